"""Matching a substitution's source in a graph, and building its target there.

Matching (TASO, Jia et al., SOSP 2019, Section 5) binds source pattern nodes to graph nodes
with the same operator and attributes, and variables to tensors consistently; it checks the
symbolic shapes (:func:`unify_shape`) and refuses opaque nodes. :func:`find_matches` yields
each binding as a frozen :class:`Match`. :func:`prepare` then checks what a binding needs to
be rewritten (internal source tensors read outside the match or used as graph outputs,
bindings that would create a cycle, a target whose shapes do not work out) and builds the
target's nodes: the result is a :class:`Rewrite`, or a falsy :class:`NoMatch` that says why
not (as onnxscript's ``MatchResult`` does).

Reasons are counted in a :class:`MatchState`, which also keeps, per rule, the bindings of
its first source node to each host node (nodes are immutable, so those never change); a
search owns one state, so no search depends on another.
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from taso_jax.ops import OPS, ShapeError
from taso_jax.ops.dims import same_size, same_value
from taso_jax.search.pattern import AttrVar, NodeRef, PNode, Ref, resolve_attr
from taso_jax.search.rules import Substitution

from taso_jax.ir.graph import Graph, Node, Tensor, make_node

__all__ = ["Match", "NoMatch", "Rewrite", "MatchState", "find_matches", "prepare", "apply",
           "rewrites", "instantiate", "unify_shape"]

#: Dtypes a pattern variable binds to (the rules are proved over the reals).
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})


@dataclass(frozen=True)
class Match:
    """One binding of a rule's source in a graph.

    Attributes:
        nodes: the host node of each source pattern node, in pattern order.
        vars: pattern variable name -> host tensor.
        sym: shape symbol or attribute variable (``"D"``, ``"?groups"``) -> its value;
            ``"..."`` -> the leading dimensions.
    """

    nodes: tuple[Node, ...]
    vars: Mapping[str, Tensor]
    sym: Mapping[str, Any]

    def __post_init__(self):
        object.__setattr__(self, "vars", MappingProxyType(dict(self.vars)))
        object.__setattr__(self, "sym", MappingProxyType(dict(self.sym)))


@dataclass(frozen=True)
class NoMatch:
    """A binding that cannot be rewritten; falsy, and says why.

    ``reason`` is one of ``weight_only`` (the matched nodes are computed ahead of time,
    rewriting them gains nothing), ``internal_used`` (a tensor the rewrite removes is read
    elsewhere or is a graph output), ``cycle``, ``target_shape`` (the target's shape rules
    reject the bound tensors, or a size does not divide), ``output_type`` (a target output's
    type differs from the source output it replaces).
    """

    reason: str

    def __bool__(self) -> bool:
        return False


@dataclass(frozen=True)
class Rewrite:
    """A valid rewrite of one match: what :meth:`Graph.replace` takes, and the target nodes.

    Attributes:
        match: the binding rewritten.
        mapping: source output tensor -> the target tensor that replaces it.
        created: the target's nodes, built on the bound tensors (some may already exist in
            the graph: nodes are hash-consed).
    """

    match: Match
    mapping: Mapping[Tensor, Tensor]
    created: tuple[Node, ...]


@dataclass
class MatchState:
    """What matching keeps while one search runs: rejection counts and per-node bindings.

    Attributes:
        rejected: reason -> how many candidate bindings were turned down for it (``attrs``,
            ``shape``, ``unproved_instance`` while matching; the :class:`NoMatch` reasons
            when preparing).
    """

    rejected: Counter = field(default_factory=Counter)
    # (first source node, its variables' shapes) -> {host node: bindings}
    _first: dict = field(default_factory=dict, repr=False)
    _first_of_rule: dict = field(default_factory=dict, repr=False)  # rule id -> dict
    # (rule id, bound variables' types, symbols) whose target the shape rules rejected: a
    # single-node source such as expand-conv2d matches every convolution in every graph
    _bad_targets: set = field(default_factory=set, repr=False)

    def first_cache(self, rule: Substitution) -> dict:
        """Host node -> bindings of ``rule``'s first source node there.

        The bindings depend on that node (operator, attributes, inputs) and its variables'
        shape patterns only, so rules that agree on those share one dict: the 1,030 shipped
        rules have 112 distinct first nodes. One dict per rule kept about 15 MB of bindings
        after ten expansions of a 254-operator ShuffleNet.
        """
        found = self._first_of_rule.get(rule.id)
        if found is None:  # the rule's content, hence its first node, gives the dict
            p = rule.source[0]
            key = (p, tuple(rule.variable_shapes[r.name] for r in p.inputs
                            if not isinstance(r, NodeRef)))
            found = self._first_of_rule[rule.id] = self._first.setdefault(key, {})
        return found


def unify_shape(pattern: tuple, shape: tuple[int, ...], sym: dict) -> dict | None:
    """Extend the binding ``sym`` so that ``pattern`` matches ``shape``, or ``None``.

    ``pattern`` holds integers, shape symbols, and an optional leading ``"..."`` for any
    leading dimensions (bound as a tuple under ``"..."``).
    """
    sym = dict(sym)
    if pattern and pattern[0] == "...":
        rest = pattern[1:]
        if len(shape) < len(rest):
            return None
        lead = tuple(shape[: len(shape) - len(rest)])
        if not same_value(sym.setdefault("...", lead), lead):
            return None
        pattern, shape = rest, shape[len(shape) - len(rest):]
    if len(pattern) != len(shape):
        return None
    for p, d in zip(pattern, shape, strict=True):
        # same_size: equal at every binding of a model's open sizes (taso_jax.ops.dims), so a
        # rule that needs two sizes equal (or a size of 1) does not match N bound at 1
        if isinstance(p, int):
            if not same_size(p, d):
                return None
        elif not same_size(sym.setdefault(p, d), d):
            return None
    return sym


def _attrs_match(pattern: tuple, host: tuple, sym: dict) -> dict | None:
    """Extended binding if the pattern's attributes match the host's, else ``None``.

    An attribute variable is bound to the host's value on first use and must be equal
    wherever else it appears; a size expression must evaluate to the host's value.
    """
    if len(pattern) != len(host):
        return None
    for (k1, v1), (k2, v2) in zip(pattern, host, strict=True):
        if k1 != k2:
            return None
        if isinstance(v1, AttrVar):
            if v1.name not in sym:
                sym = {**sym, v1.name: v2}
            elif not same_value(sym[v1.name], v2):
                return None
            continue
        try:
            if not same_value(resolve_attr(v1, sym), v2):
                return None
        except (KeyError, ShapeError):
            return None
    return sym


def find_matches(rule: Substitution, graph: Graph, state: MatchState | None = None,
                 near: set | None = None, deadline: float | None = None) -> Iterator[Match]:
    """Yield every binding of ``rule``'s source in ``graph``.

    ``state`` (optional) counts rejections and caches first-node bindings; ``near``
    (optional) restricts the host of the first source node to a set of nodes (a local
    search around a recent rewrite). Past ``deadline`` (a ``time.perf_counter()`` value,
    optional) no more host nodes are tried: the bindings found so far are yielded, and a
    search that passes one stops (a rule can try millions of pairs of nodes in a large
    graph before it yields).
    """
    state = state if state is not None else MatchState()
    order = _join_order(rule.source)
    if order == tuple(range(len(rule.source))):
        yield from _find_matches(rule, graph, state, near, order, deadline)
        return
    # Bound in another order than the pattern's: yield in the order the pattern's would.
    pos = graph.positions
    found = list(_find_matches(rule, graph, state, near, order, deadline))
    found.sort(key=lambda m: tuple(pos[n] for n in m.nodes))
    yield from found


@functools.lru_cache(maxsize=4096)
def _join_order(source: tuple[PNode, ...]) -> tuple[int, ...]:
    """The order in which to bind ``source``'s nodes: each one next to one already bound.

    A node is *anchored* when it reads a bound node or a bound variable (its host is among
    the readers of that tensor) or when a bound node reads it (its host is the producer of
    that input). The pattern's own order is kept while it is anchored; otherwise the first
    anchored node comes next, so that two unrelated source nodes are never joined by trying
    every pair (``conv2d(conv2d(x, w), ewadd(y, y))`` binds the outer convolution second and
    finds the ``ewadd`` as the producer of its kernel).
    """
    order = [0]
    bound_vars = {r.name for r in source[0].inputs if not isinstance(r, NodeRef)}

    def anchored(i):
        if any(isinstance(r, NodeRef) and r.node in order or
               not isinstance(r, NodeRef) and r.name in bound_vars
               for r in source[i].inputs):
            return True
        return any(isinstance(r, NodeRef) and r.node == i
                   for j in order for r in source[j].inputs)

    while len(order) < len(source):
        rest = [i for i in range(len(source)) if i not in order]
        nxt = next((i for i in rest if anchored(i)), rest[0])
        order.append(nxt)
        bound_vars |= {r.name for r in source[nxt].inputs if not isinstance(r, NodeRef)}
    return tuple(order)


def _pending(i: int, k: int | str) -> str:
    """Where a bound reader records the host tensor of source node ``i``'s output ``k``.

    The key is used before node ``i`` is bound and is never a variable name.
    """
    return f"#{i}.{k}"


def _find_matches(rule: Substitution, graph: Graph, state: MatchState, near, order,
                  deadline: float | None = None):
    stats = state.rejected
    shapes = rule.variable_shapes
    source = rule.source
    n_src = len(source)
    bound: list[Node | None] = [None] * n_src
    allowed = rule.proved_instances
    first_cache = state.first_cache(rule)
    natural = order == tuple(range(n_src))

    def host_of(ref: Ref, var: dict) -> Tensor | None:
        if isinstance(ref, NodeRef):
            node = bound[ref.node]
            if node is None:  # read by a node bound before it: that tensor, if known
                return var.get(_pending(ref.node, ref.output))
            return Tensor(node, ref.output)
        return var.get(ref.name)

    def first_bindings(h: Node) -> tuple[tuple, ...]:
        # The first source node reads variables only, so its bindings depend on the host
        # node alone, and nodes are immutable: computed once per node and kept.
        found = first_cache.get(h)
        if found is None:
            found = first_cache[h] = _host_bindings(source[0], h, {}, {}, host_of, shapes,
                                                    stats)
        return found

    def extend(step: int, var: dict, sym: dict) -> Iterator[Match]:
        if step == n_src:
            if allowed is not None and not any(all(sym.get(k) == v for k, v in a.items())
                                               for a in allowed):
                stats["unproved_instance"] += 1  # proved only at other attribute values
                return
            if not natural:
                var = {k: v for k, v in var.items() if not k.startswith("#")}
            yield Match(tuple(bound), var, sym)
            return
        i = order[step]
        p = source[i]
        prefix = _pending(i, "")
        produced = [] if natural else [(k, t) for k, t in var.items() if k.startswith(prefix)]
        if produced:
            h = produced[0][1].node
            if h.op != p.op or any(t != Tensor(h, int(k[len(prefix):])) for k, t in produced):
                return
            cands = [h]
        else:
            anchors = [host_of(r, var) for r in p.inputs]
            anchor = next((t for t in anchors if t is not None), None)
            if anchor is not None:
                cands = [n for n in graph.consumers.get(anchor, ()) if n.op == p.op]
            else:
                cands = graph.by_op.get(p.op, [])
                if near is not None and len(near) < len(cands):
                    # the few nodes near a rewrite, in the same (topological) order
                    pos = graph.positions
                    cands = sorted((n for n in near if n.op == p.op and n in pos),
                                   key=pos.__getitem__)
                elif near is not None:
                    cands = [n for n in cands if n in near]
        for h in dict.fromkeys(cands):
            if h in bound:
                continue
            if deadline is not None and time.perf_counter() > deadline:
                return
            found = (first_bindings(h) if step == 0 else
                     _host_bindings(p, h, var, sym, host_of, shapes, stats))
            for var2, sym2 in found:
                bound[i] = h
                yield from extend(step + 1, var2, sym2)
                bound[i] = None

    yield from extend(0, {}, {})


def _host_bindings(p: PNode, h: Node, var: dict, sym: dict, host_of, shapes: dict,
                   stats: Counter) -> tuple[tuple, ...]:
    """Each ``(vars, symbols)`` that binds pattern node ``p`` to host node ``h``.

    ``var`` and ``sym`` are extended; a commutative operator is tried in both operand orders.
    """
    if len(h.inputs) != len(p.inputs):
        return ()
    sym_a = _attrs_match(p.attrs, h.attrs, sym)
    if sym_a is None:
        stats["attrs"] += 1
        return ()
    orders = [h.inputs]
    if OPS[p.op].commutative and h.inputs[0] != h.inputs[1]:
        orders.append(h.inputs[::-1])
    found = []
    for host_inputs in orders:
        b = _bind_inputs(p, host_inputs, var, sym_a, host_of, shapes, stats)
        # Sizes in attributes ("$D") can only be checked once shapes are bound.
        if b is not None and _attrs_match(p.attrs, h.attrs, b[1]) is not None:
            found.append(b)
    return tuple(found)  # kept per host node by first_bindings: () shares one object


def _bind_inputs(p: PNode, host_inputs, var: dict, sym: dict, host_of, shapes: dict,
                 stats: Counter) -> tuple | None:
    """Bind a pattern node's inputs to host tensors: ``(vars, symbols)`` or ``None``."""
    var = dict(var)
    for r, t in zip(p.inputs, host_inputs, strict=True):
        want = host_of(r, var)
        if want is not None:
            if want != t:
                return None
            continue
        if isinstance(r, NodeRef):  # its producer is bound later: it must be t's producer
            var[_pending(r.node, r.output)] = t
            continue
        if t.dtype not in FLOAT_DTYPES:
            return None
        sym = unify_shape(shapes[r.name], t.shape, sym)
        if sym is None:
            stats["shape"] += 1
            return None
        var[r.name] = t
    return var, sym


