"""Convolution-family operators on NCHW activations and OIHW kernels.

Sources: ONNX operator spec (Conv, ConvTranspose); TASO (Jia et al., SOSP 2019, Table 1 and Section 3) for ``enlarge``,
the constant kernels, fused activations and ``merge_gconv``.

Padding is one attribute: ``"same"`` (begin ``d*(k-1)//2``, end the rest, for every stride,
so that a kernel can be enlarged without changing the result), ``"valid"`` (none), or an
explicit ``(top, left, bottom, right)`` tuple. The ONNX importer canonicalises explicit pads
to ``"same"``/``"valid"`` when they agree, which lets shape-generic substitutions match.
"""

from __future__ import annotations

from functools import partial

import numpy as np
from taso_jax.ops import (
    OpDef,
    ShapeError,
    TensorType,
    axiom,
    declare,
    jaxpr_importer,
    matrix_product_dims,
    onnx_importer,
)
from taso_jax.ops._lazy import LazyModule, deferred
from taso_jax.ops.windows import (
    _onnx_pads,
    _window_out,
    canonical_padding,
    explicit_pads,
)

jax = LazyModule("jax")
jnp = LazyModule("jax.numpy")
lax = LazyModule("jax.lax")
_jnp = partial(deferred, "jax.numpy")
_jnn = partial(deferred, "jax.nn")

ACTIVATIONS = {"none": lambda x: x, "relu": _jnn("relu"),
               "sigmoid": _jnn("sigmoid"), "tanh": _jnp("tanh")}
_ACT_ONNX = {"relu": "Relu", "sigmoid": "Sigmoid", "tanh": "Tanh"}
_F32 = "float32"


def check_activation(activation) -> None:
    """Raise ``ShapeError`` unless ``activation`` names a fused activation.

    Shape rules call it for every node built, so it computes nothing.
    """
    if activation not in ACTIVATIONS:
        raise ShapeError(f"unknown activation {activation!r}")


def _act(x, activation):
    check_activation(activation)
    return ACTIVATIONS[activation](x)


def _emit_act(ctx, y, outs, activation):
    if activation == "none":
        ctx.node("Identity", [y], outs)
    else:
        ctx.node(_ACT_ONNX[activation], [y], outs)


# ---- conv2d -------------------------------------------------------------------------------

def _conv2d(x, w, *, strides, padding, dilations, groups, activation):
    t, lf, b, r = explicit_pads(padding, w.shape[2:], dilations)
    y = lax.conv_general_dilated(x, w, strides, [(t, b), (lf, r)], rhs_dilation=dilations,
                                 dimension_numbers=("NCHW", "OIHW", "NCHW"),
                                 feature_group_count=groups)
    return _act(y, activation)


def _conv2d_shape(ts, *, strides, padding, dilations, groups, activation):
    x, w = ts
    if len(x.shape) != 4 or len(w.shape) != 4:
        raise ShapeError(f"conv2d: expects NCHW input and OIHW kernel, got {x.shape}, {w.shape}")
    if x.dtype != w.dtype:
        raise ShapeError(f"conv2d: dtype mismatch {x.dtype} vs {w.dtype}")
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    if groups < 1 or c % groups or o % groups or c // groups != cg:
        raise ShapeError(f"conv2d: input channels {c}, kernel {w.shape}, groups {groups} disagree")
    check_activation(activation)
    t, lf, b, r = explicit_pads(padding, (kh, kw), dilations)
    return [TensorType((n, o, _window_out(h, kh, strides[0], dilations[0], t, b),
                        _window_out(wd, kw, strides[1], dilations[1], lf, r)), x.dtype)]


def _conv2d_flops(ins, outs, **_):
    o, cg, kh, kw = ins[1].shape
    return 2.0 * outs[0].size * cg * kh * kw


def _conv2d_product(ins, outs, *, groups=1, **_):
    o, cg, kh, kw = ins[1].shape
    return matrix_product_dims(outs[0], o, cg * kh * kw, groups)


def _conv2d_onnx(ctx, ins, outs, *, strides, padding, dilations, groups, activation):
    kh, kw = ctx.shape(ins[1])[2:]
    t, lf, b, r = explicit_pads(padding, (kh, kw), dilations)
    y = outs[0] if activation == "none" else ctx.fresh()
    ctx.node("Conv", ins, [y], strides=list(strides), pads=[t, lf, b, r],
             dilations=list(dilations), group=groups, kernel_shape=[kh, kw])
    if activation != "none":
        _emit_act(ctx, y, outs, activation)


# ---- laws (TASO, SOSP 2019, Table 2: convolution laws) -----------------------------------
# Each law is one literal line. Shapes and the attribute values the numeric check tries:
_C = {"x": ("N", "C", "H", "W"), "y": ("N", "C", "H", "W"), "w": ("D", "C", 3, 3),
      "v": ("D", "C", 3, 3), "s": (1, "D", 1, 1)}
_P = {"st": ((1, 1), (2, 2)), "p": ("same", "valid")}
_PD = {**_P, "dl": ((1, 1), (2, 1))}
_F = ("none", "relu", "sigmoid", "tanh")
_PER_CHANNEL = ("dim(s, -4) == 1", "dim(s, -2) == 1", "dim(s, -1) == 1")
# Laws over groups=q hold for any number of groups: the shapes are grouped (input channels
# q*E, kernel q*D x E), and q = 1 is the ungrouped case.
_G = {"x": ("N", "q*E", "H", "W"), "y": ("N", "q*E", "H", "W"), "w": ("q*D", "E", 3, 3),
      "v": ("q*D", "E", 3, 3), "s": (1, "q*D", 1, 1)}
