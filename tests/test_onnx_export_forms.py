"""The forms the ONNX export writes for onnxruntime, and the zero states it leaves out (issue 62).

Each model here has an open size (a batch ``N`` or a length ``T``); every written file is
run in onnxruntime beside the original at two bindings of it. What the export must not do:

* write a zero ``initial_h`` of the bound batch size (the file then fails at another batch,
  as it did on main at f2966a4 for an LSTM or GRU whose state the file left absent);
* compute, at run time, a zero state PyTorch writes as ``ConstantOfShape(Shape(x))``, a
  size an ``Expand`` input already has, or a slice's bound counted from an open end;
* write a product and its bias as ``MatMul`` and ``Add`` on a 3-D input, which onnxruntime
  runs as two kernels.
"""

from __future__ import annotations

import numpy as np
import pytest

HID, INP = 16, 8


def _gru_model(state: str, value: float = 0.0, activations=None):
    """``GRU(x)``, ``x`` ``[T, N, I]``; ``state``: "absent", or "shape" (PyTorch's default
    ``h0 = zeros(1, N, H)``: ``ConstantOfShape`` of sizes read from ``x``, then a ``Slice``
    of its one layer), filled with ``value``. ``activations`` other than the defaults keep
    the GRU opaque on import."""
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    rng = np.random.default_rng(0)
    inits = [nh.from_array(rng.standard_normal((1, 3 * HID, INP)).astype(np.float32), "W"),
             nh.from_array(rng.standard_normal((1, 3 * HID, HID)).astype(np.float32), "R"),
             nh.from_array(np.array([1], np.int64), "one"),
             nh.from_array(np.array([0], np.int64), "zero"),
             nh.from_array(np.array([1], np.int64), "layers"),
             nh.from_array(np.array([HID], np.int64), "hidden")]
    nodes, ins = [], ["x", "W", "R"]
    if state == "shape":
        nodes += [h.make_node("Shape", ["x"], ["s"]),
                  h.make_node("Gather", ["s", "one"], ["n"], axis=0),
                  h.make_node("Concat", ["layers", "n", "hidden"], ["sizes"], axis=0),
                  h.make_node("ConstantOfShape", ["sizes"], ["zeros"],
                              value=nh.from_array(np.array([value], np.float32))),
                  h.make_node("Slice", ["zeros", "zero", "one", "zero"], ["h0"])]
        ins += ["", "", "h0"]
    more = {"activations": activations} if activations else {}
    nodes.append(h.make_node("GRU", ins, ["Y", "Yh"], hidden_size=HID, **more))
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, ["T", "N", INP])],
                         [h.make_tensor_value_info("Y", T.FLOAT, ["T", 1, "N", HID]),
                          h.make_tensor_value_info("Yh", T.FLOAT, [1, "N", HID])], inits)
    return _checked(graph, 17)


def _checked(graph, opset: int):
    """The model of ``graph`` at ``opset`` (IR version 8), checked by ``onnx.checker``."""
    import onnx
    from onnx import helper as h

    m = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def _run(model, feeds: dict) -> list:
    import onnxruntime as ort

    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, feeds)


def _written(model, tmp_path):
    """The cleaned-up graph of ``model`` as the export writes it, its open sizes kept."""
    import onnx

    from taso_jax.frontends.onnx_io import export_onnx, load_onnx, with_symbolic_dims

    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    graph = load_onnx(str(path))
    return graph, with_symbolic_dims(export_onnx(graph), graph.meta["symbolic_dims"])


def _ops(model) -> list[str]:
    return [n.op_type for n in model.graph.node]


def _same_at(original, written, name: str, shapes) -> None:
    for shape in shapes:
        x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
        for a, b in zip(_run(original, {name: x}), _run(written, {name: x}), strict=True):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


def test_a_pytorch_default_state_is_computed_by_nothing_and_the_file_runs_at_every_batch(
        tmp_path):
    original = _gru_model("shape")
    graph, written = _written(original, tmp_path)
    assert graph.meta["cleanup"]["zero_recurrent_input"] == 1
    assert _ops(written) == ["GRU"]
    (gru,) = written.graph.node
    assert list(gru.input) == ["x", "W", "R"]  # B and initial_h absent: zero
    assert {i.name for i in written.graph.initializer} == {"W", "R"}  # no unread zeros
    _same_at(original, written, "x", [(1, 1, INP), (5, 3, INP)])


