"""Fetches missing official benchmark files into the data directory.

  python -m experiments.download --benchmark=locomo [--data_dir=DIR] [--base_url=URL] [--force]
"""
from absl import app
from absl import flags

from ear_jax.data import download

_BENCHMARK = flags.DEFINE_multi_enum("benchmark", ["locomo"], ["locomo", "longmemeval"],
                                     "Benchmark(s) to fetch.")
_DATA_DIR = flags.DEFINE_string("data_dir", None,
                                "Target directory (else $EAR_DATA_DIR, else ~/.cache/ear_jax/data).")
_BASE_URL = flags.DEFINE_string("base_url", None, "Mirror replacing https://github.com / huggingface.co.")
_FORCE = flags.DEFINE_bool("force", False, "Fetch even if the file exists.")


def main(argv):
  del argv
  for name in _BENCHMARK.value:
    path = download.download(name, _DATA_DIR.value, base_url=_BASE_URL.value, force=_FORCE.value)
    print(f"{name}: {path}")


if __name__ == "__main__":
  app.run(main)