_GPD = {**_PD, "q": (1, 2, 3)}

_CONV2D_LAWS = (
    axiom("conv2d(ewadd(x, y), w, strides=st, padding=p, dilations=dl, groups=q) = ewadd(conv2d(x, w, strides=st, padding=p, dilations=dl, groups=q), conv2d(y, w, strides=st, padding=p, dilations=dl, groups=q))",
          _G, **_GPD),
    axiom("conv2d(x, ewadd(w, v), strides=st, padding=p, dilations=dl, groups=q) = ewadd(conv2d(x, w, strides=st, padding=p, dilations=dl, groups=q), conv2d(x, v, strides=st, padding=p, dilations=dl, groups=q))",
          _G, **_GPD),
    axiom("conv2d(x, concat(w, v, axis=-4), strides=st, padding=p, dilations=dl, activation=f) = concat(conv2d(x, w, strides=st, padding=p, dilations=dl, activation=f), conv2d(x, v, strides=st, padding=p, dilations=dl, activation=f), axis=-3)",
          _C, f=_F, **_PD),
    axiom("conv2d(concat(x, y, axis=-3), concat(w, v, axis=-3), strides=st, padding=p, dilations=dl) = ewadd(conv2d(x, w, strides=st, padding=p, dilations=dl), conv2d(y, v, strides=st, padding=p, dilations=dl))",
          {**_C, "y": ("N", "E", "H", "W"), "v": ("D", "E", 3, 3)}, **_PD),
    axiom("conv2d(concat(x, y, axis=-4), w, strides=st, padding=p, dilations=dl, groups=q, activation=f) = concat(conv2d(x, w, strides=st, padding=p, dilations=dl, groups=q, activation=f), conv2d(y, w, strides=st, padding=p, dilations=dl, groups=q, activation=f), axis=-4)",
          _G, f=_F, **_GPD),
    axiom("conv2d(x, w, strides=st, padding=p, dilations=dl, groups=q, activation='relu') = relu(conv2d(x, w, strides=st, padding=p, dilations=dl, groups=q))",
          _G, **_GPD),
    axiom("conv2d(x, w, strides=st, padding=p, dilations=dl, groups=q, activation='sigmoid') = sigmoid(conv2d(x, w, strides=st, padding=p, dilations=dl, groups=q))",
          _G, **_GPD),
    axiom("conv2d(x, w, strides=st, padding=p, dilations=dl, groups=q, activation='tanh') = tanh(conv2d(x, w, strides=st, padding=p, dilations=dl, groups=q))",
          _G, **_GPD),
    # a per-output-channel scale folds into the kernel, for any groups; the conditions say
    # that s is [1, D, 1, 1] (Z3 does not know shapes otherwise)
    axiom("ewmul(conv2d(x, w, strides=st, padding=p, dilations=dl, groups=q), s) = conv2d(x, ewmul(w, transpose(s, perm=(1, 0, 2, 3))), strides=st, padding=p, dilations=dl, groups=q)",
          _G, where=_PER_CHANNEL, **_GPD),
    # ... and so does a per-input-channel scale (ungrouped: the kernel spans all C)
    axiom("conv2d(ewmul(x, r), w, strides=st, padding=p, dilations=dl, activation=f) = conv2d(x, ewmul(w, r), strides=st, padding=p, dilations=dl, activation=f)",
          {**_C, "r": (1, "C", 1, 1)},
          where=("dim(r, -4) == 1", "dim(r, -2) == 1", "dim(r, -1) == 1"), f=_F, **_PD),
    axiom("dim(conv2d(x, w, strides=st, padding=p, dilations=dl, groups=q, activation=f), -3) = dim(w, -4)",
          _G, f=("none", "relu"), **_GPD),
    # 'same' padding at stride 1 keeps the spatial size
    axiom("dim(conv2d(x, w, strides=(1, 1), padding='same', dilations=dl, groups=q, activation=f), -1) = dim(x, -1)",
          _G, f=("none", "relu"), dl=((1, 1), (2, 1)), q=(1, 2, 3)),
    axiom("dim(conv2d(x, w, strides=(1, 1), padding='same', dilations=dl, groups=q, activation=f), -2) = dim(x, -2)",
          _G, f=("none", "relu"), dl=((1, 1), (2, 1)), q=(1, 2, 3)),
    axiom("conv2d(scalar_mul(x, scalar=c), w, strides=st, padding=p, dilations=dl) = scalar_mul(conv2d(x, w, strides=st, padding=p, dilations=dl), scalar=c)",
          _C, c=(2.0,), **_PD),
    axiom("conv2d(x, enlarge(u, w), strides=st, padding='same', dilations=dl, activation=f) = conv2d(x, u, strides=st, padding='same', dilations=dl, activation=f)",
          {**_C, "u": ("D", "C", 1, 1)}, st=((1, 1), (2, 2)), dl=((1, 1), (2, 1)),
          f=("none", "relu")),
    # two branch convolutions side by side are one grouped convolution (each of the 2g
    # groups reads its own channels)
    axiom("conv2d(concat(x, y, axis=-3), concat(w, v, axis=-4), groups=g + g, strides=st, padding=p, dilations=dl, activation=f) = concat(conv2d(x, w, groups=g, strides=st, padding=p, dilations=dl, activation=f), conv2d(y, v, groups=g, strides=st, padding=p, dilations=dl, activation=f), axis=-3)",
          {"x": ("N", "g*E", "H", "W"), "y": ("N", "g*E", "H", "W"), "w": ("g*D", "E", 3, 3),
           "v": ("g*D", "E", 3, 3)}, g=(1, 2, 3), f=_F, **_PD),
)

