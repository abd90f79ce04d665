"""Real JAX model definitions used by the tests and benchmarks of ``@taso_jax.optimize``.

* flax.linen: a ResNet-50 (bottleneck stages 3-4-6-3, NHWC, batchnorm in inference mode) and
  a BERT-style transformer encoder block (multi-head self-attention with a mask, layer norm,
  GELU feed-forward);
* equinox: an MLP and a small conv net (NCHW, per-example, vmapped over the batch);
* library layers assembled as their users assemble them: a flax LSTM run by ``nn.RNN`` (a
  ``scan``), a ViT-style block, equinox's multi-head attention, and a causal language model
  on integer token ids (``nn.Embed``, ``jax.nn.dot_product_attention``);
* written the way other projects write them: a CNN in the style of flax's MNIST example
  (batchnorm, average pooling, NHWC) and the ResNet of jax's own ``examples/resnet50.py``
  from ``jax.example_libraries.stax`` (HWCN input, two stages);
* plain JAX: a NasRNN-style recurrent cell (Pham et al., ENAS, 2018; the cell TASO evaluates):
  eight pairs of matmuls on the input and on the hidden state, combined elementwise, on
  ``[batch, hidden]`` rows or on 1-D vectors; and a tiny single-head attention function.

Each ``make_*`` returns ``(fn, weights, inputs)``: call ``fn(weights, *inputs)``; weights are
random (``jax.random`` with a fixed key).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def make_flax_resnet50(batch: int = 1, size: int = 64, width: int = 16, classes: int = 100):
    """flax.linen ResNet-50 on ``[batch, size, size, 3]`` (NHWC); ``width`` is the stem
    width (64 in the paper; smaller keeps CPU tests fast)."""
    import flax.linen as nn

    class Bottleneck(nn.Module):
        filters: int
        strides: int = 1

        @nn.compact
        def __call__(self, x):
            norm = lambda: nn.BatchNorm(use_running_average=True)  # noqa: E731
            y = nn.relu(norm()(nn.Conv(self.filters, (1, 1), use_bias=False)(x)))
            y = nn.Conv(self.filters, (3, 3), (self.strides, self.strides), use_bias=False)(y)
            y = nn.relu(norm()(y))
            y = norm()(nn.Conv(self.filters * 4, (1, 1), use_bias=False)(y))
            if x.shape[-1] != self.filters * 4 or self.strides != 1:
                x = nn.Conv(self.filters * 4, (1, 1), (self.strides, self.strides),
                            use_bias=False)(x)
                x = norm()(x)
            return nn.relu(x + y)

    class ResNet50(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Conv(width, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], use_bias=False)(x)
            x = nn.relu(nn.BatchNorm(use_running_average=True)(x))
            x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
            for i, blocks in enumerate((3, 4, 6, 3)):
                for j in range(blocks):
                    x = Bottleneck(width * 2 ** i, strides=2 if i > 0 and j == 0 else 1)(x)
            x = jnp.mean(x, axis=(1, 2))
            return nn.Dense(classes)(x)

    model = ResNet50()
    x = jax.random.normal(jax.random.key(1), (batch, size, size, 3))
    variables = model.init(jax.random.key(0), x)
    variables = _perturb_batch_stats(variables)
    return (lambda v, x: model.apply(v, x)), variables, (x,)


def _perturb_batch_stats(variables):
    """Random running statistics, so that batchnorm is not the identity."""
    if "batch_stats" not in variables:
        return variables
    leaves, tree = jax.tree_util.tree_flatten(variables["batch_stats"])
    keys = jax.random.split(jax.random.key(7), len(leaves))
    new = [jax.random.uniform(k, x.shape, minval=0.5, maxval=1.5) if i % 2 else
           0.1 * jax.random.normal(k, x.shape)
           for i, (k, x) in enumerate(zip(keys, leaves, strict=True))]
    return {**variables, "batch_stats": jax.tree_util.tree_unflatten(tree, new)}


def make_flax_bert_block(batch: int = 2, seq: int = 16, hidden: int = 64, heads: int = 4):
    """flax.linen BERT-style encoder block on ``[batch, seq, hidden]`` with a padding mask."""
    import flax.linen as nn

    class EncoderBlock(nn.Module):
        @nn.compact
        def __call__(self, x, mask):
            a = nn.MultiHeadDotProductAttention(num_heads=heads)(x, x, mask=mask)
            x = nn.LayerNorm()(x + a)
            h = nn.Dense(4 * hidden)(x)
            h = nn.Dense(hidden)(nn.gelu(h))
            return nn.LayerNorm()(x + h)

    model = EncoderBlock()
    x = jax.random.normal(jax.random.key(1), (batch, seq, hidden))
    lengths = jnp.arange(batch) % seq + seq // 2
    valid = jnp.arange(seq)[None, :] < lengths[:, None]
    mask = (valid[:, None, None, :] & valid[:, None, :, None])
    variables = model.init(jax.random.key(0), x, mask)
    return (lambda v, x, m: model.apply(v, x, m)), variables, (x, mask)


def make_eqx_mlp(batch: int = 8, width: int = 64, depth: int = 3):
    """equinox MLP (``in 32 -> width x depth -> 10``), vmapped over the batch."""
    import equinox as eqx

    mlp = eqx.nn.MLP(32, 10, width, depth, key=jax.random.key(0))
    params, static = eqx.partition(mlp, eqx.is_array)
    x = jax.random.normal(jax.random.key(1), (batch, 32))

    def fn(params, x):
        return jax.vmap(eqx.combine(params, static))(x)

    return fn, params, (x,)


def make_eqx_convnet(batch: int = 4, size: int = 16):
    """equinox conv net (NCHW per example): two 3x3 convs with ReLU, pooling, a linear head."""
    import equinox as eqx

    class ConvNet(eqx.Module):
        c1: eqx.nn.Conv2d
        c2: eqx.nn.Conv2d
        c3: eqx.nn.Conv2d
        head: eqx.nn.Linear

        def __init__(self, key):
            k1, k2, k3, k4 = jax.random.split(key, 4)
            self.c1 = eqx.nn.Conv2d(3, 16, 3, padding=1, key=k1)
            self.c2 = eqx.nn.Conv2d(16, 16, 3, padding=1, key=k2)
            self.c3 = eqx.nn.Conv2d(16, 16, 1, key=k3)
            self.head = eqx.nn.Linear(16, 10, key=k4)

        def __call__(self, x):
            x = jax.nn.relu(self.c1(x))
            x = jax.nn.relu(self.c2(x)) + jax.nn.relu(self.c3(x))
            return self.head(jnp.mean(x, axis=(1, 2)))

    net = ConvNet(jax.random.key(0))
    params, static = eqx.partition(net, eqx.is_array)
    x = jax.random.normal(jax.random.key(1), (batch, 3, size, size))

    def fn(params, x):
        return jax.vmap(eqx.combine(params, static))(x)

    return fn, params, (x,)


def make_flax_cnn_bn(batch: int = 8, size: int = 28):
    """flax.linen CNN in the style of flax's MNIST example, with inference batchnorm (NHWC).

    Two blocks of 3x3 convolution, ``BatchNorm(use_running_average=True)``, ReLU and a 2x2
    ``nn.avg_pool``; then dense 128, ReLU, dense 10. Its pools sit between NHWC activations:
    the layout candidate runs them in NHWC (``avgpool2d_nhwc``).
    """
    import flax.linen as nn

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            for features in (32, 64):
                x = nn.Conv(features, (3, 3))(x)
                x = nn.BatchNorm(use_running_average=True)(x)
                x = nn.avg_pool(nn.relu(x), (2, 2), (2, 2))
            x = x.reshape((x.shape[0], -1))
            return nn.Dense(10)(nn.relu(nn.Dense(128)(x)))

    model = CNN()
    x = jax.random.normal(jax.random.key(1), (batch, size, size, 1))
    variables = _perturb_batch_stats(model.init(jax.random.key(0), x))
    return (lambda v, x: model.apply(v, x)), variables, (x,)


def make_stax_resnet(batch: int = 2, size: int = 32, width: int = 16):
    """The ResNet of jax's own ``examples/resnet50.py``, built from
    ``jax.example_libraries.stax`` as that example builds it, cut to its first two stages:
    an HWCN input, ``GeneralConv`` stem, ``stax.BatchNorm`` (batch statistics: stax has no
    inference mode), max pooling, bottleneck blocks (``FanOut``/``parallel``/``FanInSum``),
    average pooling, dense and log-softmax. ``width`` is the stem's channels (64 there).
    """
    from jax.example_libraries import stax

    def conv_block(ks, filters, strides=(2, 2)):
        f1, f2, f3 = filters
        main = stax.serial(stax.Conv(f1, (1, 1), strides), stax.BatchNorm(), stax.Relu,
                           stax.Conv(f2, (ks, ks), padding="SAME"), stax.BatchNorm(),
                           stax.Relu, stax.Conv(f3, (1, 1)), stax.BatchNorm())
        shortcut = stax.serial(stax.Conv(f3, (1, 1), strides), stax.BatchNorm())
        return stax.serial(stax.FanOut(2), stax.parallel(main, shortcut), stax.FanInSum,
                           stax.Relu)

    def identity_block(ks, filters):
        f1, f2 = filters

        def make_main(input_shape):
            return stax.serial(stax.Conv(f1, (1, 1)), stax.BatchNorm(), stax.Relu,
                               stax.Conv(f2, (ks, ks), padding="SAME"), stax.BatchNorm(),
                               stax.Relu, stax.Conv(input_shape[3], (1, 1)), stax.BatchNorm())

        return stax.serial(stax.FanOut(2), stax.parallel(stax.shape_dependent(make_main),
                                                         stax.Identity),
                           stax.FanInSum, stax.Relu)

    w = width
    init, apply = stax.serial(
        stax.GeneralConv(("HWCN", "OIHW", "NHWC"), w, (7, 7), (2, 2), "SAME"),
        stax.BatchNorm(), stax.Relu, stax.MaxPool((3, 3), strides=(2, 2)),
        conv_block(3, [w, w, 4 * w], strides=(1, 1)), identity_block(3, [w, w]),
        conv_block(3, [2 * w, 2 * w, 8 * w]), identity_block(3, [2 * w, 2 * w]),
        stax.AvgPool((size // 8 - 1, size // 8 - 1)), stax.Flatten, stax.Dense(10),
        stax.LogSoftmax)
    shape = (size, size, 3, batch)  # HWCN, as the example feeds it
    _, params = init(jax.random.key(0), shape)
    x = jax.random.normal(jax.random.key(1), shape)
    return apply, params, (x,)


def make_nasrnn(batch: int = 1, hidden: int = 512, steps: int = 4):
    """NasRNN-style cell unrolled ``steps`` times: per step, eight matmuls on the input ``x``
    and eight on the state ``h`` (weights ``[hidden, hidden]``), combined pairwise."""
    keys = jax.random.split(jax.random.key(0), 16)
    scale = hidden ** -0.5
    weights = {"wx": [scale * jax.random.normal(k, (hidden, hidden)) for k in keys[:8]],
               "wh": [scale * jax.random.normal(k, (hidden, hidden)) for k in keys[8:]]}
    xs = jax.random.normal(jax.random.key(1), (steps, batch, hidden))
    h0 = jnp.zeros((batch, hidden))

    def cell(w, x, h):
        m = [x @ a + h @ b for a, b in zip(w["wx"], w["wh"], strict=True)]
        s = [jax.nn.sigmoid(m[0]) * jnp.tanh(m[1]), jax.nn.relu(m[2]) * jax.nn.sigmoid(m[3]),
             jax.nn.sigmoid(m[4]) * jnp.tanh(m[5]), jnp.tanh(m[6]) * jax.nn.relu(m[7])]
        return jnp.tanh((s[0] + s[1]) * (s[2] + s[3]))

    def fn(w, xs, h):
        for t in range(xs.shape[0]):
            h = cell(w, xs[t], h)
        return h

    return fn, weights, (xs, h0)


def hand_merged_nasrnn(fn, weights, inputs):
    """NasRNN (either form) rewritten by hand as TASO's merges leave it: per step one
    ``x @ Wx + h @ Wh`` with the eight weights of each side concatenated ahead of time, then
    split. A ceiling to read the optimizer's speedup against, timed in the same loop.

    Returns ``(hand_fn, hand_weights)``: call ``hand_fn(hand_weights, *inputs)``.
    """
    merged = {"wx": jnp.concatenate(weights["wx"], axis=1),
              "wh": jnp.concatenate(weights["wh"], axis=1)}

    def hand(w, xs, h):
        for t in range(xs.shape[0]):
            m = jnp.split(xs[t] @ w["wx"] + h @ w["wh"], 8, axis=-1)
            s = [jax.nn.sigmoid(m[0]) * jnp.tanh(m[1]), jax.nn.relu(m[2]) * jax.nn.sigmoid(m[3]),
                 jax.nn.sigmoid(m[4]) * jnp.tanh(m[5]), jnp.tanh(m[6]) * jax.nn.relu(m[7])]
            h = jnp.tanh((s[0] + s[1]) * (s[2] + s[3]))
        return h

    return hand, merged


def make_nasrnn_1d(hidden: int = 512, steps: int = 2):
    """The NasRNN cell of :func:`make_nasrnn` on 1-D vectors: ``x`` and ``h`` of shape
    ``(hidden,)``, so every matmul is ``vector @ matrix``."""
    fn, weights, (xs, h0) = make_nasrnn(batch=1, hidden=hidden, steps=steps)
    return fn, weights, (xs[:, 0, :], h0[0])


def make_tiny_attention(batch: int = 2, seq: int = 5, dim: int = 3):
    """Single-head attention on ``[batch, seq, dim]``: a function of a few microseconds, where
    only the decorator's own per-call work can show."""
    keys = jax.random.split(jax.random.key(2), 4)
    weights = {k: jax.random.normal(kk, (dim, dim)) for k, kk in zip("qkv", keys[:3], strict=True)}
    x = jax.random.normal(keys[3], (batch, seq, dim))

    def fn(w, x):
        q, k, v = x @ w["q"], x @ w["k"], x @ w["v"]
        a = jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) * dim ** -0.5, axis=-1)
        return a @ v

    return fn, weights, (x,)


