"""Models written by others that ship inside the ``onnx`` wheel
(``onnx/backend/test/data``): old PyTorch exports at opset 6, some of whose operators
onnxruntime no longer implements, and hand-built graphs that pass sequences between nodes.
Each goes through ``taso-jax optimize`` with no flags, and the written file, run in
onnxruntime on the wheel's own inputs, gives the wheel's expected outputs (recorded by the
exporter, not by us). ``benchmarks/onnx_backend_models.py`` runs all 140 of them."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from taso_jax.cli import main

DATA = Path(onnx.__file__).parent / "backend" / "test" / "data"

# (folder, whether onnxruntime itself runs the file as shipped)
CASES = [
    ("pytorch-converted/test_Conv2d", True),            # opset 6, Conv-1: onnxruntime runs it
    ("pytorch-converted/test_Conv2d_groups", True),
    ("pytorch-converted/test_Linear", False),           # Gemm-6: onnxruntime has no kernel
    ("pytorch-converted/test_BatchNorm2d_eval", False),  # BatchNormalization-6
    ("pytorch-operator/test_operator_add_broadcast", False),  # Add-6 with broadcast=1
    ("pytorch-converted/test_PReLU_2d_multiparam", False),  # PRelu-6, a slope per channel
    ("pytorch-operator/test_operator_chunk", True),
    ("simple/test_sequence_model1", True),  # SequenceEmpty -> SequenceInsert -> SequenceAt
    ("simple/test_sequence_model6", True),  # SplitToSequence -> SequenceLength
]


def _values(folder: Path, kind: str) -> list:
    files = sorted(folder.glob(f"{kind}_*.pb"), key=lambda p: int(p.stem.split("_")[1]))
    return [numpy_helper.to_array(onnx.TensorProto.FromString(p.read_bytes())) for p in files]


def _runs_in_onnxruntime(path: Path) -> bool:
    import onnxruntime as ort

    try:
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return True
    except Exception:  # noqa: BLE001 - the answer is the point
        return False


@pytest.mark.parametrize("case,runs_as_shipped", CASES, ids=[c for c, _ in CASES])
def test_an_onnx_wheel_model_optimizes_and_gives_the_recorded_outputs(case, runs_as_shipped,
                                                                    tmp_path, capsys):
    import onnxruntime as ort

    folder = DATA / case
    src = folder / "model.onnx"
    before = hashlib.sha256(src.read_bytes()).hexdigest()
    assert _runs_in_onnxruntime(src) == runs_as_shipped  # the case is what it says
    out = tmp_path / "out.onnx"
    assert main(["optimize", str(src), "-o", str(out), "--cost-model", "analytic",
                 "--budget", "10", "--repeats", "3", "-q"]) == 0
    text = capsys.readouterr().out
    assert hashlib.sha256(src.read_bytes()).hexdigest() == before
    if not runs_as_shipped:
        assert "onnxruntime does not run the model at its opset 6" in text
        assert "byte-for-byte" not in text
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    data = folder / "test_data_set_0"
    feeds = dict(zip((i.name for i in sess.get_inputs()), _values(data, "input"), strict=True))
    got = sess.run(None, feeds)
    want = _values(data, "output")
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-5 * max(1.0, float(np.abs(w).max())))


def test_a_graph_that_returns_a_sequence_is_refused_in_one_line(tmp_path):
    from onnx import TensorProto, helper

    import taso_jax

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    s = helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, [2, 3])
    model = helper.make_model(
        helper.make_graph([helper.make_node("SequenceConstruct", ["x", "x"], ["s"])], "g",
                          [x], [s]),
        opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    with pytest.raises(taso_jax.ModelError, match="output 's' is a sequence, not a tensor"):
        taso_jax.load_onnx(model)


def test_a_sequence_between_declared_operators_is_one_opaque_region(tmp_path):
    # relu -> SplitToSequence -> SequenceAt -> tanh: the two sequence nodes are one region,
    # and the declared operators around them stay in the IR
    from onnx import TensorProto, helper

    import taso_jax

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])
    idx = numpy_helper.from_array(np.array(2, np.int64), "idx")
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("SplitToSequence", ["r"], ["s"], axis=0, keepdims=1),
             helper.make_node("SequenceAt", ["s", "idx"], ["a"]),
             helper.make_node("Tanh", ["a"], ["y"])]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y], [idx]),
                              opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    g = taso_jax.load_onnx(model)
    ops = g.op_counts()
    assert ops.get("opaque") == 1 and ops.get("relu") == 1 and ops.get("tanh") == 1
    v = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    got = taso_jax.compile_graph(g)(v)
    got = got[0] if isinstance(got, (list, tuple)) else got
    np.testing.assert_allclose(np.asarray(got), np.tanh(np.maximum(v[2:3], 0)), rtol=1e-6)


@pytest.mark.parametrize("case,name,op", [("simple/test_expand_shape_model1", "shape", "Expand"),
                                          ("simple/test_sequence_model8", "Splits",
                                           "SplitToSequence")])
def test_a_model_whose_sizes_follow_input_values_passes_through_unchanged(case, name, op,
                                                                         tmp_path, capsys):
    # Expand's target shape, or the split sizes, come in as an input: the output sizes
    # follow its values, which a static-shape import cannot hold, and no --input-shape
    # helps. The model passes through whole, as an opaque region would: exit 0, the input
    # written back byte for byte, and the report names the input and the operator.
    import onnxruntime as ort

    src = DATA / case / "model.onnx"
    out, js = tmp_path / "out.onnx", tmp_path / "report.json"
    assert main(["optimize", str(src), "-o", str(out), "--json", str(js), "-q"]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "error" not in captured.err
    assert (f"not optimized: the values of input {name!r} (into {op}) set sizes"
            in captured.out)
    assert out.read_bytes() == src.read_bytes()
    import json

    report = json.loads(js.read_text())
    assert report["imported"] is False and report["written_copy_of_input"] is True
    # the copy gives the wheel's recorded outputs on its recorded inputs
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    feeds = dict(zip((i.name for i in sess.get_inputs()), _values(src.parent / "test_data_set_0",
                                                                  "input"), strict=True))
    for got, want in zip(sess.run(None, feeds), _values(src.parent / "test_data_set_0",
                                                        "output"), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_value_sized_model_onnxruntime_cannot_load_is_refused_in_one_line(tmp_path, capsys):
    # Passing a model through is only for one that runs: Expand's shape comes from an
    # input, and an operator of an unknown domain follows, so onnxruntime cannot load it.
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 1])
    shape = helper.make_tensor_value_info("shape", TensorProto.INT64, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b", "c"])
    nodes = [helper.make_node("Expand", ["x", "shape"], ["e"]),
             helper.make_node("Mystery", ["e"], ["y"], domain="com.example.nowhere")]
    model = helper.make_model(helper.make_graph(nodes, "g", [x, shape], [y]),
                              opset_imports=[helper.make_opsetid("", 17),
                                             helper.make_opsetid("com.example.nowhere", 1)],
                              ir_version=8)
    src = tmp_path / "m.onnx"
    onnx.save(model, src)
    out = tmp_path / "out.onnx"
    assert main(["optimize", str(src), "-o", str(out), "-q"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("taso-jax: error:"), err
    assert "onnxruntime cannot load the model" in err[0]
    assert not out.exists()
