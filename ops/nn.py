"""Normalization and reduction operators: softmax, layer and batch normalization, reductions.

Sources: ONNX operator spec (Softmax opset 13, LayerNormalization opset 17,
BatchNormalization, ReduceMean, ReduceSum, ReduceMax); the jaxpr primitives ``reduce_sum`` and ``reduce_max``.
"""

from __future__ import annotations

from functools import partial

import numpy as np
from taso_jax.ops import OpDef, ShapeError, TensorType, declare, jaxpr_importer, onnx_importer
from taso_jax.ops._lazy import LazyModule, deferred
from taso_jax.ops.tensor import _canon_axis, _i64, _neg_axis

jax = LazyModule("jax")
jnp = LazyModule("jax.numpy")
_jnp = partial(deferred, "jax.numpy")

_F32 = "float32"


def _flops_per_elem(k):
    return lambda ins, outs, **_: float(k * ins[0].size)


def _softmax_shape(ts, *, axis):
    _neg_axis(axis, len(ts[0].shape), "softmax")
    return [ts[0]]


declare(OpDef(
    name="softmax", ref=lambda x, *, axis: jax.nn.softmax(x, axis=axis),
    shape=_softmax_shape, arity=1,
    
    attrs={"axis": -1},
    to_onnx=lambda ctx, ins, outs, *, axis: ctx.node("Softmax", ins, outs, axis=axis),
    flops=_flops_per_elem(5), canon=_canon_axis, layout="axis",
    examples=(([TensorType((2, 3, 5), _F32)], {"axis": -1}),
              ([TensorType((2, 3, 5), _F32)], {"axis": 1})),
    doc="exp(x) / sum(exp(x)) along axis (ONNX Softmax, opset 13 semantics)"))


@onnx_importer("Softmax")
def _import_softmax(ctx, ins, axis=-1):
    return [ctx.op("softmax", ins, axis=axis)]


def _through(t, ops: tuple[str, ...]):
    """``t`` before the named operators (one input each) and ``stop_gradient``.

    Transposes that only move unit axes are passed too.
    """
    while t.node.op in ops or (t.node.op == "opaque" and getattr(
            dict(t.node.attrs).get("call"), "primitive", None) == "stop_gradient") or (
            t.node.op == "transpose" and _unit_moves(t.node)):
        t = t.node.inputs[0]
    return t


#: Element types whose reductions JAX accumulates in float32 (``jnp.sum``, ``jnp.mean``).
NARROW_FLOATS = ("bfloat16", "float16")


def accumulated_wide(t):
    """``(inner, dtype)`` if ``t`` is a float32 result cast back to a 16-bit float.

    ``jnp.sum`` and ``jnp.mean`` of a bfloat16 or float16 array trace as
    ``cast(reduce_sum(cast(x, float32)), dtype)``; ``inner`` is the float32 tensor under
    the outer cast. Else ``(t, None)``.
    """
    if t.node.op == "cast" and t.dtype in NARROW_FLOATS \
            and t.node.inputs[0].dtype == "float32":
        return t.node.inputs[0], t.dtype
    return t, None


def widened_from(t, dtype: str):
    """``x`` if ``t`` is ``x`` of ``dtype`` widened to float32, else ``None``."""
    if t.node.op in ("widen", "cast") and t.dtype == "float32" \
            and t.node.inputs[0].dtype == dtype:
        return t.node.inputs[0]
    return None


def _unit_moves(n) -> bool:
    """``n``, a transpose, keeps its axes longer than 1 in order."""
    moved = [a for a in dict(n.attrs)["perm"] if n.inputs[0].shape[a] != 1]
    return moved == sorted(moved)


def _reduced_axis(t, op: str):
    """``(input, axis)`` if ``t`` is ``op`` over one axis (negative), else ``None``."""
    if t.node.op != op:
        return None
    (axes,) = (v for k, v in t.node.attrs if k == "axes")
    x = t.node.inputs[0]
    return (x, axes[0] % len(x.shape) - len(x.shape)) if len(axes) == 1 else None


