"""The layout an ONNX file runs its convolutions in, and the order of its nodes.

ONNX's ``Conv`` is NCHW only, so a program that runs its convolutions channels-last (a
TensorFlow model through tf2onnx, or a file this project wrote from a graph whose
convolutions the end-to-end choice put in NHWC) writes each as ``Transpose`` (NHWC to NCHW),
``Conv``, ``Transpose`` back. The import reads every such file in NCHW, the form the rules
are stated on (:func:`taso_jax.ir.layout.sink_transposes` cancels the transposes that meet);
:func:`in_layout` then gives back the NHWC form where the file runs in it, so that ``jax.jit``
of the import runs what the file says (XLA:CPU runs NHWC convolutions 1.2-1.4x faster on
this project's deployed detectors, 2026-11-29).

Source: ONNX operator specification, ``Conv`` (opsets 1-22: input ``X`` is ``(N, C, H, W)``).
"""

from __future__ import annotations

from taso_jax.frontends.onnx_opaque import _outer_names
from taso_jax.ir.graph import Graph

__all__ = ["runs_channels_last", "in_layout", "topological_order", "LAYOUTS"]

#: The layouts :func:`in_layout` (and :func:`~taso_jax.frontends.onnx_import.load_onnx`) take.
LAYOUTS = ("file", "nchw")

#: ``Transpose`` permutation from NHWC to NCHW.
_TO_NCHW = [0, 3, 1, 2]


def runs_channels_last(model) -> bool:
    """Whether ``model`` (an ``onnx.ModelProto``) runs its convolutions channels-last.

    That is, every ``Conv`` reads its input ``X`` through a ``Transpose`` from NHWC
    (``perm=[0, 3, 1, 2]``). ``False`` for a model without ``Conv`` nodes, or where any one
    is fed otherwise (a mixed file keeps the NCHW reading).
    """
    producer = {o: n for n in model.graph.node for o in n.output if o}
    convs = [n for n in model.graph.node if n.op_type == "Conv"]

    def fed_nhwc(conv) -> bool:
        src = producer.get(conv.input[0])
        if src is None or src.op_type != "Transpose":
            return False
        perm = [list(a.ints) for a in src.attribute if a.name == "perm"]
        return perm == [_TO_NCHW]

    return bool(convs) and all(fed_nhwc(n) for n in convs)


def in_layout(graph: Graph, layout: str) -> Graph:
    """``graph`` (imported NCHW) in ``layout``.

    ``"nchw"``: as it is; ``"file"``: with its convolutions in NHWC
    (:func:`taso_jax.ir.layout.to_nhwc`) where ``graph.meta`` says the file runs them so
    (``"channels_last"``, set by the import from :func:`runs_channels_last`).

    Raises:
        ValueError: ``layout`` is not one of :data:`LAYOUTS`.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "nchw" or not graph.meta.get("channels_last"):
        return graph
    from taso_jax.ir.layout import to_nhwc

    return to_nhwc(graph)


def topological_order(graph) -> list[int] | None:
    """Node indices of ``graph`` in an order where every node follows its inputs' producers.

    The file's own order where it already is one (Kahn's algorithm, lowest index first);
    ``None`` where no order exists (a cycle, or an input no node, graph input or
    initializer defines): the checker then says what is wrong. Names read by subgraphs
    count as inputs of the node that holds them.
    """
    import heapq

    defined = ({i.name for i in graph.input} | {i.name for i in graph.initializer}
               | {i.values.name for i in graph.sparse_initializer} | {""})
    producer = {o: k for k, n in enumerate(graph.node) for o in n.output if o}
    needs: list[set] = []
    users: dict[int, list[int]] = {}
    for k, n in enumerate(graph.node):
        deps = set()
        for x in [*n.input, *_outer_names(n)]:
            if x in producer:
                deps.add(producer[x])
            elif x not in defined:
                return None
        deps.discard(k)
        needs.append(deps)
        for d in deps:
            users.setdefault(d, []).append(k)
    ready = [k for k, d in enumerate(needs) if not d]
    heapq.heapify(ready)
    order = []
    while ready:
        k = heapq.heappop(ready)
        order.append(k)
        for u in users.get(k, ()):
            needs[u].discard(k)
            if not needs[u]:
                heapq.heappush(ready, u)
    return order if len(order) == len(graph.node) else None
