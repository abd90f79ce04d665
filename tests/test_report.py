"""taso_jax.report: the output check never passes by a NaN tolerance or a NaN error."""

import math

import numpy as np
import pytest

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
