"""The package's layers import only downward, and nothing imports tests/."""
from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
LAYERS = ["core", "data", "io", "index", "agent", "experiment"]  # each may import only those before it


def _imports(path: pathlib.Path):
  """Every `ear_jax...` / `tests...` module a file imports (at any depth, incl. function-level)."""
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      yield from (a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      yield node.module
      yield from (f"{node.module}.{a.name}" for a in node.names)


def _layer(module: str):
  parts = module.split(".")
  return parts[1] if len(parts) > 1 and parts[0] == "ear_jax" and parts[1] in LAYERS else None


def test_every_layer_imports_only_from_layers_below_it():
  bad = []
  for layer in LAYERS:
    allowed = set(LAYERS[:LAYERS.index(layer) + 1])
    for path in sorted((REPO / "ear_jax" / layer).rglob("*.py")):
      for module in _imports(path):
        target = _layer(module)
        if target is not None and target not in allowed:
          bad.append(f"{path.relative_to(REPO)} imports {module} (layer {target} above {layer})")
  assert not bad, "\n".join(bad)
  assert len(list((REPO / "ear_jax").glob("*/"))) >= len(LAYERS)


def test_no_library_module_or_program_imports_tests():
  offenders = [f"{p.relative_to(REPO)}: {m}"
               for folder in ("ear_jax", "experiments") for p in (REPO / folder).rglob("*.py")
               for m in _imports(p) if m == "tests" or m.startswith("tests.")]
  assert not offenders, offenders


def test_importing_ear_jax_imports_no_experiment_code_and_not_nltk():
  # The package's table of contents (`ear_jax/__init__`) reaches trained adapters through io/;
  # nltk (half a second) is imported when an answer is first stemmed.
  code = ("import sys, ear_jax; print(sorted(m for m in sys.modules "
          "if m.startswith(('ear_jax.experiment', 'nltk'))))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
  assert out.stdout.strip() == "[]", out.stdout


def test_the_layer_checker_catches_an_upward_import(tmp_path):
  f = tmp_path / "x.py"
  f.write_text("def f():\n  from ear_jax.experiment import runner\n")
  assert "ear_jax.experiment" in set(_imports(f))
  assert _layer("ear_jax.experiment.runner") == "experiment" and _layer("numpy") is None


def _import_graph(package: str):
  """`module -> {modules of the package it imports}` inside `ear_jax/<package>` (subpackages
  included, a package as its `__init__`; every import, any depth, also the ones under
  `if TYPE_CHECKING:`: a type-only import still ties the two modules together). Modules are
  named by their path under the package without '.py' ('memory/front', 'memory/__init__')."""
  root = REPO / "ear_jax" / package
  files = {str(p.relative_to(root).with_suffix("")): p for p in root.rglob("*.py")}

  def resolve(module: str):
    parts = module.split(".")
    if parts[:2] != ["ear_jax", package]:
      return None
    rest = parts[2:]
    for n in range(len(rest), 0, -1):  # the longest prefix that is a module or a package
      name = "/".join(rest[:n])
      if name in files:
        return name
      if f"{name}/__init__" in files:
        return f"{name}/__init__"
    return None

  def deps_of(path):
    """`from pkg import sub` depends on `sub` (a module) or on `pkg` (a name defined there)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        yield from (resolve(a.name) for a in node.names)
      elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        yield from (resolve(f"{node.module}.{a.name}") for a in node.names)

  return {name: set(deps_of(path)) - {None, name} for name, path in files.items()}


def _core_import_graph():
  return _import_graph("core")


def _cycles(graph):
  """The modules that reach themselves through imports."""
  def reach(start):
    seen, todo = set(), [start]
    while todo:
      for nxt in graph.get(todo.pop(), ()):
        if nxt not in seen:
          seen.add(nxt)
          todo.append(nxt)
    return seen
  return sorted(m for m in graph if m in reach(m))


def test_the_core_has_no_import_circle():
  graph = _core_import_graph()
  assert {"config", "buffer", "policies", "learner", "types"} <= set(graph)
  assert not _cycles(graph), {m: sorted(graph[m]) for m in _cycles(graph)}
  assert not graph["types"], "core/types.py imports nothing from ear_jax"


def test_the_agent_layer_has_no_import_circle_and_llm_is_independent_of_memory():
  graph = _import_graph("agent")
  assert {"memory/front", "memory/bank", "llm/critic", "mcp_server"} <= set(graph)
  assert not _cycles(graph), {m: sorted(graph[m]) for m in _cycles(graph)}
  llm_uses_memory = {m: sorted(d for d in deps if d.startswith("memory/"))
                     for m, deps in graph.items() if m.startswith("llm/")}
  assert not any(llm_uses_memory.values()), llm_uses_memory
  # inside memory/, only the package's __init__ imports the front
  assert {m for m, deps in graph.items() if "memory/front" in deps} == {"memory/__init__"}
  # and each module imports only those before it (the order of `ear_jax/agent/memory/__init__.py`)
  order = ["checks", "table", "bank", "scopes", "lexical_bank", "persistence", "rows",
           "encoder_slot", "config", "episode", "sessions", "registry", "driver", "learning",
           "recall", "batcher", "staging", "front", "__init__"]
  assert {m for m in graph if m.startswith("memory/")} == {f"memory/{m}" for m in order}
  upward = [f"{m} imports {d}" for i, m in enumerate(order) for d in graph[f"memory/{m}"]
            if d.startswith("memory/") and order.index(d.split("/")[1]) >= i]
  assert not upward, upward


def test_the_cycle_checker_finds_a_circle():
  assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == ["a", "b"]
  assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_public_face_is_small_and_callers_jit():
  import ear_jax  # pylint: disable=import-outside-toplevel
  assert len(ear_jax.__all__) <= 30, len(ear_jax.__all__)
  assert len(set(ear_jax.__all__)) == len(ear_jax.__all__)
  assert not [n for n in ear_jax.__all__ if n.endswith("_jit")]
  assert all(hasattr(ear_jax, n) for n in ear_jax.__all__)
  # no module-level `*_jit` twin anywhere in the library (callers jit, as with optax / rlax)
  twins = [f"{p.relative_to(REPO)}: {t.id}" for p in (REPO / "ear_jax").rglob("*.py")
           for node in ast.parse(p.read_text()).body if isinstance(node, ast.Assign)
           for t in node.targets if isinstance(t, ast.Name) and t.id.endswith("_jit")
           and not t.id.startswith("_")]
  assert not twins, twins


_MEMORY_NAMES = ("memory", "mem", "m")  # what a `Memory` is called outside its module


def _private_memory_reads(path: pathlib.Path, root: pathlib.Path = REPO) -> list[str]:
  """`<x>._name` reads where `<x>` is `memory`, `mem`, `m`, or an attribute `.memory` (e.g.
  `self.memory._bank`, `service.memory._lock`): a conservative stand-in for "a `_`-prefixed
  attribute of a `Memory`"."""
  out = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
            and not node.attr.startswith("__")):
      continue
    obj = node.value
    if ((isinstance(obj, ast.Name) and obj.id in _MEMORY_NAMES)
        or (isinstance(obj, ast.Attribute) and obj.attr == "memory")):
      out.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
  return out


def test_no_module_but_the_front_reads_a_private_attribute_of_memory():
  front = REPO / "ear_jax" / "agent" / "memory" / "front.py"
  bad = [hit for folder in ("ear_jax", "experiments") for p in sorted((REPO / folder).rglob("*.py"))
         if p != front for hit in _private_memory_reads(p)]
  assert not bad, "\n".join(bad)


def test_the_private_read_checker_catches_one(tmp_path):
  f = tmp_path / "x.py"
  f.write_text("def f(memory, service, mem):\n  memory._bank\n  service.memory._lock\n"
               "  m.__len__\n  mem.stats\n  other._x\n")
  hits = [h.split(": ", 1)[1] for h in _private_memory_reads(f, tmp_path)]
  assert hits == ["memory._bank", "service.memory._lock"]


def test_memory_has_at_most_15_public_members():
  from ear_jax.agent.memory import Memory  # pylint: disable=import-outside-toplevel
  public = [n for n in dir(Memory) if not n.startswith("_")]
  assert len(public) <= 15, public
