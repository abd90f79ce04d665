"""One options record for every way in, and the one search pipeline.

:class:`OptimizeOptions` holds the search's settings with the one set of defaults that
``taso_jax.optimize``, ``taso_jax.search_graph``, ``taso-jax optimize`` and
``@taso_jax.optimize`` share; :func:`run_search` runs TASO's backtracking search with them
and, unless ``end_to_end=0``, the end-to-end choice (:func:`taso_jax.search.choose.choose_fastest`).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from taso_jax.search.backtracking import SearchResult, backtracking_search
from taso_jax.search.choose import choose_fastest, measured_set
from taso_jax.search.compile_ahead import choice_reserve, compile_ahead, guessed_make_seconds
from taso_jax.search.cost import (
    COST_MODEL_NAMES,
    AnalyticCostModel,
    CostModel,
    MeasuredCostModel,
    get_cost_model,
)
from taso_jax.search.fold_refusals import FoldGate, refuse_faulty_folds
from taso_jax.search.limits import SHARES, Deadline
from taso_jax.search.rules import Substitution, default_substitutions, load_substitutions
from taso_jax.search.second_opinions import (
    add_ablation_candidate,
    add_analytic_candidate,
    add_as_written_candidate,
    add_near_tie_candidate,
    prices_nchw_as_nhwc,
)

from taso_jax.ir.executor import forget_compiled
from taso_jax.ir.graph import Graph
from taso_jax.ir.layout import has_nchw_convolutions

__all__ = ["OptimizeOptions", "run_search", "add_second_opinions", "usable_rules",
           "TARGETS"]

#: Share of ``time_limit`` that the backtracking search may use (:data:`SHARES`).
SEARCH_SHARE = SHARES["search"]

#: Share of ``time_limit`` each search that second-guesses the cost model may use
#: (:data:`SHARES`).
ANALYTIC_SHARE = SHARES["second_opinion"]

#: Graphs besides the input that a search run here holds in ``result.visited`` (the
#: cheapest ones; at least the candidates kept): the end-to-end choice needs no more, and
#: every graph held keeps its nodes alive through that choice.
VISITED_HELD = 8

#: Changes when the same options and rules can give another graph (kept graphs are cached on
#: disk under it: :mod:`taso_jax.frontends.graph_cache`). 2: convolutions priced in NHWC on
#: XLA:CPU, and the analytic search's best graph among the candidates. 3: the NHWC layout
#: candidate runs pools in NHWC too. 4: the best graph with its rules' near ties taken is
#: a candidate (:func:`taso_jax.search.second_opinions.add_near_tie_candidate`). 5: so is the
#: best graph of a search without one rule every candidate applies
#: (:func:`taso_jax.search.second_opinions.add_ablation_candidate`). 6: the greedy descent runs
#: a rule that rewrites one node into its own operator several times in a row where the
#: last form is the cheapest (:func:`taso_jax.search.descent._chain_step`), and forms
#: of a convolution with other groups are priced side by side
#: (:meth:`taso_jax.search.cost.MeasuredCostModel._measure_beside`); the end-to-end choice
#: duels a confirmed candidate with one ahead of it by median. 7: the calibrated cost model
#: is the default (:mod:`taso_jax.search.calibrated`). 8: the best graph priced with its
#: convolutions as written is a candidate where the search priced them in NHWC
#: (:func:`taso_jax.search.second_opinions.add_as_written_candidate`), in the analytic
#: search's place. 9: attention's cuDNN form (built only where cuDNN runs:
#: ``OpDef.runs_here``), attention with scores wider than its values, bfloat16 operands.
#: 10: the CPU calibration refitted to kernels timed on an idle machine. 11: onnxruntime
#: timed on one thread (:func:`taso_jax.frontends.onnxruntime_target.ort_session`); the
#: ONNX export writes zero recurrent states absent and products with a bias as ``Gemm``.
SEARCH_REVISION = 11

#: The runtimes a result can be made fast in.
TARGETS = ("xla", "onnxruntime")


def _option(default, help: str, **kw):
    """A field of :class:`OptimizeOptions` with its one description (``metadata["help"]``)."""
    return field(default=default, metadata={"help": help}, **kw)


@dataclass(frozen=True)
class OptimizeOptions:
    """Settings of one optimization, with the defaults every front door uses.

    Each setting is described once, in its field's ``help``; :meth:`help` gives it,
    ``taso-jax optimize --help`` and the README's options table are rendered from it
    (:meth:`markdown_table`), and the list below is too.

    Raises:
        ValueError: a setting out of its range (on construction).
    """

    alpha: float = _option(
        1.05, "TASO's alpha relaxation (SOSP 2019, Section 5): graphs up to alpha times "
              "costlier than the best found are still explored; >= 1")
    budget: int = _option(100, "graphs expanded at most; >= 0")
    time_limit: float = _option(
        60.0, "seconds for the whole optimization at most (import, kernel measurement, "
              "search and end-to-end choice); > 0. The decorator's default is 10 s")
    cost_model: Any = _option(
        "calibrated", "how graphs are priced: \"calibrated\" (each kernel from its FLOPs "
                      "and bytes through curves fitted to kernels timed on this device class; "
                      "compiles only to settle close calls between forms of one node), "
                      "\"measured\" (every kernel compiled and timed on this device, cached in "
                      "a SQLite file in the user cache directory), \"analytic\" (a roofline "
                      "of FLOPs and bytes), or a CostModel")
    substitutions: Any = _option(
        None, "the rules: a rule file path or a list of Substitution; None for the shipped "
              "set", compare=False)
    allow_unverified: bool = _option(
        False, "also use rules the verifier has not proved (TASO, Section 4: only proved "
               "rules are sound); the report marks each one applied [NOT PROVED]")
    end_to_end: int = _option(
        4, "how many of the cheapest graphs are timed on the target with the input, the "
           "fastest confirmed faster being kept: never slower than the input beyond the "
           "measurement's noise; 0 trusts the cost model")
    trust_proofs: bool = _option(
        False, "take a rule file's proof stamps as they are; by default its rules are "
               "proved again (once per file content and process: a cached proof is proved "
               "again); the shipped set is trusted")
    target: str = _option(
        "xla", "the runtime the result must be fast in: \"xla\" (jax.jit on this device) "
               "or \"onnxruntime\" (kernels and candidates timed in onnxruntime against "
               "the input file)")
    layout_candidates: bool = _option(
        True, "the end-to-end choice also times the NHWC form of the input and of the "
              "cheapest candidate (XLA:CPU runs NHWC convolutions up to 2x faster); the "
              "ONNX command line, which writes NCHW files, turns it off")

    def __post_init__(self):
        checks = [("alpha", 1.0 <= self.alpha < float("inf"), "a finite number >= 1"),
                  ("budget", self.budget >= 0, ">= 0"),
                  ("time_limit", self.time_limit > 0, "> 0"),
                  ("end_to_end", self.end_to_end >= 0, ">= 0")]
        for name, ok, want in checks:
            if not ok:
                raise ValueError(f"{name} must be {want}, got {getattr(self, name)}")
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, got {self.target!r}")
        if isinstance(self.cost_model, str) and self.cost_model not in COST_MODEL_NAMES:
            raise ValueError(f"cost_model must be one of {COST_MODEL_NAMES} or a CostModel, "
                             f"got {self.cost_model!r}")

    @classmethod
    def help(cls, name: str) -> str:
        """The one description of setting ``name``.

        Raises:
            KeyError: an unknown setting.
        """
        return {f.name: f.metadata["help"] for f in dataclasses.fields(cls)}[name]

    @classmethod
    def markdown_table(cls) -> str:
        """Every setting, its default and its description, as a Markdown table."""
        rows = ["| option | default | meaning |", "|---|---|---|"]
        for f in dataclasses.fields(cls):
            rows.append(f"| `{f.name}` | `{f.default!r}` | {f.metadata['help']} |")
        return "\n".join(rows)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The option names (the keywords every front door accepts)."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def replace(self, **changes) -> OptimizeOptions:
        """A copy with some settings changed (validated again).

        Raises:
            TypeError: an unknown option name.
        """
        unknown = set(changes) - set(self.names())
        if unknown:
            raise TypeError(f"unknown option(s) {sorted(unknown)}; the options are "
                            f"{', '.join(self.names())}")
        return dataclasses.replace(self, **changes)

    @property
    def cost_model_name(self) -> str:
        """The cost model's name for reports (``"measured"``, ``"analytic"``, a class name)."""
        cm = self.cost_model
        return cm if isinstance(cm, str) else getattr(cm, "name", type(cm).__name__)

    def make_cost_model(self, layouts: bool = True, **kw) -> CostModel:
        """The cost model these options name (a given instance is returned as is).

        ``"measured"`` and ``"calibrated"`` on XLA:CPU with ``layout_candidates`` price
        convolutions in NHWC (``nhwc_convolutions=True``): the end-to-end choice times NHWC
        forms and on a CPU keeps them, so the search ranks graphs by what they will run.
        ``layouts``: whether the target runs those forms (``jax.jit`` does; onnxruntime runs
        the file it is given, and its target passes ``False``). ``kw`` goes to
        :func:`get_cost_model` where a name is given (``cache_path`` for the measured model).
        """
        cm = self.cost_model
        if cm in ("measured", "calibrated") and layouts and self.layout_candidates:
            import jax

            return get_cost_model(cm, nhwc_convolutions=jax.default_backend() == "cpu", **kw)
        return get_cost_model(cm, **kw) if isinstance(cm, str) else cm

    def load_rules(self) -> list[Substitution]:
        """Every rule these options name (proved or not), stamps as they are in the file.

        The front doors use :func:`taso_jax.verify.runner.rules_for`, which proves a rule
        file's rules again.

        Raises:
            ValueError: the rule file is not a substitution file.
            OSError: the rule file cannot be read.
        """
        subs = self.substitutions
        if subs is None:
            return default_substitutions()
        if isinstance(subs, str) or hasattr(subs, "__fspath__"):
            return load_substitutions(subs)
        return list(subs)


