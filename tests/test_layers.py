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
