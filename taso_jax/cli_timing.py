"""The command line's own timings for its report.

The graphs in the target's runtime, and the written file in onnxruntime against the input
file. Both are the report's, not the choice's: the end-to-end choice
(:mod:`taso_jax.search.choose`) decided before them, and each ends where the time limit,
or delivery's share of it, does.
"""

from __future__ import annotations

from taso_jax._text import one_line

__all__ = ["report_timing", "onnxruntime_timing", "LATE_ONNXRUNTIME_ROUNDS"]


def report_timing(args, target, graph, optimized, report: dict, deadline,
                  keep: float = 0.0) -> None:
    """The report's own timing of the input and optimized graphs in the target's runtime.

    An input written back as it is is not timed: nothing to compare, and compiling it only
    to time it once cost 100 s on a 5,000-operator chain under a 20 s limit. A target that
    times the written files instead (``times_graphs`` false: onnxruntime, whose
    process then never imports JAX, about 145 MB) is timed after the export. Past the time
    limit it is left out (a compile and five calls more: 10 s past a 30 s limit on a 1 s
    model), and the speed-up is the end-to-end choice's. ``keep``: seconds before the limit
    it leaves to delivery (``_OnnxFile.after_search_seconds`` in
    :mod:`taso_jax.cli_optimize`): its rounds end there, and it is left out where less is
    left, or where its least rounds of the calls the end-to-end choice timed
    (:func:`~taso_jax.search.paired_test.loops_fit`) would not end before then (a layout
    model's 1 s calls: 15 s, and 6 s past a 60 s limit).
    """
    from taso_jax.search.paired_test import loops_fit

    if not target.times_graphs:
        return
    e2e = report.get("end_to_end") or {}
    calls = [e2e["times_us"][i] for i in (0, e2e.get("chosen") or 0)
             if len(e2e.get("times_us") or ()) > i]  # what the choice timed, microseconds
    if deadline.left() <= keep or not loops_fit(calls, 1, deadline.at - keep):
        report["notes"].append(f"the report's own {target.runtime} timing was left out: the "
                               "time limit had passed, or what it left is delivery's "
                               "(--time-limit)")
        return
    try:
        timing = target.time_graphs(graph, optimized, args.repeats, deadline.at - keep)
    except Exception as e:  # noqa: BLE001 - the report's own timing only
        report["notes"].append(f"the report's own {target.runtime} timing failed, and is left "
                               f"out: {type(e).__name__}: {one_line(str(e), 200)}")
        return
    report[target.timing_key] = timing


#: Rounds of the report's onnxruntime timing once the time limit has passed.
LATE_ONNXRUNTIME_ROUNDS = 3


def onnxruntime_timing(args, target, report: dict, reference, data, feeds: dict,
                       deadline) -> None:
    """The report's onnxruntime timing of the written model against the input file.

    For a target that did not time its choice in onnxruntime (XLA) it is what warns that
    the file runs slower there (one rewritten OCR model ran at 0.17x), so past the time
    limit it is still made, on :data:`LATE_ONNXRUNTIME_ROUNDS` rounds (two sessions and a
    few runs), with a note; ``report["onnxruntime"]["slower_warning"]`` says whether to
    warn (below :data:`~taso_jax.checks.ONNXRUNTIME_WARN`). For the onnxruntime target
    the end-to-end choice timed it already, and past the limit its figure stands in
    (:attr:`~taso_jax.outcome.Outcome.speedup`).
    """
    from taso_jax.checks import ONNXRUNTIME_WARN, measure_onnxruntime

    if not deadline.passed():
        timing = measure_onnxruntime(reference, data, feeds, deadline=deadline.at)
    elif not target.warns_in_onnxruntime:  # two sessions more, for the choice's figure
        report["notes"].append("the report's own onnxruntime timing was left out: the time "
                               "limit had passed (--time-limit); the speed-up is the "
                               "end-to-end choice's")
        return
    else:
        timing = measure_onnxruntime(reference, data, feeds, repeats=LATE_ONNXRUNTIME_ROUNDS)
        report["notes"].append(f"the report's onnxruntime timing ran {LATE_ONNXRUNTIME_ROUNDS} "
                               "rounds only: the time limit had passed (--time-limit)")
    report["onnxruntime"] = {**timing, "slower_warning": bool(
        target.warns_in_onnxruntime and timing["speedup"] < ONNXRUNTIME_WARN)}
