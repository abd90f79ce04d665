"""ResNeXt-50 (32x4d) as in TASO's evaluation: input [1, 3, 224, 224] (NCHW); a 7x7 stem,
then stages of 3, 4, 6 and 3 blocks whose 3x3 convolution has 32 groups (Xie et al., 2017).
Convolutions carry a fused relu and no batchnorm."""

from __future__ import annotations

import taso_jax

SMALL = {"size": 32, "base": 16, "groups": 4, "blocks": (1, 1, 1, 1)}


def block(g, x, in_ch: int, width: int, out_ch: int, groups: int, stride: int):
    """1x1 (width) -> grouped 3x3 (width, ``groups`` groups, stride) -> 1x1 (out_ch)."""
    t = g.conv2d(x, g.new_weight((width, in_ch, 1, 1)), activation="relu")
    t = g.conv2d(t, g.new_weight((width, width // groups, 3, 3)), strides=(stride, stride),
                 groups=groups, activation="relu")
    t = g.conv2d(t, g.new_weight((out_ch, width, 1, 1)))
    if stride != 1 or in_ch != out_ch:
        x = g.conv2d(x, g.new_weight((out_ch, in_ch, 1, 1)), strides=(stride, stride))
    return g.relu(g.ewadd(t, x))


def build(size: int = 224, base: int = 64, groups: int = 32, blocks=(3, 4, 6, 3),
          seed: int = 0):
    """The model as a :class:`taso_jax.Graph`; widths 2*base, 4*base, ... per stage."""
    g = taso_jax.new_graph(seed)
    x = g.new_input((1, 3, size, size), name="input")
    x = g.conv2d(x, g.new_weight((base, 3, 7, 7)), strides=(2, 2), activation="relu")
    x = g.maxpool2d(x, kernel=(3, 3), strides=(2, 2), padding="same")
    ch = base
    for stage, n in enumerate(blocks):
        width, out = 2 * base * 2 ** stage, 4 * base * 2 ** stage
        for i in range(n):
            x = block(g, x, ch, width, out, groups, 2 if (i == 0 and stage > 0) else 1)
            ch = out
    g.mark_output(x, "output")
    return g.graph()
