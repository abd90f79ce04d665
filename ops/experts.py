"""A mixture-of-experts layer combined by a gate matrix, and its guarded gathered lowering.

``gated_experts(g, x, w1, w2, activation, impl, capacity_factor)`` is the dense formulation
of a mixture-of-experts MLP as JAX users write it (Mixtral, Jiang et al. 2024; Shazeer et
al., "Outrageously large neural networks", ICLR 2017)::

    y[t, e] = act(x[t] @ w1[e]) @ w2[e]          # every expert on every token
    out[t]  = sum_e g[t, e] * y[t, e]            # einsum("te,ted->td", g, y)

with tokens ``x [T, d]``, expert weights ``w1 [E, d, h]`` and ``w2 [E, h, d]`` and gates
``g [T, E]``, zero where a token does not use an expert (top-k routing and a softmax over
the k, spread into ``[T, E]`` by ``one_hot`` or a scatter). The router is not part of the
operator: any gate matrix is allowed, and the operator's meaning is the formula above.

It has two lowerings (``impl``):

* ``dense``: the formula itself, ``E`` times the arithmetic of one expert on every token;
* ``capacity``: per expert, the tokens whose gate is nonzero are gathered, in token order,
  into ``C = min(T, ceil(capacity_factor * T / E))`` slots (GShard, Lepikhin et al. 2021,
  and the Switch Transformer's capacity factor, Fedus et al., JMLR 2022); the expert runs
  on ``[C, d]`` and its outputs, times their gates, are added into their tokens' rows. A
  guard (``lax.cond``) runs this only where no expert has more than ``C`` such tokens, and
  the dense form otherwise: no token is ever dropped, unlike a capacity-limited layer in
  training. The guard costs one count over ``g``; where it fails, the call costs that
  count and the dense form.

Why the two agree: the dense form adds ``g[t, e] * y[t, e]`` for every expert, and a zero
gate contributes ``0 * y[t, e] = 0`` exactly while ``y[t, e]`` is finite; the gathered form
adds the same nonzero terms and skips the zero ones. So the lowering law below holds in real
arithmetic, and in floating point it holds up to the order of the sums (the two dot
products may be blocked differently by XLA) wherever the experts' outputs are finite; an
expert output of ``inf`` or NaN on a token that does not use it makes the dense form NaN
there and the gathered form not. That is the precondition, as PET (Wang et al., OSDI 2021)
states partial equivalences: the guard checks what it can check cheaply (the counts), and
the finiteness is assumed as the scores' span is in ``attention_masks``. The end-to-end
output check compares within the element type's tolerance.

The import (:func:`experts_idiom`) recognizes the dense formulation where the function's
own ``einsum``s import to the same graph as :func:`dense_experts`'s (the check is the
identity of hash-consed nodes, not a numeric test): ``einsum("td,edh->teh", x, w1)``, the
activation (``jax.nn.relu`` or ``jax.nn.silu``), ``einsum("teh,ehd->ted", h, w2)`` and
``einsum("te,ted->td", g, y)``, with 2-D tokens (``x.reshape(-1, d)``).
"""

from __future__ import annotations

import functools
import math
import threading

import numpy as np
from taso_jax.ops import (
    JAXPR_IMPORTERS,
    OpDef,
    ShapeError,
    TensorType,
    axiom,
    declare,
    is_float_dtype,
)
from taso_jax.ops._lazy import LazyModule

jax = LazyModule("jax")
jnp = LazyModule("jax.numpy")

__all__ = ["ACTIVATIONS", "capacity", "dense_experts", "experts_idiom", "gathered_experts"]

#: The activations between an expert's two matmuls, by the name the attribute holds.
ACTIVATIONS = ("relu", "silu")
_F32 = "float32"


def _act(h, activation: str):
    return jax.nn.relu(h) if activation == "relu" else jax.nn.silu(h)


def capacity(tokens: int, experts: int, capacity_factor: float) -> int:
    """Slots per expert: ``min(T, ceil(capacity_factor * T / E))`` (Switch Transformer)."""
    return min(int(tokens), math.ceil(float(capacity_factor) * int(tokens) / int(experts)))


