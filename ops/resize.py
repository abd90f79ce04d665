"""Resampling: ``resize``, nearest-neighbour and (multi)linear interpolation on any axes.

Source: ONNX operator spec, Resize (opsets 10-19; the importer reads the opset 11-19 inputs
``X, roi, scales, sizes``, which opset conversion gives older models and their Upsample). Shapes are static, so
the source coordinates, the nearest indices and the linear weights are computed once, in
float32 NumPy, the way onnxruntime's CPU kernel computes them
(``GetOriginalCoordinateFromResizedCoordinate``, ``GetNearestPixelFromOriginal``): nearest
matches onnxruntime exactly, linear within float rounding (it interpolates one axis at a
time; onnxruntime sums the four bilinear products).

Supported: ``mode`` ``nearest`` (``nearest_mode`` ``floor``, ``ceil``, ``round_prefer_floor``,
``round_prefer_ceil``) and ``linear``, with ``coordinate_transformation_mode``
``asymmetric``, ``half_pixel``, ``pytorch_half_pixel`` or ``align_corners``. Cubic
interpolation, ``tf_crop_and_resize``, ``half_pixel_symmetric``, antialiasing and
aspect-ratio policies other than ``stretch`` are declined by the importer: such a node stays
opaque and runs in onnxruntime.
"""

from __future__ import annotations

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
from taso_jax.ops._lazy import LazyModule
from taso_jax.ops.dims import is_open, open_dims

jnp = LazyModule("jax.numpy")

_F32 = "float32"
MODES = ("nearest", "linear")
COORDINATE_MODES = ("asymmetric", "half_pixel", "pytorch_half_pixel", "align_corners")
NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")


def source_coordinates(out_len: int, in_len: int, scale: float, mode: str) -> np.ndarray:
    """Float32 source coordinate of each output index along one axis.

    ONNX Resize's ``coordinate_transformation_mode``; ``scale`` is the axis's float32 scale.

    Raises:
        ShapeError: an unsupported mode.
    """
    x = np.arange(out_len, dtype=np.float32)
    s = np.float32(scale)
    half = np.float32(0.5)
    if mode == "asymmetric":
        return x / s
    if mode == "half_pixel":
        return (x + half) / s - half
    if mode == "pytorch_half_pixel":
        return (x + half) / s - half if out_len > 1 else np.zeros(out_len, np.float32)
    if mode == "align_corners":
        if out_len == 1:
            return np.zeros(1, np.float32)
        return x * np.float32(in_len - 1) / np.float32(out_len - 1)
    raise ShapeError(f"resize: unsupported coordinate_transformation_mode {mode!r}")


def _round_half_away(x: np.ndarray) -> np.ndarray:
    return np.sign(x) * np.floor(np.abs(x) + np.float32(0.5))  # C's std::round


def nearest_indices(coords: np.ndarray, in_len: int, nearest_mode: str) -> np.ndarray:
    """Input index of each output element along one axis, clipped to the axis.

    Rounds the source coordinate by ONNX Resize's ``nearest_mode``.

    Raises:
        ShapeError: an unsupported mode.
    """
    if nearest_mode == "floor":
        idx = np.floor(coords)
    elif nearest_mode == "ceil":
        idx = np.ceil(coords)
    elif nearest_mode == "round_prefer_floor":
        tie = coords == np.trunc(coords) + np.float32(0.5)
        idx = np.where(tie, np.floor(coords), _round_half_away(coords))
    elif nearest_mode == "round_prefer_ceil":
        idx = _round_half_away(coords)
    else:
        raise ShapeError(f"resize: unsupported nearest_mode {nearest_mode!r}")
    return np.clip(idx, 0, in_len - 1).astype(np.int32)


