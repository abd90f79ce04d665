"""Attention under a constant mask, lowered to the blocks the mask lets through.

A mask known ahead of time (a constant, or computed from weights and constants: sliding
windows, prefix-LM, packed documents, causal) says which blocks of the ``[Sq, Sk]`` score
matrix matter. Its *block plan*, read from the constant at import, marks each
``grain x grain`` cell of the scores (:data:`PLAN_GRAIN` rows and key columns):

* ``S`` (skip): every entry of the mask there is ``<= ADDITIVE_FILL`` (``-inf``,
  ``finfo.min``, ``-1e9``, or ``False`` in a boolean mask): those keys weigh zero;
* ``F`` (full): every entry is 0 (``True``): the scores there are unmasked;
* ``P`` (partial): anything else; the mask is read there.

A plan is a string, ``"<grain>:<row>/<row>/..."``, one letter per key cell in each row of
cells (``"64:PS/FP"``); ``""`` marks every cell partial.

Two operators carry it. ``block_mask(s, m, plan)`` is ``s + m`` with the plan imposed: its
``S`` cells read ``-inf`` and its ``F`` cells 0, whatever ``m`` holds there but NaN (the
*effective mask*, :func:`effective_mask`); elsewhere ``m``.
``block_masked_attention(q, kt, v, m, plan, impl, block)`` is ``softmax(block_mask(q @ kt, m,
plan)) @ v``, keys transposed, with two lowerings that compute it alike:

* ``naive``: the composition itself;
* ``blocked``: queries in blocks of ``block`` rows (a multiple of the grain), each against
  the span of key cells that some row of the block does not skip; the mask is added only
  where that span holds a cell that is not ``F``; normalized after the second matmul, as
  ``attention``'s blocked lowering. At most :data:`~taso_jax.ops.attention.MAX_BLOCKS`
  blocks.

Because the plan is part of each operator's meaning, both lowerings agree for *any* ``m``,
so the laws below hold for every value and are checked numerically and proved like any
other; the blocked form gives the skipped keys ``exp(-inf) = 0`` exactly as the naive one
does, and the largest score of each row is the same over the span as over the row.

The one step that is not an identity is the import's (:func:`block_scores`): before a
softmax over the last axis, ``s + m`` or ``where(keep, s, fill)`` with a constant mask
becomes ``block_mask(s, m', plan)``, ``m'`` the mask as an additive constant and ``plan``
derived from it and checked against every entry. A mask that differs over its leading axes
(ALiBi's per-head bias ``[1, H, Sq, Sk]``: ``-m_h (i - j)`` below the diagonal, ``-inf``
above) keeps them; one plan serves every head, a cell skipped only where every head skips
it, and every row of every head is checked. The two differ only where the constant is
``<= ADDITIVE_FILL`` (read as ``-inf``) and, for a ``where``, where it masks inside a
``P`` cell (``s + fill`` against ``fill``). Each row keeps an entry ``>= 0`` (checked), so
its largest score is at least its kept score, and while a row's scores span less than
``-ADDITIVE_FILL - 104`` (``1e9``) every such term weighs exactly zero in float32 (and
below ``-fill - 17`` in bfloat16, float16) on both sides: the softmax is the same. That is
the argument of ``attention.causal_scores`` and the partial equivalence of PET (Wang et
al., OSDI 2021, Section 4): the rewrite is exact where its precondition holds, the
precondition is checked on the constant itself, and the complement (a row that keeps
nothing, a fill above the bound) is left as it was. Online normalization rounds
differently from ``jax.nn.softmax``; the end-to-end output check compares within the
element type's tolerance.

Sources: Press et al., "Train short, test long" (ICLR 2022) for ALiBi; Child et al.,
"Generating long sequences with sparse transformers" (2019) and Beltagy et al.,
"Longformer" (2020) for local and block-sparse attention; Dong et al., "UniLM" (2019) for
the prefix-LM mask; FlashAttention (Dao et al., 2022) for skipping masked key blocks; PET
(Wang et al., OSDI 2021) for partially equivalent transformations.
"""

from __future__ import annotations

import numpy as np
from taso_jax.ops import OpDef, ShapeError, TensorType, axiom, declare, is_float_dtype
from taso_jax.ops._lazy import LazyModule
from taso_jax.ops.attention import ADDITIVE_FILL, MAX_BLOCKS, _attention_shape
from taso_jax.ops.elementwise import broadcast_shape

