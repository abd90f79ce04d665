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

from taso_jax.graph import Graph, Node, Tensor, intern_node, make_node

__all__ = ["normalize_affine"]


def _split(t: Tensor):
    """``(runtime operand, weight-only operand)`` of a binary elementwise node, else None."""
    n = t.node
    if len(n.inputs) != 2:
        return None
    a, b = n.inputs
    if a.node.weight_only == b.node.weight_only:
        return None
    y, c = (b, a) if a.node.weight_only else (a, b)
    if y.shape != n.types[0].shape or y.dtype != c.dtype:
        return None  # c must broadcast into y without enlarging it
    return y, c


def normalize_affine(graph: Graph) -> Graph:
    """Return an equivalent graph with affine chains normalized (see module doc)."""
    consumers = graph.consumers
    outputs = graph.output_set
    new: dict[Node, Node] = {}

    def remap(t: Tensor) -> Tensor:
        return Tensor(new.get(t.node, t.node), t.index)

    def only_use(t: Tensor) -> bool:
        return len(consumers.get(t, ())) == 1 and t not in outputs

    for n in graph.nodes:
        if not n.inputs:
            continue
        ins = tuple(remap(t) for t in n.inputs)
        node = n if ins == n.inputs else (
            intern_node(n.op, n.attrs, ins, n.types) if n.op == "opaque"
            else make_node(n.op, ins, n.attr_dict))
        if n.op in ("ewmul", "ewadd") and not node.weight_only:
            outer = _split(node.outputs[0])
            old_inner = next((t for t in n.inputs if not t.node.weight_only), None)
            if outer is not None and old_inner is not None and only_use(old_inner):
                y, c = outer
                inner = _split(y) if y.node.op in ("ewadd", "ewmul") else None
                if inner is not None:
                    z, d = inner
                    if n.op == "ewmul" and y.node.op == "ewadd":  # (z + d) * c
                        node = make_node("ewadd", [make_node("ewmul", [z, c]).outputs[0],
                                                   make_node("ewmul", [d, c]).outputs[0]])
                    elif n.op == y.node.op:  # (z * d) * c, (z + d) + c
                        node = make_node(n.op, [z, make_node(n.op, [d, c]).outputs[0]])
        if node is not n:
            new[n] = node
    return Graph(graph.inputs, tuple(remap(t) for t in graph.outputs), graph.output_names,
                 graph.weights, graph.meta)
