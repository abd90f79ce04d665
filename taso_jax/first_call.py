"""The first call of a signature: trace, search, compile, check and time (a mixin).

:class:`FirstCallPipeline` holds what ``@taso_jax.optimize`` does the first time it meets a
call signature, and :class:`~taso_jax.decorator.OptimizedFunction` inherits it:
``_build`` traces the function and fills an ``_Entry``; ``_optimize`` imports the
jaxpr, reads the graph cache or runs the search, splits the result into jitted stages,
compares its outputs with ``jax.jit`` of the original (allowing for the device's own
rounding, else at full float32 precision, else falling back), times it against that
original (``_keep_original``) and stores the decision in the graph cache. The helpers and
constants here serve that pipeline alone; the call path that uses the finished entry is in
:mod:`taso_jax.decorator`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import time
import warnings
from collections import Counter
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from taso_jax.checks import compare_outputs
from taso_jax.first_call_budget import (
    CONFIRM_LEAST_ROUNDS,
    LIMIT_SLACK,
    SPAN_SECONDS,
    OriginalRun,
    first_call_reserve,
)
from taso_jax.frontends import graph_cache
from taso_jax.frontends.jaxpr_io import TracedFunction, _fn_name, trace_function
from taso_jax.frontends.onnx_model import ImportTimeLimit
from taso_jax.frontends.signature_entry import _Entry, _is_tracer, _leaf_signature
from taso_jax.ir.executor import StagedGraph, time_function, time_interleaved
from taso_jax.ir.folded_work import folded_work
from taso_jax.records import search_report
from taso_jax.search.backtracking import SearchResult
from taso_jax.search.choose import CONFIRM_LOOP_SECONDS, CONFIRM_MIN_ROUNDS, device_name
from taso_jax.search.limits import Deadline
from taso_jax.search.options import SEARCH_REVISION
from taso_jax.search.paired_test import MIN_SPEEDUP, confirm_faster, rounds_for
from taso_jax.search.rules import RuleFileError

__all__ = ["FirstCallPipeline"]

# The optimized function must beat ``jax.jit`` of the original by MIN_SPEEDUP (the paired
# test's one margin, :data:`taso_jax.search.paired_test.MIN_SPEEDUP`, imported above) and
# pass its signed-rank test. It is read from this module's namespace so that a test can
# raise it for the decorator alone.

#: The first call's stage that searches: the backtracking search, the searches that
#: second-guess its cost model, and the end-to-end choice among their candidates (the
#: report's ``search`` seconds count the backtracking search alone).
SEARCH_STAGE = "search and choice"

#: How ``original_kept`` starts where the time limit passed during the import or the
#: search.
_PAST_LIMIT = "not compiled, checked or timed against jax.jit"
#: How ``original_kept`` starts where the optimized stages were checked but the time limit
#: left no room for the comparison with ``jax.jit``.
_UNTIMED = "checked but not timed against jax.jit"
#: Interleaved runs of each when the optimized function is timed against the original.
BASELINE_REPEATS = 25
#: The phases of the search pipeline (``SearchResult.out_of_time_in``) that, cut by the time
#: limit, leave no time for the end-to-end choice: the optimized function is not timed.
_BEFORE_CHOICE = ("import", "search", "second opinions")
#: Why the original runs where the search delivered its input unchanged.
_KEPT_INPUT = "the search changed nothing"


@functools.cache
def _shipped_rules() -> tuple:
    """The shipped rule set, read once per process for every decorated function.

    Reading and parsing it took 1.5-2 s of each first call on the loaded 2-core machine
    (1,039 rules); the rules are frozen records, so one tuple serves every function.
    """
    from taso_jax.search.rules import default_substitutions

    return tuple(default_substitutions())


def _proves_rule_file(options) -> bool:
    """Whether making the optimizer proves a rule file's rules (a path, not trusted)."""
    subs = options.substitutions
    return (isinstance(subs, str) or hasattr(subs, "__fspath__")) and not options.trust_proofs


def _rule_file_error(error: Exception, substitutions) -> bool:
    """Whether ``error`` is about the caller's rule file: malformed, or not readable.

    Such an error is raised to the caller, not hidden behind a fallback to ``jax.jit``: it
    names the file and what is wrong (a
    :class:`~taso_jax.search.rules.RuleFileError`, which the command line reports with exit
    code 2, or the ``OSError`` of reading it).
    """
    if isinstance(error, RuleFileError):
        return True
    if not isinstance(error, OSError) or error.filename is None:
        return False
    if not (isinstance(substitutions, str) or hasattr(substitutions, "__fspath__")):
        return False
    return os.fspath(error.filename) == os.fspath(substitutions)


