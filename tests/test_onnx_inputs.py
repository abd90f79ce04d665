"""Inputs a model can run on: index ranges derived from the graph, and the size probe.

Small models built with ``onnx.helper``; every drawn input is run in onnxruntime, the
independent executor, which refuses an index out of range or a bad sequence length.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from taso_jax.frontends.onnx_io import load_onnx
from taso_jax.frontends.onnx_shapes import MORE_PROBE_SECONDS
from taso_jax.frontends.onnx_tensor_types import index_bounds, static_types
from taso_jax.ir.executor import random_inputs


def _model(nodes, inputs, outputs, inits=(), value_info=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits),
                              value_info=list(value_info))
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def _bounds(m):
    inferred = onnx.shape_inference.infer_shapes(m)
    return index_bounds(m, static_types(inferred))


def _runs_on_drawn_inputs(m, graph, seeds=(0, 1, 2)):
    """The model runs in onnxruntime on the inputs the project draws for it."""
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    for seed in seeds:
        feeds = dict(zip((n.name for n in graph.inputs), random_inputs(graph, seed=seed),
                         strict=True))
        sess.run(None, feeds)
    return feeds


def _table(name, rows, cols=3):
    return numpy_helper.from_array(
        np.arange(rows * cols, dtype=np.float32).reshape(rows, cols), name)


def test_gather_on_an_initializer_bounds_ids_by_its_rows():
    m = _model([helper.make_node("Gather", ["table", "ids"], ["y"], axis=0)],
               [helper.make_tensor_value_info("ids", TensorProto.INT64, [6])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [6, 3])],
               [_table("table", 5)])
    assert _bounds(m) == {"ids": 5}
    g = load_onnx(m)
    assert g.meta["integer_input_bounds"] == {"ids": 5}
    feeds = _runs_on_drawn_inputs(m, g)
    assert feeds["ids"].min() >= 0 and feeds["ids"].max() < 5


def test_gather_on_an_inputs_open_axis_is_bounded_after_binding():
    m = _model([helper.make_node("Gather", ["x", "ids"], ["y"], axis=0)],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4]),
                helper.make_tensor_value_info("ids", TensorProto.INT64, [10])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [10, 4])])
    g = load_onnx(m, input_shapes={"x": (3, 4)})
    assert g.meta["integer_input_bounds"] == {"ids": 3}
    bound = onnx.ModelProto()
    bound.CopyFrom(m)
    bound.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 3
    _runs_on_drawn_inputs(bound, g)
    # unbound, the default binding (n = 1) lets only index 0 through
    assert load_onnx(m).meta["integer_input_bounds"] == {"ids": 1}


def test_ids_through_cast_unsqueeze_and_concat_reach_the_smallest_table():
    nodes = [helper.make_node("Cast", ["a"], ["a64"], to=TensorProto.INT64),
             helper.make_node("Unsqueeze", ["a64", "ax"], ["a2"]),
             helper.make_node("Concat", ["a2", "b"], ["ab"], axis=0),
             helper.make_node("Gather", ["table", "ab"], ["y"], axis=0),
             helper.make_node("Gather", ["small", "b"], ["z"], axis=0)]
    m = _model(nodes,
               [helper.make_tensor_value_info("a", TensorProto.INT32, [4]),
                helper.make_tensor_value_info("b", TensorProto.INT64, [1, 4])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 3]),
                helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 4, 3])],
               [_table("table", 6), _table("small", 3),
                numpy_helper.from_array(np.array([0], np.int64), "ax")])
    assert _bounds(m) == {"a": 6, "b": 3}
    _runs_on_drawn_inputs(m, load_onnx(m))


@pytest.mark.parametrize("axis", [1, -1])
def test_gather_elements_negative_axis_and_onehot_depth(axis):
    nodes = [helper.make_node("GatherElements", ["table", "idx"], ["y"], axis=axis),
             helper.make_node("OneHot", ["cls", "depth", "values"], ["h"])]
    m = _model(nodes,
               [helper.make_tensor_value_info("idx", TensorProto.INT64, [2, 4]),
                helper.make_tensor_value_info("cls", TensorProto.INT64, [3])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4]),
                helper.make_tensor_value_info("h", TensorProto.FLOAT, [3, 5])],
               [_table("table", 2, cols=7),
                numpy_helper.from_array(np.array(5, np.int64), "depth"),
                numpy_helper.from_array(np.array([0, 1], np.float32), "values")])
    # axis 1 (or -1) of the 2x7 table: indices below 7 (listed since 7 < 8); OneHot's below 5
    assert _bounds(m) == {"idx": 7, "cls": 5}
    g = load_onnx(m)
    feeds = _runs_on_drawn_inputs(m, g)
    assert feeds["cls"].max() < 5


def test_lstm_sequence_lengths_are_drawn_in_one_to_t_and_probed_at_t():
    hidden, steps = 4, 6
    w = numpy_helper.from_array(np.full((1, 4 * hidden, 3), 0.1, np.float32), "W")
    r = numpy_helper.from_array(np.full((1, 4 * hidden, hidden), 0.1, np.float32), "R")
    m = _model([helper.make_node("LSTM", ["x", "W", "R", "", "lens"], ["y"],
                                 hidden_size=hidden)],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["t", 2, 3]),
                helper.make_tensor_value_info("lens", TensorProto.INT32, [2])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["t", 1, 2, hidden])],
               [w, r])
    # onnxruntime refuses a length above T, which the default draw of ids, [0, 8), holds
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    with pytest.raises(Exception, match="sequence_lens"):
        sess.run(None, {"x": np.zeros((steps, 2, 3), np.float32),
                        "lens": np.array([steps + 1, 1], np.int32)})
    g = load_onnx(m, input_shapes={"x": (steps, 2, 3)})
    assert g.meta["integer_input_bounds"] == {"lens": range(1, steps + 1)}
    drawn = [random_inputs(g, seed=s)[1] for s in range(20)]
    assert min(d.min() for d in drawn) >= 1 and max(d.max() for d in drawn) <= steps
    _runs_on_drawn_inputs(m, g)
    assert load_onnx(m).inputs[0].types[0].shape[0] >= 1  # the default probe runs too


def _reshape_model(batch_rows, declared=None):
    """x [N, 8] reshaped to [batch_rows, 2, 4]: runs only at N = batch_rows."""
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                        declared or ["N", 2, 4])
    return _model([helper.make_node("Reshape", ["x", "shape"], ["y"])],
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])], [out],
                  [numpy_helper.from_array(np.array([batch_rows, 2, 4], np.int64), "shape")])


def test_probe_finds_a_model_that_runs_only_at_batch_4():
    g = load_onnx(_reshape_model(4))
    assert g.inputs[0].types[0].shape == (4, 8)
    notes = g.meta["shape_notes"]
    assert any("picked batch 4" in n for n in notes), notes


def test_probe_reads_the_batch_size_the_file_declares():
    g = load_onnx(_reshape_model(20, declared=[20, 2, 4]))
    assert g.inputs[0].types[0].shape == (20, 8)
    assert any("batch 20 (a size the file's own shapes hold), after 1 more" in n
               for n in g.meta["shape_notes"]), g.meta["shape_notes"]


def test_probe_finds_an_ocr_text_line_of_height_32():
    # the recogniser flattens its 32-row text line into a fixed 32x320 sequence
    m = _model([helper.make_node("Reshape", ["x", "shape"], ["y"])],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                              ["batch", 1, "height", "width"])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 10240])],
               [numpy_helper.from_array(np.array([0, 32 * 320], np.int64), "shape")])
    g = load_onnx(m)
    assert g.inputs[0].types[0].shape == (1, 1, 32, 320)
    # 224, 64 and 32 squares were tried in the first round and are not tried again:
    # 320x320, 48x48, then 32x320
    assert any("picked batch 1 and image sides 32x320, after 3 more" in n
               for n in g.meta["shape_notes"]), g.meta["shape_notes"]


def test_probe_gives_up_within_its_bound_with_exit_2_material():
    # runs at no size the probe knows: one line naming the sizes, no traceback
    import time

    from taso_jax.frontends.onnx_model import ModelError

    start = time.perf_counter()
    with pytest.raises(ModelError, match="runs at none of the default sizes"):
        load_onnx(_reshape_model(7))
    assert time.perf_counter() - start < MORE_PROBE_SECONDS + 5


def test_an_input_with_an_initializer_stays_an_input_with_its_default(tmp_path):
    """Issue 60: an initializer named among the inputs (IR 4+) is a default the caller may
    override. It was read as a weight: ``(x @ (a + b)) @ s`` was reordered into ``x @ ((a +
    b) @ s)`` and ``s`` left the written model's inputs. It stays an input, written with its
    default, and the written model agrees with the original with and without it fed."""
    from taso_jax.cli import main

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32), n)
             for n in ("s", "a", "b")]
    nodes = [helper.make_node("MatMul", ["x", "a"], ["xa"]),
             helper.make_node("MatMul", ["x", "b"], ["xb"]),
             helper.make_node("Add", ["xa", "xb"], ["y0"]),
             helper.make_node("MatMul", ["y0", "s"], ["y"])]
    m = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4]),
                       helper.make_tensor_value_info("s", TensorProto.FLOAT, [4, 4])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], inits)
    src, out = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(m, src)
    graph = load_onnx(str(src))
    assert [n.name for n in graph.inputs] == ["x", "s"] and "s" not in graph.weights
    assert main(["optimize", str(src), "-o", str(out), "--cost-model", "analytic", "--budget",
                 "5", "-q", "--no-time", "--end-to-end", "0"]) == 0
    written = onnx.load(str(out))
    assert [i.name for i in written.graph.input] == ["x", "s"]
    assert "s" in {t.name for t in written.graph.initializer}
    assert "MatMul" in {n.op_type for n in written.graph.node}
    x = rng.standard_normal((1, 4)).astype(np.float32)
    s = rng.standard_normal((4, 4)).astype(np.float32)
    run = {p: ort.InferenceSession(str(p), providers=["CPUExecutionProvider"])
           for p in (src, out)}
    for feeds in ({"x": x}, {"x": x, "s": s}):
        want, got = (run[p].run(None, feeds)[0] for p in (src, out))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
