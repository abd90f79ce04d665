"""Built-in example graphs, written with the graph-builder API."""

from __future__ import annotations

from taso_jax.ir.graph import Graph, new_graph

__all__ = ["resnet_module"]


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
