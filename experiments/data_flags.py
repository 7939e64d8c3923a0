"""The data flags shared by the experiment programs: benchmark, files, encoder, slice and K."""
import os
from typing import NamedTuple, Sequence

from absl import app
from absl import flags


class DataFlags(NamedTuple):
  benchmark: flags.FlagHolder
  jsonl: flags.FlagHolder
  data_dir: flags.FlagHolder
  encoder: flags.FlagHolder
  cache_dir: flags.FlagHolder
  limit: flags.FlagHolder
  k: flags.FlagHolder


def define(benchmarks: Sequence[str], benchmark_help: str = "Which benchmark.") -> DataFlags:
  """Defines --benchmark, --jsonl, --data_dir, --encoder, --cache_dir, --limit and --k."""
  return DataFlags(
      benchmark=flags.DEFINE_enum("benchmark", "locomo", list(benchmarks), benchmark_help),
      jsonl=flags.DEFINE_string("jsonl", None, "User JSONL memory bank (--benchmark=jsonl)."),
      data_dir=flags.DEFINE_string(
          "data_dir", None, "Benchmark files (else $EAR_DATA_DIR, else ~/.cache/ear_jax/data)."),
      encoder=flags.DEFINE_string(
          "encoder", "minilm", "'minilm', a local HF checkpoint dir, or a .npy/.npz of embeddings."),
      cache_dir=flags.DEFINE_string(
          "cache_dir", None, "Embedding cache root (else $EAR_CACHE_DIR, else ~/.cache/ear_jax)."),
      limit=flags.DEFINE_integer(
          "limit", None, "Only the first N conversations / questions / queries (a quick slice)."),
      k=flags.DEFINE_integer("k", 20, "Candidates per query (K).", lower_bound=1))


def benchmark_name(data: DataFlags) -> str:
  """The `load_benchmark` name of the flags (`jsonl:PATH` for a user memory bank).

  Raises:
    app.UsageError: --benchmark=jsonl without --jsonl, a --jsonl path that is a directory or
      missing, or a benchmark file not in the data directory (saying where to put it).
  """
  name = data.benchmark.value
  if name in ("locomo", "longmemeval"):
    from ear_jax.data import corpora  # pylint: disable=g-import-not-at-top
    try:
      corpora.find_benchmark_file(name, data.data_dir.value)
    except FileNotFoundError as e:
      raise app.UsageError(f"--data_dir / --benchmark={name}: {e}") from None
  if name == "jsonl":
    path = data.jsonl.value
    if not path:
      raise app.UsageError("--benchmark=jsonl needs --jsonl=PATH")
    if os.path.isdir(path):
      raise app.UsageError(f"--jsonl={path} is a directory; pass the path of a .jsonl file")
    if not os.path.isfile(path):
      raise app.UsageError(f"--jsonl={path}: file does not exist")
    return "jsonl:" + path
  return name


def load_benchmark(data: DataFlags, **kwargs):
  """`candidates.load_benchmark` of the flags (`kwargs`: its other arguments, e.g. `progress`)."""
  from ear_jax.data import candidates  # pylint: disable=g-import-not-at-top
  return candidates.load_benchmark(benchmark_name(data), data_dir=data.data_dir.value,
                                   encoder=data.encoder.value, k=data.k.value,
                                   limit=data.limit.value, cache_dir=data.cache_dir.value,
                                   **kwargs)
