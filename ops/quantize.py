"""Linear quantization: (de)quantize, dynamic quantize, and the integer matmul.

Operators ``quantize_linear``, ``dequantize_linear``, ``dynamic_quantize_linear`` and
``matmul_integer``.

Sources: ONNX operator spec, QuantizeLinear and DequantizeLinear (opsets 10-20: per-tensor
and per-axis scales, int8/uint8 (and int32 for DequantizeLinear), round half to even,
saturate), DynamicQuantizeLinear (opset 11) and MatMulInteger (opset 10). Blocked
quantization and the float8/int4 types of later opsets are declined by the importers (such a
node stays opaque and runs in onnxruntime).

On the XLA target a ``dequantize_linear`` of an int8 initializer is weight-only: the
executor computes the float weight once, ahead of time, and the ONNX export writes the
operator back on the int8 weight (a float32 copy would be four times as large). A
``quantize_linear`` followed by a ``dequantize_linear`` on an activation (fake quantization)
runs as exactly that float arithmetic. The export writes every one of these operators as
the ONNX node it came from, so onnxruntime still runs its int8 kernels on the written file.
"""

from __future__ import annotations

import numpy as np
from taso_jax.ops import (
    OpDef,
    ShapeError,
    TensorType,
    axiom,
    declare,
    matrix_product_dims,
    onnx_importer,
)
from taso_jax.ops._lazy import LazyModule

jax = LazyModule("jax")
jnp = LazyModule("jax.numpy")

_F32 = "float32"
_QUANTIZED = ("int8", "uint8")
_FLOATS = ("float32", "float16", "float64")