def dense_experts(g, x, w1, w2, activation: str = "relu"):
    """Every expert on every token, combined by the gates: the executable specification.

    Args:
        g: gates ``[T, E]``, zero where a token does not use an expert.
        x: tokens ``[T, d]``.
        w1: first expert weights ``[E, d, h]``.
        w2: second expert weights ``[E, h, d]``.
        activation: ``"relu"`` or ``"silu"``.

    Returns:
        ``[T, d]``, ``einsum("te,ted->td", g, act(x @ w1[e]) @ w2[e])``.
    """
    h = _act(jnp.einsum("td,edh->teh", x, w1), activation)
    return jnp.einsum("te,ted->td", g, jnp.einsum("teh,ehd->ted", h, w2))


def gathered_experts(g, x, w1, w2, activation: str, slots: int):
    """Each expert on the tokens whose gate is nonzero, gathered into ``slots`` rows.

    Exact only where no expert has more than ``slots`` such tokens (the others would be
    dropped); :func:`_gated_experts` guards it. Padding slots read a row of zeros with gate
    0 and add into a row that is cut off.

    Returns:
        ``[T, d]``, the sum over experts of ``g[t, e] * y[t, e]`` where ``g[t, e] != 0``.
    """
    t, e = g.shape
    keep = g != 0
    slot = jnp.where(keep, jnp.cumsum(keep, axis=0, dtype=jnp.int32) - 1, slots)
    token = jnp.full((e, slots), t, jnp.int32).at[
        jnp.arange(e, dtype=jnp.int32)[None, :], slot].set(
        jnp.arange(t, dtype=jnp.int32)[:, None], mode="drop")          # [E, C], t: padding
    xs = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[token]           # [E, C, d]
    gs = jnp.take_along_axis(jnp.concatenate([g, jnp.zeros((1, e), g.dtype)]), token.T,
                             axis=0).T                                               # [E, C]
    y = jnp.matmul(_act(jnp.matmul(xs, w1), activation), w2)                        # [E, C, d]
    out = jnp.zeros((t + 1, x.shape[1]), x.dtype).at[token].add(gs[..., None] * y)
    return out[:t]


def _gated_experts(g, x, w1, w2, *, activation, impl, capacity_factor):
    if impl != "capacity":
        return dense_experts(g, x, w1, w2, activation)
    slots = capacity(g.shape[0], g.shape[1], capacity_factor)
    fits = jnp.max(jnp.sum(g != 0, axis=0)) <= slots  # the guard: no expert over capacity
    return jax.lax.cond(fits, lambda *a: gathered_experts(*a, activation, slots),
                        lambda *a: dense_experts(*a, activation), g, x, w1, w2)


def _shape(ts, *, activation, impl, capacity_factor):
    g, x, w1, w2 = ts
    if len({t.dtype for t in ts}) != 1 or not is_float_dtype(x.dtype):
        raise ShapeError(f"gated_experts: needs one float dtype, got {[t.dtype for t in ts]}")
    if len(g.shape) != 2 or len(x.shape) != 2 or len(w1.shape) != 3 or len(w2.shape) != 3:
        raise ShapeError("gated_experts: needs g [T, E], x [T, d], w1 [E, d, h], w2 [E, h, d]")
    (t, e), (_, d), (_, _, h) = g.shape, x.shape, w1.shape
    if x.shape[0] != t or w1.shape != (e, d, h) or w2.shape != (e, h, d):
        raise ShapeError(f"gated_experts: g {g.shape}, x {x.shape}, w1 {w1.shape}, "
                         f"w2 {w2.shape} do not fit [T, E], [T, d], [E, d, h], [E, h, d]")
    if activation not in ACTIVATIONS or impl not in ("dense", "capacity") \
            or not float(capacity_factor) > 0:
        raise ShapeError(f"gated_experts: unknown activation {activation!r}, lowering "
                         f"{impl!r} or capacity factor {capacity_factor}")
    return [TensorType((t, d), x.dtype)]


def _flops(ins, outs, *, activation, impl, capacity_factor):
    """Two matmuls, the activation and the gating per (token, expert) pair computed."""
    g, x, w1, _ = ins
    (t, e), (d, h) = g.shape, w1.shape[1:]
    rows = e * (capacity(t, e, capacity_factor) if impl == "capacity" else t)
    return float(rows * (4 * d * h + h + 2 * d))


