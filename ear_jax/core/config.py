"""Static configuration (shapes and switches) and continuous hyperparameters.

`EARConfig` is frozen and hashable, a static argument of jitted functions; `HParams` holds array
leaves, so a sweep is a `jax.vmap`, not a recompile.

Symbols: `d` embedding dimension, `K` candidates per query, `s` slate size, `T` exploration rounds,
`B` replayed experiences per query, `C` buffer capacity.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Union

import flax
import jax
import jax.numpy as jnp
import optax

from ear_jax.core.types import Critic, Optimizer, ReplayStrategy, TrainSlatePolicy

LOSS_FORMS = ("flat", "sequential")
REPLAY_UNOBSERVED = ("negative", "ignore")
LOSS_SUPPORTS = ("all", "labelled", "window", "auto")
FINAL_SLATES = ("round_T", "exploit")
# Optax aliases `learning_rate -> optax.GradientTransformation` (the rate is injected per step).
OPTIMIZERS = {
    "adam": optax.adam,
    "sgd": optax.sgd,
}
# Fields naming a behaviour (or holding its function), resolved where used by their registries.
STRATEGY_FIELDS = ("train_slate", "replay_strategy", "optimizer")

# Methods of Tables 2-3 as presets of the switches below.
METHODS = {
    # Only Retriever: no training; test = frozen cosine top-s (the adapter is the identity).
    "retriever": dict(train_slate="none", use_replay=False),
    # Reranker + RL update (Tan et al. 2025, RMM): one Gumbel-sampled slate, REINFORCE on z/tau.
    "rl_update": dict(train_slate="gumbel", use_replay=False, loss_on_tempered_logits=True),
    # EAR: Explorer (T rounds) + experience replay.
    "ear": dict(train_slate="explorer", use_replay=True),
    # Table 3: "+ Only Explorer during training" (no replay).
    "ear_no_replay": dict(train_slate="explorer", use_replay=False),
    # Table 3: "+ Only Experience Buffer during training": adapter top-s slate, one critic call.
    "ear_no_explorer": dict(train_slate="adapter", use_replay=True),
    # Beyond the paper: switches chosen by `--suite=tune`, `side_init_tune` and `pool_tune`.
    "ear_tuned": dict(train_slate="explorer", use_replay=True, replay_strategy="random",
                      replay_size=8, final_slate="exploit", test_rounds=4, side_init=0.25,
                      loss_support="auto"),
}
# `ear_safe`: `ear_tuned` with the guard (`ear_jax.core.guard`).
METHODS["ear_safe"] = dict(METHODS["ear_tuned"], guard_holdout=5, guard_z=0.25)
# Hyperparameters of a method where they differ from the paper's (`hparams_for_method`).
METHOD_HPARAMS = {
    "ear_tuned": dict(learning_rate=1e-4, baseline=0.0, tau=0.25),
}
METHOD_HPARAMS["ear_safe"] = METHOD_HPARAMS["ear_tuned"]


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _check_choice(name, value, choices):
  if value not in choices:
    raise ValueError(f"unknown {name}={value!r}; expected one of {choices}")


def resolve_strategy(field: str, value, registry: dict):
  """A strategy field's value -> its function: a name is looked up in `registry`, a function passes.

  Raises:
    ValueError: naming the field and the registry's names, for an unknown name.
  """
  if isinstance(value, str):
    if value not in registry:
      raise ValueError(f"unknown {field}={value!r}; expected one of {tuple(registry)} or a "
                       "function")
    return registry[value]
  if value is None and "none" in registry:
    return None
  if not callable(value):
    raise ValueError(f"{field} must be a name in {tuple(registry)} or a function, got {value!r}")
  return value


def optimizer_fn(config: "EARConfig") -> Optimizer:
  """The optax alias of `config.optimizer` (a name in `OPTIMIZERS`, or the alias itself)."""
  return resolve_strategy("optimizer", config.optimizer, OPTIMIZERS)


def _strategy_name(value) -> str:
  """A strategy field for `to_dict`: its name (`module.qualname` for a function)."""
  if isinstance(value, str):
    return value
  return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', repr(value))}"


@dataclasses.dataclass(frozen=True)
class EARConfig:
  """Shapes and discrete switches of an EAR learner (static under `jit`).

  Attributes:
    dim: `d`, embedding dimension.
    num_candidates: `K`, candidates per query (Eq. (1)); 20 in the paper.
    slate_size: `s`, memories per slate; 5 in the paper.
    num_rounds: `T`, Explorer rounds per query (Alg. 2); 4 in the paper.
    replay_size: `B`, replayed experiences per query (Eq. (15)); 4 in the paper.
    buffer_capacity: `C`, ring-buffer capacity (Eq. (13)-(14)); the oldest is overwritten.
    batch_size: training queries per optimizer step (Appendix A.1: 4).
    train_slate: 'explorer', 'adapter', 'gumbel' or 'none' / None (`core.policies`), or a function.
    use_replay: add the replay loss of Eq. (16).
    loss_form: 'flat' (Alg. 3 line 7) or 'sequential' (Plackett-Luce, Section 3.4).
    replay_strategy: 'similarity' (Eq. (15)), 'reward' or 'random' (Table 7), or a function.
    replay_unobserved: 'negative' (Eq. (20): never-chosen items get -1) or 'ignore' (left out).
    optimizer: 'adam' (default) or 'sgd' (`OPTIMIZERS`), or an optax alias `learning_rate -> ...`.
    loss_on_tempered_logits: the REINFORCE loss uses log softmax(z / tau) (RMM), not softmax(z).
    loss_support: Eq. (10)'s softmax support, 'all' (the paper), 'labelled', 'window' or 'auto'.
    final_slate: 'round_T' (the paper) or 'exploit' (`core.explorer.exploit_slate`) at test.
    test_rounds: `T` at test (explorer-assisted inference); None: `num_rounds`.
    side_features: `F` first-stage features per candidate row `[emb (d) | features (F)]`, 0 = off
      (the paper); feature 0 the first stage's score, feature 1 the dense cosine.
    side_init: the initial weight of feature 0 (the untrained adapter ranks as the first stage).
    guard_z: the guard's confidence: the adapted ranking is served when mean(d) - guard_z * se > 0.
    guard_min_queries: held-out queries with a citation needed before the adapter may be served.
    guard_holdout: n >= 2 holds every n-th training query out for the guard (`core.guard`; 0 =
      off, the paper): the first stage is served unless the adapter beats it on those.
    guard_holdout_capacity: `H`, the held-out queries the ring keeps (the newest).
  """
  dim: int = 384
  num_candidates: int = 20
  slate_size: int = 5
  num_rounds: int = 4
  replay_size: int = 4
  buffer_capacity: int = 2048
  batch_size: int = 4
  train_slate: Union[str, TrainSlatePolicy, None] = "explorer"
  use_replay: bool = True
  loss_form: str = "flat"
  replay_strategy: Union[str, ReplayStrategy] = "similarity"
  replay_unobserved: str = "negative"
  optimizer: Union[str, Optimizer] = "adam"
  loss_on_tempered_logits: bool = False
  loss_support: str = "all"
  # Beyond the paper; left out of `to_dict` at their (the paper's) defaults.
  final_slate: str = "round_T"
  test_rounds: Optional[int] = None
  side_features: int = 0
  side_init: float = 0.5  # chosen for `ear` by `--suite=first_stage_tune` (LoCoMo validation)
  guard_z: float = 0.5
  guard_min_queries: int = 50
  guard_holdout: int = 0
  guard_holdout_capacity: int = 256

  def __post_init__(self):
    # Strategies stay names (None is 'none', a registered alias its name): equal choices hash equal.
    if self.train_slate is None:
      object.__setattr__(self, "train_slate", "none")
    for name in ("train_slate", "replay_strategy"):
      value = getattr(self, name)
      if not (isinstance(value, str) and value) and not callable(value):
        raise ValueError(f"{name} must be a registry name or a function, got {value!r}")
    resolve_strategy("optimizer", self.optimizer, OPTIMIZERS)
    for key, fn in OPTIMIZERS.items():
      if self.optimizer is fn:
        object.__setattr__(self, "optimizer", key)
    for name in ("dim", "num_candidates", "slate_size", "num_rounds", "replay_size",
                 "buffer_capacity", "batch_size", "guard_min_queries", "guard_holdout_capacity"):
      value = getattr(self, name)
      if not _is_int(value):
        raise ValueError(f"{name} must be an int, got {value!r}")
      if value < 1:
        raise ValueError(f"{name} must be >= 1, got {name}={value}")
    for what, value in (("replay_size B", self.replay_size), ("batch_size", self.batch_size)):
      if value > self.buffer_capacity:
        raise ValueError(f"{what}={value} is larger than buffer_capacity C={self.buffer_capacity}")
    if self.slate_size > self.num_candidates:
      raise ValueError(
          f"slate_size s={self.slate_size} is larger than num_candidates K={self.num_candidates}")
    for name, choices in (("loss_form", LOSS_FORMS), ("replay_unobserved", REPLAY_UNOBSERVED),
                          ("loss_support", LOSS_SUPPORTS), ("final_slate", FINAL_SLATES)):
      _check_choice(name, getattr(self, name), choices)
    if self.test_rounds is not None and not (_is_int(self.test_rounds) and self.test_rounds >= 1):
      raise ValueError(f"test_rounds must be None or an int >= 1, got {self.test_rounds!r}")
    if not (_is_int(self.side_features) and (self.side_features == 0 or self.side_features >= 2)):
      raise ValueError("side_features must be 0 (off) or an int >= 2 (feature 0: the first "
                       f"stage's score, feature 1: the dense cosine), got {self.side_features!r}")
    for name in ("side_init", "guard_z"):
      value = getattr(self, name)
      if not (_is_int(value) or isinstance(value, float)) or not value >= 0:
        raise ValueError(f"{name} must be a float >= 0, got {value!r}")
    if not (_is_int(self.guard_holdout) and (self.guard_holdout == 0 or self.guard_holdout >= 2)):
      raise ValueError("guard_holdout must be 0 (off) or an int >= 2 (every n-th training query "
                       f"held out), got {self.guard_holdout!r}")

  @property
  def trains(self) -> bool:
    return self.train_slate != "none"

  @property
  def loss_window(self) -> int:
    """`T s`: the first stage's candidates a query's training rounds can show (`loss_support`)."""
    return self.num_rounds * self.slate_size

  @property
  def guard(self) -> bool:
    """Whether the guard is on (`guard_holdout` > 0)."""
    return self.guard_holdout > 0

  @property
  def eval_rounds(self) -> int:
    """`T` of explorer-assisted inference: `test_rounds`, else `num_rounds`."""
    return self.num_rounds if self.test_rounds is None else self.test_rounds

  def to_dict(self) -> dict:
    """JSON-able fields, strategies by name; fields beyond the paper only when not default."""
    d = dataclasses.asdict(self)
    for name in STRATEGY_FIELDS:
      d[name] = _strategy_name(getattr(self, name))
    for name, default in _OPTIONAL_DEFAULTS.items():
      if d[name] == default:
        del d[name]
    return d

  @classmethod
  def from_dict(cls, d: dict) -> "EARConfig":
    """Inverse of `to_dict`; a retired field (`_RETIRED`) is read only at this version's value.

    Raises:
      ValueError: for an unknown field, or a retired one at another value.
    """
    d = dict(d)
    retired = {k: d.pop(k) for k in list(d) if k in _RETIRED}
    held = bool(d.get("guard_holdout", 0))
    if "guard" in retired:  # (a guarded config stored its evidence unit when not 'items')
      retired.setdefault("guard_evidence", "items")
    have = {**_RETIRED, "guard": held, "guard_evidence": "questions" if held else "items"}
    for name, value in retired.items():
      if have[name] is not _ANY and value != have[name]:
        raise ValueError(f"stored EARConfig field {name}={value!r} is an option this version no "
                         f"longer has (only {name}={have[name]!r} is read)")
    return cls(**d)

  @classmethod
  def for_method(cls, method: str, **overrides) -> "EARConfig":
    """The config of a named method of Tables 2-3, with `overrides` applied on top.

    Args:
      method: one of `METHODS`.
      **overrides: any `EARConfig` field.

    Raises:
      ValueError: for an unknown method or field.
    """
    if method not in METHODS:
      raise ValueError(f"unknown method={method!r}; expected one of {tuple(METHODS)}")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(overrides) - fields
    if unknown:
      raise ValueError(f"unknown EARConfig field(s) {sorted(unknown)}")
    return cls(**{**METHODS[method], **overrides})


_OPTIONAL_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EARConfig)
                      if f.name in ("loss_support", "final_slate", "test_rounds", "side_features",
                                    "side_init", "guard_z", "guard_min_queries", "guard_holdout",
                                    "guard_holdout_capacity")}
_ANY = object()
# Retired fields -> the value whose behaviour this version has (`_ANY`: acted only with another).
_RETIRED = {"adapter_rank": None, "grad_clip_norm": None, "label_weights": "none",
            "lr_schedule": "constant", "lr_schedule_steps": _ANY, "weight_decay": 0.0,
            "weight_decay_target": _ANY, "guard": False, "guard_probe": False,
            "guard_evidence": "items", "guard_half_life": _ANY, "guard_pages": "first_stage"}


@flax.struct.dataclass
class HParams:
  """Continuous hyperparameters (array leaves: a sweep is a `vmap`); defaults: Appendix A."""
  lambda_rel: jax.Array  # [] float32, Eq. (7) relevance weight
  lambda_div: jax.Array  # [] float32, Eq. (7) redundancy weight
  lambda_exp: jax.Array  # [] float32, Eq. (7) UCB weight
  alpha: jax.Array  # [] float32, Eq. (5) exploration strength
  baseline: jax.Array  # [] float32, b of Eq. (10)
  tau: jax.Array  # [] float32, Gumbel temperature of Eq. (19)
  lambda_rep: jax.Array  # [] float32, Eq. (17)
  learning_rate: jax.Array  # [] float32, eta of Eq. (18)


# The paper's values (Appendix A, A.1): the one place they are written down.
HPARAM_DEFAULTS = dict(lambda_rel=0.4, lambda_div=0.3, lambda_exp=0.3, alpha=0.5, baseline=0.5,
                       tau=0.5, lambda_rep=1.0, learning_rate=1e-3)


def default_hparams(*, dtype=jnp.float32, **overrides) -> HParams:
  """`HParams` of float `dtype`: the paper's values, then `overrides` (scalars or sweep arrays)."""
  unknown = set(overrides) - set(HPARAM_DEFAULTS)
  if unknown:
    raise ValueError(f"unknown hyperparameter(s) {sorted(unknown)}; "
                     f"expected some of {sorted(HPARAM_DEFAULTS)}")
  values = {**HPARAM_DEFAULTS, **overrides}
  if jnp.any(jnp.asarray(values["tau"]) <= 0):
    raise ValueError(f"tau must be > 0, got {values['tau']!r}")
  return HParams(**{k: jnp.asarray(v, dtype) for k, v in values.items()})


