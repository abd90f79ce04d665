"""Attention: dot-product attention, its causal mask, grouped K/V heads, an additive mask.

Each with its lowerings per device.

``attention(q, kt, v)`` is ``softmax(q @ kt) @ v`` over the last two axes, with the keys
given transposed (``kt``: ``[..., D, Sk]``), as JAX's ``dot_general`` import and ONNX
exporters leave them; a scale is folded into ``q`` beforehand. ``q`` and ``kt`` may be of a
wider float type than ``v`` (scores taken in float32 from bfloat16 operands, as
``jax.nn.dot_product_attention`` does): the probabilities are then cast to ``v``'s type for
the second product, and the output has ``v``'s type. Its laws are its naive
composition (matmul, causal mask, softmax, matmul), so the rules that introduce it are read
off those laws and proved like any other (``taso_jax.verify.from_laws``). Its ``impl``
attribute names a lowering; each computes the same function, and the measured cost model
picks one per device through the rules ``attention(impl='naive') => attention(impl=...)``:

* ``naive``: the composition itself, an ``[Sq, Sk]`` score matrix;
* ``blocked``: for causal attention, queries in blocks of ``block`` rows, each against the
  key prefix it can see, so the masked upper triangle is neither computed nor stored (about
  half the arithmetic at ``Sq = Sk``); normalized after the second matmul; at most
  :data:`MAX_BLOCKS` blocks;
* ``cudnn``: cuDNN's fused attention with its causal flag, on a CUDA GPU in float16 or
  bfloat16 (:mod:`taso_jax.ops.cudnn_attention`); the search offers it nowhere else.

The blocked form gives the masked keys exactly zero weight, as the naive form does
with ``fill = -inf``; with a finite ``fill`` (``-1e9``, ``finfo.min``) the naive form gives
them ``exp(fill - max)``, which is zero in float32 whenever a row's largest score exceeds
``fill + 104``, so that form is offered only for ``fill <= -1e4``
(:data:`SKIP_FILL`). Online normalization rounds differently from ``jax.nn.softmax``; the
end-to-end output check compares within the tolerance of the element type.

Sources: Vaswani et al., "Attention is all you need" (2017), Section 3.2.1 (scaled
dot-product attention); ONNX Softmax, MatMul, Where; ``jax.nn.dot_product_attention``; the
query-blocked causal form after FlashAttention (Dao et al., 2022), without its online
softmax across key blocks.
"""

from __future__ import annotations

import numpy as np
from taso_jax.ops import OpDef, ShapeError, TensorType, axiom, declare, is_float_dtype
from taso_jax.ops._lazy import LazyModule
from taso_jax.ops.cudnn_attention import (
    causal_fraction,
    check_cudnn_shapes,
    cudnn_attention,
    cudnn_unavailable,
)
from taso_jax.ops.elementwise import broadcast_shape

jax = LazyModule("jax")
jnp = LazyModule("jax.numpy")

__all__ = ["causal_offset", "causal_scores", "repeat_idiom", "IMPLS", "SKIP_FILL",
           "ADDITIVE_FILL", "MAX_BLOCKS"]

#: The lowerings of ``attention``.
IMPLS = ("naive", "blocked", "cudnn")
#: Most query blocks of the blocked lowering: XLA compiles each block's kernels apart (32
#: blocks of 64 at S=2048 took 4.4 s to compile on XLA:CPU, and ran slower than 16 of 128).
MAX_BLOCKS = 16
#: Largest ``fill`` for which a lowering may skip masked keys instead of weighting them
#: ``exp(fill - max)`` (zero in float32 and bfloat16 below ``max - 104``).
SKIP_FILL = -1e4
#: Largest finite fill of a constant additive causal mask that :func:`causal_scores` reads,
#: before a softmax, as a ``causal_mask``: masked scores then weigh exactly zero, as with the
#: mask, unless a row's scores span about ``-fill`` (1e9).
ADDITIVE_FILL = -1e9

_F32 = "float32"


def _keep(sq: int, sk: int, offset: int, row0: int = 0, cols: int | None = None):
    """Boolean ``[rows, cols]`` mask: key ``j`` is visible to query ``i`` iff ``j <= i + offset``."""
    rows = jnp.arange(row0, row0 + sq)[:, None]
    return jnp.arange(sk if cols is None else cols)[None, :] <= rows + offset


def _keep_numpy(sq: int, sk: int, offset: int) -> np.ndarray:
    """:func:`_keep` as a constant NumPy array (ONNX export, recognition)."""
    return np.arange(sk)[None, :] <= np.arange(sq)[:, None] + offset


def _causal_mask(x, *, offset, fill):
    keep = _keep(x.shape[-2], x.shape[-1], offset)
    return jnp.where(keep, x, jnp.asarray(fill, x.dtype))


def _causal_mask_shape(ts, *, offset, fill):
    (x,) = ts
    if len(x.shape) < 2:
        raise ShapeError(f"causal_mask: needs rank >= 2, got {x.shape}")
    if not is_float_dtype(x.dtype):
        raise ShapeError(f"causal_mask: needs a float tensor, got {x.dtype}")
    return [x]


def _causal_mask_onnx(ctx, ins, outs, *, offset, fill):
    sq, sk = ctx.shape(ins[0])[-2:]
    ctx.node("Where", [ctx.const(_keep_numpy(sq, sk, offset)), ins[0],
                       ctx.const(np.asarray(fill, ctx.dtype(ins[0])))], outs)


