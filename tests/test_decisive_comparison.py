"""The decisive comparison: calls too long for the signed-rank loop, confirmed by a wide margin.

A first call whose least comparison with ``jax.jit`` (6 rounds and warm-ups) cannot fit its
time limit compares a few rounds instead, each of which the optimized function must win by
``DECISIVE_SPEEDUP`` (sliding-window attention at S=4096: 1.5 s calls of the original on the
2-core CPU). The test, the first call's sizing of it and the verdicts it gives.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from taso_jax.search.paired_test import DECISIVE_ROUNDS, DECISIVE_SPEEDUP, decisive_speedup

import taso_jax

OPTS = {"cost_model": "analytic", "budget": 20, "time_limit": 60.0, "end_to_end": 2}


def test_every_round_must_clear_the_margin():
    wide = decisive_speedup([3.0, 3.1, 2.9], [1.0, 1.0, 1.1])
    assert wide["faster"] and wide["rounds"] == 3 and wide["wins"] == 3
    assert wide["least_speedup"] == pytest.approx(2.9 / 1.1)
    assert wide["p_value"] is None and wide["decisive"] == DECISIVE_SPEEDUP
    one_close = decisive_speedup([3.0, 1.4, 3.0], [1.0, 1.0, 1.0])
    assert not one_close["faster"] and one_close["least_speedup"] == pytest.approx(1.4)
    assert one_close["speedup"] == pytest.approx(3.0)


def test_too_few_rounds_or_a_broken_time_decide_nothing():
    assert not decisive_speedup([3.0, 3.0], [1.0, 1.0])["faster"]  # 2 of 3 rounds
    assert decisive_speedup([3.0, 3.0], [1.0, 1.0], rounds=2)["faster"]
    assert not decisive_speedup([3.0, 3.0, 3.0], [1.0, 0.0, 1.0])["faster"]
    assert not decisive_speedup([], [])["faster"]
    assert not decisive_speedup([3.0, 3.0, 3.0], [1.0, 1.0, 1.0], ratio=3.5)["faster"]


def _merge_cell():
    @taso_jax.optimize(weight_argnums=0, **OPTS)
    def cell(w, x):
        return x @ w["a"] + x @ w["b"]

    return cell, {"a": jnp.ones((64, 64)), "b": jnp.ones((64, 64))}


def _no_least_loop(monkeypatch, ratio: float, priced: float = 0.0):
    import taso_jax.first_call_timing as first_call_timing

    # the signed-rank loop never fits the limit; the decisive one (a few calls) does
    monkeypatch.setattr(first_call_timing, "CONFIRM_LEAST_ROUNDS", 10**9)
    monkeypatch.setattr(first_call_timing, "DECISIVE_SPEEDUP", ratio)
    monkeypatch.setattr(first_call_timing, "PRICED_LEAST", priced)


def test_a_decisive_win_is_delivered(monkeypatch):
    """With a margin every round clears, the optimized function is delivered and the
    report's baseline holds the decisive test's rounds."""
    _no_least_loop(monkeypatch, 1e-9)
    cell, w = _merge_cell()
    np.testing.assert_allclose(cell(w, jnp.ones((8, 64))), 128.0, rtol=1e-6)
    if cell.optimized_graph.key == cell.graph.key:
        pytest.skip("the search left the cell unchanged: nothing to compare")
    base = cell._last.report["baseline"]
    assert base["paired"]["faster"] and base["paired"]["decisive"] == 1e-9
    assert base["repeats"] == DECISIVE_ROUNDS
    assert cell.original_kept is None
    assert cell.outcome().verdict.value == "rewritten"


def test_a_margin_no_round_clears_keeps_the_original_after_one_round(monkeypatch):
    """A round short of the margin ends the comparison: the original runs, and the reason
    says either the measurement (not ahead) or the limit (ahead, not decisively)."""
    _no_least_loop(monkeypatch, 1e9)
    cell, w = _merge_cell()
    np.testing.assert_allclose(cell(w, jnp.ones((8, 64))), 128.0, rtol=1e-6)
    if cell.optimized_graph.key == cell.graph.key:
        pytest.skip("the search left the cell unchanged: nothing to compare")
    base = cell._last.report["baseline"]
    assert base["repeats"] == 1 and not base["paired"]["faster"]
    kept = cell.original_kept
    if base["paired"]["speedup"] >= 1.03:
        assert kept.startswith("ahead of jax.jit, but not decisively")
        assert cell.outcome().verdict.value == "time_limit"
    else:
        assert kept.startswith("jax.jit of the original is as fast or faster")
        assert cell.outcome().verdict.value == "unchanged"


def test_a_gain_not_priced_decisive_is_not_timed(monkeypatch):
    """Where the search priced less than a decisive margin, no round is spent: the original
    runs untimed, and the reason gives the priced gain."""
    _no_least_loop(monkeypatch, 1e-9, priced=1e9)
    cell, w = _merge_cell()
    np.testing.assert_allclose(cell(w, jnp.ones((8, 64))), 128.0, rtol=1e-6)
    if cell.optimized_graph.key == cell.graph.key:
        pytest.skip("the search left the cell unchanged: nothing to compare")
    assert cell._last.report["baseline"]["skipped"]
    assert "and the search priced" in cell.original_kept
    assert cell.outcome().verdict.value == "time_limit"


def test_the_reserve_sizes_the_decisive_comparison_where_the_least_cannot_fit():
    """The search's reserve: the least loop's need where it fits the limit, else the
    decisive comparison's less the slack the limit allows it."""
    from taso_jax.first_call_budget import LIMIT_SLACK, first_call_reserve

    class Run:
        ok, compile_seconds, call_seconds = True, 1.0, 1.5

    class Optimizer:
        cost_model = None

    class Graph:
        nodes = ()

    full = first_call_reserve(Run, Optimizer, Graph, 60.0)()
    assert full == pytest.approx(1.0 + (1 + 2 * 8) * 1.5)
    short = first_call_reserve(Run, Optimizer, Graph, 10.0)()
    assert short == pytest.approx(1.0 + (1 + 2 * DECISIVE_ROUNDS) * 1.5 - LIMIT_SLACK * 10.0)
    assert short < 10.0 < full
