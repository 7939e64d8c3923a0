"""Sweeps sharded over devices: the run axis (seeds / hyperparameter settings) split across a `Mesh`.

Symbols: `R` runs (seeds x settings), `D` devices, `N` training queries.

`SeedAxis` splits a run axis over a 1-D `'runs'` mesh of every process's devices by
`jax.shard_map`: each device runs `R / D` runs (`R` padded to a multiple of `D` by repeating the
last run), the rest is replicated, nothing is communicated. `sharded_episodes` is
`jax.vmap(run_episode)` split so. On CPU, `XLA_FLAGS=--xla_force_host_platform_device_count=4`
gives four devices. Several processes: call `initialize_distributed` first, then every process
runs the same program; `is_primary` says which process writes files.
"""
from __future__ import annotations

import functools
import os
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

# Environment variables read by `initialize_distributed` when no argument is given.
ENV_COORDINATOR = "EAR_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "EAR_NUM_PROCESSES"
ENV_PROCESS_ID = "EAR_PROCESS_ID"


def initialize_distributed(coordinator_address: Optional[str] = None,
                           num_processes: Optional[int] = None,
                           process_id: Optional[int] = None) -> bool:
  """Calls `jax.distributed.initialize` when a multi-host run is asked for; else does nothing.

  Asked for = `coordinator_address` (`host:port` of process 0, or `'auto'` for SLURM / TPU pods)
  passed or in `$EAR_COORDINATOR_ADDRESS`; `num_processes` / `process_id` default to
  `$EAR_NUM_PROCESSES` / `$EAR_PROCESS_ID` or auto-detection. Call it before any other JAX call.
  Returns True when `jax.distributed.initialize` was called.
  """
  address = coordinator_address or os.environ.get(ENV_COORDINATOR)
  if not address:
    return False
  if num_processes is None and os.environ.get(ENV_NUM_PROCESSES):
    num_processes = int(os.environ[ENV_NUM_PROCESSES])
  if process_id is None and os.environ.get(ENV_PROCESS_ID):
    process_id = int(os.environ[ENV_PROCESS_ID])
  # CPU processes need gloo for cross-process collectives; GPUs / TPUs ignore it.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if address == "auto":
    jax.distributed.initialize()
  else:
    jax.distributed.initialize(coordinator_address=address, num_processes=num_processes,
                               process_id=process_id)
  return True


def is_primary() -> bool:
  """True in the process that writes files: process 0 (the only process of a 1-process run)."""
  return jax.process_index() == 0


class SeedAxis:
  """`S` seeds' `[S, ...]` trees on a mesh, the seed axis split over its devices (multi-process).

  Every process holds the same host arrays; `shard` places each device's seeds (padded to `S'`, a
  multiple of the device count), `map` runs a per-seed-batch function under `jax.shard_map`
  (nothing communicated) and `to_host` all-gathers a result to every host, padding dropped.
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
    return jax.tree_util.tree_map(lambda x: _global_array(np.asarray(x)[idx], self._rows), tree)

  def to_host(self, tree):
    """Global `[S', ...]` leaves -> host numpy `[S, ...]` on every process (a collective)."""
    return jax.tree_util.tree_map(lambda x: np.asarray(x)[:self.num_seeds], gather_to_host(tree))

  def map(self, fn, sharded: dict, replicated: dict, **static):
    """`fn(**sharded, **replicated, **static)` with each device on its own seeds.

    `fn` takes per-seed-batched arguments and returns outputs with the leading seed axis;
    `sharded`: name -> global `[S', ...]` tree; `replicated`: name -> host tree every device sees
    whole; `static`: hashable arguments. Returns `fn`'s outputs as global `[S', ...]` arrays.
    """
    names = tuple(sharded) + tuple(replicated)
    call = _seed_sharded_fn(fn, self.mesh, names, len(sharded), tuple(sorted(static.items())))
    rep = [jax.tree_util.tree_map(lambda x: _global_array(np.asarray(x), self._replicated), v)
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
  """A 1-D `Mesh` with axis `'runs'` over `devices` (default: every device of every process)."""
  devices = jax.devices() if devices is None else list(devices)
  return Mesh(np.asarray(devices), (RUN_AXIS,))


def _global_array(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
  """A global array from a host array that every process holds in full (works multi-host)."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


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


def gather_to_host(tree):
  """Host numpy copies of a tree of (possibly multi-host) global arrays."""
  if jax.process_count() == 1:
    return jax.tree_util.tree_map(np.asarray, tree)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return multihost_utils.process_allgather(tree, tiled=True)


def unsharded_episodes(keys: jax.Array, stream: Stream, config: EARConfig, hparams: HParams,
                       critic=None, *, hparams_batched: bool = False):
  """The reference: `jax.vmap(run_episode)` over the runs on the default device (one call)."""
  critic = critic_lib.or_default(critic)
  return _vmapped_episodes_jit(jnp.asarray(keys), stream, config, hparams, critic,
                              hparams_batched)


_vmapped_episodes_jit = jax.jit(_vmapped_episodes,
                                static_argnames=("config", "hparams_batched"))
