"""Where the official benchmark files come from, and what to tell a user whose file is missing.

* LoCoMo: `locomo10.json` from github.com/snap-research/LoCoMo (CC BY-NC 4.0, non-commercial),
  pinned to the sha256 of commit 3eb6f2c5.
* LongMemEval_S: `longmemeval_s_cleaned.json` from the Hugging Face dataset
  xiaowu0162/longmemeval-cleaned, else `longmemeval_s.json` from xiaowu0162/longmemeval (MIT).

Fetching is `ear_jax.data.download`; finding a file in the data directory is
`ear_jax.data.corpora.find_benchmark_file`, whose error message is `missing_file_message`.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Sequence


@dataclasses.dataclass(frozen=True)
class Source:
  """One official copy of a benchmark file."""
  filename: str  # name in the data directory
  url: str  # official URL
  path: str  # URL path appended to `base_url` when overridden
  sha256: str | None  # expected digest, None when the upstream file is not pinned


LOCOMO_SHA256 = "79fa87e90f04081343b8c8debecb80a9a6842b76a7aa537dc9fdf651ea698ff4"
SOURCES = {
    "locomo": (
        Source("locomo10.json",
               "https://github.com/snap-research/LoCoMo/raw/main/data/locomo10.json",
               "/snap-research/LoCoMo/raw/main/data/locomo10.json", LOCOMO_SHA256),
    ),
    "longmemeval": (
        Source("longmemeval_s_cleaned.json",
               "https://huggingface.co/datasets/xiaowu0162/longmemeval-cleaned/resolve/main/"
               "longmemeval_s_cleaned.json",
               "/datasets/xiaowu0162/longmemeval-cleaned/resolve/main/longmemeval_s_cleaned.json",
               None),
        Source("longmemeval_s.json",
               "https://huggingface.co/datasets/xiaowu0162/longmemeval/resolve/main/longmemeval_s.json",
               "/datasets/xiaowu0162/longmemeval/resolve/main/longmemeval_s.json", None),
    ),
}


def shown_path(path) -> str:
  """`path` as results files record it: `$EAR_DATA_DIR/<relative>` when it lies in the data
  directory `$EAR_DATA_DIR` names (results never hold a machine's absolute path), else as is."""
  root = os.environ.get("EAR_DATA_DIR")
  if root:
    try:
      return "$EAR_DATA_DIR/" + pathlib.Path(path).resolve().relative_to(
          pathlib.Path(root).resolve()).as_posix()
    except ValueError:
      pass
  return str(path)


def missing_file_message(name: str, data_dir, filenames: Sequence[str] = ()) -> str:
  """What to download and where to put it, for benchmark `name` missing from `data_dir`.

  Args:
    name: benchmark name.
    data_dir: the data directory that was searched.
    filenames: the file names that were looked for (listed when `name` has no official source).
  """
  data_dir = pathlib.Path(data_dir)
  lines = [f"benchmark {name!r}: no file in {data_dir}. Put one of these files there:"]
  srcs = SOURCES.get(name, ())
  for s in srcs:
    lines.append(f"  {data_dir / s.filename}   <- {s.url}")
  if not srcs:
    lines += [f"  {data_dir / f}" for f in filenames]
  else:
    lines.append(f"or run: python -m experiments.download --benchmark={name} --data_dir={data_dir}")
  lines.append("(the data directory is --data_dir, else $EAR_DATA_DIR, else ~/.cache/ear_jax/data)")
  return "\n".join(lines)
