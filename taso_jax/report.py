"""The optimization report, rendered: the text of an :class:`~taso_jax.outcome.Outcome`.

Everything here renders a report record that the pipeline filled (the measurements and
checks are in :mod:`taso_jax.checks`, the record's parts in :mod:`taso_jax.records`);
nothing here runs a model or times one. The names that moved to :mod:`taso_jax.checks` and
:mod:`taso_jax.records` are still read from here (:func:`__getattr__`), for old callers.
"""

from __future__ import annotations

from taso_jax._text import one_line
from taso_jax.records import PhaseTimes
from taso_jax.search.choose import DUEL_WITHIN, NHWC_LAYOUT

__all__ = ["end_to_end_line", "format_report", "speedup_sources", "format_not_searched",
           "format_pass_through"]

#: Names that moved to :mod:`taso_jax.checks`, read through :func:`__getattr__`.
_MOVED_TO_CHECKS = frozenset({
    "measure_speed", "measure_onnxruntime", "compare_onnx", "check_onnx", "reference_runs",
    "compare_outputs", "other_bindings", "check_other_sizes", "RTOL", "ATOL",
    "CHECK_SCALES", "ONNXRUNTIME_WARN", "OTHER_SIZES_ATOL", "check_graphs"})
_MOVED_TO_RECORDS = frozenset({"search_report", "proofs_cut_note"})


