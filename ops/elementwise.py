"""Elementwise operators with NumPy broadcasting (ONNX multidirectional broadcasting).

Sources: ONNX operator spec (Add, Sub, Mul, Div, Mod, Pow, Relu, Sigmoid, Tanh, Gelu, Erf,
Sqrt, Exp, Sign, Clip, Max, Min, Where, IsNaN, And, Not, Equal, Cast, Identity, LeakyRelu, HardSigmoid,
HardSwish); TASO (Jia et al.,
SOSP 2019, Table 1) for ``ewadd``, ``ewmul``, ``scalar_mul`` and fused activations.
"""

from __future__ import annotations

from functools import partial

import numpy as np
from taso_jax.ops import (
    OpDef,
    ShapeError,
    TensorType,
    axiom,
    declare,
    is_float_dtype,
    onnx_importer,
)
from taso_jax.ops._lazy import LazyModule, deferred
from taso_jax.ops.dims import is_open, open_dims

jax = LazyModule("jax")

jnp = LazyModule("jax.numpy")
_jnp = partial(deferred, "jax.numpy")
_jnn = partial(deferred, "jax.nn")
_lax = partial(deferred, "jax.lax")


def broadcast_shape(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    """NumPy broadcast of shapes. Raises :class:`ShapeError` when they do not broadcast."""
    try:
        out = tuple(np.broadcast_shapes(*shapes))
    except ValueError as e:
        raise ShapeError(f"shapes {list(shapes)} do not broadcast") from e
    if not any(open_dims(s) for s in shapes):
        return out
    # An open size (taso_jax.ops.dims.Dim) is kept where an input has it: the first input's
    # size at that axis that is not 1, else the first one (right-aligned, as NumPy).
    kept = list(out)
    for k in range(1, len(out) + 1):
        sizes = [s[-k] for s in shapes if len(s) >= k]
        pick = next((d for d in sizes if is_open(d) and int(d) != 1), None)
        pick = pick if pick is not None else next((d for d in sizes if is_open(d)), None)
        if pick is not None and int(pick) == out[-k]:
            kept[-k] = pick
    return tuple(kept)


def _binary_shape(ts, **_):
    a, b = ts
    if a.dtype != b.dtype:
        raise ShapeError(f"dtype mismatch {a.dtype} vs {b.dtype}")
    return [TensorType(broadcast_shape(a.shape, b.shape), a.dtype)]


def _same_shape(ts, **_):
    return [ts[0]]


def _emit(onnx_type):
    def to_onnx(ctx, ins, outs, **_):
        ctx.node(onnx_type, ins, outs)
    return to_onnx


_F32 = "float32"
_EX2 = ((((2, 3, 4), _F32), ((3, 1), _F32)), {})
_EX1 = ((((2, 3, 4), _F32),), {})


# ---- laws (TASO, SOSP 2019, Table 2: the elementwise laws) ---------------------------------
_V = {"x": ("N", "C"), "y": ("N", "C"), "z": ("N", "C")}
_S = {**_V, "s": (1, "C")}
_SAME_SIZES = {"where": ("dim(x, k) == dim(y, k)",), "k": (-1, -2)}  # without broadcasting

_EWADD_LAWS = (
    axiom("ewadd(x, y) = ewadd(y, x)", _V),
    axiom("ewadd(x, ewadd(y, z)) = ewadd(ewadd(x, y), z)", _V),
    axiom("dim(ewadd(x, y), k) = dim(x, k)", _V, **_SAME_SIZES),
)
_EWSUB_LAWS = (axiom("ewsub(x, y) = ewadd(x, neg(y))", _V),)
_EWMUL_LAWS = (
    axiom("ewmul(x, y) = ewmul(y, x)", _V),
    axiom("ewmul(x, ewmul(y, z)) = ewmul(ewmul(x, y), z)", _V),
    axiom("ewmul(ewadd(x, y), z) = ewadd(ewmul(x, z), ewmul(y, z))", _V),
    axiom("ewmul(ewadd(x, y), s) = ewadd(ewmul(x, s), ewmul(y, s))", _S),
    axiom("dim(ewmul(x, y), k) = dim(x, k)", _V, **_SAME_SIZES),
)
_RELU_LAWS = (
    axiom("relu(relu(x)) = relu(x)", _V),
    axiom("relu(ewadd(x, x)) = ewadd(relu(x), relu(x))", _V),  # positive homogeneity
    axiom("dim(relu(x), k) = dim(x, k)", _V, k=(-1, -2)),
)
_NEG_LAWS = (axiom("neg(neg(x)) = x", _V),)
_SCALAR_MUL_LAWS = (
    axiom("scalar_mul(ewadd(x, y), scalar=c) = ewadd(scalar_mul(x, scalar=c), scalar_mul(y, scalar=c))", _V, c=(2.0, -0.5)),
    axiom("scalar_mul(ewmul(x, y), scalar=c) = ewmul(scalar_mul(x, scalar=c), y)", _V, c=(2.0, -0.5)),
)


def _binary(name, fn, onnx_type, doc, commutative=False, laws=(), numpy_ref=None,
            to_onnx=None):
    declare(OpDef(name=name, ref=fn, shape=_binary_shape, arity=2,
                  to_onnx=to_onnx or _emit(onnx_type), commutative=commutative,
                  fusible=True, layout="elementwise",
                  examples=(([TensorType(*t) for t in _EX2[0]], {}),), axioms=laws, doc=doc,
                  numpy_ref=numpy_ref))
    if to_onnx is None:
        onnx_importer(onnx_type)(_onnx_binary(name))


def _onnx_binary(name):
    def _import(ctx, ins, **_):
        if name in ("ewmul", "ewdiv"):  # a norm written out (torch's LayerNorm export)
            from taso_jax.ops.norm import norm_idiom

            norm = norm_idiom(ctx, *ins, divide=name == "ewdiv")
            if norm is not None:
                return [norm]
        return [ctx.op(name, ins)]
    return _import


_binary("ewadd", _jnp("add"), "Add", "a + b, broadcasting (ONNX Add; TASO ewadd)", True,
        _EWADD_LAWS, numpy_ref=np.add)
_binary("ewsub", _jnp("subtract"), "Sub", "a - b, broadcasting (ONNX Sub)", laws=_EWSUB_LAWS,
        numpy_ref=np.subtract)
_binary("ewmul", _jnp("multiply"), "Mul", "a * b, broadcasting (ONNX Mul; TASO ewmul)", True,
        _EWMUL_LAWS, numpy_ref=np.multiply)
def _ewdiv(a, b):
    # ONNX Div and lax.div on integers truncate toward zero; jnp.divide would give floats
    if jnp.issubdtype(jnp.result_type(a, b), jnp.integer):
        return jax.lax.div(*jnp.broadcast_arrays(a, b))
    return jnp.divide(a, b)


_binary("ewdiv", _ewdiv, "Div", "a / b, broadcasting; integers truncate toward zero (ONNX Div)")


def _rem(a, b):
    # C's remainder (lax.rem, ONNX Mod with fmod=1): the result has the dividend's sign, for
    # integers and floats alike; jnp.remainder (Python's %) takes the divisor's instead
    return jax.lax.rem(*jnp.broadcast_arrays(a, b))


_binary("rem", _rem, "Mod", "a - b * trunc(a / b), broadcasting: the remainder of ewdiv, with "
        "the sign of a (ONNX Mod with fmod=1, jax.lax.rem, C fmod)",
        to_onnx=lambda ctx, ins, outs, **_: ctx.node("Mod", ins, outs, fmod=1))


@onnx_importer("Mod")
def _import_mod(ctx, ins, fmod=0, **_):
    # fmod=0 (integers only) is the floored modulus, the divisor's sign: kept opaque
    return [ctx.op("rem", ins)] if fmod else None


_binary("pow", _jnp("power"), "Pow", "a ** b, broadcasting (ONNX Pow)")


_binary("ewmax", _jnp("maximum"), "Max", "the larger of a and b, broadcasting; NaN where either "
        "is NaN (ONNX Max of two inputs; jax.lax.max)", True, numpy_ref=np.maximum,
        to_onnx=_emit("Max"))
_binary("ewmin", _jnp("minimum"), "Min", "the smaller of a and b, broadcasting; NaN where "
        "either is NaN (ONNX Min of two inputs; jax.lax.min)", True, numpy_ref=np.minimum,
        to_onnx=_emit("Min"))


def _scalar_const(ctx, t):
    """The value of a constant tensor whose entries are all equal, else ``None``.

    Reshapes and expands keep the set of values, so it is read before them: a fill value
    broadcast to a score matrix is not materialized.
    """
    while t.node.op in ("expand", "reshape"):
        t = t.node.inputs[0]
    v = ctx.const(t)
    if v is None:
        return None
    v = np.asarray(v).reshape(-1)
    return float(v[0]) if v.size and np.all(v == v[0]) else None


def _max_min_with_scalar(ctx, ins, take_max):
    """A relu or clip computing ``max``/``min`` of ``ins`` (two tensors), or ``None``.

    ``max(x, 0)`` is relu, ``max(x, c)`` and ``min(x, c)`` with a constant scalar ``c`` (a
    constant broadcast to ``x``'s shape counts) are clips. The output must have ``x``'s
    shape: a clip does not broadcast.
    """
    for x, c in ((ins[0], ins[1]), (ins[1], ins[0])):
        v = _scalar_const(ctx, c)
        if v is None or ctx.type(x).shape != ctx.out_types[0].shape:
            continue
        if ctx.type(x).dtype != ctx.type(c).dtype:
            continue
        if take_max:
            return ctx.op("relu", [x]) if v == 0.0 else ctx.op("clip", [x], min=v)
        return ctx.op("clip", [x], max=v)
    return None


@onnx_importer("Max", "Min")
def _import_max_min_onnx(ctx, ins, **_):
    # ONNX Max/Min take 1 to many inputs with multidirectional broadcasting (opset 8 on);
    # a pair with a constant scalar is a relu or a clip, anything else a chain of ewmax/ewmin
    take_max = ctx.source_op == "Max"
    if len(ins) == 1:
        return [ins[0]]
    if len(ins) == 2:
        clip = _max_min_with_scalar(ctx, ins, take_max)
        if clip is not None:
            return [clip]
    acc = ins[0]
    for t in ins[1:]:
        acc = ctx.op("ewmax" if take_max else "ewmin", [acc, t])
    return [acc]


@onnx_importer("Sum")
def _import_sum(ctx, ins, **_):
    acc = ins[0]
    for t in ins[1:]:
        acc = ctx.op("ewadd", [acc, t])
    return [acc]


def _unary(name, fn, onnx_type, doc, laws=(), to_onnx=None, numpy_ref=None):
    declare(OpDef(name=name, ref=fn, shape=_same_shape, arity=1,
                  to_onnx=to_onnx or _emit(onnx_type), fusible=True, layout="elementwise",
                  examples=(([TensorType(*_EX1[0][0])], {}),), axioms=laws, doc=doc,
                  numpy_ref=numpy_ref))
    if onnx_type:
        onnx_importer(onnx_type)(lambda ctx, ins, **_: [ctx.op(name, ins)])


def _erfc_onnx(ctx, ins, outs, **_):
    # ONNX has no Erfc: 1 - Erf(x) (it loses erfc's relative accuracy where erf(x) is
    # within float rounding of 1, |x| > ~4, where erfc(x) < 2e-8)
    one = ctx.scalar(1, ctx.dtype(ins[0]))
    ctx.node("Sub", [one, ctx.tmp("Erf", ins)], outs)


_unary("relu", _jnn("relu"), "Relu", "max(x, 0) (ONNX Relu)", _RELU_LAWS)
_unary("sigmoid", _jnn("sigmoid"), "Sigmoid", "1 / (1 + exp(-x)) (ONNX Sigmoid)")
_unary("tanh", _jnp("tanh"), "Tanh", "tanh(x) (ONNX Tanh)")
_unary("erf", _lax("erf"), "Erf", "error function (ONNX Erf)")
def _sqrt_numpy(x):
    # IEEE square root is correctly rounded in NumPy and XLA alike; an integer goes to
    # float32 first, as jnp.sqrt promotes it (64-bit types off), not to NumPy's float64
    x = np.asarray(x)
    with np.errstate(invalid="ignore"):  # NaN below 0, as XLA gives, without a warning
        return np.sqrt(x if x.dtype.kind == "f" else x.astype(np.float32))


_unary("sqrt", _jnp("sqrt"), "Sqrt", "square root (ONNX Sqrt)", numpy_ref=_sqrt_numpy)
_unary("exp", _jnp("exp"), "Exp", "exponential (ONNX Exp)")
_unary("neg", _jnp("negative"), "Neg", "-x (ONNX Neg)", _NEG_LAWS)
_unary("sin", _jnp("sin"), "Sin", "sine (ONNX Sin)")
_unary("cos", _jnp("cos"), "Cos", "cosine (ONNX Cos)")
_unary("log", _jnp("log"), "Log", "natural logarithm (ONNX Log)")
_unary("abs", _jnp("abs"), "Abs", "absolute value (ONNX Abs)")
_unary("sign", _jnp("sign"), "Sign", "-1, 0 or 1 by the sign of x (ONNX Sign)")
_unary("erfc", _lax("erfc"), None, "complementary error function 1 - erf(x) (jax.lax.erfc; "
       "written to ONNX as 1 - Erf)", to_onnx=_erfc_onnx)


# ---- piecewise-linear activations (ONNX LeakyRelu, HardSigmoid, HardSwish) ---------------
# Each passes through concat and transpose like relu (it acts on every element alone), which
# is what lets the generator merge branches around it; leaky_relu is also positively
# homogeneous (f(2x) = 2 f(x)), hard_sigmoid and hard_swish are not (they saturate).

def _leaky_relu(x, *, alpha=0.01):
    return jnp.where(x >= 0, x, x * jnp.asarray(alpha, x.dtype))


def _hard_sigmoid(x, *, alpha=0.2, beta=0.5):
    y = x * jnp.asarray(alpha, x.dtype) + jnp.asarray(beta, x.dtype)
    return jnp.clip(y, jnp.asarray(0, x.dtype), jnp.asarray(1, x.dtype))


def _hard_swish(x):
    # ONNX HardSwish is x * HardSigmoid(x) with alpha = 1/6, beta = 0.5 (onnxruntime multiplies
    # by the float 1/6, which rounds differently from dividing by 6)
    return x * _hard_sigmoid(x, alpha=1.0 / 6.0, beta=0.5)


_LEAKY_RELU_LAWS = (
    axiom("leaky_relu(ewadd(x, x), alpha=a) = ewadd(leaky_relu(x, alpha=a), leaky_relu(x, alpha=a))", _V, a=(0.01, 0.2)),
    axiom("relu(leaky_relu(x, alpha=a)) = relu(x)", _V, a=(0.01, 0.2)),
    axiom("dim(leaky_relu(x, alpha=a), k) = dim(x, k)", _V, a=(0.2,), k=(-1, -2)),
    axiom("leaky_relu(concat(x, y, axis=k), alpha=a) = concat(leaky_relu(x, alpha=a), leaky_relu(y, alpha=a), axis=k)", _V, a=(0.01, 0.2), k=(-2, -1)),
    axiom("leaky_relu(transpose(x, perm=q), alpha=a) = transpose(leaky_relu(x, alpha=a), perm=q)", _V, a=(0.2,), q=((1, 0), (0, 1))),
)
_HARD_SIGMOID_LAWS = (
    axiom("dim(hard_sigmoid(x, alpha=a, beta=b), k) = dim(x, k)", _V, a=(0.2,), b=(0.5,), k=(-1, -2)),
    axiom("hard_sigmoid(concat(x, y, axis=k), alpha=a, beta=b) = concat(hard_sigmoid(x, alpha=a, beta=b), hard_sigmoid(y, alpha=a, beta=b), axis=k)", _V, a=(0.2, 1 / 6), b=(0.5,), k=(-2, -1)),
    axiom("hard_sigmoid(transpose(x, perm=q), alpha=a, beta=b) = transpose(hard_sigmoid(x, alpha=a, beta=b), perm=q)", _V, a=(0.2,), b=(0.5,), q=((1, 0), (0, 1))),
)
_HARD_SWISH_LAWS = (
    axiom("dim(hard_swish(x), k) = dim(x, k)", _V, k=(-1, -2)),
    axiom("hard_swish(concat(x, y, axis=k)) = concat(hard_swish(x), hard_swish(y), axis=k)", _V, k=(-2, -1)),
    axiom("hard_swish(transpose(x, perm=q)) = transpose(hard_swish(x), perm=q)", _V, q=((1, 0), (0, 1))),
)


def _activation(name, fn, onnx_type, attrs, examples, laws, doc):
    declare(OpDef(name=name, ref=fn, shape=_same_shape, arity=1, attrs=attrs,
                  to_onnx=lambda ctx, ins, outs, **a: ctx.node(onnx_type, ins, outs, **a),
                  fusible=True, layout="elementwise",
                  examples=tuple(([TensorType((2, 3, 4), _F32)], e) for e in examples),
                  axioms=laws, doc=doc))


_activation("leaky_relu", _leaky_relu, "LeakyRelu", {"alpha": 0.01},
            ({}, {"alpha": 0.2}), _LEAKY_RELU_LAWS,
            "x if x >= 0 else alpha * x (ONNX LeakyRelu; jax.nn.leaky_relu)")
_activation("hard_sigmoid", _hard_sigmoid, "HardSigmoid", {"alpha": 0.2, "beta": 0.5},
            ({}, {"alpha": 1 / 6, "beta": 0.5}), _HARD_SIGMOID_LAWS,
            "max(0, min(1, alpha * x + beta)) (ONNX HardSigmoid)")
_activation("hard_swish", _hard_swish, "HardSwish", {}, ({},), _HARD_SWISH_LAWS,
            "x * max(0, min(1, x / 6 + 1 / 2)) (ONNX HardSwish; MobileNetV3's h-swish)")


@onnx_importer("LeakyRelu", "HardSigmoid")
def _import_leaky_hard_sigmoid(ctx, ins, alpha=None, beta=None):
    # ONNX stores the attributes as float32; the float64 of that value is kept, so the
    # export writes back the same float32 and the reference multiplies by it in x's dtype
    if ctx.source_op == "LeakyRelu":
        return [ctx.op("leaky_relu", ins, alpha=0.01 if alpha is None else float(alpha))]
    return [ctx.op("hard_sigmoid", ins, alpha=0.2 if alpha is None else float(alpha),
                   beta=0.5 if beta is None else float(beta))]


onnx_importer("HardSwish")(lambda ctx, ins, **_: [ctx.op("hard_swish", ins)])


def _gelu(x, *, approximate="none"):
    return jax.nn.gelu(x, approximate=(approximate == "tanh"))


def _gelu_onnx(ctx, ins, outs, *, approximate):
    if ctx.opset >= 20:
        ctx.node("Gelu", ins, outs, approximate=approximate)
        return
    x = ins[0]
    if approximate == "tanh":  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        x3 = ctx.tmp("Mul", [x, ctx.tmp("Mul", [x, x])])
        inner = ctx.tmp("Add", [x, ctx.tmp("Mul", [x3, ctx.scalar(0.044715, ctx.dtype(x))])])
        t = ctx.tmp("Tanh", [ctx.tmp("Mul", [inner, ctx.scalar(np.sqrt(2 / np.pi), ctx.dtype(x))])])
    else:  # 0.5 x (1 + erf(x / sqrt(2)))
        t = ctx.tmp("Erf", [ctx.tmp("Mul", [x, ctx.scalar(1 / np.sqrt(2), ctx.dtype(x))])])
    one_plus = ctx.tmp("Add", [t, ctx.scalar(1.0, ctx.dtype(x))])
    half_x = ctx.tmp("Mul", [x, ctx.scalar(0.5, ctx.dtype(x))])
    ctx.node("Mul", [half_x, one_plus], outs)


declare(OpDef(name="gelu", ref=_gelu, shape=_same_shape, arity=1,
              attrs={"approximate": "none"}, to_onnx=_gelu_onnx,
              layout="elementwise",
              examples=(([TensorType((2, 5), _F32)], {}),
                        ([TensorType((2, 5), _F32)], {"approximate": "tanh"})),
              doc="Gaussian error linear unit (ONNX Gelu, opset 20)"))


@onnx_importer("Gelu")
def _import_gelu(ctx, ins, approximate="none", **_):
    return [ctx.op("gelu", ins, approximate=approximate)]


def _scalar_mul(x, *, scalar=1.0):
    return x * jnp.asarray(scalar, x.dtype)


declare(OpDef(
    name="scalar_mul", ref=_scalar_mul, shape=_same_shape, arity=1,
    attrs={"scalar": 1.0}, fusible=True,
    layout="elementwise",
    to_onnx=lambda ctx, ins, outs, *, scalar: ctx.node(
        "Mul", [ins[0], ctx.scalar(scalar, ctx.dtype(ins[0]))], outs),
    examples=(([TensorType((2, 3), _F32)], {"scalar": 2.5}),), axioms=_SCALAR_MUL_LAWS,
    doc="x * c for a constant scalar attribute c (TASO scalar mul)"))


def _clip(x, *, min=None, max=None):  # noqa: A002 - ONNX attribute names
    if min is not None:
        x = jnp.maximum(x, jnp.asarray(min, x.dtype))
    if max is not None:
        x = jnp.minimum(x, jnp.asarray(max, x.dtype))
    return x


def _clip_onnx(ctx, ins, outs, *, min, max):  # noqa: A002
    dt = ctx.dtype(ins[0])
    lo = ctx.scalar(min, dt) if min is not None else ""
    hi = ctx.scalar(max, dt) if max is not None else ""
    ctx.node("Clip", [ins[0], lo, hi] if max is not None else [ins[0], lo], outs)


declare(OpDef(name="clip", ref=_clip, shape=_same_shape, arity=1,
              attrs={"min": None, "max": None}, fusible=True,
              to_onnx=_clip_onnx, layout="elementwise",
              examples=(([TensorType((2, 3), _F32)], {"min": 0.0, "max": 6.0}),),
              doc="min(max(x, min), max) (ONNX Clip; ReLU6 is clip(0, 6))"))


@onnx_importer("Clip")
def _import_clip(ctx, ins, min=None, max=None, **_):  # noqa: A002
    # Opset < 11 carries min/max as attributes, later opsets as optional constant inputs.
    bounds = [min, max]
    for i, t in enumerate(ins[1:3]):
        if t is None:
            continue
        v = ctx.const(t)
        if v is None:
            return None  # runtime bounds: keep the node opaque
        bounds[i] = float(np.asarray(v).reshape(()))
    return [ctx.op("clip", [ins[0]], min=bounds[0], max=bounds[1])]


def _where(c, a, b):
    return jnp.where(c, a, b)


def _where_shape(ts, **_):
    c, a, b = ts
    if c.dtype != "bool":
        raise ShapeError(f"where: condition must be bool, got {c.dtype}")
    if a.dtype != b.dtype:
        raise ShapeError(f"where: dtype mismatch {a.dtype} vs {b.dtype}")
    return [TensorType(broadcast_shape(c.shape, a.shape, b.shape), a.dtype)]


declare(OpDef(name="where", copies_values=True, ref=_where, shape=_where_shape, arity=3,
              to_onnx=_emit("Where"), layout="elementwise", numpy_ref=np.where,
              examples=(([TensorType((2, 3), "bool"), TensorType((2, 3), _F32),
                          TensorType((1, 3), _F32)], {}),),
              doc="elementwise select c ? a : b (ONNX Where)"))
onnx_importer("Where")(lambda ctx, ins, **_: [ctx.op("where", ins)])


def _pred_shape(ts, **_):
    return [TensorType(broadcast_shape(*(t.shape for t in ts)), "bool")]


def _predicate(name, fn, onnx_type, arity, in_dtype, doc, numpy_ref):
    ex = [TensorType((2, 3), in_dtype)] * arity
    declare(OpDef(name=name, ref=fn, shape=_pred_shape, arity=arity,
                  to_onnx=_emit(onnx_type), layout="elementwise",
                  examples=((ex, {}),), doc=doc, numpy_ref=numpy_ref))
    onnx_importer(onnx_type)(lambda ctx, ins, **_: [ctx.op(name, ins)])


# Their NumPy forms are exact (a comparison or a logical operation rounds nothing): a mask
# built from iota and comparisons folds at import without compiling an XLA executable per
# operator and shape (0.5-1.9 s of a decorator's first call, first in a process).
_predicate("isnan", _jnp("isnan"), "IsNaN", 1, _F32, "x != x (ONNX IsNaN)", np.isnan)
_predicate("logical_and", _jnp("logical_and"), "And", 2, "bool", "a and b (ONNX And)",
           np.logical_and)
_predicate("logical_not", _jnp("logical_not"), "Not", 1, "bool", "not a (ONNX Not)",
           np.logical_not)
_predicate("equal", _jnp("equal"), "Equal", 2, _F32, "a == b (ONNX Equal)", np.equal)
_predicate("less", _jnp("less"), "Less", 2, _F32, "a < b (ONNX Less)", np.less)


def _cast(x, *, to="float32"):
    return x.astype(to)


def _cast_numpy(x, *, to="float32"):
    """``_cast`` in NumPy, where NumPy converts as XLA does.

    That is between booleans, integers and IEEE floats, except floats to integers (their
    out-of-range and NaN values differ); those and bfloat16/float8 go through the JAX
    reference.
    """
    x = np.asarray(x)
    try:
        dst = np.dtype(to)
    except TypeError:
        dst = None
    if dst is None or dst.kind not in "biuf" or x.dtype.kind not in "biuf" or (
            x.dtype.kind == "f" and dst.kind in "biu"):
        return np.asarray(_cast(jnp.asarray(x), to=to))
    return x.astype(dst)


def _cast_onnx(ctx, ins, outs, *, to):
    from onnx import helper

    ctx.node("Cast", ins, outs, to=helper.np_dtype_to_tensor_dtype(np.dtype(to)))


declare(OpDef(name="cast", ref=_cast,
              shape=lambda ts, *, to: [TensorType(ts[0].shape, to)], arity=1,
              
              attrs={"to": "float32"}, to_onnx=_cast_onnx, layout="elementwise",
              numpy_ref=_cast_numpy,
              examples=(([TensorType((2, 3), "int64")], {"to": "float32"}),
                        ([TensorType((2, 3), "float32")], {"to": "int32"}),
                        ([TensorType((2, 3), "bool")], {"to": "float16"})),
              doc="convert element type (ONNX Cast)"))


def exact_widening(src, dst) -> bool:
    """Whether every value of float type ``src`` is a value of float type ``dst``.

    As many significand bits or more and an exponent range as wide or wider (bfloat16 and
    float16 into float32 or float64, float32 into float64, any type into itself); not
    bfloat16 into float16 nor float16 into bfloat16.
    """
    import ml_dtypes

    if not (is_float_dtype(src) and is_float_dtype(dst)):
        return False
    a, b = ml_dtypes.finfo(np.dtype(src)), ml_dtypes.finfo(np.dtype(dst))
    return b.nmant >= a.nmant and b.maxexp >= a.maxexp and b.minexp <= a.minexp


def _widen_shape(ts, *, to):
    (x,) = ts
    if not exact_widening(x.dtype, to):
        raise ShapeError(f"widen: {x.dtype} values are not all {to} values")
    return [TensorType(x.shape, to)]


# A cast between float types that changes no value: bfloat16 scores widened to float32 for
# their softmax (equinox, flax's force_fp32_for_softmax). Unlike ``cast``, it is the identity
# on values, so a law may pass through it; its shape rule refuses any narrowing.
declare(OpDef(name="widen", ref=_cast, shape=_widen_shape, arity=1,
              attrs={"to": "float32"}, to_onnx=_cast_onnx, layout="elementwise",
              numpy_ref=_cast_numpy, copies_values=True,
              examples=(([TensorType((2, 3), "float16")], {"to": "float32"}),
                        ([TensorType((2, 3), "float32")], {"to": "float64"})),
              doc="convert a float type to one that holds its every value (an exact ONNX "
                  "Cast)"))


@onnx_importer("Cast", same_meaning={24: "adds round_mode, which applies to casts to "
                                         "float8e8m0 only"})
def _import_cast(ctx, ins, to, **_):
    from onnx import helper

    return [ctx.op("cast", ins, to=str(helper.tensor_dtype_to_np_dtype(to)))]


@onnx_importer("Identity", "Dropout")
def _import_identity(ctx, ins, training_mode=None, **_):
    # Inference-mode Dropout is the identity, and its optional mask output is all true.
    if len(ins) > 2 and ins[2] is not None:
        mode = ctx.const(ins[2])
        if mode is None or bool(np.asarray(mode)):
            return None
    outs = [ins[0]]
    if len(ctx.out_types) > 1:
        outs.append(ctx.weight(np.ones(ctx.out_types[1].shape, bool), "dropout_mask"))
    return outs