_ENLARGE_LAWS = (
    axiom("enlarge(concat(u, v, axis=-4), w) = concat(enlarge(u, w), enlarge(v, w), axis=-4)",
          {"u": ("D", "C", 1, 1), "v": ("E", "C", 1, 1), "w": ("F", "C", 3, 3)}),
    axiom("dim(enlarge(u, w), -4) = dim(u, -4)", {"u": ("D", "C", 1, 1), "w": ("F", "C", 3, 3)}),
    axiom("dim(enlarge(u, w), -3) = dim(u, -3)", {"u": ("D", "C", 1, 1), "w": ("F", "C", 3, 3)}),
    axiom("dim(enlarge(u, w), -2) = dim(w, -2)", {"u": ("D", "C", 1, 1), "w": ("F", "C", 3, 3)}),
    axiom("dim(enlarge(u, w), -1) = dim(w, -1)", {"u": ("D", "C", 1, 1), "w": ("F", "C", 3, 3)}),
    # enlarging a kernel to its own size changes nothing
    axiom("enlarge(u, w) = u", {"u": ("D", "C", "K", "K"), "w": ("E", "C", "K", "K")},
          where=("h = dim(u, -2)", "h = dim(w, -2)", "k = dim(u, -1)", "k = dim(w, -1)")),
)

_MERGE_GCONV_LAWS = (
    # a grouped kernel rewritten block-diagonally for fewer groups (TASO merge_gconv)
    axiom("conv2d(x, merge_gconv(w, groups=g, count=c), groups=q, strides=st, padding=p, dilations=dl, activation=f) = conv2d(x, w, groups=g, strides=st, padding=p, dilations=dl, activation=f)",
          {"x": ("N", "q*c*E", "H", "W"), "w": ("q*c*D", "E", 3, 3)}, where=("g = q * c",),
          q=(1, 2), c=(2, 3), f=("none", "tanh"), st=((2, 2),), p=("same",), dl=((2, 1),)),
)

_IDENTITY_KERNEL_LAWS = (
    # a depthwise convolution with a centred one is the identity, for any kernel size
    axiom("conv2d(x, constant_identity_kernel(channels=c, kernel=k, dtype=t), padding='same', groups=c) = x",
          {"x": ("N", "C", "H", "W")}, where=("c = dim(x, -3)",),
          k=((3, 3), (1, 1), (5, 3), (2, 2), (1, 4)), t=("float64",)),
)

_POOL_KERNEL_LAWS = (
    # average pooling that counts the padding is a depthwise convolution
    axiom("avgpool2d(x, kernel=k, strides=st, padding=p, count_include_pad=True) = conv2d(x, constant_pool_kernel(channels=c, kernel=k, dtype=t), strides=st, padding=p, groups=c)",
          {"x": ("N", "C", "H", "W")}, where=("c = dim(x, -3)",), k=((3, 3), (2, 2), (1, 3)),
          st=((1, 1), (2, 2)), p=("valid", "same", (1, 0, 1, 0)), t=("float64",)),
)


declare(OpDef(
    name="conv2d", ref=_conv2d, shape=_conv2d_shape, arity=2,
    attrs={"strides": (1, 1), "padding": "same", "dilations": (1, 1), "groups": 1,
           "activation": "none"},
    to_onnx=_conv2d_onnx, flops=_conv2d_flops,
    examples=(
        ([TensorType((1, 4, 9, 9), _F32), TensorType((6, 4, 3, 3), _F32)], {}),
        ([TensorType((2, 4, 8, 8), _F32), TensorType((6, 2, 3, 3), _F32)],
         {"strides": (2, 2), "groups": 2, "activation": "relu"}),
        ([TensorType((1, 4, 9, 9), _F32), TensorType((4, 4, 3, 1), _F32)],
         {"padding": (1, 0, 2, 1), "dilations": (2, 1), "activation": "tanh"}),
        ([TensorType((1, 4, 9, 9), _F32), TensorType((4, 4, 3, 3), _F32)],
         {"padding": "valid", "activation": "sigmoid"}),
        ([TensorType((1, 8, 6, 6), _F32), TensorType((8, 1, 3, 3), _F32)], {"groups": 8}),
    ),
    axioms=_CONV2D_LAWS,
    grouped_kernel_axis=1, dot_operands=(0, 1), product_dims=_conv2d_product,
    channel_scale=(-3, -4),
    doc="2-D convolution, NCHW x OIHW -> NCHW, with groups and fused activation (ONNX Conv)"))


# ---- conv2d in NHWC ------------------------------------------------------------------------
# The same convolution with activations in NHWC and kernels in HWIO, the layouts XLA:CPU runs
# fastest (a 3x3 convolution on 1x56x56x64 took 5.4 ms NHWC, 9.3 ms NCHW under jax.jit on 2
# cores). No substitution is stated on it: the rules see conv2d, and
# taso_jax.ir.layout.to_nhwc turns a finished graph's convolutions into this one,
# a candidate that the end-to-end choice times like any other. It has no axioms (every
# axiom joins every proof); NHWC_LAW, its relation to conv2d, is checked numerically in the
# tests.