def _original_call_seconds(run, original, warm: bool, deadline) -> float:
    """Seconds one call of the original takes, as the comparison with it is sized.

    The background run's call where it made one (:class:`OriginalRun`), else one call timed
    here (with a warm-up unless ``warm``). That background call ran beside the search and
    the compiles (0.63-1.0 s where HF Llama's call alone took 0.36 s, S=1024, 2 loaded
    cores): where it would leave the least comparison past ``deadline`` by more than
    :data:`LIMIT_SLACK` of the limit, the original is timed once alone before giving up.
    """
    def alone() -> float:
        return time_function(original, repeats=1, warmup=0 if warm else 1)[0] / 1e6

    if run is None or not run.ok:
        return alone()
    call = run.call_seconds
    least = 2 * (CONFIRM_LEAST_ROUNDS + 2) * call
    if deadline is not None and least > deadline.left() + LIMIT_SLACK * deadline.seconds:
        call = min(call, alone())
    return call


def _nothing_to_run(graph, result) -> bool:
    """Whether ``result`` delivers ``graph`` itself with too little weight-only work to gain.

    Then the staged graph runs what ``jax.jit`` of the original runs, less the weight-only
    work it folds once; where that work, priced by the analytic cost model, is under the
    :data:`MIN_SPEEDUP` margin of the whole graph's price, no comparison could confirm the
    staged graph faster: there is nothing to compile, check or time. GPT-2 small's
    weight-only work is reshapes of its weights and its causal mask (the transposes that
    products read stay in the runtime stage, ``StagedGraph``); comparing its staged graph
    took 22 of its first call's 31 s, for 1.00x.
    """
    if result.graph.key != graph.key:
        return False
    from taso_jax.ir.executor import read_transposed
    from taso_jax.search.cost import AnalyticCostModel

    kept = read_transposed(graph)
    work = [n for n in graph.nodes if n.op not in ("weight", "input")]
    folded = [n for n in work if n.weight_only and n not in kept]
    if not folded:
        return True
    model = AnalyticCostModel.for_backend()
    gain = sum(model.node_cost(n) for n in folded)
    return gain < (MIN_SPEEDUP - 1.0) * sum(model.node_cost(n) for n in work)


def _package_version() -> str:
    try:
        from importlib.metadata import version

        return version("taso_jax")
    except Exception:  # not installed as a distribution (a source checkout)
        return "source"


class _Fallback(Exception):
    """Internal: the optimized pipeline failed for this signature."""


NOISE_MARGIN = 4.0
"""How many times the reference's own rounding noise an optimized output may differ by.

Two results that each carry up to the noise differ by up to twice it; twice that again
leaves room for the largest of many elements' errors."""


def _rounding_noise(flat_fn: Callable, values, reference) -> list[float]:
    """Per output, how far the original moves between default and full float32 precision.

    That is the largest change of ``reference``, ``jax.jit(flat_fn)(*values)`` at the
    device's default precision, when its matrix products and convolutions run at full
    float32 precision (``jax.default_matmul_precision("highest")``).

    On CPU the default is full precision and every entry is 0. On NVIDIA GPUs from Ampere
    on, float32 ``dot_general`` and convolutions at the default precision round their
    operands to TF32 (10 mantissa bits), so a rewrite that regroups the arithmetic (a
    batchnorm scale folded into a convolution kernel, say) differs from ``jax.jit`` of the
    original by about that rounding, which the fixed relative tolerance of
    :func:`taso_jax.checks.compare_outputs` (1e-3) does not cover through 50 layers.
    Integer, boolean and empty outputs get 0; non-finite elements are skipped. Runs one more
    compile of the original, so it is called only after a failed comparison.
    """
    with jax.default_matmul_precision("highest"):
        exact = jax.tree_util.tree_leaves(jax.jit(flat_fn)(*values))
    noise = []
    for r, e in zip(reference, exact, strict=True):
        r, e = np.asarray(r), np.asarray(e)
        if r.size == 0 or not np.issubdtype(r.dtype, np.inexact):
            noise.append(0.0)
            continue
        wide = np.result_type(r.dtype, np.float64)
        diff = np.abs(r.astype(wide) - e.astype(wide))
        noise.append(float(np.max(diff[np.isfinite(diff)], initial=0.0)))
    return noise


def _default_precision_rounds() -> bool:
    """Whether the default backend's default float32 precision may round matrix products.

    XLA:CPU computes float32 products in float32 at the default precision; GPUs may use TF32
    and TPUs bfloat16 passes. Where it does not round, comparing again at full precision
    would only compile the same function twice.
    """
    return jax.default_backend() != "cpu"


