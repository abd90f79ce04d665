"""Candidates refused for a weight they fold ahead of time that overflows or underflows.

A proved rule is an identity over the reals; a graph it makes may compute a weight ahead
of time that overflows (``abs(x) @ (W1 + W2)`` at ``W = 3e38`` in float32) or underflows
(``x * (c * c)`` at ``c = 1e-30``) where the original does not
(:func:`~taso_jax.ir.fold_check.fold_overflow`). Such a graph is a refusal by design, not a
failure. The search asks a :class:`FoldGate` of each rewrite that computes a new weight
ahead of time, and does not apply one whose fold is faulty (its other rewrites stay);
:func:`refuse_faulty_folds` then drops from the search's candidates any graph that still
holds such a fold (a second opinion's, or one the search built before the gate) before the
end-to-end choice, and the cheapest graphs left (the input at worst) stand in for it. Each
refusal is recorded once per fault (:class:`FoldRefusal`), naming the rewrite refused.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from taso_jax.ir.fold_check import FoldOverflow, computes, fold_overflow
from taso_jax.ir.graph import Graph

__all__ = ["FoldGate", "FoldRefusal", "refuse_faulty_folds"]


@dataclass(frozen=True)
class FoldRefusal:
    """A rewrite refused because a weight it folds ahead of time overflowed or underflowed.

    Attributes:
        rules: the substitutions refused: those whose rewrites made the fault (the
            search's gate), or those every candidate dropped for it applied, in order (the
            rewrite to blame is among them).
        fault: what the fold computed (:class:`~taso_jax.ir.fold_check.FoldOverflow`).
        graphs: how many rewrites (by the search) or candidate graphs (after it) were
            refused for it.
    """

    rules: tuple[str, ...]
    fault: FoldOverflow
    graphs: int = 1

    def __str__(self) -> str:
        rules = ", ".join(self.rules) or "a rewrite"
        return f"rewrite refused: {rules}: {self.fault}"

    def to_json(self) -> dict:
        """The record as a JSON-able dict (one of the report's ``fold_refusals``)."""
        return {"rules": list(self.rules), "graphs": self.graphs, "why": str(self),
                **{k: v for k, v in self.fault.to_json().items() if k not in ("ok", "why")}}


class FoldGate:
    """The search's check of each rewrite that computes a new weight ahead of time.

    Called as ``gate(graph, rewrite, rule)`` (:attr:`~taso_jax.search._rewrites.
    SearchState.fold_gate`): the graph the rewrite makes is built and the weight-only
    operators it adds are evaluated (:func:`~taso_jax.ir.fold_check.fold_overflow`, against
    ``graph``); returns the fault, or ``None``. A set of new operators is judged once.

    Args:
        weights_of: ``weights_of(g)``, the weight values of ``g`` (default ``g.weights``);
            ``None`` from it: nothing is judged (a trace under a transformation).

    Attributes:
        refused: fault -> :class:`~collections.Counter` of the rules refused for it.
    """

    def __init__(self, weights_of: Callable[[Graph], Mapping | None] | None = None):
        self.weights_of = weights_of or (lambda g: g.weights)
        self.judged: dict[frozenset, FoldOverflow | None] = {}
        self.refused: dict[FoldOverflow, Counter] = {}

    def __call__(self, graph: Graph, rw, rule) -> FoldOverflow | None:
        """The fault of what rewrite ``rw`` of ``graph`` by ``rule`` folds, or ``None``."""
        nodes = graph.node_set
        new = frozenset(n for n in rw.created
                        if n.weight_only and n not in nodes and computes(n))
        if not new:  # only copies of values (a concatenated or merged kernel)
            return None
        if new not in self.judged:
            after = graph.replace(rw.mapping)
            weights = self.weights_of(after)
            self.judged[new] = None if weights is None else fold_overflow(after, graph, weights)
        fault = self.judged[new]
        if fault is not None:
            self.refused.setdefault(fault, Counter())[rule.name] += 1
        return fault

    def refusals(self) -> list[FoldRefusal]:
        """One :class:`FoldRefusal` per fault, naming the rules refused for it."""
        return [FoldRefusal(tuple(rules), f, sum(rules.values()))
                for f, rules in self.refused.items()]


def refuse_faulty_folds(result, graph: Graph,
                        weights_of: Callable[[Graph], Mapping | None] | None = None,
                        gate: FoldGate | None = None) -> list[FoldRefusal]:
    """Drop the candidates of ``result`` whose pre-folded weights overflow or underflow.

    Args:
        result: a :class:`~taso_jax.search.backtracking.SearchResult` of a search from
            ``graph``; changed in place: ``candidates`` lose the graphs refused and are
            refilled, cheapest first, from ``visited``'s admissible graphs (as many as
            there were); where ``result.graph`` is refused, the cheapest admissible
            candidate cheaper than the input replaces it (the input where none is), with
            its ``applied`` and ``cost_after``; ``fold_refusals`` holds the refusals.
        graph: the input graph (never refused: it folds nothing new).
        weights_of: ``weights_of(g)``, the weight values ``g``'s folds are computed from
            (the decorator's call); ``None`` from it: not checked. Default ``g.weights``.
        gate: the search's :class:`FoldGate`, whose refusals come first.

    Returns:
        The refusals, one per distinct fault (empty where nothing was refused).
    """
    from_gate = gate.refusals() if gate is not None else []
    weights_of = weights_of or (lambda g: g.weights)
    faults: dict[bytes, FoldOverflow | None] = {graph.key: None}

    def fault(g: Graph) -> FoldOverflow | None:
        if g.key not in faults:
            weights = weights_of(g)
            faults[g.key] = None if weights is None else fold_overflow(g, graph, weights)
        return faults[g.key]

    first = list(result.candidates)
    want = len(first)
    kept = [c for c in first if fault(c.graph) is None]
    best_refused = fault(result.graph) is not None
    if len(kept) == want and not best_refused:
        result.fold_refusals = from_gate
        return from_gate
    held = {c.graph.key for c in kept}
    for c in sorted(result.visited, key=lambda c: c.cost):
        if len(kept) >= want:
            break
        if c.graph.key not in held and fault(c.graph) is None:
            kept.append(c)
            held.add(c.graph.key)
    result.candidates = sorted(kept, key=lambda c: c.cost)
    if best_refused:
        best = next((c for c in result.candidates if c.cost < result.cost_before), None)
        result.graph = best.graph if best is not None else graph
        result.cost_after = best.cost if best is not None else result.cost_before
        result.applied = Counter(best.path if best is not None else ())
    refused = [c for c in (*first, *result.visited) if faults.get(c.graph.key)]
    faulted = {r.fault for r in from_gate}
    result.fold_refusals = from_gate + [r for r in _grouped(refused, faults)
                                        if r.fault not in faulted]
    return result.fold_refusals


def _grouped(refused, faults: Mapping) -> list[FoldRefusal]:
    """One :class:`FoldRefusal` per distinct fault of the ``refused`` candidates."""
    by_fault: dict[FoldOverflow, list] = {}
    seen = set()
    for c in refused:
        if c.graph.key not in seen:
            seen.add(c.graph.key)
            by_fault.setdefault(faults[c.graph.key], []).append(c)
    out = []
    for f, cands in by_fault.items():
        common = set(cands[0].path).intersection(*(set(c.path) for c in cands[1:]))
        rules = tuple(dict.fromkeys(r for r in cands[0].path if r in common)) \
            or tuple(dict.fromkeys(cands[0].path))
        out.append(FoldRefusal(rules, f, len(cands)))
    return out
