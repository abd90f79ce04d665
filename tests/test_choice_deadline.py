"""The end-to-end choice inside its time limit: a timing loop that cannot reach the rounds a
verdict needs before the deadline is not begun (issue 60, item 7)."""

from __future__ import annotations

import time

import numpy as np
from taso_jax.search import SearchResult
from taso_jax.search.backtracking import Candidate
from taso_jax.search.paired_test import LOOP_LEAST_ROUNDS, loops_fit

import taso_jax
from taso_jax.ir.executor import MIN_ROUNDS, time_interleaved


def test_loops_fit_counts_warm_up_sizing_and_the_least_rounds_of_every_loop():
    now = time.perf_counter()
    rounds = 2 + LOOP_LEAST_ROUNDS  # warm-up, sizing, then the least rounds
    assert loops_fit([1e6, 1e6], 1, None)  # no deadline: anything fits
    # one loop of two 0.1 s calls: 7 rounds of 0.2 s = 1.4 s
    assert loops_fit([1e5, 1e5], 1, now + 0.2 * rounds + 1.0)
    assert not loops_fit([1e5, 1e5], 1, now + 0.2 * rounds - 0.3)
    # a loop and its check loop need twice that; making a candidate comes first
    assert not loops_fit([1e5, 1e5], 2, now + 0.2 * rounds + 1.0)
    assert not loops_fit([1e5, 1e5], 1, now + 0.2 * rounds + 1.0, make_seconds=2.0)
    # a 1.1 s-a-call model against its candidate: 15 s a loop, more than 20 s left can hold
    assert not loops_fit([1.1e6, 1.0e6], 2, now + 20.0)
    assert not loops_fit([0.0, 0.0], 1, now - 1.0)  # past the deadline, not even an empty one


def test_a_loop_past_its_deadline_runs_the_least_rounds_it_is_given():
    calls = []

    def f():
        calls.append(1)
    past = time.perf_counter() - 1.0
    assert [len(t) for t in time_interleaved([f, f], 50, 0, past, min_sample_us=0)] \
        == [MIN_ROUNDS] * 2
    assert [len(t) for t in time_interleaved([f, f], 50, 0, past, min_sample_us=0,
                                             least=LOOP_LEAST_ROUNDS)] \
        == [LOOP_LEAST_ROUNDS] * 2


def _graphs():
    """``x @ a`` and the slower ``x @ a + x @ 0`` on ``x [256, 512]``."""
    b = taso_jax.new_graph(seed=1)
    x = b.new_input((256, 512), name="x")
    b.mark_output(b.matmul(x, b.new_weight((512, 512))), "y")
    b2 = taso_jax.new_graph(seed=1)
    x2 = b2.new_input((256, 512), name="x")
    a2, z2 = b2.new_weight((512, 512)), b2.new_weight(data=np.zeros((512, 512), np.float32))
    b2.mark_output(b2.ewadd(b2.matmul(x2, a2), b2.matmul(x2, z2)), "y")
    return b.graph(), b2.graph()


def test_a_confirmation_that_cannot_end_before_the_deadline_is_not_begun(monkeypatch):
    import taso_jax.search.choose as choose
    import taso_jax.search.head_to_head as head_to_head

    asked = []

    def no_time(calls_us, loops, deadline, make_seconds=0.0):
        asked.append((len(calls_us), loops, deadline))
        return False

    monkeypatch.setattr(head_to_head, "loops_fit", no_time)
    slow, fast = _graphs()[1], _graphs()[0]
    r = SearchResult(slow, 10.0, 5.0, {"fake": 1}, 1, 2, 0.0, "budget",
                     candidates=[Candidate(5.0, fast, ("fake",)), Candidate(10.0, slow, ())],
                     visited=[Candidate(10.0, slow, ()), Candidate(5.0, fast, ("fake",))])
    deadline = time.perf_counter() + 120.0
    e = choose.choose_fastest(r, repeats=15, deadline=deadline)
    # asked once, for a loop and its check loop, of the input and the screened best; no
    # confirmation loop ran: the verdict is the screening rounds' own
    assert asked == [(2, 2, deadline)]
    assert e["paired"] is not None and e["paired"]["rounds"] == e["repeats"]
    assert "loops" not in e["paired"]  # confirm_faster never ran
