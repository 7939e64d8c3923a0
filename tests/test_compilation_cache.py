"""The library's persistent compilation cache (`ear_jax.io.compilation_cache`): on by default for
a `Memory`, in a documented directory, off with `EAR_NO_COMPILATION_CACHE`, never over a cache the
caller chose; a second process compiles nothing the first compiled."""
import os
import pathlib
import subprocess
import sys

import jax
import pytest

from ear_jax.io import compilation_cache

REPO = pathlib.Path(__file__).resolve().parents[1]

# A small memory's whole life: add, a session with feedback, a learner step, a search.
_PROGRAM = """
import numpy as np
from ear_jax.agent.memory import Memory
from ear_jax.core.config import EARConfig
m = Memory(None, config=EARConfig(dim=8, batch_size=1))
rng = np.random.default_rng(0)
m.add([f"memory {i}" for i in range(10)], embeddings=rng.normal(size=(10, 8)))
s = m.session(query_embedding=rng.normal(size=8))
s.feedback(s.round(3).ids[:1])
s.close()
print(len(m.search(query_embedding=rng.normal(size=8), k=3)), int(m.learner.step))
"""


def _files(directory: pathlib.Path) -> set:
  return {p.name for p in directory.rglob("*") if p.is_file()} if directory.exists() else set()


def _run(env_extra: dict, drop=()) -> str:
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE", "EAR_NO_COMP"))
         and k not in drop}
  env.update({"PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", **env_extra})
  out = subprocess.run([sys.executable, "-c", _PROGRAM], env=env, capture_output=True, text=True,
                       timeout=300, cwd=REPO)
  assert out.returncode == 0, out.stderr[-2000:]
  return out.stdout.strip()


def test_the_directory_is_under_the_library_cache_and_a_callers_cache_wins(monkeypatch, tmp_path):
  monkeypatch.setenv("EAR_CACHE_DIR", str(tmp_path / "c"))
  assert compilation_cache.directory() == tmp_path / "c" / "xla"
  monkeypatch.delenv("EAR_CACHE_DIR")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
  assert compilation_cache.directory() == tmp_path / "x" / "ear_jax" / "xla"
  chosen = jax.config.jax_compilation_cache_dir  # (the test session's own: tests/conftest.py)
  assert chosen and compilation_cache.enable() == chosen
  assert jax.config.jax_compilation_cache_dir == chosen and not (tmp_path / "x").exists()


def test_prune_removes_the_least_recently_used_programs_down_to_the_bound(tmp_path):
  for i, name in enumerate(["old", "mid", "new"]):
    (tmp_path / name).write_bytes(b"x" * 100)
    os.utime(tmp_path / name, (1000 + i, 1000 + i))
  assert compilation_cache.prune(tmp_path, max_bytes=300) == 0
  assert compilation_cache.prune(tmp_path, max_bytes=150) == 2
  assert _files(tmp_path) == {"new"}


@pytest.mark.slow  # four subprocesses: ~20 s
def test_a_second_process_compiles_nothing_and_the_cache_can_be_turned_off(tmp_path):
  ours = tmp_path / "ear" / "xla"
  assert _run({"EAR_CACHE_DIR": str(tmp_path / "ear")}) == "3 1"
  first = _files(ours)
  assert len(first) >= 5  # the memory's programs (the search, the round, the learner step, ...)
  assert _run({"EAR_CACHE_DIR": str(tmp_path / "ear")}) == "3 1"
  assert _files(ours) == first  # every program of the second process came from the cache
  _run({"EAR_CACHE_DIR": str(tmp_path / "off"), "EAR_NO_COMPILATION_CACHE": "1"})
  assert not _files(tmp_path / "off")  # opted out: nothing written
  _run({"EAR_CACHE_DIR": str(tmp_path / "mine"), "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "j"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"})
  assert not _files(tmp_path / "mine") and _files(tmp_path / "j")  # the caller's cache is used
