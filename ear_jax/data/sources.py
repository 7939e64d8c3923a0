"""Where the official benchmark files come from, and what to tell a user whose file is missing."""
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
  """`path` as results files record it: `$EAR_DATA_DIR/<relative>` inside the data directory."""
  root = os.environ.get("EAR_DATA_DIR")
  if root:
    try:
      return "$EAR_DATA_DIR/" + pathlib.Path(path).resolve().relative_to(
          pathlib.Path(root).resolve()).as_posix()
    except ValueError:
      pass
  return str(path)


def missing_file_message(name: str, data_dir, filenames: Sequence[str] = ()) -> str:
  """What to download and where to put it, for benchmark `name` missing from `data_dir`."""
  data_dir = pathlib.Path(data_dir)
  lines = [f"benchmark {name!r}: no file in {data_dir}. Put one of these files there:"]
  srcs = SOURCES.get(name, ())
  lines += [f"  {data_dir / s.filename}   <- {s.url}" for s in srcs]
  if not srcs:
    lines += [f"  {data_dir / f}" for f in filenames]
  else:
    lines.append(f"or run: python -m experiments.download --benchmark={name} --data_dir={data_dir}")
  lines.append("(the data directory is --data_dir, else $EAR_DATA_DIR, else ~/.cache/ear_jax/data)")
  return "\n".join(lines)
