"""Matrix multiplication: ``[..., M, K] @ [..., K, N] -> [..., M, N]`` with batch broadcasting.

Sources: ONNX operator spec (MatMul, Gemm); TASO (Jia et al., SOSP 2019, Table 1) for the
fused activation.
"""

from __future__ import annotations

import numpy as np
from taso_jax.ops import (
    OpDef,
    ShapeError,
    TensorType,
    axiom,
    declare,
    jaxpr_importer,
    matrix_product_dims,
    onnx_importer,
)
from taso_jax.ops._lazy import LazyModule
from taso_jax.ops.conv import _ACT_ONNX, _act, check_activation
from taso_jax.ops.elementwise import broadcast_shape
from taso_jax.ops.nn import NARROW_FLOATS

jnp = LazyModule("jax.numpy")


def _matmul(a, b, *, activation):
    return _act(jnp.matmul(a, b), activation)


def _matmul_shape(ts, *, activation):
    a, b = ts
    if len(a.shape) < 2 or len(b.shape) < 2:
        raise ShapeError(f"matmul: operands need rank >= 2, got {a.shape}, {b.shape}")
    if a.shape[-1] != b.shape[-2]:
        raise ShapeError(f"matmul: contracting sizes differ in {a.shape} @ {b.shape}")
    if a.dtype != b.dtype:
        raise ShapeError(f"matmul: dtype mismatch {a.dtype} vs {b.dtype}")
    check_activation(activation)
    batch = broadcast_shape(a.shape[:-2], b.shape[:-2])
    return [TensorType(batch + (a.shape[-2], b.shape[-1]), a.dtype)]


def _matmul_onnx(ctx, ins, outs, *, activation):
    if activation == "none":
        ctx.node("MatMul", ins, outs)
    else:
        ctx.node(_ACT_ONNX[activation], [ctx.tmp("MatMul", ins)], outs)


# ---- laws (TASO, SOSP 2019, Table 2: matmul laws) ------------------------------------------
_X = {"x": ("M", "K"), "y": ("M", "K"), "a": ("K", "N"), "b": ("K", "N"), "c": ("N", "P")}
_ACTS = ("none", "relu", "sigmoid", "tanh")
_MATMUL_LAWS = (
    axiom("matmul(matmul(x, a), c) = matmul(x, matmul(a, c))", _X),
    axiom("dim(matmul(x, a, activation=f), -1) = dim(a, -1)", _X, f=("none", "relu")),
    axiom("dim(matmul(x, a, activation=f), -2) = dim(x, -2)", _X, f=("none", "relu")),
    axiom("matmul(x, ewadd(a, b)) = ewadd(matmul(x, a), matmul(x, b))", _X),
    axiom("matmul(ewadd(x, y), a) = ewadd(matmul(x, a), matmul(y, a))", _X),
    axiom("matmul(x, concat(a, b, axis=-1), activation=f) = concat(matmul(x, a, activation=f), matmul(x, b, activation=f), axis=-1)", _X, f=_ACTS),
    axiom("matmul(concat(x, y, axis=-2), a, activation=f) = concat(matmul(x, a, activation=f), matmul(y, a, activation=f), axis=-2)", _X, f=_ACTS),
    axiom("matmul(concat(x, y, axis=-1), concat(a, b, axis=-2)) = ewadd(matmul(x, a), matmul(y, b))", _X),
    axiom("matmul(x, a, activation='relu') = relu(matmul(x, a))", _X),
    axiom("matmul(x, a, activation='sigmoid') = sigmoid(matmul(x, a))", _X),
    axiom("matmul(x, a, activation='tanh') = tanh(matmul(x, a))", _X),
    axiom("matmul(scalar_mul(x, scalar=s), a) = scalar_mul(matmul(x, a), scalar=s)", _X, s=(2.0,)),
    axiom("matmul(x, scalar_mul(a, scalar=s)) = scalar_mul(matmul(x, a), scalar=s)", _X, s=(2.0,)),
    axiom("transpose(matmul(x, a), perm=(1, 0)) = matmul(transpose(a, perm=(1, 0)), transpose(x, perm=(1, 0)))", _X),
)