NCHW_TO_NHWC = (0, 2, 3, 1)
NHWC_TO_NCHW = (0, 3, 1, 2)
OIHW_TO_HWIO = (2, 3, 1, 0)
HWIO_TO_OIHW = (3, 2, 0, 1)
NHWC_LAW = axiom(
    "conv2d_nhwc(x, w, strides=st, padding=p, dilations=dl, groups=q, activation=f) = transpose(conv2d(transpose(x, perm=(0, 3, 1, 2)), transpose(w, perm=(3, 2, 0, 1)), strides=st, padding=p, dilations=dl, groups=q, activation=f), perm=(0, 2, 3, 1))",
    {"x": ("N", "H", "W", "q*E"), "w": (3, 3, "E", "q*D")}, f=("none", "relu"), q=(1, 2),
    **_PD)


def _conv2d_nhwc(x, w, *, strides, padding, dilations, groups, activation):
    t, lf, b, r = explicit_pads(padding, w.shape[:2], dilations)
    y = lax.conv_general_dilated(x, w, strides, [(t, b), (lf, r)], rhs_dilation=dilations,
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                 feature_group_count=groups)
    return _act(y, activation)


def _conv2d_nhwc_shape(ts, *, strides, padding, dilations, groups, activation):
    x, w = ts
    if len(x.shape) != 4 or len(w.shape) != 4:
        raise ShapeError(f"conv2d_nhwc: expects NHWC input and HWIO kernel, got {x.shape}, "
                         f"{w.shape}")
    nchw = [TensorType(tuple(x.shape[i] for i in NHWC_TO_NCHW), x.dtype),
            TensorType(tuple(w.shape[i] for i in HWIO_TO_OIHW), w.dtype)]
    (y,) = _conv2d_shape(nchw, strides=strides, padding=padding, dilations=dilations,
                         groups=groups, activation=activation)
    return [TensorType(tuple(y.shape[i] for i in NCHW_TO_NHWC), y.dtype)]


def _conv2d_nhwc_flops(ins, outs, **_):
    kh, kw, cg, o = ins[1].shape
    return 2.0 * outs[0].size * cg * kh * kw


def _conv2d_nhwc_product(ins, outs, *, groups=1, **_):
    kh, kw, cg, o = ins[1].shape
    return matrix_product_dims(outs[0], o, cg * kh * kw, groups)


def _conv2d_nhwc_onnx(ctx, ins, outs, *, strides, padding, dilations, groups, activation):
    # ONNX Conv is NCHW/OIHW only: transpose in, conv2d's own export, transpose out
    x = ctx.tmp("Transpose", [ins[0]], perm=list(NHWC_TO_NCHW))
    w = ctx.tmp("Transpose", [ins[1]], perm=list(HWIO_TO_OIHW))
    hwio = ctx.types[ins[1]]
    ctx.types[w] = TensorType(tuple(hwio.shape[i] for i in HWIO_TO_OIHW), hwio.dtype)
    y = ctx.fresh()
    _conv2d_onnx(ctx, [x, w], [y], strides=strides, padding=padding, dilations=dilations,
                 groups=groups, activation=activation)
    ctx.node("Transpose", [y], outs, perm=list(NCHW_TO_NHWC))


declare(OpDef(
    name="conv2d_nhwc", ref=_conv2d_nhwc, shape=_conv2d_nhwc_shape, arity=2,
    attrs={"strides": (1, 1), "padding": "same", "dilations": (1, 1), "groups": 1,
           "activation": "none"},
    to_onnx=_conv2d_nhwc_onnx, flops=_conv2d_nhwc_flops,
    examples=(
        ([TensorType((1, 9, 9, 4), _F32), TensorType((3, 3, 4, 6), _F32)], {}),
        ([TensorType((2, 8, 8, 4), _F32), TensorType((3, 3, 2, 6), _F32)],
         {"strides": (2, 2), "groups": 2, "activation": "relu"}),
        ([TensorType((1, 9, 9, 4), _F32), TensorType((3, 1, 4, 4), _F32)],
         {"padding": (1, 0, 2, 1), "dilations": (2, 1), "activation": "tanh"}),
    ),
    grouped_kernel_axis=2, dot_operands=(0, 1), product_dims=_conv2d_nhwc_product,
    channel_scale=(-1, -1),
    doc="2-D convolution, NHWC x HWIO -> NHWC, with groups and fused activation; conv2d in "
        "the layouts XLA:CPU prefers (exported to ONNX as Transpose, Conv, Transpose)"))


@onnx_importer("Conv")
def _import_conv(ctx, ins, *, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None,
                 pads=None, strides=None):
    x, w = ins[0], ins[1]
    if len(ctx.type(x).shape) == 3 and len(ctx.type(w).shape) == 3:
        return _import_conv1d(ctx, ins, auto_pad=auto_pad, dilations=dilations, group=group,
                              pads=pads, strides=strides)
    if len(ctx.type(x).shape) != 4:
        return None  # 3-D convolutions stay opaque
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    dil = tuple(dilations or (1, 1))
    st = tuple(strides or (1, 1))
    k_hw = ctx.type(w).shape[2:]
    p = _onnx_pads(ctx, ctx.type(x).shape[2:], k_hw, st, dil, auto_pad, pads)
    y = ctx.op("conv2d", [x, w], strides=st, padding=canonical_padding(p, k_hw, dil),
               dilations=dil, groups=int(group))
    if len(ins) > 2 and ins[2] is not None:
        o = ctx.type(w).shape[0]
        y = ctx.op("ewadd", [y, ctx.op("reshape", [ins[2]], shape=(1, o, 1, 1))])
    return [y]


