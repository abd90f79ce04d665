"""NasNet-A as in TASO's evaluation: input [1, 3, 224, 224] (NCHW), three stages of five
normal cells joined by reduction cells, built from separable convolutions (relu, depthwise
k x k, pointwise 1x1), 3x3 pooling and additions (Zoph et al., 2018, Figure 4)."""

from __future__ import annotations

import taso_jax

SMALL = {"size": 32, "channels": 8, "cells": 1}


def _sep(g, x, k: int, stride: int = 1):
    ch = x.shape[1]
    t = g.conv2d(g.relu(x), g.new_weight((ch, 1, k, k)), strides=(stride, stride), groups=ch)
    return g.conv2d(t, g.new_weight((ch, ch, 1, 1)))


def _avg(g, x, stride: int = 1):
    return g.avgpool2d(x, kernel=(3, 3), strides=(stride, stride), padding="same")


def _max(g, x, stride: int = 1):
    return g.maxpool2d(x, kernel=(3, 3), strides=(stride, stride), padding="same")


def _fit(g, x, ch: int, size: int):
    """1x1 convolution to ``ch`` channels, with stride 2 when x is twice ``size``."""
    stride = 2 if x.shape[2] > size else 1
    return g.conv2d(g.relu(x), g.new_weight((ch, x.shape[1], 1, 1)), strides=(stride, stride))


def normal_cell(g, prev, cur, ch: int):
    """Five additions of two branches each, concatenated with the input: 6 ch channels."""
    p, c = _fit(g, prev, ch, cur.shape[2]), _fit(g, cur, ch, cur.shape[2])
    ys = [g.ewadd(_sep(g, c, 3), c), g.ewadd(_sep(g, p, 3), _sep(g, c, 5)),
          g.ewadd(_avg(g, c), p), g.ewadd(_avg(g, p), _avg(g, p)),
          g.ewadd(_sep(g, p, 5), _sep(g, p, 3))]
    return g.concat(p, *ys, axis=-3)


def reduction_cell(g, prev, cur, ch: int):
    """Halves the spatial size: 4 ch channels."""
    p, c = _fit(g, prev, ch, cur.shape[2]), _fit(g, cur, ch, cur.shape[2])
    y1 = g.ewadd(_sep(g, p, 7, 2), _sep(g, c, 5, 2))
    y2 = g.ewadd(_max(g, c, 2), _sep(g, p, 7, 2))
    y3 = g.ewadd(_avg(g, c, 2), _sep(g, p, 5, 2))
    y4 = g.ewadd(_max(g, c, 2), _sep(g, y1, 3))
    y5 = g.ewadd(_avg(g, y1), y2)
    return g.concat(y2, y3, y4, y5, axis=-3)


def build(size: int = 224, channels: int = 44, cells: int = 5, seed: int = 0):
    """The model as a :class:`taso_jax.Graph`: a stride-2 stem, two reduction cells, then
    three stages of ``cells`` normal cells with ``channels``, 2x and 4x channels."""
    g = taso_jax.new_graph(seed)
    x = g.new_input((1, 3, size, size), name="input")
    stem = g.conv2d(x, g.new_weight((channels, 3, 3, 3)), strides=(2, 2))
    prev, cur = stem, reduction_cell(g, stem, stem, channels // 2)
    prev, cur = cur, reduction_cell(g, stem, cur, channels)
    for stage in range(3):
        ch = channels * 2 ** stage
        if stage:
            prev, cur = cur, reduction_cell(g, prev, cur, ch)
        for _ in range(cells):
            prev, cur = cur, normal_cell(g, prev, cur, ch)
    g.mark_output(cur, "output")
    return g.graph()