def test_an_opaque_recurrence_reads_no_zero_state_either(tmp_path):
    original = _gru_model("shape", activations=["Sigmoid", "Relu"])
    graph, written = _written(original, tmp_path)
    assert any(n.op == "opaque" and n.attr("call").label == "GRU" for n in graph.nodes)
    assert graph.meta["cleanup"]["zero_recurrent_input"] == 1
    assert _ops(written) == ["GRU"]
    (gru,) = written.graph.node
    assert [x for x in gru.input if x] == ["x", "W", "R"]
    _same_at(original, written, "x", [(1, 1, INP), (5, 3, INP)])


def test_a_state_the_file_left_absent_is_not_written_at_the_bound_batch(tmp_path):
    original = _gru_model("absent")
    _, written = _written(original, tmp_path)
    (gru,) = written.graph.node
    assert list(gru.input) == ["x", "W", "R"]
    _same_at(original, written, "x", [(1, 1, INP), (4, 3, INP)])


def test_a_state_of_another_value_is_kept():
    from taso_jax.frontends.onnx_cleanup import drop_zero_states, is_zero
    from taso_jax.frontends.onnx_io import load_onnx

    model = _gru_model("shape", value=0.5)
    graph = load_onnx(model)
    (gru,) = [n for n in graph.nodes if n.op == "gru"]
    assert not is_zero(gru.inputs[4], graph.weights)
    same, counts = drop_zero_states(graph)
    assert same is graph and not counts


def _expand_slice_model():
    """``y = Expand(b, [1, N, 8])`` of a ``[1, N, 1]`` tensor and ``z = x[:, N-3:N-1, :]``,
    ``x`` ``[1, N, 8]`` with ``N`` open."""
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    inits = [nh.from_array(np.array([2], np.int64), "ax2"),
             nh.from_array(np.array([1], np.int64), "ax1"),
             nh.from_array(np.array([-3], np.int64), "start"),
             nh.from_array(np.array([-1], np.int64), "end")]
    nodes = [h.make_node("ReduceMax", ["x", "ax2"], ["b"], keepdims=1),
             h.make_node("Shape", ["x"], ["s"]),
             h.make_node("Expand", ["b", "s"], ["y"]),
             h.make_node("Slice", ["x", "start", "end", "ax1"], ["z"])]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, [1, "N", 8])],
                         [h.make_tensor_value_info("y", T.FLOAT, [1, "N", 8]),
                          h.make_tensor_value_info("z", T.FLOAT, [1, 2, 8])], inits)
    return _checked(graph, 18)


def test_expand_and_a_slice_from_an_open_end_read_no_size_at_run_time(tmp_path):
    original = _expand_slice_model()
    _, written = _written(original, tmp_path)
    ops = _ops(written)
    assert "Shape" not in ops and "Expand" in ops and "Slice" in ops, ops
    (sl,) = [n for n in written.graph.node if n.op_type == "Slice"]
    from onnx import numpy_helper

    values = {i.name: numpy_helper.to_array(i) for i in written.graph.initializer}
    assert values[sl.input[1]].tolist() == [-3] and values[sl.input[2]].tolist() == [-1]
    assert values[sl.input[3]].tolist() == [1]  # the one axis it narrows
    _same_at(original, written, "x", [(1, 4, 8), (1, 9, 8)])


def _linear_model():
    """``MatMul(x, W) + b``, ``x`` ``[1, T, 32]``, ``T`` open: a PyTorch ``Linear``."""
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    rng = np.random.default_rng(0)
    inits = [nh.from_array(rng.standard_normal((32, 24)).astype(np.float32), "W"),
             nh.from_array(rng.standard_normal(24).astype(np.float32), "b")]
    nodes = [h.make_node("MatMul", ["x", "W"], ["p"]), h.make_node("Add", ["b", "p"], ["q"]),
             h.make_node("Relu", ["q"], ["y"])]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, [1, "T", 32])],
                         [h.make_tensor_value_info("y", T.FLOAT, [1, "T", 24])], inits)
    return _checked(graph, 17)


def test_a_product_and_its_bias_on_a_3d_input_are_written_as_one_gemm(tmp_path):
    original = _linear_model()
    _, written = _written(original, tmp_path)
    ops = _ops(written)
    assert ops.count("Gemm") == 1 and "MatMul" not in ops and "Add" not in ops, ops
    assert "Shape" not in ops  # the open length is written as -1
    _same_at(original, written, "x", [(1, 1, 32), (1, 7, 32)])


