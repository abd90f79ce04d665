"""The cuDNN lowering of attention: ``jax.nn.dot_product_attention(implementation="cudnn")``.

``attention(q, kt, v, impl="cudnn")`` (and ``grouped_attention``) computes its definition
through cuDNN's fused (flash) attention kernel: one kernel for both products and the
softmax, the score matrix never stored, and, with ``is_causal``, the key tiles above the
diagonal never computed. The mask is passed as that flag, never as a mask tensor: on an
H200, cuDNN with an explicit mask ran about 2.6x slower than with the flag.

The operands are given as ``attention`` takes them (``q``: ``[..., N, Sq, D]``, ``kt``:
``[..., K, D, Sk]``, ``v``: ``[..., K, Sk, D]``, keys transposed, the scale already folded
into ``q``) and moved into the ``[batch, sequence, heads, head dim]`` layout that
``jax.nn.dot_product_attention`` reads, with ``scale=1``; ``N`` query heads share each of
the ``K`` K/V heads in groups of ``N / K`` (grouped-query attention), as both operators
define it.

Where it runs (:func:`cudnn_unavailable`): a CUDA GPU, float16 or bfloat16 operands, a
head dimension that is a multiple of 8 and at most 128 (256 on compute capability 9.0 and
later, Hopper), the same head dimension for queries and values. Elsewhere the reference
function computes the same values by einsums in the same layout (JAX's own XLA
implementation takes its softmax in float32, which a float64 check would see), so the
lowering's law is checked numerically on any machine (float64 on a CPU: the layout moves,
the grouping of heads, the scale and the causal flag), and the search applies no rule that
introduces the lowering where it cannot run (``OpDef.runs_here``). cuDNN accumulates in float32 and rounds the output to the
operands' type, as XLA's attention does, but in another order: the end-to-end output check
compares within the element type's tolerance.

Sources: ``jax.nn.dot_product_attention`` (JAX documentation: ``is_causal``,
``implementation``); cuDNN's fused flash attention (NVIDIA cuDNN frontend, "Scaled Dot
Product Attention"); FlashAttention (Dao et al., 2022).
"""

from __future__ import annotations

import functools

import numpy as np
from taso_jax.ops import ShapeError
from taso_jax.ops._lazy import LazyModule

jax = LazyModule("jax")
jnp = LazyModule("jax.numpy")

__all__ = ["check_cudnn_shapes", "cudnn_attention", "cudnn_unavailable"]

#: Element types cuDNN's fused attention takes (besides float8, which no graph here holds).
CUDNN_DTYPES = ("float16", "bfloat16")


@functools.cache
def _device() -> tuple[str, float]:
    """``(platform, compute capability)`` of JAX's default device (0.0 off CUDA)."""
    d = jax.devices()[0]
    cuda = d.platform == "gpu" and str(getattr(d, "device_kind", "")).startswith("NVIDIA")
    try:
        cc = float(getattr(d, "compute_capability", 0.0)) if cuda else 0.0
    except (TypeError, ValueError):
        cc = 0.0
    return ("cuda" if cuda else d.platform), cc


def cudnn_unavailable(q, kt, v) -> str | None:
    """Why cuDNN's fused attention cannot run on these operand types here, or ``None``.

    ``q``, ``kt``, ``v``: the :class:`~taso_jax.ops.TensorType` of ``attention``'s operands
    (any layout :func:`check_cudnn_shapes` accepts). The kernel runs in the values' type:
    scores taken in float32 from 16-bit operands (``jax.nn.dot_product_attention``'s form)
    are cast back first. Asks JAX's default device once.
    """
    platform, cc = _device()
    if platform != "cuda":
        return f"cuDNN attention needs a CUDA GPU (this device: {platform})"
    if str(v.dtype) not in CUDNN_DTYPES:
        return f"cuDNN attention takes float16 or bfloat16, not {v.dtype}"
    d, most = q.shape[-1], (256 if cc >= 9.0 else 128)
    if d % 8 or d > most or v.shape[-1] != d:
        return (f"cuDNN attention needs one head dimension, a multiple of 8 up to {most} "
                f"(queries {d}, values {v.shape[-1]})")
    return None


