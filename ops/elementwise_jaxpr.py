"""JAX primitives of the elementwise operators: how a jaxpr's equations import.

The operators themselves are declared in :mod:`taso_jax.ops.elementwise`; this module maps
``jax.lax`` primitives onto them (the ``jaxpr`` side of each record), including the idioms a
traced function writes with them: a causal mask built by ``select_n`` over an iota
comparison, ``max(x, 0)`` as relu, a division by a constant as a multiplication.
"""

from __future__ import annotations

from functools import partial

import numpy as np
from taso_jax.ops import is_float_dtype, jaxpr_importer
from taso_jax.ops._lazy import LazyModule, deferred
from taso_jax.ops.elementwise import _max_min_with_scalar, _scalar_const, exact_widening

jax = LazyModule("jax")
jnp = LazyModule("jax.numpy")
_jnp = partial(deferred, "jax.numpy")


# ---- jaxpr primitives ---------------------------------------------------------------------
# lax binary operators broadcast size-1 dimensions and rank-0 literals like NumPy, so they map
# one to one; rank-0 literals arrive as scalar weights.

for _prim, _op in (("pow", "pow"), ("tanh", "tanh"),
                   ("logistic", "sigmoid"), ("erf", "erf"), ("sqrt", "sqrt"), ("exp", "exp"),
                   ("neg", "neg"), ("eq", "equal"), ("lt", "less"), ("sin", "sin"),
                   ("cos", "cos"), ("log", "log"), ("erfc", "erfc"), ("abs", "abs"),
                   ("sign", "sign"), ("rem", "rem")):
    jaxpr_importer(_prim)(lambda ctx, ins, _op=_op, **_: [ctx.op(_op, ins)])


def _inexact(dtype) -> bool:
    """A float (bfloat16 included) or complex element type."""
    return is_float_dtype(dtype) or np.issubdtype(np.dtype(dtype), np.complexfloating)


def _constant_scalar(ctx, t) -> float | None:
    """The value of a rank-0 float constant (a literal of the traced function), else None."""
    if ctx.type(t).shape != () or not is_float_dtype(ctx.type(t).dtype):
        return None
    v = ctx.const(t)
    return None if v is None else float(np.asarray(v))


@jaxpr_importer("mul")
def _import_mul(ctx, ins, **_):
    from taso_jax.ops.norm import norm_idiom

    norm = norm_idiom(ctx, *ins)
    if norm is not None:
        return [norm]
    # x * 0.125 with a literal is TASO's scalar_mul: its scale is an attribute, which the
    # laws of matmul, attention and the adapters carry through (an ewmul by a tensor would
    # not be sound to move across a matmul for every shape of that tensor).
    for x, c in (ins, ins[::-1]):
        v = _constant_scalar(ctx, c)
        if v is not None and ctx.type(x).shape == ctx.out_types[0].shape \
                and not ctx.weight_only(x):
            return [ctx.op("scalar_mul", [x], scalar=v)]
    return [ctx.op("ewmul", ins)]


@jaxpr_importer("sub", "div")
def _import_sub_div(ctx, ins, **_):
    # x - c and x / c with a weight-only c become x + (-c) and x * (1 / c): the
    # substitutions state scale and shift folding with ewadd and ewmul (the negation and
    # reciprocal are computed once with the weights). x * (1 / c) is real division only:
    # lax.div on integers truncates toward zero, and 1 / c is 0 there.
    a, b = ins
    if ctx.source_op == "div":
        from taso_jax.ops.nn import softmax_idiom

        softmax = softmax_idiom(ctx, a, b)
        if softmax is not None:
            return [softmax]
        from taso_jax.ops.norm import norm_idiom

        norm = norm_idiom(ctx, a, b, divide=True)
        if norm is not None:
            return [norm]
    real = ctx.source_op == "sub" or _inexact(ctx.type(b).dtype)
    v = _constant_scalar(ctx, b) if ctx.source_op == "div" else None
    if v is not None and v != 0 and not ctx.weight_only(a) and a.shape == ctx.out_types[0].shape:
        return [ctx.op("scalar_mul", [a], scalar=1.0 / v)]
    if real and ctx.weight_only(b) and not ctx.weight_only(a):
        inv = ctx.op("neg" if ctx.source_op == "sub" else "ewdiv",
                     [b] if ctx.source_op == "sub" else [ctx.scalar(1, ctx.type(b).dtype), b])
        return [ctx.op("ewadd" if ctx.source_op == "sub" else "ewmul", [a, inv])]
    return [ctx.op("ewsub" if ctx.source_op == "sub" else "ewdiv", ins)]


@jaxpr_importer("max", "min")
def _import_max_min(ctx, ins, **_):
    # max(x, 0) is relu; max(x, c) and min(x, c) with a constant c are clips; any other
    # pair (same element type: lax.max does not promote) is ewmax/ewmin
    take_max = ctx.source_op == "max"
    clip = _max_min_with_scalar(ctx, ins, take_max)
    if clip is not None:
        return [clip]
    return [ctx.op("ewmax" if take_max else "ewmin", ins)]


@jaxpr_importer("gt")
def _import_gt(ctx, ins, **_):
    return [ctx.op("less", [ins[1], ins[0]])]


@jaxpr_importer("ge", "le")
def _import_ge_le(ctx, ins, **_):
    # a >= b is not (a < b) for integers and booleans; for floats NaN makes both false
    if _inexact(ctx.type(ins[0]).dtype):
        return None
    a, b = ins if ctx.source_op == "ge" else ins[::-1]
    return [ctx.op("logical_not", [ctx.op("less", [a, b])])]


