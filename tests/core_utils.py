"""Small learnable streams for the core tests (no encoder, no files)."""
import numpy as np

from ear_jax.core.stream import make_stream


def _unit(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def learnable_stream(seed, n, d=16, k=8, num_gold=2, num_valid=None, noise=0.3):
  """Queries whose gold candidates lie near R q (a hidden rotation) while distractors lie near q.

  Frozen cosine prefers the distractors; a linear adapter that learns R finds the gold.
  """
  rng = np.random.default_rng(seed)
  rot = np.linalg.qr(np.random.default_rng(1234).normal(size=(d, d)))[0]
  q = _unit(rng.normal(size=(n, d)))
  target = q @ rot.T
  cands = np.zeros((n, k, d), np.float32)
  gold = np.zeros((n, k), bool)
  mask = np.zeros((n, k), bool)
  nv = k if num_valid is None else num_valid
  for i in range(n):
    order = rng.permutation(nv)
    g = order[:num_gold]
    dist = order[num_gold:]
    cands[i, g] = _unit(target[i] + noise * rng.normal(size=(num_gold, d)) / np.sqrt(d))
    cands[i, dist] = _unit(q[i] + 1.2 * noise * rng.normal(size=(len(dist), d)) / np.sqrt(d) * 3)
    gold[i, g] = True
    mask[i, :nv] = True
  return make_stream(q, cands, mask, gold)


def close_or_equal(x, y, rtol, atol):
  """Floats equal up to `rtol` / `atol` (two programs round differently); the rest bit for bit."""
  x, y = np.asarray(x), np.asarray(y)
  if np.issubdtype(x.dtype, np.floating):
    np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)
  else:
    np.testing.assert_array_equal(x, y)