# Low-rank adapters merged into the weight they adapt (LoRA, Hu et al. 2021, Section 4.1:
# ``W + s * A @ B`` is computed once, ahead of time, when the weights are weights), read right
# to left as rules. Theorems: distributivity, associativity and the scalar_mul laws prove them.
_LORA = {"x": ("...", "M", "K"), "w": ("K", "N"), "a": ("K", "R"), "b": ("R", "N")}
_LORA_LAWS = (
    axiom("matmul(x, ewadd(w, matmul(a, b))) = ewadd(matmul(x, w), matmul(matmul(x, a), b))", _LORA,
          derive="rtl", theorem=True),
    axiom("matmul(x, ewadd(w, scalar_mul(matmul(a, b), scalar=s))) = ewadd(matmul(x, w), scalar_mul(matmul(matmul(x, a), b), scalar=s))",
          _LORA, derive="rtl", theorem=True, s=(0.5,)),
    axiom("matmul(x, ewadd(w, matmul(scalar_mul(a, scalar=s), b))) = ewadd(matmul(x, w), matmul(scalar_mul(matmul(x, a), scalar=s), b))",
          _LORA, derive="rtl", theorem=True, s=(0.5,)),
)


_F32 = "float32"
declare(OpDef(
    name="matmul", ref=_matmul, shape=_matmul_shape, arity=2,
    attrs={"activation": "none"}, to_onnx=_matmul_onnx,
    flops=lambda ins, outs, **_: 2.0 * outs[0].size * ins[0].shape[-1],
    examples=(([TensorType((3, 4), _F32), TensorType((4, 5), _F32)], {}),
              ([TensorType((2, 1, 3, 4), _F32), TensorType((6, 4, 5), _F32)],
               {"activation": "relu"})),
    axioms=_MATMUL_LAWS + _LORA_LAWS, dot_operands=(0, 1), channel_scale=(-1, -1),
    product_dims=lambda ins, outs, **_: matrix_product_dims(outs[0], outs[0].shape[-1],
                                                            ins[0].shape[-1]),
    doc="batched matrix product with fused activation (ONNX MatMul; TASO matmul)"))


@onnx_importer("MatMul")
def _import_matmul(ctx, ins, **_):
    if any(len(ctx.type(t).shape) < 2 for t in ins):
        return None
    return [ctx.op("matmul", ins)]


@onnx_importer("Gemm")
def _import_gemm(ctx, ins, *, alpha=1.0, beta=1.0, transA=0, transB=0):  # noqa: N803
    a, b = ins[0], ins[1]
    if transA:
        a = ctx.op("transpose", [a], perm=(1, 0))
    if transB:
        b = ctx.op("transpose", [b], perm=(1, 0))
    y = ctx.op("matmul", [a, b])
    if alpha != 1.0:
        y = ctx.op("scalar_mul", [y], scalar=float(alpha))
    if len(ins) > 2 and ins[2] is not None and beta != 0.0:
        c = ins[2] if beta == 1.0 else ctx.op("scalar_mul", [ins[2]], scalar=float(beta))
        y = ctx.op("ewadd", [y, c])
    return [y]


# ---- jaxpr primitives ---------------------------------------------------------------------

def _split_free(shape, free):
    """The free axes of one operand of a batched product: (broadcast axes, matrix axis).

    With two or more free axes longer than 1, the longest (the last of equals) is the matmul's
    row or column axis and the others become broadcast batch axes: grouped-query attention's
    ``einsum("BTKGH,BSKH->BKTGS")`` is then a product per query group against the one K/V
    head, rows the queries, which is what attention's laws state (folding the group into the
    rows, ``[B, K, T*G, S]``, hides them). Otherwise ``None``: the free axes fold into one.
    """
    long = [a for a in free if shape[a] != 1]
    if len(long) < 2:
        return None
    m = max(reversed(long), key=lambda a: shape[a])
    return [a for a in free if a != m], m


