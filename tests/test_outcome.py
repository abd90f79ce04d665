"""The text report and the JSON report are renderings of one Outcome, and agree (issue 44).

For each kind of outcome (rewritten, unchanged, the faster graph held at the bound sizes
only, the time limit, a fallback), both renderings must tell the same story: which graph is
delivered, the speed-up delivered, whether the input was copied, and the times with units.
"""

from __future__ import annotations

import json
import re

import pytest

import taso_jax
from taso_jax.cli import main
from taso_jax.examples import nasrnn_cells
from taso_jax.optimizer import Optimizer
from taso_jax.outcome import Outcome, Verdict

FOUND_TIME = {"device": "cpu:2 cores", "repeats": 30, "before_us": 2000.0, "after_us": 1156.1,
              "speedup": 1.73}


@pytest.fixture(scope="module")
def searched():
    """A real report: two small NasRNN cells searched under the analytic cost model."""
    graph = nasrnn_cells(hidden=16, steps=1)
    outcome = Optimizer(cost_model="analytic", budget=5, end_to_end=0).run(graph)
    assert outcome.verdict is Verdict.REWRITTEN and outcome.report["applied"]
    return graph, outcome


def _outcome(kind: str, graph, found: Outcome) -> Outcome:
    report = {**found.report, "time": dict(FOUND_TIME), "time_limit": 60.0,
              "wall_seconds": 3.5, "written": "out.onnx"}
    if kind == "rewritten":
        return Outcome(Verdict.REWRITTEN, report, found.graph)
    if kind == "unchanged":
        report["applied"] = {}
        report["time"] = {**FOUND_TIME, "after_us": 2010.0, "speedup": 0.995}
        return Outcome(Verdict.UNCHANGED, {**report, "written_copy_of_input": True}, graph)
    why = {"bound_sizes_only": "the optimized graph runs at the sizes it was optimized at "
                               "only",
           "time_limit": "the time limit had passed after the search",
           "fallback": "RuntimeError: the search broke"}[kind]
    report["written_copy_of_input"] = True
    return Outcome(Verdict(kind), report, graph, why=why)


@pytest.mark.parametrize("kind", ["rewritten", "unchanged", "bound_sizes_only", "time_limit",
                                  "fallback"])
def test_text_and_json_agree_for_every_kind_of_outcome(searched, kind):
    graph, found = searched
    outcome = _outcome(kind, graph, found)
    data = json.loads(json.dumps(outcome.to_json()))  # what --json writes
    text = outcome.to_text()
    head = text.splitlines()[0]
    verdict = data["outcome"]
    assert verdict["verdict"] == kind
    delivered_input = kind != "rewritten"
    assert verdict["delivered"] == ("input" if delivered_input else "optimized")
    # the speed-up delivered: the measured one for a rewrite, exactly 1 for the input
    assert verdict["speedup"] == (1.0 if delivered_input else FOUND_TIME["speedup"])
    assert ("1.73x faster" in head) is (not delivered_input)
    if delivered_input:
        # nothing claimed for the written model that belongs to a graph not delivered
        assert data["applied"] == {}
        assert data["operators_after"] == data["operators_before"]
        assert data["cost"]["after_us"] == data["cost"]["before_us"]
        assert "substitutions applied: none" in text
        assert data.get("time", {}).get("speedup", 1.0) == 1.0
        assert data["written_copy_of_input"] is True
        assert "byte-for-byte copy of the input" in text
        assert data["check"]["identical"] and "output check: not needed" in text
        assert outcome.why is None or outcome.why in head
    else:
        assert data["applied"] == dict(found.report["applied"])
        assert "written_copy_of_input" not in data and "copy of the input" not in text
        for name, n in data["applied"].items():
            assert re.search(rf"{n} x {re.escape(name)}\b", text)
    found_part = data.get("found_not_delivered")
    if kind in ("bound_sizes_only", "time_limit", "fallback"):
        # the faster graph that was found is reported as found, with its own figures
        assert found_part["time"]["speedup"] == FOUND_TIME["speedup"]
        assert "found, not delivered: a graph timed at 1.73x" in text
    else:
        assert found_part is None and "found, not delivered" not in text
    # every time in the JSON is in the text, with its unit
    t = data.get("time")
    if t:
        assert f"{t['before_us']:.1f} us" in text
    assert f"total time: {data['wall_seconds']:.1f} s" in text


@pytest.mark.slow
def test_the_command_line_prints_and_writes_the_same_outcome(tmp_path, capsys):
    report = tmp_path / "r.json"
    assert main(["optimize", "--cost-model", "analytic", "--budget", "5", "-q",
                 "--repeats", "3", "--json", str(report)]) == 0
    text = capsys.readouterr().out
    data = json.loads(report.read_text())
    verdict = data["outcome"]
    assert text.startswith("result: ")
    if verdict["delivered"] == "optimized":
        assert f"{verdict['speedup']:.2f}x faster under jax.jit" in text.splitlines()[0]
        assert data["time"]["speedup"] == verdict["speedup"]
    else:
        assert verdict["speedup"] == 1.0 and "substitutions applied: none" in text
    assert f"{data['time']['before_us']:.1f} us" in text


