"""Second opinions: candidates that second-guess the search's cost model.

A cost model prices kernels one at a time, at one moment, on a machine whose speed
drifts. Each function here adds to a search's candidates a graph that the cost model may
have ranked wrongly, for the end-to-end choice
(:func:`taso_jax.search.choose.choose_fastest`) to time: the best graph under the analytic
cost model (:func:`add_analytic_candidate`) or, where the search priced NCHW convolutions
in NHWC, the best graph priced with them as written (:func:`add_as_written_candidate`, in
its place); the best graph with its rules' near ties taken (:func:`add_near_tie_candidate`);
and the best graph of a search without one rule that every candidate applies
(:func:`add_ablation_candidate`).
:func:`taso_jax.search.options.add_second_opinions` adds three of them.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

from taso_jax.search._rewrites import SearchState, _refusal_key, _relevant, _sides
from taso_jax.search.backtracking import Candidate, SearchResult, backtracking_search
from taso_jax.search.cost import AnalyticCostModel, CostModel
from taso_jax.search.match import Rewrite, find_matches, prepare
from taso_jax.search.rules import Substitution

from taso_jax.ir.graph import Graph

__all__ = ["add_analytic_candidate", "add_as_written_candidate", "add_near_tie_candidate",
           "add_ablation_candidate", "prices_nchw_as_nhwc", "NEAR_TIE"]


def add_analytic_candidate(result: SearchResult, graph: Graph,
                           substitutions: Sequence[Substitution], cost_model: CostModel,
                           alpha: float = 1.05, budget: int = 100,
                           time_limit: float = 6.0) -> Candidate | None:
    """Search ``graph`` again under the analytic cost model; add its best to the candidates.

    A measured cost model prices each kernel once, at one moment, on a machine whose speed
    drifts, so two searches of one model can descend into different graphs; the analytic
    model (:meth:`AnalyticCostModel.for_backend`) ranks graphs the same way in every run
    (docs/benchmarks.md, "Why the search and choice work as they do"). Its best graph, when
    it is another than the input and than the candidates already kept, is appended to
    ``result.candidates`` priced by ``cost_model`` (kernels not yet measured are measured,
    within ``time_limit`` seconds; the analytic search has the same limit), so that the
    end-to-end choice times it too and the device decides between the two opinions.
    ``result.graph`` is not changed.

    Returns the candidate added, or ``None``.
    """
    if isinstance(cost_model, AnalyticCostModel):
        return None
    return _add_best_under(AnalyticCostModel.for_backend(), result, graph, substitutions,
                           cost_model, alpha, budget, time_limit)


def add_as_written_candidate(result: SearchResult, graph: Graph,
                             substitutions: Sequence[Substitution], cost_model: CostModel,
                             alpha: float = 1.05, budget: int = 100,
                             time_limit: float = 6.0) -> Candidate | None:
    """Search ``graph`` again with its convolutions priced as written; add its best.

    A calibrated cost model with ``nhwc_convolutions`` prices each NCHW convolution as the
    NHWC kernel the end-to-end choice's NHWC form would run. The NHWC kernel is cheap on
    XLA:CPU, so that search rarely takes a lowering that pays only against the NCHW one:
    on a PP-OCRv6 text recognizer (2 cores, load ~4) it applied 2 ``lower-pointwise_matmul``
    rewrites and the choice delivered 1.34x, where the search priced as written applied 24
    and delivered 1.75x (the choice keeps NHWC where that is faster: a YOLO detector's and
    an OCR detector's NHWC forms won either way). This search uses the same curves
    (``cost_model.calibration``) without ``nhwc_convolutions`` and compiles nothing; its
    best graph, when new, is appended to ``result.candidates`` priced by ``cost_model``, with
    ``judged`` set (timed whatever that price, its NHWC form too). Nothing is added for
    another cost model, or where ``cost_model`` prices convolutions as written.
    ``result.graph`` is not changed.

    Returns the candidate added, or ``None``.
    """
    from taso_jax.search.calibrated import CalibratedCostModel

    if not prices_nchw_as_nhwc(cost_model):
        return None
    as_written = CalibratedCostModel(cache_path=False, calibration=cost_model.calibration,
                                     max_compiles=0)
    return _add_best_under(as_written, result, graph, substitutions, cost_model, alpha,
                           budget, time_limit, judged=True)


def prices_nchw_as_nhwc(cost_model: CostModel) -> bool:
    """Whether ``cost_model`` is a calibrated model pricing NCHW convolutions in NHWC."""
    from taso_jax.search.calibrated import CalibratedCostModel

    return isinstance(cost_model, CalibratedCostModel) and cost_model.nhwc_convolutions


def _add_best_under(other: CostModel, result: SearchResult, graph: Graph,
                    substitutions: Sequence[Substitution], cost_model: CostModel,
                    alpha: float, budget: int, time_limit: float,
                    judged: bool = False) -> Candidate | None:
    """The best graph of a search of ``graph`` priced by ``other``, appended where new."""
    t0 = time.perf_counter()
    second = backtracking_search(graph, substitutions, other, alpha=alpha, budget=budget,
                                 time_limit=time_limit, keep=1)
    known = {graph.key, *(c.graph.key for c in result.candidates)}
    if second.graph.key in known:
        return None
    cost = cost_model.graph_cost(second.graph, measure_until=t0 + time_limit)
    added = Candidate(cost, second.graph, second.path, judged=judged,
                      rule_ids=second.rule_ids)
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
    runs them: this is a second opinion for the device to settle, not a better estimate
    (docs/benchmarks.md, "Why the search and choice work as they do").

    Starting from ``result.graph``, rewrites of the rules on its path (``result.rule_ids``)
    whose new kernels cost at most ``ratio`` times the kernels they remove are applied one
    at a time, first found first, into graphs not seen before, until none is left or
    ``time_limit`` seconds have passed (kernels not yet measured are then priced
    analytically). The graph reached, when another than the candidates already kept, is
    appended to ``result.candidates`` with ``judged`` set, priced by ``cost_model``: the
    end-to-end choice times it against the input like any candidate, and keeps it only if
    it runs faster. ``result.graph`` is not changed.

    Returns the candidate added, or ``None``.
    """
    ids = set(result.rule_ids)
    rules = [s for s in substitutions if s.id in ids]
    if not rules:
        return None
    t0 = time.perf_counter()
    end = t0 + time_limit
    state = SearchState()
    graph = result.graph
    path, path_ids = result.path, result.rule_ids
    taken: list[Substitution] = []
    seen = {graph.key}
    refused: set = set()
    with cost_model.holding_nodes():
        changed = True
        while changed and time.perf_counter() - t0 < time_limit:
            changed = False
            for sub in _relevant(rules, graph):
                for m in find_matches(sub, graph, state.matching, deadline=end):
                    key = _refusal_key(sub, m)
                    if key is not None and key in refused:
                        continue
                    rw = prepare(sub, graph, m, state.matching)
                    g2 = graph.replace(rw.mapping) if rw and _within(
                        graph, rw, cost_model, ratio, end) else None
                    if g2 is None or g2.key in seen:
                        if key is not None:
                            refused.add(key)
                        continue
                    seen.add(g2.key)
                    graph = g2
                    taken.append(sub)
                    changed = True
                    break
                if changed:
                    break
        if not taken or graph.key in {c.graph.key for c in result.candidates}:
            return None
        added = Candidate(cost_model.graph_cost(graph, end), graph,
                          (*path, *(r.name for r in taken)), judged=True,
                          rule_ids=(*path_ids, *(r.id for r in taken)))
    result.candidates.append(added)
    return added


def add_ablation_candidate(result: SearchResult, graph: Graph,
                           substitutions: Sequence[Substitution], cost_model: CostModel,
                           alpha: float = 1.05, budget: int = 100,
                           time_limit: float = 6.0) -> Candidate | None:
    """Search ``graph`` again without one rule that every candidate applies; add its best.

    A rule can price well kernel by kernel and lose in the whole graph, and when every
    candidate applies it the end-to-end choice never times a graph without it
    (docs/benchmarks.md, "Why the search and choice work as they do").

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
    paths = [c.rule_ids for c in result.candidates if c.rule_ids]
    if not paths:
        return None
    shared = set(paths[0]).intersection(*map(set, paths[1:]))
    if not shared:
        return None
    uses = Counter(rid for p in paths for rid in p)
    names = {s.id: s.name for s in substitutions}
    left_out = min(shared, key=lambda rid: (uses[rid], names.get(rid, rid)))
    rest = [s for s in substitutions if s.id != left_out]
    second = backtracking_search(graph, rest, cost_model, alpha=alpha, budget=budget,
                                 time_limit=time_limit, keep=1)
    if second.graph.key in {graph.key, *(c.graph.key for c in result.candidates)}:
        return None
    added = Candidate(second.cost_after, second.graph, second.path, judged=True,
                      rule_ids=second.rule_ids)
    result.candidates.append(added)
    return added


def _within(graph: Graph, rw: Rewrite, cost_model: CostModel, ratio: float,
            measure_until: float | None) -> bool:
    """Whether a rewrite's new kernels cost at most ``ratio`` times those it removes.

    Kernels not yet priced are measured until ``measure_until`` (a ``time.perf_counter()``
    value), priced analytically after it.
    """
    new, removed = _sides(graph, rw, cost_model, measure_until)
    return sum(cost_model.node_cost(n, measure_until) for n in new) <= ratio * removed
