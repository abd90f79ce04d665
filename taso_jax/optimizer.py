"""The optimizer every front door runs: built once from the options, run on a graph.

:class:`Optimizer` loads and proves the rules once, takes a target (the runtime the result
must be fast in, a :class:`~taso_jax.targets.Target` from the registry, owning its cost
model and its end-to-end choice), and runs the one search pipeline
(:func:`~taso_jax.search.options.run_search`) under one
:class:`~taso_jax.search.limits.Deadline`. The front doors only import or trace, run, then
write or compile:

* the command line (``taso-jax optimize``): ONNX import -> :meth:`Optimizer.run` on the
  file as a :class:`~taso_jax.pipeline.Source` -> export, output check in onnxruntime ->
  :class:`~taso_jax.outcome.Outcome` -> written model and report;
* the Python API (``taso_jax.optimize(graph)``): :meth:`Optimizer.run` -> ``Outcome``, whose
  graph was checked against the input graph under ``jax.jit``;
* the decorator (``@taso_jax.optimize``): trace -> :meth:`Optimizer.run` on a
  :class:`~taso_jax.traced_source.TracedSource` -> compile, check against ``jax.jit`` of
  the function, time against it -> ``Outcome``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from taso_jax.checks import RTOL, check_tolerances
from taso_jax.ir.graph import Graph, GraphBuilder
from taso_jax.outcome import Outcome
from taso_jax.records import PhaseTimes, cost_model_stats
from taso_jax.search.backtracking import SearchResult
from taso_jax.search.limits import Deadline
from taso_jax.search.options import VISITED_HELD, OptimizeOptions, run_search, usable_rules
from taso_jax.targets import make_target
from taso_jax.verify.runner import NOT_PROVED_IN_TIME, rules_for

__all__ = ["Optimizer"]


class Optimizer:
    """One optimization setup: options, proved rules, target and cost model, made once.

    Args:
        options: the settings (:class:`~taso_jax.search.options.OptimizeOptions`; its
            defaults when ``None``), with ``changes`` applied.
        target: the runtime to be fast in (a :class:`~taso_jax.targets.Target`); default
            the registered target the options name (:func:`~taso_jax.targets.make_target`;
            the ONNX front door makes its own, which knows the user's file). A string is
            the option ``target``.
        rules: the rules to search with, proof stamps as given; default
            :func:`~taso_jax.verify.runner.rules_for` the options (a rule file's rules are
            proved again unless ``trust_proofs``). Unproved rules are left out unless
            ``allow_unverified``.
        deadline: the run's :class:`~taso_jax.search.limits.Deadline`, or ``None`` (no
            limit on making the optimizer). A rule file's proofs use at most its
            ``rule_proofs`` share; the rules not proved by then are left out (unless
            ``allow_unverified``), counted in ``rule_counts["not_proved_in_time"]``, and
            the proofs done are kept for the next run
            (:func:`~taso_jax.verify.runner.load_proved_rules`).

    Raises:
        ValueError: a setting out of range, a target that is not the options', or a rule
            file that is not one.
        TypeError: an unknown setting.
    """

    def __init__(self, options: OptimizeOptions | None = None, *, target=None, rules=None,
                 deadline: Deadline | None = None, **changes):
        if isinstance(target, str):  # the option's name (``target="onnxruntime"``)
            changes["target"], target = target, None
        opts = (options or OptimizeOptions()).replace(**changes)
        self.target = target if target is not None else make_target(opts.target)
        if self.target.name != opts.target:
            raise ValueError(f"target {self.target.name!r} given for options of target "
                             f"{opts.target!r}")
        self.cost_model = self.target.cost_model(opts)
        self.options = opts.replace(cost_model=self.cost_model) \
            if isinstance(opts.cost_model, str) and self.target.replaces_cost_model else opts
        subs = rules if rules is not None else rules_for(
            opts, deadline.share("rule_proofs") if deadline is not None else None)
        self.rules, self.rule_counts = usable_rules(subs, opts.allow_unverified, stacklevel=4)
        late = sum(1 for s in subs if isinstance(s.provenance.get("proof"), dict)
                   and s.provenance["proof"].get("why") == NOT_PROVED_IN_TIME)
        if late:
            self.rule_counts["not_proved_in_time"] = late

    def search(self, graph: Graph | GraphBuilder, deadline: Deadline | None = None,
               progress: Callable[[int, float], None] | None = None,
               record: int | None = VISITED_HELD, confirm: bool = True,
               reserve: Callable[[], float] | None = None,
               fold_weights: Callable[[Graph], Mapping | None] | None = None) -> SearchResult:
        """The search pipeline on ``graph``: search, second opinions, end-to-end choice.

        ``deadline`` (default: ``options.time_limit`` from now) bounds all of it; ``record``
        is how many visited graphs the result holds
        (:func:`~taso_jax.search.options.run_search`). With ``confirm=False`` the end-to-end
        choice only screens, and the caller must confirm the graph it picked faster than its
        own baseline before using it (the decorator, against ``jax.jit`` of the function).
        ``reserve()``: seconds the caller keeps for itself before ``deadline`` (the
        decorator's compile, check and comparison; see
        :func:`~taso_jax.search.options.run_search`). ``fold_weights(g)``: the weight values
        a candidate's pre-folded weights are checked on (default ``g.weights``); a candidate
        whose fold overflows or underflows is dropped before the choice
        (``result.fold_refusals``). Returns the
        :class:`~taso_jax.search.backtracking.SearchResult`, with ``rules`` (the counts of
        rules used and left out) set. ``graph`` is not changed.
        """
        if isinstance(graph, GraphBuilder):
            graph = graph.graph()
        started = time.perf_counter()
        result = run_search(graph, self.rules, self.cost_model, self.options,
                            deadline=deadline, chooser=self.target.chooser(self.options),
                            progress=progress, second_opinions=self.target.second_opinions,
                            record=record, confirm=confirm, reserve=reserve,
                            fold_weights=fold_weights)
        result.pipeline_seconds = time.perf_counter() - started  # search, opinions, choice
        result.rules = dict(self.rule_counts)
        if result.out_of_time_in == "import" and "not_proved_in_time" in self.rule_counts:
            result.out_of_time_in = "rule proofs"  # what used the time up before the search
        return result

    def phases(self, result: SearchResult, *, import_s: float | None = None,
               check_s: float | None = None, total_s: float | None = None) -> PhaseTimes:
        """Where ``result``'s time went (:class:`~taso_jax.records.PhaseTimes`), in seconds.

        The search's phases come from ``result`` (the end-to-end choice: what
        :meth:`search` took beyond the search and its second opinions), pricing and compiles
        from the cost model where it reports them (an optional ``stats()``:
        :func:`~taso_jax.records.cost_model_stats`); the front door's own phases are given.
        """
        stats = cost_model_stats(self.cost_model)
        whole = getattr(result, "pipeline_seconds", None)
        second = result.second_opinion_seconds or None
        choice = (max(whole - result.seconds - (second or 0.0), 0.0)
                  if whole is not None and result.end_to_end else None)
        return PhaseTimes(import_s=import_s, search_s=result.seconds,
                          second_opinions_s=second, choice_s=choice, check_s=check_s,
                          pricing_s=stats.get("pricing_seconds"), compiles=stats.get("compiles"),
                          compile_s=stats.get("compile_seconds"), total_s=total_s,
                          cost_model=stats.get("name") or self.options.cost_model_name)

    def run(self, graph, *, check: bool = True, deadline: Deadline | None = None,
            name: str = "graph", progress: Callable[[int, float], None] | None = None,
            rtol: float = RTOL, atol: float | None = None) -> Outcome:
        """Optimize a graph or a front door's source, check and deliver: the one pipeline.

        ``graph`` is a :class:`~taso_jax.pipeline.Source` (the command line's ONNX file, the
        decorator's traced function; ``check``, ``rtol``, ``atol`` and ``name`` are its), or
        a graph (the Python API), which becomes a :class:`~taso_jax.pipeline.GraphSource`:
        a rewritten graph is compared with the input graph under ``jax.jit`` at the input
        scales of :data:`~taso_jax.checks.CHECK_SCALES` (tolerances ``rtol``/``atol``), and
        by its non-finite values at :func:`~taso_jax.checks.range_scales`; where it differs
        the input is delivered (:attr:`~taso_jax.outcome.Verdict.FALLBACK`) with a
        ``RuntimeWarning``. A candidate with a weight computed ahead of time that overflows
        or underflows (:func:`~taso_jax.ir.fold_check.fold_overflow`, whatever ``check``
        says) is refused by the search, and another is delivered (the input at worst:
        :attr:`~taso_jax.outcome.Verdict.UNCHANGED`), the report saying why;
        ``check=False`` turns the check off (then a wrong rule given with ``trust_proofs``
        or as objects goes unnoticed). Never slower: the end-to-end
        choice (``end_to_end > 0``) keeps the input unless a candidate is confirmed faster.
        The steps are :func:`~taso_jax.pipeline.deliver`'s.

        Returns:
            The :class:`~taso_jax.outcome.Outcome`; its ``graph`` is the graph delivered.

        Raises:
            ValueError: ``rtol`` or ``atol`` negative, not finite or above its ceiling
                (:func:`~taso_jax.checks.check_tolerances`).
        """
        from taso_jax.pipeline import GraphSource, deliver

        check_tolerances(rtol, atol)
        if isinstance(graph, GraphBuilder):
            graph = graph.graph()
        source = GraphSource(graph, name, check, rtol, atol) if isinstance(graph, Graph) \
            else graph
        return deliver(self, source, deadline, progress)