jax = LazyModule("jax")
jnp = LazyModule("jax.numpy")

__all__ = ["PLAN_GRAIN", "block_plan", "block_scores", "effective_mask", "parse_plan",
           "plan_spans"]

#: Rows and key columns of one cell of the plans the import derives: the blocked lowering's
#: query blocks (128, 256, 512) are multiples of it.
PLAN_GRAIN = 64
_F32 = "float32"


def parse_plan(plan: str, sq: int, sk: int) -> tuple[int, np.ndarray]:
    """``(grain, codes)`` of a plan for scores ``[sq, sk]``.

    ``codes`` is a ``[R, C]`` array of ``'S'``, ``'F'``, ``'P'`` (``R = ceil(sq / grain)``,
    ``C = ceil(sk / grain)``).

    ``""`` is one partial cell of the whole matrix.

    Raises:
        ShapeError: a malformed plan, a grid that does not cover ``[sq, sk]``, or a row of
            cells that skips every key (a fully masked row has no softmax to keep).
    """
    if plan == "":
        return max(sq, sk, 1), np.full((1, 1), "P")
    try:
        grain, rows = plan.split(":", 1)
        grain = int(grain)
        codes = np.asarray([list(r) for r in rows.split("/")])
    except ValueError:
        raise ShapeError(f"block plan {plan[:40]!r}: not '<grain>:<row>/<row>/...'") from None
    if grain < 1 or codes.ndim != 2 or codes.shape != (-(-sq // grain), -(-sk // grain)) \
            or not np.isin(codes, ("S", "F", "P")).all():
        raise ShapeError(f"block plan {plan[:40]!r} does not cover scores [{sq}, {sk}] in "
                         f"cells of {grain}")
    if (codes == "S").all(axis=1).any():
        raise ShapeError(f"block plan {plan[:40]!r}: a row of cells skips every key")
    return grain, codes


def block_plan(mask: np.ndarray, grain: int = PLAN_GRAIN) -> str | None:
    """The plan of an additive mask ``[..., Sq, Sk]`` (read over all its leading slices).

    ``None`` where no cell is skipped (nothing to gain) or a row keeps no entry ``>= 0``
    (the argument of the module docstring needs one).
    """
    m = np.asarray(mask).reshape(-1, *np.shape(mask)[-2:])
    if m.shape[-2] < 1 or m.shape[-1] < 1 or not (np.isfinite(m) | (m == -np.inf)).all() \
            or not (m.max(axis=-1) >= 0).all():
        return None
    sq, sk = m.shape[-2:]
    r, c = -(-sq // grain), -(-sk // grain)

    def per_cell(entries):  # [sq, sk] bool -> [r, c]: true at every entry of the cell
        pad = np.ones((r * grain, c * grain), bool)
        pad[:sq, :sk] = entries
        return pad.reshape(r, grain, c, grain).all(axis=(1, 3))

    skip = per_cell((m <= ADDITIVE_FILL).all(axis=0))
    full = per_cell((m == 0).all(axis=0))
    if not skip.any() or skip.all(axis=1).any():
        return None
    codes = np.where(skip, "S", np.where(full, "F", "P"))
    return f"{grain}:" + "/".join("".join(row) for row in codes)


def _cells(codes: np.ndarray, grain: int, sq: int, sk: int, code: str) -> np.ndarray:
    """Boolean ``[sq, sk]``: the entries in cells marked ``code``."""
    return np.repeat(np.repeat(codes == code, grain, 0), grain, 1)[:sq, :sk]


def effective_mask(m, plan: str, sq: int, sk: int, rows=slice(None), cols=slice(None)):
    """``m`` with the plan imposed: ``-inf`` in ``S`` cells, 0 in ``F`` cells.

    ``m`` holds the entries ``[..., rows, cols]`` of a mask over ``[sq, sk]`` scores (already
    sliced so); a JAX array of its shape and dtype is returned. ``S`` cells are imposed as
    ``minimum(m, c)``, ``c`` a constant of ``-inf`` there and ``+inf`` elsewhere: the same
    values as a ``where`` but for a NaN in a skipped cell, which stays NaN, and XLA:CPU fuses
    it into the scores' add where a ``where`` on a per-head mask ``[1, 12, 1024, 1024]``
    took a fifth more time (85 against 108 ms for the attention, 2026-11-29).
    """
    grain, codes = parse_plan(plan, sq, sk)
    skip, full = (_cells(codes, grain, sq, sk, c)[rows, cols] for c in "SF")
    m = jnp.asarray(m)
    if full.any():
        m = jnp.where(full, jnp.zeros((), m.dtype), m)
    if skip.any():
        m = jnp.minimum(m, jnp.asarray(np.where(skip, -np.inf, np.inf), m.dtype))
    return m


def plan_spans(plan: str, sq: int, sk: int, block: int) -> list[tuple[int, int, int, int, bool]]:
    """``(r0, r1, k0, k1, masked)`` per query block ``[r0, r1)`` of ``block`` rows.

    ``[k0, k1)`` is the key span from the first to the last cell that some row of the block
    does not skip; ``masked``, whether a cell of the span is not ``F`` (the mask is added).

    Raises:
        ShapeError: ``block`` is not a multiple of the plan's grain (:func:`parse_plan`).
    """
    grain, codes = parse_plan(plan, sq, sk)
    if plan and block % grain:
        raise ShapeError(f"block_masked_attention: block {block} is not a multiple of the "
                         f"plan's cells of {grain}")
    per = max(1, block // grain) if plan else codes.shape[0]
    spans = []
    for b in range(0, codes.shape[0], per):
        part = codes[b:b + per]
        kept = np.flatnonzero(~(part == "S").all(axis=0))
        lo, hi = int(kept[0]), int(kept[-1]) + 1
        r0, r1 = b * grain, min(sq, (b + per) * grain)
        spans.append((r0, r1, lo * grain, min(sk, hi * grain),
                      bool((part[:, lo:hi] != "F").any())))
    return spans


# ---- block_mask ----------------------------------------------------------------------------

def _block_mask(s, m, *, plan):
    return s + effective_mask(m, plan, *s.shape[-2:])


def _block_mask_shape(ts, *, plan):
    s, m = ts
    if len(s.shape) < 2 or not is_float_dtype(s.dtype):
        raise ShapeError(f"block_mask: needs float scores of rank >= 2, got {s.shape} {s.dtype}")
    if m.dtype != s.dtype or len(m.shape) > len(s.shape) or m.shape[-2:] != s.shape[-2:] \
            or broadcast_shape(s.shape, m.shape) != s.shape:
        raise ShapeError(f"block_mask: mask {m.shape} {m.dtype} does not fill the scores "
                         f"{s.shape} {s.dtype}")
    parse_plan(plan, *s.shape[-2:])
    return [s]


def _effective_onnx(ctx, m, plan, sq, sk):
    """ONNX ``Where`` nodes imposing ``plan`` on the mask tensor ``m``; the result's name."""
    grain, codes = parse_plan(plan, sq, sk)
    dtype = ctx.dtype(m)
    for code, value in (("F", 0.0), ("S", -np.inf)):
        cells = _cells(codes, grain, sq, sk, code)
        if cells.any():
            m = ctx.tmp("Where", [ctx.const(cells), ctx.const(np.asarray(value, dtype)), m])
    return m


def _block_mask_onnx(ctx, ins, outs, *, plan):
    sq, sk = ctx.shape(ins[0])[-2:]
    ctx.node("Add", [ins[0], _effective_onnx(ctx, ins[1], plan, sq, sk)], outs)


declare(OpDef(
    name="block_mask", ref=_block_mask, shape=_block_mask_shape, arity=2,
    attrs={"plan": ""}, to_onnx=_block_mask_onnx, fusible=True, family="attention",
    flops=lambda ins, outs, **_: float(outs[0].size),
    examples=(([TensorType((2, 4, 6), _F32), TensorType((1, 4, 6), _F32)],
               {"plan": "2:PSS/FPS"}),
              ([TensorType((3, 5), _F32), TensorType((3, 5), _F32)], {})),
    doc="s + m with a block plan imposed on the additive mask m: -inf in its skipped cells, "
        "0 in its full ones (a constant attention mask read by blocks)"))


# ---- block_masked_attention ----------------------------------------------------------------

def _masked_naive(q, kt, v, m, *, plan):
    s = jnp.matmul(q, kt)
    return jnp.matmul(jax.nn.softmax(_block_mask(s, m, plan=plan), axis=-1), v)


def _masked_blocked(q, kt, v, m, *, plan, block):
    """Query blocks, each against the key span its plan does not skip."""
    sq, sk = q.shape[-2], kt.shape[-1]
    outs = []
    for r0, r1, k0, k1, masked in plan_spans(plan, sq, sk, block):
        s = jnp.matmul(q[..., r0:r1, :], kt[..., k0:k1])
        if masked:
            part = m[..., r0:r1, k0:k1]
            s = s + effective_mask(part, plan, sq, sk, slice(r0, r1), slice(k0, k1))
        e = jnp.exp(s - jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True)))
        outs.append(jnp.matmul(e, v[..., k0:k1, :]) / jnp.sum(e, axis=-1, keepdims=True))
    return jnp.concatenate(outs, axis=-2)


def _masked_attention(q, kt, v, m, *, plan, impl, block):
    if impl == "blocked":
        return _masked_blocked(q, kt, v, m, plan=plan, block=block)
    return _masked_naive(q, kt, v, m, plan=plan)


def _masked_shape(ts, *, plan, impl, block):
    q, kt, v, m = ts
    (out,) = _attention_shape([q, kt, v], causal=False, offset=0, fill=float("-inf"),
                              impl="naive", block=128)
    if v.dtype != q.dtype:
        raise ShapeError(f"block_masked_attention: needs one float type, got {q.dtype}, "
                         f"{v.dtype}")
    scores = TensorType(broadcast_shape(q.shape[:-2], kt.shape[:-2])
                        + (q.shape[-2], kt.shape[-1]), q.dtype)
    _block_mask_shape([scores, m], plan=plan)
    if impl not in ("naive", "blocked") or int(block) < 1:
        raise ShapeError(f"block_masked_attention: unknown lowering {impl!r} (block {block})")
    if impl == "blocked":
        if -(-q.shape[-2] // int(block)) > MAX_BLOCKS:
            raise ShapeError(f"block_masked_attention: {q.shape[-2]} queries in blocks of "
                             f"{block} make more than {MAX_BLOCKS} blocks")
        plan_spans(plan, q.shape[-2], kt.shape[-1], int(block))
    return [out]


def _masked_flops(ins, outs, *, plan, impl, block):
    """Two matmuls and a softmax over the scores, or, blocked, over the spans kept."""
    q, kt, _v, _m = ins
    rows, sk = outs[0].size // outs[0].shape[-1], kt.shape[-1]
    per = float(2 * q.shape[-1] + 2 * outs[0].shape[-1] + 5)
    if impl != "blocked":
        return rows * sk * (per + 1)
    sq = q.shape[-2]
    seen = sum((r1 - r0) * (k1 - k0) * (per + masked)
               for r0, r1, k0, k1, masked in plan_spans(plan, sq, sk, block))
    return rows / sq * seen


def _masked_composition(node):
    """The naive lowering runs as its definition; the blocked one is a kernel of its own."""
    if node.attr("impl") == "blocked":
        return None
    q, kt, v, m = node.inputs
    return [("matmul", [q, kt], {}), ("block_mask", [0, m], {"plan": node.attr("plan")}),
            ("softmax", [1], {"axis": -1}), ("matmul", [2, v], {})]


def _masked_priced_as(node):
    """The blocked lowering as the calibrated cost model estimates it (``OpDef.priced_as``).

    The definition on each query block's key span, its pieces sliced from the inputs and
    joined. So both forms are priced by the kernels of the same arithmetic (matmuls, a
    softmax), the blocked one on the scores it computes only (the mask's add, fused, prices
    alike with the plan imposed or not). Priced as one kernel by the attention family's
    curve, the blocked form under a causal plan (ALiBi's, S=1024, 12 heads) cost 1.2x its
    naive form where it ran 1.4-1.5x faster, a close call that only timing could settle and
    the decorator's 10 s left no time for. The measured cost model times the kernel itself.
    """
    if node.attr("impl") != "blocked":
        return None
    q, kt, v, m = node.inputs
    steps: list = []

    def piece(op, ins, **attrs):
        steps.append((op, ins, attrs))
        return len(steps) - 1

    def part(t, rows=None, cols=None):  # t[..., rows, cols]
        starts, ends = [0] * len(t.shape), list(t.shape)
        for axis, span in ((-2, rows), (-1, cols)):
            if span is not None:
                starts[axis], ends[axis] = span
        return piece("slice", [t], starts=tuple(starts), ends=tuple(ends),
                     steps=(1,) * len(t.shape))

    outs = []
    for r0, r1, k0, k1, masked in plan_spans(node.attr("plan"), q.shape[-2], kt.shape[-1],
                                             node.attr("block")):
        s = piece("matmul", [part(q, rows=(r0, r1)), part(kt, cols=(k0, k1))])
        if masked:
            s = piece("ewadd", [s, part(m, rows=(r0, r1), cols=(k0, k1))])
        e = piece("softmax", [s], axis=-1)
        outs.append(piece("matmul", [e, part(v, rows=(k0, k1))]))
    if len(outs) > 1:
        piece("concat", outs, axis=len(q.shape) - 2)
    return steps


def _masked_onnx(ctx, ins, outs, *, plan, impl, block):
    sq, sk = ctx.shape(ins[0])[-2], ctx.shape(ins[1])[-1]
    s = ctx.tmp("Add", [ctx.tmp("MatMul", ins[:2]), _effective_onnx(ctx, ins[3], plan, sq, sk)])
    ctx.node("MatMul", [ctx.tmp("Softmax", [s], axis=-1), ins[2]], outs)


# The definition is the axiom, at a mask of the scores' full shape; with the mask broadcast
# over batch and heads ([1, 1, Sq, Sk], [1, Sq, Sk]: the form the import gives) it is the
# same formula to the prover, a theorem, as are the scaled forms (matmul's scalar law). The
# lowering law, read left to right, gives one rule per block size.
_QKVM = {"q": ("...", "M", "K"), "kt": ("...", "K", "N"), "v": ("...", "N", "P"),
         "m": ("...", "M", "N")}
_BH = {"q": ("B", "H", "M", "K"), "kt": ("B", "H", "K", "N"), "v": ("B", "H", "N", "P"),
       "m": (1, 1, "M", "N")}
_B = {"q": ("B", "M", "K"), "kt": ("B", "K", "N"), "v": ("B", "N", "P"), "m": (1, "M", "N")}
_P = ("", "4:PS/FP")
_LAWS = tuple(
    law for k, shapes in enumerate((_QKVM, _BH, _B)) for law in (
        axiom("block_masked_attention(q, kt, v, m, plan=p) = matmul(softmax(block_mask(matmul(q, kt), m, plan=p), axis=-1), v)",
              shapes, derive="rtl", theorem=k > 0, p=_P),
        axiom("block_masked_attention(scalar_mul(q, scalar=s), kt, v, m, plan=p) = matmul(softmax(block_mask(scalar_mul(matmul(q, kt), scalar=s), m, plan=p), axis=-1), v)",
              shapes, derive="rtl", theorem=True, s=(0.125,), p=_P),
        axiom("block_masked_attention(q, kt, v, m, plan=p) = block_masked_attention(q, kt, v, m, plan=p, impl=i, block=b)",
              shapes, derive="ltr", theorem=k > 0, p=_P, i=("blocked",), b=(128, 256, 512))))

declare(OpDef(
    name="block_masked_attention", ref=_masked_attention, shape=_masked_shape, arity=4,
    attrs={"plan": "", "impl": "naive", "block": 128}, family="attention",
    to_onnx=_masked_onnx, flops=_masked_flops, axioms=_LAWS,
    composition=_masked_composition, priced_as=_masked_priced_as,
    examples=(([TensorType((2, 8, 4), _F32), TensorType((2, 4, 8), _F32),
                TensorType((2, 8, 3), _F32), TensorType((2, 8, 8), _F32)],
               {"plan": "4:PS/FP"}),
              ([TensorType((1, 2, 6, 4), _F32), TensorType((1, 2, 4, 7), _F32),
                TensorType((1, 2, 7, 5), _F32), TensorType((1, 1, 6, 7), _F32)],
               {"plan": "2:PSSS/FPSS/SFPP", "impl": "blocked", "block": 2})),
    doc="softmax(block_mask(q @ kt, mask, plan)) @ v over the last two axes, keys "
        "transposed: attention under a constant mask whose blocks the plan marks skipped, "
        "full or partial"))


# ---- import -------------------------------------------------------------------------------

def _read(ctx, t, scores: tuple[int, ...]) -> np.ndarray | None:
    """The constant ``t`` (a mask, or a ``where``'s predicate) as the scores read it.

    ``scores`` is ``[..., Sq, Sk]``. ``[Sq, Sk]`` where ``t`` is equal over its leading axes
    (read before the reshapes and expands that kept its last two axes); else the value of
    ``t`` itself, left-padded with 1s to the rank of ``scores``, where its leading axes are
    the scores' (a per-head bias ``[1, H, Sq, Sk]`` at batch 1, ALiBi's): the rules that
    bring ``block_mask`` into attention bind a mask's leading axes to the scores' or to 1s,
    so a per-head mask under a batch of 2 stays an add, as before (and a per-batch one
    ``[B, 1, Sq, Sk]`` under heads, which ``masked_attention``'s rules take). ``t`` itself,
    not its source: a reshape may have moved a batch axis to the heads. ``None`` where ``t``
    is not a constant or does not fit.
    """
    from taso_jax.ops.elementwise_jaxpr import _unbroadcast

    value = ctx.const(_unbroadcast(t))
    if value is None or np.shape(value)[-2:] != scores[-2:]:
        return None
    flat = np.asarray(value).reshape(-1, *scores[-2:])
    if (flat == flat[:1]).all():
        return flat[0]
    value = ctx.const(t)
    if value is None or np.ndim(value) > len(scores):
        return None
    value = np.asarray(value).reshape((1,) * (len(scores) - np.ndim(value)) + np.shape(value))
    return value if value.shape == tuple(scores) else None


def _additive(ctx, x):
    """``(s, m, mask)`` if ``x`` is ``s + m`` or ``where(keep, s, fill)``, else ``None``.

    The mask is a constant; ``mask`` is its additive value, ``[Sq, Sk]`` where it is equal
    over the leading axes, else ``[..., Sq, Sk]`` of the rank of ``x``, broadcast into it
    (:func:`_read`); ``m`` the additive mask tensor (``None`` for a ``where``).
    """
    from taso_jax.ops.elementwise import _scalar_const

    node = x.node
    if node.op == "ewadd":
        pairs = [(s, m, None) for s, m in (node.inputs, node.inputs[::-1])]
    elif node.op == "where":
        pred, a, b = node.inputs
        pairs = [(a, b, True), (b, a, False)]
    else:
        return None
    for s, m, keep_on in pairs:
        if s.shape != x.shape or ctx.weight_only(s) or not ctx.weight_only(m):
            continue
        if keep_on is None:
            value = _read(ctx, m, x.shape)
            if value is None:
                continue
        else:
            keep, fill = _read(ctx, pred, x.shape), _scalar_const(ctx, m)
            if keep is None or fill is None or not fill <= ADDITIVE_FILL:
                continue
            value = np.where(np.asarray(keep, bool) == keep_on, 0.0, fill)
        return s, (m if keep_on is None else None), value
    return None


def block_scores(ctx, x):
    """``block_mask(s, m, plan)`` for a softmax's input ``x`` under a constant mask, else ``x``.

    ``x`` is ``s + m`` (an additive mask: 0, biases, and fills ``<= ADDITIVE_FILL``) or
    ``where(keep, s, fill)`` (a boolean mask, ``fill <= ADDITIVE_FILL``), the mask computed
    from constants only (``ctx.const``: in a traced function, not from the weights a later
    call may change) and broadcast into the scores ``s`` ``[..., Sq, Sk]``: ``[Sq, Sk]``
    where it is equal over the leading axes, else with them (a per-head bias, :func:`_read`).
    Its plan (:func:`block_plan`) is derived from, and checked against, every entry; where it
    skips no cell, or a row keeps no entry ``>= 0``, ``x`` is left as it was. The softmax
    reads the same either way (module docstring: the import's step). Call it only for a
    softmax over the last axis of ``x``, after ``attention.causal_scores``.
    """
    if len(x.shape) < 2 or not is_float_dtype(x.dtype):
        return x
    found = _additive(ctx, x)
    if found is None:
        return x
    s, m, mask = found
    plan = block_plan(mask)
    if plan is None:
        return x
    shape = (1,) * (len(x.shape) - mask.ndim) + mask.shape
    if m is None or m.shape != shape or m.dtype != x.dtype:
        m = ctx.weight(np.asarray(mask, x.dtype).reshape(shape), "mask")
    return ctx.op("block_mask", [s, m], plan=plan)