def _param_shape(x_rank: int, axis: int, param_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a scale or zero point broadcasts as against ``x``.

    ``()`` for a per-tensor one (rank 0, or one element), ``[1, .., D, .., 1]`` with ``D`` at
    ``axis`` for a per-axis one.
    """
    if len(param_shape) == 0 or int(np.prod(param_shape)) == 1:
        return ()
    shape = [1] * x_rank
    shape[axis] = param_shape[0]
    return tuple(shape)


def _check_params(who: str, x: TensorType, scale: TensorType, zero: TensorType, axis: int):
    if len(scale.shape) > 1 or scale.shape != zero.shape:
        raise ShapeError(f"{who}: scale {scale.shape} and zero point {zero.shape} must be one "
                         "scalar or one 1-D tensor each, of the same shape")
    if scale.dtype not in _FLOATS:
        raise ShapeError(f"{who}: scale must be a float tensor, got {scale.dtype}")
    if len(scale.shape) == 1 and scale.shape[0] != 1 and (
            not -len(x.shape) <= axis < len(x.shape) or x.shape[axis] != scale.shape[0]):
        raise ShapeError(f"{who}: {scale.shape[0]} scales for axis {axis} of {x.shape}")


def _canon_axis(ts, attrs):
    if ts and len(ts[0].shape):
        axis = attrs.get("axis", 1)
        rank = len(ts[0].shape)
        if -rank <= axis < rank:
            attrs["axis"] = axis - rank if axis >= 0 else axis
    return attrs


def _quantize_linear(x, scale, zero_point, *, axis=1):
    shape = _param_shape(x.ndim, axis, scale.shape)
    info = jnp.iinfo(zero_point.dtype)
    # round half to even (ONNX), before the zero point is added, as onnxruntime does
    scale = jax.lax.optimization_barrier(scale.reshape(shape).astype(x.dtype))  # a division
    q = jnp.round(x / scale) + zero_point.reshape(shape).astype(x.dtype)
    return jnp.clip(q, info.min, info.max).astype(zero_point.dtype)


def _quantize_linear_shape(ts, *, axis=1):
    x, scale, zero = ts
    if x.dtype not in _FLOATS or zero.dtype not in _QUANTIZED:
        raise ShapeError(f"quantize_linear: {x.dtype} to {zero.dtype} is not supported")
    _check_params("quantize_linear", x, scale, zero, axis)
    return [TensorType(x.shape, zero.dtype)]


def _dequantize_linear(x, scale, zero_point, *, axis=1):
    shape = _param_shape(x.ndim, axis, scale.shape)
    d = x.astype(jnp.int32) - zero_point.reshape(shape).astype(jnp.int32)
    return d.astype(scale.dtype) * scale.reshape(shape)


def _dequantize_linear_shape(ts, *, axis=1):
    x, scale, zero = ts
    if x.dtype not in (*_QUANTIZED, "int32") or zero.dtype != x.dtype:
        raise ShapeError(f"dequantize_linear: {x.dtype} with zero point {zero.dtype} is not "
                         "supported")
    _check_params("dequantize_linear", x, scale, zero, axis)
    return [TensorType(x.shape, scale.dtype)]


#: The first opset whose QuantizeLinear and DequantizeLinear onnxruntime (1.32) has no
#: kernel for; there the export writes the same arithmetic with plain operators.
_NO_KERNEL_OPSET = 28


def _quantize_linear_onnx(ctx, ins, outs, *, axis):
    x, scale, zero = ins
    per_axis = len(ctx.shape(scale)) == 1 and ctx.shape(scale)[0] != 1
    if ctx.opset < _NO_KERNEL_OPSET:
        ctx.node("QuantizeLinear", ins, outs, **({"axis": axis} if per_axis else {}))
        return
    shape = _param_shape(len(ctx.shape(x)), axis, ctx.shape(scale))
    if shape:
        scale = ctx.tmp("Reshape", [scale, ctx.const(np.asarray(shape, np.int64))])
        zero = ctx.tmp("Reshape", [zero, ctx.const(np.asarray(shape, np.int64))])
    dt = ctx.dtype(x)
    info = np.iinfo(ctx.dtype(ins[2]))
    q = ctx.tmp("Add", [ctx.tmp("Round", [ctx.tmp("Div", [x, scale])]),  # half to even
                        ctx.tmp("Cast", [zero], to=_onnx_type(dt))])
    q = ctx.tmp("Clip", [q, ctx.scalar(info.min, dt), ctx.scalar(info.max, dt)])
    ctx.node("Cast", [q], outs, to=_onnx_type(ctx.dtype(ins[2])))


def _dequantize_linear_onnx(ctx, ins, outs, *, axis):
    x, scale, zero = ins
    per_axis = len(ctx.shape(scale)) == 1 and ctx.shape(scale)[0] != 1
    if ctx.opset < _NO_KERNEL_OPSET:
        ctx.node("DequantizeLinear", ins, outs, **({"axis": axis} if per_axis else {}))
        return
    shape = _param_shape(len(ctx.shape(x)), axis, ctx.shape(scale))
    if shape:
        scale = ctx.tmp("Reshape", [scale, ctx.const(np.asarray(shape, np.int64))])
        zero = ctx.tmp("Reshape", [zero, ctx.const(np.asarray(shape, np.int64))])
    i32 = _onnx_type("int32")
    d = ctx.tmp("Sub", [ctx.tmp("Cast", [x], to=i32), ctx.tmp("Cast", [zero], to=i32)])
    ctx.node("Mul", [ctx.tmp("Cast", [d], to=_onnx_type(ctx.dtype(ins[1]))), scale], outs)


def _onnx_type(dtype: str) -> int:
    from onnx import helper

    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


# ---- laws ---------------------------------------------------------------------------------
# Per-tensor (de)quantization acts on each element alone, so it passes through concat; the
# numeric check draws float tensors, so the zero point is a float cast to the integer type.
_Q = {"x": ("N", "C"), "y": ("N", "C"), "s": (), "z": ()}
_QUANTIZE_LAWS = (
    axiom("quantize_linear(concat(x, y, axis=k), abs(s), cast(z, to=t)) = concat(quantize_linear(x, abs(s), cast(z, to=t)), quantize_linear(y, abs(s), cast(z, to=t)), axis=k)",
          _Q, k=(-1, -2), t=_QUANTIZED),
)
_DEQUANTIZE_LAWS = (
    axiom("dequantize_linear(concat(cast(x, to=t), cast(y, to=t), axis=k), s, cast(z, to=t)) = concat(dequantize_linear(cast(x, to=t), s, cast(z, to=t)), dequantize_linear(cast(y, to=t), s, cast(z, to=t)), axis=k)",
          _Q, k=(-1, -2), t=_QUANTIZED),
)

_QEX = [TensorType((2, 3, 4), _F32), TensorType((), _F32), TensorType((), "uint8")]
declare(OpDef(
    name="quantize_linear", ref=_quantize_linear, shape=_quantize_linear_shape, arity=3,
    attrs={"axis": 1}, to_onnx=_quantize_linear_onnx, canon=_canon_axis,
    flops=lambda ins, outs, **_: 3.0 * outs[0].size,
    examples=((_QEX, {}),
              ([TensorType((2, 3, 4), _F32), TensorType((3,), _F32), TensorType((3,), "int8")],
               {"axis": 1})),
    axioms=_QUANTIZE_LAWS,
    doc="saturate(round_half_even(x / scale) + zero_point), per tensor or per axis, to the "
        "zero point's int8/uint8 type (ONNX QuantizeLinear)"))

declare(OpDef(
    name="dequantize_linear", ref=_dequantize_linear, shape=_dequantize_linear_shape,
    arity=3, attrs={"axis": 1}, to_onnx=_dequantize_linear_onnx, canon=_canon_axis,
    flops=lambda ins, outs, **_: 2.0 * outs[0].size,
    examples=(([TensorType((2, 3, 4), "uint8"), TensorType((), _F32),
                TensorType((), "uint8")], {}),
              ([TensorType((4, 3), "int8"), TensorType((3,), _F32), TensorType((3,), "int8")],
               {"axis": -1})),
    axioms=_DEQUANTIZE_LAWS,
    doc="(x - zero_point) * scale in the scale's float type, per tensor or per axis (ONNX "
        "DequantizeLinear)"))


def _zero_point(ctx, ins, dtype: str):
    """The zero point input, or a zero of ``dtype`` shaped like the scale where absent."""
    if len(ins) > 2 and ins[2] is not None:
        return ins[2]
    return ctx.weight(np.zeros(ctx.type(ins[1]).shape, dtype), "zero_point")


_LATER = ("adds element types and the attributes block_size, output_dtype and precision, "
          "whose default 0 keeps the per-tensor and per-axis meaning; the importer declines "
          "other values")


@onnx_importer("QuantizeLinear", "DequantizeLinear",
               same_meaning={v: _LATER for v in (21, 23, 24, 25)})
def _import_q_dq(ctx, ins, *, axis=1, saturate=1, block_size=0, output_dtype=0, precision=0):
    if block_size or output_dtype or precision:
        return None  # blocked quantization, or a type other than the zero point's or scale's
    if ctx.source_op == "QuantizeLinear":
        zero = _zero_point(ctx, ins, "uint8")
        return [ctx.op("quantize_linear", [ins[0], ins[1], zero], axis=int(axis))]
    zero = _zero_point(ctx, ins, ctx.type(ins[0]).dtype)
    return [ctx.op("dequantize_linear", [ins[0], ins[1], zero], axis=int(axis))]


# ---- DynamicQuantizeLinear -----------------------------------------------------------------

def _dynamic_quantize_linear(x):
    # the range always holds 0; onnxruntime takes a scale of 1 when it is empty (x all 0).
    # The barriers keep XLA's simplifier from turning the divisions into multiplications by
    # reciprocals, which round differently (by one step, at ties of round half to even)
    lo = jnp.minimum(jnp.min(x), 0)
    hi = jnp.maximum(jnp.max(x), 0)
    steps = jax.lax.optimization_barrier(jnp.asarray(255, x.dtype))
    scale = jnp.where(hi == lo, jnp.asarray(1, x.dtype), (hi - lo) / steps)
    scale = jax.lax.optimization_barrier(scale)
    zero = jnp.round(jnp.clip(-lo / scale, 0, 255))
    y = jnp.clip(jnp.round(x / scale) + zero, 0, 255)
    return y.astype(jnp.uint8), scale, zero.astype(jnp.uint8)


def _dynamic_quantize_linear_shape(ts):
    (x,) = ts
    if x.dtype != _F32:
        raise ShapeError(f"dynamic_quantize_linear: expects float32, got {x.dtype}")
    return [TensorType(x.shape, "uint8"), TensorType((), _F32), TensorType((), "uint8")]


declare(OpDef(
    name="dynamic_quantize_linear", ref=_dynamic_quantize_linear,
    shape=_dynamic_quantize_linear_shape, arity=1,
    to_onnx=lambda ctx, ins, outs: ctx.node("DynamicQuantizeLinear", ins, outs),
    flops=lambda ins, outs: 5.0 * ins[0].size,
    examples=(([TensorType((3, 5), _F32)], {}),),
    num_outputs=lambda attrs: 3,
    doc="uint8 quantization of x over its range (min(x, 0), max(x, 0)): (y, scale, "
        "zero_point) (ONNX DynamicQuantizeLinear)"))
onnx_importer("DynamicQuantizeLinear")(
    lambda ctx, ins, **_: ctx.op("dynamic_quantize_linear", ins))


# ---- MatMulInteger -------------------------------------------------------------------------

def _matmul_integer(a, b, a_zero_point, b_zero_point):
    a = a.astype(jnp.int32) - a_zero_point.astype(jnp.int32)
    b = b.astype(jnp.int32) - b_zero_point.astype(jnp.int32)  # one per column of b
    return jnp.matmul(a, b, preferred_element_type=jnp.int32)


def _matmul_integer_shape(ts):
    a, b, za, zb = ts
    if a.dtype not in _QUANTIZED or b.dtype not in _QUANTIZED or za.dtype != a.dtype \
            or zb.dtype != b.dtype:
        raise ShapeError(f"matmul_integer: {a.dtype} x {b.dtype} with zero points {za.dtype}, "
                         f"{zb.dtype}")
    if len(a.shape) < 2 or len(b.shape) < 2 or a.shape[-1] != b.shape[-2]:
        raise ShapeError(f"matmul_integer: {a.shape} x {b.shape}")
    m, n = a.shape[-2], b.shape[-1]
    # one zero point per row of a is in the spec, but onnxruntime refuses it (1.32)
    if len(za.shape) > 1 or za.size != 1 or len(zb.shape) > 1 or zb.size not in (1, n):
        raise ShapeError(f"matmul_integer: zero points {za.shape}, {zb.shape} for {m}x{n}")
    try:
        batch = tuple(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    except ValueError as e:
        raise ShapeError(f"matmul_integer: batch axes {a.shape}, {b.shape} differ") from e
    return [TensorType((*batch, m, n), "int32")]


declare(OpDef(
    name="matmul_integer", ref=_matmul_integer, shape=_matmul_integer_shape, arity=4,
    to_onnx=lambda ctx, ins, outs: ctx.node("MatMulInteger", ins, outs),
    flops=lambda ins, outs: 2.0 * outs[0].size * ins[0].shape[-1],
    product_dims=lambda ins, outs: matrix_product_dims(outs[0], outs[0].shape[-1],
                                                       ins[0].shape[-1]),
    examples=(([TensorType((2, 3, 4), "uint8"), TensorType((4, 5), "int8"),
                TensorType((), "uint8"), TensorType((5,), "int8")], {}),
              ([TensorType((3, 4), "int8"), TensorType((4, 2), "uint8"),
                TensorType((1,), "int8"), TensorType((), "uint8")], {})),
    doc="(a - a_zero_point) @ (b - b_zero_point) in int32; a's zero point per tensor, b's "
        "per tensor or per column (ONNX MatMulInteger)"))


@onnx_importer("MatMulInteger")
def _import_matmul_integer(ctx, ins, **_):
    a, b = ins[0], ins[1]
    za = ins[2] if len(ins) > 2 and ins[2] is not None else \
        ctx.weight(np.zeros((), ctx.type(a).dtype), "zero_point")
    zb = ins[3] if len(ins) > 3 and ins[3] is not None else \
        ctx.weight(np.zeros((), ctx.type(b).dtype), "zero_point")
    return [ctx.op("matmul_integer", [a, b, za, zb])]