def _product(ctx, a, b, wide: str | None):
    """``matmul(a, b)``, or with ``wide`` (``"float32"``) ``matmul(widen(a), widen(b))``."""
    if wide is not None:
        a, b = (ctx.op("widen", [t], to=wide) for t in (a, b))
    return ctx.op("matmul", [a, b])


def _dot(ctx, lhs, rhs, lc, rc, lb, rb, wide: str | None = None):
    """``lhs`` against ``rhs`` as one batched ``matmul``: shape (batch, lhs free, rhs free).

    ``wide``: the products accumulate in this type (``preferred_element_type``), the
    operands cast to it right before the ``matmul``, after the moves that lay them out.
    """
    ls, rs = ctx.type(lhs).shape, ctx.type(rhs).shape
    lf = [i for i in range(len(ls)) if i not in (*lc, *lb)]
    rf = [i for i in range(len(rs)) if i not in (*rc, *rb)]
    k = int(np.prod([ls[i] for i in lc], dtype=np.int64))
    shape = (*(ls[i] for i in lb), *(ls[i] for i in lf), *(rs[i] for i in rf))
    lsplit, rsplit = (_split_free(ls, lf), _split_free(rs, rf)) if lb else (None, None)
    if lsplit is None and rsplit is None:
        n = int(np.prod([rs[i] for i in rf], dtype=np.int64))
        b = ctx.reshape(ctx.transpose(rhs, (*rb, *rc, *rf)), (*(rs[i] for i in rb), k, n))
        if not lb:  # [..., M, K] @ [K, N]: the free dimensions of the left operand stay
            lead = tuple(ls[i] for i in lf) or (1,)
            a = ctx.reshape(ctx.transpose(lhs, (*lf, *lc)), (*lead, k))
        else:
            m = int(np.prod([ls[i] for i in lf], dtype=np.int64))
            a = ctx.reshape(ctx.transpose(lhs, (*lb, *lf, *lc)), (*(ls[i] for i in lb), m, k))
        return ctx.reshape(_product(ctx, a, b, wide), shape), len(lb), len(lf), len(rf)
    # Free axes kept apart as broadcast batch axes: a [*batch, *El, 1.., M, K] against
    # b [*batch, 1.., *Er, K, N]. Positions in the product: batch, El, Er, M, N; a side that is
    # not split has no broadcast axes and one folded M (or N).
    batch = [ls[i] for i in lb]
    el, mi = lsplit if lsplit else ([], None)
    er, ni = rsplit if rsplit else ([], None)
    m = ls[mi] if lsplit else int(np.prod([ls[i] for i in lf], dtype=np.int64))
    n = rs[ni] if rsplit else int(np.prod([rs[i] for i in rf], dtype=np.int64))
    lorder = (*el, mi) if lsplit else tuple(lf)
    rorder = (*er, ni) if rsplit else tuple(rf)
    a = ctx.reshape(ctx.transpose(lhs, (*lb, *lorder, *lc)),
                    (*batch, *(ls[i] for i in el), *(1,) * len(er), m, k))
    b = ctx.reshape(ctx.transpose(rhs, (*rb, *er, *rc, *rorder[len(er):])),
                    (*batch, *(1,) * len(el), *(rs[i] for i in er), k, n))
    y = _product(ctx, a, b, wide)
    nb, ne = len(lb), len(el) + len(er)
    # Product axes: batch, El, Er, M, N -> batch, lhs free in order, rhs free in order.
    pos = {("l", x): nb + i for i, x in enumerate(el)}
    pos.update({("r", x): nb + len(el) + i for i, x in enumerate(er)})
    if lsplit:
        pos[("l", mi)] = nb + ne
    if rsplit:
        pos[("r", ni)] = nb + ne + 1
    lpart = [pos[("l", x)] for x in lf] if lsplit else [nb + ne]
    rpart = [pos[("r", x)] for x in rf] if rsplit else [nb + ne + 1]
    y = ctx.transpose(y, (*range(nb), *lpart, *rpart))
    return ctx.reshape(y, shape), len(lb), len(lf), len(rf)


