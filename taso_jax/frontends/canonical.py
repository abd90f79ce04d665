"""Affine normalization: collect elementwise chains with weight-only operands into x*s + t.

Front ends write per-channel affine maps in different orders. flax's batchnorm is
``(y - mean) * (scale / sqrt(var + eps)) + bias``; the ONNX importer emits
``y * s + t``. The substitutions fold a scale into the producing convolution or matmul
(``conv2d(x, w) * s => conv2d(x, w * s^T)``) and a shift into a following one, which needs
the scale next to its producer. This pass rewrites, bottom-up:

* ``(y + c) * s``  into  ``y * s + c * s``;
* ``(y * s1) * s2``  into  ``y * (s1 * s2)``;
* ``(y + c1) + c2``  into  ``y + (c1 + c2)``;

where ``c``, ``s`` are weight-only tensors that broadcast to ``y`` without changing its shape,
and the inner node has no other consumer. Every right-hand side computes the same values in
exact arithmetic (distributivity and associativity; float rounding differs by a few ulp), and
the weight-only parts (``c * s``, ``s1 * s2``) are precomputed, so no runtime work is added.

Source: the distributive and associative laws of TASO's axioms for ``ewadd`` and ``ewmul``
(Jia et al., SOSP 2019, Table 2).
"""

from __future__ import annotations

from taso_jax.ir.graph import Graph, Node, Tensor, make_node, rebuild_node
from taso_jax.ir.weight_folds import weight_operand

__all__ = ["normalize_affine"]


def normalize_affine(graph: Graph) -> Graph:
    """Return an equivalent graph with affine chains normalized (see module doc)."""
    consumers = graph.consumers
    outputs = graph.output_set
    new: dict[Node, Node] = {}
    exclusive: dict[Tensor, bool] = {}  # new tensor -> read by one node only

    def remap(t: Tensor) -> Tensor:
        return Tensor(new.get(t.node, t.node), t.index)

    def affine(op: str, y: Tensor, c: Tensor) -> Tensor:
        """``op(y, c)`` for runtime ``y`` and weight-only ``c``, normalized."""
        inner = weight_operand(y) if y.node.op in ("ewadd", "ewmul") and exclusive.get(y) else None
        if inner is not None:
            z, d = inner
            if op == "ewmul" and y.node.op == "ewadd":  # (z + d) * c = z * c + d * c
                dc = make_node("ewmul", [d, c]).outputs[0]
                return _mark(make_node("ewadd", [affine("ewmul", z, c), dc]).outputs[0])
            if op == y.node.op:  # (z * d) * c = z * (d * c), (z + d) + c = z + (d + c)
                return affine(op, z, make_node(op, [d, c]).outputs[0])
        return _mark(make_node(op, [y, c]).outputs[0])

    def _mark(t: Tensor) -> Tensor:
        exclusive.setdefault(t, True)  # a node created here has one consumer: its user
        return t

    for n in graph.nodes:
        if not n.inputs:
            continue
        node = rebuild_node(n, (remap(t) for t in n.inputs))
        if n.op in ("ewmul", "ewadd") and not node.weight_only:
            split = weight_operand(node.outputs[0])
            if split is not None:
                node = affine(n.op, *split).node
        if node is not n:
            new[n] = node
        for t, nt in zip(n.outputs, node.outputs, strict=True):
            exclusive[nt] = len(consumers.get(t, ())) == 1 and t not in outputs
    return Graph(graph.inputs, tuple(remap(t) for t in graph.outputs), graph.output_names,
                 graph.weights, graph.meta)