declare(OpDef(
    name="causal_mask", ref=_causal_mask,
    shape=_causal_mask_shape, arity=1, attrs={"offset": 0, "fill": float("-inf")},
    to_onnx=_causal_mask_onnx, fusible=True, trailing=2,
    examples=(([TensorType((2, 5, 5), _F32)], {}),
              ([TensorType((3, 2, 6), _F32)], {"offset": 4, "fill": -1e9})),
    doc="x[..., i, j] where j <= i + offset, else fill: a causal (lower-triangular) mask "
        "over the last two axes (jnp.where(jnp.tril(ones, offset), x, fill))"))


def causal_offset(mask: np.ndarray) -> int | None:
    """The causal offset that ``mask`` keeps, else ``None``.

    ``mask`` is a ``[..., Sq, Sk]`` bool array, equal over its leading axes; its offset is the
    ``o >= 0`` with ``mask[i, j] == (j <= i + o)`` (every row keeps at least one key).
    """
    mask = np.asarray(mask)
    if mask.dtype != bool or mask.ndim < 2:
        return None
    m = mask.reshape(-1, *mask.shape[-2:])
    if not (m == m[:1]).all():
        return None
    m = m[0]
    sq, sk = m.shape
    offset = int(m[0].sum()) - 1
    if offset < 0 or offset >= sk:
        return None
    return offset if np.array_equal(m, _keep_numpy(sq, sk, offset)) else None


def causal_scores(ctx, x):
    """``causal_mask(s, offset, fill)`` for a softmax's input ``x = s + m``, else ``x``.

    ``m`` is a constant (computed from constants only: Hugging Face's
    ``select(mask > 0, 0, finfo.min)`` over a sliced ``tril``) equal over its leading axes,
    broadcast into the scores ``s``; each of its values, all checked, is 0 where key
    ``j <= i + offset`` and one ``fill <= ADDITIVE_FILL`` elsewhere. A softmax over the last
    axis then reads the same as on ``causal_mask(s, offset, fill)``: the two differ only in
    the masked terms, ``exp(s_ij + fill - max)`` against ``exp(fill - max)``; every row keeps a
    key (``offset >= 0``), so while a row's scores span less than ``-fill - 104`` both are
    exactly zero in float32 (and bfloat16, float16 below ``-fill - 17``) and the rows' maxima
    are those of the kept scores. That bound is the one the blocked lowering already relies
    on (:data:`SKIP_FILL`); it holds for any finite float32 scores with ``fill = finfo.min``.
    With ``fill = -inf`` the add itself is the mask (``elementwise_jaxpr._causal_additive``).

    An import-time canonicalization, not a rule: the search never sees ``s + m``, so the
    attention laws (stated on ``causal_mask``) apply to it. Call it only for a softmax over
    the last axis of ``x``.
    """
    from taso_jax.ops.elementwise_jaxpr import _unbroadcast

    if x.node.op != "ewadd" or len(x.shape) < 2 \
            or not is_float_dtype(x.dtype):
        return x
    for s, m in (x.node.inputs, x.node.inputs[::-1]):
        if s.shape != x.shape or ctx.weight_only(s) or not ctx.weight_only(m):
            continue
        mask = ctx.const(_unbroadcast(m))
        if mask is None or np.shape(mask)[-2:] != x.shape[-2:]:
            continue
        mask = np.asarray(mask)
        keep = mask == 0
        masked = mask[~keep]
        fill = float(masked[0]) if masked.size else 0.0
        if not fill <= ADDITIVE_FILL or not np.all(masked == masked[0]):
            continue  # not one large negative value (nor NaN) where masked
        offset = causal_offset(keep)
        if offset is not None:
            return ctx.op("causal_mask", [s], offset=offset, fill=fill)
    return x


# ---- attention ----------------------------------------------------------------------------

def _naive(q, kt, v, *, causal, offset, fill):
    s = jnp.matmul(q, kt)
    if causal:
        s = _causal_mask(s, offset=offset, fill=fill)
    return jnp.matmul(jax.nn.softmax(s, axis=-1).astype(v.dtype), v)


def _blocked(q, kt, v, *, offset, fill, block):
    """Causal attention in query blocks, each against the keys it can see."""
    sq, sk = q.shape[-2], kt.shape[-1]
    outs = []
    for start in range(0, sq, block):
        stop = min(start + block, sq)
        hi = min(sk, stop + offset)  # the block's last query sees keys j <= stop - 1 + offset
        s = jnp.matmul(q[..., start:stop, :], kt[..., :hi])
        keep = _keep(stop - start, sk, offset, row0=start, cols=hi)
        s = jnp.where(keep, s, jnp.asarray(fill, s.dtype))
        e = jnp.exp(s - jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True)))
        num = jnp.matmul(e.astype(v.dtype), v[..., :hi, :], preferred_element_type=s.dtype)
        outs.append((num / jnp.sum(e, axis=-1, keepdims=True)).astype(v.dtype))
    return jnp.concatenate(outs, axis=-2)


def _attention(q, kt, v, *, causal, offset, fill, impl, block):
    if impl == "blocked" and causal:
        return _blocked(q, kt, v, offset=offset, fill=fill, block=block)
    if impl == "cudnn":
        return cudnn_attention(q, kt, v, causal=causal)
    return _naive(q, kt, v, causal=causal, offset=offset, fill=fill)


