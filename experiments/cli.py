"""Running an experiment program: `absl.app.run`, but a usage error prints only its message.

absl prints the module docstring and every flag's help (over 100 lines for `experiments.run`)
before the message of an `app.UsageError` raised in `main`, so the one line that says what is wrong
scrolls away. `run(main)` prints `<program>: error: <message>` and a pointer to `--helpshort` on
stderr instead, and exits with the error's exit code (1). Flag-parsing errors (an unknown flag, a
value off an enum) are absl's own short messages, unchanged.
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
