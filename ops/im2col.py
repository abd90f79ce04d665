"""A dense convolution computed as one matrix product over its kernel taps (``conv2d_im2col``).

A one-group convolution, NCHW x OIHW ``[O, C, KH, KW]``, is the product of the kernel's
``[O, KH*KW*C]`` view with the column matrix ``[KH*KW*C, Ho*Wo]`` of each image: the
``KH * KW`` strided slices of the padded input (one per kernel tap,
:func:`taso_jax.ops.taps.kernel_taps`) stacked along the channels (Chellapilla et al.,
2006, "im2col").
The column matrix is ``KH * KW`` times the input, so it pays only where the convolution
itself runs badly. Measured under ``jax.jit`` on 2 cores, float32: XLA:CPU runs a
convolution with few input channels slowly, and the product is faster there (a 3x3
convolution of 1x3x224x160 into 32 channels took 4.3 ms as a convolution and 2.3 ms as
columns and a product; 1x3x50x155, 1.12 and 0.67 ms; 1x1x901x161 into 128 channels, 86
and 71 ms); with 32 to 128 input channels at 28x28 and more it is 1.3-7x slower. The
measured cost model times both at each convolution's shape and chooses; the analytic one
prices it as a lowering (:data:`taso_jax.search.cost.LOWERING_PENALTY`).

The operator's law says it equals ``conv2d`` with one group, any kernel, strides, padding,
dilation and fused activation; read left to right it gives the one rule that introduces it
(:mod:`taso_jax.verify.from_laws`). Its shape rule turns down grouped kernels, 1x1 kernels
(``pointwise_matmul``'s), kernels of more than :data:`~taso_jax.ops.taps.MAX_TAPS` taps
and column matrices over :data:`MAX_COLUMN_BYTES`. One slice a tap makes XLA's compile
grow with the taps: fifteen of basic_pitch's convolutions (kernels up to 1x256) as columns
took 59 s to compile on 2 cores, against 6 s as convolutions (2026-11-29), more than a
candidate may cost the end-to-end choice. Its ONNX form
is Pad, one Slice per tap (ends relative to the padded input's end, so it holds at every
binding of open sizes), Concat on the channels, Reshape ``[0, 0, -1]``, MatMul by the
kernel's view and Reshape to the output's sizes (the batch size kept, the output's height
and width read off a tap's shape where they are open).

Sources: ONNX operator spec (Conv, Pad, Slice, Concat, MatMul, Reshape); Chellapilla,
Puri and Simard, "High performance convolutional neural networks for document processing"
(2006), the unrolled convolution as a matrix product.
"""

from __future__ import annotations

import numpy as np
from taso_jax.ops import OpDef, ShapeError, TensorType, axiom, declare, is_float_dtype
from taso_jax.ops._lazy import LazyModule
from taso_jax.ops.conv import _act, _conv2d_product, _conv2d_shape, _emit_act
from taso_jax.ops.dims import is_open
from taso_jax.ops.taps import MAX_TAPS, kernel_taps, onnx_kernel_taps
from taso_jax.ops.tensor import _i64

jnp = LazyModule("jax.numpy")

#: Largest column matrix (``KH*KW*C x Ho*Wo`` per image in the input's dtype, at the bound
#: sizes, in bytes) the operator builds: past it the copy costs more memory than the convolution
#: it replaces is worth (a 3x3 kernel on 128 channels at 320x320 would need 470 MB).
MAX_COLUMN_BYTES = 16 << 20


def _im2col(x, w, *, strides, padding, dilations, activation):
    o, c, kh, kw = w.shape
    taps = kernel_taps(x, (kh, kw), strides=strides, padding=padding, dilations=dilations)
    n, _, ho, wo = taps[0].shape
    columns = jnp.concatenate(taps, axis=1).reshape(n, kh * kw * c, ho * wo)
    # the kernel's [O, KH, KW, C] order matches the taps' order along the columns
    kernel = w.transpose(0, 2, 3, 1).reshape(o, kh * kw * c)
    return _act(jnp.matmul(kernel, columns).reshape(n, o, ho, wo), activation)