def __getattr__(name: str):
    """The names that moved out of this module, from where they live now (PEP 562)."""
    if name in _MOVED_TO_CHECKS:
        import taso_jax.checks

        return getattr(taso_jax.checks, name)
    if name in _MOVED_TO_RECORDS:
        import taso_jax.records

        return getattr(taso_jax.records, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _rival(duel: dict) -> str:
    """Why a duel's rival was timed against the confirmed candidate, in a few words."""
    if duel.get("reason") == "median":
        return "ahead of it by its median round in screening"
    return f"within {DUEL_WITHIN:.0%} of it in screening"


def _ratio(speedup: float) -> str:
    """``speedup`` (old time over new) in words: "1.12x faster" or "0.89x, slower"."""
    return f"{speedup:.2f}x faster" if speedup >= 1.0 else f"{speedup:.2f}x, slower"


def _confirmed(p: dict | None) -> str:
    """Why a kept candidate was kept: the paired test that confirmed it (``p``)."""
    if not p:
        return "confirmed faster than the input"
    return (f"confirmed faster than the input in a paired test, {_ratio(p['speedup'])} "
            f"(median of the per-round ratios, input time over candidate time; it won "
            f"{p['wins']} of {p['rounds']} rounds)")


def _screened(ts: list, k: int) -> str:
    """The screening medians of the input and candidate ``k``, each named.

    Screening ranks by fastest round, in a loop of its own, so its medians can order the
    two otherwise than the paired test that decides; that is said where they do.
    """
    line = (f"; screening medians: the input {ts[0]:.0f} us, candidate {k} {ts[k]:.0f} us")
    if ts[k] >= ts[0]:
        line += (" (screening ranks by fastest round and its medians are noisier; the paired "
                 "test decides)")
    return line


def cost_model_line(cm: dict) -> str:
    """One line on what the search's cost model compiled.

    ``cm`` is its ``stats()`` (see :class:`~taso_jax.search.calibrated.CalibratedCostModel`).
    """
    line = f"cost model: {cm['name']}, {cm['compiles']} kernels compiled and timed"
    line += f" ({cm['compile_seconds']:.1f} s)"
    if "decisions" in cm:
        line += (f" to settle {cm['decisions']} close calls between forms of one node"
                 f" ({cm['from_cache']} kernel times read from the cost cache)")
        if cm.get("over_budget"):
            line += (f"; {cm['over_budget']} close calls left to the curves (compile budget "
                     "or deadline)")
    if "priced" in cm:
        line += f"; {cm['priced']} kernels priced in {cm['pricing_seconds']:.2f} s"
    return line


def end_to_end_line(e: dict) -> str:
    """The report's line on an end-to-end choice.

    ``e`` is the dict :func:`~taso_jax.search.choose.keep_fastest` returns (times in
    microseconds); the line says what was timed, which graph was kept and the paired tests
    that decided it.
    """
    ts, k, p = e["times_us"], e.get("chosen", 0), e.get("paired")
    rounds = (f"; it won {p['wins']} of {p['rounds']} rounds, median ratio "
              f"{p['speedup']:.2f}x" if p else "")
    d = e.get("duel")
    if e.get("skipped"):
        return (f"end-to-end choice ({e['device']}, {e.get('runtime', 'jax.jit')}): kept the "
                f"input, no candidate timed: {e['skipped']}")
    if e.get("confirmed_by"):  # screened only (search.choose.screen_fastest)
        if e.get("picked_by") == "estimate":
            picked = (f"picked {'the input' if e['original_kept'] else f'candidate {k}'} "
                      f"of {len(e['estimates_us'])} graphs by estimate, untimed"
                      + (f" ({e['why_untimed']})" if e.get("why_untimed") else ""))
        else:
            picked = (f"screened the input graph and {e['measured'] - 1} candidates ("
                      + ", ".join(f"{t:.0f}" for t in ts) + " us, medians of "
                      f"{e['repeats']}); picked "
                      + ("the input: no candidate's fastest round was below its own"
                         if e["original_kept"] else f"candidate {k} by its fastest round"))
        return (f"end-to-end choice ({e['device']}, {e.get('runtime', 'jax.jit')}): {picked}; "
                "the graph picked is confirmed by its caller's own comparison")
    if e["original_kept"]:
        verdict = f"kept the input: no candidate ran faster in a paired test{rounds}"
    elif d and d["faster"]:
        verdict = (f"candidate {d['against']} was confirmed faster than the input"
                   f"{rounds}; candidate {k}, {_rival(d)}, ran faster still head to "
                   f"head (won {d['wins']} of {d['rounds']} rounds, {d['speedup']:.2f}x "
                   f"faster than candidate {d['against']}): kept candidate {k}"
                   + _screened(ts, k))
    else:
        verdict = f"kept candidate {k}: {_confirmed(p)}" + _screened(ts, k)
        if d:
            verdict += (f"; candidate {d['candidate']}, {_rival(d)}, was not faster head "
                        f"to head (won {d['wins']} of {d['rounds']} rounds, "
                        f"{_ratio(d['speedup'])} than candidate {k})")
    runtime = e.get("runtime", "jax.jit")
    floors = ("; fastest rounds, which ranked them: "
              + ", ".join(f"{t:.0f}" for t in e["floors_us"]) + " us") if e.get("floors_us") else ""
    baseline = e.get("baseline", "the input graph")  # what the target times against
    return (f"end-to-end choice ({e['device']}, {runtime}, median of {e['repeats']}): "
            f"timed {baseline} and {e['measured'] - 1} candidates ("
            + ", ".join(f"{t:.0f}" for t in e["times_us"]) + " us" + floors + f"); {verdict}"
            + _dropped(e))


def _dropped(e: dict) -> str:
    """The end-to-end line's note on candidates that could not be timed (``e["dropped"]``)."""
    dropped = e.get("dropped") or []
    if not dropped:
        return ""
    return (f"; {len(dropped)} candidate(s) left out, not exportable to ONNX (first: "
            f"{one_line(dropped[0], 200)})")


def format_report(r: dict) -> str:
    """The human-readable report printed by ``taso-jax optimize``."""
    lines = [f"model: {r['model']}"]
    if r.get("notes"):
        lines += [f"note: {n}" for n in r["notes"]]
    ob, oa = r["operators_before"], r["operators_after"]
    lines.append(f"operators: {sum(ob.values())} -> {sum(oa.values())}")
    for op in sorted(set(ob) | set(oa)):
        if ob.get(op, 0) != oa.get(op, 0):
            lines.append(f"  {op:<14} {ob.get(op, 0):>5} -> {oa.get(op, 0)}")
    c = r["cost"]
    lines.append(f"estimated cost ({c['model']}): {c['before_us']:.1f} us -> "
                 f"{c['after_us']:.1f} us ({c['before_us'] / max(c['after_us'], 1e-9):.2f}x)")
    if r.get("time"):
        t = r["time"]
        head = f"measured time ({t['device']}, jax.jit, median of {t['repeats']}): "
        if r.get("applied"):
            lines.append(head + f"{t['before_us']:.1f} us -> {t['after_us']:.1f} us "
                         f"({t['speedup']:.2f}x)")
        else:  # the same graph twice: a ratio would only show the noise
            lines.append(head + f"{t['before_us']:.1f} us, unchanged")
    if r.get("onnxruntime"):
        t = r["onnxruntime"]
        lines.append(f"onnxruntime time (CPU, median of {t['repeats']}): "
                     f"{t['before_us']:.1f} us -> {t['after_us']:.1f} us "
                     f"({t['speedup']:.2f}x)")
        if t.get("slower_warning"):  # set where the target did not time onnxruntime
            lines.append("WARNING: the written model runs slower than the original in "
                         "onnxruntime: the rewrites were chosen for XLA (jax.jit); if you run "
                         "the file in onnxruntime, optimize it with --target onnxruntime")
    s = r["search"]
    if r.get("first_call"):
        fc = dict(r["first_call"])
        total = fc.pop("total", sum(fc.values()))
        lines.append(f"first call: {total:.1f} s (" + ", ".join(
            f"{k} {v:.2f} s" for k, v in fc.items()) + ")")
    if r.get("phases"):
        lines.append(PhaseTimes(**r["phases"]).line())
    if r.get("wall_seconds") is not None:
        lines.append(f"total time: {r['wall_seconds']:.1f} s (limit {r['time_limit']:g} s: "
                     "import, search, end-to-end choice, check and write)")
    lines.append(f"backtracking search: {s['seconds']:.1f} s, {s['iterations']} graphs expanded, "
                 f"{s['explored']} explored, stopped: {s['stopped']}, "
                 f"{s['substitutions']} substitutions")
    counters = s.get("rule_counters") or {}
    if counters:
        busiest = sorted(counters.items(), key=lambda kv: (-kv[1][1], -kv[1][0], kv[0]))[:3]
        lines.append(f"rules that matched in the backtracking search: {len(counters)} of "
                     f"{s['substitutions']}; most "
                     "rewrites queued: " + ", ".join(f"{name} ({q} of {m} matches)"
                                                    for name, (m, q) in busiest))
    if s.get("out_of_time_in"):
        lines.append(f"time limit reached during: {s['out_of_time_in']}")
    cm = r.get("cost_model") or {}
    if "compiles" in cm:
        lines.append(cost_model_line(cm))
    e = r.get("end_to_end") or {}
    if e:
        lines.append(end_to_end_line(e))
    rules = r.get("rules") or {}
    if rules:
        line = f"rules used: {rules['used']} ({rules['proved']} proved)"
        if rules.get("unverified_used"):
            line += (f"; WARNING: {rules['unverified_used']} unproved rules allowed "
                     "(--allow-unverified)")
        elif rules.get("unverified_left_out"):
            line += f"; {rules['unverified_left_out']} unproved rules left out"
        lines.append(line)
    lines += _applied_lines(r)
    if r.get("check", {}).get("identical"):
        lines.append("output check: not needed, the input model is returned unchanged")
    elif r.get("check"):
        lines.append(_check_line(r["check"]))
    lines += [refusal["why"] for refusal in r.get("fold_refusals") or ()]
    if r.get("written"):
        lines.append(_written_line(r))
    return "\n".join(lines)


def _check_line(k: dict) -> str:
    """The report's ``output check`` line, from check record ``k``.

    ``k`` is a comparison (:func:`~taso_jax.checks.compare_outputs`) with the check's
    ``scales``, ``reference``, and where they apply ``failed_scale``, ``noise_floor``
    (the export's own noise), ``rounding_noise`` and ``noise_margin`` (the device's),
    ``full_precision``, ``error``, ``range_scales``, ``type_rtol`` (a float16 or bfloat16
    model's own rounding), ``rounding_cuts`` (:mod:`taso_jax.rounding_cuts`) and ``nonfinite``
    (:func:`~taso_jax.checks.compare_nonfinite`).
    """
    scales = (f", inputs N(0,1) x {' and x '.join(f'{x:g}' for x in k['scales'])}"
              if k.get("scales") else "")
    if k.get("range_scales"):
        scales += "; non-finite values at x" + " and x".join(f"{x:.2g}"
                                                            for x in k["range_scales"])
    typed = (f" (at least {k['type_rtol']:.3g} of the value and of max|output|: the "
             "model's narrower float type's rounding)" if k.get("type_rtol") else "")
    return (f"output check ({k.get('reference', 'onnxruntime')}, original vs optimized"
            f"{scales}, rtol {k['rtol']}, atol {k['atol']}{typed}): "
            f"{'ok' if k['ok'] else 'MISMATCH'}"
            + (f" at x{k['failed_scale']:g}" if k.get("failed_scale")
               and not k["ok"] else "")
            + f", max abs error {k['max_abs_err']:.3g}"
            + (f" (within twice the {k['noise_floor']:.3g} that exporting the input "
               "without any rewrite already gives: the model's own rounding noise)"
               if k.get("noise_floor") is not None else "")
            + (f" (allowed up to {k['atol_floor']:.3g}: {k['noise_margin']:g}x the "
               f"{k['rounding_noise']:.3g} by which the original itself moves between "
               "the device's default and full float32 precision)"
               if k.get("rounding_noise") else "")
            + ("; the optimized graph's matrix products and convolutions run at full "
               "float32 precision: at the device's default precision they differed "
               "from the original by more than that"
               if k.get("full_precision") else "")
            + (f"; {k['rounding_cuts']['note']}" if k.get("rounding_cuts") else "")
            + (f"; the outputs themselves differ by up to {k['outputs_max_abs_err']:.3g}"
               if k.get("outputs_max_abs_err") is not None else "")
            + (f"; {k['error']}" if k.get("error") else "")
            + ("; " + ", ".join(f"{n} element(s) {what}" for what, n in k["nonfinite"].items())
               if k.get("nonfinite") else ""))


def _applied_lines(r: dict) -> list[str]:
    """The substitutions applied, and for a delivered rewrite what made it faster.

    ``r["outcome"]["delivered"]`` (set by :meth:`~taso_jax.outcome.Outcome.to_json`) tells
    whether the optimized graph is delivered; ``r["sources"]`` names the speed-up's
    sources besides substitutions (:func:`speedup_sources`).
    """
    delivered = (r.get("outcome") or {}).get("delivered")
    lines = []
    if r["applied"]:
        lines.append("substitutions applied:")
        for name, n in sorted(r["applied"].items(), key=lambda kv: -kv[1]):
            status = r.get("proof", {}).get(name, "proved")
            lines.append(f"  {n:>3} x {name}"
                         + ("" if status == "proved" else f"  [NOT PROVED: {status}]"))
            if name in r.get("laws", {}):
                lines.append(f"        {r['laws'][name]}")
            elif name == NHWC_LAYOUT:
                lines.append("        convolutions in NHWC (conv2d_nhwc, HWIO kernels), "
                             "activations carried in NHWC between them")
    elif delivered == "optimized":
        lines.append("substitutions applied: none (the operators are the input's)")
    else:
        lines.append("substitutions applied: none (the input graph is returned unchanged)")
    if delivered == "optimized":
        lines.append("what made it faster: " + speedup_sources(r))
    return lines


def speedup_sources(r: dict) -> str:
    """Every source of a delivered rewrite's speed-up, in words, from report ``r``.

    The sources: the substitutions applied (``r["applied"]``, the NHWC layout apart), the
    layout, and the work the delivered graph computes once rather than on every call
    (``r["folded"]``, :func:`~taso_jax.ir.folded_work.folded_work`: weights pre-folded,
    constants such as masks and biases computed once), and the cleanup of an input file
    that ran nodes no output needs (``r["cleanup"]``, :mod:`taso_jax.frontends.
    onnx_cleanup`).
    """
    applied = {k: v for k, v in (r.get("applied") or {}).items() if k != NHWC_LAYOUT}
    parts = []
    if applied:
        parts.append(f"{sum(applied.values())} substitution(s) applied ("
                     + ", ".join(sorted(applied)) + ")")
    if NHWC_LAYOUT in (r.get("applied") or {}):
        parts.append("layout: convolutions run in NHWC")
    folded = r.get("folded") or {}
    for kind, words in (("weights", "weights pre-folded: {n} operator(s) on the weights "
                                    "computed once ({ops})"),
                        ("constants", "constants computed once (masks, biases): {n} "
                                      "operator(s) ({ops})")):
        ops = folded.get(kind) or {}
        if ops:
            parts.append(words.format(n=sum(ops.values()), ops=", ".join(
                f"{op} x{c}" for op, c in sorted(ops.items()))))
    cleanup = {k: v for k, v in (r.get("cleanup") or {}).items() if k != "timing"}
    if cleanup:
        parts.append("cleanup of the input file: " + ", ".join(
            f"{k.replace('_', ' ')} x{v}" for k, v in sorted(cleanup.items())))
    return "; ".join(parts) if parts else (
        "no rewrite and no work moved ahead of the calls: the difference is the runtime's")


def _written_line(r: dict) -> str:
    """The report's ``written:`` line: the output path, and how the input was kept."""
    copy = r.get("written_copy_of_input")
    why = r.get("kept_input_because") or "no faster graph was found"
    data = (f", its tensors in {r['written_data']} (over protobuf's 2 GB limit)"
            if r.get("written_data") else "")
    return f"written: {r['written']}" + data + (
        f" (the input with its external data inlined: {why})"
        if copy == "inlined" else
        f" (the input, its external data gathered into one file: {why})"
        if copy == "gathered" else
        f" (the input converted to opset {r.get('written_opset')} by onnx's version converter, "
        f"which onnxruntime runs: {why})" if copy == "converted" else
        f" (a byte-for-byte copy of the input: {why})" if copy
        else "")


def format_not_searched(r: dict) -> list[str]:
    """The lines of a report that stopped before any search: total time, the file written.

    ``r`` may hold ``wall_seconds`` and ``time_limit`` (seconds) and ``written``.
    """
    lines = [PhaseTimes(**r["phases"]).line()] if r.get("phases") else []
    if "wall_seconds" in r and "time_limit" in r:
        lines.append(f"total time: {r['wall_seconds']:.1f} s (limit {r['time_limit']:g} s)")
    if r.get("written"):
        lines.append(_written_line(r))
    return lines


def format_pass_through(r: dict) -> str:
    """The report of a model written back without being imported (its sizes follow values).

    ``r`` holds ``model``, ``not_optimized_because`` (the sentence naming the inputs whose
    values set sizes), ``wall_seconds`` (seconds) and ``time_limit`` (seconds), and
    ``written`` when ``-o`` was given.
    """
    lines = [f"model: {r['model']}",
             f"not optimized: {r['not_optimized_because']}; the model passes through "
             "unchanged, as an opaque region would",
             f"total time: {r['wall_seconds']:.1f} s (limit {r['time_limit']:g} s)"]
    if r.get("written"):
        lines.append(_written_line(r))
    return "\n".join(lines)