def test_the_python_api_checks_outputs_and_keeps_the_input_where_they_differ(tmp_path):
    """A wrong rule passed as an object (not proved again) must not reach the user."""
    from taso_jax.search.pattern import PNode
    from taso_jax.search.rules import Substitution

    wrong = Substitution("wrong_drop_tanh", (("a", ("N", "C")),), (PNode("tanh", (), ("a",)),),
                         (), (("#0", "a"),), {"method": "hand-written, deliberately wrong",
                                              "proof": {"status": "proved"}})
    graph = nasrnn_cells(hidden=8, steps=1)
    with pytest.warns(RuntimeWarning, match="outputs differ"):
        result = taso_jax.search_graph(graph, substitutions=[wrong], cost_model="analytic",
                                       budget=3, end_to_end=0, allow_unverified=True)
    assert result.graph is graph and result.outcome.verdict is Verdict.FALLBACK
    assert result.outcome.report["check"]["ok"] is False
    # turned off by name, the check is not made and the wrong graph comes back
    off = taso_jax.search_graph(graph, substitutions=[wrong], cost_model="analytic", budget=3,
                                end_to_end=0, allow_unverified=True, check=False)
    assert off.graph.key != graph.key and "check" not in off.outcome.report


@pytest.mark.parametrize("target", ["xla", "onnxruntime"])
def test_a_rewrite_whose_report_timing_was_left_out_has_the_choice_speedup(searched, target):
    """Issue 59 (a): "result: rewritten" with ``speedup: null`` while the end-to-end choice
    had measured 7.66x: past the time limit (or with ``--no-time``) the report's own timing
    is left out, and the speed-up is the one that decided the rewrite.
    """
    graph, found = searched
    e2e = {"measured": 2, "original_kept": False, "chosen": 1, "times_us": [766.0, 100.0],
           "floors_us": [760.0, 99.0], "estimates_us": [2.0, 1.0], "device": "cpu",
           "repeats": 20, "duel": None,
           "paired": {"speedup": 7.66, "wins": 20, "rounds": 20, "p_value": 1e-5,
                      "faster": True, "candidate": 1}}
    if target == "onnxruntime":
        e2e["runtime"] = "onnxruntime"
    report = {**found.report, "target": target, "end_to_end": e2e}
    report.pop("time", None)
    outcome = Outcome(Verdict.REWRITTEN, report, found.graph)
    assert outcome.speedup == pytest.approx(7.66)
    data = json.loads(json.dumps(outcome.to_json()))
    assert data["outcome"]["speedup"] == pytest.approx(7.66)
    assert data["outcome"]["speedup_measured_by"] == "end-to-end choice"
    runtime = "onnxruntime" if target == "onnxruntime" else "jax.jit"
    assert f"7.66x faster under {runtime} (measured by the end-to-end choice)" in \
        outcome.to_text().splitlines()[0]


PHASES = {"import_s": 0.25, "search_s": 1.5, "second_opinions_s": None, "choice_s": 0.75,
          "check_s": 0.5, "pricing_s": 0.125, "compiles": 12, "compile_s": 0.0625,
          "total_s": 3.5, "cost_model": "measured"}


@pytest.mark.parametrize("kind", ["rewritten", "unchanged", "bound_sizes_only", "time_limit",
                                  "fallback", "error"])
def test_one_record_renders_alike_as_text_and_json_with_its_phases(searched, kind):
    """Issue 59, item 3: the JSON is a dump of the record, the text renders the same
    record: speed-up, delivered graph, copy flag and the per-phase times agree."""
    from taso_jax.outcome import make_outcome
    from taso_jax.records import PhaseTimes

    graph, found = searched
    phases = PhaseTimes(**PHASES)
    if kind == "error":  # the pipeline itself failed, before any search reported
        outcome = make_outcome(Verdict.FALLBACK, {"model": "m", "time_limit": 60.0,
                                                  "wall_seconds": 3.5}, graph,
                               why="RuntimeError: the import broke", phases=phases)
    else:
        base = _outcome(kind, graph, found)
        outcome = make_outcome(base.verdict, base.report, base.graph, why=base.why,
                               phases=phases)
    data = json.loads(json.dumps(outcome.to_json()))
    text = outcome.to_text()
    assert data["phases"] == phases.to_json() == PHASES  # a plain dump
    rewritten = kind == "rewritten"
    assert data["outcome"]["delivered"] == ("optimized" if rewritten else "input")
    assert data["outcome"]["speedup"] == (FOUND_TIME["speedup"] if rewritten else 1.0)
    assert (f"{FOUND_TIME['speedup']:.2f}x faster" in text.splitlines()[0]) is rewritten
    assert bool(data.get("written_copy_of_input")) is (kind not in ("rewritten", "error"))
    assert ("copy of the input" in text) is bool(data.get("written_copy_of_input"))
    line = next(ln for ln in text.splitlines() if ln.startswith("phases"))
    for key in ("import_s", "search_s", "choice_s", "check_s", "pricing_s"):
        assert f"{PHASES[key]:.2f} s" in line
    assert f"{PHASES['compiles']} compiles ({PHASES['compile_s']:.2f} s)" in line
    assert "cost model measured" in line
    assert f"total time: {data['wall_seconds']:.1f} s" in text
