"""The backtracking search's runner records what each rule and each expansion did
(issue 59 item 4: egg's per-rule counters and iterations)."""

from __future__ import annotations

from taso_jax.search.backtracking import backtracking_search
from taso_jax.search.cost import AnalyticCostModel
from taso_jax.search.rules import default_substitutions

from taso_jax.examples import example


def test_rule_counters_and_iterations_agree_with_the_search():
    graph, _ = example("nasrnn")
    r = backtracking_search(graph, default_substitutions(), AnalyticCostModel(), budget=20,
                            greedy=False)
    assert r.iterations == len(r.iteration_log) > 0
    # every rewrite queued is counted once, by its rule and by its expansion
    assert sum(s.queued for s in r.rule_stats.values()) == \
        sum(i.queued for i in r.iteration_log)
    assert all(s.matches >= s.queued for s in r.rule_stats.values())
    # a rule on the path to the best graph had rewrites queued (no descent ran first)
    assert r.applied and all(r.rule_stats[name].queued > 0 for name in r.applied)
    # the best cost known never rises from one expansion to the next
    bests = [i.best for i in r.iteration_log]
    assert all(b2 <= b1 for b1, b2 in zip(bests, bests[1:], strict=False))
    assert bests[-1] <= r.cost_before


def test_the_report_names_the_rules_that_queued_most():
    from taso_jax.optimizer import Optimizer
    from taso_jax.pipeline import GraphSource, deliver

    out = deliver(Optimizer(cost_model="analytic", end_to_end=0),
                  GraphSource(example("nasrnn")[0], check=False))
    counters = out.to_json()["search"]["rule_counters"]
    assert counters and all(m > 0 and 0 <= q <= m for m, q in counters.values())
    assert "rules that matched in the backtracking search" in out.to_text()