def _at_full_precision(stage: Callable) -> Callable:
    """``stage`` traced with its matrix products and convolutions at full float32 precision.

    ``jax.default_matmul_precision("highest")`` is read when ``lax.dot_general`` and
    ``lax.conv_general_dilated`` are traced, and stored in each equation, so a ``jax.jit`` of
    the result runs at that precision with no per-call cost. Used where the optimized graph
    at the device's default precision differs from the original by more than the original's
    own rounding (see :meth:`FirstCallPipeline._optimize`).
    """
    @functools.wraps(stage)
    def at_full_precision(*args):
        with jax.default_matmul_precision("highest"):
            return stage(*args)

    return at_full_precision


def _stored_check(check: dict | None) -> dict | None:
    """The JSON-able part of an output check's result, for the graph cache."""
    if check is None:
        return None
    return {k: v for k, v in check.items() if k != "reference"
            and isinstance(v, bool | int | float | str | type(None))}


class _Laps:
    """Seconds per step of the first call, added into ``stages`` as each step ends."""

    def __init__(self, stages: dict):
        self.stages, self.clock = stages, time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.stages[name] = self.stages.get(name, 0.0) + now - self.clock
        self.clock = now


def _compile_stages(entry, full_precision: bool) -> None:
    """``jax.jit`` of ``entry``'s staged graph, its products at full precision if asked.

    The user's calls donate the inputs they donate (``entry.donated``); the check and the
    timing must not, so a donating runner is compiled beside the plain one.
    """
    fold, run = entry.staged.fold, entry.staged.run
    if full_precision:
        fold, run = _at_full_precision(fold), _at_full_precision(run)
    entry.full_precision = full_precision
    entry.fold, entry.run = jax.jit(fold), jax.jit(run)
    entry.folded_for = ()
    if entry.donated:
        entry.run_donating = jax.jit(run, donate_argnums=entry.donated)


def past_limit(kept: str | None) -> bool:
    """Whether ``original_kept`` says the time limit, not a measurement, kept the original."""
    return bool(kept) and kept.startswith((_PAST_LIMIT, _UNTIMED))


def _tracing() -> bool:
    """Whether a JAX transformation is tracing here (an array made now is a tracer)."""
    return _is_tracer(jnp.zeros(()))


