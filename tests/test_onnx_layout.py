"""The layout an ONNX file runs its convolutions in: read back as written (onnx_layout)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from taso_jax.frontends.onnx_io import export_onnx, load_onnx
from taso_jax.frontends.onnx_layout import in_layout, runs_channels_last
from taso_jax.ir.executor import compile_graph
from taso_jax.ir.layout import to_nhwc


def _conv_model(channels_last: bool, mixed: bool = False) -> onnx.ModelProto:
    """Two 3x3 convolutions with a ReLU between, on ``x [1, 8, 8, 4]`` (NHWC, as tf2onnx
    writes a TensorFlow model: each ``Conv`` between transposes) or ``x [1, 4, 8, 8]``
    (NCHW). ``mixed``: the second convolution reads its input straight (NCHW)."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((6, 4, 3, 3)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((5, 6, 3, 3)).astype(np.float32), "w2")
    pads = {"pads": [1, 1, 1, 1]}
    if channels_last:
        nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 3, 1, 2]),
                 helper.make_node("Conv", ["xt", "w1"], ["c1"], **pads),
                 helper.make_node("Transpose", ["c1"], ["c1t"], perm=[0, 2, 3, 1]),
                 helper.make_node("Relu", ["c1t"], ["r"])]
        if mixed:
            nodes += [helper.make_node("Transpose", ["r"], ["rt"], perm=[0, 3, 1, 2]),
                      helper.make_node("Relu", ["rt"], ["rr"]),
                      helper.make_node("Conv", ["rr", "w2"], ["c2"], **pads),
                      helper.make_node("Transpose", ["c2"], ["y"], perm=[0, 2, 3, 1])]
        else:
            nodes += [helper.make_node("Transpose", ["r"], ["rt"], perm=[0, 3, 1, 2]),
                      helper.make_node("Conv", ["rt", "w2"], ["c2"], **pads),
                      helper.make_node("Transpose", ["c2"], ["y"], perm=[0, 2, 3, 1])]
        shape_in, shape_out = [1, 8, 8, 4], [1, 8, 8, 5]
    else:
        nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], **pads),
                 helper.make_node("Relu", ["c1"], ["r"]),
                 helper.make_node("Conv", ["r", "w2"], ["y"], **pads)]
        shape_in, shape_out = [1, 4, 8, 8], [1, 5, 8, 8]
    graph = helper.make_graph(
        nodes, "convs", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape_in)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape_out)], [w1, w2])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _ort(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def _ops(graph) -> set:
    return {n.op for n in graph.nodes} & {"conv2d", "conv2d_nhwc"}


@pytest.mark.parametrize("scale", [1.0, 100.0])
def test_a_channels_last_file_imports_in_nhwc_and_runs_as_onnxruntime_does(scale):
    model = _conv_model(channels_last=True)
    assert runs_channels_last(model)
    g = load_onnx(model)
    assert g.meta["channels_last"] and _ops(g) == {"conv2d_nhwc"}
    canonical = load_onnx(model, layout="nchw")  # the search's reading: the rules' form
    assert canonical.meta["channels_last"] and _ops(canonical) == {"conv2d"}
    x = (scale * np.random.default_rng(1).standard_normal((1, 8, 8, 4))).astype(np.float32)
    want = _ort(model, x)
    for graph in (g, canonical):
        np.testing.assert_allclose(np.asarray(compile_graph(graph)(x)[0]), want,
                                   rtol=1e-4, atol=1e-4 * scale)


def test_an_nchw_file_and_a_mixed_one_import_in_nchw():
    for model in (_conv_model(channels_last=False), _conv_model(True, mixed=True)):
        assert not runs_channels_last(model)
        g = load_onnx(model)
        assert not g.meta["channels_last"] and _ops(g) == {"conv2d"}


def test_a_graph_put_in_nhwc_is_written_as_transposed_convolutions_and_read_back_in_nhwc():
    model = _conv_model(channels_last=False)
    g = load_onnx(model)
    written = export_onnx(to_nhwc(g))
    assert runs_channels_last(written)  # ONNX's Conv is NCHW: each one between transposes
    back = load_onnx(written)
    assert _ops(back) == {"conv2d_nhwc"}
    x = np.random.default_rng(2).standard_normal((1, 4, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(_ort(written, x), _ort(model, x), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(compile_graph(back)(x)[0]), _ort(model, x),
                               rtol=1e-4, atol=1e-4)


def test_in_layout_refuses_an_unknown_layout():
    g = load_onnx(_conv_model(channels_last=True), layout="nchw")
    assert in_layout(g, "nchw") is g
    assert _ops(in_layout(g, "file")) == {"conv2d_nhwc"}
    with pytest.raises(ValueError, match="layout must be one of"):
        in_layout(g, "nhwc")