def prepare(rule: Substitution, graph: Graph, match: Match,
            state: MatchState | None = None) -> Rewrite | NoMatch:
    """Check that ``match`` can be rewritten and build the target's nodes.

    Returns a :class:`Rewrite`, or a falsy :class:`NoMatch` with the reason (also counted
    in ``state.rejected`` when a state is given).
    """
    if state is None:
        return _prepare(rule, graph, match)
    try:  # the target's shapes depend on the bound types alone, not on the graph
        key = (rule.id, tuple((k, t.type) for k, t in match.vars.items()),
               tuple(match.sym.items()))
        known_bad = key in state._bad_targets
    except TypeError:  # an unhashable attribute value: not remembered
        key, known_bad = None, False
    result = NoMatch("target_shape") if known_bad else _prepare(rule, graph, match)
    if not result:
        state.rejected[result.reason] += 1
        if result.reason == "target_shape" and key is not None:
            state._bad_targets.add(key)
    return result


def _prepare(rule: Substitution, graph: Graph, match: Match) -> Rewrite | NoMatch:
    hosts = match.nodes
    var, sym = match.vars, match.sym
    matched = set(hosts)
    if all(h.weight_only for h in hosts):
        return NoMatch("weight_only")  # rewriting weight-only work changes nothing at run time
    out_refs = rule.source_output_refs
    for i, h in enumerate(hosts):
        for k, t in enumerate(h.outputs):
            if NodeRef(i, k) in out_refs:
                continue
            if t in graph.output_set or any(
                    c not in matched for c in graph.consumers.get(t, ())):
                return NoMatch("internal_used")
    if _creates_cycle(graph, matched, var.values()):
        return NoMatch("cycle")
    try:
        built = instantiate(rule.target, var, sym)
    except (ShapeError, KeyError):
        return NoMatch("target_shape")
    mapping: dict[Tensor, Tensor] = {}
    for s, t in rule.outputs:
        src = Tensor(hosts[s.node], s.output)
        tgt = var[t.name] if not isinstance(t, NodeRef) else Tensor(built[t.node], t.output)
        if src.type != tgt.type:
            return NoMatch("output_type")
        mapping[src] = tgt
    return Rewrite(match, mapping, tuple(built))


