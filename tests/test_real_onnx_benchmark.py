"""``benchmarks/real_onnx_models.py`` on two small models that ship in the onnx wheel.

The script runs ``taso-jax optimize`` in a subprocess per model and writes its markdown
table atomically; the test reads the table back.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import onnx
import pytest

DATA = Path(onnx.__file__).parent / "backend" / "test" / "data"
SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "real_onnx_models.py"


def _script():
    spec = importlib.util.spec_from_file_location("real_onnx_models", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_benchmark_writes_one_row_per_model_and_a_summary(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(DATA / "simple" / "test_single_relu_model" / "model.onnx",
                models / "relu.onnx")
    shutil.copy(DATA / "simple" / "test_sign_model" / "model.onnx", models / "sign.onnx")
    # an opset-6 PyTorch export: onnxruntime has no kernel for its Gemm-6, so the
    # benchmark's own measurements of it fail; the filter leaves it out
    shutil.copy(DATA / "pytorch-operator" / "test_operator_addmm" / "model.onnx",
                models / "addmm.onnx")
    bench = _script()
    assert [p.name for p in bench.model_paths([str(models)], "[rs]*")] == ["relu.onnx",
                                                                             "sign.onnx"]
    table = tmp_path / "table.md"
    code = bench.main([str(models), "--models", "[rs]*", "--time-limit", "5", "--repeats",
                       "3", "--out", str(table), "--out-dir", str(tmp_path / "out")])
    assert code == 0
    text = table.read_text()
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and "---" not in ln]
    assert rows[0] == bench.HEADER
    by_model = {r.split(" | ")[0][2:]: r.split(" | ") for r in rows[1:]}
    assert sorted(by_model) == ["relu", "sign"]  # addmm.onnx is filtered out
    for cells in by_model.values():
        assert cells[1] == "xla" and cells[2] == "0"  # target, exit code
        assert cells[3] in ("yes", "no") and cells[4] != "-"  # rewritten, verdict
        # a written file that is not the input's bytes was compared in onnxruntime
        assert cells[8] == "same file" or cells[8].startswith("yes")
    assert "2 runs; exit codes {0: 2}" in text
    assert not list(tmp_path.glob("*.tmp*"))  # written atomically, nothing left over
