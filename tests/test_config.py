"""Configuration errors are ValueErrors naming the offending value, before anything is traced."""
import jax
import numpy as np
import optax
import pytest

from ear_jax.core import buffer
from ear_jax.core import episode
from ear_jax.core import learner
from ear_jax.core import policies
from ear_jax.core.config import EARConfig, default_hparams, stack_hparams
from ear_jax.core.stream import make_stream

jit_run_episode = jax.jit(episode.run_episode, static_argnames=("config",))


@pytest.mark.parametrize("kwargs,message", [
    (dict(slate_size=21, num_candidates=20), "slate_size s=21 is larger than num_candidates K=20"),
    (dict(replay_size=0), "replay_size must be >= 1"),
    (dict(batch_size=0), "batch_size must be >= 1"),
    (dict(loss_form="pl"), "unknown loss_form='pl'"),
    (dict(replay_unobserved="zero"), "unknown replay_unobserved='zero'"),
    (dict(loss_support="shown"), "unknown loss_support='shown'"),
    (dict(optimizer="rmsprop"), "unknown optimizer='rmsprop'"),
    (dict(train_slate=3), "train_slate must be a registry name or a function"),
    (dict(guard_holdout=1), "guard_holdout must be 0"),
    (dict(replay_size=9, buffer_capacity=8), "replay_size B=9 is larger than buffer_capacity"),
    (dict(dim=2.5), "dim must be an int"),
])
def test_bad_config_raises_value_error_naming_the_value(kwargs, message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
    EARConfig(**kwargs)


def test_unknown_method_and_field():
  with pytest.raises(ValueError, match="unknown method='reinforce'"):
    EARConfig.for_method("reinforce")
  with pytest.raises(ValueError, match="slate"):
    EARConfig.for_method("ear", slate=3)


def test_bad_hparams():
  with pytest.raises(ValueError, match="unknown hyperparameter"):
    default_hparams(lr=1.0)
  with pytest.raises(ValueError, match="unknown hyperparameter"):
    default_hparams(critic_precision=0.9)  # the critic owns its parameters
  with pytest.raises(ValueError, match="tau"):
    default_hparams(tau=0.0)


def test_mismatched_stream_shapes_raise_before_tracing():
  cfg = EARConfig(dim=4, num_candidates=3, slate_size=2)
  s = make_stream(np.ones((2, 5)), np.ones((2, 3, 5)))
  with pytest.raises(ValueError, match=r"stream.queries has shape \(2, 5\), expected \(2, 4\)"):
    jit_run_episode(jax.random.PRNGKey(0), s, cfg, default_hparams())


def test_make_stream_names_the_bad_field():
  with pytest.raises(ValueError, match="candidates shape"):
    make_stream(np.ones((2, 4)), np.ones((3, 3, 4)))
  with pytest.raises(ValueError, match="gold must have shape"):
    make_stream(np.ones((2, 4)), np.ones((2, 3, 4)), gold=np.ones((2, 2), bool))
  with pytest.raises(ValueError, match="queries contains NaN"):
    make_stream(np.full((1, 2), np.nan), np.ones((1, 3, 2)))


@pytest.mark.parametrize("kwargs,message", [
    (dict(replay_strategy="newest"), "unknown replay_strategy='newest'"),
    (dict(train_slate="beam"), "unknown train_slate='beam'"),
])
def test_an_unknown_strategy_name_fails_where_it_is_resolved_before_any_step(kwargs, message):
  cfg = EARConfig(dim=4, num_candidates=3, slate_size=2, **kwargs)  # names resolve where used
  with pytest.raises(ValueError, match=message):
    learner.init_learner(jax.random.PRNGKey(0), cfg)


def test_strategies_are_names_resolved_by_the_registry_beside_them():
  cfg = EARConfig.for_method("rl_update", optimizer="sgd", replay_strategy="reward")
  assert cfg == EARConfig.for_method("rl_update", optimizer=optax.sgd, replay_strategy="reward")
  assert policies.train_slate_policy(cfg.train_slate) is policies.gumbel_slates
  assert buffer.replay_strategy(cfg.replay_strategy) is buffer.reward_replay
  d = cfg.to_dict()
  assert (d["train_slate"], d["optimizer"], d["replay_strategy"]) == ("gumbel", "sgd", "reward")
  assert EARConfig.from_dict(d) == cfg
  assert EARConfig.for_method("retriever").to_dict()["train_slate"] == "none"
  assert EARConfig(train_slate=None) == EARConfig(train_slate="none")
  assert not EARConfig.for_method("retriever").trains
  # a function passes through (and is written by `module.qualname`)
  fn_cfg = EARConfig(replay_strategy=buffer.reward_replay)
  assert buffer.replay_strategy(fn_cfg.replay_strategy) is buffer.reward_replay
  assert fn_cfg.to_dict()["replay_strategy"] == "ear_jax.core.buffer.reward_replay"


def test_a_config_written_before_strategies_were_names_loads_and_equals_todays():
  old = {"dim": 384, "num_candidates": 20, "slate_size": 5, "num_rounds": 4, "replay_size": 4,
         "buffer_capacity": 2048, "batch_size": 4, "train_slate": "explorer", "use_replay": True,
         "loss_form": "flat", "replay_strategy": "similarity", "replay_unobserved": "negative",
         "optimizer": "adam", "adapter_rank": None, "grad_clip_norm": None,
         "loss_on_tempered_logits": False}  # the `to_dict` of EARConfig() before strategy objects
  assert EARConfig.from_dict(old) == EARConfig() == EARConfig.for_method("ear")
  assert EARConfig().to_dict() == {k: v for k, v in old.items()
                                   if k not in ("adapter_rank", "grad_clip_norm")}


def test_a_stored_config_with_fields_of_earlier_versions_reads_as_the_behaviour_it_names():
  safe = EARConfig.for_method("ear_safe")
  stored = {**safe.to_dict(), "adapter_rank": None, "grad_clip_norm": None, "guard": True,
            "guard_evidence": "questions"}  # `ear_safe` as the version before wrote it
  assert EARConfig.from_dict(stored) == safe
  assert EARConfig.from_dict({**stored, "guard_half_life": 100.0, "guard_probe": False,
                              "guard_pages": "first_stage", "lr_schedule_steps": 7}) == safe
  for field, value in [("adapter_rank", 32), ("grad_clip_norm", 1.0), ("label_weights", "balanced"),
                       ("weight_decay", 1.0), ("lr_schedule", "rsqrt"), ("guard_probe", True),
                       ("guard_pages", "shuffled"), ("guard_evidence", "items")]:
    with pytest.raises(ValueError, match=f"stored EARConfig field {field}="):
      EARConfig.from_dict({**stored, field: value})
  with pytest.raises(ValueError, match="guard_evidence='items'"):  # (its default then)
    EARConfig.from_dict({k: v for k, v in stored.items() if k != "guard_evidence"})
  prequential = {**EARConfig.for_method("ear_tuned").to_dict(), "guard": True}
  with pytest.raises(ValueError, match="stored EARConfig field guard=True"):
    EARConfig.from_dict(prequential)
  with pytest.raises(ValueError, match="unknown EARConfig field"):
    EARConfig.for_method("ear", adapter_rank=None)  # (retired fields are read, not taken)


def test_config_is_hashable_and_hparams_stack():
  assert hash(EARConfig()) == hash(EARConfig())
  stacked = stack_hparams([default_hparams(), default_hparams(alpha=1.0)])
  assert stacked.alpha.shape == (2,)


def test_a_method_carries_its_own_hyperparameters_with_its_config():
  from ear_jax.core.config import METHOD_HPARAMS, Method  # pylint: disable=import-outside-toplevel
  tuned = Method.named("ear_tuned", dim=8, num_candidates=4, slate_size=2)
  assert tuned.config == EARConfig.for_method("ear_tuned", dim=8, num_candidates=4, slate_size=2)
  want_lr = METHOD_HPARAMS["ear_tuned"]["learning_rate"]
  assert np.isclose(float(tuned.hparams.learning_rate), want_lr)
  assert float(tuned.hparams.learning_rate) != float(default_hparams().learning_rate)
  paper = Method.named("ear", hparams={"alpha": 0.7})
  assert float(paper.hparams.learning_rate) == float(default_hparams().learning_rate)
  assert float(paper.hparams.alpha) == np.float32(0.7) and paper.critic is None
  with pytest.raises(ValueError, match="unknown hyperparameter"):
    Method.named("ear", hparams={"lr": 1.0})
  with pytest.raises(ValueError, match="unknown method='reinforce'"):
    Method.named("reinforce")


def test_the_default_first_stage_is_hybrid_with_an_encoder_and_dense_without():
  from ear_jax.agent.memory import Memory, MemoryConfig  # pylint: disable=import-outside-toplevel
  assert MemoryConfig().first_stage_name == "hybrid"  # (MiniLM by default)
  assert MemoryConfig(encoder=None, dim=8).first_stage_name == "dense"
  assert MemoryConfig(index="faiss_hnsw").first_stage_name == "dense"
  assert MemoryConfig(encoder=None, dim=8, candidates="bm25").first_stage_name == "bm25"


def test_the_default_learner_is_ear_safe_and_one_of_config_hparams_keeps_the_papers_other():
  import dataclasses  # pylint: disable=import-outside-toplevel
  from ear_jax.agent.memory import MemoryConfig  # pylint: disable=import-outside-toplevel
  from ear_jax.agent.memory import config as mconfig  # pylint: disable=import-outside-toplevel
  from ear_jax.core.config import Method  # pylint: disable=import-outside-toplevel
  safe = Method.named(mconfig.DEFAULT_METHOD, dim=8)
  default = MemoryConfig(encoder=None, dim=8)
  assert mconfig.DEFAULT_METHOD == "ear_safe" and default.method is None
  pool = mconfig.PRESET_POOL["ear_safe"]  # (the default preset's candidate pool K)
  assert pool == 100 and default.ear.num_candidates == pool and safe.config.num_candidates == 20
  assert default.ear == dataclasses.replace(safe.config, num_candidates=pool)
  assert default.ear.guard and default.ear.guard_holdout == 5
  assert MemoryConfig(encoder=None, dim=8, num_candidates=30).ear.num_candidates == 30
  assert float(default.learner_hparams.learning_rate) == float(safe.hparams.learning_rate)
  assert MemoryConfig(encoder=None, method="ear", dim=8).ear == EARConfig(dim=8)  # (the paper's)
  only_config = MemoryConfig(encoder=None, config=EARConfig(dim=8, slate_size=3))
  assert float(only_config.learner_hparams.learning_rate) == float(
      default_hparams().learning_rate)
  only_hparams = MemoryConfig(encoder=None, dim=8, hparams=default_hparams(alpha=0.25))
  assert only_hparams.ear == EARConfig(dim=8)
  assert float(only_hparams.learner_hparams.alpha) == np.float32(0.25)


def test_a_directory_of_the_earlier_default_learner_opens_as_it_was_created(tmp_path, monkeypatch):
  # Written before presets 3 (meta `presets` 2): no method / config / hparams meant the paper's
  # `EARConfig(dim=d)` + `default_hparams()`. Opened now, the directory keeps them (pinned as a
  # config, also once saved again), its learner loads, and a new default memory is `ear_safe`.
  import dataclasses  # pylint: disable=import-outside-toplevel
  from ear_jax.agent.memory import Memory, MemoryConfig  # pylint: disable=import-outside-toplevel
  from ear_jax.agent.memory import config as mconfig  # pylint: disable=import-outside-toplevel
  from ear_jax.agent.memory import persistence  # pylint: disable=import-outside-toplevel
  default = MemoryConfig(encoder=None, dim=8)
  with monkeypatch.context() as mp:
    mp.setattr(mconfig, "DEFAULT_METHOD", "ear")  # (the paper's config and hyperparameters)
    mp.setattr(mconfig, "PRESETS_VERSION", 2)
    m = Memory.open(tmp_path / "old", default)
    m.add(["a", "b", "c"], embeddings=np.eye(3, 8))
    assert m.config.ear == EARConfig(dim=8) and m.learner.guard is None
    m.close()
  meta = persistence.read_meta(tmp_path / "old")
  assert meta["presets"] == 2 and meta["memory_config"]["method"] is None
  assert meta["memory_config"]["config"] is None and meta["memory_config"]["hparams"] is None
  paper = default_hparams()
  for _ in range(2):  # (opened, saved under today's presets, opened again)
    with Memory.open(tmp_path / "old") as back:
      assert back.config.ear == EARConfig(dim=8) and back.learner.guard is None
      assert {f.name: float(getattr(back.config.learner_hparams, f.name))
              for f in dataclasses.fields(paper)} == {
                  f.name: float(getattr(paper, f.name)) for f in dataclasses.fields(paper)}
      assert len(back.list()) == 3
      back.save()
  assert persistence.read_meta(tmp_path / "old")["presets"] == mconfig.PRESETS_VERSION
  with pytest.raises(ValueError, match="guard"):  # today's default differs: named
    Memory.open(tmp_path / "old", default)
  Memory.open(tmp_path / "old", MemoryConfig(encoder=None, method="ear", dim=8)).close()
  with Memory.open(tmp_path / "new", default) as new:
    assert new.config.ear.guard_holdout == 5 and new.learner.guard is not None
  with Memory.open(tmp_path / "new") as again:  # (written under presets 3: still the default)
    assert again.config.method is None and again.config.ear.guard_holdout == 5


def test_a_default_directory_of_presets_3_keeps_its_k_of_20(tmp_path, monkeypatch):
  # Written before presets 4 the default learner ('ear_safe') retrieved K = 20 candidates; opened
  # now (also by a program passing the directory's own settings) it keeps them, and a new
  # default memory retrieves `PRESET_POOL`'s K.
  from ear_jax.agent.memory import Memory, MemoryConfig  # pylint: disable=import-outside-toplevel
  from ear_jax.agent.memory import config as mconfig  # pylint: disable=import-outside-toplevel
  default = MemoryConfig(encoder=None, dim=8)
  with monkeypatch.context() as mp:
    mp.setattr(mconfig, "PRESET_POOL", {})
    mp.setattr(mconfig, "PRESETS_VERSION", 3)
    Memory.open(tmp_path / "old", default).close()
  stored = mconfig.stored_memory_config(tmp_path / "old")
  assert stored.ear.num_candidates == 20 and stored.ear.guard_holdout == 5
  with Memory.open(tmp_path / "old") as back:
    assert back.config.ear.num_candidates == 20
  with Memory.open(tmp_path / "new", default) as new:
    assert new.config.ear.num_candidates == 100


def test_a_directory_of_presets_4_keeps_its_side_init_of_0_05(tmp_path, monkeypatch):
  # Written before presets 5 `ear_tuned` and `ear_safe` started the first stage's weight at 0.05;
  # opened now they keep it (with the K they were written with), and a new memory starts at 0.25.
  from ear_jax.agent.memory import Memory, MemoryConfig  # pylint: disable=import-outside-toplevel
  from ear_jax.agent.memory import config as mconfig  # pylint: disable=import-outside-toplevel
  settings = dict(encoder=None, dim=8, candidates="bm25")
  with monkeypatch.context() as mp:
    mp.setattr(mconfig, "PRESETS_VERSION", 4)
    for method in ("ear_tuned", "ear_safe"):
      Memory.open(tmp_path / method, MemoryConfig(method=method, **settings)).close()
  for method, k in (("ear_tuned", 20), ("ear_safe", 100)):
    stored = mconfig.stored_memory_config(tmp_path / method)
    assert stored.ear.side_init == 0.05 and stored.ear.num_candidates == k
    with Memory.open(tmp_path / method) as back:
      assert back.config.ear.side_init == 0.05
    with Memory.open(tmp_path / f"new_{method}", MemoryConfig(method=method, **settings)) as new:
      assert new.config.ear.side_init == 0.25 and new.config.ear.num_candidates == k


def test_a_directory_of_the_removed_context_features_is_refused_by_name(tmp_path, monkeypatch):
  # Until `features='context'` was removed, a directory stored `first_stage.features` when it was
  # 'context' (none for 'first_stage'). One storing 'first_stage' opens as today's; 'context' is
  # refused, naming it.
  import dataclasses  # pylint: disable=import-outside-toplevel
  from ear_jax.agent.memory import Memory, MemoryConfig  # pylint: disable=import-outside-toplevel
  from ear_jax.data.first_stage import FirstStageOptions  # pylint: disable=import-outside-toplevel
  to_dict = MemoryConfig.to_dict
  for features in ("first_stage", "context"):
    with monkeypatch.context() as mp:
      mp.setattr(MemoryConfig, "to_dict", lambda self, f=features: {
          **to_dict(self), "first_stage": {**dataclasses.asdict(self.first_stage), "features": f}})
      Memory.open(tmp_path / features, MemoryConfig(encoder=None, dim=8)).close()
  assert "features" not in MemoryConfig().to_dict()["first_stage"]
  with Memory.open(tmp_path / "first_stage") as back:
    assert back.config.first_stage == FirstStageOptions()
  with pytest.raises(ValueError, match="features='context'.*no longer has"):
    Memory.open(tmp_path / "context")


@pytest.mark.slow  # (two memory directories: seconds)
def test_a_directory_keeps_its_first_stage_when_opened_without_one(tmp_path):
  from ear_jax.agent.memory import Memory, MemoryConfig  # pylint: disable=import-outside-toplevel
  m = Memory.open(tmp_path / "m", MemoryConfig(candidates="dense"))  # (MiniLM, loaded lazily)
  m.close()
  again = Memory.open(tmp_path / "m", MemoryConfig())
  assert again.config.first_stage_name == "dense"
  again.close()
  new = Memory.open(tmp_path / "n", MemoryConfig())
  assert new.config.first_stage_name == "hybrid"
  new.close()
