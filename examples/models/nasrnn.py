"""NasRNN as in TASO's evaluation: hidden size 512, batch 1, a sequence of cells; each cell
computes eight pairs ``x @ W_i + h @ U_i`` on the input and the state and combines them
(Zoph and Le, 2017; TASO's nasrnn example)."""

from __future__ import annotations

import taso_jax

SMALL = {"hidden": 32, "steps": 2}


def cell(g, x, h, hidden: int):
    """One cell: eight input/state matmul pairs, gated pairwise, combined into the new state."""
    m = [g.ewadd(g.matmul(x, g.new_weight((hidden, hidden))),
                 g.matmul(h, g.new_weight((hidden, hidden)))) for _ in range(8)]
    s = [g.ewmul(g.sigmoid(m[0]), g.tanh(m[1])), g.ewmul(g.relu(m[2]), g.sigmoid(m[3])),
         g.ewmul(g.sigmoid(m[4]), g.tanh(m[5])), g.ewmul(g.tanh(m[6]), g.relu(m[7]))]
    return g.tanh(g.ewmul(g.ewadd(s[0], s[1]), g.ewadd(s[2], s[3])))


def build(hidden: int = 512, steps: int = 5, batch: int = 1, seed: int = 0):
    """The model as a :class:`taso_jax.Graph`: inputs ``x0..x{steps-1}`` and ``h``, each
    ``[batch, hidden]``. Each step has its own weights; sharing them across steps would
    allow the same rewrites."""
    g = taso_jax.new_graph(seed)
    h = g.new_input((batch, hidden), name="h")
    for t in range(steps):
        h = cell(g, g.new_input((batch, hidden), name=f"x{t}"), h, hidden)
    g.mark_output(h, "output")
    return g.graph()