def usable_rules(subs: Sequence[Substitution], allow_unverified: bool,
                 stacklevel: int = 3) -> tuple[list[Substitution], dict]:
    """The rules a search may use, and the counts a report gives.

    Unproved rules are left out, with a ``UserWarning``, unless ``allow_unverified``.
    Returns ``(rules, {"used", "proved", "unverified_used", "unverified_left_out"})``.
    """
    proved = [s for s in subs if s.proof_status == "proved"]
    unproved = len(subs) - len(proved)
    if unproved and not allow_unverified:
        warnings.warn(f"{unproved} of {len(subs)} substitutions are not proved and are not "
                      "used (run `taso-jax verify` on them, or pass allow_unverified=True / "
                      "--allow-unverified to use them anyway)", UserWarning,
                      stacklevel=stacklevel)
    used = list(subs) if allow_unverified else proved
    return used, {"used": len(used), "proved": len(proved),
                  "unverified_used": unproved if allow_unverified else 0,
                  "unverified_left_out": 0 if allow_unverified else unproved}


def add_second_opinions(result: SearchResult, graph: Graph, subs: Sequence[Substitution],
                        cost_model: CostModel, opts: OptimizeOptions,
                        deadline: Deadline | None = None,
                        need: Callable[[], float | None] | None = None) -> None:
    """Add the candidates that second-guess the search's cost model to ``result``.

    The best graph of a search under another pricing: with convolutions priced in the
    layout they are written in, where ``cost_model`` priced them in NHWC
    (:func:`~taso_jax.search.second_opinions.add_as_written_candidate`; the analytic
    search's NCHW roofline is the cruder form of the same opinion, and a fourth search
    took 3-5 s from the choice of the 60 s corpus runs), else under the analytic cost model
    (:func:`~taso_jax.search.second_opinions.add_analytic_candidate`); the best graph with its
    rules' near ties taken (:func:`~taso_jax.search.second_opinions.add_near_tie_candidate`)
    and the best graph of a search without one rule every candidate applies
    (:func:`~taso_jax.search.second_opinions.add_ablation_candidate`), each limited to the
    ``second_opinion`` share of the ``deadline``'s span (default: ``opts.time_limit`` from
    now) and to what the end-to-end choice's ``choice_reserve`` share leaves of the
    ``deadline`` (:func:`_second_opinion_seconds`): a search that ran past its share leaves
    the time to the choice of the graphs it found, not to more candidates. ``need()``, once
    it is known (not ``None``), is what one comparison of the choice needs
    (:func:`~taso_jax.search.compile_ahead.choice_reserve`), kept too where it is more than that
    share: a layout model whose calls took 1.5 s searched 17 s, then second opinions took
    14 s of the 35 s left, and the 27.7 s comparison no longer fit.
    ``result.graph`` is not changed.
    """
    deadline = deadline or Deadline.start(opts.time_limit)
    seconds = _second_opinion_seconds(deadline, need)
    if seconds is None:
        return
    other = add_as_written_candidate if prices_nchw_as_nhwc(cost_model) \
        else add_analytic_candidate
    other(result, graph, subs, cost_model, alpha=opts.alpha, budget=opts.budget,
          time_limit=seconds)
    seconds = _second_opinion_seconds(deadline, need)
    if seconds is None:
        return
    add_near_tie_candidate(result, subs, cost_model, time_limit=seconds)
    seconds = _second_opinion_seconds(deadline, need)
    if seconds is not None:
        add_ablation_candidate(result, graph, subs, cost_model, alpha=opts.alpha,
                               budget=opts.budget, time_limit=seconds)


