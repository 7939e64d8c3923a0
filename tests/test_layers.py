"""The package's layers import only downward (BUILD_NOTES "Architecture"), and nothing imports tests/."""
from __future__ import annotations

import ast
import pathlib

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


def test_the_layer_checker_catches_an_upward_import(tmp_path):
  f = tmp_path / "x.py"
  f.write_text("def f():\n  from ear_jax.experiment import runner\n")
  assert "ear_jax.experiment" in set(_imports(f))
  assert _layer("ear_jax.experiment.runner") == "experiment" and _layer("numpy") is None


def _core_import_graph():
  """`module -> {core modules it imports}` inside `ear_jax/core` (every import, any depth, also the
  ones under `if TYPE_CHECKING:`: a type-only import still ties the two modules together)."""
  core = REPO / "ear_jax" / "core"
  names = {p.stem for p in core.glob("*.py")}
  graph = {}
  for path in core.glob("*.py"):
    deps = set()
    for module in _imports(path):
      parts = module.split(".")
      if parts[:2] == ["ear_jax", "core"] and len(parts) > 2 and parts[2] in names:
        deps.add(parts[2])
    graph[path.stem] = deps - {path.stem}
  return graph


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
