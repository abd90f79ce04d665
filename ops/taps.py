"""A depthwise convolution computed as the sum of its kernel taps (``conv2d_taps``).

A depthwise convolution (``groups`` = input channels = output channels, OIHW kernel
``[C, 1, KH, KW]``) is, for each kernel position ``(i, j)``, the padded input shifted by
``(i * dh, j * dw)`` and strided, times that tap's per-channel weight, summed over the
``KH * KW`` taps. Written that way it is elementwise work that XLA fuses into one loop.
XLA:CPU runs the convolution form slowly: measured here under ``jax.jit`` on 2 cores,
float32, NCHW, a 3x3 depthwise convolution on 1x64x56x56 took 9.6 ms as a grouped
convolution, 5.1 ms as the dense convolution that ``expand-conv2d`` makes, and 0.17 ms as
taps; 1x480x14x14 took 4.9, 13.0 and 0.22 ms. On a GPU cuDNN's depthwise kernels are
fast, and the cost model chooses per device.

The operator's law says it equals ``conv2d`` with ``groups`` = channels; read left to
right it gives the one rule that introduces it (:mod:`taso_jax.verify.from_laws`), proved
like any other. Its ONNX form is the same sum (Pad, then per tap a strided Slice of the
input, the tap's weights gathered from the kernel, Mul and Add), so a written model keeps
the gain in any runtime that fuses elementwise work. The slices end relative to the
padded input's end, so the written model is right at every binding of open sizes.

Sources: ONNX operator spec (Conv, Pad, Slice, Gather); the depthwise separable
convolution of MobileNets (Howard et al., 2017, Section 3.1).
"""

from __future__ import annotations

import numpy as np
from taso_jax.ops import OpDef, ShapeError, TensorType, axiom, declare, is_float_dtype
from taso_jax.ops._lazy import LazyModule
from taso_jax.ops.conv import _act, _conv2d_product, _conv2d_shape, _emit_act
from taso_jax.ops.tensor import _i64
from taso_jax.ops.windows import explicit_pads

jnp = LazyModule("jax.numpy")
lax = LazyModule("jax.lax")

#: Most kernel taps the operator takes (a 7x7 kernel has 49): past that the sum is longer
#: to compile and to export than the convolution is worth replacing.
MAX_TAPS = 64


def kernel_taps(x, kernel_hw, *, strides, padding, dilations) -> list:
    """The ``KH * KW`` windows of a convolution over ``x``, one per kernel tap.

    ``x`` is NCHW; tap ``(i, j)`` (row-major order) is the padded input shifted by
    ``(i * dh, j * dw)`` and strided, ``[N, C, Ho, Wo]``: the input values that kernel
    position meets at every output position. Shared by ``conv2d_taps`` (which scales and
    sums them) and ``conv2d_im2col`` (which stacks them into a column matrix).
    """
    kh, kw = kernel_hw
    t, lf, b, r = explicit_pads(padding, (kh, kw), dilations)
    xp = jnp.pad(x, ((0, 0), (0, 0), (t, b), (lf, r)))
    n, c, hp, wp = xp.shape
    (sh, sw), (dh, dw) = strides, dilations
    ho, wo = (hp - dh * (kh - 1) - 1) // sh + 1, (wp - dw * (kw - 1) - 1) // sw + 1
    return [lax.slice(xp, (0, 0, i * dh, j * dw),
                      (n, c, i * dh + sh * (ho - 1) + 1, j * dw + sw * (wo - 1) + 1),
                      (1, 1, sh, sw))
            for i in range(kh) for j in range(kw)]


def onnx_kernel_taps(ctx, x: str, kernel_hw, *, strides, padding, dilations) -> list[str]:
    """:func:`kernel_taps` written to ONNX: Pad, then one strided Slice per tap.

    Each slice ends relative to the padded input's end, so the taps are right at every
    binding of the model's open sizes. Returns the taps' names, row-major.
    """
    kh, kw = kernel_hw
    t, lf, b, r = explicit_pads(padding, (kh, kw), dilations)
    if any((t, lf, b, r)):
        x = ctx.tmp("Pad", [x, ctx.const(_i64([0, 0, t, lf, 0, 0, b, r])),
                            ctx.scalar(0, ctx.dtype(x))])
    end = np.iinfo(np.int64).max
    dh, dw = dilations
    axes, steps = ctx.const(_i64([2, 3])), ctx.const(_i64(strides))
    # the tap's window ends (k - 1 - i) * d before the padded input's end, at any size
    return [ctx.tmp("Slice", [x, ctx.const(_i64([i * dh, j * dw])),
                              ctx.const(_i64([-(kh - 1 - i) * dh or end,
                                              -(kw - 1 - j) * dw or end])), axes, steps])
            for i in range(kh) for j in range(kw)]


