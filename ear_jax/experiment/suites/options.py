"""`Options`: everything a suite run needs, as one dataclass (no flags are read here)."""
from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass
class Options:
  """Everything a suite needs; built from flags by experiments/run.py (or directly in tests)."""
  benchmark: str = "synthetic"  # locomo | longmemeval | jsonl | synthetic
  data_dir: Optional[str] = None
  jsonl: Optional[str] = None
  encoder: str = "minilm"
  cache_dir: Optional[str] = None
  limit: Optional[int] = None
  k: int = 20
  # A name in `first_stage.GENERATORS`; side features default to on for all but 'dense'.
  candidates: str = "dense"
  side_features: Optional[bool] = None
  fusion: Optional[str] = None  # hybrid: 'rrf' | 'weighted' (None: FirstStageOptions' default)
  lexical_weight: Optional[float] = None  # hybrid 'weighted': the BM25 share
  seeds: int = 10
  workdir: str = "runs/default"
  suite: Optional[str] = None
  method: str = "ear"
  checkpoint_every: Optional[int] = None  # training checkpoints only when asked for
  resume: bool = False
  eval_every: int = 64
  stop_after_chunks: Optional[int] = None
  progress: bool = True
  config_overrides: dict = dataclasses.field(default_factory=dict)
  hparam_overrides: dict = dataclasses.field(default_factory=dict)
  critic_overrides: dict = dataclasses.field(default_factory=dict)  # simulated critic p / r
  # The critic of every trained run: 'simulated' or 'answer' (gold answers, `ANSWER_DEFAULTS`).
  critic: str = "simulated"
  synthetic_queries: int = 500
  synthetic_dim: int = 32
  noise_levels: tuple = (0.7, 0.8, 0.9, 1.0)
  qa: dict = dataclasses.field(default_factory=dict)  # --suite=qa: `suites.qa.QASettings` fields
  command: str = ""

  @property
  def use_side_features(self) -> bool:
    return self.candidates != "dense" if self.side_features is None else bool(self.side_features)

  def first_stage_options(self):
    """The first stage's `FirstStageOptions` (defaults where the option is None)."""
    from ear_jax.data import first_stage  # pylint: disable=g-import-not-at-top
    return first_stage.FirstStageOptions.with_defaults(self.fusion, self.lexical_weight)
