"""Layout and indexing operators: concat, split, transpose, reshape, slice, pad, gather, expand.

Sources: ONNX operator spec (Concat, Split, Transpose, Reshape, Flatten, Squeeze, Unsqueeze,
Slice, Pad, Gather, Expand); TASO (Jia et al., SOSP 2019, Table 1) for concat and split.
Axes are stored negative (``axis - rank``) so that substitutions written for one rank match
tensors with extra leading dimensions.
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
    onnx_importer,
)
from taso_jax.ops._lazy import LazyModule
from taso_jax.ops.dims import is_open, open_dims, same_size
from taso_jax.ops.tensor_sizes import (
    carried_sizes,
    from_end,
    open_bounds,
    runtime_bounds,
)

jnp = LazyModule("jax.numpy")

_F32 = "float32"


def _neg_axis(axis: int, rank: int, who: str) -> int:
    if not -rank <= axis < rank:
        raise ShapeError(f"{who}: axis {axis} out of range for rank {rank}")
    return axis - rank if axis >= 0 else axis


def _canon_axis(ts, attrs):
    if ts:
        attrs["axis"] = _neg_axis(attrs.get("axis", 0), len(ts[0].shape), "axis")
    return attrs


def _i64(values) -> np.ndarray:
    return np.asarray(list(values), np.int64)


# ---- concat / split -----------------------------------------------------------------------

def _concat_shape(ts, *, axis):
    if not ts:
        raise ShapeError("concat: needs at least one input")
    r = len(ts[0].shape)
    ax = _neg_axis(axis, r, "concat") + r
    for t in ts[1:]:
        if len(t.shape) != r or t.dtype != ts[0].dtype or any(
                a != b for i, (a, b) in enumerate(zip(t.shape, ts[0].shape, strict=True))
                if i != ax):
            raise ShapeError(f"concat: inputs {[t.shape for t in ts]} differ off axis {axis}")
    shape = list(ts[0].shape)
    shape[ax] = sum(t.shape[ax] for t in ts)
    return [TensorType(tuple(shape), ts[0].dtype)]


# ---- laws (TASO, SOSP 2019, Table 2: concat, split and transpose laws) ---------------------
_M = {"a": ("N", "C"), "b": ("N", "C"), "c": ("N", "C"), "d": ("N", "C")}
_NCHW = ("N", "C", "H", "W")
_T = {"w": _NCHW, "u": _NCHW, "v": _NCHW, "z": _NCHW}
_AXES = (-2, -1)
_PERMS = ((1, 0), (0, 1))
_CONCAT_LAWS = (
    axiom("concat(concat(a, b, axis=k), c, axis=k) = concat(a, concat(b, c, axis=k), axis=k)", _M, k=_AXES),
    axiom("relu(concat(a, b, axis=k)) = concat(relu(a), relu(b), axis=k)", _M, k=_AXES),
    # the blocks must line up: a and c equally long on the axis (a per-channel bias may
    # broadcast on the other axes)
    axiom("ewadd(concat(a, b, axis=k), concat(c, d, axis=k)) = concat(ewadd(a, c), ewadd(b, d), axis=k)", _M,
          where=("dim(a, k) == dim(c, k)",), k=_AXES),
    axiom("ewmul(concat(a, b, axis=k), concat(c, d, axis=k)) = concat(ewmul(a, c), ewmul(b, d), axis=k)", _M,
          where=("dim(a, k) == dim(c, k)",), k=_AXES),
    axiom("scalar_mul(concat(a, b, axis=k), scalar=s) = concat(scalar_mul(a, scalar=s), scalar_mul(b, scalar=s), axis=k)", _M, k=_AXES, s=(3.0,)),
    # interchange of concatenations on two different axes (the blocks line up: a and c
    # equally long on axis i; a comparison, not a size variable, which gives Z3 no trigger)
    axiom("concat(concat(a, b, axis=i), concat(c, d, axis=i), axis=j) = concat(concat(a, c, axis=j), concat(b, d, axis=j), axis=i)",
          {"a": _NCHW, "b": _NCHW, "c": _NCHW, "d": _NCHW},
          where=("i != j", "i < 0", "j < 0", "dim(a, i) == dim(c, i)"),
          i=(-1, -2, -3, -4), j=(-1, -2, -3, -4)),
)
_SPLIT_LAWS = (
    axiom("split(concat(a, b, axis=k), axis=k, sizes=(s, t))[0] = a", {"a": ("N", "C"), "b": ("N", "D")},
          where=("s = dim(a, k)", "t = dim(b, k)"), k=(-1, -2)),
    axiom("split(concat(a, b, axis=k), axis=k, sizes=(s, t))[1] = b", {"a": ("N", "C"), "b": ("N", "D")},
          where=("s = dim(a, k)", "t = dim(b, k)"), k=(-1, -2)),
    # Stated with size variables, not "dim(a, k) - s" inside the pattern: a size term as
    # Z3's trigger would fire on every dim() and loop.
    axiom("concat(split(a, axis=k, sizes=(s, t))[0], split(a, axis=k, sizes=(s, t))[1], axis=k) = a", _M,
          where=("t = dim(a, k) - s",), k=_AXES, s=(1,)),
)
_TRANSPOSE_LAWS = (
    axiom("transpose(transpose(a, perm=(1, 0)), perm=(1, 0)) = a", _M),
    axiom("transpose(transpose(w, perm=(1, 0, 2, 3)), perm=(1, 0, 2, 3)) = w", {"w": ("D", "C", "K", "K")}),
    axiom("relu(transpose(a, perm=q)) = transpose(relu(a), perm=q)", _M, q=_PERMS),
    axiom("transpose(ewadd(a, b), perm=q) = ewadd(transpose(a, perm=q), transpose(b, perm=q))", _M, q=_PERMS),
    axiom("transpose(ewmul(w, s), perm=(1, 0, 2, 3)) = ewmul(transpose(w, perm=(1, 0, 2, 3)), transpose(s, perm=(1, 0, 2, 3)))",
          {"w": ("D", "C", "K", "K"), "s": ("D", 1, 1, 1)}),
    axiom("transpose(ewmul(a, b), perm=q) = ewmul(transpose(a, perm=q), transpose(b, perm=q))", _M, q=_PERMS),
    axiom("transpose(concat(a, b, axis=-2), perm=(1, 0)) = concat(transpose(a, perm=(1, 0)), transpose(b, perm=(1, 0)), axis=-1)", _M),
    axiom("transpose(concat(w, u, axis=-3), perm=(1, 0, 2, 3)) = concat(transpose(w, perm=(1, 0, 2, 3)), transpose(u, perm=(1, 0, 2, 3)), axis=-4)", _T),
    axiom("transpose(concat(w, u, axis=-4), perm=(1, 0, 2, 3)) = concat(transpose(w, perm=(1, 0, 2, 3)), transpose(u, perm=(1, 0, 2, 3)), axis=-3)", _T),
)


declare(OpDef(
    name="concat", copies_values=True, ref=lambda *xs, axis: jnp.concatenate(xs, axis=axis),
    numpy_ref=lambda *xs, axis: np.concatenate(xs, axis=axis),
    shape=_concat_shape, arity=None,
    
    attrs={"axis": 0},
    to_onnx=lambda ctx, ins, outs, *, axis: ctx.node("Concat", ins, outs, axis=axis),
    flops=lambda i, o, **_: 0.0, canon=_canon_axis, layout="axis",
    examples=(([TensorType((2, 3), _F32), TensorType((2, 5), _F32)], {"axis": 1}),
              ([TensorType((2, 3, 4, 4), _F32)] * 3, {"axis": -3})),
    axioms=_CONCAT_LAWS,
    doc="concatenate along axis (ONNX Concat; TASO concat)"))


@onnx_importer("Concat")
def _import_concat(ctx, ins, *, axis):
    return [ctx.op("concat", [t for t in ins if ctx.type(t).size or len(ins) == 1], axis=axis)]


def _split(x, *, axis, sizes):
    idx = np.cumsum(sizes)[:-1].tolist()
    return tuple(jnp.split(x, idx, axis=axis))


def _split_shape(ts, *, axis, sizes):
    (x,) = ts
    ax = _neg_axis(axis, len(x.shape), "split") + len(x.shape)
    if sum(sizes) != x.shape[ax] or any(s < 0 for s in sizes):
        raise ShapeError(f"split: sizes {sizes} do not add up to {x.shape[ax]} on axis {axis}")
    out = []
    for s in sizes:
        shape = list(x.shape)
        shape[ax] = s
        out.append(TensorType(tuple(shape), x.dtype))
    return out


declare(OpDef(
    name="split", copies_values=True, ref=_split, shape=_split_shape, arity=1,
    attrs={"axis": 0, "sizes": ()}, fusible=True,
    num_outputs=lambda attrs: len(attrs["sizes"]) if isinstance(attrs["sizes"], tuple) else None,
    to_onnx=lambda ctx, ins, outs, *, axis, sizes: ctx.node(
        "Split", [ins[0], ctx.ints(sizes)], outs, axis=axis),
    flops=lambda i, o, **_: 0.0, canon=_canon_axis, layout="axis",
    examples=(([TensorType((2, 7), _F32)], {"axis": 1, "sizes": (3, 4)}),),
    axioms=_SPLIT_LAWS,
    doc="split along axis into parts of the given sizes; one output per part (ONNX Split)"))


@onnx_importer("Split")
def _import_split(ctx, ins, *, axis=0, split=None, num_outputs=None):
    rank = len(ctx.type(ins[0]).shape)
    ax = axis + rank if axis < 0 else axis
    sizes = tuple(t.shape[ax] for t in ctx.out_types)
    parts = ctx.op("split", [ins[0]], axis=axis, sizes=sizes)
    return list(parts) if isinstance(parts, list | tuple) else [parts]


# ---- transpose / reshape ------------------------------------------------------------------

def _transpose_shape(ts, *, perm):
    (x,) = ts
    if sorted(perm) != list(range(len(x.shape))):
        raise ShapeError(f"transpose: perm {perm} is not a permutation of rank {len(x.shape)}")
    return [TensorType(tuple(x.shape[p] for p in perm), x.dtype)]


declare(OpDef(
    name="transpose", copies_values=True, ref=lambda x, *, perm: jnp.transpose(x, perm),
    numpy_ref=lambda x, *, perm: np.transpose(x, perm),
    shape=_transpose_shape, arity=1,
    
    attrs={"perm": ()},
    to_onnx=lambda ctx, ins, outs, *, perm: ctx.node("Transpose", ins, outs, perm=list(perm)),
    flops=lambda i, o, **_: 0.0,
    examples=(([TensorType((2, 3, 4), _F32)], {"perm": (2, 0, 1)}),),
    axioms=_TRANSPOSE_LAWS,
    doc="permute axes (ONNX Transpose)"))


@onnx_importer("Transpose")
def _import_transpose(ctx, ins, *, perm=None):
    rank = len(ctx.type(ins[0]).shape)
    return [ctx.op("transpose", ins, perm=tuple(perm) if perm else tuple(reversed(range(rank))))]


def _reshape_shape(ts, *, shape):
    (x,) = ts
    if any(d < 0 for d in shape) or int(np.prod(shape)) != x.size:
        raise ShapeError(f"reshape: cannot reshape {x.shape} to {shape}")
    return [TensorType(tuple(shape), x.dtype)]


def _reshape_to_onnx(ctx, ins, outs, *, shape):
    """ONNX Reshape whose shape still holds at other bindings of the model's open sizes.

    With no open size (:mod:`taso_jax.ops.dims`) in the input or the target: output sizes
    equal to the input's at the same leading positions are written 0 (ONNX: copy that size
    from the input), and a single size after them -1 (whatever is left), so a model written
    with its batch size open reshapes right at any batch size. With open sizes: a size
    equal at every binding to the input's at the same position is written 0, a single
    other open size -1, and where more are open the target is computed at run time from
    the inputs' shapes (``ctx.ints``). At the size it was built for, the result is the same.
    """
    try:
        in_shape = ctx.shape(ins[0])
    except KeyError:
        in_shape = ()
    if open_dims(shape) or open_dims(in_shape):
        out = list(shape)
        for k, d in enumerate(shape):
            if k < len(in_shape) and same_size(d, in_shape[k]) and (is_open(d) or int(d)):
                out[k] = 0
        rest = [k for k, d in enumerate(out) if is_open(d)]
        if len(rest) == 1 and all(int(d) for d in shape):
            out[rest[0]] = -1
            rest = []
        target = (ctx.ints(out) if rest else
                  ctx.const(_i64([int(d) for d in out])))
        ctx.node("Reshape", [ins[0], target], outs)
        return
    full = tuple(int(d) for d in shape)
    out = list(full)
    k = 0
    if int(np.prod(full)) == 0:  # onnxruntime refuses -1 beside a size of 0
        ctx.node("Reshape", [ins[0], ctx.const(_i64(out))], outs)
        return
    while k < min(len(full), len(in_shape)) and full[k] == in_shape[k]:
        out[k] = 0
        k += 1
    if len(full) - k == 1 and k > 0:
        out[k] = -1
    ctx.node("Reshape", [ins[0], ctx.const(_i64(out))], outs)


declare(OpDef(
    name="reshape", copies_values=True,
    ref=lambda x, *, shape: jnp.reshape(x, shape), shape=_reshape_shape, arity=1,
    numpy_ref=lambda x, *, shape: np.reshape(x, shape),
    fusible=True,
    attrs={"shape": ()},
    to_onnx=_reshape_to_onnx,
    flops=lambda i, o, **_: 0.0,
    examples=(([TensorType((2, 3, 4), _F32)], {"shape": (6, 4)}),),
    doc="reshape to a static shape (ONNX Reshape, Flatten, Squeeze, Unsqueeze)"))


@onnx_importer("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def _import_reshape(ctx, ins, *, axis=1, allowzero=0, **_):
    # All shapes are static after import, so the target shape is the inferred output shape,
    # with the open sizes that the ONNX operator carries over from its input.
    shape = ctx.out_types[0].shape
    derived = carried_sizes(ctx, ins, int(axis), int(allowzero))
    fixed = (ctx.out_fixed or [None])[0] or ()
    if derived is not None and len(derived) == len(shape):
        # a size the symbolic inference found to be a number stays one: at a binding of 1,
        # an input's 12*N equals a head count of 12 (a MiniLM's keys, 2026-11-30)
        shape = tuple(d if is_open(d) or not is_open(e) or int(e) != int(d)
                      or (k < len(fixed) and fixed[k]) else e
                      for k, (d, e) in enumerate(zip(shape, derived, strict=True)))
    return [ctx.op("reshape", [ins[0]], shape=shape)]


# ---- slice / pad / gather / expand --------------------------------------------------------

def _slice(x, *, starts, ends, steps):
    return x[tuple(slice(s, e if e >= 0 else None, st)
                   for s, e, st in zip(starts, ends, steps, strict=True))]


def _slice_shape(ts, *, starts, ends, steps):
    (x,) = ts
    if not len(starts) == len(ends) == len(steps) == len(x.shape):
        raise ShapeError(f"slice: starts/ends/steps need one entry per axis of {x.shape}")
    shape = tuple(_extent(s, e, st) for s, e, st in zip(starts, ends, steps, strict=True))
    return [TensorType(shape, x.dtype)]


def _extent(s, e, st):
    """Entries of ``range(s, e, st)``; an expression where ``s`` or ``e`` is an open size."""
    n = len(range(int(s), int(e), int(st)))
    if (is_open(s) or is_open(e)) and st > 0 and n > 0:
        return (e - s + (st - 1)) // st
    return n


def _slice_onnx(ctx, ins, outs, *, starts, ends, steps):
    """ONNX Slice, on the axes it narrows; bounds at an open size's end counted from the back.

    An end at an open size's full extent is written as "to the end", one a constant short
    of it as a negative index (:func:`from_end`), and so is a start; an axis taken whole
    (start 0, step 1, to the end) is left out of ``axes``.
    """
    low, high = np.iinfo(np.int64).min, np.iinfo(np.int64).max
    try:
        in_shape = ctx.shape(ins[0])
    except KeyError:
        in_shape = (None,) * len(starts)
    axes, s_out, e_out, st_out = [], [], [], []
    for k, (s, e, st, d) in enumerate(zip(starts, ends, steps, in_shape, strict=True)):
        e = e if e >= 0 else low
        if st > 0 and d is not None and (same_size(e, d) if is_open(e) or is_open(d)
                                         else int(e) >= int(d)):
            e = high
        elif st > 0 and from_end(e, d) is not None:
            e = from_end(e, d)
        if st > 0 and from_end(s, d) is not None:
            s = from_end(s, d)
        if st == 1 and not is_open(s) and int(s) == 0 and e == high:
            continue  # the whole axis
        axes.append(k)
        s_out.append(s), e_out.append(e), st_out.append(st)
    if not axes:  # every axis whole: a copy
        ctx.node("Identity", [ins[0]], outs)
        return
    ctx.node("Slice", [ins[0], ctx.ints(s_out), ctx.ints(e_out), ctx.const(_i64(axes)),
                       ctx.const(_i64(st_out))], outs)


declare(OpDef(
    name="slice", copies_values=True, ref=_slice, shape=_slice_shape, arity=1,
    attrs={"starts": (), "ends": (), "steps": ()}, fusible=True,
    numpy_ref=_slice,  # indexing, the same in NumPy
    to_onnx=_slice_onnx, flops=lambda i, o, **_: 0.0,
    examples=(([TensorType((5, 6), _F32)], {"starts": (1, 5), "ends": (4, -1),
                                            "steps": (2, -2)}),),
    doc="strided slice with per-axis start, end (exclusive; -1 past the front) and step "
        "(ONNX Slice)"))


@onnx_importer("Slice")
def _import_slice(ctx, ins, **attrs):
    shape = ctx.type(ins[0]).shape
    if len(ins) == 1:  # opset < 10: attributes
        starts, ends, axes = attrs["starts"], attrs["ends"], attrs.get("axes")
        steps = None
    else:
        vals = [ctx.const(t) if t is not None else None for t in ins[1:]] + [None] * 3
        if any(t is not None and v is None for v, t in zip(vals[2:4], ins[3:5],
                                                            strict=False)):
            return None
        starts, ends, axes, steps = (None if v is None else np.asarray(v).tolist()
                                     for v in vals[:4])
        if starts is None and ends is None:
            return None
    n_axes = len(starts if starts is not None else ends if ends is not None else axes or ())
    axes = axes if axes is not None else list(range(n_axes))
    steps = steps if steps is not None else [1] * n_axes
    full = [(0, d, 1) for d in shape]
    for k, (a, st) in enumerate(zip(axes, steps, strict=True)):
        a = a + len(shape) if a < 0 else a
        s, e = (None if b is None else int(b[k]) for b in (starts, ends))
        if s is None or e is None:  # computed at run time: read off the output's size
            full[a] = runtime_bounds(s, e, int(st), shape[a], ctx.out_types[0].shape[a])
            continue
        full[a] = open_bounds(slice(s, e, int(st)).indices(shape[a]), s, e, int(st),
                               shape[a])
    # Python's range end for a negative step that runs past the front is -1: store as -1.
    return [ctx.op("slice", [ins[0]], starts=tuple(f[0] for f in full),
                   ends=tuple(f[1] for f in full), steps=tuple(f[2] for f in full))]


def _pad(x, *, pads, value):
    r = x.ndim
    return jnp.pad(x, [(pads[i], pads[i + r]) for i in range(r)],
                   constant_values=jnp.asarray(value, x.dtype))


def _pad_shape(ts, *, pads, value):
    (x,) = ts
    r = len(x.shape)
    if len(pads) != 2 * r or any(p < 0 for p in pads):
        raise ShapeError(f"pad: need {2 * r} non-negative pads for {x.shape}, got {pads}")
    return [TensorType(tuple(d + pads[i] + pads[i + r] for i, d in enumerate(x.shape)), x.dtype)]


declare(OpDef(
    name="pad", copies_values=True,
    ref=_pad, shape=_pad_shape, arity=1, attrs={"pads": (), "value": 0.0},
    to_onnx=lambda ctx, ins, outs, *, pads, value: ctx.node(
        "Pad", [ins[0], ctx.const(_i64(pads)), ctx.scalar(value, ctx.dtype(ins[0]))], outs),
    flops=lambda i, o, **_: 0.0,
    examples=(([TensorType((2, 3), _F32)], {"pads": (0, 1, 2, 0), "value": 1.5}),),
    doc="constant padding, pads = begins of every axis then ends (ONNX Pad, constant mode)"))


_EDGE_MODES = ("reflect", "edge", "wrap")


def _edge_pad(x, *, pads, mode):
    r = x.ndim
    return jnp.pad(x, [(pads[i], pads[i + r]) for i in range(r)], mode=mode)


def _edge_pad_shape(ts, *, pads, mode):
    (x,) = ts
    if mode not in _EDGE_MODES:
        raise ShapeError(f"edge_pad: mode must be one of {_EDGE_MODES}, got {mode!r}")
    r = len(x.shape)
    # reflect mirrors without repeating the edge: at most d - 1 entries each side (ONNX
    # Pad, as onnxruntime runs it); wrap at most d; edge needs a non-empty axis
    most = {"reflect": -1, "edge": None, "wrap": 0}[mode]
    fits = len(pads) == 2 * r and all(p >= 0 for p in pads)
    for i, d in enumerate(x.shape if fits else ()):
        wide = max(pads[i], pads[i + r])
        if wide and (int(d) == 0 or most is not None and wide > int(d) + most):
            fits = False
    if not fits:
        raise ShapeError(f"edge_pad: pads {pads} do not fit {x.shape} in mode {mode!r}")
    return [TensorType(tuple(d + pads[i] + pads[i + r] for i, d in enumerate(x.shape)), x.dtype)]


declare(OpDef(
    name="edge_pad", copies_values=True, ref=_edge_pad, shape=_edge_pad_shape, arity=1,
    attrs={"pads": (), "mode": "reflect"},
    to_onnx=lambda ctx, ins, outs, *, pads, mode: ctx.node(
        "Pad", [ins[0], ctx.const(_i64(pads))], outs, mode=mode),
    flops=lambda i, o, **_: 0.0,
    examples=(([TensorType((3, 4), _F32)], {"pads": (1, 2, 2, 0), "mode": "reflect"}),
              ([TensorType((3, 4), _F32)], {"pads": (0, 3, 2, 1), "mode": "edge"}),
              ([TensorType((3, 4), _F32)], {"pads": (2, 1, 0, 4), "mode": "wrap"})),
    doc="padding by the tensor's own entries, pads = begins of every axis then ends: "
        "mirrored without the edge (reflect), the edge repeated (edge), or wrapped around "
        "(wrap) (ONNX Pad, reflect/edge/wrap modes; numpy.pad)"))


@onnx_importer("Pad")
def _import_pad(ctx, ins, *, mode="constant", pads=None, value=0.0):
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode not in ("constant", *_EDGE_MODES) or (mode == "wrap" and ctx.opset < 19):
        return None
    if len(ins) > 1:
        p = ctx.const(ins[1])
        v = ctx.const(ins[2]) if len(ins) > 2 and ins[2] is not None else 0.0
        if p is None or v is None:
            return None
        pads, value = np.asarray(p).tolist(), float(np.asarray(v).reshape(()))
        if len(ins) > 3 and ins[3] is not None:  # opset 18: the pads of these axes only
            axes = ctx.const(ins[3])
            if axes is None:
                return None
            pads = _pads_on_axes(pads, np.asarray(axes).tolist(), len(ctx.type(ins[0]).shape))
    if any(p < 0 for p in pads):
        return None
    pads = tuple(int(p) for p in pads)
    if mode != "constant":
        return [ctx.op("edge_pad", [ins[0]], pads=pads, mode=mode)]
    return [ctx.op("pad", [ins[0]], pads=pads, value=float(value))]


def _pads_on_axes(pads: list, axes: list, rank: int) -> list:
    """ONNX Pad's ``pads`` of the listed ``axes`` as pads of every axis (0 elsewhere).

    Opset 18's ``axes`` input; negative axes count from the back. Begins of each axis,
    then ends, as ONNX orders them.
    """
    full = [0] * (2 * rank)
    for k, a in enumerate(axes):
        a = a + rank if a < 0 else a
        full[a], full[a + rank] = int(pads[k]), int(pads[k + len(axes)])
    return full


def _gather(data, idx, *, axis):
    idx = jnp.where(idx < 0, idx + data.shape[axis], idx)
    return jnp.take(data, idx, axis=axis, mode="clip")


def _gather_shape(ts, *, axis):
    d, i = ts
    if not i.dtype.startswith("int"):
        raise ShapeError(f"gather: indices must be integers, got {i.dtype}")
    ax = _neg_axis(axis, len(d.shape), "gather") + len(d.shape)
    return [TensorType(d.shape[:ax] + i.shape + d.shape[ax + 1:], d.dtype)]


declare(OpDef(
    name="gather", copies_values=True, ref=_gather, shape=_gather_shape, arity=2, attrs={"axis": 0},
    to_onnx=lambda ctx, ins, outs, *, axis: ctx.node("Gather", ins, outs, axis=axis),
    flops=lambda i, o, **_: 0.0, canon=_canon_axis,
    examples=(([TensorType((10, 4), _F32), TensorType((2, 3), "int64")], {"axis": 0}),),
    doc="take entries of data along axis at integer indices (ONNX Gather)"))
onnx_importer("Gather")(lambda ctx, ins, axis=0: [ctx.op("gather", ins, axis=axis)])


def _expand_shape(ts, *, shape):
    (x,) = ts
    try:
        out = np.broadcast_shapes(x.shape, tuple(shape))
    except ValueError as e:
        raise ShapeError(f"expand: {x.shape} does not broadcast to {shape}") from e
    if tuple(out) != tuple(shape):
        raise ShapeError(f"expand: {x.shape} does not broadcast to {shape}")
    return [TensorType(tuple(shape), x.dtype)]


def _expand_onnx(ctx, ins, outs, *, shape):
    """ONNX ``Expand``, each size the input already has written as 1.

    ``Expand`` broadcasts (ONNX operator specification, Expand-13): a 1 keeps the input's
    size, so an open size the input has (a batch) needs no ``Shape`` computed at run time.
    """
    have = ctx.shape(ins[0])
    lead = len(shape) - len(have)
    target = [1 if k >= lead and same_size(have[k - lead], d) else d
              for k, d in enumerate(shape)]
    ctx.node("Expand", [ins[0], ctx.ints(target)], outs)


declare(OpDef(
    name="expand", copies_values=True,
    ref=lambda x, *, shape: jnp.broadcast_to(x, shape), shape=_expand_shape, arity=1,
    attrs={"shape": ()},
    to_onnx=_expand_onnx,
    flops=lambda i, o, **_: 0.0,
    numpy_ref=lambda x, *, shape: np.broadcast_to(x, tuple(int(d) for d in shape)),
    examples=(([TensorType((3, 1), _F32)], {"shape": (2, 3, 4)}),),
    doc="broadcast to a static shape (ONNX Expand)"))
@onnx_importer("Expand")
def _import_expand(ctx, ins, **_):
    """``expand`` to the inferred output shape, an open size the input has kept open.

    ONNX infers the output at the bound sizes; where the input's size on an axis is open
    and equals the output's there (above 1, so not broadcast), the output's is taken to be
    the same open size: the shape input was read off the input (``Shape``), as exporters
    write it. Where that is not so, the check at other sizes finds it (the original and the
    written file then disagree, and the input is kept).
    """
    out = list(ctx.out_types[0].shape)
    have = ctx.type(ins[0]).shape
    lead = len(out) - len(have)
    for k, d in enumerate(have):
        if lead + k >= 0 and is_open(d) and not is_open(out[lead + k]) \
                and int(d) == int(out[lead + k]) > 1:
            out[lead + k] = d
    return [ctx.op("expand", [ins[0]], shape=tuple(out))]


# ---- jaxpr primitives ---------------------------------------------------------------------

@jaxpr_importer("concatenate")
def _import_concatenate(ctx, ins, *, dimension, **_):
    return [ctx.op("concat", ins, axis=int(dimension))]


@jaxpr_importer("split")
def _import_split_jaxpr(ctx, ins, *, sizes, axis, **_):
    return list(ctx.op("split", ins, axis=int(axis), sizes=tuple(int(s) for s in sizes)))


@jaxpr_importer("transpose")
def _import_transpose_jaxpr(ctx, ins, *, permutation, **_):
    return [ctx.transpose(ins[0], tuple(permutation))]


@jaxpr_importer("reshape", "squeeze")
def _import_reshape_jaxpr(ctx, ins, *, dimensions=None, **_):
    if ctx.source_op == "reshape" and dimensions is not None:
        return None  # reshape with a transposition folded in (old lax API)
    from taso_jax.ops.attention import repeat_idiom

    repeated = repeat_idiom(ctx, ins[0], ctx.out_types[0].shape)
    return [repeated if repeated is not None else ctx.reshape(ins[0], ctx.out_types[0].shape)]


@jaxpr_importer("broadcast_in_dim")
def _import_broadcast_in_dim(ctx, ins, *, shape, broadcast_dimensions, **_):
    # Insert the new axes as size 1 (a reshape), then expand to the full shape if needed.
    (x,) = ins
    xs = ctx.type(x).shape
    if list(broadcast_dimensions) != sorted(broadcast_dimensions):
        return None
    unit = [1] * len(shape)
    for d, size in zip(broadcast_dimensions, xs, strict=True):
        unit[d] = size
    y = ctx.reshape(x, tuple(unit))
    return [y if tuple(unit) == tuple(shape) else ctx.op("expand", [y], shape=tuple(shape))]


@jaxpr_importer("slice")
def _import_slice_jaxpr(ctx, ins, *, start_indices, limit_indices, strides=None, **_):
    steps = tuple(strides) if strides else (1,) * len(start_indices)
    return [ctx.op("slice", ins, starts=tuple(int(s) for s in start_indices),
                   ends=tuple(int(e) for e in limit_indices), steps=steps)]


@jaxpr_importer("pad")
def _import_pad_jaxpr(ctx, ins, *, padding_config, **_):
    x, value = ins
    v = ctx.const(value)
    if v is None or any(i != 0 or lo < 0 or hi < 0 for lo, hi, i in padding_config):
        return None  # runtime value, interior or negative padding
    pads = tuple(lo for lo, _, _ in padding_config) + tuple(hi for _, hi, _ in padding_config)
    return [ctx.op("pad", [x], pads=tuple(int(p) for p in pads),
                   value=float(np.asarray(v).reshape(())))]


#: Most elements of an ``iota`` folded into a constant at import; a larger one stays a
#: runtime operation (a one-hot table over a vocabulary would be a large weight). 4096 x 4096:
#: the positions of a causal mask over 4096 tokens, which at ``1 << 22`` stayed a runtime
#: computation that no attention rule recognized (S=4096 ran unchanged on an H200 where
#: S=2048 ran 1.7x).
IOTA_FOLD_MAX = 1 << 24


@jaxpr_importer("iota")
def _import_iota(ctx, ins, *, dtype, shape, dimension, **_):
    # Positions (0, 1, 2, ... along one axis) are constants: folded here, the masks and
    # position tables computed from them fold too, and a causal mask can be recognized.
    shape = tuple(int(d) for d in shape)
    if int(np.prod(shape, dtype=np.int64)) > IOTA_FOLD_MAX:
        return None
    axis = np.arange(shape[dimension], dtype=np.dtype(dtype))
    view = [1] * len(shape)
    view[dimension] = shape[dimension]
    return [ctx.weight(np.broadcast_to(axis.reshape(view), shape).copy(), "iota")]