@jaxpr_importer("dot_general")
def _import_dot_general(ctx, ins, *, dimension_numbers, preferred_element_type=None, **_):
    """dot_general as transposes and reshapes around one batched ``matmul``.

    Output layout of dot_general: batch dimensions, then the free dimensions of the left
    operand, then those of the right (jax.lax.dot_general). Where the right operand is laid
    out as a matmul's left one (batch, free, contracting) and the left is not, the product
    is taken the other way round and transposed: ``einsum("bkhd,bhqk->bhdq", v, p)`` becomes
    ``p @ v`` transposed, the form in which attention's laws see it. The right operand
    counts as laid out when only its axes of size 1 are out of place.

    Operands of a 16-bit float type accumulated in float32 (``preferred_element_type``, as
    ``jax.nn.dot_product_attention`` and flax take attention scores in bfloat16) become
    ``matmul(widen(a, float32), widen(b, float32))``: each product of two such values is
    exact in float32, so this is the same arithmetic, and XLA folds the widening casts into
    the product's operands (its convert-operand folding). Other mixed types stay opaque.
    """
    lhs, rhs = ins
    from taso_jax.ops.experts import experts_idiom

    experts = experts_idiom(ctx, lhs, rhs, dimension_numbers)
    if experts is not None:
        return [experts]
    (lc, rc), (lb, rb) = dimension_numbers
    out = ctx.out_types[0]
    wide = None
    if ctx.type(lhs).dtype != ctx.type(rhs).dtype or ctx.type(lhs).dtype != out.dtype:
        if ctx.type(lhs).dtype != ctx.type(rhs).dtype or out.dtype != "float32" \
                or ctx.type(lhs).dtype not in NARROW_FLOATS:
            return None  # mixed precision
        wide = "float32"
    ls, rs = ctx.type(lhs).shape, ctx.type(rhs).shape
    lf = [i for i in range(len(ls)) if i not in (*lc, *lb)]
    rf = [i for i in range(len(rs)) if i not in (*rc, *rb)]
    left_laid_out = [*lb, *lf, *lc] == list(range(len(ls)))
    # Unit axes do not count: jax.nn.dot_product_attention's probabilities carry a group axis
    # of size 1 ahead of the batch axes, and moving it moves no element.
    moved = [a for a in (*rb, *rf, *rc) if rs[a] != 1]
    right_laid_out_as_left = moved == sorted(moved)
    # Or the right operand's contracting axes are its last while the left's are not (the
    # probabilities of grouped-query attention, [G, B, K, T, S], against v^T): p @ v again.
    if not right_laid_out_as_left and lb and _split_free(rs, rf):
        right_laid_out_as_left = (list(rc) == list(range(len(rs) - len(rc), len(rs)))
                                  and list(lc) != list(range(len(ls) - len(lc), len(ls))))
    if left_laid_out or not right_laid_out_as_left or not lf or not rf:
        return [ctx.reshape(_dot(ctx, lhs, rhs, lc, rc, lb, rb, wide)[0], out.shape)]
    y, nb, nr, nl = _dot(ctx, rhs, lhs, rc, lc, rb, lb, wide)  # (batch, rhs free, lhs free)
    perm = (*range(nb), *range(nb + nr, nb + nr + nl), *range(nb, nb + nr))
    return [ctx.reshape(ctx.transpose(y, perm), out.shape)]
