"""The comparison the first call's time limit left out, settled on the user's next calls.

Where a decorated function's first call compiled and checked the optimized stages but its
time limit held no comparison with ``jax.jit`` of the original (the reasons that start
"checked but not timed" or "ahead of jax.jit, but not decisively",
:mod:`taso_jax.first_call_timing`), the signature does not give up the graph found: its
next calls run the original and the optimized stages in turn, each timed to its result,
and the two are compared as the first call would have compared them (a one-sided
signed-rank test on the per-pair ratios, :func:`~taso_jax.search.paired_test.paired_speedup`,
at least :data:`~taso_jax.search.paired_test.MIN_SPEEDUP`). The outputs are equal (the
first call's check), so which one runs changes only the time a call takes. Once the test
decides, every later call runs the winner: the optimized stages where they were confirmed
faster, else the original, and the graph cache keeps the decision for the next process.

GPT-2 small at S=1024 (1.1 s calls on 2 cores): its blocked attention was found, priced
1.16x and checked within the 10 s limit, and one comparison needs 17.7 s; timed with a
60 s limit it ran 1.45x faster than ``jax.jit``.

The pairs run in the order original, optimized, then optimized, original (ABBA), so that a
machine growing busier or quieter favours neither. Calls are blocked on their results while
the trial lasts (``jax.block_until_ready``); JAX's asynchronous dispatch returns after it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import numpy as np

from taso_jax.first_call_budget import CONFIRM_LEAST_ROUNDS, SPAN_SECONDS
from taso_jax.search.choose import device_name
from taso_jax.search.paired_test import LOOK_AGAIN_FROM, MIN_SPEEDUP, paired_speedup

__all__ = ["CallTrial", "TRIAL_MOST_PAIRS"]

#: Pairs of calls (one of each function) a trial runs at most; undecided after them, the
#: original runs from then on (never slower). 25 pairs of GPT-2 small's 1.1 s calls are a
#: minute of the user's calls.
TRIAL_MOST_PAIRS = 25


@dataclass
class CallTrial:
    """The trial of one signature: the per-call times (seconds) of each function, pairwise.

    ``reason`` is why the first call ran the original (the time limit's words), kept as the
    verdict if the trial ends undecided. ``store`` (optional) records the decision in the
    graph cache: called with ``None`` (optimized) or the reason the original runs.
    """

    reason: str
    store: Callable[[str | None], None] | None = None
    original: list[float] = field(default_factory=list)
    optimized: list[float] = field(default_factory=list)
    calls: int = 0

    def original_next(self) -> bool:
        """Whether the next call runs the original (pairs in ABBA order)."""
        pair, second = divmod(self.calls, 2)
        return (pair % 2 == 0) != bool(second)

    def run(self, original: Callable, optimized: Callable):
        """One of the user's calls: the function whose turn it is, timed to its result.

        ``optimized`` must have done its per-weight work (folding) before it is passed:
        what is timed is what a call that hits the signature's cache runs.
        """
        which = self.original_next()
        t0 = time.perf_counter()
        out = jax.block_until_ready((original if which else optimized)())
        (self.original if which else self.optimized).append(time.perf_counter() - t0)
        self.calls += 1
        return out

    def test(self) -> dict:
        """:func:`~taso_jax.search.paired_test.paired_speedup` on the complete pairs so far."""
        n = min(len(self.original), len(self.optimized))
        return paired_speedup(self.original[:n], self.optimized[:n], MIN_SPEEDUP)

    def verdict(self) -> str | None:
        """``"optimized"``, ``"original"`` or ``None`` (not yet decided) after this call.

        Decided only on complete pairs, at least
        :data:`~taso_jax.first_call_budget.CONFIRM_LEAST_ROUNDS` of them: the optimized
        stages where the test says faster and the pairs span at least
        :data:`~taso_jax.first_call_budget.SPAN_SECONDS` (the drift a second loop would
        guard against) or, for shorter calls, twice as many pairs were run and the later
        half of them was ahead too; the original where the median gain is under halfway to
        the margin (:data:`~taso_jax.search.paired_test.LOOK_AGAIN_FROM`, as the first
        call's loop stops looking) or after :data:`TRIAL_MOST_PAIRS` pairs.
        """
        n = min(len(self.original), len(self.optimized))
        if self.calls % 2 or n < CONFIRM_LEAST_ROUNDS:
            return None
        test = self.test()
        span = sum(self.original[:n]) + sum(self.optimized[:n])
        if test["faster"] and span >= SPAN_SECONDS:
            return "optimized"
        if test["faster"] and n >= 2 * CONFIRM_LEAST_ROUNDS:  # short calls: the later half
            later = paired_speedup(self.original[n // 2:n], self.optimized[n // 2:n])
            if later["speedup"] > 1.0:  # ahead there too, as the first call's check loop
                return "optimized"
        if test["speedup"] <= MIN_SPEEDUP ** LOOK_AGAIN_FROM or n >= TRIAL_MOST_PAIRS:
            return "original"
        return None

    def baseline(self) -> dict:
        """The report's ``"baseline"`` entry for the trial (times in microseconds)."""
        n = min(len(self.original), len(self.optimized))
        return {"jit_us": float(np.median(self.original[:n])) * 1e6,
                "optimized_us": float(np.median(self.optimized[:n])) * 1e6,
                "repeats": n, "paired": self.test(), "on_calls": self.calls,
                "device": device_name()}

    def original_kept(self, verdict: str) -> str | None:
        """Why the original runs after ``verdict`` (``None``: the optimized stages run)."""
        if verdict == "optimized":
            return None
        test = self.test()
        if test["speedup"] <= MIN_SPEEDUP ** LOOK_AGAIN_FROM:
            return (f"jax.jit of the original is as fast or faster on the calls after the "
                    f"first: the optimized won {test['wins']} of {test['rounds']} pairs, "
                    f"{test['speedup']:.2f}x")
        return (f"{self.reason}; the calls after the first did not decide either "
                f"({test['rounds']} pairs, {test['speedup']:.2f}x, p={test['p_value']:.2g})")


def trial_call(host, entry, args, leaves, static_pos):
    """One call of a signature on trial: its result, and the trial settled when it decides.

    ``host`` is the :class:`~taso_jax.decorator.OptimizedFunction`, ``entry`` the
    signature's ``_Entry`` (its ``trial`` set), ``args`` the bound arguments and ``leaves``
    their array leaves. The original runs as the first call's check ran it (``jax.jit`` of
    the function, already compiled), the optimized stages as the decorator calls them
    (``_staged``), their weights folded before the clock starts.
    """
    from taso_jax.frontends.jaxpr_io import leaves_for_call

    trial = entry.trial
    if entry.all_arrays:
        jitted = host._entry_jit(entry, static_pos)

        def original():
            return jitted(*args)
    else:
        def original():
            return entry.jit_original(*leaves_for_call(leaves, entry.key_leaves))

    optimized = None if trial.original_next() else host._staged(entry, leaves, entry.kinds,
                                                                 True)
    out = trial.run(original, optimized)
    verdict = trial.verdict()
    if verdict is not None:
        _settle(host, entry, verdict, static_pos, len(args))
    return out


def _settle(host, entry, verdict: str, static_pos, n_args: int) -> None:
    """Every later call of ``entry``'s signature runs the trial's winner.

    The entry's ``original_kept``, report (``baseline``: the trial's pairs) and
    :class:`~taso_jax.outcome.Outcome` are made again (verdict
    :attr:`~taso_jax.outcome.Verdict.REWRITTEN`, or
    :attr:`~taso_jax.outcome.Verdict.UNCHANGED`: measured), the graph cache stores the
    decision, and the compiled original goes where the first call would have put it.
    """
    from dataclasses import replace

    from taso_jax.outcome import Verdict, _thawed

    trial, entry.trial = entry.trial, None
    kept = trial.original_kept(verdict)
    entry.original_kept = kept
    entry.report["baseline"] = baseline = trial.baseline()
    entry.report["original_kept"] = kept
    outcome = entry.outcome
    if outcome is not None:
        report = {k: v for k, v in _thawed(outcome.report).items()
                  if k not in ("kept_input_because", "baseline", "original_kept")}
        report.update(baseline=baseline, original_kept=kept)
        if kept is None:
            entry.outcome = replace(outcome, verdict=Verdict.REWRITTEN, report=report,
                                    graph=entry.result.graph, why=None)
        else:
            entry.outcome = replace(outcome, verdict=Verdict.UNCHANGED,
                                    report={**report, "kept_input_because": kept}, why=kept)
    if trial.store is not None:  # graph_cache.store: an unwritable cache stores nothing
        trial.store(kept)
    host._hand_over_original(entry, static_pos, n_args)
