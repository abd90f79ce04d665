"""The time limit covers delivery: the search pipeline ends what the steps after it need
before the limit (issue 60 item 7, issue 58's time limit on deployed models)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from taso_jax.search.choose import COMPARE_CALLS
from taso_jax.search.limits import Deadline
from taso_jax.search.options import _search_stop

from taso_jax.examples import example
from taso_jax.optimizer import Optimizer
from taso_jax.pipeline import GraphSource, deliver


def _ahead(call_seconds: float):
    """A background compile of the input that has timed one call (compile_ahead.compile_ahead)."""
    return SimpleNamespace(seconds=0.0, call_seconds=call_seconds)


def test_the_search_leaves_the_choice_its_comparison_before_the_callers_reserve():
    graph, _ = example("nasrnn")
    need = COMPARE_CALLS * 1.0  # one comparison of calls of a second each
    end = time.perf_counter() + 100.0
    deadline = Deadline(end, 100.0)
    # 100 s left: the choice's need fits before the deadline, and before a reserve of 50 s
    assert not _search_stop(_ahead(1.0), graph, deadline, end, lambda: 50.0)()
    # a reserve leaving less than the comparison needs stops the search, though the
    # pipeline's own deadline is far
    assert _search_stop(_ahead(1.0), graph, deadline, end, lambda: 100.0 - need / 2)()
    # without a reserve only the deadline counts, as before
    assert not _search_stop(_ahead(1.0), graph, deadline, end, None)()
    # with neither a reserve nor a timed input there is no rule
    assert _search_stop(None, graph, deadline, end, None) is None


class _SlowToDeliver(GraphSource):
    def __init__(self, graph, seconds: float):
        super().__init__(graph, "slow to deliver")
        self.seconds = seconds

    def after_search_seconds(self) -> float:
        return self.seconds


def test_delivery_that_needs_the_whole_limit_leaves_the_search_nothing():
    graph, _ = example("nasrnn")
    opt = Optimizer(cost_model="analytic", end_to_end=0, time_limit=30.0)
    free = deliver(opt, _SlowToDeliver(graph, 0.0), Deadline.start(30.0))
    cut = deliver(opt, _SlowToDeliver(graph, 1e6), Deadline.start(30.0))
    assert free.result.iterations > 0
    assert cut.result.iterations == 0


def test_a_built_graphs_check_is_kept_time_for_by_its_size():
    graph, _ = example("nasrnn")
    assert GraphSource(graph).after_search_seconds() > 0.0
    assert GraphSource(graph, check=False).after_search_seconds() == 0.0


def test_the_reports_own_timing_leaves_delivery_its_time():
    from taso_jax.cli_timing import report_timing

    calls = []
    target = SimpleNamespace(times_graphs=True, runtime="jax.jit", timing_key="xla",
                             time_graphs=lambda g, o, r, until: calls.append(until) or {})
    args = SimpleNamespace(repeats=5)
    report = {"notes": []}
    deadline = Deadline.start(10.0)
    report_timing(args, target, None, None, report, deadline, keep=20.0)  # more than is left
    assert not calls and "left out" in report["notes"][0]
    report_timing(args, target, None, None, report, deadline, keep=4.0)
    assert calls and abs(calls[0] - (deadline.at - 4.0)) < 1e-9  # its rounds end there
    # calls of 0.6 s and 0.5 s as the choice timed them: its least rounds (7 of 1.1 s)
    # would not end before the 6 s left to it: left out, the choice's figure stands
    slow = {"notes": [], "end_to_end": {"times_us": [6e5, 9e5, 5e5], "chosen": 2}}
    report_timing(args, target, None, None, slow, deadline, keep=4.0)
    assert len(calls) == 1 and "left out" in slow["notes"][0]
    fast = {"notes": [], "end_to_end": {"times_us": [4e4, 9e4, 3e4], "chosen": 2}}
    report_timing(args, target, None, None, fast, deadline, keep=4.0)
    assert len(calls) == 2 and not fast["notes"]


def test_a_reserve_larger_than_what_the_import_left_blames_the_import():
    """Where the import (or the rule proofs) left less than delivery's reserve, the time
    ran out before the search, not in it."""
    from taso_jax.search.cost import AnalyticCostModel
    from taso_jax.search.options import OptimizeOptions, run_search
    from taso_jax.search.rules import default_substitutions

    graph, _ = example("nasrnn")
    opts = OptimizeOptions(cost_model="analytic", end_to_end=0, time_limit=10.0)
    result = run_search(graph, default_substitutions(), AnalyticCostModel(), opts,
                        deadline=Deadline(time.perf_counter() + 0.5, 10.0),
                        reserve=lambda: 1.0)
    assert result.out_of_time_in == "import"
