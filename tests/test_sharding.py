"""`ear_jax.experiment.sharding`: the run axis of a sweep split over the devices equals one `vmap`.

Fast: the mesh and the argument checks, in process. Slow: the equality itself, in a fresh interpreter
with 4 forced CPU devices (the device count is fixed when JAX starts; only the child's environment
is changed), for 6 seeds (padded to 8 runs) and for 4 hyperparameter settings.
"""
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import ear_jax as ej
from ear_jax.core import stream as stream_lib
from ear_jax.experiment import sharding
from tests.core_utils import learnable_stream

_REPO = pathlib.Path(__file__).resolve().parent.parent

# Runs in a fresh interpreter: the device count is fixed when JAX starts.
_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    sys.path.insert(0, {tests!r})
    from core_utils import learnable_stream
    import ear_jax as ej
    from ear_jax.experiment import sharding
    from ear_jax.core import stream as stream_lib
    assert jax.device_count() == 4, jax.devices()
    stream = stream_lib.to_device(learnable_stream(0, 48, d=16, k=8))
    config = ej.EARConfig(dim=16, num_candidates=8, slate_size=3, num_rounds=2, replay_size=2,
                          buffer_capacity=32, batch_size=4)
    out = {{}}
    # 6 seeds (not a multiple of 4: exercises the padding), shared hyperparameters.
    keys = jax.vmap(jax.random.PRNGKey)(np.arange(6))
    hp = ej.default_hparams()
    a = jax.device_get(sharding.sharded_episodes(keys, stream, config, hp))
    b = jax.device_get(sharding.unsharded_episodes(keys, stream, config, hp))
    # 4 hyperparameter settings (one per device), one seed each.
    hps = ej.stack_hparams([ej.default_hparams(learning_rate=lr, lambda_div=ld)
                            for lr, ld in ((1e-3, .3), (3e-3, .1), (1e-2, .5), (3e-4, 0.))])
    keys4 = jax.vmap(jax.random.PRNGKey)(np.zeros(4, np.int32))
    c = jax.device_get(sharding.sharded_episodes(keys4, stream, config, hps,
                                                          hparams_batched=True))
    d = jax.device_get(sharding.unsharded_episodes(keys4, stream, config, hps,
                                                            hparams_batched=True))
    def compare(x, y):
      fx, fy = jax.tree_util.tree_leaves(x), jax.tree_util.tree_leaves(y)
      assert len(fx) == len(fy)
      exact = all(np.array_equal(u, v) for u, v in zip(fx, fy)
                  if np.asarray(u).dtype.kind in 'biu')
      diff = max(float(np.max(np.abs(np.asarray(u, np.float64) - np.asarray(v, np.float64)),
                              initial=0.0)) for u, v in zip(fx, fy)
                 if np.asarray(u).dtype.kind == 'f')
      return exact, diff
    for name, (x, y) in dict(seeds=(a, b), hparams=(c, d)).items():
      exact, diff = compare(x, y)
      out[name] = dict(ints_exact=exact, max_abs_diff=diff, runs=int(x[0].step.shape[0]))
    out["seeds_differ"] = bool(np.any(a[0].params.w_q[0] != a[0].params.w_q[1]))
    out["hparams_differ"] = bool(np.any(c[0].params.w_m[1] != c[0].params.w_m[2]))
    out["num_devices"] = jax.device_count()
    print("RESULT" + json.dumps(out))
""")


def _run_forced_devices():
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = str(_REPO) + os.pathsep + env.get("PYTHONPATH", "")
  proc = subprocess.run([sys.executable, "-c", _SCRIPT.format(tests=str(_REPO / "tests"))],
                        capture_output=True, text=True, env=env, cwd=str(_REPO), timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")][-1]
  return json.loads(line[len("RESULT"):])


def test_run_mesh_spans_every_device_and_bad_keys_fail_before_any_compilation():
  mesh = sharding.run_mesh()
  assert mesh.axis_names == (sharding.RUN_AXIS,) and mesh.devices.size == jax.device_count()
  assert sharding.run_mesh(jax.devices()[:1]).devices.size == 1
  stream = stream_lib.to_device(learnable_stream(0, 4, d=8, k=6))
  config = ej.EARConfig(dim=8, num_candidates=6, slate_size=2, num_rounds=2, replay_size=2,
                        buffer_capacity=8, batch_size=2)
  key = jax.random.PRNGKey(0)
  for bad in (key, np.stack([np.asarray(key)] * 2)[None]):  # [2] and [1, 2, 2], not [R, 2]
    with pytest.raises(ValueError, match=r"\[R, 2\]"):
      sharding.sharded_episodes(bad, stream, config, ej.default_hparams())


@pytest.mark.slow
def test_sharded_sweep_equals_unsharded_on_four_cpu_devices():
  out = _run_forced_devices()
  assert out["num_devices"] == 4
  for name in ("seeds", "hparams"):
    assert out[name]["ints_exact"], out  # same slates, labels, counters
    assert out[name]["max_abs_diff"] < 1e-5, out  # same params, losses, buffers
  assert out["seeds"]["runs"] == 6  # the padding to a multiple of 4 is dropped
  assert out["seeds_differ"] and out["hparams_differ"], out  # the runs are really different
