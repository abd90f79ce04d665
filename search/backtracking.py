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
  is no longer the cheapest. Most children are never popped.
* Matching is incremental. A rewrite rebuilds every node downstream of it (hash-consing),
  but most of those are *stable*: the same operator on the rebuilt versions of the same
  inputs (:class:`~taso_jax.search._incremental._Change`). A popped graph keeps its
  parent's matches made of stable nodes, translated, and matches again only near the
  nodes the rewrite really changed (:mod:`taso_jax.search._incremental`).

What each saves is measured in docs/benchmarks.md ("Why the search and choice work as they
do").

The greedy descent that runs first is :mod:`taso_jax.search.descent`; the searches that
second-guess the cost model are :mod:`taso_jax.search.second_opinions`.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from taso_jax.search._gc_tuning import fewer_collections
from taso_jax.search._incremental import _Change, _incremental_matches, _reach
from taso_jax.search._rewrites import SearchState, _prepared, _relevant
from taso_jax.search.cost import AnalyticCostModel, CostModel
from taso_jax.search.descent import _descend
from taso_jax.search.limits import StopReason
from taso_jax.search.match import find_matches
from taso_jax.search.rules import Substitution

from taso_jax.ir.graph import Graph

__all__ = ["SearchResult", "SearchState", "Candidate", "RuleStats", "Iteration",
           "backtracking_search"]


@dataclass(frozen=True)
class Candidate:
    """A graph the search built and priced.

    Attributes:
        cost: estimated cost in microseconds.
        graph: the graph.
        path: names of the substitutions applied on the way from the input graph, in order.
        rule_ids: the content-hash ids (:attr:`Substitution.id`) of the same substitutions,
            in the same order: what the search and its second opinions know a rule by.
        judged: added for the end-to-end choice to judge whatever its estimate: it is timed
            even when its estimate ties a cheaper candidate's
            (:func:`add_near_tie_candidate`).
    """

    cost: float
    graph: Graph
    path: tuple[str, ...] = ()
    judged: bool = False
    rule_ids: tuple[str, ...] = ()

    def __iter__(self):  # unpacks as (cost, graph, path)
        return iter((self.cost, self.graph, self.path))

    @classmethod
    def of(cls, cost: float, graph: Graph, rules: Sequence[Substitution],
           judged: bool = False) -> Candidate:
        """The candidate reached by applying ``rules`` in order, with their names and ids."""
        return cls(cost, graph, tuple(r.name for r in rules), judged,
                   tuple(r.id for r in rules))


@dataclass
class SearchResult:
    """Outcome of a search.

    Attributes:
        graph: the cheapest graph found (the input graph when nothing cheaper exists).
        cost_before, cost_after: estimated costs in microseconds.
        applied: substitution name -> times applied on the path to ``graph``.
        iterations: graphs expanded. explored: distinct graphs built and priced exactly.
        seconds: wall time of the search.
        second_opinion_seconds: wall time of the searches that second-guessed the cost
            model after it (set by :func:`taso_jax.search.options.run_search`).
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
        out_of_time_in: the phase of the pipeline that was running when the whole time
            limit passed (``"import"``: before the search, ``"search"``, ``"second
            opinions"``, ``"end-to-end choice"``;
            set by :func:`taso_jax.search.options.run_search`), ``""`` where it did not.
        unmeasurable: the kernels the cost model could not time alone, and why (set by
            :func:`taso_jax.search.options.run_search`).
        cost_model: what the cost model did (its ``stats()``: ``name``, ``compiles``,
            ``compile_seconds``, and more per model), set by
            :func:`taso_jax.search.options.run_search`; empty for a model without stats.
        outcome: the :class:`taso_jax.outcome.Outcome` of the whole pipeline, where
            :func:`taso_jax.search_graph` ran it; else ``None``.
        rule_stats: substitution name -> :class:`RuleStats` (matches found, rewrites
            queued, seconds) over the backtracking search's expansions (not the descent's).
        iteration_log: one :class:`Iteration` per graph expanded, in order.
        fold_refusals: the candidates dropped for a weight they fold ahead of time that
            overflows or underflows, one :class:`~taso_jax.search.fold_refusals.FoldRefusal`
            per fault (set by :func:`taso_jax.search.options.run_search`).
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
    rules: dict[str, int] = field(default_factory=dict)
    candidates: list[Candidate] = field(default_factory=list)
    visited: list[Candidate] = field(default_factory=list)
    end_to_end: dict = field(default_factory=dict)
    out_of_time_in: str = ""
    second_opinion_seconds: float = 0.0
    unmeasurable: list[str] = field(default_factory=list)
    cost_model: dict = field(default_factory=dict)
    outcome: object | None = None  # a taso_jax.outcome.Outcome (a layer above the search)
    rule_stats: dict = field(default_factory=dict)
    iteration_log: list = field(default_factory=list)
    fold_refusals: list = field(default_factory=list)

    @property
    def path(self) -> tuple[str, ...]:
        """Names of the substitutions applied on the way to ``graph``.

        In order where a candidate records it, else grouped by name (from ``applied``).
        """
        return next((c.path for c in self.candidates if c.graph.key == self.graph.key),
                    tuple(name for name, k in self.applied.items() for _ in range(k)))

    @property
    def rule_ids(self) -> tuple[str, ...]:
        """Content-hash ids of the substitutions applied on the way to ``graph``, in order.

        Empty where no candidate holds ``graph``.
        """
        return next((c.rule_ids for c in self.candidates if c.graph.key == self.graph.key),
                    ())


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

    ``parent`` and ``matches`` (the parent's matches per rule id) and ``mapping`` (the
    rewrite's tensor mapping) are what let a child's matches be found incrementally;
    ``rebuilt`` (old node -> rebuilt node) is filled when the child is built.
    """

    cost: float
    tie: int
    graph: Graph | None = field(compare=False, default=None)
    path: tuple = field(compare=False, default=())  # the Substitution records applied
    parent: Graph | None = field(compare=False, default=None)
    matches: dict | None = field(compare=False, default=None)
    mapping: dict | None = field(compare=False, default=None)
    rebuilt: dict | None = field(compare=False, default=None)


def backtracking_search(graph: Graph, substitutions: Sequence[Substitution],
                        cost_model: CostModel | None = None, alpha: float = 1.05,
                        budget: int = 100, time_limit: float = 60.0,
                        progress: Callable[[int, float], None] | None = None,
                        greedy: bool = True, keep: int = 4,
                        record: int | None = None,
                        stop: Callable[[], bool] | None = None,
                        fold_gate: Callable | None = None) -> SearchResult:
    """Search for the cheapest graph equivalent to ``graph`` under ``substitutions``.

    Args:
        graph: the input graph (unchanged).
        substitutions: rewrite rules (each applied wherever it matches).
        cost_model: defaults to :class:`AnalyticCostModel`.
        alpha: relaxation factor (>= 1); TASO's default is 1.05.
        budget: maximum number of graphs expanded.
        time_limit: maximum wall time in seconds, kernel measurement included: once it is
            up, a cost model that times kernels (the measured one) prices the kernels it has
            not measured analytically (``measure_until``,
            :meth:`~taso_jax.search.cost.CostModel.node_cost`).
        progress: called as ``progress(iterations, best_cost)`` after each expansion.
        greedy: first apply every strictly cost-reducing rewrite (:func:`greedy_descent`,
            at most half the time limit), then search from there.
        keep: how many of the cheapest graphs to return in ``candidates``.
        record: how many graphs besides the input ``visited`` holds: the cheapest ones
            (at least ``keep``; ``None``: every graph built). Each graph held keeps its
            nodes alive: on rapid_layout (717 operators), 250,000 objects and 100 MB
            after a search of 100 graphs, still held during the end-to-end choice.
        stop: asked before each expansion (and each pass of the descent); ``True`` ends the
            search (``stopped``: :attr:`StopReason.CHOICE_RESERVE`), as
            :func:`taso_jax.search.options.run_search` does to leave the end-to-end choice
            the time it needs.
        fold_gate: asked of each rewrite that computes a new weight ahead of time; one it
            faults is not applied (:class:`~taso_jax.search.fold_refusals.FoldGate`).

    Raises:
        ValueError: ``alpha < 1`` or a negative budget.
    """
    cost_model = cost_model or AnalyticCostModel()
    with cost_model.holding_nodes(), fewer_collections():
        return _search(graph, substitutions, cost_model, alpha, budget, time_limit,
                       progress, greedy, keep, record, stop, fold_gate)


@dataclass
class RuleStats:
    """What one substitution did in a search (egg's per-rule counters, :class:`SearchResult`).

    Attributes:
        matches: matches found over every graph expanded (incrementally carried ones too).
        queued: rewrites of those whose estimated cost passed the alpha bound, queued as
            children.
        seconds: wall time spent matching it and preparing its rewrites.
    """

    matches: int = 0
    queued: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class Iteration:
    """One expansion of the backtracking search (egg's ``Iteration``).

    Attributes:
        cost: the estimated cost of the graph expanded, microseconds.
        best: the cheapest cost known after it (built graphs and queued estimates).
        queued: children it queued. queue: the queue's length after it.
        seconds: its wall time.
    """

    cost: float
    best: float
    queued: int
    queue: int
    seconds: float


class _Backtracking:
    """The state of one backtracking search and its steps (:func:`backtracking_search`).

    It carries the search's deadline (``end``, a ``time.perf_counter()`` value) into every
    step (matching, pricing, building), and records per-rule counters (:class:`RuleStats`)
    and one :class:`Iteration` per expansion.
    """

    def __init__(self, graph: Graph, substitutions: Sequence[Substitution],
                 cost_model: CostModel, alpha: float, budget: int, end: float, keep: int,
                 record: int | None, stop: Callable[[], bool] | None):
        self.graph, self.substitutions, self.cost_model = graph, substitutions, cost_model
        self.alpha, self.budget, self.end, self.keep, self.stop = alpha, budget, end, keep, stop
        self.state = SearchState()
        self.cost0 = cost_model.graph_cost(graph, end)
        self.visited: list[Candidate] = [Candidate(self.cost0, graph)]
        self.hold = None if record is None else max(record, keep)
        self.tie = itertools.count()
        self.reach = {sub.id: _reach(sub) for sub in substitutions}
        self.seen = {graph.key}
        self.queue: list[_Entry] = []
        # bounds the alpha relaxation: the cheapest graph built, or the cheapest estimate
        # queued (estimates are upper bounds, so that cost is reachable)
        self.best_cost = self.cost0
        self.iterations, self.stopped = 0, StopReason.QUEUE_EMPTY
        self.rule_stats: dict[str, RuleStats] = {}
        self.log: list[Iteration] = []

    def note(self, c: Candidate) -> None:
        """Record a graph built, holding at most about twice ``hold`` of them.

        Past that, the ``hold`` cheapest stay (ties go to the earlier), in their order of
        discovery, so that the best graph and the candidates are those of a full record.
        """
        self.visited.append(c)
        hold, visited = self.hold, self.visited
        if hold is not None and len(visited) > 2 * hold + 1:
            cheapest = sorted(range(1, len(visited)), key=lambda i: visited[i].cost)[:hold]
            self.visited = [visited[0], *(visited[i] for i in sorted(cheapest))]

    def start_from(self, start: Graph, cost: float, path: tuple) -> None:
        """Queue the graph the search begins at (the input, or where the descent ended)."""
        self.seen.add(start.key)
        self.best_cost = min(self.best_cost, cost)
        self.queue = [_Entry(cost, next(self.tie), start, path)]

    def build(self, entry: _Entry) -> bool:
        """Build, price and record an unbuilt entry; ``False`` if its graph was seen."""
        rebuilt: dict = {}
        g2 = entry.parent.replace(entry.mapping, rebuilt)
        if g2.key in self.seen:
            return False
        self.seen.add(g2.key)
        entry.graph, entry.cost, entry.rebuilt = g2, self.cost_model.graph_cost(g2, self.end), \
            rebuilt
        self.note(Candidate.of(entry.cost, g2, entry.path))
        return True

    def why_stop(self) -> str | None:
        """The reason to stop before the next expansion, or ``None``."""
        if self.iterations >= self.budget:
            return StopReason.BUDGET
        if self.stopped == StopReason.TIME_LIMIT or time.perf_counter() > self.end:
            return StopReason.TIME_LIMIT
        if self.stop is not None and self.stop():
            return StopReason.CHOICE_RESERVE
        return None

    def run(self, progress: Callable[[int, float], None] | None) -> None:
        """Pop and expand the cheapest graph until the queue empties or a stop holds."""
        while self.queue:
            why = self.why_stop()
            if why is not None:
                self.stopped = why
                return
            entry = heapq.heappop(self.queue)
            if entry.graph is None:
                if not self.build(entry):
                    continue
                self.best_cost = min(self.best_cost, entry.cost)
                if self.queue and self.queue[0].cost < entry.cost:  # cheaper than estimated
                    entry.tie = next(self.tie)
                    heapq.heappush(self.queue, entry)
                    continue
            self.expand(entry)
            if progress:
                progress(self.iterations, self.best_cost)

    def expand(self, entry: _Entry) -> None:
        """Queue every rewrite of ``entry``'s graph whose estimate passes the alpha bound."""
        t0, queued = time.perf_counter(), 0
        g, gc = entry.graph, entry.cost
        self.iterations += 1
        table: dict[str, list] = {}
        change = near_cache = None
        if entry.parent is not None:
            change = _Change(entry.parent, g, entry.mapping, entry.rebuilt)
            near_cache = {}
        for sub in _relevant(self.substitutions, g):
            if time.perf_counter() > self.end:  # one expansion of a large graph takes long
                self.stopped = StopReason.TIME_LIMIT
                break
            t_rule = time.perf_counter()
            rid = sub.id
            previous = None if change is None or self.reach[rid] is None \
                else entry.matches.get(rid)
            if previous is None:
                found = list(find_matches(sub, g, self.state.matching, deadline=self.end))
            else:
                found = _incremental_matches(g, sub, self.reach[rid], previous, change,
                                             near_cache, self.state)
            table[rid] = found or ()  # most rules match nowhere: one shared empty tuple
            stats = self.rule_stats.setdefault(sub.name, RuleStats())
            stats.matches += len(found)
            for rw, estimate in _prepared(g, gc, sub, self.cost_model,
                                          self.alpha * self.best_cost, self.state,
                                          matches=found, deadline=self.end,
                                          measure_until=self.end):
                heapq.heappush(self.queue, _Entry(estimate, next(self.tie), None,
                                                  (*entry.path, sub), g, table, rw.mapping))
                self.best_cost = min(self.best_cost, estimate)
                stats.queued += 1
                queued += 1
            stats.seconds += time.perf_counter() - t_rule
        # Its children need its nodes (to be built) and node set (to carry matches) only.
        g.forget_caches(keep=("nodes", "node_set"))
        cap = QUEUE_PER_EXPANSION * (self.budget - self.iterations) + 4 * self.keep \
            + QUEUE_FLOOR
        if len(self.queue) > 2 * cap:
            self.queue = heapq.nsmallest(cap, self.queue)  # sorted, hence a heap
        self.log.append(Iteration(gc, self.best_cost, queued, len(self.queue),
                                  time.perf_counter() - t0))

    def result(self, t0: float) -> SearchResult:
        """Build the cheapest children still queued, and the result.

        The cheapest children left unbuilt are built, so that the best graph and the
        candidates are among what was priced exactly.
        """
        built_after = tries = 0
        while self.queue and built_after < self.keep and tries < 4 * self.keep and (
                not tries or time.perf_counter() <= self.end):
            entry = heapq.heappop(self.queue)
            if entry.graph is None:
                tries += 1
                built_after += self.build(entry)
        self.queue = []
        visited = self.visited
        for v in visited:
            v.graph.forget_caches()
        best_cost, best, best_path = min(visited, key=lambda v: v.cost)
        if best_cost >= self.cost0:
            best, best_cost, best_path = self.graph, self.cost0, ()
        order = sorted(range(len(visited)), key=lambda i: visited[i].cost)
        return SearchResult(best, self.cost0, best_cost, Counter(best_path), self.iterations,
                            len(self.seen), time.perf_counter() - t0, self.stopped,
                            self.state.matching.rejected,
                            candidates=[visited[i] for i in order[:self.keep]],
                            visited=visited, rule_stats=self.rule_stats,
                            iteration_log=self.log)


def _search(graph: Graph, substitutions: Sequence[Substitution], cost_model: CostModel,
            alpha: float, budget: int, time_limit: float,
            progress: Callable[[int, float], None] | None, greedy: bool,
            keep: int, record: int | None = None,
            stop: Callable[[], bool] | None = None,
            fold_gate: Callable | None = None) -> SearchResult:
    """The body of :func:`backtracking_search`: the descent, then the runner."""
    if alpha < 1.0:
        raise ValueError(f"alpha must be >= 1, got {alpha}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    t0 = time.perf_counter()
    end = t0 + time_limit  # of the search, and of measuring kernels (measure_until)
    run = _Backtracking(graph, substitutions, cost_model, alpha, budget, end, keep, record,
                        stop)
    run.state.fold_gate = fold_gate
    start, start_cost, start_path = graph, run.cost0, ()
    if greedy:
        start, start_cost, rules = _descend(
            graph, substitutions, cost_model, time_limit / 2, run.state, alpha,
            on_step=lambda c, g, rules: run.note(Candidate.of(c, g, rules)),
            measure_until=end, stop=stop)
        start_path = tuple(rules)
    run.start_from(start, start_cost, start_path)
    run.run(progress)
    return run.result(t0)