def make_flax_lstm(batch: int = 2, steps: int = 10, features: int = 32, hidden: int = 64):
    """flax.linen ``nn.RNN(nn.LSTMCell)`` over ``[batch, steps, features]``: a ``scan``."""
    import flax.linen as nn

    model = nn.RNN(nn.LSTMCell(hidden))
    x = jax.random.normal(jax.random.key(1), (batch, steps, features))
    variables = model.init(jax.random.key(0), x)
    return (lambda v, x: model.apply(v, x)), variables, (x,)


def make_flax_vit_block(batch: int = 2, size: int = 32, patch: int = 4, dim: int = 64,
                        heads: int = 4):
    """flax.linen ViT-style block on ``[batch, size, size, 3]`` (NHWC): patch embedding by a
    strided convolution, pre-norm self-attention and MLP, mean pooling."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Conv(dim, (patch, patch), strides=(patch, patch))(x)
            x = x.reshape(x.shape[0], -1, dim)
            x = x + nn.MultiHeadDotProductAttention(num_heads=heads)(nn.LayerNorm()(x))
            y = nn.Dense(dim)(nn.gelu(nn.Dense(2 * dim)(nn.LayerNorm()(x))))
            return (x + y).mean(axis=1)

    model = Block()
    x = jax.random.normal(jax.random.key(1), (batch, size, size, 3))
    variables = model.init(jax.random.key(0), x)
    return (lambda v, x: model.apply(v, x)), variables, (x,)


def make_eqx_attention(batch: int = 3, seq: int = 10, dim: int = 64, heads: int = 4):
    """equinox ``MultiheadAttention`` (self-attention) vmapped over the batch."""
    import equinox as eqx

    mha = eqx.nn.MultiheadAttention(heads, dim, key=jax.random.key(0))
    params, static = eqx.partition(mha, eqx.is_array)
    x = jax.random.normal(jax.random.key(1), (batch, seq, dim))

    def fn(params, x):
        m = eqx.combine(params, static)
        return jax.vmap(lambda t: m(t, t, t))(x)

    return fn, params, (x,)


def make_flax_causal_lm(batch: int = 2, seq: int = 12, vocab: int = 1000, dim: int = 64,
                        heads: int = 4):
    """A one-layer causal language model on int32 token ids ``[batch, seq]``: flax.linen
    ``Embed``, query/key/value projections, ``jax.nn.dot_product_attention`` with a causal
    mask, and a vocabulary head."""
    import flax.linen as nn

    class LM(nn.Module):
        @nn.compact
        def __call__(self, ids):
            x = nn.Embed(vocab, dim)(ids)
            q, k, v = (nn.Dense(dim)(x).reshape(*x.shape[:2], heads, dim // heads)
                       for _ in range(3))
            a = jax.nn.dot_product_attention(q, k, v, is_causal=True)
            return nn.Dense(vocab)(x + a.reshape(x.shape))

    model = LM()
    ids = jax.random.randint(jax.random.key(1), (batch, seq), 0, vocab)
    variables = model.init(jax.random.key(0), ids)
    return (lambda v, ids: model.apply(v, ids)), variables, (ids,)


MODELS = {"flax_resnet50": make_flax_resnet50, "flax_bert_block": make_flax_bert_block,
          "eqx_mlp": make_eqx_mlp, "eqx_convnet": make_eqx_convnet, "nasrnn": make_nasrnn,
          "nasrnn_1d": make_nasrnn_1d, "tiny_attention": make_tiny_attention,
          "flax_lstm": make_flax_lstm, "flax_vit_block": make_flax_vit_block,
          "eqx_attention": make_eqx_attention, "flax_causal_lm": make_flax_causal_lm,
          "flax_cnn_bn": make_flax_cnn_bn, "stax_resnet": make_stax_resnet}

#: Hand-rewritten forms of some models (``(fn, weights, inputs) -> (fn, weights)``): the
#: rewrite the optimizer should find, written by hand, to time beside it.
HAND_REWRITTEN = {"nasrnn": hand_merged_nasrnn, "nasrnn_1d": hand_merged_nasrnn}
