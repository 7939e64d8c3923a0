"""Sweeps sharded over devices: the run axis (seeds / hyperparameter settings) split across a `Mesh`.

Symbols: `R` runs (seeds x settings), `D` devices, `N` training queries.

`SeedAxis` splits a run axis over a 1-D `'runs'` mesh of the devices by
`jax.shard_map`: each device runs `R / D` runs (`R` padded to a multiple of `D` by repeating the
last run), the rest is replicated, nothing is communicated. `sharded_episodes` is
`jax.vmap(run_episode)` split so. On CPU, `XLA_FLAGS=--xla_force_host_platform_device_count=4`
gives four devices.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ear_jax.core import episode
from ear_jax.core.config import EARConfig, HParams
from ear_jax.core import critic as critic_lib
from ear_jax.core.stream import Stream

RUN_AXIS = "runs"


class SeedAxis:
  """`S` seeds' `[S, ...]` trees on a mesh, the seed axis split over its devices.

  `shard` places each device's seeds (padded to `S'`, a multiple of the device count), `map` runs
  a per-seed-batch function under `jax.shard_map` (nothing communicated).
  """

  def __init__(self, num_seeds: int, mesh: Optional[Mesh] = None):
    self.mesh = run_mesh() if mesh is None else mesh
    self.num_seeds = int(num_seeds)
    num_dev = self.mesh.devices.size
    self.padded = -(-self.num_seeds // num_dev) * num_dev
    self._rows = NamedSharding(self.mesh, P(RUN_AXIS))
    self._replicated = NamedSharding(self.mesh, P())

  def shard(self, tree):
    """Host `[S, ...]` leaves -> global `[S', ...]` arrays split by seeds over the mesh (the last
    seed repeated as padding)."""
    idx = np.minimum(np.arange(self.padded), self.num_seeds - 1)
    return jax.tree_util.tree_map(lambda x: jax.device_put(np.asarray(x)[idx], self._rows), tree)

  def map(self, fn, sharded: dict, replicated: dict, **static):
    """`fn(**sharded, **replicated, **static)` with each device on its own seeds.

    `fn` takes per-seed-batched arguments and returns outputs with the leading seed axis;
    `sharded`: name -> global `[S', ...]` tree; `replicated`: name -> host tree every device sees
    whole; `static`: hashable arguments. Returns `fn`'s outputs as global `[S', ...]` arrays.
    """
    names = tuple(sharded) + tuple(replicated)
    call = _seed_sharded_fn(fn, self.mesh, names, len(sharded), tuple(sorted(static.items())))
    rep = [jax.tree_util.tree_map(lambda x: jax.device_put(np.asarray(x), self._replicated), v)
           for v in replicated.values()]
    return call(*sharded.values(), *rep)


@functools.lru_cache(maxsize=None)
def _seed_sharded_fn(fn, mesh: Mesh, names: tuple, num_sharded: int, static: tuple):
  """The jitted `shard_map` of `fn` for `SeedAxis.map` (built once per function, mesh, statics)."""
  in_specs = tuple(P(RUN_AXIS) if i < num_sharded else P() for i in range(len(names)))

  def per_device(*args):
    return fn(**dict(zip(names, args)), **dict(static))

  return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=P(RUN_AXIS),
                               check_vma=False))


def run_mesh(devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
  """A 1-D `Mesh` with axis `'runs'` over `devices` (default: every device)."""
  devices = jax.devices() if devices is None else list(devices)
  return Mesh(np.asarray(devices), (RUN_AXIS,))


def sharded_episodes(keys: jax.Array, stream: Stream, config: EARConfig, hparams: HParams,
                     critic=None, *, mesh: Optional[Mesh] = None,
                     hparams_batched: bool = False):
  """`jax.vmap(run_episode)` over `R` runs, the run axis split over the devices of `mesh`.

  Equals the unsharded vmap up to float reassociation in batched matmuls.

  Args:
    keys: `[R, 2]` uint32 PRNG keys, one per run; each is consumed.
    stream: `N` training queries (replicated on every device).
    config: static config.
    hparams: `HParams` shared by all runs, or with a leading `[R]` axis on every leaf when
      `hparams_batched` (`config.stack_hparams`).
    critic: a critic pytree shared by the runs (default: the paper's simulated critic).
    mesh: a 1-D mesh with axis `'runs'` (default: `run_mesh()`, all devices).

  Returns:
    `(LearnerState, records)` with a leading `[R]` axis on every leaf, as global arrays.
  """
  keys = np.asarray(keys)
  if keys.ndim != 2:
    raise ValueError(f"keys must be [R, 2] raw uint32 PRNG keys, got shape {keys.shape}")
  axis = SeedAxis(keys.shape[0], mesh)
  sharded, replicated = {"keys": axis.shard(keys)}, {"stream": stream}
  if hparams_batched:
    sharded["hparams"] = axis.shard(hparams)
  else:
    replicated["hparams"] = hparams
  replicated["critic"] = critic_lib.or_default(critic)
  state, records = axis.map(_vmapped_episodes, sharded, replicated, config=config,
                            hparams_batched=hparams_batched)
  if axis.padded != axis.num_seeds:
    state, records = jax.tree_util.tree_map(lambda x: x[:axis.num_seeds], (state, records))
  return state, records


def _vmapped_episodes(keys, stream, config, hparams, critic, hparams_batched):
  return jax.vmap(episode.run_episode, in_axes=(0, None, None, 0 if hparams_batched else None,
                                                None))(keys, stream, config, hparams, critic)


def unsharded_episodes(keys: jax.Array, stream: Stream, config: EARConfig, hparams: HParams,
                       critic=None, *, hparams_batched: bool = False):
  """The reference: `jax.vmap(run_episode)` over the runs on the default device (one call)."""
  critic = critic_lib.or_default(critic)
  return _vmapped_episodes_jit(jnp.asarray(keys), stream, config, hparams, critic,
                              hparams_batched)


_vmapped_episodes_jit = jax.jit(_vmapped_episodes,
                                static_argnames=("config", "hparams_batched"))
