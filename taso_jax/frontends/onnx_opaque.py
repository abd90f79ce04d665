"""Opaque ONNX regions: nodes kept as they are, run by onnxruntime, exported verbatim.

A node that no operator declaration imports is kept in an :class:`OnnxNode`, which runs in
onnxruntime (one cached session per region); :func:`merge_opaque_regions` joins connected
ones so that each region runs as one session.
"""

from __future__ import annotations

import functools

import numpy as np

from taso_jax.ir.graph import Graph, Node, Tensor, intern_node
from taso_jax.ir.opaque import OpaqueOp

__all__ = ["OnnxNode", "merge_opaque_regions", "SESSION_CACHE"]


class OnnxNode(OpaqueOp):
    """ONNX nodes kept as they are (an opaque region): run by onnxruntime, exported verbatim.

    A region is one node without a declaration, or a connected group of them that
    :func:`merge_opaque_regions` joined, so that it runs as one onnxruntime session instead
    of one per node. Its tensors keep the model's own names: ``in_names`` are the tensors it
    reads from the rest of the graph (``node.inputs``, same order), ``out_names`` the ones
    the rest of the graph reads (``node.types``, same order). Names that the nodes'
    subgraphs (the branches of ``If``, the bodies of ``Loop`` and ``Scan``) read from the
    enclosing graph are among ``in_names`` too. Absent optional inputs and outputs are
    empty names in the nodes, as in ONNX.

    Equal when the serialized nodes, names, opsets and IR version are equal (hash-consing
    merges identical regions). Inside ``jax.jit`` it runs through ``jax.pure_callback``;
    sessions are cached (at most :data:`SESSION_CACHE`).

    Attributes:
        label: the ONNX op type (or op types joined by ``+`` for a region of several).
        nodes: serialized ``NodeProto`` of each node, in topological order.
        in_names, out_names: see above.
        opsets: ``(domain, version)`` pairs of the model.
        ir_version: the model's IR version.
    """

    def __init__(self, nodes: tuple[bytes, ...], in_names: tuple[str, ...],
                 out_names: tuple[str, ...], opsets: tuple, ir_version: int, label: str = ""):
        self.nodes, self.in_names, self.out_names = tuple(nodes), tuple(in_names), \
            tuple(out_names)
        self.opsets, self.ir_version = opsets, ir_version
        self.label = label or "+".join(_op_types(self.nodes))
        self._key = (self.nodes, self.in_names, self.out_names, opsets, ir_version)

    def __eq__(self, other) -> bool:
        return isinstance(other, OnnxNode) and other._key == self._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return f"OnnxNode({self.label})"

    def protos(self) -> list:
        """The nodes as ``onnx.NodeProto`` objects (fresh copies)."""
        import onnx

        return [onnx.NodeProto.FromString(b) for b in self.nodes]

    def evaluate(self, node: Node, args) -> tuple:
        """The outputs, computed by onnxruntime through ``jax.pure_callback``."""
        import jax

        specs = tuple(jax.ShapeDtypeStruct(t.shape, jax.dtypes.canonicalize_dtype(t.dtype))
                      for t in node.types)
        in_types = tuple(t.type for t in node.inputs)

        def callback(*values):
            sess = _session(self, in_types, tuple(node.types))
            feeds = {n: np.asarray(v).astype(t.dtype)
                     for n, v, t in zip(self.in_names, values, in_types, strict=True)}
            return tuple(np.asarray(o).astype(s.dtype)
                         for o, s in zip(sess.run(list(self.out_names), feeds), specs,
                                         strict=True))

        return tuple(jax.pure_callback(callback, specs, *args))

    def to_onnx(self, ctx, inputs: list[str], outputs: list[str]) -> None:
        """The nodes themselves, with the region's inputs and outputs renamed as exported.

        Tensors inside the region get fresh names. Subgraphs read enclosing names as they
        were in the original model; each such name that the export renamed is defined
        again by an ``Identity``: before the region's nodes for a region input, right
        after its producer for a tensor made inside the region.
        """
        rename = dict(zip(self.in_names, inputs, strict=True))
        rename.update(zip(self.out_names, outputs, strict=True))
        protos = self.protos()
        for proto in protos:
            for x in proto.output:
                if x and x not in rename:
                    rename[x] = ctx.fresh("r")
        read_by_subgraphs = {x for proto in protos for x in _outer_names(proto)}
        restored: set[str] = set()

        def restore(original: str) -> None:
            name = rename.get(original)
            if (name is None or name == original or original in restored
                    or original in ctx.types):
                return
            ctx.node("Identity", [name], [original])
            restored.add(original)
            if name in ctx.types:
                ctx.types[original] = ctx.types[name]

        for original in self.in_names:
            if original in read_by_subgraphs:
                restore(original)
        for proto in protos:
            new_in = [rename.get(x, x) if x else "" for x in proto.input]
            new_out = [rename[x] if x else "" for x in proto.output]
            made = [x for x in proto.output if x]
            del proto.input[:]
            proto.input.extend(new_in)
            del proto.output[:]
            proto.output.extend(new_out)
            ctx.nodes.append(proto)
            for original in made:
                if original in read_by_subgraphs:
                    restore(original)