class FirstCallPipeline:
    """The first-call pipeline of :class:`~taso_jax.decorator.OptimizedFunction`.

    A mixin: it reads the host's ``fn``, ``_flat_fn``, ``options``, ``check``,
    ``_positions`` and ``_optimizer_made``, and calls its ``_execute``, ``_folded`` and
    ``_user_jit``.
    """

    def _build(self, args, weight_pos, static_pos) -> _Entry:
        fn = self._flat_fn
        t_trace = time.perf_counter()
        try:
            traced = trace_function(fn, args, weight_pos, static_pos, non_arrays="static")
        except Exception as e:  # the user's function does not trace: jax.jit would fail too
            e.add_note(f"taso_jax.optimize traces {_fn_name(fn)} like jax.jit: Python control "
                       "flow on array values is not allowed (use jax.lax.cond / jnp.where, or "
                       "mark the argument with static_argnums)")
            raise
        trace_s = time.perf_counter() - t_trace
        kinds, array_index = traced.kinds, traced.array_index
        entry = _Entry(out_tree=traced.out_tree, jit_original=jax.jit(traced.flat_fn),
                       kinds=kinds, array_index=array_index)
        # jax.jit of the user's function can run it: every leaf an array (static arguments
        # are hashable, as the signature's key requires)
        entry.all_arrays = len(array_index) == traced.n_flat
        entry.key_leaves = traced.key_leaves
        inputs_at = {i for i, k in zip(array_index, kinds, strict=True) if k == "input"}
        entry.same_object = [i for i in range(traced.n_flat) if i not in inputs_at]
        entry.input_signature = [(i, _leaf_signature(x)) for i, x, k in
                                 zip(array_index, traced.leaves, kinds, strict=True)
                                 if k == "input"]
        t0 = time.perf_counter()
        try:
            # The first call may come from inside jax.jit, grad or vmap of this function: the
            # search's timings and the output check run on concrete arrays, not staged out.
            # A concrete call needs no such context, and its jitted stages and the original
            # compiled under it would be compiled again for the calls that follow (jax.jit
            # keys its cache by that context too: 0.9 s more on a Llama block's next call).
            staged_out = any(_is_tracer(x) for x in traced.leaves) or _tracing()
            with jax.ensure_compile_time_eval() if staged_out else contextlib.nullcontext():
                self._optimize(entry, traced, args, static_pos)
        except Exception as e:  # anything in our pipeline: fall back, never a wrong answer
            if _rule_file_error(e, self.options.substitutions):
                raise  # the caller's own setting, as a bad argnum is: not ours to hide
            entry.fallback = f"{type(e).__name__}: {e}"
            warnings.warn(f"taso_jax.optimize({_fn_name(fn)}): falling back to jax.jit "
                          f"of the original function ({entry.fallback})",
                          RuntimeWarning, stacklevel=3)
        if entry.original_run is not None:  # whatever the outcome, the reference goes
            entry.original_run.release()
        entry.optimize_seconds = time.perf_counter() - t0
        entry.first_call = {"trace": trace_s, **entry.first_call,
                            "total": trace_s + entry.optimize_seconds}
        return entry

    def _optimize(self, entry, traced: TracedFunction, args, static_pos):
        """The first call's pipeline for ``entry``: import, search, stage, check, time.

        Each step fills ``entry``; one that decides the original runs sets
        ``original_kept`` and ends it (:meth:`_kept_before_check`). Seconds per step go to
        ``entry.first_call``.
        """
        lap = _Laps(entry.first_call)
        # one deadline for the import and the search (the trace is jax.jit's own work)
        deadline = Deadline.start(self.options.time_limit)
        try:
            graph = traced.to_graph(_fn_name(self.fn), deadline=deadline)
        except ImportTimeLimit as e:  # a huge function: jax.jit of it, never stored
            lap("import")
            entry.original_kept = (f"{_PAST_LIMIT}: {e} (time limit "
                                   f"{self.options.time_limit:g} s)")
            entry.report = {"model": _fn_name(self.fn), "imported": False,
                            "time_limit": self.options.time_limit, "out_of_time_in": "import",
                            "original_kept": entry.original_kept}
            return
        made = time.perf_counter()
        optimizer = self._optimizer(deadline)
        if not _proves_rule_file(self.options):
            # reading the rules (once per function, 1-3 s for the shipped set) is not the
            # import's or the search's time: the deadline moves by what it took
            made = time.perf_counter() - made
            deadline = Deadline(deadline.at + made, deadline.seconds)
        key = graph_cache.cache_key(graph, self._cache_parts(optimizer.rules))
        lap("import")
        hit = graph_cache.load(key, graph)
        # another process's entry is checked on its first use here (see _check)
        unchecked_hit = (hit is not None and self.check
                         and not graph_cache.checked(key, hit[0], graph))
        if (hit is None and (self.check or self.options.end_to_end > 0)) or unchecked_hit:
            original = self._original_call(entry, traced, args, static_pos)
            if original is not None:  # compiled while the search runs, or the stages compile
                entry.original_run = OriginalRun(*original)
        reserve = (first_call_reserve(entry.original_run, optimizer, graph)
                   if entry.original_run is not None and hit is None
                   and self.options.end_to_end > 0 else None)
        if reserve is not None:  # what the search must leave, as guessed when it starts
            entry.reserved_s = reserve()
        result = self._search_or_hit(entry, optimizer, graph, hit, deadline, traced.leaves,
                                     reserve)
        lap(SEARCH_STAGE)
        weight_index = self._stage(entry, graph, result, traced, args, static_pos, hit)
        entry.report = self._first_report(entry, graph, result, optimizer.rules, weight_index)
        if self._kept_before_check(entry, graph, result, hit, key):
            return
        try:
            self._check(entry, traced, args, static_pos, result, hit, key)
        except _Fallback:
            if hit is not None:  # another process's entry that this one will not use
                graph_cache.drop(key)
            raise
        if entry.report.get("check", {}).get("ok"):
            graph_cache.mark_checked(key, result.graph, graph)
        lap("compile and check")
        if hit is not None:
            entry.original_kept = None  # the earlier process measured the optimized faster
        else:
            entry.original_kept = self._keep_original(entry, traced, result, args, static_pos,
                                                      deadline)
            lap("timing against jax.jit")
            if "baseline" in entry.report or self.options.end_to_end == 0:  # timed
                graph_cache.store(key, result.graph, graph, {
                    "cost_before": result.cost_before, "cost_after": result.cost_after,
                    "applied": dict(result.applied), "original_kept": entry.original_kept,
                    "full_precision": entry.full_precision,
                    "check": _stored_check(entry.report.get("check"))})
        entry.report["original_kept"] = entry.original_kept

    def _search_or_hit(self, entry, optimizer, graph, hit, deadline, leaves,
                       reserve=None) -> SearchResult:
        """The search's result, or the graph cache's entry ``hit`` as one.

        The search ends ``reserve()`` seconds before ``deadline``
        (:func:`~taso_jax.first_call_budget.first_call_reserve`).
        """
        if hit is not None:
            optimized, info = hit
            entry.cache_hit = True
            return SearchResult(graph=optimized, cost_before=info.get("cost_before", 0.0),
                                cost_after=info.get("cost_after", 0.0),
                                applied=info.get("applied", Counter()), iterations=0,
                                explored=0, seconds=0.0, stopped="graph cache")
        # The end-to-end choice screens only: the one comparison that decides is
        # _keep_original's, against jax.jit of the function, except under a transformation,
        # where nothing concrete can be timed against it.
        return optimizer.search(graph, deadline, confirm=any(_is_tracer(x) for x in leaves),
                                reserve=reserve)

    def _stage(self, entry, graph, result, traced: TracedFunction, args, static_pos,
               hit) -> dict:
        """Split the result into its weight and runtime stages and compile them.

        Returns the weight leaves' positions by weight name (the others are constants of
        the function, held in ``entry.constants``).
        """
        staged = StagedGraph(result.graph)
        weight_index = {p: j for j, p in enumerate(
            p for p, k in zip(traced.paths, traced.kinds, strict=True) if k == "weight")}
        entry.weight_slots = [weight_index.get(name, name) for name in staged.weight_names]
        entry.constants = {name: result.graph.weights[name] for name in staged.weight_names
                           if name not in weight_index}
        entry.graph, entry.result, entry.staged = graph, result, staged
        entry.donated = self._donated_inputs(traced, args, static_pos)
        _compile_stages(entry, bool(hit is not None and hit[1].get("full_precision")))
        return weight_index

    def _first_report(self, entry, graph, result, rules, weight_index: dict) -> dict:
        """The report of the first call's search (:func:`~taso_jax.records.search_report`).

        It adds the work computed once that ``jax.jit`` of the function computes on every
        call (``folded``).
        """
        notes = []
        if graph.meta.get("opaque"):
            notes.append("kept as opaque equations: " + ", ".join(
                f"{k} x{v}" for k, v in sorted(graph.meta["opaque"].items())))
        if entry.cache_hit:
            notes.append("optimized graph and decision read from the graph cache "
                         f"({graph_cache.graph_cache_dir()}); no search was run")
        report = search_report(_fn_name(self.fn), graph, result, self.options, rules, notes)
        # jax.jit of the function, the baseline, computes these on every call
        report["folded"] = folded_work(result.graph, weights=set(weight_index))
        return report

    def _kept_before_check(self, entry, graph, result, hit, key) -> bool:
        """Whether the original runs with no check or timing (``original_kept`` set).

        A decision stored in the graph cache; the time limit passed before the end-to-end
        choice began (3 s and 8 s more of compile, check and timing on a 120 ms stax ResNet
        skipped, never stored: a later process, its kernel costs cached, may get further);
        or nothing to run that jax.jit of the original does not (stored).
        """
        if hit is not None and hit[1].get("original_kept"):
            entry.original_kept = hit[1]["original_kept"] + " (decided earlier; graph cache)"
        elif (hit is None and self.options.end_to_end > 0
              and result.out_of_time_in in _BEFORE_CHOICE):
            reserved = entry.reserved_s
            if reserved is not None and reserved > self.options.time_limit:
                # the search was given no time: no comparison could end within the limit
                entry.original_kept = (
                    f"{_PAST_LIMIT}: compiling, checking and comparing it once needs about "
                    f"{reserved:.0f} s here (its calls priced or timed), more than the time "
                    f"limit ({self.options.time_limit:g} s) holds")
            else:
                entry.original_kept = (f"{_PAST_LIMIT}: the "
                                       f"time limit ({self.options.time_limit:g} s) had passed "
                                       f"after the search (in: {result.out_of_time_in})")
        elif hit is None and _nothing_to_run(graph, result):
            # the staged graph would run what jax.jit of the original runs
            entry.original_kept = _KEPT_INPUT
            if not result.out_of_time_in:
                graph_cache.store(key, result.graph, graph, {
                    "cost_before": result.cost_before, "cost_after": result.cost_after,
                    "applied": {}, "original_kept": entry.original_kept,
                    "full_precision": False, "check": None})
        else:
            return False
        entry.report["original_kept"] = entry.original_kept
        if entry.original_run is not None:  # the original runs now: its compile, no call
            entry.original_run.cancel()
        return True

    def _check(self, entry, traced: TracedFunction, args, static_pos, result, hit,
               key: str) -> None:
        """The output check against ``jax.jit`` of the function (``entry.report["check"]``).

        A graph read from the graph cache (under ``key``) is checked on its first use in
        this process: the file's digest is no proof that the process that stored it checked
        this graph (it may have been edited and its digest computed again). Once this
        process has checked or stored it (:func:`~taso_jax.frontends.graph_cache.checked`),
        a hit is not checked again unless ``check="always"``. Otherwise the
        optimized stages run on the call's values (random ones for tracers) and are compared
        with the original's outputs (:func:`~taso_jax.checks.compare_outputs`); where they
        differ on a device whose default precision rounds, the original's own rounding noise
        (:func:`_rounding_noise`) widens the tolerance, and failing that the stages run at
        full float32 precision if that matches.

        First, whatever ``check`` says (a cached graph met other weights), a weight computed
        ahead of time that overflows from the call's finite weights falls back
        (:func:`~taso_jax.ir.fold_check.fold_overflow`, ``entry.report["fold_check"]``).

        Raises:
            _Fallback: the outputs differ, or a pre-folded weight overflowed.
        """
        overflow = self._fold_overflow(entry, traced)
        if overflow is not None:
            entry.report["fold_check"] = overflow.to_json()
            raise _Fallback(str(overflow))
        stored = (hit[1].get("check") or {}) if hit is not None else {}
        first_use = hit is not None and not graph_cache.checked(key, result.graph, entry.graph)
        if self.check is True and stored.get("ok") is True and not first_use:
            entry.report["check"] = {**stored,
                                     "reference": "jax.jit of the original function, earlier "
                                                  "in this process (the process that stored "
                                                  "the graph cache entry, or its first use)"}
            entry.folded_for = ()
            return
        if not self.check:
            return
        check = self._compare_with_original(entry, traced, args, static_pos)
        check["reference"] = ("jax.jit of the original function, on the graph cache entry's "
                              "first use in this process" if first_use else
                              "jax.jit of the original function")
        entry.report["check"] = check
        if not check["ok"] and hit is not None:
            raise _Fallback(f"the graph cache entry {key[:12]} gives outputs that differ from "
                            f"the original's (max abs error {check['max_abs_err']:.3g}): it was "
                            f"edited or is stale; it was removed")
        if not check["ok"]:
            raise _Fallback(f"optimized outputs differ from the original's (max abs error "
                            f"{check['max_abs_err']:.3g}); substitutions applied: "
                            f"{sorted(result.applied)}")
        entry.folded_for = ()

    def _fold_overflow(self, entry, traced: TracedFunction):
        """:func:`~taso_jax.ir.fold_check.fold_overflow` on the call's weights.

        ``None`` where one is traced: no values to check.
        """
        from taso_jax.ir.fold_check import fold_overflow

        ws = [x for x, k in zip(traced.leaves, traced.kinds, strict=True) if k == "weight"]
        if any(_is_tracer(x) for x in ws):
            return None
        values = {name: entry.constants[slot] if isinstance(slot, str) else ws[slot]
                  for name, slot in zip(entry.staged.weight_names, entry.weight_slots,
                                        strict=True)}
        return fold_overflow(entry.result.graph, entry.graph, values)

    def _compare_with_original(self, entry, traced: TracedFunction, args, static_pos) -> dict:
        """The optimized stages' outputs against the original's, under :meth:`_check`'s policy.

        The stages may be left compiled at full precision.
        """
        leaves, kinds = traced.leaves, traced.kinds
        rng = np.random.default_rng(0)
        values = [rng.standard_normal(np.shape(x)).astype(jnp.result_type(x))
                  if _is_tracer(x) else x for x in leaves]
        weights = [v for v, k in zip(values, kinds, strict=True) if k == "weight"]
        inputs = [v for v, k in zip(values, kinds, strict=True) if k == "input"]
        run = entry.original_run
        # with a background run of the original, the stages compile and run while it does
        # (a graph cache hit: nothing else overlaps it)
        early = entry.run(self._folded(entry, weights, True), *inputs) if run else None
        if run is not None and run.join().ok:
            # the background run's outputs: what the timing against it calls, compiled once
            ref = run.outputs
            entry.original_warm = True
        elif entry.all_arrays and not any(_is_tracer(x) for x in leaves):
            # jax.jit of the function itself, as the timing against it calls it: one
            # compile of the original serves both
            ref = jax.tree_util.tree_leaves(self._user_jit(static_pos)(*args))
            entry.original_warm = True
        else:
            ref = jax.tree_util.tree_leaves(entry.jit_original(*values))
        ref = [np.asarray(x) for x in ref]
        floor, noise = None, []

        def compare() -> dict:
            nonlocal early
            got = (early if early is not None else
                   entry.run(self._folded(entry, weights, True), *inputs))
            early = None
            check = compare_outputs([np.asarray(x) for x in got], ref, floor=floor)
            if floor is not None:
                check.update(rounding_noise=max(noise), noise_margin=NOISE_MARGIN)
            return check

        check = compare()
        rounds = not check["ok"] and _default_precision_rounds()
        if rounds:
            noise = _rounding_noise(traced.flat_fn, values, ref)
            if any(noise):
                floor = [NOISE_MARGIN * n for n in noise]
                check = compare()
        if rounds and not check["ok"] and not entry.full_precision:
            # At the default precision a GPU may round the optimized graph's products to
            # TF32 where the original's ran in full float32: cuBLAS multiplies a 1x512 row
            # by a 512x512 matrix in float32, and by the 512x4096 matrix of eight merged
            # ones with TF32 tensor cores (NasRNN on an H200: 1.3e-3 from jax.jit of the
            # original, whose own rounding noise was 0). The optimized graph then runs with
            # its products at full precision if that matches.
            _compile_stages(entry, True)
            again = compare()
            if again["ok"]:
                return {**again, "full_precision": True}
            _compile_stages(entry, False)  # the report keeps the default precision's
        return check

    def _optimizer(self, deadline: Deadline):
        """The :class:`~taso_jax.optimizer.Optimizer` of this function's options, made once.

        A rule file's proofs (``substitutions=FILE`` without ``trust_proofs``) run under the
        first call's ``deadline``, with at most its ``rule_proofs`` share, as on the command
        line. Where they were cut, the optimizer is not kept: the next signature's first call
        goes on with the proofs from where these stopped (their checkpoint).
        """
        from taso_jax.optimizer import Optimizer

        if self._optimizer_made is not None:
            return self._optimizer_made
        shipped = self.options.substitutions is None
        made = Optimizer(self.options, rules=_shipped_rules() if shipped else None,
                         deadline=deadline if _proves_rule_file(self.options) else None)
        if "not_proved_in_time" not in made.rule_counts:
            self._optimizer_made = made
        return made

    def _donated_inputs(self, traced: TracedFunction, args, static_pos) -> tuple[int, ...]:
        """Positions, among the runtime stage's arguments, of the donated input leaves."""
        donate_pos = self._positions.get(len(args), (set(), set(), set()))[2]
        if not donate_pos:
            return ()
        arg_of_flat = [i for i, a in enumerate(args) if i not in static_pos
                       for _ in jax.tree_util.tree_leaves(a)]
        inputs = [j for j, k in zip(traced.array_index, traced.kinds, strict=True)
                  if k == "input"]
        # run(consts, *inputs): input k is argument k + 1
        return tuple(k + 1 for k, j in enumerate(inputs) if arg_of_flat[j] in donate_pos)

    def _cache_parts(self, subs) -> list[str]:
        """What besides the graph an optimized graph depends on (the graph cache's key)."""
        o = self.options
        rules = hashlib.sha256(" ".join(sorted(s.id for s in subs)).encode()).hexdigest()
        settings = (f"alpha={o.alpha} budget={o.budget} time_limit={o.time_limit} "
                    f"cost={o.cost_model_name} e2e={o.end_to_end} layouts={o.layout_candidates} "
                    f"unverified={o.allow_unverified} check={bool(self.check)} "
                    f"search_revision={SEARCH_REVISION}")
        return [device_name(), jax.__version__, _package_version(), settings, rules]

    def _original_call(self, entry: _Entry, traced: TracedFunction, args,
                       static_pos) -> tuple[Callable, tuple] | None:
        """What the user would run and its arguments, ``(jitted, args)``, or ``None``.

        ``jax.jit`` of the function itself where every leaf is an array (the one that the
        comparison calls); else ``jax.jit`` of the traced function on the array leaves
        (non-array leaves are static, as we treat them). ``None`` under a transformation:
        nothing concrete to call.
        """
        if any(_is_tracer(x) for x in traced.leaves):
            return None
        if entry.all_arrays:
            return self._user_jit(static_pos), tuple(args)
        return entry.jit_original, tuple(traced.leaves)

    def _keep_original(self, entry: _Entry, traced: TracedFunction, result, args,
                       static_pos, deadline: Deadline | None = None) -> str | None:
        """Why ``jax.jit`` of the original function should run instead, or ``None``.

        The baseline is what the user would run: ``jax.jit(fn)(*args)``. With
        ``end_to_end > 0`` it and the optimized function, with this wrapper's own per-call
        work (flattening the arguments, recognizing the weights), are timed in one loop,
        interleaved, on the call's arguments, and the optimized one must be confirmed faster
        by :func:`~taso_jax.search.paired_test.confirm_faster` over :data:`BASELINE_REPEATS`
        rounds, fewer for long calls (:func:`~taso_jax.search.paired_test.rounds_for`; at least
        :data:`MIN_SPEEDUP`; an undecided first loop with the optimized ahead by at least
        half of that is extended, and a "faster" verdict must hold in one more loop unless
        its rounds already spanned :data:`~taso_jax.search.choose.CONFIRM_LOOP_SECONDS`).
        With a ``deadline`` (the first call's time limit) each loop runs as many rounds as
        what is left holds (the first to halfway), at least :data:`CONFIRM_LEAST_ROUNDS`,
        and :data:`SPAN_SECONDS` of rounds need no check loop; where even the least loop
        would pass the deadline by more than :data:`LIMIT_SLACK` of the limit (with the
        original's call as the background run timed it, then as one call alone), nothing is
        timed and the reason starts "checked but not timed".
        This is the first call's one comparison: the end-to-end choice before it only
        screened the candidates (:func:`~taso_jax.search.choose.screen_fastest`), and its
        verdict and rounds are the report's ``"baseline"``. Called under a transformation
        (nothing concrete to time), the choice confirmed its pick against the input graph
        instead, and ``None`` is returned. With ``end_to_end=0``, a graph that the search
        left unchanged and that has no weight-only work to fold runs the original.
        """
        # over 80 lines for its docstring (the contract); the body is 59 lines
        if self.options.end_to_end == 0:
            return _KEPT_INPUT if _nothing_to_run(entry.graph, result) else None
        if any(_is_tracer(x) for x in traced.leaves):
            return None  # called under a transformation: nothing concrete to time
        kinds = traced.kinds
        dyn = tuple(None if i in static_pos else a for i, a in enumerate(args))
        if entry.all_arrays:  # what the user would run: jax.jit of the function itself
            user_jit = self._user_jit(static_pos)

            def original():
                return user_jit(*args)
        else:  # non-array leaves (a string in a config dict) are static, as we treat them
            leaves = traced.leaves

            def original():
                return entry.jit_original(*leaves)

        def optimized():  # what a call that hits the signature cache does
            flat, _ = jax.tree_util.tree_flatten(dyn)
            return self._execute(entry, [flat[i] for i in entry.array_index], kinds, True)

        # Rounds to fit the call's length: 25 rounds of half-second calls would take 25 s.
        # Both functions were compiled and run by the output check where it called jax.jit
        # of the function itself: one warm-up call before the first loop, none after it.
        warm = entry.original_warm
        run = entry.original_run
        call = _original_call_seconds(run, original, warm, deadline)
        least = 2 * (CONFIRM_LEAST_ROUNDS + 2) * call  # seconds of the least loop
        rounds = rounds_for(call, CONFIRM_LOOP_SECONDS, CONFIRM_MIN_ROUNDS, BASELINE_REPEATS)
        if deadline is not None and least > deadline.left() + LIMIT_SLACK * deadline.seconds:
            entry.report["baseline"] = {"skipped": True, "call_us": call * 1e6,
                                        "device": device_name()}
            return (f"{_UNTIMED}: one comparison with it needs about {least:.1f} s "
                    f"({CONFIRM_LEAST_ROUNDS} rounds of {call * 1e3:.0f} ms calls), and "
                    f"{max(deadline.left(), 0.0):.1f} s of the time limit "
                    f"({deadline.seconds:g} s) was left")
        loops = []
        # both ran just before (the background run, the output check): no warm-up call
        hot = run is not None and run.ok and entry.original_warm

        def loop():
            # within the time limit, the first loop to halfway, so that a check loop fits
            n = rounds
            if deadline is not None:
                left = deadline.left() / (2.0 if not loops else 1.0)
                n = max(CONFIRM_LEAST_ROUNDS, min(rounds, int(left / (2 * call))))
            loops.append(1)
            first = len(loops) == 1
            return time_interleaved([original, optimized], n,
                                    warmup=(0 if hot else 1 if warm else 2) if first else 0,
                                    call_us=call * 1e6 if hot else None)

        # Rounds spanning SPAN_SECONDS under the time limit (CONFIRM_LOOP_SECONDS without
        # one) cover the drift that a check loop guards against: none is run after them.
        test, ta, tb = confirm_faster(loop, min_speedup=MIN_SPEEDUP,
                                      span_seconds=SPAN_SECONDS if deadline is not None
                                      else CONFIRM_LOOP_SECONDS)
        a, b = float(np.median(ta)), float(np.median(tb))
        entry.report["baseline"] = {"jit_us": a, "optimized_us": b, "repeats": len(ta),
                                    "paired": test, "device": device_name()}
        if test["faster"]:
            return None
        return (f"jax.jit of the original is as fast or faster: {a:.1f} us against {b:.1f} us "
                f"optimized (medians of {len(ta)}, interleaved; the optimized won "
                f"{test['wins']} of {len(ta)} rounds, {test['speedup']:.2f}x)")
