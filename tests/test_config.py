"""Configuration errors are ValueErrors naming the offending value, before anything is traced."""
import jax
import numpy as np
import optax
import pytest

from ear_jax.core import buffer

from ear_jax.core import episode
from ear_jax.core.config import EARConfig, default_hparams, stack_hparams
from ear_jax.core.stream import make_stream


@pytest.mark.parametrize("kwargs,message", [
    (dict(slate_size=21, num_candidates=20), "slate_size s=21 is larger than num_candidates K=20"),
    (dict(replay_size=0), "replay_size must be >= 1"),
    (dict(batch_size=0), "batch_size must be >= 1"),
    (dict(loss_form="pl"), "unknown loss_form='pl'"),
    (dict(replay_strategy="newest"), "unknown replay_strategy='newest'"),
    (dict(replay_unobserved="zero"), "unknown replay_unobserved='zero'"),
    (dict(optimizer="rmsprop"), "unknown optimizer='rmsprop'"),
    (dict(train_slate="beam"), "unknown train_slate='beam'"),
    (dict(adapter_rank=0), "adapter_rank"),
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
    episode.run_episode_jit(jax.random.PRNGKey(0), s, cfg, default_hparams())


def test_make_stream_names_the_bad_field():
  with pytest.raises(ValueError, match="candidates shape"):
    make_stream(np.ones((2, 4)), np.ones((3, 3, 4)))
  with pytest.raises(ValueError, match="gold must have shape"):
    make_stream(np.ones((2, 4)), np.ones((2, 3, 4)), gold=np.ones((2, 2), bool))
  with pytest.raises(ValueError, match="queries contains NaN"):
    make_stream(np.full((1, 2), np.nan), np.ones((1, 3, 2)))


def test_strategies_are_functions_named_by_their_registry():
  cfg = EARConfig.for_method("rl_update", optimizer="sgd", replay_strategy="reward")
  assert cfg == EARConfig.for_method("rl_update", optimizer=optax.sgd,
                                     replay_strategy=buffer.reward_replay)
  d = cfg.to_dict()
  assert (d["train_slate"], d["optimizer"], d["replay_strategy"]) == ("gumbel", "sgd", "reward")
  assert EARConfig.from_dict(d) == cfg
  assert EARConfig.for_method("retriever").to_dict()["train_slate"] == "none"
  assert not EARConfig.for_method("retriever").trains


def test_config_is_hashable_and_hparams_stack():
  assert hash(EARConfig()) == hash(EARConfig())
  stacked = stack_hparams([default_hparams(), default_hparams(alpha=1.0)])
  assert stacked.alpha.shape == (2,)
