"""Two local processes on JAX's distributed runtime run a suite as one process does.

Each slow test starts 2 Python processes with `jax.distributed` (coordinator on 127.0.0.1 at a free
port, gloo CPU collectives, one CPU device each), waits for both with a deadline and kills and reaps
both whatever happens, then compares their output with the same computation in one process:

* `experiments.run --suite=main` on the synthetic benchmark, 3 seeds split over the 2 processes'
  devices (2 + 1 after padding to 4): the per-run test evaluation (slates, recall, hitrate) and
  every integer log are bit-identical to a 1-process run, the float training losses are within
  1e-5 (each device vmaps 2 seeds instead of 3: float reassociation), and only process 0 writes.

Fast: the flag checks of `experiments.dist_flags`.
"""
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from absl import app

from experiments import dist_flags

_REPO = pathlib.Path(__file__).resolve().parents[1]
_DEADLINE_S = 420  # for both processes together


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env() -> dict:
  env = dict(os.environ)
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = str(_REPO) + os.pathsep + env.get("PYTHONPATH", "")
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if "force_host_platform_device_count" not in f)  # 1 device each
  for name in ("EAR_COORDINATOR_ADDRESS", "EAR_NUM_PROCESSES", "EAR_PROCESS_ID"):
    env.pop(name, None)
  return env


def launch_two(argv_of, log_dir, deadline_s: float = _DEADLINE_S):
  """Runs `argv_of(process_id, port)` for processes 0 and 1; returns [(rc, stdout, stderr)] * 2.

  Both are killed and reaped when the deadline passes, when one of them fails (the other would wait
  for it) or when anything here raises (rc -9 = killed).
  """
  port = _free_port()
  procs, logs = [], []
  try:
    for pid in (0, 1):
      out = open(os.path.join(log_dir, f"p{pid}.out"), "w+")
      err = open(os.path.join(log_dir, f"p{pid}.err"), "w+")
      logs.append((out, err))
      procs.append(subprocess.Popen(argv_of(pid, port), stdout=out, stderr=err, env=_env(),
                                    cwd=str(_REPO)))
    end = time.monotonic() + deadline_s
    while time.monotonic() < end and any(p.poll() is None for p in procs):
      if any(p.poll() not in (None, 0) for p in procs):  # one failed: the other would hang
        break
      time.sleep(0.5)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
    for p in procs:
      p.wait(timeout=30)
  results = []
  for p, (out, err) in zip(procs, logs):
    out.seek(0)
    err.seek(0)
    results.append((p.returncode, out.read(), err.read()))
    out.close()
    err.close()
  return results


def _ok(results):
  for pid, (rc, out, err) in enumerate(results):
    assert rc == 0, f"process {pid} exited with {rc}:\n{err[-3000:]}\n{out[-1000:]}"


# -- the suite ---------------------------------------------------------------------------------

_RUN = ["-m", "experiments.run", "--benchmark=synthetic", "--suite=main", "--seeds=3",
        "--synthetic_queries=48", "--synthetic_dim=16", "--eval_every=16", "--checkpoint_every=0",
        "--noprogress"]


@pytest.mark.slow
def test_a_suite_on_two_processes_equals_one_process_and_only_process_0_writes(tmp_path):
  one = subprocess.run([sys.executable, *_RUN, f"--workdir={tmp_path / 'one'}"], env=_env(),
                       cwd=str(_REPO), capture_output=True, text=True, timeout=_DEADLINE_S)
  assert one.returncode == 0, one.stderr[-3000:]
  # Process 1 is given its own --workdir only to prove it writes nothing there.
  results = launch_two(lambda pid, port: [
      sys.executable, *_RUN, f"--workdir={tmp_path / ('two' if pid == 0 else 'two_p1')}",
      f"--coordinator=127.0.0.1:{port}", "--num_processes=2", f"--process_id={pid}"], tmp_path)
  _ok(results)
  assert "process 1 of 2: done" in results[1][1]
  assert not (tmp_path / "two_p1").exists()
  a = json.loads((tmp_path / "one" / "results.json").read_text())
  b = json.loads((tmp_path / "two" / "results.json").read_text())
  assert b["processes"] == {"count": 2, "devices": 2} and a["processes"]["count"] == 1
  assert sorted(a["runs"]) == sorted(b["runs"]) and len(a["runs"]) == 3
  for run in a["runs"]:
    for key in ("metrics", "curve", "per_category", "ceiling"):
      assert a["runs"][run].get(key) == b["runs"][run].get(key), (run, key)
    for name in ("test_eval.npz", "train_log.npz"):
      fa, fb = tmp_path / "one" / "runs" / run / name, tmp_path / "two" / "runs" / run / name
      if not fa.exists():
        assert not fb.exists()
        continue
      xa, xb = np.load(fa), np.load(fb)
      assert sorted(xa.files) == sorted(xb.files)
      for k in xa.files:
        if xa[k].dtype.kind == "f" and name == "train_log.npz":
          np.testing.assert_allclose(xa[k], xb[k], atol=1e-5, rtol=0, err_msg=f"{run} {k}")
        else:  # slates, recall, hitrate, labels, counters: bit for bit
          np.testing.assert_array_equal(xa[k], xb[k], err_msg=f"{run} {k}")
  assert a["tables"] == b["tables"]
  assert (tmp_path / "two" / "tables.md").read_text() == (tmp_path / "one" / "tables.md").read_text()
  assert sorted(p.name for p in (tmp_path / "two" / "plots").iterdir()) == sorted(
      p.name for p in (tmp_path / "one" / "plots").iterdir())


# -- the sharded search ------------------------------------------------------------------------

# -- fast: flags and the one-process case ------------------------------------------------------

class _Flag:
  def __init__(self, value):
    self.value = value


def test_process_flags_without_a_coordinator_are_a_usage_error(monkeypatch):
  monkeypatch.delenv("EAR_COORDINATOR_ADDRESS", raising=False)
  f = dist_flags.DistFlags(_Flag(None), _Flag(2), _Flag(1))
  with pytest.raises(app.UsageError, match="--coordinator"):
    dist_flags.initialize(f)
  assert dist_flags.initialize(dist_flags.DistFlags(_Flag(None), _Flag(None), _Flag(None))) is False
  for bad, match in (("localhost", "HOST:PORT"), ("127.0.0.1:1234", "process_id=2 must be <")):
    with pytest.raises(app.UsageError, match=match):
      dist_flags.initialize(dist_flags.DistFlags(_Flag(bad), _Flag(2), _Flag(2)))


def test_qa_and_resume_are_refused_in_a_multi_process_run():
  with pytest.raises(app.UsageError, match="qa"):
    dist_flags.check_supported(suite="qa", resume=False)
  with pytest.raises(app.UsageError, match="--resume"):
    dist_flags.check_supported(suite="main", resume=True)
  dist_flags.check_supported(suite="main", resume=False)
