"""Running an experiment program: `absl.app.run`, but a usage error prints only its message.

`run(main)` prints `<program>: error: <message>` and a pointer to `--helpshort` on stderr, instead
of absl's full help before the message, and exits with code 1.
"""
import sys

from absl import app


def program_name() -> str:
  """`python -m <module>` of the running program (never a path of this machine)."""
  spec = getattr(sys.modules.get("__main__"), "__spec__", None)
  name = getattr(spec, "name", None) or "experiments"
  return f"python -m {name}"


def without_usage_dump(main):
  """`main` with an `app.UsageError` turned into a one-line message on stderr and its exit code."""

  def wrapped(argv):
    try:
      return main(argv)
    except app.UsageError as e:
      prog = program_name()
      sys.stderr.write(f"{prog}: error: {e}\n({prog} --helpshort lists the flags)\n")
      return e.exitcode

  return wrapped


def run(main) -> None:
  """`absl.app.run(main)` without absl's help dump on a usage error raised in `main`."""
  app.run(without_usage_dump(main))
