"""Pooling operators on NCHW activations, and their NHWC forms.

Sources: ONNX operator spec (MaxPool, AveragePool, GlobalAveragePool); the jaxpr primitives
``reduce_window_max`` and ``reduce_window_sum``. Padding is the convolutions' one attribute
(:mod:`taso_jax.ops.conv`): ``"same"``, ``"valid"`` or an explicit
``(top, left, bottom, right)`` tuple.
"""

from __future__ import annotations

import numpy as np
from taso_jax.ops import (
    OpDef,
    ShapeError,
    TensorType,
    axiom,
    declare,
    jaxpr_importer,
    onnx_importer,
)
from taso_jax.ops._lazy import LazyModule
from taso_jax.ops.conv import NCHW_TO_NHWC, NHWC_TO_NCHW, _inverse
from taso_jax.ops.windows import _onnx_pads, _window_out, canonical_padding, explicit_pads

jnp = LazyModule("jax.numpy")
lax = LazyModule("jax.lax")

_F32 = "float32"


# ---- pooling ------------------------------------------------------------------------------

def _pool_pads(x_shape, kernel, strides, padding):
    t, lf, b, r = explicit_pads(padding, kernel)
    return [(0, 0), (0, 0), (t, b), (lf, r)]


def _maxpool2d(x, *, kernel, strides, padding):
    # A NumPy init value lets lax recognize the max monoid (reduce_window_max, which has a
    # derivative); a traced one would give the generic, non-differentiable reduce_window.
    init = -np.inf if jnp.issubdtype(x.dtype, jnp.floating) else np.iinfo(x.dtype).min
    return lax.reduce_window(x, np.asarray(init, x.dtype), lax.max, (1, 1, *kernel),
                             (1, 1, *strides), _pool_pads(x.shape, kernel, strides, padding))


def _avgpool2d(x, *, kernel, strides, padding, count_include_pad):
    pads = _pool_pads(x.shape, kernel, strides, padding)
    s = lax.reduce_window(x, np.asarray(0, x.dtype), lax.add, (1, 1, *kernel), (1, 1, *strides),
                          pads)
    if count_include_pad:
        return s / (kernel[0] * kernel[1])
    ones = jnp.ones((1, 1, *x.shape[2:]), x.dtype)
    n = lax.reduce_window(ones, np.asarray(0, x.dtype), lax.add, (1, 1, *kernel),
                          (1, 1, *strides), pads)
    return s / n


def _pool_shape(ts, *, kernel, strides, padding, **_):
    (x,) = ts
    if len(x.shape) != 4:
        raise ShapeError(f"pool2d: expects NCHW input, got {x.shape}")
    t, lf, b, r = explicit_pads(padding, kernel)
    n, c, h, w = x.shape
    return [TensorType((n, c, _window_out(h, kernel[0], strides[0], 1, t, b),
                        _window_out(w, kernel[1], strides[1], 1, lf, r)), x.dtype)]


def _pool_onnx(onnx_type):
    def to_onnx(ctx, ins, outs, *, kernel, strides, padding, **extra):
        kw = {"count_include_pad": int(extra["count_include_pad"])} if extra else {}
        ctx.node(onnx_type, ins, outs, kernel_shape=list(kernel), strides=list(strides),
                 pads=list(explicit_pads(padding, kernel)), **kw)
    return to_onnx


def _pool_flops(ins, outs, *, kernel, **_):
    return float(outs[0].size * kernel[0] * kernel[1])


_POOL_EX = [TensorType((1, 3, 9, 9), _F32)]
declare(OpDef(name="maxpool2d", ref=_maxpool2d, shape=_pool_shape, arity=1,
              attrs={"kernel": (2, 2), "strides": (2, 2), "padding": "valid"},
              to_onnx=_pool_onnx("MaxPool"), flops=_pool_flops,
              channels_last="maxpool2d_nhwc",
              examples=((_POOL_EX, {}), (_POOL_EX, {"kernel": (3, 3), "padding": "same",
                                                    "strides": (1, 1)})),
              doc="2-D max pooling on NCHW (ONNX MaxPool)"))
