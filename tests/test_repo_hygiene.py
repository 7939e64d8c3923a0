"""No machine-specific path anywhere in the repository; source that speaks of the code.

Every file git tracks, or would add (untracked and not ignored), is searched for absolute paths
under the top-level folders that name one machine's layout (`_MACHINE_ROOTS`: work, root, home,
Users, tmp, mnt, scratch, private, var/folders). Portable paths are fine: relative ones,
`~/.cache/...`, `$HOME/...`, system files (`/dev/null`, `/proc/cpuinfo`, `/usr/bin/time`) and URLs
(`https://host/...`). A test's temporary files come from pytest's `tmp_path`, data from
`$EAR_DATA_DIR` or `../shared/data` (tests/conftest.py).
"""
from __future__ import annotations

import pathlib
import re
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
# Top-level folders whose paths belong to one machine (joined here so this file has none itself).
_MACHINE_ROOTS = ("work", "root", "home", "Users", "tmp", "mnt", "scratch", "private",
                  "var" + "/folders")
# An absolute path: a slash not preceded by a word character, '.', '~', '$', ':' or '/' (so not a
# relative path, `~/x`, `$HOME/x`, or a URL), one of the roots, then a slash and a path character.
MACHINE_PATH = re.compile(r"(?<![\w.~$:/\\-])/(?:" + "|".join(map(re.escape, _MACHINE_ROOTS)) +
                          r")/[\w.~-]")


def machine_paths(text: str) -> list[tuple[int, str]]:
  """(line number, line) of every line of `text` holding a machine-specific absolute path."""
  return [(i, line.strip()) for i, line in enumerate(text.splitlines(), 1)
          if MACHINE_PATH.search(line)]


def _repo_files() -> list[pathlib.Path]:
  try:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=REPO, capture_output=True, check=True, timeout=60).stdout
  except (OSError, subprocess.CalledProcessError) as e:
    pytest.skip(f"not a git checkout ({e})")
  return sorted({REPO / p for p in out.decode("utf-8", "surrogateescape").split("\0") if p})


def test_no_file_of_the_repository_holds_a_machine_specific_path():
  offenders = []
  for path in _repo_files():
    if not path.is_file():  # deleted in the work tree, or a submodule
      continue
    data = path.read_bytes()
    if b"\0" in data[:8192]:  # binary
      continue
    for line_no, line in machine_paths(data.decode("utf-8", "replace")):
      offenders.append(f"{path.relative_to(REPO)}:{line_no}: {line[:160]}")
  assert not offenders, ("machine-specific absolute paths (use a relative path, tmp_path, "
                         "$EAR_DATA_DIR or ~/...):\n" + "\n".join(offenders))


@pytest.mark.parametrize("line", [
    'DATA = os.environ.get("EAR_DATA_DIR", "/' + 'work/shared/data")',
    "log: /" + "tmp/llm/install.log",
    "--workdir=/" + "tmp/runs/x",
    "cd /" + "home/alice/ear_jax",
    "open('/" + "root/.cache/x')",
    "/" + "Users/bob/data.json",
    "/" + "var/folders/ab/T/x",
])
def test_the_checker_finds_a_machine_path(line):
  assert machine_paths(line), line


@pytest.mark.parametrize("line", [
    "python x.py > /dev/null", "cat /proc/cpuinfo", "/usr/bin/time -v python -m x",
    "#!/usr/bin/env bash", "https://huggingface.co/datasets/x/work/y.json",
    "data in ~/.cache/ear_jax/data", "$HOME/work/x", "../shared/data", "runs/work/x",
    "see docs/tmp/notes", "ls /tmp", "file:///" + "tmp/x (a URL)",
])
def test_the_checker_allows_portable_paths(line):
  assert not machine_paths(line), line


# Numbered work history in source (an issue or a session cited by its number, a pointer to the
# build notes): the code says what it does; history lives in git.
HISTORY = re.compile(r"\b(?:[Ii]ssue|[Ss]ession) \d+\b(?! (?:of|holds|is|was|has|opened))|BUILD_NOTES")


def _sources():
  return sorted(p for top in ("ear_jax", "experiments") for p in (REPO / top).rglob("*.py"))


def test_source_names_no_work_history_and_module_docstrings_stay_short():
  import ast  # pylint: disable=g-import-not-at-top
  history, long_doc = [], []
  for path in _sources():
    text = path.read_text()
    history += [f"{path.relative_to(REPO)}:{i}" for i, line in enumerate(text.splitlines(), 1)
                if HISTORY.search(line)]
    doc = ast.get_docstring(ast.parse(text))
    if doc and len(doc.splitlines()) > 25:
      long_doc.append(f"{path.relative_to(REPO)} ({len(doc.splitlines())} lines)")
  assert not history, history
  assert not long_doc, long_doc


@pytest.mark.parametrize("line,bad", [("see BUILD_NOTES", True), ("(issue 27)", True),
                                      ("Session 16's choice", True), ("session 3 holds", False),
                                      ("the session's id", False)])
def test_the_history_checker(line, bad):
  assert bool(HISTORY.search(line)) == bad