def linear_taps(coords: np.ndarray, in_len: int):
    """``(i0, i1, w0, w1)``: the two input indices of each output element, and their weights.

    Along one axis, in float32, as onnxruntime's linear kernel computes them: the coordinate
    is clipped to the axis, and where both indices coincide each weight is 0.5.
    """
    c = np.clip(coords, np.float32(0), np.float32(in_len - 1))
    i0 = np.minimum(c.astype(np.int64), in_len - 1)
    i1 = np.minimum(i0 + 1, in_len - 1)
    w1 = np.abs(c - i0.astype(np.float32))
    w0 = np.abs(c - i1.astype(np.float32))
    same = i0 == i1
    w0[same] = w1[same] = np.float32(0.5)
    return i0.astype(np.int32), i1.astype(np.int32), w0, w1


def _axis_shape(rank: int, axis: int, n: int) -> tuple[int, ...]:
    shape = [1] * rank
    shape[axis] = n
    return tuple(shape)


def _resize(x, *, sizes, scales, mode, coordinate_transformation_mode, nearest_mode):
    first = x.ndim - len(sizes)
    for axis, n_out, s in zip(range(first, x.ndim), sizes, scales, strict=True):
        n_in = x.shape[axis]
        coords = source_coordinates(n_out, n_in, s, coordinate_transformation_mode)
        if n_in == n_out and np.array_equal(coords, np.arange(n_out)):
            continue  # this axis is not resampled
        if mode == "nearest":
            idx = nearest_indices(coords, n_in, nearest_mode)
            k = n_out // n_in
            if n_out == k * n_in and np.array_equal(idx, np.repeat(np.arange(n_in), k)):
                x = jnp.repeat(x, k, axis=axis)  # an integer upscale: broadcast, no gather
            else:
                x = jnp.take(x, idx, axis=axis)
        else:
            i0, i1, w0, w1 = linear_taps(coords, n_in)
            shape = _axis_shape(x.ndim, axis, n_out)
            x = (jnp.take(x, i0, axis=axis) * jnp.asarray(w0.reshape(shape), x.dtype)
                 + jnp.take(x, i1, axis=axis) * jnp.asarray(w1.reshape(shape), x.dtype))
    return x


def _resize_shape(ts, *, sizes, scales, mode, coordinate_transformation_mode, nearest_mode):
    (x,) = ts
    if (not sizes or len(sizes) > len(x.shape) or len(scales) != len(sizes)
            or min(sizes) < 1 or min(scales) <= 0):
        raise ShapeError(f"resize: sizes {sizes} and scales {scales} do not fit {x.shape}")
    if mode not in MODES or coordinate_transformation_mode not in COORDINATE_MODES or (
            mode == "nearest" and nearest_mode not in NEAREST_MODES):
        raise ShapeError(f"resize: unsupported mode {mode!r}, "
                         f"{coordinate_transformation_mode!r}, {nearest_mode!r}")
    if mode == "linear" and not is_float_dtype(x.dtype):
        raise ShapeError(f"resize: linear interpolation of {x.dtype}")
    return [TensorType(x.shape[:len(x.shape) - len(sizes)]
                       + tuple(s if is_open(s) else int(s) for s in sizes), x.dtype)]


def _resize_flops(ins, outs, *, mode, **_):
    return (3.0 if mode == "linear" else 0.0) * outs[0].size * len(outs[0].shape)


def _resize_onnx(ctx, ins, outs, *, sizes, scales, mode, coordinate_transformation_mode,
                 nearest_mode):
    # Sizes where the scales are what onnxruntime derives from them (out / in in float32);
    # else the scales themselves, from which it derives the same sizes (floor(in * scale)).
    in_shape = ctx.shape(ins[0])
    lead = in_shape[:len(in_shape) - len(sizes)]
    trail = in_shape[len(lead):]
    # Open output sizes (taso_jax.ops.dims: an integral scale of an open input size, or a
    # skip connection's size) are written computed from the inputs' shapes at run time:
    # constants would hold the bound ones.
    if open_dims(sizes):
        extra = ["", "", ctx.ints(tuple(lead) + tuple(sizes))]
    elif all(np.float32(o) / np.float32(i) == np.float32(s)
             for o, i, s in zip(sizes, trail, scales, strict=True)):
        extra = ["", "", ctx.const(np.asarray(lead + tuple(sizes), np.int64))]
    else:
        extra = ["", ctx.const(np.asarray((1.0,) * len(lead) + tuple(scales), np.float32))]
    ctx.node("Resize", [ins[0], *extra], outs, mode=mode,
             coordinate_transformation_mode=coordinate_transformation_mode,
             nearest_mode=nearest_mode)


