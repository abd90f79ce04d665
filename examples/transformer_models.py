"""Transformer workloads as JAX users write them, for ``benchmarks/transformers.py``.

* plain JAX: naive multi-head causal self-attention (einsum, scale, ``jnp.where`` on a
  ``jnp.tril`` mask, ``jax.nn.softmax``, einsum) and the same through
  ``jax.nn.dot_product_attention(is_causal=True)``; a Llama-style decoder block (RMSNorm with
  gain, Q/K/V projections, RoPE, grouped-query attention with K/V heads repeated by
  ``jnp.repeat``, causal mask, output projection, residuals, SwiGLU MLP), as a prefill over
  ``S`` tokens and as one decode step against a KV cache of ``S`` positions; a two-layer MLP
  whose linears carry LoRA adapters, ``x @ W + s * (x @ A) @ B``; attention under constant
  masks built from ``jnp.arange`` (sliding window, prefix-LM, packed documents) and under
  ALiBi's per-head causal bias; a top-2-of-8 mixture-of-experts MLP in the dense
  formulation, on uniform and on skewed routing;
* library modules: flax NNX ``MultiHeadAttention`` with ``nnx.make_causal_mask``, equinox
  ``MultiheadAttention`` with a causal mask, and transformers' Flax BERT-base
  (``FlaxBertModel``) and GPT-2 small (``FlaxGPT2LMHeadModel``), built from their default
  configurations with random weights (no downloads; transformers < 5, which still has the
  Flax classes, is needed for these two and is not a dependency of the project).

Each ``make_*(seq, dtype, **sizes)`` returns ``(fn, weights, inputs)``: call
``fn(weights, *inputs)``. ``seq`` is the sequence length (the KV cache's length for the
decode step), ``dtype`` the element type of the float weights and inputs. Weights are
random, drawn by NumPy's generator with fixed seeds, so that building a model compiles
nothing: the library modules' parameters are filled in on the shapes their own initializers
give (``eval_shape``), with standard deviation 0.02 (BERT's and GPT-2's
``initializer_range``) and norm gains around 1. A maker raises :class:`Unavailable` where the model
cannot be built here (transformers missing, or ``seq`` past its position embeddings).
:data:`TINY` holds sizes at which every model runs in well under a second on a CPU.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["MODELS", "TINY", "Unavailable", "cast"]


class Unavailable(RuntimeError):
    """A model that cannot be built here; the message says why."""


def cast(tree, dtype: str):
    """``tree`` with its floating-point array leaves cast to ``dtype``."""
    return jax.tree_util.tree_map(
        lambda x: x.astype(dtype) if hasattr(x, "dtype") and x.dtype != dtype
        and jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _normal(rng: np.random.Generator, shape, scale: float = 1.0):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * np.float32(scale))


# ---- plain JAX ---------------------------------------------------------------------------


def _random_like(abstract, seed: int, std: float = 0.02):
    """Random arrays in the shapes and dtypes of ``abstract`` (a pytree of
    ``jax.ShapeDtypeStruct``); a leaf under a key ``scale`` (a norm's gain) is drawn around 1,
    every other around 0."""
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        gain = any(getattr(k, "key", getattr(k, "name", None)) == "scale" for k in path)
        x = (1.0 if gain else 0.0) + std * rng.standard_normal(leaf.shape, dtype=np.float32)
        return jnp.asarray(x, dtype=leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, abstract)


def _qkv(seq: int, batch: int, heads: int, head_dim: int, layout: str):
    shape = {"bhsd": (batch, heads, seq, head_dim), "bshd": (batch, seq, heads, head_dim)}
    rng = np.random.default_rng(1)
    return tuple(_normal(rng, shape[layout]) for _ in range(3))


def make_causal_attention(seq: int = 1024, dtype: str = "float32", batch: int = 1,
                          heads: int = 12, head_dim: int = 64):
    """Naive multi-head causal self-attention on ``q, k, v`` of shape ``[batch, heads, seq,
    head_dim]``; no weights (an empty dict)."""
    scale = head_dim ** -0.5

    def fn(w, q, k, v):
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * scale
        n = q.shape[2]
        s = jnp.where(jnp.tril(jnp.ones((n, n), dtype=bool)), s, -jnp.inf)
        return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)

    return fn, {}, cast(_qkv(seq, batch, heads, head_dim, "bhsd"), dtype)


def make_causal_attention_dpa(seq: int = 1024, dtype: str = "float32", batch: int = 1,
                              heads: int = 12, head_dim: int = 64):
    """:func:`make_causal_attention` through ``jax.nn.dot_product_attention(is_causal=True)``,
    on ``q, k, v`` in that function's layout, ``[batch, seq, heads, head_dim]``."""

    def fn(w, q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    return fn, {}, cast(_qkv(seq, batch, heads, head_dim, "bshd"), dtype)


def _rms_norm(x, gain, eps: float = 1e-6):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * gain


def _rope(x, positions, theta: float = 10000.0):
    """Rotary position embedding, rotate-half form, on ``x: [batch, seq, heads, head_dim]``."""
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[:, None].astype(jnp.float32) * freqs[None, :]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[None, :, None, :].astype(x.dtype)
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[None, :, None, :].astype(x.dtype)
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def _llama_weights(dim: int, heads: int, kv_heads: int, mlp: int):
    hd = dim // heads
    shapes = {"wq": (dim, heads * hd), "wk": (dim, kv_heads * hd), "wv": (dim, kv_heads * hd),
              "wo": (heads * hd, dim), "w_gate": (dim, mlp), "w_up": (dim, mlp),
              "w_down": (mlp, dim)}
    rng = np.random.default_rng(0)
    w = {name: _normal(rng, s, s[0] ** -0.5) for name, s in shapes.items()}
    for name in ("attn_norm", "mlp_norm"):
        w[name] = jnp.asarray(1 + 0.1 * rng.standard_normal(dim, dtype=np.float32))
    return w


def _llama_attention_in(w, x, positions, heads: int, kv_heads: int):
    """RMSNorm, Q/K/V projections and RoPE: ``q [b, s, heads, hd]``, ``k, v [b, s, kv, hd]``."""
    b, s, dim = x.shape
    hd = dim // heads
    h = _rms_norm(x, w["attn_norm"])
    q = (h @ w["wq"]).reshape(b, s, heads, hd)
    k = (h @ w["wk"]).reshape(b, s, kv_heads, hd)
    v = (h @ w["wv"]).reshape(b, s, kv_heads, hd)
    return _rope(q, positions), _rope(k, positions), v


def _llama_attention_out(w, x, q, k, v, mask, heads: int, kv_heads: int):
    """GQA (K/V repeated to every query head), masked softmax, output projection, residual,
    then the SwiGLU MLP with its residual."""
    b, s, dim = x.shape
    k = jnp.repeat(k, heads // kv_heads, axis=2)
    v = jnp.repeat(v, heads // kv_heads, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    scores = jnp.where(mask, scores, -jnp.inf)
    a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(b, s, dim)
    x = x + a @ w["wo"]
    h = _rms_norm(x, w["mlp_norm"])
    return x + (jax.nn.silu(h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"]


def make_llama_block(seq: int = 1024, dtype: str = "float32", batch: int = 1, dim: int = 512,
                     heads: int = 8, kv_heads: int = 2, mlp: int = 1408):
    """A Llama-style decoder block, prefill: ``x [batch, seq, dim]`` -> same shape."""
    w = _llama_weights(dim, heads, kv_heads, mlp)
    x = _normal(np.random.default_rng(1), (batch, seq, dim))

    def fn(w, x):
        s = x.shape[1]
        q, k, v = _llama_attention_in(w, x, jnp.arange(s), heads, kv_heads)
        mask = jnp.tril(jnp.ones((s, s), dtype=bool))
        return _llama_attention_out(w, x, q, k, v, mask, heads, kv_heads)

    return fn, cast(w, dtype), cast((x,), dtype)


def make_llama_decode(seq: int = 1024, dtype: str = "float32", batch: int = 1,
                      dim: int = 512, heads: int = 8, kv_heads: int = 2, mlp: int = 1408):
    """:func:`make_llama_block`, one decode step: the token ``x [batch, 1, dim]`` at position
    ``pos`` (int32 scalar) against a KV cache ``[batch, seq, kv_heads, head_dim]`` each for K
    and V. Its K and V are written into the cache at ``pos``; it attends to positions
    ``<= pos``. Returns ``(y, k_cache, v_cache)``. The inputs put ``pos`` at the cache's last
    slot, so the step attends to all ``seq`` positions."""
    w = _llama_weights(dim, heads, kv_heads, mlp)
    hd = dim // heads
    rng = np.random.default_rng(1)
    x = _normal(rng, (batch, 1, dim))
    k_cache = _normal(rng, (batch, seq, kv_heads, hd))
    v_cache = _normal(rng, (batch, seq, kv_heads, hd))
    pos = jnp.asarray(seq - 1, dtype=jnp.int32)

    def fn(w, x, k_cache, v_cache, pos):
        q, k, v = _llama_attention_in(w, x, pos[None], heads, kv_heads)
        k_cache = jax.lax.dynamic_update_slice(k_cache, k, (0, pos, 0, 0))
        v_cache = jax.lax.dynamic_update_slice(v_cache, v, (0, pos, 0, 0))
        mask = (jnp.arange(k_cache.shape[1]) <= pos)[None, :]
        return _llama_attention_out(w, x, q, k_cache, v_cache, mask, heads, kv_heads), \
            k_cache, v_cache

    return fn, cast(w, dtype), cast((x, k_cache, v_cache), dtype) + (pos,)


def make_lora_mlp(seq: int = 1024, dtype: str = "float32", batch: int = 1, dim: int = 1024,
                  hidden: int = 1024, rank: int = 16, alpha: float = 32.0):
    """Two linears with LoRA adapters and a GELU between, on ``x [batch, seq, dim]``; each
    linear is ``x @ W + s * (x @ A) @ B`` with ``s = alpha / rank`` (B random, as after
    fine-tuning)."""
    s = alpha / rank
    rng = np.random.default_rng(0)

    def linear(n_in, n_out):
        return {"w": _normal(rng, (n_in, n_out), n_in ** -0.5),
                "a": _normal(rng, (n_in, rank), n_in ** -0.5),
                "b": _normal(rng, (rank, n_out), 0.1 * rank ** -0.5)}

    w = {"fc1": linear(dim, hidden), "fc2": linear(hidden, dim)}
    x = _normal(np.random.default_rng(1), (batch, seq, dim))

    def fn(w, x):
        def lora(x, p):
            return x @ p["w"] + s * (x @ p["a"]) @ p["b"]

        return lora(jax.nn.gelu(lora(x, w["fc1"])), w["fc2"])

    return fn, cast(w, dtype), cast((x,), dtype)


def make_causal_attention_additive(seq: int = 1024, dtype: str = "float32", batch: int = 1,
                                   heads: int = 12, head_dim: int = 64):
    """:func:`make_causal_attention` with the causal mask added to the scores as a constant
    of 0 and ``-inf`` (``s + jnp.where(tril, 0, -inf)``), on ``[batch, heads, seq, head_dim]``."""
    scale = head_dim ** -0.5

    def fn(w, q, k, v):
        n = q.shape[2]
        bias = jnp.where(jnp.tril(jnp.ones((n, n), dtype=bool)), 0.0, -jnp.inf).astype(q.dtype)
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * scale + bias
        return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)

    return fn, {}, cast(_qkv(seq, batch, heads, head_dim, "bhsd"), dtype)


def _masked_scores(q, k, v, keep, fill, additive: bool):
    """``softmax(q k^T / sqrt(d) [masked]) v`` on ``[batch, heads, seq, head_dim]``: the
    constant boolean ``keep [seq, seq]`` added as ``jnp.where(keep, 0, fill)``
    (``additive``) or applied by ``jnp.where(keep, scores, fill)``."""
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5
    fill = jnp.asarray(fill, q.dtype)
    s = s + jnp.where(keep, jnp.asarray(0, q.dtype), fill) if additive \
        else jnp.where(keep, s, fill)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


def make_sliding_window_attention(seq: int = 2048, dtype: str = "float32", batch: int = 1,
                                  heads: int = 12, head_dim: int = 64, window: int = 256):
    """Causal attention over a sliding window (Longformer's and Mistral's local attention):
    query ``i`` sees keys ``i - window < j <= i``, the constant mask built from a
    ``jnp.arange`` comparison and added as 0 and ``-inf``; ``q, k, v [batch, heads, seq,
    head_dim]``."""

    def fn(w, q, k, v):
        i, j = jnp.arange(q.shape[2])[:, None], jnp.arange(q.shape[2])[None, :]
        return _masked_scores(q, k, v, (j <= i) & (j > i - window), -jnp.inf, True)

    return fn, {}, cast(_qkv(seq, batch, heads, head_dim, "bhsd"), dtype)


def make_prefix_lm_attention(seq: int = 1024, dtype: str = "float32", batch: int = 1,
                             heads: int = 12, head_dim: int = 64, prefix: int = 256):
    """Prefix-LM attention (T5's and UniLM's): the first ``prefix`` positions see each other
    in both directions, the rest causally; the constant boolean mask applied by
    ``jnp.where(keep, scores, finfo.min)``; ``q, k, v [batch, heads, seq, head_dim]``."""

    def fn(w, q, k, v):
        n = q.shape[2]
        keep = jnp.tril(jnp.ones((n, n), dtype=bool)) | (jnp.arange(n)[None, :] < prefix)
        return _masked_scores(q, k, v, keep, jnp.finfo(q.dtype).min, False)

    return fn, {}, cast(_qkv(seq, batch, heads, head_dim, "bhsd"), dtype)


def make_packed_documents_attention(seq: int = 2048, dtype: str = "float32", batch: int = 1,
                                    heads: int = 12, head_dim: int = 64, docs: int = 4):
    """Causal attention over ``docs`` documents packed into one sequence (block-diagonal
    causal): query ``i`` sees the keys ``j <= i`` of its own document; documents of unequal
    lengths (5, 3, 4, 4 parts in 16 for four), the document ids a constant array, the mask
    added as 0 and ``-1e9``; ``q, k, v [batch, heads, seq, head_dim]``."""
    parts = np.resize(np.asarray([5, 3, 4, 4]), docs)
    ids = np.repeat(np.arange(docs), np.diff(np.round(
        np.concatenate([[0], np.cumsum(parts)]) * seq / parts.sum()).astype(int)))

    def fn(w, q, k, v):
        doc = jnp.asarray(ids)
        i, j = jnp.arange(q.shape[2])[:, None], jnp.arange(q.shape[2])[None, :]
        keep = (doc[:, None] == doc[None, :]) & (j <= i)
        return _masked_scores(q, k, v, keep, -1e9, True)

    return fn, {}, cast(_qkv(seq, batch, heads, head_dim, "bhsd"), dtype)


def make_alibi_attention(seq: int = 1024, dtype: str = "float32", batch: int = 1,
                         heads: int = 12, head_dim: int = 64):
    """Causal attention with ALiBi biases (Press et al., "Train short, test long", ICLR 2022):
    head ``h`` of ``H`` (from 1) has the slope ``m_h = 2^(-8h/H)``; query ``i`` sees keys
    ``j <= i`` with the bias ``-m_h (i - j)`` added to its scaled scores, and ``-inf`` above
    the diagonal. The bias ``[1, heads, seq, seq]`` is built from ``jnp.arange`` in the
    traced function and added to the scores, as BLOOM's and MPT's attention code does;
    ``q, k, v [batch, heads, seq, head_dim]``."""

    def fn(w, q, k, v):
        n, h = q.shape[2], q.shape[1]
        slopes = 2.0 ** (-8.0 * jnp.arange(1, h + 1, dtype=q.dtype) / h)
        i, j = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
        distance = (i - j).astype(q.dtype)
        bias = jnp.where(j <= i, -slopes[:, None, None] * distance,
                         jnp.asarray(-jnp.inf, q.dtype))[None]
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5 + bias
        return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)

    return fn, {}, cast(_qkv(seq, batch, heads, head_dim, "bhsd"), dtype)


def make_moe_top2(seq: int = 256, dtype: str = "float32", batch: int = 1, dim: int = 512,
                  hidden: int = 1024, experts: int = 8, routing: str = "uniform"):
    """A top-2-of-``experts`` mixture-of-experts MLP in the dense formulation (Mixtral,
    Jiang et al. 2024; Shazeer et al., "Outrageously large neural networks", 2017).

    The tokens ``x [batch, seq, dim]`` are flattened to ``[T, dim]``; router logits
    ``x @ wr`` pick two experts per token (``jax.lax.top_k``), a softmax over the two gives
    their weights, and ``one_hot`` spreads them into a dense gate matrix ``[T, experts]``
    (zeros for the experts not chosen). Every expert (``relu(x @ w1[e]) @ w2[e]``,
    ``w1 [experts, dim, hidden]``, ``w2 [experts, hidden, dim]``) runs on every token, and
    the gates combine the results (``einsum("te,ted->td")``). ``routing="uniform"``: random
    router weights, which spread the tokens about evenly; ``"skewed"``: a router whose
    logits rank expert 0 first and expert 1 second for every token.

    Raises:
        ValueError: an unknown ``routing``.
    """
    if routing not in ("uniform", "skewed"):
        raise ValueError(f"moe_top2: routing {routing!r} is not 'uniform' or 'skewed'")
    rng = np.random.default_rng(0)
    wr = _normal(rng, (dim, experts), dim ** -0.5)
    if routing == "skewed":  # a large constant logit per expert, falling with its index
        wr = jnp.zeros((dim, experts)).at[0].set(-1.0 * jnp.arange(experts))
    w = {"router": wr, "w1": _normal(rng, (experts, dim, hidden), dim ** -0.5),
         "w2": _normal(rng, (experts, hidden, dim), hidden ** -0.5)}
    x = _normal(np.random.default_rng(1), (batch, seq, dim))
    if routing == "skewed":
        x = x.at[..., 0].set(1.0)  # the router reads feature 0 only

    def fn(w, x):
        tokens = x.reshape(-1, x.shape[-1])
        top, chosen = jax.lax.top_k(tokens @ w["router"], 2)
        gates = jnp.einsum("tk,tke->te", jax.nn.softmax(top, axis=-1),
                           jax.nn.one_hot(chosen, w["w1"].shape[0], dtype=x.dtype))
        h = jax.nn.relu(jnp.einsum("td,edh->teh", tokens, w["w1"]))
        y = jnp.einsum("teh,ehd->ted", h, w["w2"])
        return jnp.einsum("te,ted->td", gates, y).reshape(x.shape)

    return fn, cast(w, dtype), cast((x,), dtype)


def make_moe_top2_skewed(seq: int = 256, dtype: str = "float32", batch: int = 1,
                         dim: int = 512, hidden: int = 1024, experts: int = 8):
    """:func:`make_moe_top2` with ``routing="skewed"``: every token goes to experts 0 and 1."""
    return make_moe_top2(seq, dtype, batch, dim, hidden, experts, routing="skewed")


def make_masked_attention(seq: int = 1024, dtype: str = "float32", batch: int = 1,
                          heads: int = 12, head_dim: int = 64):
    """Attention with an additive padding mask read at run time, ``[batch, 1, seq, seq]`` of
    0 and ``finfo.min`` (the last quarter of the keys masked), added to the scaled scores;
    ``q, k, v`` are ``[batch, heads, seq, head_dim]``."""
    scale = head_dim ** -0.5

    def fn(w, q, k, v, mask):
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * scale + mask
        return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)

    keep = np.arange(seq) < seq - seq // 4
    mask = np.where(keep, 0.0, np.finfo(np.float32).min).astype(np.float32)
    mask = np.broadcast_to(mask, (batch, 1, seq, seq))
    return fn, {}, cast((*_qkv(seq, batch, heads, head_dim, "bhsd"), jnp.asarray(mask)), dtype)


def make_gqa_causal_attention(seq: int = 1024, dtype: str = "float32", batch: int = 1,
                              heads: int = 12, kv_heads: int = 4, head_dim: int = 64):
    """Causal grouped-query attention written for plain attention: ``k, v [batch, seq,
    kv_heads, head_dim]`` repeated to the ``heads`` of ``q [batch, seq, heads, head_dim]``."""
    rng = np.random.default_rng(1)
    q = _normal(rng, (batch, seq, heads, head_dim))
    k, v = (_normal(rng, (batch, seq, kv_heads, head_dim)) for _ in range(2))

    def fn(w, q, k, v):
        k, v = (jnp.repeat(t, heads // kv_heads, axis=2) for t in (k, v))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)
        n = q.shape[1]
        s = jnp.where(jnp.tril(jnp.ones((n, n), dtype=bool)), s, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    return fn, {}, cast((q, k, v), dtype)



def make_gqa_causal_attention_dpa(seq: int = 1024, dtype: str = "float32", batch: int = 1,
                                  heads: int = 12, kv_heads: int = 4, head_dim: int = 64):
    """Causal grouped-query attention through ``jax.nn.dot_product_attention(is_causal=True)``
    with ``k, v [batch, seq, kv_heads, head_dim]`` and ``q [batch, seq, heads, head_dim]``:
    the function groups the query heads itself (a ``[batch, seq, kv_heads, heads // kv_heads,
    head_dim]`` view), no K/V copies."""
    rng = np.random.default_rng(1)
    q = _normal(rng, (batch, seq, heads, head_dim))
    k, v = (_normal(rng, (batch, seq, kv_heads, head_dim)) for _ in range(2))

    def fn(w, q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    return fn, {}, cast((q, k, v), dtype)

# ---- library modules ---------------------------------------------------------------------


def make_linen_attention(seq: int = 1024, dtype: str = "float32", batch: int = 1,
                         heads: int = 12, head_dim: int = 64):
    """flax.linen's ``dot_product_attention`` with ``linen.make_causal_mask``, on ``q, k, v``
    of shape ``[batch, seq, heads, head_dim]``; no weights."""
    try:
        from flax import linen
    except ImportError as e:
        raise Unavailable("flax not installed") from e

    def fn(w, q, k, v):
        mask = linen.make_causal_mask(jnp.ones(q.shape[:2]))
        return linen.dot_product_attention(q, k, v, mask=mask)

    return fn, {}, cast(_qkv(seq, batch, heads, head_dim, "bshd"), dtype)


def make_nnx_attention(seq: int = 1024, dtype: str = "float32", batch: int = 1,
                       dim: int = 768, heads: int = 12):
    """flax NNX ``MultiHeadAttention`` (self-attention) with ``nnx.make_causal_mask``, on
    ``x [batch, seq, dim]``; the weights are the module's ``nnx.State``."""
    from flax import nnx

    def module():
        return nnx.MultiHeadAttention(num_heads=heads, in_features=dim, decode=False,
                                      dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))

    graphdef, abstract = nnx.split(nnx.eval_shape(module))
    state = _random_like(abstract, seed=0)
    x = _normal(np.random.default_rng(1), (batch, seq, dim))

    def fn(state, x):
        return nnx.merge(graphdef, state)(x, mask=nnx.make_causal_mask(x[..., 0]))

    return fn, state, cast((x,), dtype)


def make_eqx_attention(seq: int = 1024, dtype: str = "float32", batch: int = 1,
                       dim: int = 768, heads: int = 12):
    """equinox ``MultiheadAttention`` (self-attention) with a causal ``[seq, seq]`` mask,
    vmapped over ``x [batch, seq, dim]``."""
    import equinox as eqx

    def module():
        return eqx.nn.MultiheadAttention(heads, dim, key=jax.random.key(0))

    abstract, static = eqx.partition(eqx.filter_eval_shape(module),
                                     lambda x: isinstance(x, jax.ShapeDtypeStruct))
    params = _random_like(abstract, seed=0)
    x = _normal(np.random.default_rng(1), (batch, seq, dim))

    def fn(params, x):
        m = eqx.combine(params, static)
        mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), dtype=bool))
        return jax.vmap(lambda t: m(t, t, t, mask=mask))(x)

    return fn, cast(params, dtype), cast((x,), dtype)


def _transformers(*names: str):
    """The named transformers classes, or :class:`Unavailable` saying why not."""
    try:
        import transformers
    except ImportError as e:
        raise Unavailable("transformers not installed") from e
    try:
        return [getattr(transformers, n) for n in names]
    except (AttributeError, ImportError) as e:
        raise Unavailable(f"transformers {transformers.__version__} has no Flax classes "
                          f"(removed in v5; pip install 'transformers<5'): {e}") from e


def _hf(model_cls, config, seq: int, dtype: str, batch: int, out: str):
    limit = config.max_position_embeddings  # GPT2Config maps it to n_positions
    if seq > limit:
        raise Unavailable(f"S={seq} is past its {limit} position embeddings")
    model = model_cls(config, dtype=jnp.dtype(dtype), _do_init=False)
    abstract = jax.eval_shape(lambda key: model.init_weights(key, (1, 1)),
                              jax.random.PRNGKey(0))
    params = _random_like(abstract, seed=0, std=config.initializer_range)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, config.vocab_size, (batch, seq)),
                      dtype=jnp.int32)

    def fn(params, ids):
        return getattr(model(ids, params=params), out)

    return fn, cast(params, dtype), (ids,)


def make_hf_bert(seq: int = 128, dtype: str = "float32", batch: int = 1, **config):
    """transformers' ``FlaxBertModel`` (BERT-base by default: ``BertConfig(**config)``) on
    token ids ``[batch, seq]``; returns the last hidden state."""
    model_cls, config_cls = _transformers("FlaxBertModel", "BertConfig")
    return _hf(model_cls, config_cls(**config), seq, dtype, batch, "last_hidden_state")


def make_hf_gpt2(seq: int = 128, dtype: str = "float32", batch: int = 1, **config):
    """transformers' ``FlaxGPT2LMHeadModel`` (GPT-2 small by default: ``GPT2Config(**config)``)
    on token ids ``[batch, seq]``; returns the logits."""
    model_cls, config_cls = _transformers("FlaxGPT2LMHeadModel", "GPT2Config")
    return _hf(model_cls, config_cls(**config), seq, dtype, batch, "logits")


def make_hf_llama(seq: int = 1024, dtype: str = "float32", batch: int = 1, **config):
    """transformers' ``FlaxLlamaForCausalLM`` on token ids ``[batch, seq]``; returns the logits.

    A small Llama by default (2 layers, width 512, 8 query heads over 2 key/value heads, an
    MLP of 1408, 1,000 tokens): ``LlamaConfig(**config)`` over those defaults."""
    model_cls, config_cls = _transformers("FlaxLlamaForCausalLM", "LlamaConfig")
    return _hf(model_cls, config_cls(**{**_SMALL_DECODER, **config}), seq, dtype, batch,
               "logits")


def make_hf_mistral(seq: int = 1024, dtype: str = "float32", batch: int = 1, **config):
    """transformers' ``FlaxMistralForCausalLM`` on token ids ``[batch, seq]``; returns the
    logits. The small decoder of :func:`make_hf_llama`, its sliding window 4096 (past
    ``seq``) unless ``config`` sets one."""
    model_cls, config_cls = _transformers("FlaxMistralForCausalLM", "MistralConfig")
    return _hf(model_cls, config_cls(**{**_SMALL_DECODER, "sliding_window": 4096, **config}),
               seq, dtype, batch, "logits")


#: The small decoder configuration of :func:`make_hf_llama` and :func:`make_hf_mistral`.
_SMALL_DECODER = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 2,
                  "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000,
                  "max_position_embeddings": 2048}


