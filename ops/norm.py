"""Normalizations over the last axis: ``rms_norm``, ``layer_norm``, and the gain that follows.

``rms_norm(x)`` is ``x / sqrt(mean(x * x) + epsilon)`` and ``layer_norm(x)`` is
``(x - mean(x)) / sqrt(mean((x - mean(x))**2) + epsilon)``, both over the last axis and
without a gain or a bias. A norm's gain is a separate operator, ``scale_last(y, g)``
(``y * g`` with ``g: [D]`` along the last axis), and a bias a following ``ewadd``: the
gain is then a tensor that a law can move into the next matmul's weight,

    ``matmul(scale_last(x, g), w) = matmul(x, scale_rows(w, g))``

(``scale_rows(w, g)`` scales row ``k`` of ``w`` by ``g[k]``). Stated with an ``ewmul`` by a
tensor the law would hold only for some shapes of that tensor, and the prover's encoding
does not see shapes; between these two operators, whose shape rules fix ``g`` to ``[D]``, it
holds wherever both sides are well typed. The rule read off it computes
``scale_rows(w, g)`` once, with the weights.

The norms' laws are their compositions (``reduce_mean``, ``ewmul``, ``scalar_add``,
``sqrt``, ``ewdiv``), so the rules that introduce them are read off the laws and proved.
Code reaches them through recognition at import (:func:`norm_idiom`), from the forms people
write: ``x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps)``, a layer norm with
``jnp.mean``/``jnp.var``, ``flax.linen.LayerNorm`` (mean of squares less the squared mean,
clipped at 0) and ``RMSNorm`` (the gain multiplied into the reciprocal root), and ONNX's
decomposed form (``ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt, Div``). The recognized
operator computes the variance as the mean of squared deviations; flax's fast variance
rounds differently by a few ulps of the output (within the output check's tolerance).

Sources: Zhang and Sennrich, "Root Mean Square Layer Normalization" (2019), Eq. 4; Ba et
al., "Layer Normalization" (2016), Eq. 4; ONNX LayerNormalization (opset 17) and
RMSNormalization (opset 23); Mirage (Wu et al., OSDI 2025) for folding the gain into the
following matmul.
"""

from __future__ import annotations

import numpy as np
from taso_jax.ops import OpDef, ShapeError, TensorType, axiom, declare, is_float_dtype
from taso_jax.ops._lazy import LazyModule
from taso_jax.ops.nn import accumulated_wide, widened_from
from taso_jax.ops.tensor import _i64

jax = LazyModule("jax")
jnp = LazyModule("jax.numpy")

__all__ = ["norm_idiom"]

_F32 = "float32"


def _float_input(name: str, x: TensorType, rank: int = 1) -> None:
    if len(x.shape) < rank or not is_float_dtype(x.dtype):
        raise ShapeError(f"{name}: needs a float tensor of rank >= {rank}, got {x}")


# ---- scalar_add: the epsilon of a norm, as an attribute the laws carry ---------------------

def _scalar_add(x, *, scalar):
    return x + jnp.asarray(scalar, x.dtype)


def _same_float(ts, **_):
    _float_input("scalar_add", ts[0], 0)
    return [ts[0]]


declare(OpDef(
    name="scalar_add", ref=_scalar_add, shape=_same_float, arity=1, attrs={"scalar": 0.0},
    fusible=True, layout="elementwise",
    to_onnx=lambda ctx, ins, outs, *, scalar: ctx.node(
        "Add", [ins[0], ctx.scalar(scalar, ctx.dtype(ins[0]))], outs),
    examples=(([TensorType((2, 3), _F32)], {"scalar": 1e-5}),),
    doc="x + c for a constant scalar attribute c (ONNX Add with a scalar; a norm's epsilon)"))


# ---- the norms -----------------------------------------------------------------------------

