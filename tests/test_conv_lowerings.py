"""Convolutions lowered to what XLA:CPU runs fast: depthwise ones as the sum of their kernel
taps (``conv2d_taps``), pointwise ones as a matrix product (``pointwise_matmul``), dense ones
as one matrix product over the columns of their kernel taps (``conv2d_im2col``).

Each rule turns its kind of ``conv2d`` (and only that) into its operator; the ONNX form
equals ONNX's own Conv in onnxruntime at other bindings of the model's open sizes, and
imports back without a convolution; on XLA:CPU the measured cost model chooses it.
"""

from __future__ import annotations

import jax
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from jax import lax
from onnx import TensorProto
from onnx import helper as h
from onnx import numpy_helper as nh
from taso_jax.search.match import rewrites
from taso_jax.search.rules import default_substitutions

import taso_jax
from taso_jax.frontends.onnx_io import load_onnx, symbolic_dims, with_symbolic_dims


def _rule(name="lower-conv2d_taps"):
    return next(r for r in default_substitutions() if r.name == name)


def _conv_model(c, out, kernel, group, strides, pads, dilations,
                act="Relu") -> onnx.ModelProto:
    """x [N, C, H, W] (open sizes N, H, W) -> Conv -> Relu -> y."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((out, c // group, *kernel)).astype(np.float32)
    nodes = [h.make_node("Conv", ["x", "w"], ["c"], group=group, strides=list(strides),
                         pads=list(pads), dilations=list(dilations), kernel_shape=list(kernel)),
             h.make_node(act, ["c"], ["y"])]
    g = h.make_graph(nodes, "dw", [h.make_tensor_value_info("x", TensorProto.FLOAT,
                                                            ["N", c, "H", "W"])],
                     [h.make_tensor_value_info("y", TensorProto.FLOAT,
                                               ["N", out, "H2", "W2"])],
                     [nh.from_array(w, "w")])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


@pytest.mark.parametrize("kernel, strides, pads, dilations", [
    ((3, 3), (1, 1), (1, 1, 1, 1), (1, 1)),
    ((3, 3), (2, 2), (1, 1, 1, 1), (1, 1)),
    ((5, 3), (2, 1), (1, 0, 2, 1), (2, 1)),
    ((7, 7), (1, 1), (3, 3, 3, 3), (1, 1)),
    ((20, 1), (1, 1), (0, 0, 0, 0), (1, 1)),
])
def test_depthwise_convolution_as_taps_equals_onnx_conv_at_other_sizes(kernel, strides, pads,
                                                                      dilations):
    """The rule rewrites the depthwise Conv; the written file equals the original in
    onnxruntime at the bound size and at two others, at two input scales, and imports back
    as padding, slices and elementwise arithmetic (no convolution left to run slowly)."""
    c = 6
    model = _conv_model(c, c, kernel, c, strides, pads, dilations)
    graph = load_onnx(model, input_shapes={"x": (1, c, 24, 20)})
    taps = next(rewrites(_rule(), graph))
    assert [n.op for n in taps.nodes if n.op.startswith("conv")] == ["conv2d_taps"]
    written = with_symbolic_dims(taso_jax.export_onnx(taps), symbolic_dims(model))
    onnx.checker.check_model(written, full_check=True)
    a, b = (ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
            for m in (model, written))
    for k, shape in enumerate([(1, c, 24, 20), (2, c, 31, 22), (3, c, 40, 9)]):
        for scale in (1.0, 100.0):
            x = (scale * np.random.default_rng(k).standard_normal(shape)).astype(np.float32)
            (want,), (got,) = a.run(None, {"x": x}), b.run(None, {"x": x})
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * scale)
    back = load_onnx(written, input_shapes={"x": (1, c, 24, 20)})
    assert not {n.op for n in back.nodes} & {"conv2d", "conv2d_taps"}
    assert {"slice", "ewmul", "ewadd"} <= {n.op for n in back.nodes}


@pytest.mark.parametrize("out, group", [(6, 1), (6, 3), (12, 6)])
def test_taps_rule_leaves_other_convolutions_alone(out, group):
    """A dense, a grouped and a depth-multiplier convolution (two kernels per channel) are
    not depthwise: the target's shape rule turns each down and the rule never applies."""
    model = _conv_model(6, out, (3, 3), group, (1, 1), (1, 1, 1, 1), (1, 1))
    graph = load_onnx(model, input_shapes={"x": (1, 6, 10, 10)})
    assert list(rewrites(_rule(), graph)) == []