def check_cudnn_shapes(name: str, q, kt, v, *, reps: int, causal: bool, offset: int) -> None:
    """Raise ``ShapeError`` unless the cuDNN lowering computes ``name`` on these types.

    Needs heads on axis -3 (``q``: ``[..., N, Sq, D]``; ``kt``: ``[..., K, D, Sk]``;
    ``v``: ``[..., K, Sk, D]``) with ``N = reps * K`` and the same leading axes before them,
    the same head dimension ``D`` for queries and values, and, for causal attention, a
    square score matrix with the diagonal at offset 0 (the flag's mask).
    """
    if min(len(q.shape), len(kt.shape), len(v.shape)) < 3:
        raise ShapeError(f"{name}: the cuDNN lowering needs a heads axis, got {q.shape}")
    if not q.shape[:-3] == kt.shape[:-3] == v.shape[:-3] or kt.shape[-3] != v.shape[-3] \
            or q.shape[-3] != kt.shape[-3] * int(reps):
        raise ShapeError(f"{name}: the cuDNN lowering needs {reps} query heads per K/V head "
                         f"and the same batch axes, got {q.shape}, {kt.shape}, {v.shape}")
    if v.shape[-1] != q.shape[-1]:
        raise ShapeError(f"{name}: the cuDNN lowering needs values of the queries' head "
                         f"dimension, got {q.shape[-1]} and {v.shape[-1]}")
    if causal and (int(offset) != 0 or q.shape[-2] != kt.shape[-1]):
        raise ShapeError(f"{name}: the cuDNN lowering's causal flag masks a square score "
                         f"matrix at offset 0, not {q.shape[-2]}x{kt.shape[-1]} at {offset}")


def _bsnd(x):
    """``[..., N, S, D]`` -> ``[B, S, N, D]``, the leading axes flattened into ``B``."""
    n, s, d = x.shape[-3:]
    return jnp.swapaxes(x.reshape(-1, n, s, d), 1, 2)


def _einsum_attention(q, k, v, causal: bool):
    """What cuDNN computes, in its layout (``[B, S, heads, D]``), by einsums."""
    b, t, n, d = q.shape
    kv = k.shape[2]
    s = jnp.einsum("btkgd,bskd->bkgts", q.reshape(b, t, kv, n // kv, d), k)
    if causal:
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, jnp.asarray(-jnp.inf, s.dtype))
    out = jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(s, axis=-1), v)
    return out.reshape(b, t, n, v.shape[-1])


def cudnn_attention(q, kt, v, *, causal: bool):
    """``softmax(q @ kt [causal]) @ v`` through ``jax.nn.dot_product_attention``.

    ``q``: ``[..., N, Sq, D]``; ``kt``: ``[..., K, D, Sk]``; ``v``: ``[..., K, Sk, D]``,
    ``K`` dividing ``N``. Returns ``[..., N, Sq, D]``. cuDNN where
    :func:`cudnn_unavailable` finds nothing against it, else the same by einsums.
    """
    from taso_jax.ops import TensorType

    q, kt = q.astype(v.dtype), kt.astype(v.dtype)  # scores taken wider than the values
    args = (_bsnd(q), _bsnd(jnp.swapaxes(kt, -1, -2)), _bsnd(v))
    if cudnn_unavailable(*(TensorType(tuple(x.shape), str(x.dtype)) for x in (q, kt, v))):
        out = _einsum_attention(*args, bool(causal))
    else:
        out = jax.nn.dot_product_attention(*args, scale=1.0, is_causal=bool(causal),
                                           implementation="cudnn")
    return jnp.swapaxes(out, 1, 2).reshape(q.shape)


def causal_fraction(sq: int, sk: int, tile: int = 128) -> float:
    """The part of a causal ``[sq, sk]`` score matrix a tiled kernel computes (0..1].

    Tiles of ``tile`` queries by ``tile`` keys wholly above the diagonal are skipped, as
    cuDNN's flash attention does with its causal flag.
    """
    rows = np.arange(0, sq, tile)
    seen = sum(min(tile, sq - r) * min(sk, -(-(r + tile) // tile) * tile) for r in rows)
    return float(seen) / (sq * sk)