# ---- laws -----------------------------------------------------------------------------------
# Resampling the last axes acts on each index of the leading axes alone: it passes through a
# concatenation along a leading axis, and through arithmetic with a tensor that is constant
# along the resampled axes (a per-channel scale: the batchnorm after an upsample). The sizes
# and scales are written out: a variable would also stand for tuples that resample the
# concatenation's axis.
_R = {"x": ("N", "C", 2, 3), "y": ("N", "C", 2, 3), "s": (1, "C", 1, 1)}
_RM = {"m": MODES, "t": COORDINATE_MODES}
_RESIZE_LAWS = (
    axiom("resize(concat(x, y, axis=k), sizes=(4, 6), scales=(2.0, 2.0), mode=m, coordinate_transformation_mode=t) = concat(resize(x, sizes=(4, 6), scales=(2.0, 2.0), mode=m, coordinate_transformation_mode=t), resize(y, sizes=(4, 6), scales=(2.0, 2.0), mode=m, coordinate_transformation_mode=t), axis=k)",
          _R, k=(-3, -4), **_RM),
    axiom("resize(ewmul(x, s), sizes=(4, 6), scales=(2.0, 2.0), mode=m, coordinate_transformation_mode=t) = ewmul(resize(x, sizes=(4, 6), scales=(2.0, 2.0), mode=m, coordinate_transformation_mode=t), s)",
          _R, where=("dim(s, -2) == 1", "dim(s, -1) == 1"), **_RM),
    axiom("resize(ewadd(x, y), sizes=(4, 6), scales=(2.0, 2.0), mode=m, coordinate_transformation_mode=t) = ewadd(resize(x, sizes=(4, 6), scales=(2.0, 2.0), mode=m, coordinate_transformation_mode=t), resize(y, sizes=(4, 6), scales=(2.0, 2.0), mode=m, coordinate_transformation_mode=t))",
          _R, **_RM),
    axiom("dim(resize(x, sizes=(4, 6), scales=(2.0, 2.0), mode=m, coordinate_transformation_mode=t), k) = dim(x, k)",
          _R, k=(-3, -4), **_RM),
)