def _composition(node):
    """The dense lowering runs as its definition: the matmuls XLA compiles for the einsums."""
    if node.attr("impl") != "dense":
        return None
    g, x, w1, w2 = node.inputs
    (t, e), (d, h) = g.shape, w1.shape[1:]
    return [("transpose", [w1], {"perm": (1, 0, 2)}),                     # 0: [d, E, h]
            ("reshape", [0], {"shape": (d, e * h)}),
            ("matmul", [x, 1], {}),                                      # 2: [T, E*h]
            ("reshape", [2], {"shape": (t, e, h)}),
            (node.attr("activation"), [3], {}),
            ("transpose", [4], {"perm": (1, 0, 2)}),                     # 5: [E, T, h]
            ("matmul", [5, w2], {}),                                     # 6: [E, T, d]
            ("transpose", [6], {"perm": (1, 0, 2)}),                     # 7: [T, E, d]
            ("reshape", [g], {"shape": (t, 1, e)}),
            ("matmul", [8, 7], {}),                                      # 9: [T, 1, d]
            ("reshape", [9], {"shape": (t, d)})]


def _priced_as(node):
    """The gathered lowering as the calibrated cost model estimates it (``OpDef.priced_as``).

    The experts' matmuls on ``[E, C, d]`` (its arithmetic), the gather as a copy of ``C``
    token rows per expert and the scatter-add as a sum over ``[E, C, d]``. The guard's count
    and the rare dense fallback are not priced: the end-to-end timing on the call's own
    arguments decides whether the form pays.
    """
    if node.attr("impl") != "capacity":
        return None
    g, x, w1, w2 = node.inputs
    (t, e), d = g.shape, x.shape[1]
    c = capacity(t, e, node.attr("capacity_factor"))
    return [("slice", [x], {"starts": (0, 0), "ends": (c, d), "steps": (1, 1)}),
            ("concat", [0] * e, {"axis": 0}),                            # 1: [E*C, d]
            ("reshape", [1], {"shape": (e, c, d)}),
            ("matmul", [2, w1], {}),                                     # 3: [E, C, h]
            (node.attr("activation"), [3], {}),
            ("matmul", [4, w2], {}),                                     # 5: [E, C, d]
            ("reduce_sum", [5], {"axes": (0,), "keepdims": False})]


def _onnx(ctx, ins, outs, *, activation, impl, capacity_factor):
    """Both lowerings export as the dense form (ONNX ``Einsum``, opset 12)."""
    g, x, w1, w2 = ins
    h = ctx.tmp("Einsum", [x, w1], equation="td,edh->teh")
    h = ctx.tmp("Relu", [h]) if activation == "relu" else \
        ctx.tmp("Mul", [h, ctx.tmp("Sigmoid", [h])])
    y = ctx.tmp("Einsum", [h, w2], equation="teh,ehd->ted")
    ctx.node("Einsum", [g, y], outs, equation="te,ted->td")


# The lowering law, read left to right: one rule per capacity factor. Factor 4 gives each
# expert twice the mean load of top-2 routing (2T/E): half the rows of the dense form.
_GXW = {"g": ("T", "E"), "x": ("T", "D"), "w1": ("E", "D", "H"), "w2": ("E", "H", "D")}
_LAWS = (
    axiom("gated_experts(g, x, w1, w2, activation=a) = gated_experts(g, x, w1, w2, activation=a, impl=i, capacity_factor=c)",
          _GXW, derive="ltr", a=ACTIVATIONS, i=("capacity",), c=(4.0,)),)

_EXAMPLE = [TensorType((6, 4), _F32), TensorType((6, 5), _F32), TensorType((4, 5, 3), _F32),
            TensorType((4, 3, 5), _F32)]
declare(OpDef(
    name="gated_experts", ref=_gated_experts, shape=_shape, arity=4,
    attrs={"activation": "relu", "impl": "dense", "capacity_factor": 4.0}, family="experts",
    to_onnx=_onnx, flops=_flops, axioms=_LAWS, composition=_composition,
    priced_as=_priced_as,
    examples=((_EXAMPLE, {}), (_EXAMPLE, {"activation": "silu", "impl": "capacity",
                                          "capacity_factor": 2.0})),
    doc="einsum('te,ted->td', g, act(x @ w1[e]) @ w2[e]): a mixture-of-experts MLP "
        "combined by a gate matrix (Mixtral's dense formulation)"))


# ---- import -------------------------------------------------------------------------------

