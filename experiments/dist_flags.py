"""Flags of a multi-process run (`jax.distributed`), shared by the absl programs.

  python -m experiments.run ... --coordinator=HOST:PORT --num_processes=N --process_id=I

Every process runs the same command with its own `--process_id`; process 0 alone writes files.
Unset flags fall back to $EAR_COORDINATOR_ADDRESS, $EAR_NUM_PROCESSES and $EAR_PROCESS_ID;
`--coordinator=auto` reads a cluster launcher's settings. Without a coordinator: one process.
"""
from __future__ import annotations

from absl import app
from absl import flags


class DistFlags:
  """The flag holders (`define`)."""

  def __init__(self, coordinator, num_processes, process_id):
    self.coordinator, self.num_processes, self.process_id = coordinator, num_processes, process_id


def define() -> DistFlags:
  """Defines --coordinator (alias --coordinator_address), --num_processes and --process_id."""
  coordinator = flags.DEFINE_string(
      "coordinator", None, "Multi-process run (jax.distributed): host:port of process 0, or 'auto' "
      "(SLURM / TPU / MPI launchers); also $EAR_COORDINATOR_ADDRESS. Unset: one process.")
  flags.DEFINE_alias("coordinator_address", "coordinator")
  num_processes = flags.DEFINE_integer("num_processes", None, "Multi-process: number of processes "
                                       "(also $EAR_NUM_PROCESSES).", lower_bound=1)
  process_id = flags.DEFINE_integer("process_id", None, "Multi-process: this process's index, 0 .. "
                                    "num_processes-1 (also $EAR_PROCESS_ID).", lower_bound=0)
  return DistFlags(coordinator, num_processes, process_id)


def initialize(f: DistFlags) -> bool:
  """Starts `jax.distributed` from the flags (before any other JAX call); True when it did.

  Raises:
    app.UsageError: --num_processes / --process_id without --coordinator, or an id out of range.
  """
  import os  # pylint: disable=g-import-not-at-top
  from ear_jax.experiment import sharding  # pylint: disable=g-import-not-at-top
  address = f.coordinator.value or os.environ.get(sharding.ENV_COORDINATOR)
  if not address:
    if f.num_processes.value not in (None, 1) or f.process_id.value not in (None, 0):
      raise app.UsageError("--num_processes / --process_id need --coordinator=HOST:PORT (or "
                           "$EAR_COORDINATOR_ADDRESS)")
    return False
  if address != "auto" and ":" not in address:
    raise app.UsageError(f"--coordinator={address!r} must be HOST:PORT (or 'auto')")
  n, i = f.num_processes.value, f.process_id.value
  if n is not None and i is not None and i >= n:
    raise app.UsageError(f"--process_id={i} must be < --num_processes={n}")
  try:
    return sharding.initialize_distributed(address, n, i)
  except (RuntimeError, ValueError) as e:
    raise app.UsageError(f"--coordinator={address}: jax.distributed.initialize failed: {e}") from None


def check_supported(*, suite, resume: bool) -> None:
  """What a multi-process `experiments.run` does not offer.

  Raises:
    app.UsageError: --suite=qa or --resume (multi-process runs write no checkpoints).
  """
  if suite == "qa":
    raise app.UsageError("--suite=qa runs in one process (drop --coordinator)")
  if resume:
    raise app.UsageError("--resume: multi-process runs write no checkpoints; resume in one "
                         "process (drop --coordinator) or start a new --workdir")
