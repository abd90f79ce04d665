"""The second opinion priced as written: a search whose cost model priced NCHW convolutions
in NHWC is second-guessed by one that prices them as they are."""

from __future__ import annotations

import math

import numpy as np
from taso_jax.search.backtracking import backtracking_search
from taso_jax.search.calibrated import CalibratedCostModel, Calibration, KernelSample
from taso_jax.search.cost import AnalyticCostModel

import taso_jax

SUBS = taso_jax.default_substitutions()


def _samples(op: str, family: str, rate: float, seed: int) -> list[KernelSample]:
    """Kernels of ``op`` whose time is 2 us plus their FLOPs at ``rate`` GFLOP/s."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(40):
        flops = float(10 ** rng.uniform(5, 9))
        micros = 2.0 + flops / (rate * 1e3)
        out.append(KernelSample(op, family, flops, flops / 8, False, micros, "m",
                                flops / 128))
    return out


def _calibration() -> Calibration:
    """A device where an NCHW convolution runs at 1 GFLOP/s, its NHWC kernel at 400 and a
    pointwise product at 40: priced in NHWC a 1x1 convolution is best left alone, priced
    as written it is best lowered to a product."""
    return Calibration.fit([*_samples("conv2d", "conv", 1.0, 0),
                            *_samples("conv2d_nhwc", "conv", 400.0, 1),
                            *_samples("pointwise_matmul", "pointwise", 40.0, 2)],
                           AnalyticCostModel())


def _pointwise_graph():
    g = taso_jax.new_graph()
    x = g.new_input(dims=(1, 64, 28, 28), name="x")
    w = g.new_weight(dims=(64, 64, 1, 1))
    g.relu(g.conv2d(input=x, weight=w, strides=(1, 1), padding="SAME"))
    return g.graph()


def test_the_search_priced_as_written_adds_the_lowering_nhwc_prices_hid():
    from taso_jax.search.second_opinions import add_as_written_candidate

    g = _pointwise_graph()
    cal = _calibration()
    nhwc = CalibratedCostModel(cache_path=False, calibration=cal, nhwc_convolutions=True)
    result = backtracking_search(g, SUBS, nhwc, budget=20, keep=2)
    assert not any("pointwise" in name for c in result.candidates for name in c.path)
    added = add_as_written_candidate(result, g, SUBS, nhwc, budget=20)
    assert added is not None and result.candidates[-1] is added
    assert "lower-pointwise_matmul" in added.path
    assert added.judged  # timed whatever its NHWC price, which ranks it last
    assert math.isclose(added.cost, nhwc.graph_cost(added.graph))
    assert added.cost > nhwc.graph_cost(g)
    assert result.graph.key == g.key  # the result itself is not changed
    assert add_as_written_candidate(result, g, SUBS, nhwc, budget=20) is None  # already there
    assert nhwc.stats()["compiles"] == 0


def test_no_search_priced_as_written_where_the_search_already_was():
    from taso_jax.search.second_opinions import add_as_written_candidate

    g = _pointwise_graph()
    as_written = CalibratedCostModel(cache_path=False, calibration=_calibration())
    result = backtracking_search(g, SUBS, as_written, budget=20, keep=2)
    assert add_as_written_candidate(result, g, SUBS, as_written, budget=20) is None
    analytic = AnalyticCostModel()
    result = backtracking_search(g, SUBS, analytic, budget=20, keep=2)
    assert add_as_written_candidate(result, g, SUBS, analytic, budget=20) is None


def test_the_search_priced_as_written_takes_the_analytic_search_s_place(monkeypatch):
    """Where the search priced NCHW convolutions in NHWC, the second opinion under another
    pricing is the as-written search; elsewhere it is the analytic one. Either way three
    second opinions run, not four: a fourth took 3-5 s from the choice of 60 s runs."""
    import time

    from taso_jax.search import options
    from taso_jax.search.limits import Deadline

    calls = []
    for name in ("add_as_written_candidate", "add_analytic_candidate",
                 "add_near_tie_candidate", "add_ablation_candidate"):
        monkeypatch.setattr(options, name,
                            lambda *a, _name=name, **k: calls.append(_name))
    cal = _calibration()
    for nhwc in (True, False):
        calls.clear()
        model = CalibratedCostModel(cache_path=False, calibration=cal, nhwc_convolutions=nhwc)
        options.add_second_opinions(None, None, [], model, options.OptimizeOptions(),
                                    Deadline(time.perf_counter() + 60.0, 60.0))
        first = "add_as_written_candidate" if nhwc else "add_analytic_candidate"
        assert calls == [first, "add_near_tie_candidate", "add_ablation_candidate"]