def _replay(ctx, jaxpr, ins):
    """Import ``jaxpr`` on the tensors ``ins`` through the registered importers.

    Descends into ``jit`` and ``custom_jvp_call`` bodies as the front door does. ``None``
    where an equation has no importer or its importer declines (the front door would have
    made it opaque, which never equals a node of this replay).
    """
    env = dict(zip(jaxpr.invars, ins, strict=True))

    def read(v):
        if hasattr(v, "val"):  # a literal
            return ctx.weight(np.asarray(v.val, dtype=v.aval.dtype), "literal")
        return env[v]

    for eqn in jaxpr.eqns:
        sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr")) \
            if eqn.primitive.name in ("jit", "pjit", "custom_jvp_call") else None
        args = [read(v) for v in eqn.invars]
        if sub is not None:
            if getattr(sub, "consts", ()) or getattr(sub, "jaxpr", sub).constvars:
                return None
            res = _replay(ctx, getattr(sub, "jaxpr", sub), args)
        else:
            importer = JAXPR_IMPORTERS.get(eqn.primitive.name)
            if importer is None:
                return None
            ctx.out_types = [TensorType(tuple(v.aval.shape), str(v.aval.dtype))
                             for v in eqn.outvars]
            ctx.source_op = eqn.primitive.name
            try:
                res = importer(ctx, args, **eqn.params)
            except (ShapeError, TypeError, ValueError, KeyError, IndexError):
                res = None
        if res is None:
            return None
        env.update(zip(eqn.outvars, res, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _ancestors(t, depth: int = 16):
    """Tensors reachable from ``t`` through at most ``depth`` producers, nearest first."""
    seen, frontier = {}, [t]
    for _ in range(depth):
        frontier = list(dict.fromkeys(i for u in frontier for i in u.node.inputs
                                      if i not in seen))
        seen.update(dict.fromkeys(frontier))
    return list(seen)


def experts_idiom(ctx, g, y, dimension_numbers):
    """``gated_experts(g, x, w1, w2)`` for ``einsum("te,ted->td", g, y)``, else ``None``.

    Called by the ``dot_general`` importer before it imports the product. ``y [T, E, d]``
    must be the experts of the dense formulation on some tokens ``x [T, d]`` and weights
    ``w1 [E, d, h]``, ``w2 [E, h, d]`` among its producers: :func:`dense_experts`, traced at
    those shapes and imported on ``(g, x, w1, w2)``, must give the very node the importer
    would give for the user's product (nodes are hash-consed, so this compares the whole
    computation, not values). The gates may be anything.
    """
    dims = tuple(tuple(tuple(int(a) for a in side) for side in pair)
                 for pair in dimension_numbers)
    gt, yt = g.type, y.type
    if getattr(_REPLAYING, "on", False) or dims != (((1,), (1,)), ((0,), (0,))) \
            or len(gt.shape) != 2 or len(yt.shape) != 3 or yt.shape[:2] != gt.shape \
            or yt.dtype != gt.dtype:
        return None
    (t, e), d = gt.shape, yt.shape[2]
    found = sorted(_ancestors(y), key=lambda u: u.node.inputs != ())  # leaves first
    xs = [u for u in found if u.shape == (t, d)][:2]
    w1s = [u for u in found if len(u.shape) == 3 and u.shape[:2] == (e, d)]
    w2s = [u for u in found if len(u.shape) == 3 and u.shape[0] == e and u.shape[2] == d]
    pairs = [(w1, w2) for w1 in w1s for w2 in w2s if w2.shape[1] == w1.shape[2]][:4]
    saved = ctx.out_types, ctx.source_op
    _REPLAYING.on = True
    try:
        want = JAXPR_IMPORTERS["dot_general"](ctx, [g, y], dimension_numbers=dims)
        for x, (w1, w2), act in ((x, p, act) for x in xs for p in pairs for act in ACTIVATIONS):
            types = tuple((u.shape, u.dtype) for u in (g, x, w1, w2))
            try:
                got = _replay(ctx, _dense_jaxpr(types, act), [g, x, w1, w2])
            except (ShapeError, TypeError, ValueError, KeyError, IndexError):
                got = None  # declined: the product imports as the user wrote it
            if want is not None and got is not None and got[0] == want[0]:
                return ctx.op("gated_experts", [g, x, w1, w2], activation=act)
    finally:
        ctx.out_types, ctx.source_op = saved
        _REPLAYING.on = False
    return None


#: Set while :func:`experts_idiom` replays the dense form: its own ``einsum("te,ted->td")``
#: reaches the ``dot_general`` importer, which must then import it plainly.
_REPLAYING = threading.local()


@functools.lru_cache(maxsize=16)
def _dense_jaxpr(types, activation: str):
    """The jaxpr of :func:`dense_experts` at ``((shape, dtype), ...)`` of ``g, x, w1, w2``."""
    abstract = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in types]
    return jax.make_jaxpr(lambda *a: dense_experts(*a, activation))(*abstract).jaxpr