def _unit_source(t):
    """The tensor that ``t`` is a reshape of, through unit-axis reshapes and transposes.

    Those only insert, remove or move axes of size 1, which keeps every element in its
    row-major place.
    """
    def squeezed(shape):
        return tuple(d for d in shape if d != 1)

    while True:
        n = t.node
        if n.op == "reshape" and squeezed(n.inputs[0].shape) == squeezed(t.shape):
            t = n.inputs[0]
        elif n.op == "transpose" and _unit_moves(n):
            t = n.inputs[0]
        else:
            return t


def _moved_alike(x, source, shift) -> bool:
    """Whether ``x`` and the maximum ``shift`` are ``source`` in one order of leading axes.

    ``x`` is ``source`` with its leading axes transposed, and ``shift``, the maximum over
    the last axis of ``source``, went through the same transpose of those axes. The grouped
    form of ``jax.nn.dot_product_attention`` takes the maximum of the scores ``[B, K, T, G,
    S]`` and subtracts it, transposed, from the scores transposed to ``[G, B, K, T, S]``: the
    same row maximum, met at the same row.
    """
    n = x.node
    if n.op != "transpose" or n.inputs[0] != source:
        return False
    perm, rank = tuple(dict(n.attrs)["perm"]), len(x.shape)
    if perm[-1] != rank - 1:
        return False
    moved, t = tuple(range(rank - 1)), shift
    while True:  # back to the maximum through the kept axis, clips and transposes
        op = t.node.op
        if op == "transpose" and len(t.shape) == rank - 1:
            moved = tuple(dict(t.node.attrs)["perm"][i] for i in moved)
        elif op == "reshape" and t.shape[:rank - 1] == t.node.inputs[0].shape \
                and t.shape[rank - 1:] == (1,):
            pass
        elif op == "clip" or (op == "opaque" and getattr(
                dict(t.node.attrs).get("call"), "primitive", None) == "stop_gradient"):
            pass
        else:
            break
        t = t.node.inputs[0]
    return t.node.op == "reduce_max" and t.node.inputs[0] == source and moved == perm[:-1]


def softmax_idiom(ctx, num, den):
    """``softmax(x, axis)`` if ``num / den`` is the softmax written out, else ``None``.

    The written-out form, as ``jax.nn.softmax`` traces: ``e / sum(e, axis)`` with
    ``e = exp(x - stop_gradient(max(x, axis)))``, the reductions' axis restored by a
    reshape; in bfloat16 and float16 the sum accumulated in float32 and cast back, as
    ``jnp.sum`` traces it, and as the operator computes it. The maximum may be taken over
    another view of ``x`` that differs from it only in unit axes
    (``jax.nn.dot_product_attention`` moves a unit group axis in between) when both reduce
    the last axis, or in the order of the leading axes when the maximum is moved back the
    same way (the same function with grouped K/V heads). It is the definition of softmax
    (ONNX Softmax-13), so nothing is lost; under ``jax.grad`` the operator's derivative is the same, since softmax is invariant to the
    shift.
    """
    if num.node.op != "exp" or num.node.inputs[0].node.op != "ewsub":
        return None
    x, shift = num.node.inputs[0].node.inputs
    inner, narrow = accumulated_wide(_through(den, ("reshape",)))
    total = _reduced_axis(_through(inner, ("reshape",)), "reduce_sum")
    if total is not None and narrow is not None:  # summed in float32, as jnp.sum does
        total = (widened_from(total[0], narrow), total[1])
    peak = _reduced_axis(_through(shift, ("reshape", "clip", "transpose")), "reduce_max")
    if total is None or peak is None or total != (num, peak[1]):
        return None
    moved = _through(shift, ("reshape", "clip")).node.op == "transpose"
    if moved:  # the maximum of x with its leading axes in another order, moved back
        if not (peak[1] == -1 and _moved_alike(x, peak[0], shift)):
            return None
    elif peak[0] != x and not (peak[1] == -1 and x.shape[-1] == peak[0].shape[-1]
                               and _unit_source(peak[0]) == _unit_source(x)):
        return None
    axis = peak[1]
    kept = tuple(1 if i == len(x.shape) + axis else d for i, d in enumerate(x.shape))
    if den.shape != kept or shift.shape != kept or x.shape != ctx.out_types[0].shape:
        return None
    clip = _through(shift, ("reshape",))
    if clip.node.op == "clip" and (dict(clip.node.attrs)["max"] is not None
                                   or dict(clip.node.attrs)["min"] != float("-inf")):
        return None  # a clip that could change the maximum
    if axis % len(x.shape) == len(x.shape) - 1:
        from taso_jax.ops.attention import causal_scores
        from taso_jax.ops.attention_masks import block_scores

        x = causal_scores(ctx, x)  # a constant additive causal mask read as the mask
        x = block_scores(ctx, x)  # any other constant mask read by blocks
    return ctx.op("softmax", [x], axis=axis)


