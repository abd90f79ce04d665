"""A traced JAX function as the delivery pipeline's source: the decorator's first call.

:class:`TracedSource` is what ``@taso_jax.optimize`` hands :func:`taso_jax.pipeline.deliver`
for one call signature, once the function is traced and imported
(:mod:`taso_jax.first_call`). Its hooks carry what differs from an ONNX file or a built
graph:

* the search: the graph cache's entry where it has one, else the optimizer's search, which
  screens only (the one comparison that decides is :meth:`TracedSource.admit`'s) and leaves
  the compile, the check and that comparison their time
  (:func:`~taso_jax.first_call_budget.first_call_reserve`); the original compiles and runs
  beside it (:class:`~taso_jax.first_call_budget.OriginalRun`);
* the screen: a decision read from the graph cache, a time limit that passed before the
  end-to-end choice, or nothing to gain (:func:`~taso_jax.first_call_timing._nothing_to_run`);
* the fold check's weights: the call's own;
* prepare: the graph split into its weight and runtime stages, jitted
  (:class:`~taso_jax.ir.executor.StagedGraph`);
* the check: against ``jax.jit`` of the function, with its rounding-noise policy
  (:func:`~taso_jax.first_call_check.compare_with_original`); a graph cache entry is
  checked on its first use in this process;
* admit: the timing against ``jax.jit`` of the function
  (:func:`~taso_jax.first_call_timing.keep_original`), and the graph cache's entry stored;
* delivery: what the signature's calls run, set on its ``_Entry``.

The pipeline decides the verdict from these; the source only answers.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from taso_jax.call_trial import CallTrial
from taso_jax.first_call_budget import OriginalRun, first_call_reserve
from taso_jax.first_call_check import _compile_stages, _stored_check, compare_with_original
from taso_jax.first_call_timing import (
    _BEFORE_CHOICE,
    _KEPT_INPUT,
    _PAST_LIMIT,
    _nothing_to_run,
    keep_original,
    past_limit,
    settles_on_calls,
)
from taso_jax.frontends import graph_cache
from taso_jax.frontends.jaxpr_io import TracedFunction, _fn_name
from taso_jax.frontends.signature_entry import _Entry, _is_tracer
from taso_jax.ir.executor import StagedGraph
from taso_jax.ir.folded_work import folded_work
from taso_jax.ir.graph import Graph
from taso_jax.outcome import Verdict
from taso_jax.search.backtracking import SearchResult

__all__ = ["TracedSource", "SEARCH_STAGE"]

#: The first call's stage that searches: the backtracking search, the searches that
#: second-guess its cost model, and the end-to-end choice among their candidates (the
#: report's ``search`` seconds count the backtracking search alone).
SEARCH_STAGE = "search and choice"


class _Laps:
    """Seconds per step of the first call, added into ``stages`` as each step ends."""

    def __init__(self, stages: dict):
        self.stages, self.clock = stages, time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.stages[name] = self.stages.get(name, 0.0) + now - self.clock
        self.clock = now


class TracedSource:
    """One call signature of a decorated function, as the pipeline's source.

    A :class:`~taso_jax.pipeline.Source` for :func:`~taso_jax.pipeline.deliver`.

    Args:
        host: the :class:`~taso_jax.decorator.OptimizedFunction` (its ``options``,
            ``check``, ``_original_call``, ``_donated_inputs``, ``_folded``, ``_entry_jit``
            and ``_execute``).
        entry: the signature's ``_Entry``, filled as the pipeline goes.
        traced: the traced function; ``args``, ``static_pos``: the call's arguments.
        graph: the imported graph; ``key``: its graph cache key.
        laps: the first call's step clock (``entry.first_call``).
        import_seconds: the trace and the import.
    """

    #: The staged graph folds weight-only work that ``jax.jit`` of the original runs on
    #: every call: a graph the search left unchanged is still checked and timed.
    checks_unchanged = True

    def __init__(self, host, entry: _Entry, traced: TracedFunction, args, static_pos,
                 graph: Graph, key: str, laps: _Laps, import_seconds: float):
        self.host, self.entry, self.traced = host, entry, traced
        self.args, self.static_pos, self.graph, self.key = args, static_pos, graph, key
        self.name, self.import_seconds, self._lap = _fn_name(host.fn), import_seconds, laps
        self.options = host.options
        self.hit = graph_cache.load(key, graph)
        self.report: dict = {}
        self._reserve = self._result = self._deadline = None
        self._weight_index = {p: j for j, p in enumerate(
            p for p, k in zip(traced.paths, traced.kinds, strict=True) if k == "weight")}
        self.notes = []
        if graph.meta.get("opaque"):
            self.notes.append("kept as opaque equations: " + ", ".join(
                f"{k} x{v}" for k, v in sorted(graph.meta["opaque"].items())))
        if self.hit is not None:
            self.notes.append("optimized graph and decision read from the graph cache "
                              f"({graph_cache.graph_cache_dir()}); no search was run")
        entry.graph = graph
        # another process's entry is checked on its first use here (see check)
        unchecked_hit = (self.hit is not None and host.check
                         and not graph_cache.checked(key, self.hit[0], graph))
        if (self.hit is None and (host.check or self.options.end_to_end > 0)) or unchecked_hit:
            original = host._original_call(entry, traced, args, static_pos)
            if original is not None:  # compiled while the search runs, or the stages compile
                entry.original_run = OriginalRun(*original)

    def after_search_seconds(self) -> float:
        """What the compile, the check and the comparison need, as guessed now (or 0)."""
        return self._reserve() if self._reserve is not None else 0.0

    def search(self, optimizer, deadline, progress) -> SearchResult:
        """The graph cache's entry as a result, else the optimizer's search.

        :meth:`Optimizer.search <taso_jax.optimizer.Optimizer.search>` ends what the steps
        after it need before ``deadline``.
        The end-to-end choice screens only: the one comparison that decides is
        :meth:`admit`'s, against ``jax.jit`` of the function, except under a transformation,
        where nothing concrete can be timed against it and the choice confirms its pick.
        """
        entry, self._deadline = self.entry, deadline
        if self.hit is not None:
            optimized, info = self.hit
            entry.cache_hit = True
            result = SearchResult(graph=optimized, cost_before=info.get("cost_before", 0.0),
                                  cost_after=info.get("cost_after", 0.0),
                                  applied=info.get("applied", Counter()), iterations=0,
                                  explored=0, seconds=0.0, stopped="graph cache")
        else:
            if entry.original_run is not None and self.options.end_to_end > 0:
                self._reserve = _timed_when_it_stops(
                    first_call_reserve(entry.original_run, optimizer, self.graph,
                                       deadline.seconds),
                    entry.original_run, deadline)
                entry.reserved_s = self._reserve()  # as guessed (or timed) when it starts
            result = optimizer.search(
                self.graph, deadline, progress,
                confirm=any(_is_tracer(x) for x in self.traced.leaves), reserve=self._reserve,
                fold_weights=self.fold_weights)
        entry.result = self._result = result
        return result

    def time_graphs(self, target, optimized: Graph, report: dict, deadline) -> None:
        """No timing of its own (:meth:`admit` times); the report gains ``folded``.

        That is the work computed once that ``jax.jit`` of the function computes on every
        call.
        """
        self._lap(SEARCH_STAGE)
        self.report = self.entry.report = report
        report["folded"] = folded_work(optimized, weights=set(self._weight_index))

    def screen(self, result, report: dict) -> tuple[Verdict, str] | None:
        """Why the original runs with no check or timing, or ``None``.

        A decision stored in the graph cache; the time limit passed before the end-to-end
        choice began (3 s and 8 s more of compile, check and timing on a 120 ms stax ResNet
        skipped, never stored: a later process, its kernel costs cached, may get further);
        or nothing to run that jax.jit of the original does not (stored).
        """
        hit, opts = self.hit, self.options
        if hit is not None and hit[1].get("original_kept"):
            kept = hit[1]["original_kept"] + " (decided earlier; graph cache)"
        elif hit is None and opts.end_to_end > 0 and result.out_of_time_in in _BEFORE_CHOICE:
            reserved = self.entry.reserved_s
            if reserved is not None and reserved > opts.time_limit:
                # the search was given no time: no comparison could end within the limit
                kept = (f"{_PAST_LIMIT}: compiling, checking and comparing it once needs "
                        f"about {reserved:.0f} s here (its calls priced or timed), more than "
                        f"the time limit ({opts.time_limit:g} s) holds")
            else:
                kept = (f"{_PAST_LIMIT}: the time limit ({opts.time_limit:g} s) had passed "
                        f"after the search (in: {result.out_of_time_in})")
        elif hit is None and _nothing_to_run(self.graph, result):
            kept = _KEPT_INPUT  # the staged graph would run what jax.jit of the original runs
            if not result.out_of_time_in:
                self._store(result, kept, check=None)
        else:
            return None
        if self.entry.original_run is not None:  # the original runs now: its compile, no call
            self.entry.original_run.cancel()
        return (Verdict.TIME_LIMIT if past_limit(kept) else Verdict.UNCHANGED), kept

    def fold_weights(self, optimized: Graph):
        """The call's weights by name, or ``None`` where one is traced (nothing to check).

        A constant of the function is the graph's own.
        """
        ws = [x for x, k in zip(self.traced.leaves, self.traced.kinds, strict=True)
              if k == "weight"]
        if any(_is_tracer(x) for x in ws):
            return None
        return {**optimized.weights, **{p: ws[j] for p, j in self._weight_index.items()}}

    def prepare(self, optimized: Graph, report: dict) -> _Entry:
        """The graph split into its weight and runtime stages, jitted, on the entry.

        The weight leaves are found by name (the others are constants of the function, held
        in ``entry.constants``).
        """
        entry = self.entry
        staged = StagedGraph(optimized)
        entry.weight_slots = [self._weight_index.get(name, name) for name in staged.weight_names]
        entry.constants = {name: optimized.weights[name] for name in staged.weight_names
                           if name not in self._weight_index}
        entry.staged = staged
        entry.donated = self.host._donated_inputs(self.traced, self.args, self.static_pos)
        _compile_stages(entry, bool(self.hit is not None and self.hit[1].get("full_precision")))
        return entry

    def check(self, prepared: _Entry, report: dict, unchanged: bool) -> dict | None:
        """The output check against ``jax.jit`` of the function, or ``None`` (not asked).

        A graph read from the graph cache is checked on its first use in this process: the
        file's digest is no proof that the process that stored it checked this graph (it
        may have been edited and its digest computed again). Once this process has checked
        or stored it (:func:`~taso_jax.frontends.graph_cache.checked`), a hit is not checked
        again unless ``check="always"``. Otherwise
        :func:`~taso_jax.first_call_check.compare_with_original`.
        """
        hit, result = self.hit, self._result
        stored = (hit[1].get("check") or {}) if hit is not None else {}
        first_use = hit is not None and not graph_cache.checked(self.key, result.graph,
                                                                self.graph)
        if self.host.check is True and stored.get("ok") is True and not first_use:
            return {**stored, "reference": "jax.jit of the original function, earlier in this "
                                           "process (the process that stored the graph cache "
                                           "entry, or its first use)"}
        if not self.host.check:
            return None
        check = compare_with_original(self.host, prepared, self.traced, self.args,
                                      self.static_pos)
        check["reference"] = ("jax.jit of the original function, on the graph cache entry's "
                              "first use in this process" if first_use else
                              "jax.jit of the original function")
        return check

    def mismatch(self, check: dict, result) -> str:
        """Why outputs that differ from the original's are not run, in words."""
        if self.hit is not None:
            return (f"the graph cache entry {self.key[:12]} gives outputs that differ from "
                    f"the original's (max abs error {check['max_abs_err']:.3g}): it was "
                    f"edited or is stale; it was removed")
        return (f"optimized outputs differ from the original's (max abs error "
                f"{check['max_abs_err']:.3g}); substitutions applied: "
                f"{sorted(result.applied)}")

    def admit(self, prepared: _Entry, report: dict, unchanged: bool):
        """The timing against ``jax.jit`` of the function decides; its decision is stored.

        A graph cache hit was measured faster by the process that stored it. A graph the
        search left unchanged that wins runs as its stages (:attr:`Verdict.REWRITTEN`): the
        work they fold is what made it faster.
        """
        entry, result = self.entry, self._result
        entry.folded_for = ()
        if report.get("check", {}).get("ok"):
            graph_cache.mark_checked(self.key, result.graph, self.graph)
        self._lap("compile and check")
        if self.hit is not None:
            return prepared, Verdict.REWRITTEN, None
        kept = keep_original(self.host, entry, self.traced, result, self.args, self.static_pos,
                             self._deadline)
        self._lap("timing against jax.jit")
        stored = _stored_check(report.get("check"))
        if "baseline" in report or self.options.end_to_end == 0:  # timed
            self._store(result, kept, check=stored)
        if self._settles_on_calls(kept, report):  # the next calls compare (call_trial)
            entry.trial = CallTrial(kept, store=lambda k: self._store(result, k, check=stored))
        if kept is None:
            return prepared, Verdict.REWRITTEN, None
        return prepared, (Verdict.TIME_LIMIT if past_limit(kept) else Verdict.UNCHANGED), kept

    def _settles_on_calls(self, kept: str | None, report: dict) -> bool:
        """Whether the calls after the first compare the two (:mod:`taso_jax.call_trial`).

        Where only the time limit cut the comparison (:func:`settles_on_calls`), the
        outputs were checked equal (or the check is off), the decorator allows it
        (``settle_on_calls``) and no input is donated (a donated input cannot be read by
        the other function's turn).
        """
        host = self.host
        return (settles_on_calls(kept) and host.settle_on_calls and not self.entry.donated
                and (report.get("check", {}).get("ok") or not host.check))

    def deliver(self, prepared: _Entry, report: dict, unchanged: bool, deadline) -> None:
        """The signature's calls run the optimized stages."""
        self.entry.original_kept = report["original_kept"] = None

    def deliver_input(self, report: dict, verdict: Verdict, why: str | None,
                      deadline) -> None:
        """The signature's calls run ``jax.jit`` of the original.

        By choice (``original_kept``), or as a fallback (a graph cache entry that failed is
        removed, as is one whose pre-folded weights overflow or underflow on this call's
        weights).
        """
        entry = self.entry
        if entry.staged is None and self._result is not None:  # decided before prepare
            self.prepare(self._result.graph, report)
        if verdict is Verdict.FALLBACK:
            entry.fallback = why
            if self.hit is not None:  # another process's entry that this one will not use
                graph_cache.drop(self.key)
        else:
            if self.hit is not None and report.get("fold_refusals"):
                graph_cache.drop(self.key)  # its fold is faulty on these weights: search again
            entry.original_kept = report["original_kept"] = why

    def _store(self, result, kept: str | None, check: dict | None) -> None:
        """The decision in the graph cache, for the next process."""
        graph_cache.store(self.key, result.graph, self.graph, {
            "cost_before": result.cost_before, "cost_after": result.cost_after,
            "applied": dict(result.applied) if kept != _KEPT_INPUT else {},
            "original_kept": kept, "full_precision": self.entry.full_precision,
            "check": check})


def _timed_when_it_stops(reserve: Callable[[], float], run: OriginalRun,
                         deadline) -> Callable[[], float]:
    """``reserve``, except that a guess which would stop the search waits for the timing.

    Until ``run`` has timed the original, :func:`first_call_reserve` guesses its call from
    a price; a guess that leaves the search nothing (at or above what ``deadline`` has
    left) is not taken on trust: the original's own timing, due within seconds, is waited
    for (at most until ``deadline``) and decides. The calibrated price of an S=2048 masked
    attention's softmax alone was 311 ms where the whole call took 360 ms, and the search
    got 0.1 s. (The pipeline's shares are still sized from the need seen when it starts.)
    """

    def timed() -> float:
        need = reserve()
        if not run.ok and run.error is None and need >= deadline.left():
            run.join(deadline.left())
            need = reserve()
        return need

    return timed

