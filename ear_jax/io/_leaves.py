"""The leaf record of a saved array pytree: every leaf's name, shape, dtype and SHA-256.

Leaves are named by container-independent paths ('a/b/0'); zero-size leaves, which Orbax cannot
write, are saved as a scalar placeholder and rebuilt from the record.
"""
from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np


def _key_name(key) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def leaf_name(path) -> str:
  return "/".join(_key_name(k) for k in path)


def _digest(x: np.ndarray) -> str:
  return hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()


def prepare(arrays):
  """`(the tree Orbax saves, the leaf record)`; ValueError for an empty tree or non-numeric leaf."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(arrays)
  if not flat:
    raise ValueError("arrays must hold at least one array")
  leaves, record = [], {}
  for p, x in flat:
    name = leaf_name(p)
    if name in record:
      raise ValueError(f"two array leaves are both named {name!r}")
    if not isinstance(x, jax.Array):
      x = np.asarray(x)
    dtype = np.dtype(x.dtype)
    if dtype.kind in "OUSMm":
      raise ValueError(f"array leaf {name!r} has dtype {dtype}: only numeric arrays can be saved")
    host = None if isinstance(x, jax.Array) and not x.is_fully_addressable else np.asarray(x)
    empty = int(np.prod(np.shape(x))) == 0
    record[name] = {"shape": list(np.shape(x)), "dtype": str(dtype), "empty": empty,
                    "sha256": None if host is None else _digest(host)}
    leaves.append(np.zeros((), dtype) if empty else x)
  return jax.tree_util.tree_unflatten(treedef, leaves), record


def stored_shapes(record: dict) -> dict:
  """{name: (shape, dtype)} as Orbax's array metadata must show them (placeholders are scalars)."""
  return {n: ([] if r["empty"] else r["shape"], r["dtype"]) for n, r in record.items()}


def metadata_shapes(tree) -> dict:
  """{name: (shape, dtype)} of Orbax's array metadata tree."""
  flat = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))[0]
  return {leaf_name(p): (list(m.shape), str(np.dtype(m.dtype))) for p, m in flat}


def _check_target(flat_target, stored: dict, what: str) -> None:
  """ValueError naming `what` and each leaf in which `stored` ({name: (shape list, dtype str)})
  and a flat target differ."""
  diffs, names = [], set()
  for p, t in flat_target:
    name = leaf_name(p)
    names.add(name)
    shape, dtype = list(np.shape(t)), str(np.dtype(t.dtype))
    got = stored.get(name)
    if got is None:
      diffs.append(f"{name}: not in the checkpoint")
    elif list(got[0]) != shape or got[1] != dtype:
      diffs.append(f"{name}: stored {got[1]}{list(got[0])} vs expected {dtype}{shape}")
  diffs += [f"{n}: stored but not in the target" for n in sorted(set(stored) - names)]
  if diffs:
    raise ValueError(f"{what} does not match the stored arrays in {len(diffs)} leaves: "
                     + "; ".join(diffs[:10]) + ("; ..." if len(diffs) > 10 else ""))


def restore_target(target, record: dict):
  """The Orbax restore target for `target`; a ValueError listing the leaves that do not match."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(target)
  _check_target(flat, {n: (r["shape"], r["dtype"]) for n, r in record.items()},
                "the restore target")
  leaves = [jax.ShapeDtypeStruct((), t.dtype) if record[leaf_name(p)]["empty"] else t
            for p, t in flat]
  return jax.tree_util.tree_unflatten(treedef, leaves)


def fit_target(target, tree, what: str):
  """The arrays of a restored `tree` in the structure of the abstract pytree `target`, by leaf NAME.

  Two same-shaped fields can never swap. ValueError naming `what` and every missing, extra or
  mis-shaped leaf.
  """
  flat, treedef = jax.tree_util.tree_flatten_with_path(target)
  stored = {leaf_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
  _check_target(flat, {n: (np.shape(x), str(np.asarray(x).dtype)) for n, x in stored.items()},
                what)
  return jax.tree_util.tree_unflatten(treedef, [stored[leaf_name(p)] for p, _ in flat])


def check_restored(arrays, record: dict):
  """`(arrays with empty leaves rebuilt, problems)`: each leaf checked for shape, dtype, SHA-256."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(arrays)
  bad, out, seen = [], [], set()
  for p, x in flat:
    name = leaf_name(p)
    rec = record.get(name)
    seen.add(name)
    if rec is None:
      bad.append(f"{name}: not in the leaf record")
    elif rec["empty"]:
      x = np.zeros(rec["shape"], jnp.dtype(rec["dtype"]))
    elif rec["sha256"] is not None:
      host = np.asarray(x)
      if list(host.shape) != rec["shape"] or str(host.dtype) != rec["dtype"]:
        bad.append(f"{name}: read {host.dtype}{list(host.shape)}, saved {rec['dtype']}{rec['shape']}")
      elif _digest(host) != rec["sha256"]:
        bad.append(f"{name}: checksum mismatch")
    out.append(x)
  bad += [f"{n}: missing" for n in sorted(set(record) - seen)]
  return jax.tree_util.tree_unflatten(treedef, out), bad
