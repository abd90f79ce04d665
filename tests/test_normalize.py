"""Graph normalizations run at jaxpr import: transpose sinking and affine chains.

Each is checked numerically: the normalized graph, run by our executor, must match the
original JAX function under jax.jit, and the structure must be the one promised.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from taso_jax.frontends.canonical import normalize_affine
from taso_jax.frontends.jaxpr_io import from_jax
from taso_jax.frontends.layout import sink_transposes
from taso_jax.ir.executor import compile_graph


def _x(*shape, seed=0):
    return jax.random.normal(jax.random.key(seed), shape)


def _same(g, fn, args, inputs):
    got = compile_graph(g)(*inputs)
    ref = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_transposes_sink_through_reductions_and_concat():
    def fn(x, y):
        a = jnp.transpose(x, (0, 2, 3, 1))  # NCHW -> NHWC
        b = jnp.transpose(y, (0, 2, 3, 1))
        c = jnp.tanh(jnp.concatenate([jax.nn.relu(a), b * 2.0], axis=-1))
        return jnp.sum(c, axis=(1, 2)), jnp.max(c, axis=1), jnp.transpose(c, (0, 3, 1, 2))

    args = (_x(2, 3, 4, 5), _x(2, 6, 4, 5, seed=1))
    g = from_jax(fn, *args)
    _same(g, fn, args, args)
    counts = g.op_counts()
    # Everything runs in the inputs' NCHW layout; the only transpose left puts the
    # max-reduced output ([N, C, W] underneath) into the [N, W, C] order it promises.
    assert counts["transpose"] == 1, counts
    t = next(n for n in g.nodes if n.op == "transpose" and not n.weight_only)
    assert t.outputs[0] in g.outputs


def test_mixed_layouts_keep_a_transpose():
    def fn(x, y):  # y is already NHWC: one operand must be transposed at run time
        return jnp.transpose(x, (0, 2, 3, 1)) + y

    args = (_x(2, 3, 4, 5), _x(2, 4, 5, 3, seed=1))
    g = from_jax(fn, *args)
    _same(g, fn, args, args)
    assert g.op_counts()["transpose"] == 1


def test_sink_is_idempotent():
    def fn(w, x):
        dn = ("NHWC", "HWIO", "NHWC")
        return jax.nn.relu(lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dn))

    args = (_x(3, 3, 3, 4), _x(1, 6, 6, 3, seed=1))
    g = from_jax(fn, *args, weight_argnums=0)
    assert sink_transposes(g).key == g.key


def test_flax_style_batchnorm_becomes_scale_then_shift():
    def fn(p, x):
        y = lax.conv_general_dilated(x, p["w"], (1, 1), "SAME")
        y = (y - p["mean"][None, :, None, None]) * lax.rsqrt(p["var"] + 1e-5)[None, :, None,
                                                                               None]
        return y * p["scale"][None, :, None, None] + p["bias"][None, :, None, None]

    p = {"w": _x(4, 3, 3, 3), "mean": _x(4, seed=1), "var": jnp.abs(_x(4, seed=2)) + 0.5,
         "scale": _x(4, seed=3), "bias": _x(4, seed=4)}
    x = _x(2, 3, 6, 6, seed=5)
    g = from_jax(fn, p, x, weight_argnums=0)
    _same(g, fn, (p, x), (x,))
    runtime = g.op_counts()
    assert runtime == {"conv2d": 1, "ewmul": 1, "ewadd": 1}, runtime
    mul = next(n for n in g.nodes if n.op == "ewmul" and not n.weight_only)
    assert mul.inputs[0].node.op == "conv2d"  # the scale sits right after the convolution


def test_affine_normalization_leaves_shared_intermediates_alone():
    def fn(c, x):
        y = x + c
        return y * c, y  # y is used twice: distributing would compute it twice

    args = (_x(1, 4, seed=1), _x(3, 4))
    g = from_jax(fn, *args, weight_argnums=0)
    assert normalize_affine(g).key == g.key
    _same(g, fn, args, args[1:])