def _im2col_shape(ts, *, strides, padding, dilations, activation):
    x, w = ts
    if len(x.shape) != 4 or len(w.shape) != 4:
        raise ShapeError(f"conv2d_im2col: expects NCHW input and OIHW kernel, got {x.shape}, "
                         f"{w.shape}")
    if w.shape[1] != x.shape[1]:
        raise ShapeError(f"conv2d_im2col: a one-group kernel [O, {x.shape[1]}, KH, KW] is "
                         f"needed, got {w.shape}")
    if not is_float_dtype(x.dtype):
        raise ShapeError(f"conv2d_im2col: needs a float dtype, got {x.dtype}")
    n, c, _, _ = x.shape
    kh, kw = int(w.shape[2]), int(w.shape[3])
    if kh * kw == 1:
        raise ShapeError("conv2d_im2col: a 1x1 kernel's columns are the input itself "
                         "(pointwise_matmul)")
    if kh * kw > MAX_TAPS:
        raise ShapeError(f"conv2d_im2col: {kh}x{kw} kernel has more than {MAX_TAPS} taps")
    (y,) = _conv2d_shape(ts, strides=strides, padding=padding, dilations=dilations,
                         groups=1, activation=activation)
    column_bytes = (kh * kw * int(c) * int(y.shape[2]) * int(y.shape[3])
                    * np.dtype(x.dtype).itemsize)
    if column_bytes > MAX_COLUMN_BYTES:
        raise ShapeError(f"conv2d_im2col: its column matrix would take {column_bytes} bytes "
                         f"per image, more than {MAX_COLUMN_BYTES}")
    return [y]


def _im2col_flops(ins, outs, **_):
    _, c, kh, kw = ins[1].shape
    return 2.0 * outs[0].size * c * kh * kw


def _im2col_onnx(ctx, ins, outs, *, strides, padding, dilations, activation):
    x, w = ins
    o, c, kh, kw = ctx.shape(w)
    taps = onnx_kernel_taps(ctx, x, (kh, kw), strides=strides, padding=padding,
                            dilations=dilations)
    columns = ctx.tmp("Reshape", [ctx.tmp("Concat", taps, axis=1), ctx.const(_i64([0, 0, -1]))])
    kernel = ctx.tmp("Reshape", [ctx.tmp("Transpose", [w], perm=[0, 2, 3, 1]),
                                 ctx.const(_i64([o, kh * kw * c]))])
    _, _, ho, wo = ctx.shape(outs[0])
    if is_open(ho) or is_open(wo):  # read off a tap's shape at run time: [N, C, Ho, Wo]
        spatial = ctx.tmp("Slice", [ctx.tmp("Shape", [taps[0]]), ctx.const(_i64([2])),
                                    ctx.const(_i64([4])), ctx.const(_i64([0]))])
        sizes = ctx.tmp("Concat", [ctx.const(_i64([0, o])), spatial], axis=0)
    else:  # 0: the batch size of the product, whatever it is
        sizes = ctx.const(_i64([0, o, int(ho), int(wo)]))
    y = outs[0] if activation == "none" else ctx.fresh()
    ctx.node("Reshape", [ctx.tmp("MatMul", [kernel, columns]), sizes], [y])
    if activation != "none":
        _emit_act(ctx, y, outs, activation)


# ---- law ----------------------------------------------------------------------------------
# Its definition: a one-group convolution. Read left to right, the rule that introduces the
# operator (any kernel, strides, padding, dilations and fused activation; the target's shape
# rule turns down the rest). ``groups=1`` is written out and every other attribute carried:
# Z3 does not see shapes, and a law that dropped one would say conv2d does not depend on it.
_IM2COL_LAWS = (
    axiom("conv2d(x, w, strides=st, padding=p, dilations=dl, groups=1, activation=f) = conv2d_im2col(x, w, strides=st, padding=p, dilations=dl, activation=f)",
          {"x": ("N", "C", "H", "W"), "w": ("O", "C", "K", "L")}, derive="ltr",
          st=((1, 1), (2, 1)), p=("same", (1, 0, 2, 1)), dl=((1, 1), (2, 1)),
          f=("none", "relu")),
)

declare(OpDef(
    name="conv2d_im2col", lowering=True, ref=_im2col, shape=_im2col_shape, arity=2,
    attrs={"strides": (1, 1), "padding": "same", "dilations": (1, 1), "activation": "none"},
    to_onnx=_im2col_onnx, flops=_im2col_flops, axioms=_IM2COL_LAWS,
    product_dims=_conv2d_product,
    examples=(
        ([TensorType((1, 3, 9, 9), "float32"), TensorType((4, 3, 3, 3), "float32")], {}),
        ([TensorType((2, 2, 8, 7), "float32"), TensorType((3, 2, 5, 3), "float32")],
         {"strides": (2, 1), "padding": (1, 0, 2, 1), "dilations": (2, 1),
          "activation": "relu"}),
    ),
    doc="one-group 2-D convolution (NCHW x OIHW -> NCHW) as the product of the kernel's "
        "[O, KH*KW*C] view with the column matrix of the input's kernel taps"))