#: Nodes :func:`_creates_cycle` walks before it asks the graph's ancestor sets instead.
CYCLE_WALK = 64


def _creates_cycle(graph: Graph, matched: set[Node], var_tensors,
                   walk: int = CYCLE_WALK) -> bool:
    """Whether a bound variable depends on a matched node (the rewrite would be cyclic).

    Only variables produced after the first matched node (in topological order) can, and
    only through nodes between the two. Those are walked back, at most ``walk`` of them;
    where the walk is longer (a weight that two matmuls far apart in an unrolled RNN
    share: every pair of them matches), one ``&`` of the graph's ancestor sets
    (:attr:`~taso_jax.ir.graph.Graph.ancestor_bits`, built once per graph) answers
    instead: a walk per match made matching quadratic in the graph's size.
    """
    pos = graph.positions
    first = min(pos[n] for n in matched)
    late = [t.node for t in var_tensors if pos[t.node] >= first]
    if not late:
        return False
    stack = list(late)
    seen: set[Node] = set()
    while stack:
        n = stack.pop()
        if n in matched:
            return True
        if n in seen:
            continue
        seen.add(n)
        if len(seen) > walk:
            bits = graph.ancestor_bits
            mask = 0
            for m in matched:
                mask |= 1 << pos[m]
            return any(bits[v] & mask for v in late)
        stack.extend(t.node for t in n.inputs if pos[t.node] >= first)
    return False


