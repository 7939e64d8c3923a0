"""Small helpers shared by the `Memory` test files: the tests' config, unit rows, deep equality."""
import numpy as np

from ear_jax.core.config import EARConfig

D = 16


def config(**overrides) -> EARConfig:
  """The tests' small `EARConfig` (d = 16, K = 8, s = 3, T = 2, b = 2), with `overrides`."""
  kw = dict(dim=D, num_candidates=8, slate_size=3, num_rounds=2, batch_size=2,
            buffer_capacity=16, replay_size=2)
  return EARConfig(**{**kw, **overrides})


def unit(x) -> np.ndarray:
  x = np.asarray(x, np.float32)
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def equal(x, y) -> bool:
  """Deep equality of nested dicts / lists / tuples / arrays (arrays bit for bit)."""
  if isinstance(x, dict):
    return x.keys() == y.keys() and all(equal(x[k], y[k]) for k in x)
  if isinstance(x, (list, tuple)):
    return len(x) == len(y) and all(equal(u, v) for u, v in zip(x, y))
  if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
    return x is not None and y is not None and np.array_equal(x, y)
  return x == y
