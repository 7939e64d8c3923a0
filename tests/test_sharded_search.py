"""Candidate search over a bank sharded across 4 forced CPU devices equals the unsharded search."""
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ear_jax.experiment import sharding

_REPO = pathlib.Path(__file__).resolve().parents[1]

_SCRIPT = textwrap.dedent("""
    import json
    import jax, numpy as np
    from ear_jax.core import retrieval
    from ear_jax.experiment import sharding
    rng = np.random.default_rng(0)
    out = {"num_devices": jax.device_count(), "cases": []}
    for m, n in ((1001, 5), (64, 2), (10, 1)):  # not a multiple of 4; tiny shards; fewer than K
      bank = rng.normal(size=(m, 16)).astype(np.float32)
      bank /= np.linalg.norm(bank, axis=1, keepdims=True)
      if m > 900:  # exact ties on different devices: equal scores must go to the lower row
        bank[500] = bank[3]; bank[900] = bank[3]
      valid = rng.random(m) < 0.9
      valid[[3, 500, 900] if m > 900 else []] = True
      q = np.concatenate([bank[3:4], rng.normal(size=(n - 1, 16)).astype(np.float32)])
      mesh = sharding.bank_mesh()
      bank_g, valid_g = sharding.shard_bank(bank, valid, mesh)
      a = sharding.sharded_top_k_search(q, bank_g, valid_g, 20, mesh=mesh)
      b = jax.jit(retrieval.top_k_search, static_argnames=("k", "chunk"))(q, bank, valid, k=20)
      out["cases"].append(dict(
          shards=len(bank_g.addressable_shards), idx=np.asarray(a[0]).tolist(),
          ref=np.asarray(b[0]).tolist(), mask_equal=bool(np.array_equal(a[2], b[2])),
          score_diff=float(np.nanmax(np.abs(np.where(np.asarray(b[2]), np.asarray(a[1]) -
                                                     np.asarray(b[1]), 0.0))))))
    print("RESULT" + json.dumps(out))
""")


def test_bank_mesh_spans_every_device():
  mesh = sharding.bank_mesh()
  assert mesh.axis_names == (sharding.BANK_AXIS,)


@pytest.mark.slow
def test_sharded_search_equals_the_unsharded_search_on_four_cpu_devices():
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      " --xla_force_host_platform_device_count=4").strip()
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = str(_REPO) + os.pathsep + env.get("PYTHONPATH", "")
  proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env,
                        cwd=str(_REPO), timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  out = json.loads([l for l in proc.stdout.splitlines() if l.startswith("RESULT")][-1][6:])
  assert out["num_devices"] == 4
  for case in out["cases"]:
    assert case["shards"] == 4
    assert case["idx"] == case["ref"] and case["mask_equal"], case
    assert case["score_diff"] < 1e-5, case
  first = np.asarray(out["cases"][0]["idx"])
  assert first[0, :3].tolist() == [3, 500, 900]  # the tie order across devices
  assert (np.asarray(out["cases"][2]["idx"])[0] == -1).sum() >= 10  # 10 rows: padded
