"""The delivery pipeline every front door runs: search, time, check, decide, deliver.

:func:`deliver` takes an :class:`~taso_jax.optimizer.Optimizer` and a :class:`Source` (what
a front door imported: an ONNX file, a built graph, a traced function) and returns the one
:class:`~taso_jax.outcome.Outcome`. The steps, in order:

1. search (:meth:`Optimizer.search <taso_jax.optimizer.Optimizer.search>`, or the source's
   own :meth:`Source.search`: the decorator's graph cache), and the report's own figures
   of the graphs (:meth:`Source.time_graphs`);
2. a search that kept its input delivers it (:func:`~taso_jax.outcome.kept_input_verdict`),
   unless the source checks an unchanged graph too (a built-in example written as ONNX, a
   traced function whose weight-only work is folded) or delivering it cleans the input up
   (:meth:`Source.cleans_up`: an ONNX file running nodes no output needs);
3. the source may deliver its input before any check (:meth:`Source.screen`: the
   decorator's decision read from its graph cache, a time limit passed before the
   end-to-end choice, nothing to gain);
4. the weights it computes ahead of time are checked again (the search dropped the
   candidates whose folds overflow or underflow: :mod:`taso_jax.search.fold_refusals`, on
   :meth:`Source.fold_weights`; a graph from the decorator's graph cache was not searched):
   one that does is refused, and the input is delivered
   (:attr:`~taso_jax.outcome.Verdict.UNCHANGED`, saying why);
5. the graph found is made deliverable (:meth:`Source.prepare`: an exported file, jitted
   stages); one that cannot be made is not delivered
   (:attr:`~taso_jax.outcome.Verdict.FALLBACK`);
6. the output check (:meth:`Source.check`; its policy and noise model are the source's,
   with :mod:`taso_jax.checks`'s comparison); a mismatch delivers the input, saying why
   (:meth:`Source.mismatch`);
7. the source may refuse the result for what it is (:meth:`Source.admit`: a file that holds
   at the bound sizes only, one that imports back with opaque operators, a function not
   confirmed faster than ``jax.jit`` of the original);
8. delivery: the result (:meth:`Source.deliver`) or the input
   (:meth:`Source.deliver_input`), and the outcome, built once, here.

A front door that stops before the pipeline (a model not imported, an import cut by the
time limit, a failure it falls back from) has its outcome made here too
(:func:`stopped_before`): :func:`~taso_jax.outcome.make_outcome` is called in this module
only.

The front doors parse or trace, call :meth:`Optimizer.run
<taso_jax.optimizer.Optimizer.run>` (which runs :func:`deliver`) and print or compile; none
decides a verdict.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping
from typing import Any, Protocol

from taso_jax.ir.graph import Graph
from taso_jax.outcome import Verdict, kept_input_verdict, make_outcome
from taso_jax.records import search_report
from taso_jax.search.fold_refusals import FoldRefusal
from taso_jax.search.limits import Deadline

__all__ = ["Source", "GraphSource", "NotDeliverable", "deliver", "stopped_before"]


class NotDeliverable(Exception):
    """The graph found cannot be delivered (it does not export); the input is, instead."""


class Source(Protocol):
    """What a front door imported, and how its results are checked and delivered.

    Attributes:
        name: the model's name in the report.
        graph: the imported input graph.
        notes: notes for the report, from the import.
        import_seconds: what importing took (``None``: not timed).
        checks_unchanged: whether an unchanged graph is still prepared and checked (the
            input has no file of its own to give back).
    """

    name: str
    graph: Graph
    notes: list
    import_seconds: float | None
    checks_unchanged: bool

    def after_search_seconds(self) -> float:
        """Seconds the steps after the search pipeline need (prepare, check, admit, deliver).

        A guess, kept out of the search's and the end-to-end choice's time
        (:meth:`Optimizer.search <taso_jax.optimizer.Optimizer.search>`'s ``reserve``), so
        that the whole run ends within its time limit.
        """

    def time_graphs(self, target, optimized: Graph, report: dict, deadline: Deadline) -> None:
        """The report's own timing of the input and ``optimized`` graphs, where made."""

    def prepare(self, optimized: Graph, report: dict) -> Any:
        """The deliverable form of ``optimized``; raise :class:`NotDeliverable` if none."""

    def check(self, prepared: Any, report: dict, unchanged: bool) -> dict | None:
        """The output check of ``prepared`` against the input (``None``: not checked)."""

    def admit(self, prepared: Any, report: dict, unchanged: bool) -> tuple[Any, Verdict | None,
                                                                           str | None]:
        """``(prepared, None, None)``, or ``(prepared, verdict, why)`` deciding otherwise.

        The verdict says why the input is delivered instead, or is
        :attr:`~taso_jax.outcome.Verdict.REWRITTEN` where ``prepared`` differs from the
        input although the graph does not (the decorator's stages fold work the original
        runs on every call).
        """

    def deliver(self, prepared: Any, report: dict, unchanged: bool, deadline: Deadline) -> None:
        """Deliver ``prepared`` (write it), noting how in ``report``."""

    def deliver_input(self, report: dict, verdict: Verdict, why: str | None,
                      deadline: Deadline) -> None:
        """Deliver the input (write it back), noting how in ``report``."""

    # Optional hooks: a source without one gets the default named in its docstring.

    def search(self, optimizer, deadline: Deadline, progress) -> Any:
        """The search's result for :attr:`graph`.

        Default: :meth:`Optimizer.search <taso_jax.optimizer.Optimizer.search>`, reserving
        :meth:`after_search_seconds`.
        """

    def screen(self, result, report: dict) -> tuple[Verdict, str] | None:
        """``(verdict, why)`` where the input is delivered before any check (default: never)."""

    def fold_weights(self, optimized: Graph) -> Mapping | None:
        """The weight values the fold check runs on (default: ``optimized.weights``).

        ``None``: no concrete values (a trace under a transformation): not checked.
        """

    def mismatch(self, check: dict, result) -> str:
        """Why a graph whose output check failed is not delivered, in words.

        Default: the pipeline's, naming the error and the substitutions applied.
        """

    def cleans_up(self) -> bool:
        """Whether the input graph, delivered, is simpler than the input (default: no).

        An ONNX file that runs nodes no output needs (:mod:`taso_jax.frontends.
        onnx_cleanup`) is where it is: a search that keeps its input graph then still has
        it prepared, checked and admitted (:meth:`admit` decides whether it is at least as
        fast as the file).
        """


class GraphSource:
    """A built graph (the Python API): checked under ``jax.jit``, delivered as a graph.

    Args:
        graph: the input graph.
        name: its name in the report.
        check: whether a rewritten graph is compared with the input
            (:func:`~taso_jax.checks.check_graphs`).
        rtol, atol: the check's tolerances (:func:`~taso_jax.checks.compare_outputs`).
    """

    checks_unchanged = False
    import_seconds = None

    def __init__(self, graph: Graph, name: str = "graph", check: bool = True,
                 rtol: float | None = None, atol: float | None = None):
        from taso_jax.checks import RTOL

        self.graph, self.name, self.notes = graph, name, []
        self._check, self.rtol, self.atol = check, RTOL if rtol is None else rtol, atol

    def after_search_seconds(self) -> float:
        """The check's two compiles, guessed from the graph's size (none without a check)."""
        from taso_jax.search.choose import COMPILE_SECONDS_PER_NODE

        return 2 * COMPILE_SECONDS_PER_NODE * len(self.graph.nodes) if self._check else 0.0

    def time_graphs(self, target, optimized, report, deadline) -> None:
        """Not timed: the API's caller times what it runs."""

    def prepare(self, optimized: Graph, report: dict) -> Graph:
        """The graph itself."""
        return optimized

    def check(self, prepared: Graph, report: dict, unchanged: bool) -> dict | None:
        """Both graphs under ``jax.jit`` at the check's input scales, unless turned off."""
        from taso_jax.checks import check_graphs

        if not self._check:
            return None
        return check_graphs(self.graph, prepared, rtol=self.rtol, atol=self.atol)

    def admit(self, prepared, report, unchanged):
        """Any graph that passed the check."""
        return prepared, None, None

    def deliver(self, prepared, report, unchanged, deadline) -> None:
        """Nothing to write: the outcome holds the graph."""

    def deliver_input(self, report, verdict, why, deadline) -> None:
        """Nothing to write: the outcome holds the input graph; a failed check warns."""
        if report.get("check", {}).get("ok") is False:
            warnings.warn(f"taso_jax.optimize: returning the input graph: {why}",
                          RuntimeWarning, stacklevel=6)


def deliver(optimizer, source: Source, deadline: Deadline | None = None, progress=None):
    """Run the pipeline on ``source`` with ``optimizer``: the :class:`Outcome` of it.

    ``deadline`` (default: the options' ``time_limit`` from now) bounds the search, the
    choice and the timings; ``progress`` goes to the search. The steps are the module's.
    A check that fails delivers the input, with ``why`` naming the error and the
    substitutions applied.
    """
    started = time.perf_counter()
    deadline = deadline or Deadline.start(optimizer.options.time_limit)
    graph = source.graph
    search = getattr(source, "search", None)
    if search is not None:
        result = search(optimizer, deadline, progress)
    else:
        result = optimizer.search(graph, deadline, progress,
                                  reserve=getattr(source, "after_search_seconds", None),
                                  fold_weights=getattr(source, "fold_weights", None))
    report = search_report(source.name, graph, result, optimizer.options, optimizer.rules,
                           source.notes)
    unchanged = result.graph.key == graph.key
    check_s = None

    def done(verdict: Verdict, why: str | None = None, prepared=None):
        phases = optimizer.phases(result, import_s=source.import_seconds, check_s=check_s,
                                  total_s=time.perf_counter() - started
                                  + (source.import_seconds or 0.0))
        if verdict.delivers_input:
            source.deliver_input(report, verdict, why, deadline)
        else:
            source.deliver(prepared, report, unchanged, deadline)
        delivered = graph if verdict.delivers_input else result.graph
        return make_outcome(verdict, report, delivered, why=why, result=result,
                            phases=phases)

    if not (unchanged and not source.checks_unchanged):
        source.time_graphs(optimizer.target, result.graph, report, deadline)
    kept = kept_input_verdict(graph, result, report)
    if kept is not None and kept[1] is None and report.get("fold_refusals"):
        kept = (kept[0], "; ".join(r["why"] for r in report["fold_refusals"]))
    cleaned = kept is not None and getattr(source, "cleans_up", lambda: False)()
    if kept is not None and not source.checks_unchanged and not cleaned:
        return done(*kept)
    screened = source.screen(result, report) if hasattr(source, "screen") else None
    if screened is not None:
        return done(*screened)
    if not unchanged:
        overflow = _fold_overflow(source, result.graph, graph)
        if overflow is not None:
            refusal = FoldRefusal(tuple(dict.fromkeys(result.path)), overflow)
            report["fold_refusals"] = [*report.get("fold_refusals", []), refusal.to_json()]
            return done(Verdict.UNCHANGED, str(refusal))
    try:
        prepared = source.prepare(result.graph, report)
    except NotDeliverable as e:
        return done(Verdict.FALLBACK, str(e))
    t0 = time.perf_counter()
    check = source.check(prepared, report, unchanged)
    check_s = time.perf_counter() - t0 if check is not None else None
    if check is not None and cleaned and not check["ok"]:  # an import or export fault
        report["cleanup_check"] = check
        return done(kept[0], "; ".join(w for w in (kept[1], _cleanup_mismatch(check)) if w))
    if check is not None:
        report["check"] = check
        if not check["ok"]:
            words = getattr(source, "mismatch", _mismatch)
            return done(Verdict.FALLBACK, words(check, result))
    prepared, verdict, why = source.admit(prepared, report, unchanged)
    if verdict is not None:
        if cleaned and verdict.delivers_input:  # the search's own verdict, and the cleanup's
            verdict, why = kept[0], "; ".join(w for w in (kept[1], why) if w)
        return done(verdict, why, prepared)
    return done(Verdict.UNCHANGED if unchanged else Verdict.REWRITTEN, prepared=prepared)


def stopped_before(verdict: Verdict, report: Mapping, why: str, *, graph: Graph | None = None,
                   phases=None):
    """The :class:`~taso_jax.outcome.Outcome` of a run that never reached :func:`deliver`.

    A model not imported (its sizes follow input values:
    :attr:`~taso_jax.outcome.Verdict.PASS_THROUGH`), an import the time limit cut
    (:attr:`~taso_jax.outcome.Verdict.TIME_LIMIT`), a failure the front door falls back
    from (:attr:`~taso_jax.outcome.Verdict.FALLBACK`): the input is delivered, and
    ``why`` says why. ``report`` holds what the front door knew; ``graph``, the input graph
    where one was imported.
    """
    return make_outcome(verdict, report, graph, why=why, phases=phases)


def _fold_overflow(source, optimized: Graph, graph: Graph):
    """:func:`~taso_jax.ir.fold_check.fold_overflow` of ``optimized`` on the source's weights."""
    from taso_jax.ir.fold_check import fold_overflow

    hook = getattr(source, "fold_weights", None)
    weights = hook(optimized) if hook is not None else optimized.weights
    return None if weights is None else fold_overflow(optimized, graph, weights)


def _cleanup_mismatch(check: dict) -> str:
    """Why a cleaned-up input whose check failed is not delivered, in words."""
    return (f"the cleaned-up file's outputs differ from the input's (max abs error "
            f"{check['max_abs_err']:.3g}): a fault in taso_jax's import or export of this "
            "model (please report it)")


def _mismatch(check: dict, result) -> str:
    """Why a graph whose check failed is not delivered, in words."""
    applied = (f"substitutions applied: {', '.join(sorted(result.applied))}" if result.applied
               else "no substitution was applied, so the fault is in taso_jax's import or "
                    "export of this model (please report it)")
    return (f"its outputs differ from the input's (max abs error {check['max_abs_err']:.3g}); "
            f"{applied}")
