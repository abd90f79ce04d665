"""What a staged graph computes once, ahead of the calls: the speed-up that needs no rewrite.

A delivered graph runs as two stages (:class:`~taso_jax.ir.executor.StagedGraph`): the
weight-only operators are computed once, and the calls run the rest. A graph the search did
not change can still run faster that way, where the function rebuilds a causal mask or
scales a bias on every call. :func:`folded_work` counts that work, split by what it reads,
so that a report can name it as a source of the speed-up.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection

from taso_jax.ir.graph import Graph

__all__ = ["folded_work"]


def folded_work(graph: Graph, weights: Collection[str] | None = None) -> dict:
    """The operators of ``graph`` computed once rather than on every call, by kind.

    Args:
        graph: the graph as it is delivered.
        weights: names of the weight nodes that hold the caller's weights (the decorator's
            ``weight_argnums`` leaves); every other weight node, and every operator without
            inputs (an iota, a filled array), is a constant of the function. ``None``: all
            weight nodes are weights (an ONNX file's initializers).

    Returns:
        ``{"weights": {op: count}, "constants": {op: count}}``: the operators of the weight
        stage that read at least one weight, and those that read constants only (a mask
        built from ``jnp.tril``, a bias scaled by a literal). Weight-only transposes read
        by products are not counted: XLA reads those in the product itself
        (:func:`~taso_jax.ir.executor.read_transposed`).
    """
    from taso_jax.ir.executor import read_transposed

    skip = read_transposed(graph)
    reads_weight: dict = {}
    counts = {"weights": Counter(), "constants": Counter()}
    for n in graph.nodes:  # topological order: a node's inputs come first
        if n.op == "weight":
            reads_weight[n] = weights is None or n.name in weights
            continue
        if n.op == "input" or not n.weight_only:
            continue
        reads_weight[n] = any(reads_weight.get(t.node, False) for t in n.inputs)
        if n not in skip:
            counts["weights" if reads_weight[n] else "constants"][n.op] += 1
    return {k: dict(sorted(v.items())) for k, v in counts.items()}
