"""CI (`.ci/run`) and the real-LLM tier: the llama.cpp build is bounded with a margin, and a
skipped real-LLM tier is loud (a banner at the end of the pytest run) and, once CI has installed
the LLM extra (`EAR_REQUIRE_REAL_LLM=1`), a failure."""
import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_ci_bounds_the_llm_build_with_a_margin_and_reports_a_skipped_tier():
  script = (REPO / ".ci" / "run").read_text()
  build = re.search(r"timeout (\d+) nice -n 19 python -m pip wheel [^\n]*requirements-llm[^\n]*\\\n[^\n]*&\n", script)
  assert build, "the llama.cpp wheel is built in the background"
  # The tests leave the nice-19 build little CPU (it took 590 s to 20 min on loaded 2-core
  # machines), so its bound counts from the tests' end: a few minutes more at full speed (2 min
  # 20 s on a quiet machine), then its process group (timeout's) is stopped; the whole CI must
  # stay under 30 min.
  after = re.search(r'LLM_BUILD_AFTER_TESTS_S="\$\{LLM_BUILD_AFTER_TESTS_S:-(\d+)\}"', script)
  assert after and 300 <= int(after[1]) <= 600, after
  assert int(build[1]) >= 1800  # (the last resort, from the build's start)
  assert 'kill -TERM -- "-$LLM_BUILD"' in script
  assert script.index("pip wheel") < script.index("pip install -q -r requirements.txt")
  assert "--find-links" in script and "-DLLAVA_BUILD=OFF" in script
  assert "CMAKE_BUILD_PARALLEL_LEVEL" in script
  assert "EAR_REQUIRE_REAL_LLM=1" in script  # set only when the extra installed
  assert "-rs" in script and "REAL-LLM" in script  # pytest's skip reasons and CI's own banner
  # The build (at nice 19: the regex above) overlaps every test but the real-LLM ones; those run
  # after it.
  first = script.index('-m "not real_llm" tests')
  assert script.index("pip install -q --no-deps -e .") < first < script.index('wait "$LLM_BUILD"')
  assert script.index('wait "$LLM_BUILD"') < script.index("-m real_llm tests")


@pytest.mark.slow
def test_a_skipped_real_llm_tier_prints_a_banner_and_fails_when_required(tmp_path):
  shadow = tmp_path / "shadow" / "llama_cpp"
  shadow.mkdir(parents=True)
  (shadow / "__init__.py").write_text('raise ModuleNotFoundError("llama_cpp hidden by a test")\n')
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": os.pathsep.join([str(shadow.parent), str(REPO)])}
  env.pop("EAR_REQUIRE_REAL_LLM", None)
  cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_llm_real.py"]
  plain = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert plain.returncode == 0, plain.stdout[-3000:]
  assert "REAL-LLM TIER SKIPPED: 1 test(s) did not run" in plain.stdout, plain.stdout[-3000:]
  assert "llama-cpp-python is not installed" in plain.stdout
  required = subprocess.run(cmd, cwd=REPO, env={**env, "EAR_REQUIRE_REAL_LLM": "1"},
                            capture_output=True, text=True, timeout=300)
  assert required.returncode == 1, required.stdout[-3000:]
  assert "EAR_REQUIRE_REAL_LLM=1: the session fails" in required.stdout