@pytest.mark.slow
def test_measured_cost_model_chooses_taps_on_xla_cpu(tmp_path, monkeypatch):
    """A JAX function with a depthwise convolution (the MobileNet block's 3x3): the search
    under the measured cost model replaces it with taps (or, where it times faster, a
    densified grouped form: once in four CI runs under load), the end-to-end choice confirms
    the graph against the input, and the result equals jax.jit of the function."""
    if jax.devices()[0].platform != "cpu":
        pytest.skip("the measured choice is asserted for XLA:CPU, where taps win ~50x")
    c = 64

    def block(x, w):
        y = lax.conv_general_dilated(x, w, (1, 1), [(1, 1), (1, 1)],
                                     dimension_numbers=("NCHW", "OIHW", "NCHW"),
                                     feature_group_count=c)
        return jax.nn.relu(y)

    rng = np.random.default_rng(1)
    args = (rng.standard_normal((1, c, 56, 56)).astype(np.float32),
            rng.standard_normal((c, 1, 3, 3)).astype(np.float32))
    _measured_search_lowers(block, args, ("conv2d_taps", "merge_gconv"), tmp_path, monkeypatch,
                            tol=1e-5)


def _measured_search_lowers(block, args, op, tmp_path, monkeypatch, tol) -> None:
    """The measured search of ``block`` (a fresh cost cache) puts ``op`` (or one of a tuple
    of them) in the graph, and the graph's outputs equal jax.jit of ``block`` within
    ``tol``."""
    monkeypatch.setenv("TASO_JAX_COST_CACHE", str(tmp_path / "cost.sqlite"))
    result = taso_jax.search_graph(taso_jax.from_jax(block, *args), cost_model="measured",
                                   time_limit=60)
    ops = {n.op for n in result.graph.nodes}
    assert ops & set(op if isinstance(op, tuple) else (op,)), ops
    out = taso_jax.compile_graph(result.graph)(*args)
    out = out[0] if isinstance(out, tuple | list) else out
    np.testing.assert_allclose(np.asarray(out), np.asarray(jax.jit(block)(*args)),
                               rtol=tol, atol=tol)


def _same_at_other_sizes(model, written, shapes):
    a, b = (ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
            for m in (model, written))
    for k, shape in enumerate(shapes):
        for scale in (1.0, 100.0):
            x = (scale * np.random.default_rng(k).standard_normal(shape)).astype(np.float32)
            (want,), (got,) = a.run(None, {"x": x}), b.run(None, {"x": x})
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * scale)


@pytest.mark.parametrize("act", ["Relu", "Sigmoid"])
def test_pointwise_convolution_as_matmul_equals_onnx_conv_at_other_sizes(act):
    """A 1x1 Conv becomes pointwise_matmul; the written file (Reshape, MatMul, Reshape)
    equals the original in onnxruntime at three bindings of N, H and W, and imports back
    as a matmul between reshapes."""
    model = _conv_model(6, 10, (1, 1), 1, (1, 1), (0, 0, 0, 0), (1, 1), act=act)
    graph = load_onnx(model, input_shapes={"x": (1, 6, 24, 20)})
    lowered = next(rewrites(_rule("lower-pointwise_matmul"), graph))
    assert [n.op for n in lowered.nodes if n.op.startswith(("conv", "pointwise"))] == [
        "pointwise_matmul"]
    written = with_symbolic_dims(taso_jax.export_onnx(lowered), symbolic_dims(model))
    onnx.checker.check_model(written, full_check=True)
    _same_at_other_sizes(model, written, [(1, 6, 24, 20), (2, 6, 31, 22), (3, 6, 40, 9)])
    back = load_onnx(written, input_shapes={"x": (1, 6, 24, 20)})
    assert "conv2d" not in {n.op for n in back.nodes} and "matmul" in {n.op for n in back.nodes}


@pytest.mark.parametrize("kernel, strides, pads, group", [
    ((3, 3), (1, 1), (1, 1, 1, 1), 1), ((1, 1), (2, 2), (0, 0, 0, 0), 1),
    ((1, 1), (1, 1), (0, 0, 0, 0), 2), ((1, 1), (1, 1), (1, 1, 1, 1), 1)])
def test_pointwise_rule_leaves_other_convolutions_alone(kernel, strides, pads, group):
    """A 3x3, a strided, a grouped and a padded 1x1 convolution are not a plain matrix
    product: the rule never applies."""
    model = _conv_model(6, 6, kernel, group, strides, pads, (1, 1))
    graph = load_onnx(model, input_shapes={"x": (1, 6, 10, 10)})
    assert list(rewrites(_rule("lower-pointwise_matmul"), graph)) == []


