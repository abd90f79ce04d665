"""BERT-Large encoder layers as in TASO's evaluation: batch 16, sequence 64, hidden 1024,
16 heads, feed-forward 4096 (Devlin et al., 2019). Whole layers: attention with softmax,
the output projection, residual and layer norm, and the gelu feed-forward block."""

from __future__ import annotations

import numpy as np

import taso_jax

SMALL = {"batch": 2, "seq": 8, "hidden": 32, "heads": 4, "layers": 2}


def dense(g, x, n_in: int, n_out: int):
    """``x @ W + b`` with W [n_in, n_out] and b [n_out]."""
    return g.ewadd(g.matmul(x, g.new_weight((n_in, n_out))), g.new_weight((n_out,)))


def layer(g, x, batch: int, seq: int, hidden: int, heads: int):
    """One encoder layer on x [batch, seq, hidden] (post-norm, as in BERT)."""
    d = hidden // heads

    def split_heads(t):  # [B, S, H] -> [B, heads, S, d]
        return g.transpose(g.reshape(t, shape=(batch, seq, heads, d)), perm=(0, 2, 1, 3))

    q, k, v = (split_heads(dense(g, x, hidden, hidden)) for _ in range(3))
    scores = g.scalar_mul(g.matmul(q, g.transpose(k, perm=(0, 1, 3, 2))),
                          scalar=float(1 / np.sqrt(d)))
    ctx = g.matmul(g.softmax(scores, axis=-1), v)
    ctx = g.reshape(g.transpose(ctx, perm=(0, 2, 1, 3)), shape=(batch, seq, hidden))
    x = g.layernorm(g.ewadd(dense(g, ctx, hidden, hidden), x),
                    g.new_weight(data=np.ones(hidden, np.float32)),
                    g.new_weight(data=np.zeros(hidden, np.float32)), axis=-1)
    ff = dense(g, g.gelu(dense(g, x, hidden, 4 * hidden)), 4 * hidden, hidden)
    return g.layernorm(g.ewadd(ff, x), g.new_weight(data=np.ones(hidden, np.float32)),
                       g.new_weight(data=np.zeros(hidden, np.float32)), axis=-1)


def build(batch: int = 16, seq: int = 64, hidden: int = 1024, heads: int = 16, layers: int = 8,
          seed: int = 0):
    """The model as a :class:`taso_jax.Graph`; input ``[batch, seq, hidden]``. BERT-Large has
    24 layers; the default of 8 keeps compilation and search short (every layer is alike)."""
    g = taso_jax.new_graph(seed)
    x = g.new_input((batch, seq, hidden), name="input")
    for _ in range(layers):
        x = layer(g, x, batch, seq, hidden, heads)
    g.mark_output(x, "output")
    return g.graph()