@jaxpr_importer("ne")
def _import_ne(ctx, ins, **_):
    # not (a == b) is a != b for NaNs too: NaN == NaN is false
    return [ctx.op("logical_not", [ctx.op("equal", ins)])]


@jaxpr_importer("and", "not")
def _import_logical(ctx, ins, **_):
    if any(ctx.type(t).dtype != "bool" for t in ins):
        return None  # bitwise on integers
    return [ctx.op("logical_and" if len(ins) == 2 else "logical_not", ins)]


@jaxpr_importer("or")
def _import_or(ctx, ins, **_):
    # a or b = not (not a and not b): a constant mask built with | (prefix-LM) then folds
    if any(ctx.type(t).dtype != "bool" for t in ins):
        return None  # bitwise on integers
    nots = [ctx.op("logical_not", [t]) for t in ins]
    return [ctx.op("logical_not", [ctx.op("logical_and", nots)])]


@jaxpr_importer("rsqrt")
def _import_rsqrt(ctx, ins, **_):
    one = ctx.scalar(1.0, ctx.type(ins[0]).dtype)
    return [ctx.op("ewdiv", [one, ctx.op("sqrt", ins)])]


@jaxpr_importer("integer_pow", "square")
def _import_integer_pow(ctx, ins, *, y=2, **_):
    (x,) = ins
    if y == 1:
        return [x]
    if y in (2, 3):
        acc = ctx.op("ewmul", [x, x])
        return [acc if y == 2 else ctx.op("ewmul", [acc, x])]
    return [ctx.op("pow", [x, ctx.scalar(float(y), ctx.type(x).dtype)])]


@jaxpr_importer("select_n")
def _import_select_n(ctx, ins, **_):
    if len(ins) != 3 or ctx.type(ins[0]).dtype != "bool":
        return None  # integer case selectors
    masked = _causal_select(ctx, ins[0], ins[2], ins[1])
    if masked is not None:
        return [masked]
    return [ctx.op("where", [ins[0], ins[2], ins[1]])]  # select_n(p, f, t) = p ? t : f


def _unbroadcast(t):
    """``t`` before the reshapes and expands that kept its last two axes.

    A mask broadcast to ``[B, H, S, S]`` is read back at its own size.
    """
    while t.node.op in ("expand", "reshape") and len(t.node.inputs[0].shape) >= 2 \
            and t.node.inputs[0].shape[-2:] == t.shape[-2:]:
        t = t.node.inputs[0]
    return t


def _causal_select(ctx, pred, on_true, on_false):
    """``causal_mask(x, offset, fill)`` for a causal ``where``, else ``None``.

    The ``where`` is ``where(pred, x, fill)`` (or ``where(pred, fill, x)``) with a constant
    ``pred`` that keeps ``j <= i + offset`` over the last two axes (drops, when swapped) and
    a constant uniform ``fill``.
    """
    from taso_jax.ops.attention import causal_offset

    out = ctx.out_types[0]
    if len(out.shape) < 2 or not is_float_dtype(out.dtype):
        return None
    keep = ctx.const(_unbroadcast(pred))
    if keep is None or np.shape(keep)[-2:] != out.shape[-2:]:
        return None
    for x, fill, negate in ((on_true, on_false, False), (on_false, on_true, True)):
        if ctx.type(x).shape != out.shape or ctx.weight_only(x):
            continue
        value = _scalar_const(ctx, fill)
        if value is None:
            continue
        offset = causal_offset(~np.asarray(keep) if negate else np.asarray(keep))
        if offset is not None:
            return ctx.op("causal_mask", [x], offset=offset, fill=value)
    return None


@jaxpr_importer("add")
def _import_add(ctx, ins, **_):
    masked = _causal_additive(ctx, *ins)
    return [masked if masked is not None else ctx.op("ewadd", ins)]


def _causal_additive(ctx, a, b):
    """``causal_mask(x, offset, fill=-inf)`` for ``x + m`` with a constant causal mask ``m``.

    ``m`` is 0 where key ``j <= i + offset`` and ``-inf`` elsewhere over the last two axes,
    the same over the leading ones (``jnp.where(jnp.tril(...), 0, -jnp.inf)``, added to the
    scores). Adding ``-inf`` gives ``-inf`` for every score but ``+inf``, so this is the
    causal ``where``; a finite fill (``-1e9``, ``finfo.min``) is not: ``x + fill`` differs
    from ``fill`` with ``x``, which a fully masked row would show. Before a softmax a finite
    fill masks too (``attention.causal_scores``).
    """
    from taso_jax.ops.attention import causal_offset

    out = ctx.out_types[0]
    if len(out.shape) < 2 or not is_float_dtype(out.dtype):
        return None
    for x, m in ((a, b), (b, a)):
        if ctx.type(x).shape != out.shape or ctx.weight_only(x):
            continue
        mask = ctx.const(_unbroadcast(m))
        if mask is None or np.shape(mask)[-2:] != out.shape[-2:]:
            continue
        mask = np.asarray(mask)
        keep = mask == 0
        if not np.all(keep | (mask == -np.inf)):
            continue
        offset = causal_offset(keep)
        if offset is not None:
            return ctx.op("causal_mask", [x], offset=offset, fill=float("-inf"))
    return None


@jaxpr_importer("convert_element_type")
def _import_convert(ctx, ins, *, new_dtype, **_):
    to = str(np.dtype(new_dtype))
    if ctx.type(ins[0]).dtype == to:
        return [ins[0]]
    return [ctx.op("widen" if exact_widening(ctx.type(ins[0]).dtype, to) else "cast", ins,
                   to=to)]


@jaxpr_importer("copy", "copy_p", "optimization_barrier")
def _import_identity_prim(ctx, ins, **_):
    return list(ins)