@pytest.mark.parametrize("c, kernel, strides, pads, dilations", [
    (3, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1)),
    (1, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1)),
    (4, (5, 3), (2, 1), (1, 0, 2, 1), (2, 1)),
    (2, (1, 7), (1, 1), (0, 3, 0, 3), (1, 1)),
])
def test_dense_convolution_as_columns_equals_onnx_conv_at_other_sizes(c, kernel, strides,
                                                                      pads, dilations):
    """A one-group Conv becomes conv2d_im2col; the written file (Pad, Slices, Concat,
    Reshape, MatMul, Reshape) equals the original in onnxruntime at three bindings of N, H
    and W and two input scales, and imports back with no convolution."""
    model = _conv_model(c, 8, kernel, 1, strides, pads, dilations)
    graph = load_onnx(model, input_shapes={"x": (1, c, 24, 20)})
    lowered = next(rewrites(_rule("lower-conv2d_im2col"), graph))
    assert [n.op for n in lowered.nodes if n.op.startswith("conv")] == ["conv2d_im2col"]
    written = with_symbolic_dims(taso_jax.export_onnx(lowered), symbolic_dims(model))
    onnx.checker.check_model(written, full_check=True)
    _same_at_other_sizes(model, written, [(1, c, 24, 20), (2, c, 31, 22), (3, c, 40, 9)])
    back = load_onnx(written, input_shapes={"x": (1, c, 24, 20)})
    assert not {n.op for n in back.nodes} & {"conv2d", "conv2d_im2col"}
    assert {"slice", "concat", "matmul"} <= {n.op for n in back.nodes}


@pytest.mark.parametrize("c, out, kernel, group, size", [
    (6, 6, (3, 3), 3, 10),     # grouped
    (6, 6, (3, 3), 6, 10),     # depthwise (conv2d_taps's)
    (6, 6, (1, 1), 1, 10),     # 1x1 (pointwise_matmul's)
    (64, 8, (3, 3), 1, 96),    # a column matrix of 64*9 x 96*96 floats, over 16 MiB
    (2, 4, (1, 65), 1, 70),    # 65 taps, past MAX_TAPS: one slice each, slow to compile
])
def test_columns_rule_leaves_other_convolutions_alone(c, out, kernel, group, size):
    """Grouped, depthwise and 1x1 convolutions, and one whose column matrix would pass
    MAX_COLUMN_BYTES: the target's shape rule turns each down and the rule never applies."""
    from taso_jax.ops.im2col import MAX_COLUMN_BYTES

    assert c * 9 * size * size * 4 > MAX_COLUMN_BYTES or size in (10, 70)
    model = _conv_model(c, out, kernel, group, (1, 1), (1, 1, 1, 1) if kernel == (3, 3)
                        else (0, 0, 0, 0), (1, 1))
    graph = load_onnx(model, input_shapes={"x": (1, c, size, size)})
    assert list(rewrites(_rule("lower-conv2d_im2col"), graph)) == []


@pytest.mark.slow
def test_measured_cost_model_chooses_columns_for_few_input_channels(tmp_path, monkeypatch):
    """A JAX function whose first convolution reads 3 channels at 224x160 (a spectrogram
    CNN's first layer): XLA:CPU runs it about 2x slower than its columns and one product,
    the measured search lowers it, and the result equals jax.jit of the function."""
    if jax.devices()[0].platform != "cpu":
        pytest.skip("the measured choice is asserted for XLA:CPU, where columns win ~2x")

    def block(x, w):
        y = lax.conv_general_dilated(x, w, (1, 1), [(1, 1), (1, 1)],
                                     dimension_numbers=("NCHW", "OIHW", "NCHW"))
        return jax.nn.relu(y)

    rng = np.random.default_rng(2)
    args = (rng.standard_normal((1, 3, 224, 160)).astype(np.float32),
            rng.standard_normal((32, 3, 3, 3)).astype(np.float32))
    _measured_search_lowers(block, args, "conv2d_im2col", tmp_path, monkeypatch, tol=1e-4)


@pytest.mark.parametrize("attrs", [(("groups", 2),), (("dilations", (2, 1)),)])
def test_the_lowering_laws_leave_conv2d_dependent_on_its_attributes(attrs):
    """Z3 does not see shapes: a lowering law that dropped an attribute (the groups of the
    taps form, the dilation of the matrix product) would say conv2d is the same at every
    value of it. With every axiom, conv2d at another groups or dilation is not proved."""
    from taso_jax.search.rules import PNode, Substitution
    from taso_jax.verify.prover import Prover

    shape = ("N", "C", "H", "W")
    wrong = Substitution("test:conv2d-ignores-" + attrs[0][0],
                         (("x", shape), ("w", ("D", "C", 3, 3))),
                         (PNode("conv2d", (), ("x", "w")),), (PNode("conv2d", attrs, ("x", "w")),),
                         (("#0", "#0"),), {})
    assert Prover(rlimit=300_000).prove(wrong)["status"] != "proved"
