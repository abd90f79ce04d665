"""Targets are registered, not branched on (issue 59): a new runtime is one registration.

A toy target, "XLA with a fixed layout" (NCHW, no NHWC forms priced or timed), is defined
and registered here without editing any module of the package; the options, the Python API
and the command line take it by name, and the outcome reads its runtime from it.
"""

from __future__ import annotations

import ast
import json
from functools import partial
from pathlib import Path

import pytest
import taso_jax.search.options as options_module
from taso_jax.search.choose import choose_fastest

import taso_jax.targets as targets
from taso_jax.cli import main
from taso_jax.examples import nasrnn_cells
from taso_jax.optimizer import Optimizer
from taso_jax.targets.xla import XlaTarget

ROOT = Path(__file__).parent.parent


class FixedLayoutXla(XlaTarget):
    """XLA, its graphs kept in the layout they came in (no NHWC forms)."""

    name = "xla_fixed_layout"

    def cost_model(self, options):
        return super().cost_model(options.replace(layout_candidates=False))

    def chooser(self, options):
        return partial(choose_fastest, layouts=False)


@pytest.fixture
def toy(monkeypatch):
    """The toy target registered for one test; the registry as it was afterwards."""
    monkeypatch.setattr(targets, "_FACTORIES", dict(targets._FACTORIES))
    monkeypatch.setattr(options_module, "TARGETS", options_module.TARGETS)
    targets.register_target(FixedLayoutXla.name, FixedLayoutXla)
    return FixedLayoutXla.name


def test_a_registered_target_runs_through_the_python_api(toy):
    assert toy in targets.target_names()
    optimizer = Optimizer(target=toy, cost_model="analytic", budget=5, end_to_end=0)
    assert isinstance(optimizer.target, FixedLayoutXla)
    outcome = optimizer.run(nasrnn_cells(hidden=8, steps=1))
    assert outcome.report["target"] == toy
    if outcome.speedup is not None and not outcome.verdict.delivers_input:
        assert "faster under jax.jit" in outcome.to_text().splitlines()[0]


def test_a_registered_target_is_a_command_line_choice(toy, tmp_path, capsys):
    report = tmp_path / "r.json"
    assert main(["optimize", "--target", toy, "--cost-model", "analytic", "--budget", "3",
                 "--end-to-end", "0", "-q", "--repeats", "3", "--json", str(report)]) == 0
    assert json.loads(report.read_text())["target"] == toy
    assert capsys.readouterr().out.startswith("result: ")


def test_an_unknown_target_is_refused_by_name():
    with pytest.raises(ValueError, match="target"):
        targets.make_target("no_such_runtime")
    with pytest.raises(ValueError, match="registered already"):
        targets.register_target("xla", FixedLayoutXla)


def test_every_built_in_target_answers_the_protocol():
    for name in targets.BUILTIN:
        t = targets.make_target(name)
        assert isinstance(t, targets.Target) and t.name == name


#: Modules that may name a target: the registry and the targets themselves.
_REGISTRY = ("taso_jax/targets/",)


def test_no_target_name_is_compared_outside_the_registry():
    """``== "xla"`` / ``"onnxruntime"`` branches decide nothing in the front doors or the
    search (which once chose its cost model's layouts by ``target == "xla"``)."""
    names = set(targets.BUILTIN)
    found = []
    for path in sorted([*(ROOT / "taso_jax").rglob("*.py"), *(ROOT / "search").rglob("*.py")]):
        rel = str(path.relative_to(ROOT))
        if rel.startswith(_REGISTRY):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                consts = [c for c in (node.left, *node.comparators)
                          if isinstance(c, ast.Constant) and c.value in names]
                if consts:
                    found.append(f"{rel}:{node.lineno}")
    assert not found, found