def stack_hparams(hparams_list) -> HParams:
  """Stacks `HParams` along a new leading axis (for `vmap` sweeps)."""
  return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *hparams_list)


def hparams_for_method(method: str, *, dtype=jnp.float32, **overrides) -> HParams:
  """`default_hparams` of `dtype` with the method's own values (`METHOD_HPARAMS`), then `overrides`.

  Raises:
    ValueError: for an unknown method or hyperparameter.
  """
  if method not in METHODS:
    raise ValueError(f"unknown method={method!r}; expected one of {tuple(METHODS)}")
  return default_hparams(dtype=dtype, **{**METHOD_HPARAMS.get(method, {}), **overrides})


class Method(NamedTuple):
  """A method as one object: its static config, its hyperparameters and its critic."""
  name: str  # the preset's name in `METHODS`
  config: EARConfig  # static: shapes and switches
  hparams: HParams  # array leaves: the preset's hyperparameters
  critic: Optional[Critic] = None  # None: the paper's simulated critic (Appendix A.2)

  @classmethod
  def named(cls, name: str, *, hparams: Optional[dict] = None, critic: Optional[Critic] = None,
            dtype=jnp.float32, **config_overrides) -> "Method":
    """The method `name` of `METHODS`, with overrides applied on top of its own values.

    Args:
      name: one of `METHODS`.
      hparams: hyperparameter overrides (`default_hparams` keywords) on top of the method's own.
      critic: the critic (None: the paper's simulated critic).
      dtype: the hyperparameters' float dtype.
      **config_overrides: `EARConfig` fields on top of the preset's.

    Raises:
      ValueError: for an unknown method, field or hyperparameter.
    """
    config = EARConfig.for_method(name, **config_overrides)
    return cls(name=name, config=config,
               hparams=hparams_for_method(name, dtype=dtype, **(hparams or {})), critic=critic)