def _op_types(nodes: tuple[bytes, ...]) -> list[str]:
    import onnx

    return [onnx.NodeProto.FromString(b).op_type for b in nodes]


#: onnxruntime sessions kept for opaque regions at most (least recently used dropped).
SESSION_CACHE = 256


def _outer_names(proto) -> list[str]:
    """Names that a node's subgraphs read from enclosing graphs, in first-use order."""
    from onnx import AttributeProto

    found: dict[str, None] = {}

    def visit(graph, defined: set):
        defined = defined | {i.name for i in graph.input} | {i.name for i in graph.initializer}
        for n in graph.node:
            for name in n.input:
                if name and name not in defined:
                    found.setdefault(name)
            for a in n.attribute:
                for g in ([a.g] if a.type == AttributeProto.GRAPH else
                          list(a.graphs) if a.type == AttributeProto.GRAPHS else []):
                    visit(g, defined)
            defined |= set(n.output)

    for a in proto.attribute:
        for g in ([a.g] if a.type == AttributeProto.GRAPH else
                  list(a.graphs) if a.type == AttributeProto.GRAPHS else []):
            visit(g, set())
    return list(found)


@functools.lru_cache(maxsize=SESSION_CACHE)
def _session(op: OnnxNode, in_types: tuple, out_types: tuple):
    """An onnxruntime session running the region ``op`` alone (one intra-op thread).

    Its graph inputs are ``op.in_names`` (typed ``in_types``), its outputs ``op.out_names``.
    """
    import onnxruntime as ort
    from onnx import helper

    def info(name, t):
        return helper.make_tensor_value_info(
            name, helper.np_dtype_to_tensor_dtype(np.dtype(t.dtype)), list(t.shape))

    ins = [info(n, t) for n, t in zip(op.in_names, in_types, strict=True)]
    outs = [info(n, t) for n, t in zip(op.out_names, out_types, strict=True)]
    model = helper.make_model(helper.make_graph(op.protos(), "opaque", ins, outs),
                              opset_imports=[helper.make_opsetid(d, v) for d, v in op.opsets],
                              ir_version=min(int(op.ir_version), 10))
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 4
    return ort.InferenceSession(model.SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])


