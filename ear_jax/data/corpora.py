"""Loading a benchmark corpus by name: the loader registry, the data directory, the query split.

`load_corpus(name)` dispatches through `REGISTRY`; a benchmark is one loader function
(`load(path, *, limit) -> Corpus`) and one registry line. Names: a registered name (its file in
the data directory), `"<name>:<path>"`, or a path (`*.jsonl`: the user JSONL format; a
`.json[.gz]` whose name starts with a registered name: that loader).

Data directory: the argument, else `$EAR_DATA_DIR`, else `~/.cache/ear_jax/data`.
Split (Section 4.4): `split_indices(n, seed)`.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Callable

import numpy as np

from ear_jax.data import corpus as corpus_lib
from ear_jax.data import jsonl
from ear_jax.data import locomo
from ear_jax.data import longmemeval
from ear_jax.data import sources

# Re-exported: callers (ear_jax/__init__.py, experiments, tests) import these from here.
from ear_jax.data.corpus import STORE_DIALOGUE
from ear_jax.data.jsonl import load_jsonl
from ear_jax.data.locomo import load_locomo, normalize_evidence
from ear_jax.data.longmemeval import load_longmemeval

__all__ = ["STORE_DIALOGUE", "load_jsonl", "load_locomo", "normalize_evidence", "load_longmemeval",
           "CorpusLoader", "REGISTRY", "resolve_data_dir", "find_benchmark_file", "load_corpus",
           "split_indices"]


@dataclasses.dataclass(frozen=True)
class CorpusLoader:
  """A registered benchmark format."""
  load: Callable[..., corpus_lib.Corpus]  # load(path, *, limit=None) -> Corpus
  files: tuple[str, ...] = ()  # file names looked up in the data directory, first found wins


REGISTRY: dict[str, CorpusLoader] = {
    "locomo": CorpusLoader(locomo.load_locomo, locomo.FILES),
    "longmemeval": CorpusLoader(longmemeval.load_longmemeval, longmemeval.FILES),
    "jsonl": CorpusLoader(jsonl.load_jsonl),  # a user file: always given as a path
}


def resolve_data_dir(data_dir=None) -> pathlib.Path:
  """`data_dir`, else `$EAR_DATA_DIR`, else the user cache dir `~/.cache/ear_jax/data`."""
  if data_dir:
    return pathlib.Path(data_dir).expanduser()
  if os.environ.get("EAR_DATA_DIR"):
    return pathlib.Path(os.environ["EAR_DATA_DIR"]).expanduser()
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "ear_jax" / "data"


def find_benchmark_file(name: str, data_dir=None) -> pathlib.Path:
  """The file of registered benchmark `name` ('locomo' | 'longmemeval') in the data directory.

  Raises:
    ValueError: `name` is not a registered benchmark read from the data directory.
    FileNotFoundError: saying which file to put where.
  """
  entry = REGISTRY.get(name)
  if entry is None or not entry.files:
    known = sorted(n for n, e in REGISTRY.items() if e.files)
    raise ValueError(f"unknown benchmark {name!r}; expected one of {known}")
  d = resolve_data_dir(data_dir)
  for n in entry.files:
    if (d / n).is_file():
      return d / n
  raise FileNotFoundError(sources.missing_file_message(name, d, entry.files))


def load_corpus(name: str, *, data_dir=None, limit: int | None = None) -> corpus_lib.Corpus:
  """Loads a benchmark corpus by name or path (module docstring).

  Args:
    name: a registered name, `"<name>:<path>"`, or a path to a `.jsonl` / `.json[.gz]` file.
    data_dir: where registered benchmarks' files are found (see `resolve_data_dir`).
    limit: passed to the loader (first conversations / questions / queries).

  Raises:
    ValueError: an unknown name, or malformed input (naming the file and the field).
    FileNotFoundError: a missing file (saying what to put where).
  """
  if name in REGISTRY:
    if not REGISTRY[name].files:
      raise ValueError(f"benchmark {name!r} is a user file: pass '{name}:<path>'")
    return REGISTRY[name].load(find_benchmark_file(name, data_dir), limit=limit)
  prefix, sep, rest = name.partition(":")
  if sep and prefix in REGISTRY and rest:
    return REGISTRY[prefix].load(pathlib.Path(rest).expanduser(), limit=limit)
  path = pathlib.Path(name).expanduser()
  if path.suffix == ".jsonl":
    return REGISTRY["jsonl"].load(path, limit=limit)
  if path.suffix in (".json", ".gz"):
    for key, entry in REGISTRY.items():
      if path.name.startswith(key):
        return entry.load(path, limit=limit)
  raise ValueError(f"unknown benchmark {name!r}: expected one of {sorted(REGISTRY)} (or "
                   "'synthetic'), '<name>:<path>', or a path to a .jsonl file")


def split_indices(num_queries: int, seed: int, train_fraction: float = 0.8
                  ) -> tuple[np.ndarray, np.ndarray]:
  """The 80/20 query split of Section 4.4: `np.random.default_rng(seed).permutation(N)`.

  Returns:
    (`train_idx`, `test_idx`) int64; the first `floor(train_fraction * N)` are the training stream,
    in stream order.
  """
  if not 0.0 <= train_fraction <= 1.0:
    raise ValueError(f"train_fraction must be in [0, 1], got {train_fraction}")
  perm = np.random.default_rng(seed).permutation(num_queries)
  n_train = int(np.floor(train_fraction * num_queries + 1e-9))
  return perm[:n_train].astype(np.int64), perm[n_train:].astype(np.int64)
