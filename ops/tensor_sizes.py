"""How the tensor operators' ONNX import and export keep a model's open sizes.

An open size (:class:`~taso_jax.ops.dims.Dim`, a batch ``N`` or a length ``T``) must reach
the reshape targets, slice bounds and expand shapes the import builds, and the export must
write them so that the file runs at every size. These are the size computations of
``ops/tensor.py``'s Reshape, Flatten, Squeeze, Unsqueeze and Slice importers and of its
Slice export, from the ONNX operator specification (Reshape-14, Slice-13).
"""

from __future__ import annotations

import numpy as np
from taso_jax.ops.dims import expr_of, is_open, open_dims

__all__ = ["product", "aligned_sizes", "carried_sizes", "from_end", "open_bounds",
           "runtime_bounds"]


def product(dims) -> int:
    """The product of sizes, keeping open sizes' expressions (``1`` for none)."""
    out = 1
    for d in dims:
        out = d * out
    return out


def aligned_sizes(x: tuple, y: tuple) -> tuple:
    """``y``'s sizes, each matched to an equal one of ``x`` at the same place from either end.

    A reshape whose target is computed at run time (``Shape``, ``Gather``, ``Concat``)
    mostly keeps the leading and trailing sizes and merges or splits the middle: the sizes
    equal from the left and from the right are taken from ``x`` (with their open sizes),
    and where one size of ``y`` is left between them it is the product of ``x``'s sizes
    left there. A guess, not a derivation: the check at a second binding of the open
    sizes catches a wrong one (and the input is then kept).
    """
    n, m = len(x), len(y)
    out = list(y)
    i = 0
    while i < min(n, m) and int(x[i]) == int(y[i]):
        out[i] = x[i]
        i += 1
    j = 0
    while j < min(n, m) - i and int(x[n - 1 - j]) == int(y[m - 1 - j]):
        out[m - 1 - j] = x[n - 1 - j]
        j += 1
    if m - i - j == 1 and n - i - j >= 1:
        rest = product(x[i:n - j])
        if int(rest) == int(y[i]):
            out[i] = rest
    return tuple(out)


def carried_sizes(ctx, ins, axis: int, allowzero: int) -> tuple | None:
    """The output sizes of an ONNX Reshape, Flatten, Squeeze or Unsqueeze, from its input's.

    Computed from the operator's definition (ONNX operator spec: Reshape's 0 copies the
    input's size at that position and -1 takes what is left; Flatten's two sizes are the
    products before and after ``axis``; Squeeze and Unsqueeze drop and insert sizes of 1),
    so that a size following an input's open size (:class:`~taso_jax.ops.dims.Dim`) keeps
    its expression where onnxruntime's symbolic shape inference gave none (its Flatten of
    an open batch is a fresh name). A Reshape whose target is computed at run time gets
    :func:`aligned_sizes`. ``None`` where the input has no open size, or the axes of a
    Squeeze or Unsqueeze are not constants.
    """
    x = tuple(ctx.type(ins[0]).shape)
    if not open_dims(x):
        return None
    op = ctx.source_op
    if op == "Flatten":
        a = axis + len(x) if axis < 0 else axis
        return (product(x[:a]), product(x[a:]))
    if op not in ("Reshape", "Squeeze", "Unsqueeze"):
        return None
    value = ctx.const(ins[1]) if len(ins) > 1 and ins[1] is not None else None
    if op == "Squeeze":
        axes = ({int(a) % len(x) for a in np.ravel(value)} if value is not None
                else {k for k, d in enumerate(x) if int(d) == 1 and not is_open(d)})
        return tuple(d for k, d in enumerate(x) if k not in axes)
    if value is None:
        return aligned_sizes(x, ctx.out_types[0].shape) if op == "Reshape" else None
    if op == "Unsqueeze":
        rank = len(x) + np.size(value)
        axes = {int(a) % rank for a in np.ravel(value)}
        rest = iter(x)
        return tuple(1 if k in axes else next(rest) for k in range(rank))
    out = [x[k] if t == 0 and not allowzero and k < len(x) else int(t)
           for k, t in enumerate(np.ravel(value).tolist())]
    if out.count(-1) == 1:
        k = out.index(-1)
        known = product(out[:k] + out[k + 1:])
        if int(known) == 0:
            return None
        out[k] = product(x) // known
    return tuple(out)


def from_end(v, d):
    """``-c`` where bound ``v`` is open size ``d`` less a constant ``c > 0`` at every binding.

    ONNX Slice counts a negative start or end from the back of the axis, so the written
    model slices the same part at every size without computing ``d`` at run time.
    """
    if d is None or not (is_open(v) or is_open(d)):
        return None
    diff = expr_of(d) - expr_of(v)
    return -int(diff) if diff.is_Integer and int(diff) > 0 else None


def open_bounds(bounds, s: int, e: int, st: int, d) -> tuple:
    """Slice ``bounds`` (Python's ``slice.indices`` at the bound size) over an open size ``d``.

    Where the axis's size is open (:class:`~taso_jax.ops.dims.Dim`), a start or end counted
    from the back (negative) or past the end is the size's expression plus the offset, so
    the written model slices the same part at other sizes; others stay as bound.
    """
    if not is_open(d) or st <= 0:
        return bounds
    start, stop, step = bounds
    if s < 0 and start == int(d) + s:
        start = d + s
    if e >= int(d) and stop == int(d):
        stop = d
    elif e < 0 and stop == int(d) + e:
        stop = d + e
    return start, stop, step


def runtime_bounds(s, e, st: int, d, extent) -> tuple:
    """Slice bounds on an axis of size ``d`` whose start or end is computed at run time.

    ``s`` or ``e`` is ``None`` where it comes from ``Shape`` arithmetic (as this project's
    export writes a bound at an open size): the other bound is taken as given, and the
    missing one where ``extent`` entries (the output's size, from ONNX shape inference,
    with its expression where open) begin or end. Forward steps only, and a step of 1
    where the start is missing (``ValueError``).
    """
    if st <= 0 or (s is None and st != 1) or (s is None and e is None):
        raise ValueError("a slice whose bounds are computed at run time")
    if s is None:  # the end as given, the start extent entries before it
        stop = open_bounds(slice(0, int(e), 1).indices(int(d)), 0, int(e), 1, d)[1]
        return stop - extent, stop, 1
    start = open_bounds(slice(int(s), int(d), st).indices(int(d)), int(s), int(d), st, d)[0]
    return start, start + st * (extent - 1) + 1 if int(extent) > 0 else start, st
