"""Scales and shifts after a product folded into its weights: fewer passes over activations.

Exporters leave an affine step after a convolution or a matrix product that the model could
have stored in the product's weights: PaddlePaddle's PP-LCNet writes a learnable scale and
shift after most of its convolutions (``Conv -> Mul(c) -> Add(d)``, ``c`` and ``d`` scalars),
a batch normalization after a convolution imports as a per-channel ``Mul`` and ``Add``, and
attention code scales the query projection by ``1/sqrt(d)``. onnxruntime's own fusions fold
a ``BatchNormalization`` into the ``Conv`` before it, but not a ``Mul`` by a scalar; XLA fuses
the step into the product's epilogue, but still computes it on every call. Folded, the step
costs nothing at run time: the product reads the scaled weight, which the staged executor
computes once (:class:`~taso_jax.ir.executor.StagedGraph`) and an ONNX export stores as an
initializer.

The laws, for a product ``P`` linear in its weight ``w`` channel by channel (its
declaration's ``OpDef.channel_scale``: ``conv2d``, NCHW activations and OIHW kernels, any
``groups``, where output channel ``o`` reads ``w[o]`` only; ``matmul``, where output column
``n`` reads ``w[..., n]`` only), ``s`` and ``c`` weight-only tensors constant over every axis
but the output-channel one (a scalar, ``[1]``, ``[C, 1, 1]``, ``[1, C, 1, 1]``; ``[N]`` or
``[1, N]`` for a matrix product):

* ``P(x, w) * s = P(x, w * s')`` (``s'`` is ``s`` laid out along ``w``'s output axis);
* ``(P(x, w) + b) * s = P(x, w * s') + b * s`` (distributivity, then the law above);
* ``(P(x, w) + b) + c = P(x, w) + (b + c)`` (associativity).

These are the rules ``expand-conv2d-ewmul`` and its kin of the generated set, proved from
the axioms (a per-channel scale commutes into a convolution's kernel), with scalars and
biases added. In floating point they are equal up to rounding (the scale is applied to each
term before the sum, not to the sum), which the end-to-end output check bounds. A step is
folded only where the product's output (and its bias's sum) has no other reader, so no work
is duplicated, and where the tensor it makes has the type of the one it replaces.
"""

from __future__ import annotations

from collections import Counter

from taso_jax.ir.cleanup import _same_shape, rebuild
from taso_jax.ir.fold_check import fold_overflow
from taso_jax.ir.graph import Graph, Node, Tensor, make_node
from taso_jax.ops import OPS
from taso_jax.ops.dims import same_size

__all__ = ["fold_affine_into_products", "weight_operand"]

#: Float element types a fold may change the rounding of.
_FLOATS = ("float32", "float64", "float16", "bfloat16")


def _channel_axes(t: Tensor) -> tuple[int, int] | None:
    """``(output axis, weight axis)`` of the product computing ``t``, or ``None``.

    From the operator's declaration (``OpDef.channel_scale``), where the product has no
    fused activation and its weight (input 1) is weight-only.
    """
    n = t.node
    op = OPS.get(n.op)
    if (op is None or op.channel_scale is None or n.attr("activation", "none") != "none"
            or not n.inputs[1].node.weight_only):
        return None
    out_axis, w_axis = op.channel_scale
    if len(t.shape) < -out_axis or len(n.inputs[1].shape) < -w_axis:
        return None
    return out_axis, w_axis


def _per_channel(s: Tensor, y: Tensor, axis: int) -> bool:
    """Whether ``s`` is a per-channel constant for ``y`` along ``axis``.

    That is: weight-only, of ``y``'s element type, of size 1 on every axis but ``axis``,
    and broadcast against ``y`` it leaves ``y``'s shape as it is.
    """
    if not s.node.weight_only or s.dtype != y.dtype or len(s.shape) > len(y.shape):
        return False
    for k in range(1, len(s.shape) + 1):
        d = s.shape[-k]
        if same_size(d, 1):
            continue
        if -k != axis or not same_size(d, y.shape[-k]):
            return False
    return True