def _import_conv1d(ctx, ins, *, auto_pad, dilations, group, pads, strides):
    """ONNX Conv over one spatial axis (``x [N, C, L]``, ``w [O, C/group, k]``) as conv2d.

    The signal becomes an image of height 1 (``[N, C, 1, L]``, kernel ``[O, C/group, 1, k]``,
    strides, dilations and pads 1 / 0 on the new axis), and the output ``[N, O, 1, L']``
    goes back to ``[N, O, L']``: what XLA lowers a 1-D convolution to as well. Audio and
    sequence models (speech-quality nets, EEG detectors, voice activity detectors) are made
    of them.
    """
    x, w = ins[0], ins[1]
    n, c, length = ctx.type(x).shape
    o, cg, k = ctx.type(w).shape
    x4 = ctx.op("reshape", [x], shape=(n, c, 1, length))
    w4 = ctx.op("reshape", [w], shape=(o, cg, 1, k))
    pads2 = None if pads is None else (0, int(pads[0]), 0, int(pads[1]))
    y = _import_conv(ctx, [x4, w4, *ins[2:]], auto_pad=auto_pad,
                     dilations=(1, *(dilations or (1,))), group=group,
                     kernel_shape=None, pads=pads2, strides=(1, *(strides or (1,))))
    if y is None:
        return None
    (y,) = y
    yn, yo, _, yl = y.shape
    return [ctx.op("reshape", [y], shape=(yn, yo, yl))]


# ---- conv_transpose -------------------------------------------------------------------------
# ONNX ConvTranspose, the gradient of a convolution with respect to its input: each input pixel
# scatters the kernel, scaled by its value, onto the output at stride spacing; `pads` then crop
# (top, left, bottom, right) and `output_padding` adds rows and columns at the bottom and
# right. Computed as a stride-1 convolution of the input dilated by the strides with the
# kernel flipped and its two channel axes swapped (per group), padded by d * (k - 1) - pad on
# each side (negative: a crop; a negative pad adds zeros).

def _conv_transpose_out(size, k, s, d, pb, pe, op):
    out = s * (size - 1) + op + d * (k - 1) + 1 - pb - pe
    if out <= 0:
        raise ShapeError(f"conv_transpose: output size {out} for input size {size}")
    return out


