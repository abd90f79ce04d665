"""The README's commands are the ones CI runs, and the examples run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import model_path

ROOT = Path(__file__).parent.parent


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```(?:bash|sh)?\n(.*?)```", text, re.S).group(1)
    return [ln.strip() for ln in block.splitlines() if ln.strip() and not ln.startswith("#")]


def test_ci_runs_the_readme_test_commands():
    """CI runs README's two test commands, the fast tier then the slow one, as written."""
    from conftest import TIERS

    run_cmd, fast_cmd, slow_cmd = _readme_commands()[:3]
    assert "taso-jax optimize" in run_cmd
    assert "pytest" in fast_cmd and "--tier" not in fast_cmd  # the default tier: fast
    assert "pytest" in slow_cmd and slow_cmd.endswith("--tier=slow") and "slow" in TIERS
    # a line of .ci/run, or one with `|| exit` added (which stops it after a failed install)
    ci = [ln.removesuffix(" || exit") for ln in
          (ROOT / ".ci" / "run").read_text().splitlines()]
    assert fast_cmd in ci and slow_cmd in ci
    assert ci.index(fast_cmd) < ci.index(slow_cmd)
    assert "set -euo pipefail" in ci


@pytest.mark.slow
def test_builder_example_runs(tmp_path):
    out = tmp_path / "m.onnx"
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "builder_api.py"), str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "enlarge" in r.stdout and out.exists()


@pytest.mark.slow
def test_onnx_example_runs(tmp_path):
    out = tmp_path / "m.onnx"
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "optimize_onnx.py"),
                        str(model_path("hf_gpt2_tiny")), str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "'ok': True" in r.stdout and out.exists()


@pytest.mark.slow
def test_jax_decorator_example_runs():
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "jax_decorator.py"),
                        "--analytic"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "weights concatenated at run time: False" in r.stdout
    assert "merge-matmul-matmul" in r.stdout


@pytest.mark.slow
def test_new_operator_example_runs():
    """Declaring an operator is enough for generation, proof and search to use it."""
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "new_operator.py")],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "linear(x, w, b) = ewadd(matmul(x, w), b)  (holds on" in out
    assert re.search(r"ewadd\((b, matmul\(x, a\)|matmul\(x, a\), b)\)  =>  linear\(x, a, b\)",
                     out), out  # the fusion, found by generation
    proved, total = (int(v) for v in out.split("proved ")[1].split(" candidates")[0]
                     .split(" of "))
    assert 0 < proved <= total
    # the two layers merge into one linear with concatenated weights, and outputs agree
    assert "{'linear': 2," in out and "-> {'linear': 1," in out
    assert "merge-linear-linear" in out
    assert "onnxruntime, original vs optimized" in out and "ok: True" in out


def test_the_readme_options_table_is_the_options_record_rendered():
    from taso_jax.search.options import OptimizeOptions

    assert OptimizeOptions.markdown_table() in (ROOT / "README.md").read_text()
    # and --help gives each option's one description
    from taso_jax.cli import build_parser

    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["optimize"]
                         .format_help().split())
    for name in ("alpha", "budget", "time_limit", "end_to_end", "trust_proofs"):
        assert " ".join(OptimizeOptions.help(name).split()) in help_text