def _attention_shape(ts, *, causal, offset, fill, impl, block):
    q, kt, v = ts
    if min(len(q.shape), len(kt.shape), len(v.shape)) < 2:
        raise ShapeError(f"attention: operands need rank >= 2, got {q.shape}, {kt.shape}, "
                         f"{v.shape}")
    if q.shape[-1] != kt.shape[-2] or kt.shape[-1] != v.shape[-2]:
        raise ShapeError(f"attention: sizes do not chain in q{q.shape} kt{kt.shape} "
                         f"v{v.shape}")
    if q.dtype != kt.dtype or not is_float_dtype(q.dtype) or not is_float_dtype(v.dtype):
        raise ShapeError(f"attention: needs float operands, the scores' of one type, got "
                         f"{q.dtype}, {kt.dtype}, {v.dtype}")
    if impl not in IMPLS or int(block) < 1:
        raise ShapeError(f"attention: unknown lowering {impl!r} (block {block})")
    if impl == "blocked" and -(-q.shape[-2] // int(block)) > MAX_BLOCKS:
        raise ShapeError(f"attention: {q.shape[-2]} queries in blocks of {block} make more "
                         f"than {MAX_BLOCKS} blocks")
    if impl != "naive" and (float(fill) > SKIP_FILL or (causal and offset < 0)):
        raise ShapeError(f"attention: the {impl} lowering skips masked keys, which the "
                         f"fill {fill} does not make zero")
    if impl == "cudnn":
        check_cudnn_shapes("attention", q, kt, v, reps=1, causal=causal, offset=offset)
    batch = broadcast_shape(q.shape[:-2], kt.shape[:-2], v.shape[:-2])
    return [TensorType(batch + (q.shape[-2], v.shape[-1]), v.dtype)]


def _attention_flops(ins, outs, *, causal, impl, offset=0, block=128, **_):
    """Two matmuls and a softmax over the score matrix.

    The blocked form does them over its blocks' key prefixes: about half at ``Sq = Sk``,
    less the smaller the blocks; the cuDNN form over the tiles of 128 it does not skip.
    """
    q, kt, _v = ins
    rows, sk = outs[0].size // outs[0].shape[-1], kt.shape[-1]
    full = float(rows) * sk * (2 * q.shape[-1] + 2 * outs[0].shape[-1] + 5)
    if causal and impl == "cudnn":
        return full * causal_fraction(q.shape[-2], sk)
    if not (causal and impl == "blocked"):
        return full
    sq = q.shape[-2]
    seen = sum((min(start + block, sq) - start) * min(sk, min(start + block, sq) + offset)
               for start in range(0, sq, block))
    return full * seen / (sq * sk)


def _composition(node, mask=None, causal=None):
    """``softmax(q @ kt [+ mask]) @ v`` on ``node``'s inputs, as ``OpDef.composition`` steps.

    ``causal``: the ``causal_mask`` attributes applied to the scores, if any.
    """
    q, kt, v = node.inputs[:3]
    steps = [("matmul", [q, kt], {})]
    if mask is not None:
        steps.append(("ewadd", [0, mask], {}))
    if causal is not None:
        steps.append(("causal_mask", [len(steps) - 1], causal))
    steps.append(("softmax", [len(steps) - 1], {"axis": -1}))
    if v.dtype != q.dtype:
        steps.append(("cast", [len(steps) - 1], {"to": v.dtype}))
    steps.append(("matmul", [len(steps) - 1, v], {}))
    return steps


def _attention_composition(node):
    """The naive lowering runs as the definition; the blocked one is a kernel of its own.

    Timed as one kernel, naive causal attention (72 ms at S=1024, 12 heads, XLA:CPU) cost
    more than its matmuls and softmax timed one by one (56 ms), so the rewrite that
    introduces it lay beyond the search's alpha relaxation, and the blocked lowerings
    behind it out of reach.
    """
    if (node.attr("impl") == "blocked" and node.attr("causal")) or node.attr("impl") == "cudnn":
        return None
    causal = ({"offset": node.attr("offset"), "fill": node.attr("fill")}
              if node.attr("causal") else None)
    return _composition(node, causal=causal)


def _runs_here(node):
    """Why the search may not build ``node`` on this device (``OpDef.runs_here``).

    The cuDNN form where cuDNN cannot run. The query-blocked form where the cuDNN form of
    the same node runs: on an H200 in bfloat16, cuDNN's causal attention ran 1.6x, 2.4x and
    3.7x faster than the naive form at S=1024, 2048 and 4096 where query blocks gave 1.1x,
    1.1x and 1.3x (``benchmarks/cudnn_attention.py``), and timing the blocked forms cost
    seconds of XLA:GPU compiles per search (one per block size, eight to sixteen blocks).
    """
    impl, types = node.attr("impl"), [t.type for t in node.inputs]
    if impl == "cudnn":
        return cudnn_unavailable(*types)
    if impl != "blocked" or cudnn_unavailable(*types) is not None:
        return None
    try:
        check_cudnn_shapes(node.op, *types, reps=node.attr("reps", 1),
                           causal=node.attr("causal"), offset=node.attr("offset"))
    except ShapeError:
        return None
    return "cuDNN's fused attention runs here, faster than query blocks"


def _attention_onnx(ctx, ins, outs, *, causal, offset, fill, impl, block, kt_shape=None,
                    v_dtype=None):
    s = ctx.tmp("MatMul", ins[:2])
    if causal:
        rows, cols = ctx.shape(ins[0])[-2], (kt_shape or ctx.shape(ins[1]))[-1]
        s = ctx.tmp("Where", [ctx.const(_keep_numpy(rows, cols, offset)),
                              s, ctx.const(np.asarray(fill, ctx.dtype(ins[0])))])
    p = ctx.tmp("Softmax", [s], axis=-1)
    v_dtype = v_dtype or ctx.dtype(ins[2])
    if v_dtype != ctx.dtype(ins[0]):  # scores taken wider than the values
        from onnx import helper

        p = ctx.tmp("Cast", [p], to=helper.np_dtype_to_tensor_dtype(np.dtype(v_dtype)))
    ctx.node("MatMul", [p, ins[2]], outs)


# ---- laws ---------------------------------------------------------------------------------
# The two definitions are axioms. The scaled forms are theorems (a scale on the scores is a
# scale on the queries: matmul's scalar_mul law), so their rules are proved, not assumed.
# Read right to left, each law gives the rule that introduces ``attention``; the lowering law,
# read left to right, gives one rule per block size.
_QKV = {"q": ("...", "M", "K"), "kt": ("...", "K", "N"), "v": ("...", "N", "P")}
#: Grouped K/V heads: one K/V head (a unit axis) against the G query heads of its group.
_QKV_G = {"q": ("...", "G", "M", "K"), "kt": ("...", 1, "K", "N"), "v": ("...", 1, "N", "P")}
_F = (float("-inf"), -1e9)
#: The cast's type in the numeric check of the laws with scores taken wider than the values.
_WIDE = ("float64",)
_QKV_HEADS = {"q": ("B", "H", "M", "K"), "kt": ("B", "H", "K", "N"), "v": ("B", "H", "N", "K")}
_QKV_SQUARE = {"q": ("B", "H", "M", "K"), "kt": ("B", "H", "K", "M"), "v": ("B", "H", "M", "K")}
_ATTENTION_LAWS = (
    axiom("attention(q, kt, v) = matmul(softmax(matmul(q, kt), axis=-1), v)", _QKV,
          derive="rtl"),
    axiom("attention(q, kt, v, causal=True, offset=o, fill=f) = matmul(softmax(causal_mask(matmul(q, kt), offset=o, fill=f), axis=-1), v)",
          _QKV, derive="rtl", o=(0, 1), f=_F),
    axiom("attention(scalar_mul(q, scalar=s), kt, v) = matmul(softmax(scalar_mul(matmul(q, kt), scalar=s), axis=-1), v)",
          _QKV, derive="rtl", theorem=True, s=(0.125,)),
    axiom("attention(scalar_mul(q, scalar=s), kt, v, causal=True, offset=o, fill=f) = matmul(softmax(causal_mask(scalar_mul(matmul(q, kt), scalar=s), offset=o, fill=f), axis=-1), v)",
          _QKV, derive="rtl", theorem=True, s=(0.125,), o=(0, 1), f=_F),
    axiom("attention(q, kt, v, causal=True, offset=o, fill=f) = attention(q, kt, v, causal=True, offset=o, fill=f, impl=i, block=b)",
          _QKV, derive="ltr", o=(0, 1), f=_F, i=("blocked",), b=(128, 256, 512)),
    # The same laws with one K/V head broadcast over a group of query heads: the form of
    # jax.nn.dot_product_attention with fewer K/V heads than query heads, whose product per
    # group the dot_general import keeps (ops/matmul.py, _split_free). Theorems: instances of
    # the definitions above, which hold at any shapes the products broadcast over.
    axiom("attention(q, kt, v) = matmul(softmax(matmul(q, kt), axis=-1), v)", _QKV_G,
          derive="rtl", theorem=True),
    axiom("attention(q, kt, v, causal=True, offset=o, fill=f) = matmul(softmax(causal_mask(matmul(q, kt), offset=o, fill=f), axis=-1), v)",
          _QKV_G, derive="rtl", theorem=True, o=(0, 1), f=_F),
    axiom("attention(scalar_mul(q, scalar=s), kt, v) = matmul(softmax(scalar_mul(matmul(q, kt), scalar=s), axis=-1), v)",
          _QKV_G, derive="rtl", theorem=True, s=(0.125,)),
    axiom("attention(scalar_mul(q, scalar=s), kt, v, causal=True, offset=o, fill=f) = matmul(softmax(causal_mask(scalar_mul(matmul(q, kt), scalar=s), offset=o, fill=f), axis=-1), v)",
          _QKV_G, derive="rtl", theorem=True, s=(0.125,), o=(0, 1), f=_F),
    axiom("attention(q, kt, v, causal=True, offset=o, fill=f) = attention(q, kt, v, causal=True, offset=o, fill=f, impl=i, block=b)",
          _QKV_G, derive="ltr", theorem=True, o=(0, 1), f=_F, i=("blocked",), b=(128, 256, 512)),
    # Scores taken wider than the values (16-bit operands accumulated in float32, the softmax
    # in float32, the probabilities cast back for the second product: the form of
    # jax.nn.dot_product_attention, flax and equinox in bfloat16), the same laws with the
    # cast. Over the reals a cast between float types is the identity, and typed graphs
    # bind ``t`` to the values' float type only (the second product needs it), so these are
    # the definitions again; checked numerically at float64 (``t`` the identity there).
    *(law for shapes, theorem in ((_QKV, False), (_QKV_G, True)) for law in (
        axiom("attention(q, kt, v) = matmul(cast(softmax(matmul(q, kt), axis=-1), to=t), v)",
              shapes, derive="rtl", theorem=theorem, t=_WIDE),
        axiom("attention(q, kt, v, causal=True, offset=o, fill=f) = matmul(cast(softmax(causal_mask(matmul(q, kt), offset=o, fill=f), axis=-1), to=t), v)",
              shapes, derive="rtl", theorem=theorem, o=(0, 1), f=_F, t=_WIDE),
        axiom("attention(scalar_mul(q, scalar=s), kt, v) = matmul(cast(softmax(scalar_mul(matmul(q, kt), scalar=s), axis=-1), to=t), v)",
              shapes, derive="rtl", theorem=True, s=(0.125,), t=_WIDE),
        axiom("attention(scalar_mul(q, scalar=s), kt, v, causal=True, offset=o, fill=f) = matmul(cast(softmax(causal_mask(scalar_mul(matmul(q, kt), scalar=s), offset=o, fill=f), axis=-1), to=t), v)",
              shapes, derive="rtl", theorem=True, s=(0.125,), o=(0, 1), f=_F, t=_WIDE),
        # the scores widened after the mask, the softmax in float32 (equinox in bfloat16):
        # ``widen`` changes no value (its shape rule refuses a narrowing), so the law holds
        # for every type it is well typed at
        axiom("attention(q, kt, v) = matmul(cast(softmax(widen(matmul(q, kt), to=w), axis=-1), to=t), v)",
              shapes, derive="rtl", theorem=theorem, w=_WIDE, t=_WIDE),
        axiom("attention(q, kt, v, causal=True, offset=o, fill=f) = matmul(cast(softmax(widen(causal_mask(matmul(q, kt), offset=o, fill=f), to=w), axis=-1), to=t), v)",
              shapes, derive="rtl", theorem=theorem, o=(0, 1), f=_F, w=_WIDE, t=_WIDE))),
    # cuDNN's fused attention (ops/cudnn_attention.py): heads on axis -3, one head dimension
    # for queries and values, and for its causal flag a square score matrix at offset 0.
    axiom("attention(q, kt, v) = attention(q, kt, v, impl=i)", _QKV_HEADS, derive="ltr",
          i=("cudnn",)),
    axiom("attention(q, kt, v, causal=True, offset=0, fill=f) = attention(q, kt, v, causal=True, offset=0, fill=f, impl=i)",
          _QKV_SQUARE, derive="ltr", f=_F, i=("cudnn",)),
)

declare(OpDef(
    name="attention", ref=_attention, shape=_attention_shape, arity=3,
    attrs={"causal": False, "offset": 0, "fill": float("-inf"), "impl": "naive", "block": 128},
    to_onnx=_attention_onnx, flops=_attention_flops, axioms=_ATTENTION_LAWS,
    composition=_attention_composition, runs_here=_runs_here,
    examples=(([TensorType((2, 6, 4), _F32), TensorType((2, 4, 6), _F32),
                TensorType((2, 6, 3), _F32)], {}),
              ([TensorType((1, 2, 7, 4), _F32), TensorType((1, 2, 4, 7), _F32),
                TensorType((1, 2, 7, 5), _F32)], {"causal": True}),
              ([TensorType((2, 9, 4), _F32), TensorType((2, 4, 11), _F32),
                TensorType((2, 11, 3), _F32)],
               {"causal": True, "offset": 2, "impl": "blocked", "block": 4}),
              ([TensorType((1, 2, 8, 8), _F32), TensorType((1, 2, 8, 8), _F32),
                TensorType((1, 2, 8, 8), _F32)], {"causal": True, "impl": "cudnn"})),
    doc="softmax(q @ kt [causal mask]) @ v over the last two axes, keys transposed, the "
        "probabilities in v's type (scaled dot-product attention, Vaswani et al. 2017, "
        "Section 3.2.1)"))


# ---- grouped K/V heads ---------------------------------------------------------------------
# Grouped-query attention (Ainslie et al., "GQA", 2023) shares each K/V head among ``reps``
# query heads. Code written for plain attention repeats the K/V heads (``jnp.repeat(k, reps,
# axis=heads)``), which copies them ``reps`` times; ``grouped_attention`` reads them once,
# the query heads of a group broadcast against their one K/V head.

def _repeat(x, *, axis, reps):
    return jnp.repeat(x, reps, axis=axis)


def _repeat_shape(ts, *, axis, reps):
    (x,) = ts
    r = len(x.shape)
    if not -r <= axis < 0 or int(reps) < 1:
        raise ShapeError(f"repeat: axis {axis} (negative) and reps {reps} do not fit {x.shape}")
    shape = list(x.shape)
    shape[axis] *= int(reps)
    return [TensorType(tuple(shape), x.dtype)]


def _repeat_nodes(ctx, x, axis, reps, outs=None):
    """ONNX Reshape, Expand, Reshape repeating ``x`` along ``axis``; the output's name."""
    shape = ctx.shape(x)
    a = len(shape) + axis
    unit = (*shape[:a + 1], 1, *shape[a + 1:])
    wide = (*shape[:a + 1], reps, *shape[a + 1:])
    merged = ctx.const(np.asarray((*shape[:a], shape[a] * reps, *shape[a + 1:]), np.int64))
    y = ctx.tmp("Expand", [ctx.tmp("Reshape", [x, ctx.const(np.asarray(unit, np.int64))]),
                           ctx.const(np.asarray(wide, np.int64))])
    if outs is None:
        return ctx.tmp("Reshape", [y, merged])
    ctx.node("Reshape", [y, merged], outs)
    return outs[0]


def _repeat_onnx(ctx, ins, outs, *, axis, reps):
    _repeat_nodes(ctx, ins[0], axis, reps, outs)


declare(OpDef(
    name="repeat", copies_values=True,
    ref=_repeat, shape=_repeat_shape, arity=1, attrs={"axis": -1, "reps": 1},
    to_onnx=_repeat_onnx, fusible=True,
    examples=(([TensorType((2, 3, 4), _F32)], {"axis": -2, "reps": 3}),),
    doc="each slice along axis repeated reps times in place (jnp.repeat with a scalar count; "
        "ONNX Reshape, Expand, Reshape)"))


def repeat_idiom(ctx, t, shape):
    """``repeat(y, axis, reps)`` if reshaping ``t`` to ``shape`` completes ``jnp.repeat``.

    That is ``y`` given a unit axis after ``axis``, expanded to ``reps`` there, then merged into
    ``axis``; else ``None``.
    """
    if t.node.op != "expand" or t.node.inputs[0].node.op != "reshape":
        return None
    u = t.node.inputs[0]
    y = u.node.inputs[0]
    ys, us, ts, shape = tuple(y.shape), tuple(u.shape), tuple(t.shape), tuple(shape)
    if len(us) != len(ys) + 1 or len(shape) != len(ys):
        return None
    for a in range(len(ys)):
        reps = ts[a + 1]
        if us == (*ys[:a + 1], 1, *ys[a + 1:]) and ts == (*ys[:a + 1], reps, *ys[a + 1:]) \
                and shape == (*ys[:a], ys[a] * reps, *ys[a + 1:]) and reps > 1:
            return ctx.op("repeat", [y], axis=a - len(ys), reps=int(reps))
    return None


def _grouped(q, kt, v, *, reps, causal, offset, fill, impl, block):
    """Grouped attention by broadcasting, without copies.

    Query heads ``[..., G*reps, Sq, D]`` as ``[..., G, reps, Sq, D]`` against K/V heads
    ``[..., G, 1, ...]``: the matmuls broadcast the one K/V head over its group.
    """
    if impl == "cudnn":
        return cudnn_attention(q, kt, v, causal=causal)
    lead, (h, sq, d) = q.shape[:-3], q.shape[-3:]
    g = h // reps
    out = _attention(q.reshape(*lead, g, reps, sq, d), kt[..., :, None, :, :],
                     v[..., :, None, :, :], causal=causal, offset=offset, fill=fill,
                     impl=impl, block=block)
    return out.reshape(*lead, h, sq, out.shape[-1])


def _grouped_shape(ts, *, reps, causal, offset, fill, impl, block):
    q, kt, v = ts
    if min(len(t.shape) for t in ts) < 3 or int(reps) < 1:
        raise ShapeError(f"grouped_attention: operands need rank >= 3, got {q.shape}, "
                         f"{kt.shape}, {v.shape}")
    if kt.shape[-3] != v.shape[-3] or q.shape[-3] != kt.shape[-3] * reps:
        raise ShapeError(f"grouped_attention: {q.shape[-3]} query heads are not {reps} per "
                         f"K/V head of {kt.shape[-3]}")
    if impl == "cudnn":
        check_cudnn_shapes("grouped_attention", q, kt, v, reps=reps, causal=causal,
                           offset=offset)
        if causal and float(fill) > SKIP_FILL:
            raise ShapeError(f"grouped_attention: the cuDNN lowering skips masked keys, "
                             f"which the fill {fill} does not make zero")
        impl = "naive"  # the products per group below: the same shapes
    split = [TensorType((*q.shape[:-3], kt.shape[-3], reps, *q.shape[-2:]), q.dtype),
             TensorType((*kt.shape[:-2], 1, *kt.shape[-2:]), kt.dtype),
             TensorType((*v.shape[:-2], 1, *v.shape[-2:]), v.dtype)]
    (out,) = _attention_shape(split, causal=causal, offset=offset, fill=fill, impl=impl,
                              block=block)
    return [TensorType((*out.shape[:-4], q.shape[-3], *out.shape[-2:]), out.dtype)]


def _grouped_flops(ins, outs, *, reps, **attrs):
    return _attention_flops(ins, outs, **attrs)


def _grouped_onnx(ctx, ins, outs, *, reps, **attrs):
    kt, v = (_repeat_nodes(ctx, t, -3, reps) for t in ins[1:])
    _attention_onnx(ctx, [ins[0], kt, v], outs, **attrs, kt_shape=ctx.shape(ins[1]),
                    v_dtype=ctx.dtype(ins[2]))


# The definition (K/V heads repeated), and the same in the [batch, seq, heads, dim] layout
# that JAX code repeats in before its einsums transpose the keys and values (an axiom: it
# also states that the repeat commutes with those two transposes).
_GQA = {"q": ("B", "r*G", "M", "K"), "kt": ("B", "G", "K", "N"), "v": ("B", "G", "N", "P")}
_GQA_HEADS = {"q": ("B", "r*G", "M", "K"), "kt": ("B", "G", "K", "N"), "v": ("B", "G", "N", "K")}
_GQA_SQUARE = {"q": ("B", "r*G", "M", "K"), "kt": ("B", "G", "K", "M"), "v": ("B", "G", "M", "K")}
_GQA_BSHD = {"q": ("B", "r*G", "M", "K"), "k": ("B", "N", "G", "K"), "v": ("B", "N", "G", "P")}
_GQA_LAWS = (
    axiom("grouped_attention(q, kt, v, reps=r, causal=c, offset=o, fill=f) = attention(q, repeat(kt, axis=-3, reps=r), repeat(v, axis=-3, reps=r), causal=c, offset=o, fill=f)",
          _GQA, derive="rtl", r=(2, 3), c=(False, True), o=(0,), f=(float("-inf"),)),
    axiom("grouped_attention(q, transpose(k, perm=(0, 2, 3, 1)), transpose(v, perm=(0, 2, 1, 3)), reps=r, causal=c, offset=o, fill=f) = attention(q, transpose(repeat(k, axis=-2, reps=r), perm=(0, 2, 3, 1)), transpose(repeat(v, axis=-2, reps=r), perm=(0, 2, 1, 3)), causal=c, offset=o, fill=f)",
          _GQA_BSHD, derive="rtl", r=(2, 4), c=(False, True), o=(0,), f=(float("-inf"),)),
    # The same two laws for causal attention already lowered to query blocks: the greedy
    # descent may lower attention before it sees the repeat (a causal GQA written with
    # jnp.repeat kept its K/V copies that way, 1.89-1.97x where the grouped form ran 2.53x).
    axiom("grouped_attention(q, kt, v, reps=r, causal=True, offset=o, fill=f, impl=i, block=b) = attention(q, repeat(kt, axis=-3, reps=r), repeat(v, axis=-3, reps=r), causal=True, offset=o, fill=f, impl=i, block=b)",
          _GQA, derive="rtl", r=(2, 3), o=(0,), f=(float("-inf"),), i=("blocked",),
          b=(128, 256)),
    axiom("grouped_attention(q, transpose(k, perm=(0, 2, 3, 1)), transpose(v, perm=(0, 2, 1, 3)), reps=r, causal=True, offset=o, fill=f, impl=i, block=b) = attention(q, transpose(repeat(k, axis=-2, reps=r), perm=(0, 2, 3, 1)), transpose(repeat(v, axis=-2, reps=r), perm=(0, 2, 1, 3)), causal=True, offset=o, fill=f, impl=i, block=b)",
          _GQA_BSHD, derive="rtl", r=(2, 4), o=(0,), f=(float("-inf"),), i=("blocked",),
          b=(128, 256)),
    # The causal grouped form lowered to query blocks, as attention's lowering law.
    axiom("grouped_attention(q, kt, v, reps=r, causal=True, offset=o, fill=f) = grouped_attention(q, kt, v, reps=r, causal=True, offset=o, fill=f, impl=i, block=b)",
          _GQA, derive="ltr", r=(2,), o=(0,), f=_F, i=("blocked",), b=(128, 256, 512)),
    # cuDNN's fused attention reads each K/V head once for its group of query heads.
    axiom("grouped_attention(q, kt, v, reps=r) = grouped_attention(q, kt, v, reps=r, impl=i)",
          _GQA_HEADS, derive="ltr", r=(2,), i=("cudnn",)),
    axiom("grouped_attention(q, kt, v, reps=r, causal=True, offset=0, fill=f) = grouped_attention(q, kt, v, reps=r, causal=True, offset=0, fill=f, impl=i)",
          _GQA_SQUARE, derive="ltr", r=(2,), f=_F, i=("cudnn",)),
)

declare(OpDef(
    name="grouped_attention", ref=_grouped, shape=_grouped_shape, arity=3,
    attrs={"reps": 1, "causal": False, "offset": 0, "fill": float("-inf"), "impl": "naive",
           "block": 128},
    to_onnx=_grouped_onnx, flops=_grouped_flops, axioms=_GQA_LAWS, runs_here=_runs_here,
    examples=(([TensorType((2, 6, 5, 4), _F32), TensorType((2, 3, 4, 7), _F32),
                TensorType((2, 3, 7, 3), _F32)], {"reps": 2}),
              ([TensorType((1, 4, 9, 4), _F32), TensorType((1, 1, 4, 9), _F32),
                TensorType((1, 1, 9, 5), _F32)], {"reps": 4, "causal": True}),
              ([TensorType((1, 4, 6, 8), _F32), TensorType((1, 2, 8, 6), _F32),
                TensorType((1, 2, 6, 8), _F32)], {"reps": 2, "causal": True, "impl": "cudnn"})),
    doc="attention(q, repeat(kt, reps, axis=-3), repeat(v, reps, axis=-3)) without the "
        "copies: reps query heads share each K/V head (grouped-query attention, Ainslie et "
        "al. 2023)"))


# ---- additive mask -------------------------------------------------------------------------
# ``masked_attention(q, kt, v, mask)`` is ``softmax(q @ kt + mask) @ v``: the attention of code
# that adds a bias or a mask of 0 and large negative values (-inf, finfo.min) to its scores
# (``jax.nn.dot_product_attention(bias=...)``, Hugging Face's extended attention masks). The
# mask broadcasts against the scores ``[..., Sq, Sk]`` without enlarging them. It has one
# lowering, the composition: a mask read at run time gives no block that could be skipped.
# A constant causal mask is a ``causal_mask`` instead (``_causal_additive`` for -inf; before a
# softmax, :func:`causal_scores` for finite fills too), for which the blocked lowering of
# ``attention`` applies; any other constant mask is read by blocks before a softmax and
# becomes ``block_masked_attention`` (ops/attention_masks.py).

def _masked(q, kt, v, mask):
    return jnp.matmul(jax.nn.softmax(jnp.matmul(q, kt) + mask, axis=-1), v)


def _masked_shape(ts):
    q, kt, v, mask = ts
    (out,) = _attention_shape([q, kt, v], causal=False, offset=0, fill=float("-inf"),
                              impl="naive", block=128)
    scores = broadcast_shape(q.shape[:-2], kt.shape[:-2]) + (q.shape[-2], kt.shape[-1])
    if mask.dtype != q.dtype or v.dtype != q.dtype or len(mask.shape) > len(scores) \
            or broadcast_shape(scores, mask.shape) != scores:
        raise ShapeError(f"masked_attention: mask {mask.shape} {mask.dtype} does not "
                         f"broadcast into the scores {scores} {q.dtype}")
    return [out]


def _masked_flops(ins, outs):
    return _attention_flops(ins[:3], outs, causal=False, impl="naive")


def _masked_onnx(ctx, ins, outs):
    s = ctx.tmp("Add", [ctx.tmp("MatMul", ins[:2]), ins[3]])
    ctx.node("MatMul", [ctx.tmp("Softmax", [s], axis=-1), ins[2]], outs)


# The definition, with a mask of the scores' full shape, is the axiom. The same law with a
# mask broadcast over the heads (``[1, 1, Sq, Sk]``, or per batch ``[B, 1, Sq, Sk]``, as JAX
# code writes ``mask[None, None]``) is the same formula to the prover, which does not see
# shapes: those, and the scaled forms, are theorems, as for attention.
_QKVM = {**_QKV, "m": ("...", "M", "N")}
_BHQKV = {"q": ("B", "H", "M", "K"), "kt": ("B", "H", "K", "N"), "v": ("B", "H", "N", "P")}
_MASK_SHAPES = (_QKVM, {**_BHQKV, "m": (1, 1, "M", "N")}, {**_BHQKV, "m": ("B", 1, "M", "N")})
_MASKED_LAWS = (
    axiom("masked_attention(q, kt, v, m) = matmul(softmax(ewadd(matmul(q, kt), m), axis=-1), v)",
          _MASK_SHAPES[0], derive="rtl"),
    axiom("masked_attention(q, kt, v, m) = matmul(softmax(ewadd(matmul(q, kt), m), axis=-1), v)",
          _MASK_SHAPES[1], derive="rtl", theorem=True),
    axiom("masked_attention(q, kt, v, m) = matmul(softmax(ewadd(matmul(q, kt), m), axis=-1), v)",
          _MASK_SHAPES[2], derive="rtl", theorem=True),
    axiom("masked_attention(scalar_mul(q, scalar=s), kt, v, m) = matmul(softmax(ewadd(scalar_mul(matmul(q, kt), scalar=s), m), axis=-1), v)",
          _MASK_SHAPES[0], derive="rtl", theorem=True, s=(0.125,)),
    axiom("masked_attention(scalar_mul(q, scalar=s), kt, v, m) = matmul(softmax(ewadd(scalar_mul(matmul(q, kt), scalar=s), m), axis=-1), v)",
          _MASK_SHAPES[1], derive="rtl", theorem=True, s=(0.125,)),
    axiom("masked_attention(scalar_mul(q, scalar=s), kt, v, m) = matmul(softmax(ewadd(scalar_mul(matmul(q, kt), scalar=s), m), axis=-1), v)",
          _MASK_SHAPES[2], derive="rtl", theorem=True, s=(0.125,)),
)

declare(OpDef(
    name="masked_attention", ref=_masked, shape=_masked_shape, arity=4,
    to_onnx=_masked_onnx, flops=_masked_flops, axioms=_MASKED_LAWS,
    composition=lambda node: _composition(node, mask=node.inputs[3]),
    examples=(([TensorType((2, 6, 4), _F32), TensorType((2, 4, 7), _F32),
                TensorType((2, 7, 3), _F32), TensorType((2, 6, 7), _F32)], {}),
              ([TensorType((1, 2, 5, 4), _F32), TensorType((1, 2, 4, 5), _F32),
                TensorType((1, 2, 5, 3), _F32), TensorType((5, 5), _F32)], {})),
    doc="softmax(q @ kt + mask) @ v over the last two axes, keys transposed, the additive "
        "mask broadcast into the scores (jax.nn.dot_product_attention with a bias; ONNX "
        "MatMul, Add, Softmax, MatMul)"))
