"""Cost-based backtracking search (TASO, Jia et al., SOSP 2019, Algorithm 2).

A priority queue holds candidate graphs ordered by estimated cost. The cheapest is popped
and expanded by every match of every substitution; a rewritten graph is queued when its cost
is below ``alpha`` times the best cost seen (alpha relaxation: slightly costlier graphs are
explored because they can lead to much cheaper ones). Graphs are de-duplicated exactly: the
IR is hash-consed, so a graph's output tensors identify its whole DAG, and no two distinct
graphs are ever confused (TASO summed per-operator hashes, so collisions could drop graphs).
The search stops when the queue is empty, or at the iteration or time budget. The result is
never costlier than the input: the input itself is the first "best".
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from taso_jax.search.cost import AnalyticCostModel, CostModel

from taso_jax.graph import Graph
from taso_jax.substitution import Substitution

__all__ = ["SearchResult", "backtracking_search", "greedy_descent"]


@dataclass
class SearchResult:
    """Outcome of a search.

    Attributes:
        graph: the cheapest graph found (the input graph when nothing cheaper exists).
        cost_before, cost_after: estimated costs in microseconds.
        applied: substitution name -> times applied on the path to ``graph``.
        iterations: graphs expanded. explored: distinct graphs costed.
        seconds: wall time of the search.
        stopped: why the search ended (``"queue empty"``, ``"budget"``, ``"time limit"``).
        rejected: match rejections by reason (for debugging substitutions).
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


def _relevant(subs: Sequence[Substitution], graph: Graph) -> list[Substitution]:
    ops = graph.by_op
    return [s for s in subs if all(p.op in ops for p in s.source)]


def greedy_descent(graph: Graph, substitutions: Sequence[Substitution], cost_model: CostModel,
                   time_limit: float, rejected: Counter) -> tuple[Graph, float, list[str]]:
    """Apply strictly cost-reducing rewrites, first found first, until none is left.

    Large models contain the same pattern many times (one batchnorm per convolution); the
    backtracking search would spend one expansion on each. This descent takes them all in
    one pass, and the search then explores from its result. Returns the graph, its cost and
    the names of the substitutions applied, in order.
    """
    t0 = time.perf_counter()
    cost = cost_model.graph_cost(graph)
    applied: list[str] = []
    improved = True
    while improved and time.perf_counter() - t0 < time_limit:
        improved = False
        for sub in _relevant(substitutions, graph):
            again = True
            while again and time.perf_counter() - t0 < time_limit:
                again = False
                for g2 in sub.rewrites(graph, rejected):
                    c2 = cost_model.graph_cost(g2)
                    if c2 < cost * (1 - 1e-9):
                        graph, cost = g2, c2
                        applied.append(sub.name)
                        again = improved = True
                        break
    return graph, cost, applied


def backtracking_search(graph: Graph, substitutions: Sequence[Substitution],
                        cost_model: CostModel | None = None, alpha: float = 1.05,
                        budget: int = 1000, time_limit: float = 60.0,
                        progress: Callable[[int, float], None] | None = None,
                        greedy: bool = True) -> SearchResult:
    """Search for the cheapest graph equivalent to ``graph`` under ``substitutions``.

    Args:
        graph: the input graph (unchanged).
        substitutions: rewrite rules (each applied wherever it matches).
        cost_model: defaults to :class:`AnalyticCostModel`.
        alpha: relaxation factor (>= 1); TASO's default is 1.05.
        budget: maximum number of graphs expanded.
        time_limit: maximum wall time in seconds.
        progress: called as ``progress(iterations, best_cost)`` after each expansion.
        greedy: first apply every strictly cost-reducing rewrite (:func:`greedy_descent`,
            at most half the time limit), then search from there.

    Raises:
        ValueError: ``alpha < 1`` or a negative budget.
    """
    if alpha < 1.0:
        raise ValueError(f"alpha must be >= 1, got {alpha}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    cost_model = cost_model or AnalyticCostModel()
    t0 = time.perf_counter()
    cost0 = cost_model.graph_cost(graph)
    rejected: Counter = Counter()
    start, start_cost, start_path = graph, cost0, ()
    if greedy:
        start, start_cost, names = greedy_descent(graph, substitutions, cost_model,
                                                  time_limit / 2, rejected)
        start_path = tuple(names)
    tie = itertools.count()
    queue = [(start_cost, next(tie), start, start_path)]
    seen = {graph.key, start.key}
    best, best_cost, best_path = start, start_cost, start_path
    iterations, stopped = 0, "queue empty"
    while queue:
        if iterations >= budget:
            stopped = "budget"
            break
        if time.perf_counter() - t0 > time_limit:
            stopped = "time limit"
            break
        _, _, g, path = heapq.heappop(queue)  # best is updated when a graph is pushed
        iterations += 1
        for sub in _relevant(substitutions, g):
            for g2 in sub.rewrites(g, rejected):
                if g2.key in seen:
                    continue
                seen.add(g2.key)
                c2 = cost_model.graph_cost(g2)
                if c2 < alpha * best_cost:
                    heapq.heappush(queue, (c2, next(tie), g2, (*path, sub.name)))
                    if c2 < best_cost:
                        best, best_cost, best_path = g2, c2, (*path, sub.name)
        if progress:
            progress(iterations, best_cost)
    if best_cost >= cost0:
        best, best_cost, best_path = graph, cost0, ()
    return SearchResult(best, cost0, best_cost, Counter(best_path), iterations, len(seen),
                        time.perf_counter() - t0, stopped, rejected)
