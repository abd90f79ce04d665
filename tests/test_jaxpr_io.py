"""jaxpr import: every registered primitive mapping, opaque equations, layout sinking.

Numeric equivalence is always checked against ``jax.jit`` of the original function.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from taso_jax.ops import JAXPR_IMPORTERS

import taso_jax
from taso_jax.frontends.jaxpr_io import from_jax
from taso_jax.ir.executor import compile_graph

KEY = jax.random.key(0)


def _x(*shape, seed=0):
    # numpy's generator, not jax.random: the cases are built at import, and jax.random
    # compiled once per shape (28 shapes, 14 s of every run's collection).
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


W44 = _x(4, 4, seed=1)
K_OIHW = _x(6, 3, 3, 3, seed=2)
K_HWIO = _x(3, 3, 3, 6, seed=3)

# (name, function, example inputs): together they exercise every registered primitive.
CASES = [
    ("causal_where", lambda x: jnp.where(jnp.tril(jnp.ones((5, 5), bool)), x, -1e9)
     + jnp.where(jnp.arange(5)[:, None] <= jnp.arange(5), x, 0.0), (_x(2, 5, 5),)),
    ("add_sub_mul_div", lambda x, y: (x + y) * (x - y) / (y * y + 1.0),
     (_x(3, 4), _x(3, 4, seed=1))),
    ("weight_sub_div", lambda w, x: (x - w) / w, (W44 + 3.0, _x(2, 4, 4))),
    ("relu_clip", lambda x: jnp.maximum(x, 0.0) + jnp.minimum(x, 0.5) + jnp.maximum(x, -1.0),
     (_x(2, 5),)),
    ("max_min_pair", lambda x, y: jnp.maximum(x, y) * jnp.minimum(x, y[:1]),
     (_x(3, 4), _x(3, 4, seed=1))),
    ("unary", lambda x: jnp.tanh(x) + jax.nn.sigmoid(x) + lax.erf(x) + jnp.exp(-x)
     + jnp.sqrt(x * x + 1) + lax.rsqrt(x * x + 1), (_x(2, 5),)),
    ("integer_pow", lambda x: x ** 2 + x ** 3 + x ** 5 + jnp.square(x), (_x(2, 5),)),
    ("pow", lambda x: jnp.power(jnp.abs(x) + 1.0, x), (_x(2, 5),)),
    ("trig_log_erfc", lambda x: jnp.sin(x) * jnp.cos(x) + jnp.log(jnp.abs(x) + 1.0)
     + lax.erfc(x), (_x(2, 5),)),
    ("select_compare", lambda x, y: jnp.where((x < y) & ~(x == y) | (x > 1.0), x, y),
     (_x(3, 4), _x(3, 4, seed=1))),
    ("convert", lambda x: x.astype(jnp.int32).astype(jnp.float32) + x, (_x(3, 4) * 4,)),
    ("concat_split", lambda x, y: jnp.split(jnp.concatenate([x, y], axis=1), [2, 5], axis=1),
     (_x(3, 4), _x(3, 4, seed=1))),
    ("reshape_transpose", lambda x: jnp.transpose(x.reshape(2, 6, 2), (2, 0, 1))[None, ..., 0],
     (_x(4, 6),)),
    ("squeeze_expand", lambda x: jnp.expand_dims(jnp.squeeze(x, 1), 0), (_x(3, 1, 4),)),
    ("broadcast", lambda x, b: x + b[None, :, None] + jnp.broadcast_to(b[:, None], (3, 5)),
     (_x(2, 3, 5), _x(3, seed=1))),
    ("slice_pad", lambda x: jnp.pad(x[1:3, ::2], ((1, 0), (0, 2)), constant_values=1.5),
     (_x(4, 6),)),
    ("dense", lambda w, x: x @ w, (W44, _x(2, 3, 4))),
    ("einsum_attention", lambda q, k: jnp.einsum("bqhd,bkhd->bhqk", q, k),
     (_x(2, 5, 3, 4), _x(2, 5, 3, 4, seed=1))),
    ("dot_multi_contract", lambda x, w: jnp.einsum("bshd,hdo->bso", x, w),
     (_x(2, 5, 3, 4), _x(3, 4, 6, seed=1))),
    ("matvec", lambda x, w: w @ x, (_x(4), W44)),
    ("conv_nchw", lambda x, w: lax.conv_general_dilated(x, w, (2, 1), ((1, 1), (0, 2)),
                                                        rhs_dilation=(1, 2)),
     (_x(2, 3, 9, 9), K_OIHW)),
    ("conv_nhwc_same", lambda x, w: lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")),
     (_x(2, 8, 8, 3), K_HWIO)),
    ("conv_grouped", lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "VALID",
                                                           feature_group_count=3),
     (_x(1, 6, 7, 7), _x(6, 2, 3, 3, seed=4))),
    ("pools_nhwc", lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1),
                                               "SAME")
     + lax.reduce_window(x, 0.0, lax.add, (1, 3, 3, 1), (1, 2, 2, 1), "SAME"),
     (_x(2, 8, 8, 3),)),
    ("reductions", lambda x: jnp.sum(x, axis=(0, 2)) + jnp.max(x, axis=(0, 2))
     + jnp.mean(x, axis=(0, 2)), (_x(2, 3, 4),)),
    ("identity_prims", lambda x: lax.optimization_barrier(jnp.array(x, copy=True)) * 2.0,
     (_x(3),)),
    ("lax_split", lambda x: lax.split(x, (1, 3), axis=1), (_x(2, 4),)),
    # floor division and modulus are div, rem, sign, ne and select_n (tests/
    # test_integer_division.py checks them in onnxruntime too)
    ("integer_division", lambda x, d: (x // d, x % d, lax.div(x, d), x // 3, jnp.fmod(x, -3)),
     (jnp.arange(-7, 8), jnp.array([1, -1, 2, -2, 3] * 3))),
    ("sign_rem", lambda x, y: jnp.sign(x) * lax.rem(x, y * y + 0.5) + (x != y),
     (_x(3, 4), _x(3, 4, seed=1))),
]


def _primitives(fn, args) -> set[str]:
    out = set()

    def walk(jaxpr):
        for e in jaxpr.eqns:
            out.add(e.primitive.name)
            for p in e.params.values():
                if hasattr(p, "eqns"):
                    walk(p)
                elif hasattr(p, "jaxpr") and hasattr(p.jaxpr, "eqns"):
                    walk(p.jaxpr)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return out


def _check(fn, args, weight_argnums=()):
    g = from_jax(fn, *args, weight_argnums=weight_argnums)
    inputs = [a for i, a in enumerate(args) if i not in set(np.atleast_1d(weight_argnums))]
    got = compile_graph(g)(*jax.tree_util.tree_leaves(inputs))
    ref = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
    assert len(got) == len(ref)
    for a, b in zip(got, ref, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    return g


@pytest.mark.parametrize("name,fn,args", CASES, ids=[c[0] for c in CASES])
def test_primitive_mapping_matches_jax(name, fn, args):
    g = _check(fn, args, weight_argnums=(0,) if name.startswith(("weight", "dense")) else ())
    mapped = _primitives(fn, args) & set(JAXPR_IMPORTERS)
    assert not set(g.meta["opaque"]) & mapped, f"{name}: mapped primitives kept opaque: " \
        f"{g.meta['opaque']}"


def test_every_registered_primitive_is_exercised():
    seen = set().union(*(_primitives(fn, args) for _, fn, args in CASES))
    # copy_p is the name of the copy primitive in older JAX releases.
    missing = set(JAXPR_IMPORTERS) - seen - {"copy_p"}
    assert not missing, f"no test case uses the registered primitives {sorted(missing)}"


def test_unknown_primitives_stay_opaque_and_run():
    def fn(x):
        y = jnp.sort(x, axis=-1) + jnp.cumsum(x, axis=-1)
        return lax.fori_loop(0, 3, lambda i, v: v * 0.5 + 1.0, y)

    g = _check(fn, (_x(3, 5),))
    assert g.meta["opaque"], "sort/cumsum/while should be opaque"
    assert "opaque" in g.op_counts()


def test_nhwc_convolutions_lose_their_layout_transposes():
    def fn(w1, w2, x):
        dn = ("NHWC", "HWIO", "NHWC")
        y = jax.nn.relu(lax.conv_general_dilated(x, w1, (1, 1), "SAME", dimension_numbers=dn))
        y = y * 2.0 + 1.0
        return lax.conv_general_dilated(y, w2, (1, 1), "SAME", dimension_numbers=dn)

    args = (K_HWIO, _x(3, 3, 6, 4, seed=5), _x(2, 8, 8, 3))
    g = _check(fn, args, weight_argnums=(0, 1))
    counts = g.op_counts()
    assert counts["conv2d"] == 2
    assert counts["transpose"] == 2, counts  # one into NCHW at the input, one out at the end
    unsunk = from_jax(fn, *args, weight_argnums=(0, 1), sink_layout=False).op_counts()
    assert unsunk["transpose"] == 4


def test_weights_are_named_by_pytree_path_and_inputs_by_argument():
    def fn(params, x, *, unused=None):
        return x @ params["dense"]["kernel"] + params["dense"]["bias"]

    params = {"dense": {"kernel": W44, "bias": _x(4, seed=3)}}
    g = from_jax(fn, params, _x(2, 4), weight_argnums=0)
    assert [n.name for n in g.inputs] == ["x"]
    assert {"params['dense']['kernel']", "params['dense']['bias']"} <= set(g.weights)
    assert g.output_names == ("out",)


def test_from_jax_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="weight_argnums: position 3"):
        from_jax(lambda a, b: a + b, _x(2), _x(2), weight_argnums=3)
    with pytest.raises(ValueError, match="weight_argnames: 'w' is not a parameter"):
        from_jax(lambda a, b: a + b, _x(2), _x(2), weight_argnames="w")
    with pytest.raises(ValueError, match=r"argument \"b\['flag'\]\"|argument 'b\['flag'\]'"):
        from_jax(lambda a, b: a, _x(2), {"flag": "yes"})


def test_side_effects_are_refused():
    def fn(x):
        jax.debug.print("x = {}", x)
        return x + 1

    with pytest.raises(taso_jax.ModelError, match="side effects"):
        from_jax(fn, _x(2))


def test_common_primitives_are_declared_and_export_to_onnx():
    """erfc (exact gelu), sin, cos, log and abs import as operators, not opaque nodes."""
    import onnxruntime as ort

    from taso_jax.frontends.onnx_io import export_onnx

    def f(x, w):
        h = x @ w
        return (jax.nn.gelu(h, approximate=False) + jnp.sin(h) * jnp.cos(h)
                + jnp.log(jnp.abs(h) + 1.0))

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    w = rng.standard_normal((8, 8)).astype(np.float32)
    g = taso_jax.from_jax(f, x, w)
    assert not g.meta.get("opaque") and "opaque" not in g.op_counts()
    assert {"erfc", "sin", "cos", "log", "abs"} <= set(g.op_counts())
    sess = ort.InferenceSession(export_onnx(g).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    got = sess.run(None, {n.name: v for n, v in zip(g.inputs, (x, w), strict=True)})[0]
    np.testing.assert_allclose(got, np.asarray(f(x, w)), rtol=1e-5, atol=1e-5)


def test_a_maximum_of_two_tensors_is_declared_and_exports_to_onnx():
    """max/min of two tensors (no constant side) import as ewmax/ewmin, not opaque nodes, and
    the exported ONNX Max/Min match JAX in onnxruntime."""
    import onnxruntime as ort

    from taso_jax.frontends.onnx_io import export_onnx

    def f(x, y):
        return jnp.maximum(x, y) - jnp.minimum(x, y[:1])

    rng = np.random.default_rng(0)
    x, y = (rng.standard_normal((3, 4)).astype(np.float32) for _ in range(2))
    g = taso_jax.from_jax(f, x, y)
    assert "opaque" not in g.op_counts() and {"ewmax", "ewmin"} <= set(g.op_counts())
    sess = ort.InferenceSession(export_onnx(g).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    got = sess.run(None, {n.name: v for n, v in zip(g.inputs, (x, y), strict=True)})[0]
    np.testing.assert_array_equal(got, np.asarray(f(x, y)))


def test_a_causal_mask_and_a_scale_fold_at_import_without_compiling(monkeypatch):
    """The mask (iota, comparison, not, where, broadcast) and the attention scale (a slice of
    a shape, casts, a square root) fold in NumPy: no operator runs through XLA at import, which
    cost 0.5-1.9 s of a decorator's first call, first in a process."""
    from taso_jax.frontends import context

    def no_jax(node, args):
        raise AssertionError(f"{node.op} folded through XLA")

    monkeypatch.setattr(context, "run_node", no_jax)

    def f(q, k):
        s = q.shape[0]
        scale = jnp.sqrt(jnp.asarray(jnp.asarray(q.shape)[1:2], jnp.float32))
        keep = jnp.broadcast_to(~(jnp.arange(s)[:, None] < jnp.arange(s)[None, :]), (2, s, s))
        scores = jnp.einsum("qd,kd->qk", q, k) / scale
        return jnp.where(keep, scores, -1e9)

    q, k = _x(8, 4), _x(8, 4, seed=1)
    g = taso_jax.from_jax(f, q, k)
    assert "opaque" not in g.op_counts()
    np.testing.assert_allclose(np.asarray(taso_jax.compile_graph(g)(q, k)[0]),
                               np.asarray(f(q, k)), rtol=1e-6)