def _conv_transpose_kernel(w, groups):
    """The OIHW kernel of the equivalent convolution.

    Per group, ``[C_in, C_out/g, kh, kw]`` becomes ``[C_out, C_in/g, kh, kw]``, flipped in
    space.
    """
    ci, cog, kh, kw = w.shape
    w = w.reshape(groups, ci // groups, cog, kh, kw).transpose(0, 2, 1, 3, 4)
    return w.reshape(groups * cog, ci // groups, kh, kw)[:, :, ::-1, ::-1]


def _conv_transpose(x, w, *, strides, pads, dilations, groups, output_padding):
    k = w.shape[2:]
    lo = [d * (kk - 1) - p for kk, d, p in zip(k, dilations, pads[:2], strict=True)]
    hi = [d * (kk - 1) - p + o for kk, d, p, o in zip(k, dilations, pads[2:], output_padding,
                                                        strict=True)]
    # The input dilated by the strides (interior padding) and padded by d * (k - 1) - pad
    # on each side (a negative pad crops), then a VALID convolution. Written with lax.pad
    # rather than the convolution's lhs_dilation: XLA:CPU's algebraic simplifier aborted the
    # process (a failed check, "Window dimensions do not match RHS shape") on a kernel wider
    # than its cropped input with lhs_dilation (x [5, 4, 5, 2], w [4, 3, 2, 3], strides 2,
    # pads (1, 0, 1, 1)).
    zero = jnp.zeros((), x.dtype)
    xp = lax.pad(x, zero, [(0, 0, 0), (0, 0, 0)] + [
        (a, b, s - 1) for a, b, s in zip(lo, hi, strides, strict=True)])
    return lax.conv_general_dilated(
        xp, _conv_transpose_kernel(w, groups), (1, 1), "VALID", rhs_dilation=dilations,
        dimension_numbers=("NCHW", "OIHW", "NCHW"), feature_group_count=groups)


def _conv_transpose_shape(ts, *, strides, pads, dilations, groups, output_padding):
    x, w = ts
    if len(x.shape) != 4 or len(w.shape) != 4:
        raise ShapeError("conv_transpose: expects NCHW input and [C_in, C_out/groups, kh, kw] "
                         f"kernel, got {x.shape}, {w.shape}")
    if x.dtype != w.dtype:
        raise ShapeError(f"conv_transpose: dtype mismatch {x.dtype} vs {w.dtype}")
    n, c, h, wd = x.shape
    ci, cog, kh, kw = w.shape
    if groups < 1 or c != ci or c % groups:
        raise ShapeError(f"conv_transpose: input channels {c}, kernel {w.shape}, groups "
                         f"{groups} disagree")
    if len(pads) != 4 or any(
            o < 0 or o >= max(s, d) for o, s, d in zip(output_padding, strides, dilations,
                                                       strict=True)):
        raise ShapeError(f"conv_transpose: pads {pads}, output_padding {output_padding} "
                         "invalid")
    return [TensorType((n, cog * groups,
                        _conv_transpose_out(h, kh, strides[0], dilations[0], pads[0], pads[2],
                                            output_padding[0]),
                        _conv_transpose_out(wd, kw, strides[1], dilations[1], pads[1], pads[3],
                                            output_padding[1])), x.dtype)]


def _conv_transpose_flops(ins, outs, **_):
    ci, cog, kh, kw = ins[1].shape
    return 2.0 * ins[0].size * cog * kh * kw  # every input pixel scatters one kernel slice


def _conv_transpose_onnx(ctx, ins, outs, *, strides, pads, dilations, groups, output_padding):
    kh, kw = ctx.shape(ins[1])[2:]
    attrs = {"output_padding": list(output_padding)} if any(output_padding) else {}
    extra = [max(-p, 0) for p in pads]  # ONNX pads are not negative: zeros added by a Pad
    y = ctx.fresh() if any(extra) else outs[0]
    ctx.node("ConvTranspose", ins, [y], strides=list(strides), pads=[max(p, 0) for p in pads],
             dilations=list(dilations), group=groups, kernel_shape=[kh, kw], **attrs)
    if any(extra):
        t, lf, b, r = extra
        ctx.node("Pad", [y, ctx.const(np.array([0, 0, t, lf, 0, 0, b, r], np.int64))], outs)


_CT = {"x": ("N", "C", "H", "W"), "y": ("N", "C", "H", "W"), "w": ("C", "D", 3, 3),
       "v": ("C", "D", 3, 3), "s": (1, "D", 1, 1)}
_CTG = {"x": ("N", "q*E", "H", "W"), "y": ("N", "q*E", "H", "W"), "w": ("q*E", "D", 2, 3),
        "v": ("q*E", "D", 2, 3)}
_CTA = {"st": ((2, 2), (2, 1)), "pd": ((0, 0, 0, 0), (1, 0, 1, 1)),
        "dl": ((1, 1), (2, 1))}
_CONV_TRANSPOSE_LAWS = (
    axiom("conv_transpose(ewadd(x, y), w, strides=st, pads=pd, dilations=dl, groups=q) = ewadd(conv_transpose(x, w, strides=st, pads=pd, dilations=dl, groups=q), conv_transpose(y, w, strides=st, pads=pd, dilations=dl, groups=q))",
          _CTG, q=(1, 2), **_CTA),
    axiom("conv_transpose(x, ewadd(w, v), strides=st, pads=pd, dilations=dl, groups=q) = ewadd(conv_transpose(x, w, strides=st, pads=pd, dilations=dl, groups=q), conv_transpose(x, v, strides=st, pads=pd, dilations=dl, groups=q))",
          _CTG, q=(1, 2), **_CTA),
    # kernels side by side on the output-channel axis give the outputs side by side: two
    # transposed convolutions of one input merge into one
    axiom("conv_transpose(x, concat(w, v, axis=-3), strides=st, pads=pd, dilations=dl) = concat(conv_transpose(x, w, strides=st, pads=pd, dilations=dl), conv_transpose(x, v, strides=st, pads=pd, dilations=dl), axis=-3)",
          _CT, **_CTA),
    # a per-output-channel scale (a batchnorm after it) folds into the kernel's axis 1
    axiom("ewmul(conv_transpose(x, w, strides=st, pads=pd, dilations=dl), s) = conv_transpose(x, ewmul(w, s), strides=st, pads=pd, dilations=dl)",
          _CT, where=_PER_CHANNEL, **_CTA),
    axiom("dim(conv_transpose(x, w, strides=st, pads=pd, dilations=dl), -3) = dim(w, -3)",
          _CT, **_CTA),
)

declare(OpDef(
    name="conv_transpose", ref=_conv_transpose, shape=_conv_transpose_shape, arity=2,
    attrs={"strides": (1, 1), "pads": (0, 0, 0, 0), "dilations": (1, 1), "groups": 1,
           "output_padding": (0, 0)},
    to_onnx=_conv_transpose_onnx, flops=_conv_transpose_flops, dot_operands=(0, 1),
    examples=(
        ([TensorType((1, 4, 5, 5), _F32), TensorType((4, 3, 2, 2), _F32)], {"strides": (2, 2)}),
        ([TensorType((2, 4, 5, 6), _F32), TensorType((4, 3, 3, 3), _F32)],
         {"strides": (2, 2), "pads": (1, 1, 1, 1), "output_padding": (1, 0), "groups": 2}),
        ([TensorType((1, 2, 4, 4), _F32), TensorType((2, 2, 3, 2), _F32)],
         {"strides": (3, 1), "pads": (0, 1, 2, 0), "dilations": (2, 1)}),
        ([TensorType((1, 2, 6, 6), _F32), TensorType((2, 3, 2, 2), _F32)],
         {"strides": (1, 1), "pads": (2, 2, 2, 2)}),
        ([TensorType((1, 1, 3, 3), _F32), TensorType((1, 2, 3, 3), _F32)],
         {"strides": (3, 2), "pads": (0, 0, -1, -1)}),
    ),
    axioms=_CONV_TRANSPOSE_LAWS,
    doc="2-D transposed convolution, NCHW x [C_in, C_out/groups, kh, kw] -> NCHW, with "
        "pads (top, left, bottom, right) cropped and output_padding (ONNX ConvTranspose)"))


def _conv_transpose_pads(x_hw, k_hw, strides, dilations, output_padding, auto_pad, pads,
                         output_shape):
    """ONNX ConvTranspose's pads (begins, then ends) from its attributes.

    Pads derived from ``output_shape`` (or ``SAME_*``) are split as the spec and onnxruntime
    split them; an ``output_shape`` larger than the natural size gives negative pads, rows
    and columns of zeros added.
    """
    if output_shape is None and auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        output_shape = [size * s for size, s in zip(x_hw, strides, strict=True)]
    if output_shape is None:
        return (0,) * 2 * len(x_hw) if pads is None or auto_pad == "VALID" else tuple(pads)
    begin, end = [], []
    for size, k, s, d, o, want in zip(x_hw, k_hw, strides, dilations, output_padding,
                                      output_shape, strict=True):
        total = s * (size - 1) + o + (k - 1) * d + 1 - want
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            total = max(total, 0)  # a kernel shorter than the stride: the natural size
        # the spec's split, as onnxruntime makes it: the odd pixel at the end for SAME_UPPER,
        # at the start otherwise; a negative total (one row of zeros more) rounds the same way
        half = total // 2
        b = half if auto_pad == "SAME_UPPER" else total - half
        begin.append(b)
        end.append(total - b)
    return tuple(begin) + tuple(end)


@onnx_importer("ConvTranspose")
def _import_conv_transpose(ctx, ins, *, auto_pad="NOTSET", dilations=None, group=1,
                           kernel_shape=None, output_padding=None, output_shape=None, pads=None,
                           strides=None):
    x, w = ins[0], ins[1]
    rank = len(ctx.type(x).shape)
    if rank not in (3, 4):
        return None  # 3-D transposed convolutions stay opaque
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    sp = rank - 2
    st = tuple(strides or (1,) * sp)
    dil = tuple(dilations or (1,) * sp)
    op = tuple(output_padding or (0,) * sp)
    if output_shape is not None and len(output_shape) > sp:
        output_shape = output_shape[-sp:]  # older exporters wrote N and C too
    pd = _conv_transpose_pads(ctx.type(x).shape[2:], ctx.type(w).shape[2:], st, dil, op,
                              auto_pad, pads, output_shape)
    if sp == 1:  # 1-D: one row of a 2-D transposed convolution
        x = ctx.reshape(x, ctx.type(x).shape[:2] + (1,) + ctx.type(x).shape[2:])
        w = ctx.reshape(w, ctx.type(w).shape[:2] + (1,) + ctx.type(w).shape[2:])
        st, dil, op, pd = (1,) + st, (1,) + dil, (0,) + op, (0, pd[0], 0, pd[1])
    y = ctx.op("conv_transpose", [x, w], strides=st, pads=pd, dilations=dil,
               groups=int(group), output_padding=op)
    if len(ins) > 2 and ins[2] is not None:
        o = ctx.type(y).shape[1]
        y = ctx.op("ewadd", [y, ctx.op("reshape", [ins[2]], shape=(1, o, 1, 1))])
    if sp == 1:
        y = ctx.reshape(y, ctx.out_types[0].shape)
    return [y]


# ---- enlarge ------------------------------------------------------------------------------

def _enlarge(w, ref):
    dh = ref.shape[2] - w.shape[2]
    dw = ref.shape[3] - w.shape[3]
    return jnp.pad(w, ((0, 0), (0, 0), (dh // 2, dh - dh // 2), (dw // 2, dw - dw // 2)))


def _enlarge_shape(ts):
    w, ref = ts
    if len(w.shape) != 4 or len(ref.shape) != 4:
        raise ShapeError(f"enlarge: expects OIHW kernels, got {w.shape}, {ref.shape}")
    dh, dw = ref.shape[2] - w.shape[2], ref.shape[3] - w.shape[3]
    if dh < 0 or dw < 0 or dh % 2 or dw % 2:
        raise ShapeError(f"enlarge: cannot centre kernel {w.shape[2:]} in {ref.shape[2:]}")
    return [TensorType(w.shape[:2] + ref.shape[2:], w.dtype)]


def _enlarge_onnx(ctx, ins, outs):
    kh, kw = ctx.shape(ins[0])[2:]
    rh, rw = ctx.shape(ins[1])[2:]
    dh, dw = rh - kh, rw - kw
    pads = np.array([0, 0, dh // 2, dw // 2, 0, 0, dh - dh // 2, dw - dw // 2], np.int64)
    ctx.node("Pad", [ins[0], ctx.const(pads)], outs)


declare(OpDef(
    name="enlarge", copies_values=True, ref=_enlarge, shape=_enlarge_shape, arity=2,
    to_onnx=_enlarge_onnx, flops=lambda i, o: 0.0,
    examples=(([TensorType((4, 2, 1, 1), _F32), TensorType((3, 2, 3, 5), _F32)], {}),),
    axioms=_ENLARGE_LAWS,
    doc="zero-pad kernel w (OIHW) to the spatial size of ref, centred (TASO enlarge)"))


# ---- merged grouped convolution kernel ----------------------------------------------------

def _merge_gconv(w, *, groups, count):
    o = w.shape[0]
    opg = o // groups
    block = (np.arange(o) // opg) % count
    onehot = jnp.asarray(block[:, None] == np.arange(count)[None, :], w.dtype)
    merged = w[:, None] * onehot[:, :, None, None, None]
    return merged.reshape(o, count * w.shape[1], *w.shape[2:])


def _merge_gconv_shape(ts, *, groups, count):
    (w,) = ts
    if count < 2:  # merging one group into itself is the identity: not worth a node
        raise ShapeError(f"merge_gconv: count must be at least 2, got {count}")
    if len(w.shape) != 4 or groups < 1 or w.shape[0] % groups or groups % count:
        raise ShapeError(f"merge_gconv: kernel {w.shape}, groups {groups}, count {count} disagree")
    return [TensorType((w.shape[0], w.shape[1] * count, *w.shape[2:]), w.dtype)]


def _merge_gconv_onnx(ctx, ins, outs, *, groups, count):
    o, cg, kh, kw = ctx.shape(ins[0])
    block = (np.arange(o) // (o // groups)) % count
    onehot = (block[:, None] == np.arange(count)[None, :]).astype(ctx.dtype(ins[0]))
    unsq = ctx.tmp("Unsqueeze", [ins[0], ctx.const(np.array([1], np.int64))])
    prod = ctx.tmp("Mul", [unsq, ctx.const(onehot.reshape(o, count, 1, 1, 1))])
    ctx.node("Reshape", [prod, ctx.const(np.array([o, count * cg, kh, kw], np.int64))], outs)


declare(OpDef(
    name="merge_gconv", copies_values=True, ref=_merge_gconv, shape=_merge_gconv_shape, arity=1,
    attrs={"groups": 1, "count": 1},
    to_onnx=_merge_gconv_onnx, flops=lambda i, o, **_: 0.0,
    examples=(([TensorType((8, 2, 3, 3), _F32)], {"groups": 4, "count": 2}),
              ([TensorType((8, 2, 3, 3), _F32)], {"groups": 8, "count": 2})),
    axioms=_MERGE_GCONV_LAWS,
    doc="kernel of a conv with `groups` groups, rewritten block-diagonally for groups/count "
        "groups (TASO merge_gconv)"))


# ---- constant kernels ---------------------------------------------------------------------

def _const_kernel(value_fn):
    def ref(*, channels, kernel, dtype):
        k = np.zeros((channels, 1, *kernel), dtype)
        value_fn(k, kernel)
        return jnp.asarray(k)
    return ref


def _centre_one(k, kernel):
    k[:, :, (kernel[0] - 1) // 2, (kernel[1] - 1) // 2] = 1


def _uniform(k, kernel):
    k[...] = 1.0 / (kernel[0] * kernel[1])


def _const_kernel_shape(ts, *, channels, kernel, dtype):
    return [TensorType((channels, 1, *kernel), dtype)]


def _const_onnx(ref):
    def to_onnx(ctx, ins, outs, **attrs):
        ctx.node("Identity", [ctx.const(np.asarray(ref(**attrs)))], outs)
    return to_onnx


for _name, _fill, _laws, _doc in (
        ("constant_identity_kernel", _centre_one, _IDENTITY_KERNEL_LAWS,
         "depthwise kernel [C,1,kh,kw], 1 at the centre: conv2d with groups=C is identity (TASO)"),
        ("constant_pool_kernel", _uniform, _POOL_KERNEL_LAWS,
         "depthwise kernel [C,1,kh,kw] of 1/(kh*kw): conv2d with groups=C is average pooling "
         "(TASO)")):
    _ref = _const_kernel(_fill)
    declare(OpDef(name=_name, ref=_ref, shape=_const_kernel_shape, arity=0,
                  attrs={"channels": 1, "kernel": (3, 3), "dtype": _F32},
                  to_onnx=_const_onnx(_ref), flops=lambda i, o, **_: 0.0,
                  examples=(([], {"channels": 3, "kernel": (3, 3)}),), axioms=_laws, doc=_doc))


def _constant_one(*, shape, dtype):
    return jnp.ones(shape, dtype)


declare(OpDef(name="constant_one", ref=_constant_one,
              shape=lambda ts, *, shape, dtype: [TensorType(shape, dtype)], arity=0,
              attrs={"shape": (1,), "dtype": _F32}, to_onnx=_const_onnx(_constant_one),
              flops=lambda i, o, **_: 0.0,
              examples=(([], {"shape": (2, 3)}),), doc="tensor of ones (TASO constant one)"))


# ---- jaxpr primitives ---------------------------------------------------------------------

def _inverse(perm):
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return tuple(inv)


@jaxpr_importer("conv_general_dilated")
def _import_conv_jaxpr(ctx, ins, *, window_strides, padding, lhs_dilation, rhs_dilation,
                       dimension_numbers, feature_group_count, batch_group_count,
                       preferred_element_type=None, **_):
    # Any layout (flax uses NHWC/HWIO): transpose into NCHW/OIHW, convolve, transpose back.
    # The layout pass (taso_jax.ir.layout) later cancels the transposes between convolutions.
    lhs, rhs = ins
    if (len(ctx.type(lhs).shape) != 4 or any(d != 1 for d in lhs_dilation)
            or batch_group_count != 1
            or (preferred_element_type is not None
                and str(np.dtype(preferred_element_type)) != ctx.out_types[0].dtype)):
        return None  # 1-D/3-D, transposed (lhs-dilated) and batch-grouped convolutions
    dn = dimension_numbers
    x = ctx.transpose(lhs, tuple(dn.lhs_spec))
    w = ctx.transpose(rhs, tuple(dn.rhs_spec))
    (t, b), (lf, r) = padding
    if min(t, b, lf, r) < 0:
        return None
    y = ctx.op("conv2d", [x, w], strides=tuple(window_strides),
               padding=canonical_padding((t, lf, b, r), ctx.type(w).shape[2:],
                                         tuple(rhs_dilation)),
               dilations=tuple(rhs_dilation), groups=int(feature_group_count))
    return [ctx.transpose(y, _inverse(dn.out_spec))]
