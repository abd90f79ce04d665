"""Inception-v3 as in TASO's evaluation: input [1, 3, 299, 299] (NCHW); the stem, three
Inception-A, one B, four C (7x1 and 1x7 factorised), one D and two E modules, then global
average pooling (Szegedy et al., 2016). Convolutions carry a fused relu; no batchnorm."""

from __future__ import annotations

import taso_jax

SMALL = {"size": 75, "width": 0.125}


class _Net:
    def __init__(self, g, width: float):
        self.g, self.width = g, width

    def conv(self, x, out: int, k=(1, 1), stride: int = 1, padding="same"):
        out = max(1, round(out * self.width))
        w = self.g.new_weight((out, x.shape[1], *k))
        return self.g.conv2d(x, w, strides=(stride, stride), padding=padding,
                             activation="relu")

    def pool(self, x, kind: str, stride: int = 1, padding="same"):
        op = self.g.maxpool2d if kind == "max" else self.g.avgpool2d
        return op(x, kernel=(3, 3), strides=(stride, stride), padding=padding)

    def cat(self, *xs):
        return self.g.concat(*xs, axis=-3)

    def a(self, x, pool_features: int):
        c = self.conv
        return self.cat(c(x, 64), c(c(x, 48), 64, (5, 5)),
                        c(c(c(x, 64), 96, (3, 3)), 96, (3, 3)),
                        c(self.pool(x, "avg"), pool_features))

    def b(self, x):
        c = self.conv
        return self.cat(c(x, 384, (3, 3), 2, "valid"),
                        c(c(c(x, 64), 96, (3, 3)), 96, (3, 3), 2, "valid"),
                        self.pool(x, "max", 2, "valid"))

    def c7(self, x, mid: int):
        c = self.conv
        b7 = c(c(c(x, mid), mid, (1, 7)), 192, (7, 1))
        d = c(c(c(c(c(x, mid), mid, (7, 1)), mid, (1, 7)), mid, (7, 1)), 192, (1, 7))
        return self.cat(c(x, 192), b7, d, c(self.pool(x, "avg"), 192))

    def d(self, x):
        c = self.conv
        return self.cat(c(c(x, 192), 320, (3, 3), 2, "valid"),
                        c(c(c(c(x, 192), 192, (1, 7)), 192, (7, 1)), 192, (3, 3), 2, "valid"),
                        self.pool(x, "max", 2, "valid"))

    def e(self, x):
        c = self.conv
        b3 = c(x, 384)
        d = c(c(x, 448), 384, (3, 3))
        return self.cat(c(x, 320), c(b3, 384, (1, 3)), c(b3, 384, (3, 1)),
                        c(d, 384, (1, 3)), c(d, 384, (3, 1)), c(self.pool(x, "avg"), 192))


def build(size: int = 299, width: float = 1.0, seed: int = 0):
    """The model as a :class:`taso_jax.Graph`; ``width`` scales every channel count
    (75 is the smallest input size the valid-padded reductions allow)."""
    g = taso_jax.new_graph(seed)
    n = _Net(g, width)
    x = g.new_input((1, 3, size, size), name="input")
    x = n.conv(x, 32, (3, 3), 2, "valid")
    x = n.conv(x, 32, (3, 3), 1, "valid")
    x = n.pool(n.conv(x, 64, (3, 3)), "max", 2, "valid")
    x = n.pool(n.conv(n.conv(x, 80), 192, (3, 3), 1, "valid"), "max", 2, "valid")
    for pf in (32, 64, 64):
        x = n.a(x, pf)
    x = n.b(x)
    for mid in (128, 160, 160, 192):
        x = n.c7(x, mid)
    x = n.e(n.e(n.d(x)))
    x = g.reduce_mean(x, axes=(2, 3), keepdims=True)
    g.mark_output(x, "output")
    return g.graph()
