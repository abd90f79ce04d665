"""Deployed ONNX models that this project did not export (``tests/data/real``): each loads
with no flags, optimizes for both targets, and the written file matches the original in
onnxruntime; the input file is never changed."""

from __future__ import annotations

import hashlib
from pathlib import Path

import onnx
import pytest

from taso_jax.cli import main

REAL = Path(__file__).parent / "data" / "real"
MODELS = sorted(p.name for p in REAL.glob("*.onnx"))


def _digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_the_real_models_are_here():
    assert MODELS == ["ppocr_mobile_v2.0_cls.onnx", "silero_vad.onnx",
                      "silero_vad_16k_sequence.onnx"]


@pytest.mark.parametrize("target", ["xla", "onnxruntime"])
@pytest.mark.parametrize("name", MODELS)
def test_a_real_model_optimizes_without_flags_and_matches(name, target, tmp_path, capsys):
    src = REAL / name
    before = _digest(src)
    out = tmp_path / "out.onnx"
    args = ["optimize", str(src), "-o", str(out), "--target", target, "--cost-model",
            "analytic", "--budget", "10", "--repeats", "3", "-q"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert _digest(src) == before
    onnx.checker.check_model(onnx.load(out), full_check=True)
    if "byte-for-byte copy of the input" in text:
        assert out.read_bytes() == src.read_bytes()
    else:  # rewritten: it was checked against the original in onnxruntime
        assert "output check (onnxruntime" in text and ": ok" in text
