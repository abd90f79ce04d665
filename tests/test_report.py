"""taso_jax.report: the output check never passes by a NaN tolerance or a NaN error, nor by
a tolerance above the ceiling."""

import math

import numpy as np
import pytest

from taso_jax.checks import MAX_ATOL, MAX_RTOL, check_graphs, check_tolerances
from taso_jax.examples import nasrnn_cells
from taso_jax.optimizer import Optimizer
from taso_jax.report import compare_outputs

REF = [np.array([1.0, 2.0, 3.0], np.float32)]
OFF = [np.array([1.0, 2.5, 3.0], np.float32)]  # far outside any sane tolerance


@pytest.mark.parametrize("kw", [{"rtol": math.nan}, {"atol": math.nan},
                                {"rtol": math.nan, "atol": math.nan},
                                {"floor": [math.nan]}], ids=["rtol", "atol", "both", "floor"])
def test_a_nan_tolerance_never_passes(kw):
    assert not compare_outputs(OFF, REF, **kw)["ok"]
    assert not compare_outputs(REF, REF, **kw)["ok"]  # not even equal outputs


def test_a_nan_where_the_reference_is_finite_fails_and_matching_nans_pass():
    got = [np.array([1.0, math.nan, 3.0], np.float32)]
    r = compare_outputs(got, REF)
    assert not r["ok"] and r["max_abs_err"] == math.inf
    both = [np.array([1.0, math.nan, 3.0], np.float32)]
    assert compare_outputs(both, both)["ok"]  # NaN with NaN at the same place: equal
    assert compare_outputs(OFF, REF, atol=1.0)["ok"]  # the ordinary rule still holds


def test_a_nan_tolerance_fails_even_where_every_value_is_a_matching_nan():
    nans = [np.array([math.nan, math.nan], np.float32)]
    assert compare_outputs(nans, nans)["ok"]
    assert not compare_outputs(nans, nans, rtol=math.nan)["ok"]


def _confirmed_choice(times, speedup, duel=None):
    """An end-to-end choice that kept candidate 2, confirmed by a paired test."""
    return {"measured": 3, "original_kept": False, "chosen": 2, "times_us": times,
            "floors_us": [7000.0, 7400.0, 6100.0], "estimates_us": [1.0, 0.9, 0.8],
            "device": "cpu:2 cores", "repeats": 20, "duel": duel,
            "paired": {"speedup": speedup, "wins": 14, "rounds": 16, "p_value": 0.01,
                       "faster": True, "candidate": 2}}


def test_a_kept_candidate_is_never_worded_as_slower():
    """Issue 59 (e): "kept candidate 2, the fastest confirmed faster (9149 us vs 8139 us
    for the input, 0.89x)" read as keeping a slower graph. Screening medians come from a
    loop of their own; the paired test decides, and the line says so with its own ratio.
    """
    from taso_jax.report import end_to_end_line

    line = end_to_end_line(_confirmed_choice([8139.0, 8500.0, 9149.0], 1.12))
    assert "0.89x" not in line  # no ratio that contradicts the verdict
    assert "kept candidate 2: confirmed faster than the input in a paired test, 1.12x " \
           "faster" in line
    assert "won 14 of 16 rounds" in line
    assert "the input 8139 us, candidate 2 9149 us" in line  # each number named
    assert "the paired test decides" in line
    # screening that agrees with the verdict needs no caveat
    agree = end_to_end_line(_confirmed_choice([8139.0, 8500.0, 7000.0], 1.12))
    assert "the input 8139 us, candidate 2 7000 us" in agree
    assert "paired test decides" not in agree
    # a rival that lost the duel: its ratio against the kept one reads as slower
    duel = {"speedup": 0.97, "wins": 7, "rounds": 16, "faster": False, "candidate": 1,
            "against": 2, "reason": "within"}
    lost = end_to_end_line(_confirmed_choice([8139.0, 8500.0, 7000.0], 1.12, duel))
    assert "0.97x, slower than candidate 2" in lost


def test_candidates_that_could_not_be_exported_are_named_in_the_choice_line():
    from taso_jax.report import end_to_end_line

    e = {**_confirmed_choice([100.0, 90.0, 80.0], 1.2),
         "dropped": ["KeyError: 'ln_bias'"]}
    assert "1 candidate(s) left out, not exportable to ONNX (first: KeyError" in \
        end_to_end_line(e)


@pytest.mark.parametrize("kw", [{"rtol": 0.5}, {"atol": 2.0}, {"atol": 1e308},
                                {"rtol": math.inf}, {"atol": -1.0}, {"rtol": math.nan}],
                         ids=["rtol", "atol", "huge", "inf", "negative", "nan"])
def test_every_api_refuses_a_tolerance_above_the_ceiling(kw):
    """A tolerance so loose that a wrong rewrite (a dropped ReLU) passes is refused with a
    ValueError naming it, by the optimizer, the graph check and the comparison itself."""
    graph = nasrnn_cells(hidden=4, steps=1)
    name = next(iter(kw))
    with pytest.raises(ValueError, match=f"^{name}="):
        Optimizer(cost_model="analytic", budget=1, end_to_end=0).run(graph, **kw)
    with pytest.raises(ValueError, match=f"^{name}="):
        check_graphs(graph, graph, **kw)
    if not math.isnan(next(iter(kw.values()))) and next(iter(kw.values())) > 0:
        with pytest.raises(ValueError, match=f"^{name}="):
            compare_outputs(OFF, REF, **kw)  # a NaN fails closed there (above)


def test_the_ceiling_itself_is_allowed():
    check_tolerances(MAX_RTOL, MAX_ATOL)
    check_tolerances(0.0, None)  # None: the scale-aware default
    assert compare_outputs(REF, REF, rtol=MAX_RTOL, atol=MAX_ATOL)["ok"]
