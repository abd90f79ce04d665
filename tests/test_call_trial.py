"""The comparison the first call's time limit left out, settled on the next calls
(taso_jax.call_trial)."""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np

import taso_jax
from taso_jax.call_trial import TRIAL_MOST_PAIRS, CallTrial

OPTS = {"cost_model": "analytic", "budget": 20, "time_limit": 60.0, "end_to_end": 2}


def _sleeper(seconds: float, tag: str):
    def run():
        time.sleep(seconds)
        return tag
    return run


def _run_until_settled(trial: CallTrial, original, optimized, most: int = 200) -> list:
    outs = []
    while trial.verdict() is None and len(outs) < most:
        outs.append(trial.run(original, optimized))
    return outs


def test_pairs_alternate_in_abba_order():
    trial = CallTrial("untimed")
    order = []
    for _ in range(8):
        order.append("A" if trial.original_next() else "B")
        trial.run(_sleeper(0, "a"), _sleeper(0, "b"))
    assert "".join(order) == "ABBAABBA"
    assert len(trial.original) == len(trial.optimized) == 4


def test_a_faster_optimized_function_is_settled_on_from_short_calls():
    """Calls too short to span the check's seconds need twice the least pairs, and win."""
    trial = CallTrial("untimed")
    outs = _run_until_settled(trial, _sleeper(0.02, "a"), _sleeper(0.008, "b"))
    assert trial.verdict() == "optimized"
    assert 12 <= len(outs) <= 2 * TRIAL_MOST_PAIRS
    assert outs[:4] == ["a", "b", "b", "a"]  # each call returns its own function's result
    assert trial.original_kept("optimized") is None
    base = trial.baseline()
    assert base["paired"]["faster"] and base["jit_us"] > base["optimized_us"]


def test_a_slower_optimized_function_keeps_the_original_after_the_least_pairs():
    trial = CallTrial("checked but not timed against jax.jit: ...")
    outs = _run_until_settled(trial, _sleeper(0.005, "a"), _sleeper(0.015, "b"))
    assert trial.verdict() == "original" and len(outs) == 12  # 6 pairs
    assert trial.original_kept("original").startswith("jax.jit of the original is as fast")


def test_an_undecided_trial_ends_on_the_original_after_its_most_pairs():
    """Ahead by the median, never significantly: the pairs run out and the original stays
    (never slower), with the time limit's reason and the trial's figures."""
    trial = CallTrial("checked but not timed against jax.jit: one comparison needs 17 s")
    ratios = [1.05, 1.05, 0.8] * TRIAL_MOST_PAIRS  # small gains, one large loss in three
    verdicts = []
    for k in range(1, TRIAL_MOST_PAIRS + 1):
        trial.original.append(1.0)
        trial.optimized.append(1.0 / ratios[k - 1])
        trial.calls = 2 * k
        verdicts.append(trial.verdict())
    assert verdicts[:-1] == [None] * (TRIAL_MOST_PAIRS - 1) and verdicts[-1] == "original"
    why = trial.original_kept("original")
    assert why.startswith("checked but not timed") and "did not decide" in why
    trial.calls += 1  # half a pair: never decided on
    assert trial.verdict() is None


def test_the_decorator_settles_an_untimed_first_call_on_the_next_calls(monkeypatch):
    """The first call's comparison cannot fit (the slack made hopeless): the original runs
    it and the next calls compare the two in turn, every output right, until the trial
    decides; the verdict, reason and outcome then agree, and the fast path takes over."""
    import taso_jax.first_call_timing as first_call_timing

    monkeypatch.setattr(first_call_timing, "LIMIT_SLACK", -1e6)  # nothing ever fits

    @taso_jax.optimize(weight_argnums=0, **OPTS)
    def cell(w, x):
        return x @ w["a"] + x @ w["b"]

    w = {"a": jnp.ones((64, 64)), "b": jnp.ones((64, 64))}
    x = jnp.ones((8, 64))
    np.testing.assert_allclose(cell(w, x), 128.0, rtol=1e-6)
    entry = cell._last
    if cell.optimized_graph.key == cell.graph.key:
        return  # nothing found to compare (no trial)
    assert entry.trial is not None and cell.outcome().verdict.value == "time_limit"
    calls = 1
    while entry.trial is not None and calls <= 2 * TRIAL_MOST_PAIRS:
        np.testing.assert_allclose(cell(w, x * calls), 128.0 * calls, rtol=1e-6)
        calls += 1
    assert entry.trial is None, "the trial did not settle within its most pairs"
    base = entry.report["baseline"]
    assert base["on_calls"] == calls and base["repeats"] * 2 == calls
    verdict = cell.outcome().verdict.value
    if cell.original_kept is None:
        assert verdict == "rewritten" and base["paired"]["faster"]
        assert cell.outcome().graph.key == cell.optimized_graph.key
    else:
        assert verdict == "unchanged" and not base["paired"]["faster"]
    np.testing.assert_allclose(cell(w, x), 128.0, rtol=1e-6)  # after it: the winner
    assert (cell._opt_fast is not None) == (cell.original_kept is None)


def test_settle_on_calls_false_keeps_the_time_limits_verdict(monkeypatch):
    import taso_jax.first_call_timing as first_call_timing

    monkeypatch.setattr(first_call_timing, "LIMIT_SLACK", -1e6)

    @taso_jax.optimize(weight_argnums=0, settle_on_calls=False, **OPTS)
    def cell(w, x):
        return x @ w["a"] + x @ w["b"]

    w = {"a": jnp.ones((64, 64)), "b": jnp.ones((64, 64))}
    for _ in range(3):
        np.testing.assert_allclose(cell(w, jnp.ones((8, 64))), 128.0, rtol=1e-6)
    assert cell._last.trial is None
    if cell.optimized_graph.key != cell.graph.key:
        assert cell.original_kept.startswith("checked but not timed")