declare(OpDef(name="avgpool2d", ref=_avgpool2d, shape=_pool_shape, arity=1,
              attrs={"kernel": (2, 2), "strides": (2, 2), "padding": "valid",
                     "count_include_pad": False},
              to_onnx=_pool_onnx("AveragePool"), flops=_pool_flops,
              channels_last="avgpool2d_nhwc",
              examples=((_POOL_EX, {}), (_POOL_EX, {"kernel": (3, 3), "padding": (1, 1, 1, 1),
                                                    "strides": (1, 1)})),
              doc="2-D average pooling on NCHW (ONNX AveragePool)"))


# ---- pooling in NHWC -----------------------------------------------------------------------
# XLA:CPU pools an NCHW tensor over its two minor axes about 3x slower than the same NHWC
# tensor over its middle ones (2x2 window sum on 8x28x28x32: 1100 us against 341 us, 2
# cores), and an NCHW pool between NHWC convolutions costs two transposes more. to_nhwc
# (taso_jax.ir.layout) runs pools between NHWC activations as these. Like conv2d_nhwc they
# have no axioms; POOL_NHWC_LAWS, their relation to the NCHW pools, are checked numerically
# in the tests.

POOL_NHWC_LAWS = (
    axiom("maxpool2d_nhwc(x, kernel=k, strides=st, padding=p) = transpose(maxpool2d(transpose(x, perm=(0, 3, 1, 2)), kernel=k, strides=st, padding=p), perm=(0, 2, 3, 1))",
          {"x": ("N", "H", "W", "C")}, k=((2, 2), (3, 3)), st=((1, 1), (2, 2)),
          p=("valid", "same")),
    axiom("avgpool2d_nhwc(x, kernel=k, strides=st, padding=p, count_include_pad=c) = transpose(avgpool2d(transpose(x, perm=(0, 3, 1, 2)), kernel=k, strides=st, padding=p, count_include_pad=c), perm=(0, 2, 3, 1))",
          {"x": ("N", "H", "W", "C")}, k=((2, 2), (3, 3)), st=((1, 1), (2, 2)),
          p=("valid", "same"), c=(True, False)),
)


def _nhwc_pads(kernel, padding):
    t, lf, b, r = explicit_pads(padding, kernel)
    return [(0, 0), (t, b), (lf, r), (0, 0)]


def _maxpool2d_nhwc(x, *, kernel, strides, padding):
    init = -np.inf if jnp.issubdtype(x.dtype, jnp.floating) else np.iinfo(x.dtype).min
    return lax.reduce_window(x, np.asarray(init, x.dtype), lax.max, (1, *kernel, 1),
                             (1, *strides, 1), _nhwc_pads(kernel, padding))


def _avgpool2d_nhwc(x, *, kernel, strides, padding, count_include_pad):
    pads = _nhwc_pads(kernel, padding)
    s = lax.reduce_window(x, np.asarray(0, x.dtype), lax.add, (1, *kernel, 1),
                          (1, *strides, 1), pads)
    if count_include_pad:
        return s / (kernel[0] * kernel[1])
    ones = jnp.ones((1, *x.shape[1:3], 1), x.dtype)
    n = lax.reduce_window(ones, np.asarray(0, x.dtype), lax.add, (1, *kernel, 1),
                          (1, *strides, 1), pads)
    return s / n


def _pool_nhwc_shape(ts, **attrs):
    (x,) = ts
    if len(x.shape) != 4:
        raise ShapeError(f"pool2d_nhwc: expects NHWC input, got {x.shape}")
    (y,) = _pool_shape([TensorType(tuple(x.shape[i] for i in NHWC_TO_NCHW), x.dtype)], **attrs)
    return [TensorType(tuple(y.shape[i] for i in NCHW_TO_NHWC), y.dtype)]


def _pool_nhwc_onnx(onnx_type):
    nchw = _pool_onnx(onnx_type)

    def to_onnx(ctx, ins, outs, **attrs):  # ONNX pools are NCHW: transpose in and out
        x = ctx.tmp("Transpose", [ins[0]], perm=list(NHWC_TO_NCHW))
        y = ctx.fresh()
        nchw(ctx, [x], [y], **attrs)
        ctx.node("Transpose", [y], outs, perm=list(NCHW_TO_NHWC))
    return to_onnx


