"""A pointwise (1x1) convolution computed as a matrix product (``pointwise_matmul``).

A 1x1 convolution with stride 1 and one group, NCHW x OIHW ``[O, C, 1, 1]``, is the
product of the ``[O, C]`` weight matrix with each image's ``[C, H*W]`` view. XLA:CPU runs
the matrix product 1.6 to 5.6 times faster than the convolution (jax.jit, 2 cores,
float32: 24 to 144 channels at 56x56 took 1.35 ms as a convolution and 0.56 ms as a
product; 3 to 16 channels at 224x224, 2.66 and 0.47 ms): its convolution on NCHW operands
goes through a layout change that the product, on the same memory, does not need. On a
GPU both are one library call, and the cost model chooses per device.

The operator's law says it equals ``conv2d`` with a 1x1 kernel, stride 1, one group, any
dilation and fused activation; read left to right it gives the one rule that introduces
it (:mod:`taso_jax.verify.from_laws`). Its ONNX form is Reshape (``[N, C, H*W]``, written
``[0, 0, -1]`` so that it holds at every binding of open sizes), MatMul by the
weight's ``[O, C]`` view, and Reshape back to ``[N, O, H, W]``, the sizes computed from
the input's shape where they are open.

Sources: ONNX operator spec (Conv, MatMul, Reshape); the 1x1 convolution as a GEMM is the
classic lowering (Chellapilla et al., 2006; cuDNN's IMPLICIT_GEMM).
"""

from __future__ import annotations

import numpy as np
from taso_jax.ops import OpDef, ShapeError, TensorType, axiom, declare
from taso_jax.ops._lazy import LazyModule
from taso_jax.ops.conv import _act, _conv2d_product, _emit_act, check_activation

jnp = LazyModule("jax.numpy")


def _pointwise(x, w, *, activation):
    n, c, h, wd = x.shape
    o = w.shape[0]
    y = jnp.matmul(w.reshape(o, c), x.reshape(n, c, h * wd)).reshape(n, o, h, wd)
    return _act(y, activation)


def _pointwise_shape(ts, *, activation):
    x, w = ts
    if len(x.shape) != 4 or len(w.shape) != 4:
        raise ShapeError(f"pointwise_matmul: expects NCHW input and OIHW kernel, got "
                         f"{x.shape}, {w.shape}")
    if tuple(w.shape[1:]) != (x.shape[1], 1, 1):
        raise ShapeError(f"pointwise_matmul: a [O, {x.shape[1]}, 1, 1] kernel is needed, got "
                         f"{w.shape}")
    if x.dtype != w.dtype:
        raise ShapeError(f"pointwise_matmul: dtype mismatch {x.dtype} vs {w.dtype}")
    check_activation(activation)
    n, _, h, wd = x.shape
    return [TensorType((n, w.shape[0], h, wd), x.dtype)]


def _pointwise_flops(ins, outs, **_):
    return 2.0 * outs[0].size * ins[1].shape[1]


def _pointwise_onnx(ctx, ins, outs, *, activation):
    x, w = ins
    o, c = ctx.shape(w)[:2]
    n, _, h, wd = ctx.shape(x)
    flat = ctx.tmp("Reshape", [x, ctx.const(np.array([0, 0, -1], np.int64))])
    weights = ctx.tmp("Reshape", [w, ctx.const(np.array([o, c], np.int64))])
    y = outs[0] if activation == "none" else ctx.fresh()
    ctx.node("Reshape", [ctx.tmp("MatMul", [weights, flat]), ctx.ints([n, o, h, wd])], [y])
    if activation != "none":
        _emit_act(ctx, y, outs, activation)


# ---- law ----------------------------------------------------------------------------------
# Its definition: a 1x1, stride-1, one-group, undilated convolution. Read left to right, the
# rule that introduces the operator. Every attribute but the activation is written out:
# Z3 does not see shapes, and a law over any dilation would say that conv2d does not
# depend on its dilation (true of a 1x1 kernel only).
_POINTWISE_LAWS = (
    axiom("conv2d(x, w, strides=(1, 1), padding='same', dilations=(1, 1), groups=1, activation=f) = pointwise_matmul(x, w, activation=f)",
          {"x": ("N", "C", "H", "W"), "w": ("O", "C", 1, 1)}, derive="ltr",
          f=("none", "relu")),
)

declare(OpDef(
    name="pointwise_matmul", lowering=True, ref=_pointwise, shape=_pointwise_shape, arity=2,
    attrs={"activation": "none"},
    to_onnx=_pointwise_onnx, flops=_pointwise_flops, axioms=_POINTWISE_LAWS,
    product_dims=_conv2d_product,
    examples=(
        ([TensorType((1, 4, 5, 6), "float32"), TensorType((3, 4, 1, 1), "float32")], {}),
        ([TensorType((2, 3, 4, 4), "float32"), TensorType((5, 3, 1, 1), "float32")],
         {"activation": "relu"}),
    ),
    doc="pointwise (1x1, stride 1, one group) 2-D convolution, NCHW x [O, C, 1, 1] -> "
        "NCHW, as the product of the [O, C] weights with each image's [C, H*W] view"))
