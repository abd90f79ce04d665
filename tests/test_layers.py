"""The package's import layers point one way (issues 16, 59): ops <- ir <- search <- verify <-
frontends <- the pipeline <- the front doors <- the command line; ``taso_jax/__init__.py``
only re-exports.

Every ``import`` of a ``taso_jax`` module, at module level or inside a function, is read from
the source; a module may import its own layer and the layers below it, never one above.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import run_python

ROOT = Path(__file__).parent.parent

#: layer of each folder or module (higher imports lower)
LAYERS = {"taso_jax.ops": 0, "taso_jax._io": 0, "taso_jax._text": 0, "taso_jax._malloc": 0,
          "taso_jax._machine": 0, "taso_jax._compile_cache": 0,
          "taso_jax.ir": 1, "taso_jax.search": 2, "taso_jax.verify": 3,
          # import and export, runtimes: below the pipeline, never importing it (issue 59)
          "taso_jax.frontends": 4,
          # the delivery pipeline: targets, checks, records, the outcome and its rendering
          "taso_jax.checks": 5, "taso_jax.records": 5, "taso_jax.targets": 5,
          "taso_jax.outcome": 5, "taso_jax.report": 5, "taso_jax.optimizer": 5,
          "taso_jax.pipeline": 5, "taso_jax.rounding_cuts": 5,
          # the front doors
          "taso_jax.api": 6, "taso_jax.decorator": 6, "taso_jax.first_call": 6,
          "taso_jax.first_call_budget": 6, "taso_jax.first_call_check": 6,
          "taso_jax.first_call_timing": 6, "taso_jax.traced_source": 6, "taso_jax.call_trial": 6,
          "taso_jax.examples": 6, "taso_jax.bench": 6,
          "taso_jax.cli": 7, "taso_jax.cli_files": 7, "taso_jax.cli_timing": 7,
          "taso_jax.cli_optimize": 7, "taso_jax.cli_sizes": 7,
          "taso_jax": 8}
FOLDERS = {"ops": "taso_jax.ops", "search": "taso_jax.search", "verify": "taso_jax.verify",
           "taso_jax": "taso_jax"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    parts = [FOLDERS[rel.parts[0]].removeprefix("taso_jax").strip("."), *rel.parts[1:]]
    parts[-1] = parts[-1].removesuffix(".py")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["taso_jax", *[p for p in parts if p]])


def _layer(module: str) -> int:
    best = max((k for k in LAYERS if module == k or module.startswith(k + ".")), key=len)
    return LAYERS[best]


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name


def _package_files():
    for folder in FOLDERS:
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_imports_point_down_the_layers():
    upward = []
    for path in _package_files():
        me = _module_name(path)
        if me == "taso_jax":
            continue  # the package's __init__ re-exports from every layer
        for line, module in _imports(path):
            if module.split(".")[0] != "taso_jax":
                continue
            if module == "taso_jax":
                upward.append(f"{path.relative_to(ROOT)}:{line} imports the package itself")
            elif _layer(module) > _layer(me):
                upward.append(f"{path.relative_to(ROOT)}:{line} ({me}) imports {module}")
    assert not upward, "\n".join(upward)


def test_the_package_init_only_re_exports():
    tree = ast.parse((ROOT / "taso_jax" / "__init__.py").read_text())
    kinds = {type(node).__name__ for node in tree.body}
    assert kinds <= {"Expr", "ImportFrom", "Assign", "FunctionDef"}, kinds
    # the only functions are the module's lazy attribute hooks (PEP 562)
    assert {n.name for n in tree.body if isinstance(n, ast.FunctionDef)} <= {"__getattr__",
                                                                           "__dir__"}
    import importlib

    import taso_jax

    assert sorted(taso_jax.__all__) == sorted(taso_jax._EXPORTS)
    for name, module in taso_jax._EXPORTS.items():  # each name is its module's own object
        assert getattr(taso_jax, name) is getattr(importlib.import_module(module), name)
    with pytest.raises(AttributeError):
        taso_jax.no_such_name  # noqa: B018


def test_importing_the_package_does_not_import_jax():
    # JAX costs about 145 MB resident: loaded where a graph runs under it, not before
    code = ("import sys, taso_jax, taso_jax.ops, taso_jax.ir.executor, taso_jax.search, "
            "taso_jax.cli\nassert 'jax' not in sys.modules\n"
            "import taso_jax.ops as o\nassert 'jax' not in sys.modules\n"
            "import numpy as np\nx = o.OPS['ewadd'].ref(np.ones(2), np.ones(2))\n"
            "assert 'jax' in sys.modules and float(x.sum()) == 4.0\n")
    run_python(code, timeout=300)


def test_import_and_export_import_nothing_from_the_pipeline():
    """``frontends/`` sits below the pipeline (issue 59): no optimizer, outcome or report."""
    above = ("taso_jax.optimizer", "taso_jax.outcome", "taso_jax.report", "taso_jax.pipeline",
             "taso_jax.checks", "taso_jax.targets")
    found = [f"{path.relative_to(ROOT)}:{line} imports {module}"
             for path in sorted((ROOT / "taso_jax" / "frontends").rglob("*.py"))
             for line, module in _imports(path) if module.startswith(above)]
    assert not found, "\n".join(found)


def test_outcomes_are_made_in_one_module():
    """``Outcome(...)`` is called in ``taso_jax/outcome.py`` only (``make_outcome``)."""
    found = []
    for path in sorted((ROOT / "taso_jax").rglob("*.py")):
        if path.name == "outcome.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Outcome":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found


def test_outcomes_are_decided_in_the_pipeline():
    """``make_outcome`` is called in ``taso_jax/pipeline.py`` only (issue 59): every front
    door (the command line, the API, the decorator) gets its outcome from the pipeline."""
    found = []
    for path in sorted((ROOT / "taso_jax").rglob("*.py")):
        if path.name in ("outcome.py", "pipeline.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and "make_outcome" in (
                    getattr(node.func, "id", None), getattr(node.func, "attr", None)):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found
