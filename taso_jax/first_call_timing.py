"""The decorator's one timing: the optimized function against ``jax.jit`` of the original.

:func:`keep_original` times both, interleaved, on the call's arguments and says why the
original should run instead, or ``None``; :class:`~taso_jax.traced_source.TracedSource`
gives it to the pipeline as its admission (:meth:`~taso_jax.pipeline.Source.admit`).
:func:`_nothing_to_run` says where a graph left unchanged has too little weight-only work
to gain from: then nothing is compiled, checked or timed. The reasons that start with
:data:`_PAST_LIMIT`, :data:`_UNTIMED` or :data:`_UNDECIDED` are the time limit's, not a
measurement's (:func:`past_limit`). Calls too long for the least signed-rank loop get a
decisive comparison instead (:func:`_decisive`): a few rounds, each won by a wide margin.
"""

from __future__ import annotations

import jax
import numpy as np

from taso_jax.first_call_budget import (
    CONFIRM_LEAST_ROUNDS,
    LIMIT_SLACK,
    SPAN_SECONDS,
)
from taso_jax.frontends.jaxpr_io import TracedFunction
from taso_jax.frontends.signature_entry import _Entry, _is_tracer
from taso_jax.ir.executor import time_function, time_interleaved
from taso_jax.search.choose import CONFIRM_LOOP_SECONDS, CONFIRM_MIN_ROUNDS, device_name
from taso_jax.search.limits import Deadline
from taso_jax.search.paired_test import (
    DECISIVE_ROUNDS,
    DECISIVE_SPEEDUP,
    MIN_SPEEDUP,
    confirm_faster,
    decisive_speedup,
    rounds_for,
)

__all__ = ["keep_original", "past_limit", "settles_on_calls", "BASELINE_REPEATS"]

# The optimized function must beat ``jax.jit`` of the original by MIN_SPEEDUP (the paired
# test's one margin, :data:`taso_jax.search.paired_test.MIN_SPEEDUP`, imported above) and
# pass its signed-rank test. It is read from this module's namespace so that a test can
# raise it for the decorator alone.

#: How ``original_kept`` starts where the time limit passed during the import or the
#: search.
_PAST_LIMIT = "not compiled, checked or timed against jax.jit"
#: How ``original_kept`` starts where the optimized stages were checked but the time limit
#: left no room for the comparison with ``jax.jit``.
_UNTIMED = "checked but not timed against jax.jit"
#: How ``original_kept`` starts where the optimized function led a comparison that the time
#: limit held to a few rounds of long calls, by less than a decisive margin.
_UNDECIDED = "ahead of jax.jit, but not decisively in the rounds the time limit held"
#: The gain the search must price (its cost before over after) for a decisive comparison
#: to be tried: GPT-2 small's merges, priced about 1.07x, would spend two 3 s calls to lose
#: the first round.
PRICED_LEAST = DECISIVE_SPEEDUP
#: Interleaved runs of each when the optimized function is timed against the original.
BASELINE_REPEATS = 25
#: The phases of the search pipeline (``SearchResult.out_of_time_in``) that, cut by the time
#: limit, leave no time for the end-to-end choice: the optimized function is not timed.
_BEFORE_CHOICE = ("import", "search", "second opinions")
#: Why the original runs where the search delivered its input unchanged.
_KEPT_INPUT = "the search changed nothing"


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


def past_limit(kept: str | None) -> bool:
    """Whether ``original_kept`` says the time limit, not a measurement, kept the original."""
    return bool(kept) and kept.startswith((_PAST_LIMIT, _UNTIMED, _UNDECIDED))


def settles_on_calls(kept: str | None) -> bool:
    """Whether the next calls can settle what kept the original (:mod:`taso_jax.call_trial`).

    That is where the optimized stages were compiled and checked and only the time limit
    cut the comparison with ``jax.jit`` (:data:`_UNTIMED`, :data:`_UNDECIDED`).
    """
    return bool(kept) and kept.startswith((_UNTIMED, _UNDECIDED))