def apply(rule: Substitution, graph: Graph, match: Match,
          state: MatchState | None = None) -> Graph | NoMatch:
    """The graph rewritten at ``match``, or a falsy :class:`NoMatch`."""
    rw = prepare(rule, graph, match, state)
    return graph.replace(rw.mapping) if rw else rw


def rewrites(rule: Substitution, graph: Graph,
             state: MatchState | None = None) -> Iterator[Graph]:
    """Every graph obtained by applying ``rule`` once to ``graph``."""
    for m in find_matches(rule, graph, state):
        g = apply(rule, graph, m, state)
        if g:
            yield g


def instantiate(nodes: tuple[PNode, ...], variables: Mapping[str, Tensor],
                sym: Mapping[str, Any]) -> list[Node]:
    """Build pattern nodes on tensors bound to their variables, resolving symbolic attributes.

    Raises:
        ShapeError: a node's shape rule rejects the bound tensors, or the node is a form
            that cannot run on this device (``OpDef.runs_here``: cuDNN attention on a CPU).
        KeyError: an unbound variable, symbol or attribute variable.
    """
    built: list[Node] = []
    for p in nodes:
        ins = [Tensor(built[r.node], r.output) if isinstance(r, NodeRef) else variables[r.name]
               for r in p.inputs]
        node = make_node(p.op, ins, {k: resolve_attr(v, sym) for k, v in p.attrs})
        runs_here = OPS[p.op].runs_here
        why = runs_here(node) if runs_here is not None else None
        if why:
            raise ShapeError(f"{p.op}: {why}")
        built.append(node)
    return built