_POOL_NHWC_EX = [TensorType((1, 9, 9, 3), _F32)]
declare(OpDef(name="maxpool2d_nhwc", ref=_maxpool2d_nhwc, shape=_pool_nhwc_shape, arity=1,
              attrs={"kernel": (2, 2), "strides": (2, 2), "padding": "valid"},
              to_onnx=_pool_nhwc_onnx("MaxPool"), flops=_pool_flops,
              examples=((_POOL_NHWC_EX, {}), (_POOL_NHWC_EX, {
                  "kernel": (3, 3), "padding": "same", "strides": (1, 1)})),
              doc="2-D max pooling on NHWC (ONNX MaxPool between transposes); the layout "
                  "candidate's form of maxpool2d"))
declare(OpDef(name="avgpool2d_nhwc", ref=_avgpool2d_nhwc, shape=_pool_nhwc_shape, arity=1,
              attrs={"kernel": (2, 2), "strides": (2, 2), "padding": "valid",
                     "count_include_pad": False},
              to_onnx=_pool_nhwc_onnx("AveragePool"), flops=_pool_flops,
              examples=((_POOL_NHWC_EX, {}), (_POOL_NHWC_EX, {
                  "kernel": (3, 3), "padding": (1, 1, 1, 1), "strides": (1, 1)})),
              doc="2-D average pooling on NHWC (ONNX AveragePool between transposes); the "
                  "layout candidate's form of avgpool2d"))


@onnx_importer("MaxPool", "AveragePool")
def _import_pool(ctx, ins, *, kernel_shape, auto_pad="NOTSET", pads=None, strides=None,
                 ceil_mode=0, dilations=None, storage_order=0, count_include_pad=0):
    x = ins[0]
    if (len(ctx.type(x).shape) != 4 or len(ctx.out_types) > 1
            or any(d != 1 for d in (dilations or ()))):
        return None
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    k = tuple(kernel_shape)
    st = tuple(strides or (1, 1))
    p = list(_onnx_pads(ctx, ctx.type(x).shape[2:], k, st, (1, 1), auto_pad, pads))
    if ceil_mode:
        # ceil_mode adds windows at the end; extra end padding gives the same windows
        # (max ignores -inf padding; average pooling would count it, so stays opaque).
        if ctx.source_op != "MaxPool":
            return None
        for i, size in enumerate(ctx.type(x).shape[2:]):
            out = ctx.out_types[0].shape[2 + i]
            p[2 + i] += max((out - 1) * st[i] + k[i] - (size + p[i] + p[2 + i]), 0)
    padding = canonical_padding(p, k)
    if ctx.source_op == "MaxPool":
        return [ctx.op("maxpool2d", [x], kernel=k, strides=st, padding=padding)]
    return [ctx.op("avgpool2d", [x], kernel=k, strides=st, padding=padding,
                   count_include_pad=bool(count_include_pad))]


@onnx_importer("GlobalAveragePool")
def _import_gap(ctx, ins, **_):
    rank = len(ctx.type(ins[0]).shape)
    return [ctx.op("reduce_mean", ins, axes=tuple(range(2, rank)), keepdims=True)]


@jaxpr_importer("reduce_window_max", "reduce_window_sum")
def _import_reduce_window(ctx, ins, *, window_dimensions, window_strides, padding,
                          base_dilation, window_dilation, **_):
    (x,) = ins
    rank = len(window_dimensions)
    if rank != 4 or any(d != 1 for d in (*base_dilation, *window_dilation)):
        return None
    pooled = [i for i in range(4) if window_dimensions[i] != 1 or window_strides[i] != 1
              or padding[i] != (0, 0)]
    spatial = pooled if len(pooled) == 2 else [2, 3] if set(pooled) <= {2, 3} else None
    if spatial is None:
        return None
    rest = [i for i in range(4) if i not in spatial]
    perm = (*rest, *spatial)  # pooled axes last: NCHW (NHWC input gives (0, 3, 1, 2))
    k = tuple(int(window_dimensions[i]) for i in spatial)
    st = tuple(int(window_strides[i]) for i in spatial)
    (t, b), (lf, r) = (padding[i] for i in spatial)
    pads = canonical_padding((t, lf, b, r), k)
    y = ctx.transpose(x, perm)
    if ctx.source_op == "reduce_window_max":
        y = ctx.op("maxpool2d", [y], kernel=k, strides=st, padding=pads)
    else:  # a window sum is an average that counts padding, times the window size
        y = ctx.op("avgpool2d", [y], kernel=k, strides=st, padding=pads, count_include_pad=True)
        y = ctx.op("scalar_mul", [y], scalar=float(k[0] * k[1]))
    return [ctx.transpose(y, _inverse(perm))]
