"""Built-in example graphs, written with the graph-builder API."""

from __future__ import annotations

from taso_jax.ir.graph import Graph, new_graph

__all__ = ["resnet_module", "nasrnn_cells", "example"]


def resnet_module(channels: int = 64, size: int = 28, seed: int = 0) -> Graph:
    """The ResNet-style module from TASO's README (two convolutions sharing one input).

    Input ``[1, channels, size, size]`` (NCHW); a 3x3 and a 1x1 convolution both read the
    input, the 3x3 branch has a second 3x3 convolution, and the branches are added and passed
    through relu. TASO's optimizer enlarges the 1x1 kernel to 3x3, concatenates the two
    kernels and runs one convolution whose output is split (TASO, Figure 1/README).
    """
    g = new_graph(seed)
    x = g.new_input(dims=(1, channels, size, size), name="input")
    w1 = g.new_weight(dims=(channels, channels, 3, 3), name="w1")
    w2 = g.new_weight(dims=(channels, channels, 1, 1), name="w2")
    w3 = g.new_weight(dims=(channels, channels, 3, 3), name="w3")
    left = g.conv2d(input=x, weight=w1, strides=(1, 1), padding="SAME")
    left = g.relu(left)
    left = g.conv2d(input=left, weight=w3, strides=(1, 1), padding="SAME")
    right = g.conv2d(input=x, weight=w2, strides=(1, 1), padding="SAME")
    out = g.relu(g.ewadd(left, right))
    g.mark_output(out, "output")
    return g.graph()


def nasrnn_cells(hidden: int = 512, steps: int = 2, seed: int = 0) -> Graph:
    """``steps`` NasRNN cells as in TASO's evaluation (Zoph and Le, 2017; TASO, Section 7).

    Inputs ``x0..x{steps-1}`` and ``h``, each ``[1, hidden]``; each cell computes eight
    pairs ``x @ W_i + h @ U_i`` (weights ``[hidden, hidden]``) and gates them pairwise into
    the new state, the output ``[1, hidden]``. The eight matmuls that share ``x`` (and the
    eight that share ``h``) merge into one matmul on concatenated weights, done once ahead
    of time: fewer, larger matrix-vector products, faster under ``jax.jit`` on a CPU and on
    a GPU alike.
    """
    g = new_graph(seed)
    h = g.new_input(dims=(1, hidden), name="h")
    for t in range(steps):
        x = g.new_input(dims=(1, hidden), name=f"x{t}")
        m = [g.ewadd(g.matmul(x, g.new_weight(dims=(hidden, hidden))),
                     g.matmul(h, g.new_weight(dims=(hidden, hidden)))) for _ in range(8)]
        s = [g.ewmul(g.sigmoid(m[0]), g.tanh(m[1])), g.ewmul(g.relu(m[2]), g.sigmoid(m[3])),
             g.ewmul(g.sigmoid(m[4]), g.tanh(m[5])), g.ewmul(g.tanh(m[6]), g.relu(m[7]))]
        h = g.tanh(g.ewmul(g.ewadd(s[0], s[1]), g.ewadd(s[2], s[3])))
    g.mark_output(h, "output")
    return g.graph()


def example(name: str = "nasrnn") -> tuple[Graph, str]:
    """``(graph, description)`` of the built-in example ``name`` (``taso-jax optimize``).

    ``"nasrnn"``: :func:`nasrnn_cells`, which the optimizer speeds up on a CPU and on a GPU;
    ``"resnet_module"``: :func:`resnet_module`, TASO's README example.

    Raises:
        KeyError: an unknown name.
    """
    if name == "nasrnn":
        return nasrnn_cells(), "built-in example: two NasRNN cells (TASO's NasRNN, hidden 512)"
    if name == "resnet_module":
        return resnet_module(), "built-in example: ResNet module from TASO's README"
    raise KeyError(f"no built-in example {name!r}")
