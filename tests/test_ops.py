"""Registry-driven operator tests: every declared operator, every example."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from taso_jax.ops import OPS, ShapeError, TensorType

from taso_jax.ir.graph import Graph, leaf_node, make_node

CASES = [(name, i) for name, op in sorted(OPS.items()) for i in range(len(op.examples))]


def _random(t: TensorType, rng):
    if t.dtype == "bool":
        return rng.integers(0, 2, t.shape).astype(bool)
    if "int" in t.dtype:
        return rng.integers(0, 3, t.shape).astype(t.dtype)
    return rng.standard_normal(t.shape).astype(t.dtype)


def test_every_operator_is_complete():
    for name, op in OPS.items():
        assert op.examples, f"{name} has no examples"
        assert op.to_onnx is not None, f"{name} has no ONNX mapping"
        assert op.doc, f"{name} has no doc"


@pytest.mark.parametrize("name,i", CASES)
def test_shape_rule_matches_reference(name, i):
    op = OPS[name]
    in_types, attrs = op.examples[i]
    node = make_node(name, [leaf_node("input", f"a{k}", t).outputs[0]
                            for k, t in enumerate(in_types)], attrs)
    args = [jax.ShapeDtypeStruct(t.shape, t.dtype) for t in in_types]
    out = jax.eval_shape(lambda *a: op.ref(*a, **dict(node.attrs)), *args)
    outs = out if isinstance(out, tuple | list) else (out,)
    assert [tuple(o.shape) for o in outs] == [t.shape for t in node.types]
    # Dtypes agree up to JAX's 32-bit canonicalisation.
    assert [jax.dtypes.canonicalize_dtype(t.dtype) for t in node.types] == \
        [o.dtype for o in outs]


@pytest.mark.parametrize("opset", [20, "newest"])
@pytest.mark.parametrize("name,i", CASES)
def test_onnx_export_matches_reference(name, i, opset):
    """Each operator exported alone runs in onnxruntime (independent of JAX) and agrees, at
    opset 20 and at the newest opset the installed onnx knows (a model imported at that
    opset is exported at it)."""
    import onnx
    import onnxruntime as ort

    from taso_jax.frontends.onnx_io import export_onnx, importable_at, max_opset

    opset = max_opset() if opset == "newest" else opset

    op = OPS[name]
    in_types, attrs = op.examples[i]
    rng = np.random.default_rng(i)
    leaves = [leaf_node("input", f"a{k}", t) for k, t in enumerate(in_types)]
    node = make_node(name, [n.outputs[0] for n in leaves], attrs)
    g = Graph(tuple(leaves), node.outputs, tuple(f"y{k}" for k in range(len(node.types))),
              meta={"opset": opset})
    model = export_onnx(g)
    onnx.checker.check_model(model, full_check=True)
    # what we write at a newer opset means there what it meant at 20
    assert all(importable_at(n.op_type, opset) for n in model.graph.node if not n.domain)
    xs = [_random(t, rng) for t in in_types]
    got = ort.InferenceSession(model.SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(
        None, {n.name: x for n, x in zip(leaves, xs, strict=True)})
    want = op.ref(*xs, **dict(node.attrs))
    want = want if isinstance(want, tuple | list) else (want,)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, np.asarray(b), rtol=1e-4, atol=1e-5)


def test_gelu_decomposes_below_opset_20():
    import onnxruntime as ort

    from taso_jax.frontends.onnx_io import export_onnx

    for approx in ("none", "tanh"):
        x = leaf_node("input", "x", TensorType((3, 4), "float32"))
        node = make_node("gelu", [x.outputs[0]], {"approximate": approx})
        model = export_onnx(Graph((x,), node.outputs, ("y",)), opset=17)
        assert "Gelu" not in {n.op_type for n in model.graph.node}
        xs = np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4)
        got = ort.InferenceSession(model.SerializeToString()).run(None, {"x": xs})[0]
        np.testing.assert_allclose(got, OPS["gelu"].ref(xs, approximate=approx), atol=1e-5)


@pytest.mark.parametrize("name,in_types,attrs", [
    ("conv2d", [((1, 4, 8, 8), "float32"), ((6, 3, 3, 3), "float32")], {}),
    ("matmul", [((3, 4), "float32"), ((5, 6), "float32")], {}),
    ("concat", [((2, 3), "float32"), ((3, 3), "float32")], {"axis": 1}),
    ("split", [((2, 7), "float32")], {"axis": 1, "sizes": (3, 3)}),
    ("enlarge", [((4, 2, 3, 3), "float32"), ((4, 2, 1, 1), "float32")], {}),
    ("reshape", [((2, 3), "float32")], {"shape": (4, 2)}),
    ("ewadd", [((2, 3), "float32"), ((4, 3), "float32")], {}),
])
def test_shape_rule_rejects_bad_inputs(name, in_types, attrs):
    with pytest.raises(ShapeError):
        make_node(name, [leaf_node("input", f"a{k}", TensorType(*t)).outputs[0]
                         for k, t in enumerate(in_types)], attrs)


def test_same_padding_allows_enlarging_kernels():
    """'same' padding centres every kernel, so a zero-padded kernel gives the same result."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 3, 9, 8)).astype(np.float32)
    w = rng.standard_normal((4, 3, 1, 1)).astype(np.float32)
    ref = rng.standard_normal((4, 3, 5, 3)).astype(np.float32)
    for strides in ((1, 1), (2, 2)):
        a = OPS["conv2d"].ref(x, w, strides=strides, padding="same", dilations=(1, 1),
                              groups=1, activation="none")
        b = OPS["conv2d"].ref(x, OPS["enlarge"].ref(w, ref), strides=strides, padding="same",
                              dilations=(1, 1), groups=1, activation="none")
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_merge_gconv_matches_grouped_conv():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 8, 6, 6)).astype(np.float32)
    w = rng.standard_normal((8, 2, 3, 3)).astype(np.float32)
    conv = OPS["conv2d"].ref
    a = conv(x, w, strides=(1, 1), padding="same", dilations=(1, 1), groups=4,
             activation="none")
    merged = OPS["merge_gconv"].ref(w, groups=4, count=2)
    b = conv(x, merged, strides=(1, 1), padding="same", dilations=(1, 1), groups=2,
             activation="none")
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_constant_kernels():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 3, 7, 7)).astype(np.float32)
    conv = OPS["conv2d"].ref
    ident = OPS["constant_identity_kernel"].ref(channels=3, kernel=(3, 3), dtype="float32")
    np.testing.assert_allclose(conv(x, ident, strides=(1, 1), padding="same",
                                    dilations=(1, 1), groups=3, activation="none"), x,
                               atol=1e-6)
    pool = OPS["constant_pool_kernel"].ref(channels=3, kernel=(3, 3), dtype="float32")
    a = conv(x, pool, strides=(1, 1), padding="valid", dilations=(1, 1), groups=3,
             activation="none")
    b = OPS["avgpool2d"].ref(x, kernel=(3, 3), strides=(1, 1), padding="valid",
                             count_include_pad=False)
    np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("name,i", [(n, i) for n, i in CASES if OPS[n].numpy_ref is not None])
