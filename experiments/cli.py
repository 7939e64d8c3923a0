"""What the experiment programs share: `run(main)` (`absl.app.run`, but a usage error prints
`<program>: error: <message>` and a pointer to `--helpshort` instead of absl's full help, exit code
1), the command line as run, and writing a JSON result."""
import json
import pathlib
import shlex
import sys

from absl import app


def without_usage_dump(main):
  """`main` with an `app.UsageError` turned into a one-line message on stderr and its exit code."""

  def wrapped(argv):
    try:
      return main(argv)
    except app.UsageError as e:  # named `python -m <module>`, never a path of this machine
      spec = getattr(sys.modules.get("__main__"), "__spec__", None)
      prog = f"python -m {getattr(spec, 'name', None) or 'experiments'}"
      sys.stderr.write(f"{prog}: error: {e}\n({prog} --helpshort lists the flags)\n")
      return e.exitcode

  return wrapped


def run(main) -> None:
  """`absl.app.run(main)` without absl's help dump on a usage error raised in `main`."""
  app.run(without_usage_dump(main))


def command(module: str) -> str:
  """`python -m <module> <this process's arguments>`, shell-quoted (for results files)."""
  return " ".join(shlex.quote(a) for a in ["python", "-m", module] + sys.argv[1:])


def write_json(path, obj, **kwargs) -> pathlib.Path:
  """Writes `json.dumps(obj, indent=1, **kwargs)` at `path` (folders created); returns the path."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(obj, indent=1, **kwargs))
  return path