declare(OpDef(
    name="resize", ref=_resize, shape=_resize_shape, arity=1,
    attrs={"sizes": (1, 1), "scales": (1.0, 1.0), "mode": "nearest",
           "coordinate_transformation_mode": "half_pixel", "nearest_mode": "round_prefer_floor"},
    to_onnx=_resize_onnx, flops=_resize_flops, layout=None,
    examples=(
        ([TensorType((1, 2, 3, 4), _F32)],
         {"sizes": (6, 8), "scales": (2.0, 2.0), "mode": "nearest",
          "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}),
        ([TensorType((1, 2, 4, 4), _F32)],
         {"sizes": (7, 3), "scales": (1.75, 0.75), "mode": "linear",
          "coordinate_transformation_mode": "half_pixel"}),
        ([TensorType((2, 1, 3, 5), _F32)],
         {"sizes": (8, 9), "scales": (8 / 3, 9 / 5), "mode": "linear",
          "coordinate_transformation_mode": "align_corners"}),
        ([TensorType((1, 1, 4, 5), _F32)],
         {"sizes": (1, 12), "scales": (0.25, 2.4), "mode": "linear",
          "coordinate_transformation_mode": "pytorch_half_pixel"}),
        ([TensorType((1, 3, 5, 4), _F32)],
         {"sizes": (3, 9), "scales": (0.6, 2.25), "mode": "nearest",
          "coordinate_transformation_mode": "half_pixel",
          "nearest_mode": "round_prefer_ceil"}),
        ([TensorType((1, 2, 3, 4), _F32)],
         {"sizes": (3, 5, 7), "scales": (1.5, 5 / 3, 1.75), "mode": "nearest",
          "coordinate_transformation_mode": "align_corners", "nearest_mode": "ceil"}),
    ),
    axioms=_RESIZE_LAWS,
    doc="nearest or (multi)linear resampling of the last len(sizes) axes to `sizes`, source "
        "coordinates from `scales` by coordinate_transformation_mode (ONNX Resize)"))


@onnx_importer("Resize")
def _import_resize(ctx, ins, *, mode="nearest", coordinate_transformation_mode="half_pixel",
                   nearest_mode="round_prefer_floor", antialias=0, axes=None,
                   keep_aspect_ratio_policy="stretch", exclude_outside=0, **_):
    # Upsample (opsets 7-9) and Resize-10 arrive here as Resize-11 or later: a model below
    # opset 13 is converted to 17 first, and onnx's converter rewrites them (asymmetric
    # coordinates, nearest rounding down)
    def text(v):
        return v.decode() if isinstance(v, bytes) else v

    mode, ctm, nm = text(mode), text(coordinate_transformation_mode), text(nearest_mode)
    if (mode not in MODES or ctm not in COORDINATE_MODES or antialias or exclude_outside
            or text(keep_aspect_ratio_policy) != "stretch"):
        return None
    shape = ctx.type(ins[0]).shape
    rank = len(shape)
    axes = [a % rank for a in axes] if axes is not None else list(range(rank))

    def given(i):
        if len(ins) <= i or ins[i] is None:
            return None
        v = ctx.const(ins[i])
        return None if v is None or np.size(v) == 0 else np.asarray(v).reshape(-1)

    sc, sz = given(2), given(3)
    scales_absent = len(ins) <= 2 or ins[2] is None or (
        ctx.const(ins[2]) is not None and np.size(ctx.const(ins[2])) == 0)
    if sc is None and sz is None and scales_absent and len(ins) > 3 and ins[3] is not None:
        # sizes computed at run time (from Shape, as PyTorch exports an upsample to a skip
        # connection's size): shapes are static, so they are the output's, which ONNX shape
        # inference or the import's probe run bound
        sz = [ctx.out_types[0].shape[a] for a in axes]  # open sizes stay expressions
    if (sc is None) == (sz is None):
        return None  # runtime scales, or neither: opaque
    full_scales = [np.float32(1.0)] * rank
    full_sizes = list(shape)
    for k, a in enumerate(axes):
        if sz is not None:
            full_sizes[a] = sz[k] if is_open(sz[k]) else int(sz[k])
            full_scales[a] = np.float32(int(full_sizes[a])) / np.float32(int(shape[a]))
        else:
            full_scales[a] = np.float32(sc[k])
            full_sizes[a] = int(np.floor(np.float32(sc[k]) * np.float32(shape[a])))
            if is_open(shape[a]) and float(sc[k]).is_integer() and sc[k] >= 1:
                full_sizes[a] = shape[a] * int(sc[k])  # an open size, scaled: an expression
    # the attributes cover the axes from the first one resampled on (the leading ones, batch
    # and channels, are left out, so that a rule about them matches any batch size)
    moved = [a for a in range(rank) if full_sizes[a] != shape[a] or not np.array_equal(
        source_coordinates(full_sizes[a], shape[a], full_scales[a], ctm), np.arange(shape[a]))]
    if not moved:
        return [ins[0]]
    first = moved[0]
    return [ctx.op("resize", [ins[0]], sizes=tuple(full_sizes[first:]),
                   scales=tuple(float(s) for s in full_scales[first:]), mode=mode,
                   coordinate_transformation_mode=ctm, nearest_mode=nm)]
