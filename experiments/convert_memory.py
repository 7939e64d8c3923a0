"""Converts a memory directory of the old layout (ear_jax 0.1.0's `Memory.save`) to the new one.

  python -m experiments.convert_memory --old=DIR --new=DIR

`--new` must not exist or be empty; `--old` is only read. Open sessions and queued training items
of the old memory are dropped (the output says how many). See `ear_jax.experiment.convert_memory`.
"""
from absl import app
from absl import flags

from ear_jax.experiment import convert_memory
from ear_jax.io import checkpoints
from experiments import cli

_OLD = flags.DEFINE_string("old", None, "The memory directory of the old layout (read only).",
                           required=True)
_NEW = flags.DEFINE_string("new", None, "The new memory directory (absent or empty).",
                           required=True)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  try:
    report = convert_memory.convert(_OLD.value, _NEW.value)
  except (ValueError, checkpoints.CheckpointError) as e:
    raise app.UsageError(str(e)) from None
  print(f"{report}\nwrote {_NEW.value}")


if __name__ == "__main__":
  cli.run(main)
