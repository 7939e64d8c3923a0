"""The installed programs: `pip install` puts `ear-mcp-server` and `ear-llm-server` on PATH
(setup.py's console scripts), and their code lives in the library."""
import configparser
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = {"ear-mcp-server": "ear_jax.agent.mcp_cli:main",
           "ear-llm-server": "ear_jax.agent.llm.server_cli:main"}


def _entry_points(tmp_path) -> dict:
  """setup.py's console scripts, as `pip install` reads them (setuptools' egg_info)."""
  subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path)],
                 cwd=REPO, check=True, capture_output=True, timeout=120)
  parser = configparser.ConfigParser()
  parser.read(tmp_path / "ear_jax.egg-info" / "entry_points.txt")
  return {k: v.replace(" ", "") for k, v in parser["console_scripts"].items()}


@pytest.mark.slow  # subprocesses importing jax: ~10 s
def test_pip_installs_the_two_programs_and_they_run(tmp_path):
  from pip._vendor.distlib.scripts import ScriptMaker  # pylint: disable=g-import-not-at-top
  assert _entry_points(tmp_path) == SCRIPTS
  bin_dir = tmp_path / "bin"
  maker = ScriptMaker(None, str(bin_dir))  # (what pip writes for a console script)
  maker.executable, maker.variants = sys.executable, {""}
  made = maker.make_multiple([f"{name} = {target}" for name, target in SCRIPTS.items()])
  assert sorted(pathlib.Path(p).name for p in made) == sorted(SCRIPTS)
  env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
  for name, flag in (("ear-mcp-server", "--memory_dir"), ("ear-llm-server", "--model_path")):
    out = subprocess.run([str(bin_dir / name), "--help"], env=env, capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0 and flag in out.stdout and name in out.stdout, out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def test_each_program_is_a_library_function_and_mcp_has_a_k_flag():
  from ear_jax.agent import mcp_cli  # pylint: disable=g-import-not-at-top
  from ear_jax.agent.llm import server_cli  # pylint: disable=g-import-not-at-top
  for target in SCRIPTS.values():
    module, function = target.split(":")
    assert module.startswith("ear_jax.") and callable(getattr(
        __import__(module, fromlist=[function]), function))
  args = mcp_cli.parser().parse_args(["--memory_dir=x", "--k=50"])
  assert args.k == 50 and mcp_cli.parser().parse_args(["--memory_dir=x"]).k is None
  with pytest.raises(SystemExit):
    mcp_cli.parser().parse_args(["--memory_dir=x", "--k=0"])
  assert server_cli.parser().parse_args([]).n_threads == 1


@pytest.mark.slow  # a subprocess: ~10 s
def test_the_k_flag_sets_the_candidates_of_a_new_memory_and_must_match_an_opened_one(tmp_path):
  from ear_jax.agent.memory import Memory  # pylint: disable=g-import-not-at-top
  env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
  cmd = [sys.executable, "-m", "ear_jax.agent.mcp_cli", f"--memory_dir={tmp_path / 'mem'}",
         "--candidates=dense", "--method=ear_tuned"]
  made = subprocess.run(cmd + ["--k=30"], env=env, capture_output=True, text=True, timeout=300,
                        stdin=subprocess.DEVNULL, cwd=REPO)  # (stdin ends: serves, saves, exits)
  assert made.returncode == 0, made.stderr[-2000:]
  with Memory.open(tmp_path / "mem") as m:
    assert m.config.ear.num_candidates == 30
  again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300,
                         stdin=subprocess.DEVNULL, cwd=REPO)  # no --k: the directory's
  assert again.returncode == 0, again.stderr[-2000:]
  other = subprocess.run(cmd + ["--k=20"], env=env, capture_output=True, text=True, timeout=300,
                         stdin=subprocess.DEVNULL, cwd=REPO)
  assert other.returncode != 0 and "num_candidates" in other.stderr, other.stderr[-2000:]
  assert "Traceback" not in other.stderr