def merge_opaque_regions(graph: Graph) -> Graph:
    """Join connected opaque ONNX nodes into regions that each run as one session.

    Nodes are visited in topological order; an opaque :class:`OnnxNode` joins the region of
    an opaque producer when no other input of it depends on that region through a node
    outside it (the region stays convex) and every tensor it shares with the region has
    one name. Regions that would read each other both ways are left unmerged (one session
    per node), so the graph stays acyclic. A region's outputs are the tensors read outside
    it or returned by the graph. Returns a new graph computing the same values;
    ``meta["opaque_regions"]`` counts the regions merged.
    """
    region, members = _opaque_regions(graph)
    if all(len(m) < 2 for m in members):
        return graph
    order = _condensed_order(graph, region, members)
    consumers = graph.consumers
    outputs = graph.output_set
    env: dict[Tensor, Tensor] = {}
    merged = 0
    for u in order:
        if isinstance(u, Node):
            if u.inputs:
                new = intern_node(u.op, u.attrs, tuple(env.get(t, t) for t in u.inputs),
                                  u.types)
                env.update(zip(u.outputs, new.outputs, strict=True))
            continue
        nodes = members[u[1]]
        inside = set(nodes)
        name_of: dict[Tensor, str] = {}
        for m in nodes:
            call = m.attr("call")
            name_of.update(zip(m.outputs, call.out_names, strict=True))
        # One input per name: hash-consing can make one tensor of two names (an LSTM's
        # initial h and c, equal slices of one tensor), and the nodes read both names.
        in_pairs: dict[tuple[Tensor, str], None] = {}
        for m in nodes:
            for t, nm in zip(m.inputs, m.attr("call").in_names, strict=True):
                if t.node not in inside:
                    in_pairs.setdefault((t, nm))
        out_tensors = [t for m in nodes for t in m.outputs
                       if t in outputs or any(c not in inside for c in consumers.get(t, ()))]
        call = OnnxNode(tuple(b for m in nodes for b in m.attr("call").nodes),
                        tuple(nm for _, nm in in_pairs), tuple(name_of[t] for t in out_tensors),
                        nodes[0].attr("call").opsets, nodes[0].attr("call").ir_version)
        new = intern_node("opaque", (("call", call),),
                          tuple(env.get(t, t) for t, _ in in_pairs),
                          tuple(t.type for t in out_tensors))
        env.update(zip(out_tensors, new.outputs, strict=True))
        merged += 1
    meta = dict(graph.meta)
    meta["opaque_regions"] = merged
    return Graph(graph.inputs, tuple(env.get(t, t) for t in graph.outputs),
                 graph.output_names, graph.weights, meta)



def _opaque_regions(graph: Graph) -> tuple[dict, list]:
    """``(region of each opaque ONNX node, members of each region)``.

    Regions stay convex; :func:`merge_opaque_regions` says when a node joins its
    producer's region.
    """
    def is_onnx(n: Node) -> bool:
        return n.op == "opaque" and isinstance(n.attr("call"), OnnxNode)

    region: dict[Node, int] = {}
    members: list[list[Node]] = []
    names: list[dict[Tensor, str]] = []  # per region: the name each of its tensors has
    upstream: dict[Node, frozenset] = {}  # regions a node depends on
    for n in graph.nodes:
        ups = frozenset().union(*(upstream[t.node] | ({region[t.node]} if t.node in region
                                                      else frozenset()) for t in n.inputs))
        if is_onnx(n):
            call = n.attr("call")
            choice = None
            for t in n.inputs:
                r = region.get(t.node)
                if r is None or r == choice:
                    continue
                # convex: no other input depends on the region through a node outside it;
                # and one name per tensor (hash-consing can make one tensor of two names)
                if all(region.get(u.node) == r or r not in upstream[u.node]
                       for u in n.inputs) and all(
                        names[r].get(u, nm) == nm
                        for u, nm in zip(n.inputs, call.in_names, strict=True)):
                    choice = r
                    break
            if choice is None:
                choice = len(members)
                members.append([])
                names.append({})
            region[n] = choice
            members[choice].append(n)
            names[choice].update(zip(n.inputs, call.in_names, strict=True))
            names[choice].update(zip(n.outputs, call.out_names, strict=True))
        upstream[n] = ups
    return region, members


def _condensed_order(graph: Graph, region: dict, members: list) -> list:
    """The graph's units in Kahn order: a region of two or more nodes is one unit.

    A unit is a node, or ``("r", index)`` for a merged region; regions that read each
    other both ways are left apart.
    """
    from collections import deque

    # The condensed graph (a region is one unit) in Kahn order. Two regions that each read
    # the other (each convex on its own) would make a cycle: their nodes are then left
    # apart, one session each, and the order is made again.
    merged_regions = {r for r, m in enumerate(members) if len(m) > 1}
    while True:
        unit = {n: ("r", region[n]) if region.get(n) in merged_regions else n
                for n in graph.nodes}
        deps: dict = {u: set() for u in unit.values()}
        users: dict = {u: set() for u in unit.values()}
        for n in graph.nodes:
            for t in n.inputs:
                a, b = unit[t.node], unit[n]
                if a != b:
                    deps[b].add(a)
                    users[a].add(b)
        ready = deque(u for u, d in deps.items() if not d)
        order = []
        while ready:
            u = ready.popleft()
            order.append(u)
            for v in users[u]:
                deps[v].discard(u)
                if not deps[v]:
                    ready.append(v)
        if len(order) == len(deps):
            break
        placed = set(order)
        merged_regions -= {u[1] for u in deps if isinstance(u, tuple) and u not in placed}
    return order