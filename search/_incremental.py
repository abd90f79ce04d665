"""Incremental matching: a rewritten graph's matches from those of the graph it came from.

A rewrite rebuilds every node downstream of it (hash-consing), but most of those are
*stable* (:class:`_Change`): a match made of stable nodes is carried over, and matches are
looked for again only near the nodes the rewrite really changed
(:func:`_incremental_matches`). The backtracking search carries a parent's matches to each
child it pops; the greedy descent carries its table of matches across each rewrite, or a
run of them (:func:`_carry_table`).
"""

from __future__ import annotations

from collections import Counter

from taso_jax.search._rewrites import SearchState
from taso_jax.search.match import Match, find_matches
from taso_jax.search.pattern import NodeRef
from taso_jax.search.rules import Substitution

from taso_jax.ir.graph import Graph, Tensor


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


def _carry_table(table: dict, change: _Change, new: Graph, reach: dict, by_id: dict,
                 state: SearchState) -> dict:
    """Each rule's matches moved to ``new`` across ``change`` (one rewrite, or a run).

    ``table``, ``reach`` and ``by_id`` (the rules) are keyed by rule id.

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
