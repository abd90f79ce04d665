"""A rule's rewrites of a graph, checked and priced without building the graphs they make.

What the backtracking search (:mod:`taso_jax.search.backtracking`), the greedy descent
(:mod:`taso_jax.search.descent`) and the second opinions
(:mod:`taso_jax.search.second_opinions`) share: the state one search keeps
(:class:`SearchState`), the rules that can match a graph, and each rewrite's cost estimated
from the nodes it adds and removes (:func:`_prepared`), matches that did not pay remembered
across rewrites (:func:`_refusal_key`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from taso_jax.search.cost import CostModel
from taso_jax.search.limits import until
from taso_jax.search.match import MatchState, Rewrite, find_matches, prepare
from taso_jax.search.rules import Substitution

from taso_jax.ir.graph import Graph


@dataclass
class SearchState:
    """What one search keeps while it runs; nothing outlives it or is shared between searches.

    Attributes:
        matching: rejection counts and first-node bindings (:class:`MatchState`).
        pair_hits: rule id -> times it was part of a successful pair step (pairs that
            worked once are tried first: a model repeats its patterns).
        pair_failed: sideways rewrites after which no second rewrite paid, by rule id and
            the nodes near what they created
            (see :func:`~taso_jax.search.descent._pair_step`).
        fold_gate: ``fold_gate(graph, rewrite, rule)``, asked of each rewrite that
            computes a new weight ahead of time; a truthy answer (the fault) refuses it
            (:class:`~taso_jax.search.fold_refusals.FoldGate`). ``None``: none asked.
    """

    matching: MatchState = field(default_factory=MatchState)
    pair_hits: Counter = field(default_factory=Counter)
    pair_failed: set = field(default_factory=set)
    fold_gate: Callable[[Graph, Rewrite, Substitution], object] | None = None


def _relevant(subs: Sequence[Substitution], graph: Graph) -> list[Substitution]:
    ops = graph.by_op
    return [s for s in subs if all(p.op in ops for p in s.source)]


def _estimate(graph: Graph, cost: float, rw: Rewrite, cost_model: CostModel,
              limit: float | None = None, measure_until: float | None = None) -> float:
    """Estimated cost (microseconds) of a prepared rewrite, without building the graph.

    It follows from the nodes the rewrite adds and removes: the matched nodes disappear;
    target nodes already in the graph are shared, not added. Upstream nodes that become
    dead are not subtracted, so the estimate errs high; the search builds and prices
    exactly every graph it keeps. With ``limit``, the added nodes are first taken at their
    floors (:meth:`~taso_jax.search.cost.CostModel.node_floor`): a rewrite that reaches
    ``limit`` even so is returned at that lower bound, its new kernels never measured.
    Kernels are measured until ``measure_until``
    (:meth:`~taso_jax.search.cost.CostModel.node_cost`).
    """
    new, removed = _sides(graph, rw, cost_model, measure_until)
    if limit is not None:
        floor = cost - removed + sum(cost_model.node_floor(n, measure_until) for n in new)
        if floor >= limit:
            return floor
    return cost + sum(cost_model.node_cost(n, measure_until) for n in new) - removed


def _sides(graph: Graph, rw: Rewrite, cost_model: CostModel,
           measure_until: float | None = None) -> tuple[list, float]:
    """A prepared rewrite's new runtime nodes, and the price (us) of the nodes it removes.

    The matched nodes disappear, but for those the target creates again; target nodes
    already in the graph are shared, not new; weight-only nodes cost nothing. Kernels are
    measured until ``measure_until`` (:meth:`~taso_jax.search.cost.CostModel.node_cost`).
    """
    nodes = graph.node_set
    created = set(rw.created)
    new = [n for n in created if n not in nodes and not n.weight_only]
    removed = sum(cost_model.node_cost(n, measure_until) for n in set(rw.match.nodes)
                  if n not in created and not n.weight_only)
    return new, removed


def _prepared(graph: Graph, cost: float, sub: Substitution, cost_model: CostModel,
              limit: float, state: SearchState, near: set | None = None,
              matches: list | None = None, refused: set | None = None,
              deadline: float | None = None, measure_until: float | None = None):
    """Yield ``(rewrite, estimate)`` for valid rewrites estimated below ``limit``.

    ``estimate`` (microseconds, an upper bound on the rewritten graph's cost) comes from
    :func:`_estimate`, without building the graph. ``matches`` (optional) are the rule's
    matches in ``graph`` when already known (:func:`_incremental_matches`). ``refused``
    (optional, kept by the caller across rewrites) holds the matches found here not to
    pay (:func:`_refusal_key`), which are then skipped: the greedy descent steps by a
    strictly cheaper rewrite at a time, and a match that did not pay keeps its nodes and
    its price unless a step rebuilt them. Past ``deadline`` (a ``time.perf_counter()``
    value, optional) no more matches are prepared; past ``measure_until`` (likewise) no
    more kernels are measured (:meth:`~taso_jax.search.cost.CostModel.node_cost`). A
    rewrite that computes a weight ahead of time which ``state.fold_gate`` faults is not
    yielded (a refusal by design: the fold overflows or underflows).
    """
    if matches is None:
        matches = find_matches(sub, graph, state.matching, near=near, deadline=deadline)
    if deadline is not None:
        matches = until(matches, deadline)
    for m in matches:
        key = _refusal_key(sub, m) if refused is not None else None
        if key is not None and key in refused:
            continue
        rw = prepare(sub, graph, m, state.matching)
        if not rw:
            if key is not None and rw.reason in _LASTING_REFUSALS:
                refused.add(key)
            continue
        estimate = _estimate(graph, cost, rw, cost_model, limit, measure_until)
        if estimate < limit:
            if state.fold_gate is not None and _folds(graph, rw) \
                    and state.fold_gate(graph, rw, sub):
                if key is not None:
                    refused.add(key)  # its fold stays faulty while its nodes stay
                continue
            yield rw, estimate
        elif key is not None and estimate - cost >= 0:
            refused.add(key)  # adds work wherever the graph's cost stands


def _folds(graph: Graph, rw: Rewrite) -> bool:
    """Whether ``rw`` creates an operator on weights only (one computed ahead of time)."""
    nodes = graph.node_set
    return any(n.weight_only and n.op != "weight" and n not in nodes for n in rw.created)


#: Reasons a match cannot be rewritten that no other rewrite changes while its nodes stay:
#: the matched work is weight-only, or the target's shapes do not hold. (A tensor used
#: elsewhere, or a cycle, can change as the graph around the match does.)
_LASTING_REFUSALS = frozenset({"weight_only", "target_shape", "output_type"})


def _refusal_key(sub: Substitution, m) -> tuple | None:
    """What identifies a match of ``sub`` across rewrites.

    The rule, the matched nodes and the bindings; ``None`` where a binding cannot be hashed.
    """
    try:
        key = (sub.id, m.nodes, tuple(m.vars.items()), tuple(m.sym.items()))
        hash(key)
    except TypeError:
        return None
    return key


def _cheaper(graph: Graph, cost: float, sub: Substitution, cost_model: CostModel,
             limit: float, state: SearchState, near: set | None = None,
             matches: list | None = None, deadline: float | None = None,
             measure_until: float | None = None):
    """Yield ``(rewrite, new_graph, new_cost, rebuilt)`` for rewrites estimated cheap.

    Rewrites whose estimate is below ``limit`` are built and priced exactly; ``rebuilt``
    maps the old nodes that the rewrite rebuilt to their new versions
    (:meth:`Graph.replace`). ``matches`` are the rule's matches in ``graph`` when known;
    past ``deadline`` none is looked at, past ``measure_until`` no kernel is measured.
    """
    for rw, _ in _prepared(graph, cost, sub, cost_model, limit, state, near, matches,
                           deadline=deadline, measure_until=measure_until):
        rebuilt: dict = {}
        g2 = graph.replace(rw.mapping, rebuilt)
        yield rw, g2, cost_model.graph_cost(g2, measure_until), rebuilt
