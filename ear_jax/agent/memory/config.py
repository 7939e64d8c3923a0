"""`MemoryConfig`: everything that defines a `Memory` besides its rows and its learner, checked at
construction and resolved to the `EARConfig` / `HParams` it runs (`MemoryConfig.ear`)."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np

from ear_jax.agent.memory import bank as bank_lib
from ear_jax.agent.memory import lexical_bank
from ear_jax.agent.memory import persistence
from ear_jax.agent.memory.checks import InputTypeError, check_int
from ear_jax.agent.memory.encoder_slot import EncoderSlot
from ear_jax.core import policies
from ear_jax.core.config import EARConfig, HParams, Method, default_hparams
from ear_jax.data.first_stage import FEATURES, FirstStageOptions, check_generator

MAX_WINDOW_MS = 1000.0
# The settings that say where and when, not what: an opened memory takes the caller's.
SERVING = ("cache_dir", "batch_window_ms", "batch_max_queries", "warm_learner")
# A directory stores its preset by name; `PRESET_CHANGES[v]` is what a preset meant before presets
# version v (None: refused), so `stored_config` pins older directories.
PRESETS_VERSION = 5
PRESET_CHANGES = {
    2: {"ear_safe": None},
    4: {"ear_safe": dict(num_candidates=20)},
    5: {"ear_tuned": dict(side_init=0.05), "ear_safe": dict(side_init=0.05)},
}
# The pool K of a memory whose `num_candidates` is None, by preset (`--suite=pool_tune`).
PRESET_POOL = {"ear_safe": 100}
# The learner of a memory given no `method`, `config` nor `hparams` since presets
# `DEFAULT_METHOD_SINCE` (before: the paper's defaults).
DEFAULT_METHOD = "ear_safe"
DEFAULT_METHOD_SINCE = 3


def _preset_pool(method: str, num_candidates: Optional[int]) -> dict:
  """`{"num_candidates": K}` of `PRESET_POOL` for a memory of `method` that sets no K, else {}."""
  return {"num_candidates": PRESET_POOL[method]} if (
      num_candidates is None and method in PRESET_POOL) else {}


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
  """Everything that defines a memory besides its rows and its learner (saved with both).

  `method` (a preset name, `Method.named`; `'ear'` is the paper's) is exclusive with `config` /
  `hparams`; none of them: `DEFAULT_METHOD`. `config` alone: `default_hparams()`; `hparams` alone:
  `EARConfig(dim=encoder dim or dim)`.
  """
  # 'minilm', a local Hugging Face checkpoint directory, a `.npy`/`.npz` of precomputed embeddings,
  # or None (every `add` / query passes embeddings); loaded lazily
  encoder: Optional[str] = "minilm"
  method: Optional[str] = None
  config: Optional[EARConfig] = None
  hparams: Optional[HParams] = None
  dim: Optional[int] = None  # the embedding dimension when neither `config` nor an encoder gives it
  seed: int = 0  # of the learner (adapter init, replay randomness, critic keys)
  multistore: bool = False  # candidates: top-K/2 dialogue memories + top-K/2 observations (Sec. 5)
  cache_dir: Optional[str] = None  # embedding cache root for `encoders.encode` (None: no cache)
  max_sessions: int = 4096  # open query sessions kept; beyond, the least recently used is evicted
  initial_capacity: int = 1024  # of the device bank (rounded up by `bank.capacity_for`)
  bank_dtype: str = "float32"  # or 'bfloat16', the dtype of the device bank
  index: str = "exact"  # the device search, or 'faiss_hnsw' / 'faiss_ivf' / 'faiss_pq'
  index_options: tuple = ()  # that searcher's options, sorted (key, value) pairs (or a dict)
  # K, the memories the first stage retrieves per question (>= the slate size; even with
  # `multistore`); None: the preset's pool (`PRESET_POOL`) or the method's own K
  num_candidates: Optional[int] = None
  # the first stage, 'dense' | 'bm25' | 'hybrid' (text queries; no ANN `index`); None:
  # `first_stage_name`
  candidates: Optional[str] = None
  first_stage: FirstStageOptions = FirstStageOptions()  # the hybrid fusion's options
  # milliseconds: queries arriving this close share one encoder call and one search (`batcher`);
  # 0: every call alone. A serving setting (`SERVING`: an opened memory takes the caller's)
  batch_window_ms: float = 0.0
  batch_max_queries: int = 64  # a window closes early once it holds this many queries
  warm_learner: bool = False  # compile the learner step in a background thread when built

  def __post_init__(self):
    fix = lambda name, value: object.__setattr__(self, name, value)
    if self.encoder is not None and not isinstance(self.encoder, str):
      fix("encoder", str(self.encoder) if hasattr(self.encoder, "__fspath__") else self.encoder)
      if not isinstance(self.encoder, str):
        raise InputTypeError(f"MemoryConfig.encoder must be a spec string or None, got "
                             f"{type(self.encoder).__name__} (pass an Encoder object as "
                             "Memory(encoder=...))")
    for name, minimum in (("seed", 0), ("max_sessions", 1), ("initial_capacity", 1),
                          ("batch_max_queries", 1)):
      fix(name, check_int(getattr(self, name), name, minimum))
    window = self.batch_window_ms
    if isinstance(window, bool) or not isinstance(window, (int, float, np.integer, np.floating)):
      raise InputTypeError(f"batch_window_ms must be a number of milliseconds, got "
                           f"{type(window).__name__}")
    if not 0 <= float(window) <= MAX_WINDOW_MS:
      raise ValueError(f"batch_window_ms must be in [0, {MAX_WINDOW_MS}] (milliseconds), got "
                       f"{window}")
    fix("batch_window_ms", float(window))
    for name in ("dim", "num_candidates"):
      if getattr(self, name) is not None:
        fix(name, check_int(getattr(self, name), name, 1))
    fix("multistore", bool(self.multistore))
    fix("warm_learner", bool(self.warm_learner))
    if self.cache_dir is not None:
      fix("cache_dir", str(self.cache_dir))
    opts = self.index_options
    if isinstance(opts, dict):
      opts = tuple(sorted(opts.items()))
    if not isinstance(opts, (tuple, list)) or not all(
        isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[0], str) for p in opts):
      raise InputTypeError(f"index_options must be a dict or (key, value) pairs, got "
                           f"{type(self.index_options).__name__}")
    fix("index_options", tuple(sorted((k, v) for k, v in opts)))
    for name, kind, what in (
        ("bank_dtype", str, "a string"), ("index", str, "a string"),
        ("candidates", (str, type(None)), "a string"),
        ("first_stage", FirstStageOptions, "a first_stage.FirstStageOptions"),
        ("config", (EARConfig, type(None)), "an EARConfig"),
        ("hparams", (HParams, type(None)), "an HParams")):
      if not isinstance(getattr(self, name), kind):
        raise InputTypeError(f"{name} must be {what}, got {type(getattr(self, name)).__name__}")
    if self.bank_dtype not in bank_lib.BANK_DTYPES:
      raise ValueError(f"unknown bank_dtype {self.bank_dtype!r}; expected one of "
                       f"{sorted(bank_lib.BANK_DTYPES)}")
    if self.candidates is not None:
      check_generator(self.candidates)
    if self.method is not None:
      if self.config is not None or self.hparams is not None:
        raise ValueError("pass method= (a preset with its own config and hyperparameters) or "
                         "config= / hparams=, not both")
      if not isinstance(self.method, str):
        raise InputTypeError(f"method must be a method name, got {type(self.method).__name__}")

  def to_dict(self) -> dict:
    """JSON-safe fields (`from_dict` inverts it)."""
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    d["config"] = None if self.config is None else self.config.to_dict()
    d["hparams"] = None if self.hparams is None else {
        f.name: float(getattr(self.hparams, f.name)) for f in dataclasses.fields(self.hparams)}
    d["index_options"] = dict(self.index_options)
    d["first_stage"] = dataclasses.asdict(self.first_stage)
    return d

  @classmethod
  def from_dict(cls, d: dict) -> "MemoryConfig":
    """The config of `to_dict`; ValueError naming an unknown field."""
    unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
      raise ValueError(f"unknown MemoryConfig field(s) {sorted(unknown)}")
    d = dict(d)
    if d.get("config") is not None:
      d["config"] = EARConfig.from_dict(d["config"])
    if d.get("hparams") is not None:
      d["hparams"] = default_hparams(**d["hparams"])
    if d.get("first_stage") is not None:
      fs = dict(d["first_stage"])
      features = fs.pop("features", None)  # (a removed option: 'first_stage' is what remains)
      if features not in (None, "first_stage"):
        raise ValueError(f"this memory directory was made with first_stage features="
                         f"{features!r}, side features this version no longer has: open it with "
                         "the ear_jax that made it, or make a new memory in another directory")
      d["first_stage"] = FirstStageOptions(**fs)
    return cls(**d)

  @property
  def first_stage_name(self) -> str:
    """`candidates`, or 'hybrid' with an encoder and the exact index, else 'dense'."""
    if self.candidates is not None:
      return self.candidates
    return "hybrid" if self.encoder is not None and self.index == "exact" else "dense"

  def _encoder_dim(self) -> Optional[int]:
    return 384 if self.encoder == "minilm" else None

  @property
  def ear(self) -> EARConfig:
    """The resolved `EARConfig` (its `dim`, and `side_features` set by the first stage)."""
    return self.resolved()[0]

  @property
  def learner_hparams(self) -> HParams:
    """The resolved `HParams`."""
    return self.resolved()[1]

  def resolved(self) -> tuple[EARConfig, HParams]:
    """`(EARConfig, HParams)` with the method, K, the dimension and the first stage applied."""
    config, hparams, d = self.config, self.hparams, self.dim or self._encoder_dim()
    if d is None and config is None:
      raise ValueError("the embedding dimension is unknown: pass dim= or "
                       "config=EARConfig(dim=...)")
    if self.method is not None or (config is None and hparams is None):  # (DEFAULT_METHOD)
      name = self.method or DEFAULT_METHOD
      config, hparams = Method.named(name, dim=d, **_preset_pool(name, self.num_candidates))[1:3]
    if config is None:
      config = EARConfig(dim=d)
    if self.num_candidates is not None and self.num_candidates != config.num_candidates:
      if self.num_candidates < config.slate_size:
        raise ValueError(f"num_candidates K={self.num_candidates} is smaller than the slate size "
                         f"s={config.slate_size}")
      config = dataclasses.replace(config, num_candidates=self.num_candidates)
    if self.dim is not None and self.dim != config.dim:
      raise ValueError(f"dim={self.dim} does not match config.dim={config.dim}")
    enc = self._encoder_dim()
    if enc is not None and enc != config.dim:
      raise ValueError(f"config.dim={config.dim} does not match the encoder's dimension {enc}")
    _check_honoured(config)
    if self.multistore and config.num_candidates % 2:
      raise ValueError(f"multistore needs an even num_candidates K, got {config.num_candidates}")
    f = len(FEATURES)
    if self.first_stage_name != "dense" and not config.side_features:
      config = dataclasses.replace(config, side_features=f)
    if config.side_features not in (0, f):
      raise ValueError(f"config.side_features={config.side_features}, but a memory's first stage "
                       f"gives {f} features (or 0 with candidates='dense')")
    if lexical_bank.needs_lexical(self.first_stage_name, config.side_features) and (
        self.index != "exact"):
      raise ValueError(f"index={self.index!r} cannot serve candidates="
                       f"{self.first_stage_name!r} (or side features): the lexical first stage "
                       "fuses every memory's cosine with its BM25 score; use index='exact'")
    return config, default_hparams() if hparams is None else hparams

  def _comparable(self) -> dict:
    """What two configs of one memory must agree on: everything resolved but `SERVING`."""
    d = self.to_dict()
    for name in ("method", "config", "hparams", "dim", "num_candidates") + SERVING:
      del d[name]
    d["candidates"] = self.first_stage_name
    ear, hp = self.resolved()
    return {**d, **ear.to_dict(),
            "hparams": {f.name: float(getattr(hp, f.name)) for f in dataclasses.fields(hp)}}


def _check_honoured(config: EARConfig) -> None:
  """Refuses config fields a live `Memory` cannot honour, naming the field."""
  policy = policies.train_slate_policy(config.train_slate)
  if not config.trains:
    raise ValueError("config.train_slate='none' never learns; use train_slate='explorer'")
  if policy is not None and policy is not policies.TRAIN_SLATES["explorer"]:
    raise ValueError(
        f"config.train_slate={config.train_slate!r} is not honoured by Memory: its training "
        "slates are the Explorer rounds the agent plays (recall / Session.round(explore=True)); "
        "use train_slate='explorer'")
  if config.test_rounds is not None and config.test_rounds != config.num_rounds:
    raise ValueError(
        f"config.test_rounds={config.test_rounds} is not honoured by Memory: recall plays "
        f"num_rounds={config.num_rounds} rounds, which train as one query; set test_rounds=None "
        "or equal to num_rounds")


def stored_config(meta: dict) -> MemoryConfig:
  """The `MemoryConfig` a directory's meta stores, as meant when written (`PRESET_CHANGES`)."""
  cfg = MemoryConfig.from_dict(meta["memory_config"])
  written = int(meta.get("presets", 1))
  d = cfg.dim or cfg._encoder_dim()  # pylint: disable=protected-access
  method = cfg.method
  if method is None and cfg.config is None and cfg.hparams is None:
    if written < DEFAULT_METHOD_SINCE:
      return dataclasses.replace(cfg, config=EARConfig(dim=d), hparams=default_hparams())
    method = DEFAULT_METHOD
  if method is None:
    return cfg
  over = {}
  for version in sorted(PRESET_CHANGES, reverse=True):  # (the earliest change's values win)
    if version > written:
      if method in PRESET_CHANGES[version] and PRESET_CHANGES[version][method] is None:
        raise ValueError(f"this memory directory was written with the preset {method!r} of "
                         f"presets version {written}, which this version no longer has")
      over.update(PRESET_CHANGES[version].get(method, {}))
  if not over:
    return cfg
  m = Method.named(method, dim=d, **{**_preset_pool(method, cfg.num_candidates), **over})
  return dataclasses.replace(cfg, method=None, config=m.config, hparams=m.hparams)


def opened_config(stored: MemoryConfig, cfg: Optional[MemoryConfig], settings: dict,
                  where: str) -> MemoryConfig:
  """`stored` with the caller's serving settings (`SERVING`); anything else the caller passed must
  equal it (ValueError naming `where` and the differing settings)."""
  if cfg is None and not settings:
    return stored
  wanted = dataclasses.replace(cfg or stored, **settings)
  if wanted.candidates is None:  # (not given: the directory's first stage)
    wanted = dataclasses.replace(wanted, candidates=stored.candidates)
  differ = _differences(stored, wanted)
  if differ:
    raise ValueError(
        f"the memory in {where} was made with other settings: {'; '.join(differ)}. Open it with "
        "its own settings (Memory.open(path) without these; ear-mcp-server without these "
        "flags), or make a new memory in another directory")
  return dataclasses.replace(  # (where and when, not what)
      stored, **{name: getattr(wanted, name) for name in SERVING})


def _learner_name(cfg: MemoryConfig) -> Optional[str]:
  """The preset a config's learner is, by name (None: a config / hyperparameters of its own)."""
  return (cfg.method or DEFAULT_METHOD) if cfg.config is None and cfg.hparams is None else None


def _differences(stored: MemoryConfig, wanted: MemoryConfig) -> list[str]:
  """`'<setting>: <stored> there, <wanted> asked'` of every setting two configs disagree on."""
  a, b = stored._comparable(), wanted._comparable()  # pylint: disable=protected-access
  keys = [k for k in sorted(set(a) | set(b), key=str)
          if a.get(k, "default") != b.get(k, "default")]
  show = lambda k: f"{a.get(k, 'default')!r} there, {b.get(k, 'default')!r} asked"
  learner = ({f.name for f in dataclasses.fields(EARConfig)} | {"hparams"}) - {"num_candidates"}
  out = [f"{k}: {show(k)}" for k in keys if k not in learner]
  fields = [k for k in keys if k in learner and k != "side_features"]
  names = [_learner_name(stored), _learner_name(wanted)]
  if fields and names[0] != names[1]:
    there, asked = (repr(n) if n else "a config of its own" for n in names)
    out.append(f"method: {there} there, {asked} asked")
  if fields and None in names:  # (a config of its own: which of its fields)
    out += [f"the learner's {k}: {show(k)}" for k in fields[:3]]
    out += [f"{len(fields) - 3} more of the learner's fields"] if len(fields) > 3 else []
  return out


UNSET = object()  # an argument not passed


def encoder_slot(cfg: MemoryConfig, enc, identity: Optional[str] = None) -> EncoderSlot:
  """The `EncoderSlot` of `cfg` (or of `enc`, an encoder passed on its own)."""
  return EncoderSlot(cfg.encoder if enc is UNSET else enc, identity,
                     explicit=enc is not UNSET or cfg.encoder != MemoryConfig.encoder)


def arguments(first, encoder, settings: dict) -> tuple[Optional[MemoryConfig], Any, dict]:
  """`(MemoryConfig or None, encoder or UNSET, settings)` of `Memory(...)`'s arguments."""
  fields = {f.name for f in dataclasses.fields(MemoryConfig)}
  unknown = sorted(set(settings) - fields)
  if unknown:
    raise InputTypeError(f"unknown Memory setting(s) {unknown}; the settings are MemoryConfig's "
                         f"fields {sorted(fields)}")
  if "encoder" in settings:
    raise InputTypeError("pass the encoder as Memory(encoder=...) (or MemoryConfig.encoder)")
  if isinstance(first, MemoryConfig) or first is UNSET:
    return (None if first is UNSET else first), encoder, settings
  if encoder is not UNSET:
    raise ValueError("pass the encoder once: as the first argument or as encoder=")
  return None, first, settings


def new_config(cfg: Optional[MemoryConfig], enc, settings: dict):
  """`(MemoryConfig, EncoderSlot)` of a new memory, the encoder's spec and dimension filled in."""
  cfg = cfg or MemoryConfig()
  slot = encoder_slot(cfg, enc)
  if slot.encoder is not None and cfg.dim is None and cfg.config is None and not (
      {"dim", "config"} & set(settings)):
    settings = {**settings, "dim": slot.encoder.dim}
  return dataclasses.replace(cfg, encoder=slot.spec, **settings), slot


def stored_memory_config(path) -> Optional[MemoryConfig]:
  """The `MemoryConfig` of the memory directory `path`, or None when it holds no memory yet."""
  root = persistence.checkpoint_dir(path)
  meta = persistence.read_meta(root) if root.is_dir() else None
  return None if meta is None else stored_config(meta)