def _taps(x, w, *, strides, padding, dilations, groups, activation):
    c, _, kh, kw = w.shape
    taps = kernel_taps(x, (kh, kw), strides=strides, padding=padding, dilations=dilations)
    out = None
    for k, tap in enumerate(taps):
        term = tap * w[:, 0, k // kw, k % kw].reshape(1, c, 1, 1)
        out = term if out is None else out + term
    return _act(out, activation)


def _taps_shape(ts, *, strides, padding, dilations, groups, activation):
    x, w = ts
    if len(x.shape) != 4 or len(w.shape) != 4:
        raise ShapeError(f"conv2d_taps: expects NCHW input and OIHW kernel, got {x.shape}, "
                         f"{w.shape}")
    c = x.shape[1]
    if w.shape[:2] != (c, 1) or groups != c:
        raise ShapeError(f"conv2d_taps: a depthwise kernel [{c}, 1, KH, KW] and {c} groups "
                         f"are needed for {c} channels, got {w.shape}, {groups} groups")
    if not is_float_dtype(x.dtype):
        raise ShapeError(f"conv2d_taps: needs a float dtype, got {x.dtype}")
    if int(w.shape[2]) * int(w.shape[3]) > MAX_TAPS:
        raise ShapeError(f"conv2d_taps: {w.shape[2]}x{w.shape[3]} kernel has more than "
                         f"{MAX_TAPS} taps")
    return _conv2d_shape(ts, strides=strides, padding=padding, dilations=dilations,
                         groups=c, activation=activation)


def _taps_flops(ins, outs, **_):
    kh, kw = ins[1].shape[2:]
    return 2.0 * outs[0].size * kh * kw


def _taps_onnx(ctx, ins, outs, *, strides, padding, dilations, groups, activation):
    x, w = ins
    c, _, kh, kw = ctx.shape(w)
    taps = onnx_kernel_taps(ctx, x, (kh, kw), strides=strides, padding=padding,
                            dilations=dilations)
    # [C, 1, KH, KW] -> [KH*KW, 1, C, 1, 1]: tap k's weights are entry k, shaped [1, C, 1, 1]
    per_tap = ctx.tmp("Reshape", [ctx.tmp("Transpose", [w], perm=[2, 3, 1, 0]),
                                  ctx.const(_i64([kh * kw, 1, c, 1, 1]))])
    acc = None
    for k, tap in enumerate(taps):
        weight = ctx.tmp("Gather", [per_tap, ctx.const(np.asarray(k, np.int64))], axis=0)
        term = ctx.tmp("Mul", [tap, weight])
        acc = term if acc is None else ctx.tmp("Add", [acc, term])
    _emit_act(ctx, acc, outs, activation)


# ---- law ----------------------------------------------------------------------------------
# Its definition: a convolution whose groups are its channels, one kernel row each. Read left
# to right it is the rule that introduces the operator (any kernel size, strides, padding,
# dilations and fused activation; the target's shape rule turns down every other conv2d).
# ``groups`` is carried although it must equal the channels: Z3 does not see shapes, and a
# law that dropped it would say that conv2d does not depend on its groups.
_TAPS_LAWS = (
    axiom("conv2d(x, w, strides=st, padding=p, dilations=dl, groups=q, activation=f) = conv2d_taps(x, w, strides=st, padding=p, dilations=dl, groups=q, activation=f)",
          {"x": ("N", "q", "H", "W"), "w": ("q", 1, "K", "L")}, derive="ltr",
          q=(3,), st=((1, 1), (2, 1)), p=("same", (1, 0, 2, 1)), dl=((1, 1), (2, 1)),
          f=("none", "relu")),
)

declare(OpDef(
    name="conv2d_taps", lowering=True, ref=_taps, shape=_taps_shape, arity=2,
    attrs={"strides": (1, 1), "padding": "same", "dilations": (1, 1), "groups": 1,
           "activation": "none"},
    to_onnx=_taps_onnx, flops=_taps_flops, axioms=_TAPS_LAWS, product_dims=_conv2d_product,
    examples=(
        ([TensorType((1, 4, 9, 9), "float32"), TensorType((4, 1, 3, 3), "float32")],
         {"groups": 4}),
        ([TensorType((2, 3, 8, 7), "float32"), TensorType((3, 1, 5, 3), "float32")],
         {"strides": (2, 1), "padding": (1, 0, 2, 1), "dilations": (2, 1), "groups": 3,
          "activation": "relu"}),
    ),
    doc="depthwise 2-D convolution (NCHW x [C, 1, KH, KW] -> NCHW) as the sum of its kernel "
        "taps: strided slices of the padded input times per-channel weights"))
