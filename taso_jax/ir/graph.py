"""Immutable, hash-consed computation graph IR.

A :class:`Node` is identified by ``(op, attrs, inputs)``; constructing a node that already
exists returns the existing object, so structurally equal subgraphs are the same Python
object and a whole graph is identified exactly by its output tensors (no hash collisions,
unlike TASO's sum of per-operator hashes). Rewrites never mutate: they build new nodes and a
new :class:`Graph` that shares every unchanged node with the old one.

Node kinds (``node.op``): ``"input"`` (runtime input), ``"weight"`` (constant known ahead of
time; data lives in ``Graph.weights``), ``"opaque"`` (an ONNX node without a declaration,
carried through unchanged), or the name of a declared operator in :data:`taso_jax.ops.OPS`.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np

from taso_jax.ops import OPS, ShapeError, TensorType, get_op
from taso_jax.ops.dims import MADE as _DIMS_MADE
from taso_jax.ops.dims import Dim as _Dim

__all__ = ["Graph", "GraphBuilder", "Node", "Tensor", "make_node", "new_graph", "GraphError",
           "composition_nodes"]

LEAF_OPS = ("input", "weight")


class GraphError(ValueError):
    """A graph that is not well formed (unknown tensor, duplicate name, bad output)."""


class Node:
    """One operation in the graph; hash-consed, never mutated.

    Attributes:
        op: operator name, or ``"input"``, ``"weight"``, ``"opaque"``.
        attrs: sorted tuple of ``(name, value)`` pairs (all values hashable).
        inputs: tuple of :class:`Tensor`.
        types: one :class:`TensorType` per output.
        weight_only: the value depends on weights only (computed once, ahead of time).
        price: a cache, not part of the node: ``(cost model's number, microseconds)`` as
            the last cost model to price it left it
            (:meth:`taso_jax.search.cost.CostModel.node_cost`).
    """

    __slots__ = ("op", "attrs", "inputs", "types", "_hash", "weight_only", "price",
                 "__weakref__")

    def __init__(self, op, attrs, inputs, types):
        self.op = op
        self.attrs = attrs
        self.inputs = inputs
        self.types = types
        self._hash = hash((op, attrs, inputs))
        self.price = None
        # Whether the value depends on weights only: a property of the node itself (its
        # inputs are part of its identity), so it is computed once, here.
        self.weight_only = op == "weight" or (
            op != "input" and all(t.node.weight_only for t in inputs))

    def __hash__(self) -> int:
        return self._hash

    def attr(self, name: str, default: Any = None) -> Any:
        """Value of one attribute."""
        for k, v in self.attrs:
            if k == name:
                return v
        return default

    @property
    def attr_dict(self) -> dict[str, Any]:
        """Attributes as a dict."""
        return dict(self.attrs)

    @property
    def outputs(self) -> tuple[Tensor, ...]:
        """The node's output tensors."""
        return tuple(Tensor(self, i) for i in range(len(self.types)))

    @property
    def name(self) -> str | None:
        """Name of an input or weight node, else ``None``."""
        return self.attr("name")

    def __repr__(self) -> str:
        if self.op in LEAF_OPS:
            return f"{self.op}({self.name}: {list(self.types[0].shape)})"
        if self.op == "opaque":
            return f"opaque({self.attr('call').label})"
        return f"{self.op}({', '.join(f'{k}={v}' for k, v in self.attrs)})"


class Tensor(NamedTuple):
    """Output ``index`` of ``node``."""

    node: Node
    index: int = 0

    @property
    def type(self) -> TensorType:
        """Static type."""
        return self.node.types[self.index]

    @property
    def shape(self) -> tuple[int, ...]:
        """Static shape."""
        return self.node.types[self.index].shape

    @property
    def dtype(self) -> str:
        """Element type (numpy dtype name)."""
        return self.node.types[self.index].dtype

    def __repr__(self) -> str:
        return f"{self.node!r}[{self.index}]"


_TABLE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_LOCK = threading.Lock()


_EXPR = object()  # marks an open size in a hash-consing key


def _with_exprs(value):
    """``value`` (an attribute, nested tuples) with each open size as its value and expression.

    A :class:`~taso_jax.ops.dims.Dim` equals and hashes as its value, so without this two
    reshapes of ``[1, 1, N]`` to ``(1, 1, N, 1)`` and to ``(1, 1, 1, N)``, the same at a
    binding of ``N = 1``, were one node (a MiniLM's attention mask, 2026-11-30).
    """
    if isinstance(value, _Dim):
        return (_EXPR, int(value), value.expr)
    if isinstance(value, tuple) and any(isinstance(x, tuple | _Dim) for x in value):
        return tuple(_with_exprs(x) for x in value)
    return value


def intern_node(op: str, attrs: tuple, inputs: tuple, types: tuple) -> Node:
    """Return the unique node for ``(op, attrs, inputs)``, creating it with ``types``.

    Once open sizes exist in the process, attributes that differ only in their sizes'
    expressions make different nodes (:func:`_with_exprs`).
    """
    key = (op, _with_exprs(attrs) if _DIMS_MADE[0] else attrs, inputs)
    with _LOCK:
        node = _TABLE.get(key)
        if node is None:
            node = Node(op, attrs, inputs, tuple(types))
            _TABLE[key] = node
    return node


def make_node(op: str, inputs: Iterable[Tensor], attrs: Mapping[str, Any] | None = None) -> Node:
    """Create (or find) an operator node, checking its shape rule.

    Raises:
        KeyError: unknown operator.
        ShapeError: inputs or attributes that the operator's shape rule rejects.
    """
    opdef = get_op(op)
    inputs = tuple(inputs)
    in_types = [t.type for t in inputs]
    a = dict(attrs or {})
    if opdef.canon is not None:
        a = opdef.canon(in_types, {**opdef.attrs, **a})
    norm = opdef.normalize_attrs(a)
    types = opdef.infer(in_types, dict(norm))
    return intern_node(op, norm, inputs, tuple(types))


def composition_nodes(node: Node, priced: bool = False) -> list[Node] | None:
    """The nodes of ``node``'s ``OpDef.composition``, built on its inputs, else ``None``.

    ``None`` also where the operator declares none, or where ``node``'s attributes select
    another implementation (``attention`` lowered in query blocks). The measured cost model prices
    such a node as these nodes. ``priced``: where there is no composition, the steps of
    ``OpDef.priced_as`` that estimate the node's own kernel (the calibrated cost model).
    """
    opdef = OPS.get(node.op)
    composition = opdef.composition if opdef is not None else None
    steps = composition(node) if composition is not None else None
    if steps is None and priced and opdef is not None and opdef.priced_as is not None:
        steps = opdef.priced_as(node)
    if steps is None:
        return None
    nodes: list[Node] = []
    for op, ins, attrs in steps:
        nodes.append(make_node(op, [nodes[i].outputs[0] if isinstance(i, int) else i
                                    for i in ins], attrs))
    return nodes


def rebuild_node(node: Node, inputs) -> Node:
    """``node``'s operation applied to new input tensors.

    Shapes are re-inferred; an opaque node, which has no shape rule, keeps its output types.
    Returns ``node`` itself if the inputs are unchanged.
    """
    inputs = tuple(inputs)
    if inputs == node.inputs:
        return node
    if node.op == "opaque":
        return intern_node("opaque", node.attrs, inputs, node.types)
    return make_node(node.op, inputs, node.attr_dict)


def leaf_node(kind: str, name: str, ttype: TensorType) -> Node:
    """An input or weight node named ``name`` of type ``ttype``."""
    return intern_node(kind, (("name", name), ("type", ttype)), (), (ttype,))


def topo_order(outputs: Iterable[Tensor]) -> list[Node]:
    """Nodes reachable from ``outputs``, inputs before consumers (iterative DFS)."""
    order: list[Node] = []
    seen: set[Node] = set()
    stack: list[tuple[Node, bool]] = [(t.node, False) for t in reversed(list(outputs))]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack.extend((t.node, False) for t in reversed(node.inputs) if t.node not in seen)
    return order


@dataclass(frozen=True, eq=False)
class Graph:
    """An immutable computation graph.

    Attributes:
        inputs: input nodes, in signature order (kept even when unused).
        outputs: output tensors.
        output_names: one name per output.
        weights: weight name -> numpy array (read-only mapping).
        meta: free-form facts carried from import to export (ONNX opset, domains, names).
    """

    inputs: tuple[Node, ...]
    outputs: tuple[Tensor, ...]
    output_names: tuple[str, ...]
    weights: Mapping[str, np.ndarray] = field(default_factory=dict)
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if len(self.outputs) != len(self.output_names):
            raise GraphError("outputs and output_names differ in length")
        object.__setattr__(self, "weights", MappingProxyType(dict(self.weights)))
        object.__setattr__(self, "meta", MappingProxyType(dict(self.meta)))

    @property
    def key(self) -> tuple[Tensor, ...]:
        """Exact structural identity: equal keys iff the graphs compute the same DAG."""
        return self.outputs

    def forget_caches(self, keep: Iterable[str] = ()) -> None:
        """Drop the derived properties computed so far (:attr:`nodes`, :attr:`consumers`...).

        They are recomputed when next read; the names in ``keep`` stay. A search holds
        hundreds of graphs (the visited ones, the parents of queued rewrites); on a
        254-operator model the cached adjacency of each is about 60 KB.
        """
        for name in _CACHED:
            if name not in keep:
                self.__dict__.pop(name, None)

    @cached_property
    def nodes(self) -> list[Node]:
        """All nodes reachable from the outputs, in topological order."""
        return topo_order(self.outputs)

    @cached_property
    def node_set(self) -> frozenset[Node]:
        """All nodes reachable from the outputs, as a set."""
        return frozenset(self.nodes)

    @cached_property
    def positions(self) -> dict[Node, int]:
        """Node -> its index in :attr:`nodes` (topological position)."""
        return {n: i for i, n in enumerate(self.nodes)}

    @cached_property
    def ancestor_bits(self) -> dict[Node, int]:
        """Node -> its ancestors (itself included) as a bit set of :attr:`positions`.

        Bit ``i`` of ``ancestor_bits[n]`` is set iff node ``nodes[i]`` is ``n`` or reaches
        it: whether one node reaches another is one ``&``. Built in one pass over the nodes
        (on a 20,000-operator chain about 50 ms and 25 MB: a node's set is as long as its
        position), so it is read only where a walk would be long.
        """
        bits: dict[Node, int] = {}
        for i, n in enumerate(self.nodes):
            b = 1 << i
            for t in n.inputs:
                b |= bits[t.node]
            bits[n] = b
        return bits

    @cached_property
    def consumers(self) -> dict[Tensor, list[Node]]:
        """Tensor -> nodes that read it (graph outputs are not listed)."""
        out: dict[Tensor, list[Node]] = {}
        for n in self.nodes:
            for t in n.inputs:
                out.setdefault(t, []).append(n)
        return out

    @cached_property
    def output_set(self) -> frozenset[Tensor]:
        """Graph outputs as a set."""
        return frozenset(self.outputs)

    @cached_property
    def weight_only(self) -> frozenset[Node]:
        """Nodes whose value depends on weights only (precomputed once, cost nothing)."""
        return frozenset(n for n in self.nodes if n.weight_only)

    @cached_property
    def by_op(self) -> dict[str, list[Node]]:
        """Operator name -> nodes, in topological order."""
        out: dict[str, list[Node]] = {}
        for n in self.nodes:
            out.setdefault(n.op, []).append(n)
        return out

    def op_counts(self, include_weight_only: bool = False) -> Counter:
        """Count of runtime operator nodes by operator name."""
        return Counter(n.op for n in self.nodes if n.op not in LEAF_OPS
                       and (include_weight_only or n not in self.weight_only))

    def replace(self, mapping: Mapping[Tensor, Tensor],
                rebuilt: dict[Node, Node] | None = None) -> Graph:
        """A new graph with each tensor in ``mapping`` replaced by its value everywhere.

        Every node that reads a replaced tensor, directly or through other nodes, is rebuilt
        on its new inputs. ``rebuilt`` (optional, a dict) is filled with old node -> rebuilt
        node for each of them (nodes left dead by the replacement included).
        """
        new: dict[Node, Node] = {} if rebuilt is None else rebuilt

        def remap(t: Tensor) -> Tensor:
            if t in mapping:
                return mapping[t]
            return Tensor(new.get(t.node, t.node), t.index)

        nodes = self.nodes
        # A node before every replaced tensor's producer, in topological order, reads none
        # of them, directly or not: the walk starts after the first producer.
        producers = {t.node for t in mapping}
        start = next((i for i, n in enumerate(nodes) if n in producers), -1) + 1
        for n in nodes[start:]:
            if not n.inputs:
                continue
            ins = tuple(remap(t) for t in n.inputs)
            if ins != n.inputs:
                new[n] = intern_node(n.op, n.attrs, ins, n.types)
        return Graph(self.inputs, tuple(remap(t) for t in self.outputs), self.output_names,
                     self.weights, self.meta)

    def used_weights(self) -> dict[str, np.ndarray]:
        """Weights reachable from the outputs."""
        return {n.name: self.weights[n.name] for n in self.nodes if n.op == "weight"}

    def __str__(self) -> str:
        ids = {n: f"%{i}" for i, n in enumerate(self.nodes)}
        lines = []
        for n in self.nodes:
            args = ", ".join(f"{ids[t.node]}" + (f".{t.index}" if t.index else "")
                             for t in n.inputs)
            shapes = ", ".join(str(list(t.shape)) for t in n.types)
            lines.append(f"{ids[n]} = {n!r}({args}) -> {shapes}")
        outs = ", ".join(f"{nm}={ids[t.node]}.{t.index}"
                         for nm, t in zip(self.output_names, self.outputs, strict=True))
        lines.append(f"outputs: {outs}")
        return "\n".join(lines)


#: Names of Graph's cached properties (see Graph.forget_caches).
_CACHED = tuple(name for name, v in vars(Graph).items() if isinstance(v, cached_property))


class GraphBuilder:
    """Mutable builder with TASO's Python API; ``graph()`` returns an immutable :class:`Graph`.

    Every declared operator is a method: ``b.conv2d(x, w, strides=(1, 1), padding="same",
    activation="relu")``, ``b.matmul(a, b)``, ``b.concat([t1, t2], axis=1)``,
    ``b.split(t, axis=1, sizes=(2, 3))`` (returns a list). Tensors may be passed positionally,
    as a list, or as TASO's keywords ``input=``/``weight=``; padding and activation strings
    are case-insensitive (``"SAME"``, ``"RELU"``). Shapes follow the operator docs (NCHW,
    OIHW).

    Raises:
        ShapeError: an operator applied to tensors of the wrong shapes.
        GraphError: duplicate input or weight names, or an output that is not a tensor.
    """

    def __init__(self, seed: int = 0):
        self._inputs: list[Node] = []
        self._weights: dict[str, np.ndarray] = {}
        self._outputs: list[tuple[str, Tensor]] = []
        self._made: list[Node] = []
        self._rng = np.random.default_rng(seed)

    def _fresh(self, prefix: str) -> str:
        used = {n.name for n in self._inputs} | set(self._weights)
        i = len(used)
        while f"{prefix}{i}" in used:
            i += 1
        return f"{prefix}{i}"

    def new_input(self, dims, dtype: str = "float32", name: str | None = None) -> Tensor:
        """A runtime input of shape ``dims``."""
        name = name or self._fresh("input")
        if any(n.name == name for n in self._inputs) or name in self._weights:
            raise GraphError(f"duplicate input name {name!r}")
        node = leaf_node("input", name, TensorType(tuple(int(d) for d in dims), dtype))
        self._inputs.append(node)
        return node.outputs[0]

    def new_weight(self, dims=None, data=None, dtype: str = "float32",
                   name: str | None = None) -> Tensor:
        """A weight (constant). ``data=None`` draws seeded random values N(0, 0.1^2)."""
        if data is None:
            data = (self._rng.standard_normal(tuple(dims)) * 0.1).astype(dtype)
        data = np.asarray(data)
        if dims is not None and tuple(data.shape) != tuple(dims):
            raise GraphError(f"weight data shape {data.shape} != dims {tuple(dims)}")
        name = name or self._fresh("weight")
        if name in self._weights or any(n.name == name for n in self._inputs):
            raise GraphError(f"duplicate weight name {name!r}")
        self._weights[name] = data
        return leaf_node("weight", name, TensorType(data.shape, str(data.dtype))).outputs[0]

    def mark_output(self, tensor: Tensor, name: str | None = None) -> None:
        """Make ``tensor`` a graph output (default name ``output<i>``)."""
        if not isinstance(tensor, Tensor):
            raise GraphError(f"output must be a Tensor, got {type(tensor).__name__}")
        self._outputs.append((name or f"output{len(self._outputs)}", tensor))

    def apply(self, op: str, inputs, **attrs):
        """Apply operator ``op``; returns a Tensor, or a list for multi-output operators."""
        for k in ("padding", "activation"):
            if isinstance(attrs.get(k), str):
                attrs[k] = attrs[k].lower()
        node = make_node(op, inputs, attrs)
        self._made.append(node)
        return node.outputs[0] if len(node.types) == 1 else list(node.outputs)

    def __getattr__(self, op: str):
        if op.startswith("_") or op not in OPS:
            raise AttributeError(op)

        def method(*args, **kwargs):
            inputs: list[Tensor] = []
            for a in (*args, *(kwargs.pop(k) for k in ("input", "weight", "inputs")
                               if k in kwargs)):
                if isinstance(a, list | tuple) and not isinstance(a, Tensor):
                    inputs.extend(a)
                else:
                    inputs.append(a)
            bad = [a for a in inputs if not isinstance(a, Tensor)]
            if bad:
                raise GraphError(f"{op}: inputs must be tensors, got {bad[0]!r}; pass "
                                 "attributes by keyword")
            return self.apply(op, inputs, **kwargs)

        method.__doc__ = OPS[op].doc
        return method

    def graph(self) -> Graph:
        """Freeze into a :class:`Graph`; without marked outputs, every unused tensor is one."""
        outs = self._outputs
        if not outs:
            used = {t for n in self._made for t in n.inputs}
            sinks = [t for n in self._made for t in n.outputs if t not in used]
            outs = [(f"output{i}", t) for i, t in enumerate(dict.fromkeys(sinks))]
        if not outs:
            raise GraphError("graph has no operators and no outputs")
        return Graph(tuple(self._inputs), tuple(t for _, t in outs), tuple(n for n, _ in outs),
                     self._weights, {"opset": 17})


def new_graph(seed: int = 0) -> GraphBuilder:
    """Start a graph with TASO's builder API (``taso.new_graph()``)."""
    return GraphBuilder(seed)


__all__ += ["ShapeError", "leaf_node", "topo_order", "intern_node"]