def _scaled_weight(product: Node, s: Tensor, w_axis: int) -> Tensor:
    """The product's weight times ``s`` laid out along the weight's channel axis."""
    w = product.inputs[1]
    size = 1
    for d in s.shape:
        size *= int(d)
    lay = [1] * len(w.shape)
    lay[w_axis] = size
    s = make_node("reshape", [s], {"shape": tuple(lay)}).outputs[0]
    return make_node("ewmul", [w, s]).outputs[0]


def weight_operand(t: Tensor) -> tuple[Tensor, Tensor] | None:
    """``(y, c)``: the runtime and the weight-only operand of the binary operator computing ``t``.

    ``None`` unless exactly one operand is weight-only, and ``c`` broadcasts into ``y``
    without enlarging it, of the same element type. Shared with
    :func:`~taso_jax.frontends.canonical.normalize_affine`.
    """
    n = t.node
    if len(n.inputs) != 2:
        return None
    a, b = n.inputs
    if a.node.weight_only == b.node.weight_only:
        return None
    y, c = (b, a) if a.node.weight_only else (a, b)
    if y.shape != n.types[0].shape or y.dtype != c.dtype:
        return None
    return y, c


def _fold(node: Node, readers: Counter) -> tuple[Tensor, str, list] | None:
    """``node`` with its scale or shift folded, or ``None``.

    Returns ``(tensor, law, inner)``: an equal tensor, the law's name, and the tensors made
    that only the new operators read.
    """
    if node.op not in ("ewmul", "ewadd") or node.types[0].dtype not in _FLOATS:
        return None
    split = weight_operand(node.outputs[0])
    if split is None:
        return None
    y, s = split
    if readers.get(y, 2) != 1:
        return None
    z, b = (weight_operand(y) if y.node.op == "ewadd" else None) or (y, None)
    if b is not None and readers.get(z, 2) != 1:
        return None
    axes = _channel_axes(z)
    if axes is None or not _per_channel(s, z, axes[0]):
        return None
    if node.op == "ewadd":
        if b is None:  # already the product's bias
            return None
        out = make_node("ewadd", [z, make_node("ewadd", [b, s]).outputs[0]]).outputs[0]
        law, inner = "shift_folded_into_bias", [z]
    else:
        product = z.node
        ins = list(product.inputs)
        ins[1] = _scaled_weight(product, s, axes[1])
        out = make_node(product.op, ins, product.attr_dict).outputs[0]
        inner = []
        if b is not None:
            inner = [out]
            out = make_node("ewadd", [out, make_node("ewmul", [b, s]).outputs[0]]).outputs[0]
        law = f"scale_folded_into_{product.op}"
    if out.dtype != node.types[0].dtype or not _same_shape(out.shape, node.types[0].shape):
        return None
    return out, law, inner


def fold_affine_into_products(graph: Graph) -> tuple[Graph, Counter]:
    """``graph`` with the scales and shifts after its products folded into their weights.

    The laws are the module's: weight-only scales and shifts after convolutions and matrix
    products go into the products' weights and biases. One pass of
    :func:`~taso_jax.ir.cleanup.rebuild` that keeps the readers of the tensors it makes
    counted, so a chain (``Mul`` then ``Add``) folds in one pass. Each output keeps its name and
    type. Returns ``(graph, counts)``: counts by law (``scale_folded_into_conv2d``,
    ``scale_folded_into_matmul``, ``shift_folded_into_bias``), and ``graph`` itself where
    nothing folded, or where a folded tensor came out non-finite from finite weights or
    underflowed (:func:`~taso_jax.ir.fold_check.fold_overflow`: a scale of ``1e30`` on a
    kernel of ``1e10``): then nothing is folded.
    """
    readers = Counter(t for n in graph.nodes for t in n.inputs)
    readers.update(graph.outputs)

    def replace(node: Node):
        found = _fold(node, readers)
        if found is None:
            return None
        out, law, inner = found
        for t in inner:  # read by the new operators only
            readers[t] = 1
        return out, law

    folded, counts = rebuild(graph, replace, readers=readers)
    if not counts:
        return graph, counts
    if fold_overflow(folded, graph) is not None:  # a scaled kernel left float's range
        return graph, Counter()
    return folded, counts