def _rms_norm(x, *, epsilon):
    ms = jnp.mean(x * x, axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(ms + jnp.asarray(epsilon, x.dtype))


def _layer_norm(x, *, epsilon):
    c = x - jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(c * c, axis=-1, keepdims=True)
    return c * jax.lax.rsqrt(var + jnp.asarray(epsilon, x.dtype))


def _norm_shape(name):
    def shape(ts, *, epsilon):
        _float_input(name, ts[0])
        if not float(epsilon) >= 0:
            raise ShapeError(f"{name}: epsilon must be >= 0, got {epsilon}")
        return [ts[0]]
    return shape


def _mean_onnx(ctx, x):
    """ONNX ReduceMean over the last axis, keepdims (axes an input from opset 18)."""
    if ctx.opset >= 18:
        return ctx.tmp("ReduceMean", [x, ctx.const(_i64((-1,)))], keepdims=1)
    return ctx.tmp("ReduceMean", [x], axes=[-1], keepdims=1)


def _root_onnx(ctx, c, outs, epsilon):
    """``c / sqrt(mean(c * c) + epsilon)`` as ONNX nodes."""
    ms = _mean_onnx(ctx, ctx.tmp("Mul", [c, c]))
    root = ctx.tmp("Sqrt", [ctx.tmp("Add", [ms, ctx.scalar(epsilon, ctx.dtype(c))])])
    ctx.node("Div", [c, root], outs)


def _rms_norm_onnx(ctx, ins, outs, *, epsilon):
    # RMSNormalization is opset 23, newer than the exports' opsets: written out
    _root_onnx(ctx, ins[0], outs, epsilon)


def _layer_norm_onnx(ctx, ins, outs, *, epsilon):
    (x,) = ins
    if ctx.opset < 17:
        _root_onnx(ctx, ctx.tmp("Sub", [x, _mean_onnx(ctx, x)]), outs, epsilon)
        return
    d, dt = ctx.shape(x)[-1], ctx.dtype(x)
    ctx.node("LayerNormalization", [x, ctx.const(np.ones(d, dt)), ctx.const(np.zeros(d, dt))],
             outs, axis=-1, epsilon=float(epsilon))


def _norm_flops(k):
    return lambda ins, outs, **_: float(k * ins[0].size)


_X = {"x": ("...", "M", "D")}
_E = (1e-5, 1e-6)
_NORM_LAWS = {
    "rms_norm": (
        axiom("rms_norm(x, epsilon=e) = ewdiv(x, sqrt(scalar_add(reduce_mean(ewmul(x, x), axes=(-1,), keepdims=True), scalar=e)))",
              _X, derive="rtl", e=_E),
    ),
    "layer_norm": (
        axiom("layer_norm(x, epsilon=e) = ewdiv(ewsub(x, reduce_mean(x, axes=(-1,), keepdims=True)), sqrt(scalar_add(reduce_mean(ewmul(ewsub(x, reduce_mean(x, axes=(-1,), keepdims=True)), ewsub(x, reduce_mean(x, axes=(-1,), keepdims=True))), axes=(-1,), keepdims=True), scalar=e)))",
              _X, derive="rtl", e=_E),
        # ONNX LayerNormalization over the last axis: the norm, its gain and its bias
        axiom("layernorm(x, s, b, axis=-1, epsilon=e) = ewadd(scale_last(layer_norm(x, epsilon=e), s), b)",
              {"x": ("M", "D"), "s": ("D",), "b": ("D",)}, e=_E),
    ),
}

for _name, _ref, _flops, _doc in (
        ("rms_norm", _rms_norm, 4,
         "x / sqrt(mean(x * x) + epsilon) over the last axis, no gain (RMSNorm, Zhang and "
         "Sennrich 2019, Eq. 4; ONNX RMSNormalization-23 with unit scale)"),
        ("layer_norm", _layer_norm, 7,
         "(x - mean(x)) / sqrt(var(x) + epsilon) over the last axis, no gain or bias (Ba et "
         "al. 2016; ONNX LayerNormalization-17 with unit scale and zero bias)")):
    declare(OpDef(
        name=_name, ref=_ref, shape=_norm_shape(_name), arity=1,
        attrs={"epsilon": 1e-5 if _name == "layer_norm" else 1e-6},
        to_onnx=_rms_norm_onnx if _name == "rms_norm" else _layer_norm_onnx,
        flops=_norm_flops(_flops), axioms=_NORM_LAWS[_name],
        examples=(([TensorType((2, 3, 8), _F32)], {}),
                  ([TensorType((5, 16), _F32)], {"epsilon": 1e-3})),
        doc=_doc))


# ---- the gain: scale_last and scale_rows ---------------------------------------------------

def _scale_last_shape(ts, **_):
    x, g = ts
    _float_input("scale_last", x)
    if g.shape != (x.shape[-1],) or g.dtype != x.dtype:
        raise ShapeError(f"scale_last: gain {g} does not fit the last axis of {x}")
    return [x]


def _scale_rows_shape(ts, **_):
    w, g = ts
    _float_input("scale_rows", w, 2)
    if g.shape != (w.shape[-2],) or g.dtype != w.dtype:
        raise ShapeError(f"scale_rows: scale {g} does not fit the rows of {w}")
    return [w]


def _scale_rows_onnx(ctx, ins, outs):
    w, g = ins
    col = ctx.tmp("Reshape", [g, ctx.const(_i64((-1, 1)))])
    ctx.node("Mul", [w, col], outs)


# The fold of a norm's gain into the matmul that reads it, read right to left as a rule.
_FOLD = {"x": ("...", "M", "K"), "w": ("K", "N"), "g": ("K",)}
_SCALE_LAWS = (
    axiom("matmul(x, scale_rows(w, g)) = matmul(scale_last(x, g), w)", _FOLD, derive="rtl"),
)

declare(OpDef(
    name="scale_last", ref=lambda x, g: x * g, shape=_scale_last_shape, arity=2,
    fusible=True, to_onnx=lambda ctx, ins, outs: ctx.node("Mul", ins, outs),
    examples=(([TensorType((2, 3, 8), _F32), TensorType((8,), _F32)], {}),),
    doc="x * g with g: [D] along the last axis (a norm's gain; ONNX Mul)"))
declare(OpDef(
    name="scale_rows", ref=lambda w, g: w * g[:, None], shape=_scale_rows_shape, arity=2,
    fusible=True, to_onnx=_scale_rows_onnx, axioms=_SCALE_LAWS,
    examples=(([TensorType((8, 5), _F32), TensorType((8,), _F32)], {}),
              ([TensorType((3, 8, 5), _F32), TensorType((8,), _F32)], {})),
    doc="w * g[:, None]: row k of w (axis -2) scaled by g[k] (ONNX Mul by a column)"))


# ---- recognition at import -----------------------------------------------------------------
# Each helper takes an IR tensor and returns what it is made of, or None.

def _through(t, ops=("reshape",)):
    while t.node.op in ops:
        t = t.node.inputs[0]
    return t


def _value(ctx, t) -> float | None:
    """The one value of a constant whose entries are all equal, else ``None``."""
    if not ctx.weight_only(t):
        return None
    v = ctx.const(t)
    if v is None:
        return None
    v = np.asarray(v).reshape(-1)
    return float(v[0]) if v.size and is_float_dtype(v.dtype) \
        and np.all(v == v[0]) else None


def _attr(t, name):
    return dict(t.node.attrs)[name]


def _mean_last(t):
    """``x`` if ``t`` is the mean of ``x`` over its last axis (reduced or kept), else None.

    The sum may be scaled by ``1 / D`` before or after the reshape that restores the axis;
    in bfloat16 and float16, as ``jnp.mean`` traces it and the norms compute it, the sum
    and the scaling in float32 between two casts.
    """
    t, narrow = accumulated_wide(_through(t))
    t = _through(t)
    scaled = t.node.op == "scalar_mul"
    if scaled:
        factor = _attr(t, "scalar")
        t = _through(t.node.inputs[0])
    if t.node.op not in ("reduce_sum", "reduce_mean") or (t.node.op == "reduce_sum") != scaled:
        return None
    x = t.node.inputs[0]
    r = len(x.shape)
    if tuple(a % r for a in _attr(t, "axes")) != (r - 1,):
        return None
    if scaled and not np.isclose(factor * x.shape[-1], 1.0, rtol=1e-6, atol=0):
        return None
    return x if narrow is None else widened_from(x, narrow)


def _square(t):
    t = _through(t)
    if t.node.op == "ewmul" and t.node.inputs[0] == t.node.inputs[1]:
        return t.node.inputs[0]
    return None


def _square_onnx_pow(ctx, t):
    t = _through(t)
    if t.node.op == "pow" and _value(ctx, t.node.inputs[1]) == 2.0:
        return t.node.inputs[0]
    return _square(t)


def _same(ctx, t, x) -> bool:
    """``t`` is ``x``, or ``x`` less a constant zero (flax RMSNorm subtracts a zero mean)."""
    while t != x and t.node.op in ("ewadd", "ewsub") and not ctx.weight_only(t):
        a, b = t.node.inputs
        b = b.node.inputs[0] if b.node.op == "neg" else b
        if _value(ctx, b) != 0.0:
            return False
        t = a
    return t == x


def _centered(ctx, t):
    """``x`` if ``t`` is ``x - mean(x)`` over the last axis, else None."""
    if t.node.op == "ewsub":
        x, m = t.node.inputs
    elif t.node.op == "ewadd" and t.node.inputs[1].node.op == "neg":
        x, m = t.node.inputs[0], t.node.inputs[1].node.inputs[0]
    else:
        return None
    return x if _mean_last(m) == x and not ctx.weight_only(x) else None


def _variance_of(ctx, v, x) -> bool:
    """Whether ``v`` is the variance of ``x`` over its last axis.

    That is the mean of squared deviations, or
    the mean of squares less the squared mean (clipped at 0 or not).
    """
    v = _through(v, ("reshape", "relu"))
    if v.node.op == "where" and ctx.weight_only(v.node.inputs[0]):
        keep = ctx.const(v.node.inputs[0])  # jnp.var's guard against ddof >= D
        if keep is not None and np.all(keep):
            v = v.node.inputs[1]
    c = _mean_last(v)
    if c is not None:
        c = _square_onnx_pow(ctx, c)
        return c is not None and _centered(ctx, c) == x
    if v.node.op != "ewsub":
        return False
    ms, sm = v.node.inputs
    sq = _mean_last(ms)
    m = _square(sm)
    return sq is not None and _square(sq) == x and m is not None and _mean_last(m) == x


def _root(ctx, s):
    """``(v, epsilon)`` if ``s`` is ``sqrt(v + epsilon)`` (epsilon a constant), else None."""
    s = _through(s)
    if s.node.op != "sqrt":
        return None
    t = _through(s.node.inputs[0])
    if t.node.op == "scalar_add":
        return t.node.inputs[0], float(_attr(t, "scalar"))
    if t.node.op == "ewadd":
        for v, c in (t.node.inputs, t.node.inputs[::-1]):
            e = _value(ctx, c)
            if e is not None and e >= 0 and not ctx.weight_only(v):
                return v, e
    return t, 0.0


def _reciprocal_root(ctx, r):
    """``(v, epsilon, gain)`` if ``r`` is ``1 / sqrt(v + epsilon)``, else None.

    ``r`` may be multiplied by a ``gain`` along the last axis (else ``gain`` is ``None``).
    """
    gain = None
    if r.node.op == "ewmul":
        for a, b in (r.node.inputs, r.node.inputs[::-1]):
            if a.node.op == "ewdiv" and b.node.op != "ewdiv" and b.shape[-1:] == (r.shape[-1],):
                r, gain = a, b
                break
    if r.node.op != "ewdiv" or _value(ctx, r.node.inputs[0]) != 1.0:
        return None
    root = _root(ctx, r.node.inputs[1])
    return None if root is None else (*root, gain)


def _normalized(ctx, n, v, epsilon):
    """The norm of ``x`` if ``n / sqrt(v + epsilon)`` normalizes ``x``, else None."""
    x = _centered(ctx, n)
    if x is not None and _variance_of(ctx, v, x):
        return ctx.op("layer_norm", [x], epsilon=epsilon)
    x = _square_onnx_pow(ctx, _mean_last(v)) if _mean_last(v) is not None else None
    if x is not None and _same(ctx, n, x) and not ctx.weight_only(x):
        return ctx.op("rms_norm", [x], epsilon=epsilon)
    return None


def _gain(ctx, y, g, fallback: bool = True):
    """``y * g`` as ``scale_last`` or ``ewmul``.

    ``scale_last`` where ``g`` varies along the last axis only, else ``ewmul`` (``None`` without ``fallback``).
    """
    gs, ys = ctx.type(g).shape, y.shape
    d = ys[-1]
    if len(gs) <= len(ys) and gs and gs[-1] == d and all(s == 1 for s in gs[:-1]) \
            and ctx.type(g).dtype == ctx.type(y).dtype:
        src = _through(g)  # the gain as declared, before the reshape that broadcast it
        return ctx.op("scale_last", [y, ctx.reshape(src if src.shape == (d,) else g, (d,))])
    return ctx.op("ewmul", [y, g]) if fallback else None


def norm_idiom(ctx, a, b, divide: bool = False):
    """The norm that ``a * b`` (or ``a / b``) computes, written out, else ``None``.

    Recognized, over the last axis: ``n * (1 / sqrt(v + eps))``, ``n * (1 / sqrt(v + eps) * g)``
    and ``n / sqrt(v + eps)``, where ``n`` is ``x`` and ``v`` the mean of ``x * x``
    (``rms_norm``), or ``n`` is ``x - mean(x)`` and ``v`` its variance (``layer_norm``); and
    a norm times a gain along its last axis (``scale_last``). ``ctx`` is the importer's
    ``ImportContext``; the result has ``a * b``'s shape (``ctx.out_types[0]``).
    """
    out = ctx.out_types[0]
    if divide:
        root = _root(ctx, b)
        norm = None if root is None else _normalized(ctx, a, *root)
        return norm if norm is not None and norm.shape == out.shape else None
    for n, r in ((a, b), (b, a)):
        if n.node.op in ("rms_norm", "layer_norm") and n.shape == out.shape:
            gained = _gain(ctx, n, r, fallback=False)
            if gained is not None:
                return gained
            continue
        found = _reciprocal_root(ctx, r)
        if found is None:
            continue
        v, eps, gain = found
        norm = _normalized(ctx, n, v, eps)
        if norm is not None and norm.shape == out.shape:
            return norm if gain is None else _gain(ctx, norm, gain)
    return None