MODELS = {"causal_attention": make_causal_attention,
          "causal_attention_dpa": make_causal_attention_dpa,
          "causal_attention_additive": make_causal_attention_additive,
          "masked_attention": make_masked_attention,
          "sliding_window_attention": make_sliding_window_attention,
          "prefix_lm_attention": make_prefix_lm_attention,
          "packed_documents_attention": make_packed_documents_attention,
          "alibi_attention": make_alibi_attention,
          "moe_top2": make_moe_top2, "moe_top2_skewed": make_moe_top2_skewed,
          "gqa_causal_attention": make_gqa_causal_attention,
          "gqa_causal_attention_dpa": make_gqa_causal_attention_dpa,
          "linen_attention": make_linen_attention,
          "llama_block": make_llama_block, "llama_decode": make_llama_decode,
          "lora_mlp": make_lora_mlp, "nnx_attention": make_nnx_attention,
          "eqx_attention": make_eqx_attention, "hf_bert": make_hf_bert,
          "hf_gpt2": make_hf_gpt2, "hf_llama": make_hf_llama, "hf_mistral": make_hf_mistral}

#: Sizes (keyword arguments besides ``seq`` and ``dtype``) at which each model is tiny.
TINY = {"causal_attention": {"heads": 2, "head_dim": 8},
        "causal_attention_dpa": {"heads": 2, "head_dim": 8},
        "causal_attention_additive": {"heads": 2, "head_dim": 8},
        "masked_attention": {"heads": 2, "head_dim": 8},
        "sliding_window_attention": {"heads": 2, "head_dim": 8, "window": 4},
        "prefix_lm_attention": {"heads": 2, "head_dim": 8, "prefix": 4},
        "packed_documents_attention": {"heads": 2, "head_dim": 8},
        "alibi_attention": {"heads": 2, "head_dim": 8},
        "moe_top2": {"dim": 16, "hidden": 24},
        "moe_top2_skewed": {"dim": 16, "hidden": 24},
        "gqa_causal_attention": {"heads": 4, "kv_heads": 2, "head_dim": 8},
        "gqa_causal_attention_dpa": {"heads": 4, "kv_heads": 2, "head_dim": 8},
        "linen_attention": {"heads": 2, "head_dim": 8},
        "llama_block": {"dim": 32, "heads": 4, "kv_heads": 2, "mlp": 48},
        "llama_decode": {"dim": 32, "heads": 4, "kv_heads": 2, "mlp": 48},
        "lora_mlp": {"dim": 32, "hidden": 48, "rank": 4},
        "nnx_attention": {"dim": 32, "heads": 4},
        "eqx_attention": {"dim": 32, "heads": 4},
        "hf_bert": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
                    "intermediate_size": 64, "vocab_size": 100, "max_position_embeddings": 64},
        "hf_gpt2": {"n_embd": 32, "n_layer": 1, "n_head": 4, "vocab_size": 100,
                    "n_positions": 64},
        "hf_llama": {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
                     "max_position_embeddings": 64},
        "hf_mistral": {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
                       "max_position_embeddings": 64}}