def _layernorm(x, scale, bias, *, axis, epsilon):
    axes = tuple(range(axis % x.ndim, x.ndim))
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + jnp.asarray(epsilon, x.dtype)) * scale + bias


def _layernorm_shape(ts, *, axis, epsilon):
    x, s, b = ts
    ax = _neg_axis(axis, len(x.shape), "layernorm")
    norm = x.shape[ax:] if ax else ()
    for p in (s, b):
        if np.broadcast_shapes(p.shape, norm) != norm:
            raise ShapeError(f"layernorm: parameter {p.shape} does not fit {norm}")
    return [x]


declare(OpDef(
    name="layernorm", ref=_layernorm, shape=_layernorm_shape, arity=3,
    attrs={"axis": -1, "epsilon": 1e-5},
    to_onnx=lambda ctx, ins, outs, *, axis, epsilon: ctx.node(
        "LayerNormalization", ins, outs, axis=axis, epsilon=epsilon),
    flops=_flops_per_elem(8), canon=_canon_axis,
    examples=(([TensorType((2, 3, 8), _F32), TensorType((8,), _F32), TensorType((8,), _F32)],
               {}),),
    doc="normalize over axes [axis, rank) then scale and shift (ONNX LayerNormalization)"))


@onnx_importer("LayerNormalization")
def _import_layernorm(ctx, ins, *, axis=-1, epsilon=1e-5, stash_type=1):
    if len(ctx.out_types) > 1:
        return None
    x, scale = ins[0], ins[1]
    bias = ins[2] if len(ins) > 2 and ins[2] is not None else None
    xt, st = ctx.type(x), ctx.type(scale)
    if axis % len(xt.shape) == len(xt.shape) - 1 and st.shape == xt.shape[-1:] \
            and (bias is None or ctx.type(bias).shape == st.shape) and st.dtype == xt.dtype:
        # over the last axis: the norm, its gain (foldable into a matmul) and its bias
        y = ctx.op("scale_last", [ctx.op("layer_norm", [x], epsilon=float(epsilon)), scale])
        return [y if bias is None else ctx.op("ewadd", [y, bias])]
    if bias is None:
        bias = ctx.weight(np.zeros(ctx.type(scale).shape, ctx.type(scale).dtype), "ln_bias")
    return [ctx.op("layernorm", [x, scale, bias], axis=axis, epsilon=float(epsilon))]


def _reduce_shape(ts, *, axes, keepdims):
    (x,) = ts
    r = len(x.shape)
    if any(not -r <= a < r for a in axes):
        raise ShapeError(f"reduce: axes {axes} out of range for rank {r}")
    ax = {a % r for a in axes}
    shape = tuple(1 if i in ax else d for i, d in enumerate(x.shape) if keepdims or i not in ax)
    return [TensorType(shape, x.dtype)]