def test_numpy_fold_matches_reference(name, i):
    """An operator's NumPy form (constants folded at import) gives its reference's values."""
    op = OPS[name]
    in_types, attrs = op.examples[i]
    rng = np.random.default_rng(i)
    node = make_node(name, [leaf_node("input", f"a{k}", t).outputs[0]
                            for k, t in enumerate(in_types)], attrs)
    for dtype in (None, "int64"):  # the example's dtype, and shape arithmetic's
        xs = [_random(TensorType(t.shape, dtype or t.dtype), rng) for t in in_types]
        want = np.asarray(op.ref(*xs, **dict(node.attrs)))
        got = op.numpy_ref(*xs, **dict(node.attrs))
        assert got.shape == want.shape
        np.testing.assert_array_equal(got.astype(want.dtype), want)


@pytest.mark.parametrize("name,i", [(n, i) for n, i in CASES if OPS[n].product_dims is not None])
def test_product_dims_multiply_to_the_flops(name, i):
    """``OpDef.product_dims`` (rows, inner, columns a group) times the groups is the
    operator's arithmetic: 2 FLOPs a multiply-add."""
    op = OPS[name]
    ins, attrs = op.examples[i]
    attrs = dict(op.normalize_attrs(attrs))
    outs = op.infer(ins, attrs)
    rows, inner, cols = op.product_dims(ins, outs, **attrs)
    groups = attrs.get("groups", 1)
    assert 2 * rows * inner * cols * groups == pytest.approx(op.cost_flops(ins, outs, attrs))
