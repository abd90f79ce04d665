"""ResNet-50 bottleneck stages as in TASO's evaluation: input [1, 64, 56, 56] (NCHW), stages
of 3, 4, 6 and 3 bottleneck blocks (He et al., 2016); convolutions carry a fused relu and no
batchnorm, as in TASO's example."""

from __future__ import annotations

import taso_jax

SMALL = {"size": 8, "width": 8, "blocks": (1, 1, 1, 1)}


def bottleneck(g, x, in_ch: int, width: int, stride: int):
    """One block: 1x1 (width) -> 3x3 (width, stride) -> 1x1 (4 width), plus the shortcut."""
    w1 = g.new_weight((width, in_ch, 1, 1))
    w2 = g.new_weight((width, width, 3, 3))
    w3 = g.new_weight((4 * width, width, 1, 1))
    t = g.conv2d(x, w1, activation="relu")
    t = g.conv2d(t, w2, strides=(stride, stride), activation="relu")
    t = g.conv2d(t, w3)
    if stride != 1 or in_ch != 4 * width:
        x = g.conv2d(x, g.new_weight((4 * width, in_ch, 1, 1)), strides=(stride, stride))
    return g.relu(g.ewadd(t, x))


def build(size: int = 56, width: int = 64, blocks=(3, 4, 6, 3), seed: int = 0):
    """The model as a :class:`taso_jax.Graph`; input ``[1, width, size, size]``."""
    g = taso_jax.new_graph(seed)
    x = g.new_input((1, width, size, size), name="input")
    ch = width
    for stage, n in enumerate(blocks):
        w = width * 2 ** stage
        for i in range(n):
            x = bottleneck(g, x, ch, w, 2 if (i == 0 and stage > 0) else 1)
            ch = 4 * w
    g.mark_output(x, "output")
    return g.graph()