#: The least part of its share a second opinion is started with (:func:`add_second_opinions`).
SECOND_OPINION_LEAST = 0.25


def _second_opinion_seconds(deadline: Deadline,
                            need: Callable[[], float | None] | None = None) -> float | None:
    """Seconds a second opinion started now may take, or ``None``: none is started.

    Its ``second_opinion`` share of ``deadline``'s span, less whatever would cut into the
    ``choice_reserve`` share the end-to-end choice keeps, or into ``need()`` seconds where
    that is known and more; ``None`` where that is below :data:`SECOND_OPINION_LEAST` of
    the share.
    """
    share = SHARES["second_opinion"] * deadline.seconds
    kept = SHARES["choice_reserve"] * deadline.seconds
    known = need() if need is not None else None
    seconds = min(share, deadline.left() - max(kept, known or 0.0))
    return seconds if seconds >= SECOND_OPINION_LEAST * share else None


def _pipeline_deadline(deadline: Deadline | None, opts: OptimizeOptions,
                       reserve: Callable[[], float] | None) -> tuple[Deadline, float]:
    """The search pipeline's own deadline, and the end of the caller's (``perf_counter``).

    The shares are of what the import and rule loading left (at least 5% of the limit);
    the pipeline ends ``reserve()`` seconds before the caller's end, where given.
    """
    if deadline is None:
        deadline = Deadline.start(opts.time_limit)
    else:
        deadline = Deadline.start(max(deadline.left(), 0.05 * min(deadline.seconds,
                                                                   opts.time_limit)))
    end = deadline.at  # the caller's own work comes after this pipeline, before ``end``
    if reserve is not None:
        deadline = Deadline.start(max(deadline.left() - reserve(), 1e-3))
    return deadline, end


