"""Window arithmetic shared by the convolution and pooling operators.

Padding attributes, ONNX pads and ``auto_pad``, and output sizes. A padding attribute is
``"same"`` (begin ``d*(k-1)//2``, end the rest), ``"valid"`` or an explicit ``(top, left,
bottom, right)`` tuple; ONNX's ``pads`` list the beginnings of the spatial axes, then their
ends (ONNX operator spec: Conv, MaxPool, AveragePool).
"""

from __future__ import annotations

from taso_jax.ops import ShapeError

__all__ = ["explicit_pads", "canonical_padding"]


def explicit_pads(padding, kernel_hw, dilations=(1, 1)) -> tuple[int, int, int, int]:
    """Padding attribute to explicit ``(top, left, bottom, right)`` in pixels."""
    if padding == "valid":
        return (0, 0, 0, 0)
    if padding == "same":
        tot = [d * (k - 1) for k, d in zip(kernel_hw, dilations, strict=True)]
        return (tot[0] // 2, tot[1] // 2, tot[0] - tot[0] // 2, tot[1] - tot[1] // 2)
    if isinstance(padding, tuple) and len(padding) == 4 and all(
            isinstance(p, int) for p in padding):
        return padding
    raise ShapeError("padding must be 'same', 'valid' or (top, left, bottom, right), "
                     f"got {padding!r}")


def canonical_padding(pads, kernel_hw, dilations=(1, 1)):
    """Explicit pads to ``"valid"``/``"same"`` when they agree, else the tuple."""
    pads = tuple(int(p) for p in pads)
    if pads == explicit_pads("same", kernel_hw, dilations):
        return "same"  # checked first: for a 1x1 kernel "same" and "valid" coincide
    if pads == (0, 0, 0, 0):
        return "valid"
    return pads


def _window_out(size, k, s, d, pb, pe):
    out = (size + pb + pe - d * (k - 1) - 1) // s + 1
    if out <= 0:
        raise ShapeError(f"window of size {k} does not fit input of size {size}")
    return out


def _same_upper_pads(in_hw, k_hw, strides, dilations, lower):
    pads = []
    for size, k, s, d in zip(in_hw, k_hw, strides, dilations, strict=True):
        out = -(-size // s)
        tot = max((out - 1) * s + d * (k - 1) + 1 - size, 0)
        pads.append((tot - tot // 2, tot // 2) if lower else (tot // 2, tot - tot // 2))
    return (pads[0][0], pads[1][0], pads[0][1], pads[1][1])


def _onnx_pads(ctx, x_hw, k_hw, strides, dilations, auto_pad, pads):
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        return _same_upper_pads(x_hw, k_hw, strides, dilations, auto_pad == "SAME_LOWER")
    if auto_pad == "VALID" or pads is None:
        return (0, 0, 0, 0)
    return tuple(int(p) for p in pads)