@pytest.mark.parametrize("seconds, least", [(None, 20), (0.3, 21)])
def test_cheap_models_are_timed_over_a_span_of_seconds(seconds, least):
    from taso_jax.frontends.onnxruntime_target import time_onnx_models

    model = _linear_model().SerializeToString()
    x = np.zeros((1, 4, 32), np.float32)
    times = time_onnx_models([model, model], {"x": x}, repeats=20, seconds=seconds)
    assert len(times[0]) == len(times[1])
    assert len(times[0]) >= least if seconds else len(times[0]) == least


def test_a_size_read_at_run_time_is_counted_only_where_it_is_fixed(tmp_path):
    """``fixed_sizes_read``, the benchmark's check of written files: ``Shape`` of a ``[1, 4]``
    sum counts, ``Shape`` of the ``[N, 4]`` input does not; the export of the Expand-and-
    Slice model above reads none."""
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    from taso_jax.frontends.onnx_cleanup import fixed_sizes_read

    nodes = [h.make_node("ReduceSum", ["x", "ax"], ["r"], keepdims=1),
             h.make_node("Shape", ["r"], ["fixed"]), h.make_node("Shape", ["x"], ["open"])]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, ["N", 4])],
                         [h.make_tensor_value_info("fixed", T.INT64, [2]),
                          h.make_tensor_value_info("open", T.INT64, [2])],
                         [nh.from_array(np.array([0], np.int64), "ax")])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    assert fixed_sizes_read(model) == 1
    original = _expand_slice_model()
    assert "Shape" in _ops(original)
    assert fixed_sizes_read(_written(original, tmp_path)[1]) == 0


def test_two_reshapes_equal_only_at_the_binding_stay_two_nodes():
    """``[1, 1, N]`` to ``(1, 1, N, 1)`` and to ``(1, 1, 1, N)`` are one shape at ``N = 1``;
    hash-consing keeps them apart by their sizes' expressions (a MiniLM's attention mask
    read the one as the other on main at f2966a4)."""
    from taso_jax.ops import TensorType
    from taso_jax.ops.dims import Dim, symbol

    from taso_jax.ir.graph import leaf_node, make_node

    n = Dim(1, symbol("N"))
    x = leaf_node("input", "x", TensorType((1, 1, n), "float32")).outputs[0]
    a = make_node("reshape", [x], {"shape": (1, 1, n, 1)})
    b = make_node("reshape", [x], {"shape": (1, 1, 1, n)})
    assert a is not b
    assert make_node("reshape", [x], {"shape": (1, 1, n, 1)}) is a


def _position_model():
    """``x + E[positions[:, :T]]``: a BERT position embedding, ``x`` ``[1, T, 8]``, the ids
    sliced to the input's length ``T`` (open) from a ``[1, 16]`` table of positions."""
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    rng = np.random.default_rng(0)
    inits = [nh.from_array(np.arange(16, dtype=np.int64)[None], "positions"),
             nh.from_array(rng.standard_normal((16, 8)).astype(np.float32), "E"),
             nh.from_array(np.array([1], np.int64), "one"),
             nh.from_array(np.array([0], np.int64), "zero"),
             nh.from_array(np.array([2], np.int64), "two")]
    nodes = [h.make_node("Shape", ["x"], ["s"]),
             h.make_node("Slice", ["s", "one", "two"], ["t"]),
             h.make_node("Slice", ["positions", "zero", "t", "one"], ["ids"]),
             h.make_node("Gather", ["E", "ids"], ["pe"], axis=0),
             h.make_node("Add", ["x", "pe"], ["y"])]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, [1, "T", 8])],
                         [h.make_tensor_value_info("y", T.FLOAT, [1, "T", 8])], inits)
    return _checked(graph, 17)


def test_a_weight_slice_to_an_open_length_is_computed_at_run_time(tmp_path):
    original = _position_model()
    graph, written = _written(original, tmp_path)
    assert any(n.op == "gather" and n.weight_only for n in graph.nodes)
    assert "Gather" in _ops(written)  # not one constant of the bound length
    _same_at(original, written, "x", [(1, 1, 8), (1, 5, 8)])