def _reduction(name, fn, onnx_type, axes_input_opset, primitive, doc):
    """Declare a reduction over static ``axes`` and register its importers.

    ONNX Reduce* takes axes as an input from ``axes_input_opset`` on.
    """

    def to_onnx(ctx, ins, outs, *, axes, keepdims):
        if ctx.opset >= axes_input_opset:
            ctx.node(onnx_type, [ins[0], ctx.const(_i64(axes))], outs, keepdims=int(keepdims))
        else:
            ctx.node(onnx_type, ins, outs, axes=list(axes), keepdims=int(keepdims))

    declare(OpDef(
        name=name, ref=lambda x, *, axes, keepdims: fn(x, axis=axes, keepdims=keepdims),
        shape=_reduce_shape, arity=1, attrs={"axes": (), "keepdims": True}, to_onnx=to_onnx,
        flops=_flops_per_elem(1), layout="reduce",
        examples=(([TensorType((2, 3, 4, 4), _F32)], {"axes": (2, 3)}),
                  ([TensorType((2, 3, 4), _F32)], {"axes": (-1,), "keepdims": False})),
        doc=doc))

    @onnx_importer(onnx_type)
    def _import(ctx, ins, *, axes=None, keepdims=1, noop_with_empty_axes=0):
        if len(ins) > 1 and ins[1] is not None:
            v = ctx.const(ins[1])
            if v is None:
                return None
            axes = np.asarray(v).tolist()
        if not axes:
            if noop_with_empty_axes:
                return [ins[0]]
            axes = list(range(len(ctx.type(ins[0]).shape)))
        return [ctx.op(name, [ins[0]], axes=tuple(int(a) for a in axes),
                       keepdims=bool(keepdims))]

    if primitive:
        jaxpr_importer(primitive)(lambda ctx, ins, *, axes, **_: [ctx.op(
            name, [ins[0]], axes=tuple(int(a) for a in axes), keepdims=False)])


_reduction("reduce_mean", _jnp("mean"), "ReduceMean", 18, None,
           "mean over the given axes (ONNX ReduceMean, GlobalAveragePool)")
_reduction("reduce_sum", _jnp("sum"), "ReduceSum", 13, "reduce_sum",
           "sum over the given axes (ONNX ReduceSum; jaxpr reduce_sum)")
_reduction("reduce_max", _jnp("max"), "ReduceMax", 18, "reduce_max",
           "maximum over the given axes (ONNX ReduceMax; jaxpr reduce_max)")


# ---- batch normalization (inference) ------------------------------------------------------

def _batchnorm(x, scale, bias, mean, var, *, epsilon):
    shp = (1, -1) + (1,) * (x.ndim - 2)
    inv = scale / jnp.sqrt(var + jnp.asarray(epsilon, x.dtype))
    return (x - mean.reshape(shp)) * inv.reshape(shp) + bias.reshape(shp)


def _batchnorm_shape(ts, *, epsilon):
    x = ts[0]
    if len(x.shape) < 2 or any(t.shape != (x.shape[1],) for t in ts[1:]):
        raise ShapeError(f"batchnorm: parameters must be [C] for input {x.shape}")
    return [x]


declare(OpDef(
    name="batchnorm", ref=_batchnorm, shape=_batchnorm_shape, arity=5, attrs={"epsilon": 1e-5},
    to_onnx=lambda ctx, ins, outs, *, epsilon: ctx.node(
        "BatchNormalization", ins, outs, epsilon=epsilon),
    examples=(([TensorType((2, 3, 4, 4), _F32)] + [TensorType((3,), _F32)] * 4, {}),),
    doc="inference batch normalization over channel axis 1 (ONNX BatchNormalization)"))


@onnx_importer("BatchNormalization")
def _import_batchnorm(ctx, ins, *, epsilon=1e-5, training_mode=0, **_):
    if training_mode or len(ctx.out_types) > 1:
        return None
    x, scale, bias, mean, var = ins
    params = [ctx.const(t) for t in (scale, bias, mean, var)]
    if any(p is None for p in params):
        return [ctx.op("batchnorm", ins, epsilon=float(epsilon))]
    # Constant parameters: inference BN is a per-channel affine map x * s + t; its
    # coefficients are weights, so conv2d -> ewmul -> ewadd can be folded by substitutions.
    scale, bias, mean, var = (np.asarray(p, np.float64) for p in params)
    s = scale / np.sqrt(var + epsilon)
    t = bias - mean * s
    dt = ctx.type(x).dtype
    shp = (1, -1) + (1,) * (len(ctx.type(x).shape) - 2)
    y = ctx.op("ewmul", [x, ctx.weight(s.astype(dt).reshape(shp), "bn_scale")])
    return [ctx.op("ewadd", [y, ctx.weight(t.astype(dt).reshape(shp), "bn_shift")])]