def _search_stop(ahead, graph: Graph, deadline: Deadline, end: float,
                 reserve: Callable[[], float] | None) -> Callable[[], bool] | None:
    """When the search ends early, asked before each expansion; ``None``: never.

    With the caller's ``reserve``, where less than it is left before ``end`` (it grows as
    the caller learns better). And, once the background compile ``ahead`` has timed a call
    of the input, where going on would leave the choice less than one comparison needs,
    with room for its second opinions (:func:`~taso_jax.search.compile_ahead.choice_reserve`),
    before ``deadline`` or before the caller's reserve, whichever comes first.
    """
    if reserve is None and ahead is None:
        return None

    def stop() -> bool:
        now = time.perf_counter()
        left = deadline.left()
        if reserve is not None:
            kept = end - now - reserve()
            if kept < 0.0:
                return True
            left = min(left, kept)
        need = None if ahead is None else choice_reserve(ahead, graph)
        return need is not None and left < need * (1.0 + SHARES["second_opinion"])

    return stop


def run_search(graph: Graph, subs: Sequence[Substitution], cost_model: CostModel,
               opts: OptimizeOptions, *, deadline: Deadline | None = None,
               chooser: Callable[..., dict] | None = None,
               progress: Callable[[int, float], None] | None = None,
               second_opinions: bool = True, record: int | None = VISITED_HELD,
               confirm: bool = True, reserve: Callable[[], float] | None = None,
               fold_weights: Callable[[Graph], Mapping | None] | None = None) -> SearchResult:
    """The one search pipeline: backtracking search, second opinions, end-to-end choice.

    This is the only place these are put together; every front door reaches it through
    :class:`taso_jax.optimizer.Optimizer`.

    Args:
        graph: the input graph (unchanged).
        subs: the rules to search with (already filtered: :func:`usable_rules`).
        cost_model: the cost model to price graphs with.
        opts: the settings (``alpha``, ``budget``, ``time_limit``, ``end_to_end``,
            ``layout_candidates``).
        deadline: the end of the whole optimization (default: ``opts.time_limit`` from
            now). Of what is left of it when the pipeline starts (at least 5% of its span),
            the backtracking search gets its ``search`` share, each second opinion its
            ``second_opinion`` share, the end-to-end choice what is left.
        chooser: the end-to-end choice, ``chooser(result, deadline=...) -> dict`` with
            ``deadline`` a ``time.perf_counter()`` value; it replaces ``result.graph`` by
            the fastest graph timed. Default :func:`~taso_jax.search.choose.choose_fastest`
            (``jax.jit`` on this device).
        progress: ``progress(iterations, best cost in microseconds)`` after each expansion.
        second_opinions: whether the searches that second-guess a measured cost model run
            (:func:`add_second_opinions`; never under the analytic model or without an
            end-to-end choice).
        record: how many graphs besides the input ``result.visited`` holds, the cheapest
            (``None``: every graph the search built, as a benchmark of the cost model wants).
        confirm: whether the default end-to-end choice confirms the graph it picks against
            the input (``False``: it screens only, and the caller must time the graph picked
            against its own baseline: :func:`~taso_jax.search.choose.screen_fastest`).
        reserve: ``reserve()``, the seconds the caller needs after this pipeline, before
            ``deadline`` (the decorator's compile, output check and comparison with
            ``jax.jit``). The search, the second opinions and the choice all end that much
            before ``deadline``: the search stops (``StopReason.CHOICE_RESERVE``) as soon as
            less than ``reserve()`` is left, which may grow once the caller knows better.
        fold_weights: ``g -> weights``, the values :mod:`~taso_jax.search.fold_refusals` checks.

    Returns:
        A :class:`~taso_jax.search.backtracking.SearchResult`; ``result.end_to_end`` holds
        what was timed when candidates were measured, ``result.unmeasurable`` the kernels
        the cost model could not time.
    """
    # import and rule loading took it all, or all but the caller's own reserve
    late = deadline is not None and (deadline.passed() or (
        reserve is not None and deadline.left() <= reserve()))
    deadline, end = _pipeline_deadline(deadline, opts, reserve)
    second = (second_opinions and opts.end_to_end > 0
              and not isinstance(cost_model, AnalyticCostModel))
    limit = deadline.seconds * (SHARES["search"] - (SHARES["second_opinion"] if second else 0.0)
                                if opts.end_to_end > 0 else 1.0)
    # the choice's first step, compiling the input, overlaps the search
    ahead = (compile_ahead(graph) if chooser is None and confirm and opts.end_to_end > 0
             else None)
    result = backtracking_search(graph, subs, cost_model, alpha=opts.alpha,
                                 budget=opts.budget, time_limit=limit, progress=progress,
                                 keep=max(1, opts.end_to_end),
                                 record=record, fold_gate=(gate := FoldGate(fold_weights)),
                                 stop=_search_stop(ahead, graph, deadline, end, reserve))
    if late or deadline.passed():
        result.out_of_time_in = "import" if late else "search"
    # the search's cheapest graph (the choice's first candidate) compiles beside the second
    # opinions, unless they time every kernel (a compile beside a timing slows what is timed)
    timed = (measured_set(result) if second and ahead is not None
             and not isinstance(cost_model, MeasuredCostModel) else [])
    best = compile_ahead(timed[1][1]) if len(timed) > 1 else None
    if second:
        t0 = time.perf_counter()
        add_second_opinions(result, graph, subs, cost_model, opts, deadline,
                            need=lambda: choice_reserve(ahead, graph))
        result.second_opinion_seconds = time.perf_counter() - t0
        if deadline.passed() and not result.out_of_time_in:
            result.out_of_time_in = "second opinions"
    refuse_faulty_folds(result, graph, fold_weights, gate)
    layouts = chooser is None and opts.layout_candidates and has_nchw_convolutions(graph)
    if opts.end_to_end > 0 and (len(result.candidates) > 1 or layouts):
        for thread in (ahead, best):
            if thread is not None:
                thread.join(deadline.left())
        if chooser is None:
            chooser = partial(choose_fastest, layouts=opts.layout_candidates,
                              confirm=confirm,
                              made_seconds=guessed_make_seconds(ahead, graph))
        until = deadline.at if reserve is None else min(deadline.at, end - reserve())
        result.end_to_end = chooser(result, deadline=until)
        # the candidates that lost are not run again: free their executables and weights
        forget_compiled(keep=(graph, result.graph))
        if deadline.passed() and not result.out_of_time_in:
            result.out_of_time_in = "end-to-end choice"
    for thread in (ahead, best):  # no compilation is left running into the export or exit
        if thread is not None:
            thread.join()
    result.unmeasurable = list(cost_model.unmeasurable)
    stats = getattr(cost_model, "stats", None)
    result.cost_model = dict(stats()) if stats is not None else {"name": opts.cost_model_name}
    return result


OptimizeOptions.__doc__ += "\n    Attributes:\n" + "".join(
    f"        {f.name}: {f.metadata['help']}.\n" for f in dataclasses.fields(OptimizeOptions))