def keep_original(host, entry: _Entry, traced: TracedFunction, result, args, static_pos,
                  deadline: Deadline | None = None) -> str | None:
    """Why ``jax.jit`` of the original function should run instead, or ``None``.

    ``host`` is the decorated function (its options, ``_entry_jit`` and ``_execute``).
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
    original's call as the background run timed it, then as one call alone), the
    comparison is the decisive one (:func:`_decisive`: at most
    :data:`~taso_jax.search.paired_test.DECISIVE_ROUNDS` rounds, each won by
    :data:`~taso_jax.search.paired_test.DECISIVE_SPEEDUP`) where the search priced at
    least :data:`PRICED_LEAST` (``result.cost_before / cost_after``); where it priced
    less, or even the decisive comparison does not fit, nothing is timed and the reason
    starts "checked but not timed".
    This is the first call's one comparison: the end-to-end choice before it only
    screened the candidates (:func:`~taso_jax.search.choose.screen_fastest`), and its
    verdict and rounds are the report's ``"baseline"``. Called under a transformation
    (nothing concrete to time), the choice confirmed its pick against the input graph
    instead, and ``None`` is returned. With ``end_to_end=0``, a graph that the search
    left unchanged and that has no weight-only work to fold runs the original.
    """
    # over 80 lines for its docstring (the contract); the body is 59 lines
    if host.options.end_to_end == 0:
        return _KEPT_INPUT if _nothing_to_run(entry.graph, result) else None
    if any(_is_tracer(x) for x in traced.leaves):
        return None  # called under a transformation: nothing concrete to time
    kinds = traced.kinds
    dyn = tuple(None if i in static_pos else a for i, a in enumerate(args))
    if entry.all_arrays:  # what the user would run: jax.jit of the function itself
        user_jit = host._entry_jit(entry, static_pos)

        def original():
            return user_jit(*args)
    else:  # non-array leaves (a string in a config dict) are static, as we treat them
        leaves = traced.leaves

        def original():
            return entry.jit_original(*leaves)

    def optimized():  # what a call that hits the signature cache does
        flat, _ = jax.tree_util.tree_flatten(dyn)
        return host._execute(entry, [flat[i] for i in entry.array_index], kinds, True)

    # Rounds to fit the call's length: 25 rounds of half-second calls would take 25 s.
    # Both functions were compiled and run by the output check where it called jax.jit
    # of the function itself: one warm-up call before the first loop, none after it.
    warm = entry.original_warm
    run = entry.original_run
    call = _original_call_seconds(run, original, warm, deadline)
    least = 2 * (CONFIRM_LEAST_ROUNDS + 2) * call  # seconds of the least loop
    rounds = rounds_for(call, CONFIRM_LOOP_SECONDS, CONFIRM_MIN_ROUNDS, BASELINE_REPEATS)
    # both ran just before (the background run, the output check): no warm-up call
    hot = run is not None and run.ok and entry.original_warm
    warmup = 0 if hot else 1 if warm else 2
    if deadline is not None and least > deadline.left() + LIMIT_SLACK * deadline.seconds:
        return _too_long_for_the_least_loop(entry, result, original, optimized, call,
                                            warmup, least, deadline)
    loops = []

    def loop():
        # within the time limit, the first loop to halfway, so that a check loop fits
        n = rounds
        if deadline is not None:
            left = deadline.left() / (2.0 if not loops else 1.0)
            n = max(CONFIRM_LEAST_ROUNDS, min(rounds, int(left / (2 * call))))
        loops.append(1)
        first = len(loops) == 1
        return time_interleaved([original, optimized], n,
                                warmup=warmup if first else 0,
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


def _too_long_for_the_least_loop(entry: _Entry, result, original, optimized, call: float,
                                 warmup: int, least: float, deadline: Deadline) -> str | None:
    """:func:`keep_original` where its least signed-rank loop (``least`` seconds) cannot fit.

    The decisive comparison (:func:`_decisive`) where the search priced at least
    :data:`PRICED_LEAST` (``result.cost_before / cost_after``) and its rounds, with
    ``warmup`` calls of each first, fit before ``deadline`` plus its slack; else nothing is
    timed, and the reason says which need was not met.
    """
    decisive = 2 * (DECISIVE_ROUNDS + warmup) * call
    priced = result.cost_before / result.cost_after if result.cost_after > 0 else 1.0
    if priced < PRICED_LEAST:  # a decisive margin is not even priced: no timing
        why = f"a decisive one needs {DECISIVE_SPEEDUP:g}x, and the search priced {priced:.2f}x"
    elif decisive <= deadline.left() + LIMIT_SLACK * deadline.seconds:
        return _decisive(entry, original, optimized, call, warmup)
    else:
        why = f"a decisive one {decisive:.1f} s"
    entry.report["baseline"] = {"skipped": True, "call_us": call * 1e6, "device": device_name()}
    return (f"{_UNTIMED}: one comparison with it needs about {least:.1f} s "
            f"({CONFIRM_LEAST_ROUNDS} rounds of {call * 1e3:.0f} ms calls; {why}), and "
            f"{max(deadline.left(), 0.0):.1f} s of the time limit "
            f"({deadline.seconds:g} s) was left")


def _decisive(entry: _Entry, original, optimized, call: float, warmup: int) -> str | None:
    """The comparison of calls too long for the least signed-rank loop, or ``None`` if won.

    Up to :data:`~taso_jax.search.paired_test.DECISIVE_ROUNDS` interleaved rounds, one
    call of each a round (the order swapped every round), stopped at the first round the
    optimized function does not win by :data:`~taso_jax.search.paired_test.
    DECISIVE_SPEEDUP`; it is confirmed faster only if every round did
    (:func:`~taso_jax.search.paired_test.decisive_speedup`). A gain that large is no noise
    of the machine; a smaller one keeps the original, with the time limit as the reason
    where the optimized was ahead (the verdict ``time_limit``: a longer limit might confirm
    it), and the measurement where it was not.
    """
    base: list[float] = []
    cand: list[float] = []
    for r in range(DECISIVE_ROUNDS):
        fns = [original, optimized] if r % 2 == 0 else [optimized, original]
        times = time_interleaved(fns, 1, warmup=warmup if r == 0 else 0, call_us=call * 1e6)
        tb, tc = times if r % 2 == 0 else times[::-1]
        base += tb
        cand += tc
        if tb[0] < DECISIVE_SPEEDUP * tc[0]:
            break  # this round cannot be decisive: the rest would not change the verdict
    test = decisive_speedup(base, cand, DECISIVE_SPEEDUP, DECISIVE_ROUNDS)
    a, b = float(np.median(base)), float(np.median(cand))
    entry.report["baseline"] = {"jit_us": a, "optimized_us": b, "repeats": len(base),
                                "paired": test, "device": device_name()}
    if test["faster"]:
        return None
    if test["speedup"] < MIN_SPEEDUP:
        return (f"jax.jit of the original is as fast or faster: {a:.1f} us against {b:.1f} "
                f"us optimized (medians of {len(base)} rounds of long calls, interleaved; "
                f"{test['speedup']:.2f}x)")
    return (f"{_UNDECIDED}: {len(base)} rounds of {call:.1f} s calls, the least "
            f"{test['least_speedup']:.2f}x, where a comparison this short needs "
            f"{DECISIVE_SPEEDUP:g}x in each of {DECISIVE_ROUNDS}")
