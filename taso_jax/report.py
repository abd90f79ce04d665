"""Optimization reports: measured run times, the output check, and the printed summary."""

from __future__ import annotations

import numpy as np

from taso_jax._text import one_line
from taso_jax.frontends.onnx_io import model_refusal
from taso_jax.ir.executor import random_array, random_inputs
from taso_jax.ir.graph import Graph
from taso_jax.records import PhaseTimes
from taso_jax.search.choose import DUEL_WITHIN, NHWC_LAYOUT, device_name, time_graphs
from taso_jax.search.options import OptimizeOptions

__all__ = ["measure_speed", "measure_onnxruntime", "compare_onnx", "check_onnx",
           "reference_runs", "compare_outputs", "other_bindings", "check_other_sizes",
           "search_report", "format_report", "speedup_sources", "format_not_searched", "RTOL",
           "ATOL", "CHECK_SCALES", "ONNXRUNTIME_WARN", "check_graphs"]

#: Outputs agree when ``|a - b| <= ATOL * max|b| + RTOL * |b|`` elementwise (float32 sums
#: reassociate when convolutions are merged or batchnorm is folded).
RTOL, ATOL = 1e-3, 1e-4


def measure_speed(before: Graph, after: Graph, repeats: int = 30, seed: int = 0,
                  deadline: float | None = None) -> dict:
    """Median wall time in microseconds of both graphs under ``jax.jit``, same process.

    Runs are interleaved (before, after, before, ...) after warm-up so that machine noise
    hits both alike; fewer runs (at least 3) once ``deadline`` (``time.perf_counter()``) has
    passed. Returns ``{"before_us", "after_us", "speedup", "device", "repeats"}``.
    """
    if after.key == before.key:  # the same graph: time it once
        ta = tb = time_graphs([before], repeats=repeats, warmup=2, seed=seed,
                              deadline=deadline)[0]
    else:
        ta, tb = time_graphs([before, after], repeats=repeats, warmup=2, seed=seed,
                             deadline=deadline)
    repeats = ta["repeats"]
    a, b = ta["median_us"], tb["median_us"]
    return {"before_us": a, "after_us": b, "speedup": a / b if b else float("nan"),
            "device": device_name(), "repeats": repeats}


def measure_onnxruntime(original, optimized, inputs: dict, repeats: int = 20,
                        deadline: float | None = None) -> dict:
    """Median wall time in microseconds of both ONNX models in onnxruntime, same process.

    What a user of the ONNX file runs: CPU execution provider, onnxruntime's default
    threads, runs interleaved after warm-up. A rewrite that pays under XLA can cost in
    onnxruntime (a grouped convolution made dense). Returns ``{"before_us", "after_us",
    "speedup", "repeats"}``.
    """
    from taso_jax.frontends.onnxruntime_target import time_onnx_models

    times = time_onnx_models([original, optimized], inputs, repeats=repeats, deadline=deadline)
    repeats = len(times[0])
    a, b = float(np.median(times[0])), float(np.median(times[1]))
    return {"before_us": a, "after_us": b, "speedup": a / b if b else float("nan"),
            "repeats": repeats}


#: A written model slower than this fraction of the original in onnxruntime is warned about.
ONNXRUNTIME_WARN = 0.95


def _session(model):
    from taso_jax.frontends.onnxruntime_target import ort_session

    return ort_session(model, trim=True)


def _outputs(session, inputs: dict) -> list:
    """The session's outputs on ``inputs``, owning their memory (they are kept)."""
    from taso_jax.frontends.onnxruntime_target import owned_run

    return owned_run(session, inputs)


def _reference(original, inputs: dict, hint: str | None = None) -> list:
    """The original model's outputs on ``inputs``; a model that does not run is bad input.

    ``original`` is ONNX bytes, a path or an onnxruntime session of either. ``hint`` ends
    the error in place of the advice to give ``--input-shape``; the error is then a
    :class:`~taso_jax.frontends.onnx_io.ValueSizedModel` (random values fed where sizes are
    read are the likely cause).
    """
    try:
        session = original if hasattr(original, "run") else _session(original)
        return _outputs(session, inputs)
    except Exception as e:  # the user's model itself, not ours
        shapes = ", ".join(f"{k}={list(np.shape(v))}" for k, v in inputs.items())
        message = (f"the original model does not run in onnxruntime on random inputs "
                   f"({shapes}): {one_line(str(e), 400)} ("
                   f"{hint or 'if it expects other sizes, give them with --input-shape'})")
        raise model_refusal(message, hint) from e


def _actual(optimized, inputs_list: list, reference_count: int, rtol, atol):
    """The optimized model's outputs per input set, or the failed check if it cannot run."""
    try:
        sess = _session(optimized)
        return [_outputs(sess, inputs) for inputs in inputs_list], None
    except Exception as e:  # ours: the check fails, and says why
        return None, {"ok": False, "max_abs_err": float("inf"), "rtol": rtol,
                      "atol": f"{ATOL} x max|output|" if atol is None else atol,
                      "outputs": reference_count,
                      "error": "the optimized model does not run: "
                               f"{one_line(str(e), 400)}"}


def compare_onnx(original, optimized, inputs: dict, rtol: float = RTOL,
                 atol: float | None = None) -> dict:
    """Run both ONNX models (bytes or paths) in onnxruntime on ``inputs``; compare outputs.

    Returns what :func:`compare_outputs` returns; a check that failed because the optimized
    model does not run carries ``"error"``.

    Raises:
        ModelError: the original model does not run on ``inputs``.
    """
    reference = _reference(original, inputs)
    actual, failed = _actual(optimized, [inputs], len(reference), rtol, atol)
    return failed or compare_outputs(actual[0], reference, rtol, atol)


#: Scales of the random inputs an output check runs at: N(0, 1), then x100 (a rewrite that is
#: right near zero only, such as dropping a clip, shows at large inputs).
CHECK_SCALES = (1.0, 100.0)


def reference_runs(original, graph: Graph, scales=CHECK_SCALES, seed: int = 1
                   ) -> list[tuple[float, dict, list]]:
    """``(scale, inputs, outputs)`` of the original model at each input scale.

    Float inputs are N(0, 1) times the scale; integer and boolean inputs are not scaled,
    nor are float inputs that the model casts to indices (``integer_input_bounds``). Run
    before a long search, so that a model that does not run fails at once.

    Raises:
        ModelError: the original model does not run on these inputs.
    """
    base = dict(zip((n.name for n in graph.inputs), random_inputs(graph, seed=seed),
                    strict=True))
    try:
        session = _session(original)  # one session for every scale
    except Exception:
        session = original  # _reference reports the failure, in one line
    runs = []
    indices = graph.meta.get("integer_input_bounds") or {}
    hint = graph.meta.get("value_sized_hint")
    for scale in scales:
        feeds = {k: (v * np.asarray(scale, v.dtype) if np.issubdtype(v.dtype, np.floating)
                     and k not in indices else v) for k, v in base.items()}
        runs.append((scale, feeds, _reference(session, feeds, hint)))
    return runs


def check_onnx(original, optimized, graph: Graph, rtol: float = RTOL,
               atol: float | None = None, scales=CHECK_SCALES, seed: int = 1,
               references: list | None = None) -> dict:
    """Compare the optimized model with the original at each input scale; ok if all are.

    ``references`` are :func:`reference_runs` of the original when already made. Returns
    the comparison of the worst scale, with ``"scales"`` (the scales run) and
    ``"failed_scale"`` (the first failing one, or ``None``).

    Raises:
        ModelError: the original model does not run on the check's inputs.
    """
    runs = references if references is not None else reference_runs(original, graph,
                                                                     scales, seed)
    actual, failed = _actual(optimized, [feeds for _, feeds, _ in runs], len(runs[0][2]),
                             rtol, atol)
    if failed:
        return {**failed, "failed_scale": runs[0][0], "scales": [s for s, _, _ in runs]}
    worst = _worst_scale(((scale, got, reference) for (scale, _, reference), got
                          in zip(runs, actual, strict=True)), rtol, atol)
    worst["scales"] = [s for s, _, _ in runs]
    return worst


def _worst_scale(runs, rtol: float, atol: float | None) -> dict:
    """The worst comparison of ``(scale, actual, reference)`` runs (:func:`compare_outputs`).

    Runs are compared in order until one fails; the result is the first failing comparison,
    else the one with the largest error, with ``"failed_scale"`` (``None`` when all pass).
    """
    worst = None
    for scale, got, reference in runs:
        r = compare_outputs(got, reference, rtol, atol)
        r["failed_scale"] = None if r["ok"] else scale
        if worst is None or (worst["ok"] and not r["ok"]) or (
                r["ok"] == worst["ok"] and r["max_abs_err"] > worst["max_abs_err"]):
            worst = r
        if not r["ok"]:
            break
    return worst


def check_graphs(original: Graph, optimized: Graph, rtol: float = RTOL,
                 atol: float | None = None, scales=CHECK_SCALES, seed: int = 1) -> dict:
    """Compare two graphs' outputs under ``jax.jit`` at each input scale; ok if all are.

    The check the Python API makes where no independent executor of the original is at
    hand: both graphs are compiled with :func:`~taso_jax.ir.executor.compile_graph` and run
    on the same seeded random inputs, floats scaled by each of ``scales`` (integer and
    boolean inputs, and inputs the graph uses as indices, are not scaled). Tolerances as in
    :func:`compare_outputs`. Returns the comparison of the worst scale, with ``"scales"``
    and ``"failed_scale"`` (the first failing one, or ``None``), and ``"reference"``.
    """
    from taso_jax.ir.executor import compile_graph

    base = random_inputs(original, seed=seed)
    indices = original.meta.get("integer_input_bounds") or {}
    run_a, run_b = compile_graph(original), compile_graph(optimized)
    def runs():  # each scale's outputs are computed only when the comparison reaches it
        for scale in scales:
            xs = [x * np.asarray(scale, x.dtype) if np.issubdtype(x.dtype, np.floating)
                  and n.name not in indices else x
                  for n, x in zip(original.inputs, base, strict=True)]
            yield (scale, [np.asarray(y) for y in _as_list(run_b(*xs))],
                   [np.asarray(y) for y in _as_list(run_a(*xs))])

    worst = _worst_scale(runs(), rtol, atol)
    worst.update(scales=list(scales), reference="jax.jit of the input graph")
    return worst


def _as_list(out) -> list:
    return list(out) if isinstance(out, list | tuple) else [out]


def other_bindings(graph: Graph, symbolic: dict) -> list[dict[str, tuple[int, ...]]]:
    """Input shapes at sizes other than those ``graph`` was optimized at, to try in order.

    ``symbolic`` is :func:`taso_jax.frontends.onnx_io.symbolic_dims` of the original model.
    The first trial (for 2 to 4 symbols) moves every symbol by a different factor (the
    k-th: a size bound to 1 becomes k + 2, any other k + 2 times its size), so that sizes
    equal at the binding (a
    square image's H and W, a batch and a length both bound to 1) differ there: a graph
    that holds one of them for the other fails. Then the trials of one factor: a
    batch-like symbol (bound to 1) becomes 2, any other one doubles, for every symbol, then
    the batch-like ones only, then the others only. Symbols with a name move together; an
    unnamed open axis moves alone.
    """
    bound = {n.name: n.types[0].shape for n in graph.inputs if n.name in symbolic}
    symbols: dict[str, tuple[int, bool]] = {}
    for name, axes in symbolic.items():
        for axis, sym in axes.items():
            if name in bound:
                v = bound[name][axis]
                symbols.setdefault(sym or f"{name}[{axis}]", (v, v == 1))
    trials = []
    for which in ("distinct", "all", "batch", "rest"):
        if which == "distinct":
            new = {sym: (k + 2) * v for k, (sym, (v, _)) in enumerate(symbols.items())}
            if len(set(new.values())) < len(new) or not 2 <= len(new) <= 4:
                continue
        else:
            new = {sym: (2 if v == 1 else 2 * v) if which == "all" or
                   (which == "batch") == batch else v for sym, (v, batch) in symbols.items()}
        if new == {sym: v for sym, (v, _) in symbols.items()}:
            continue
        shapes = {}
        for name, shape in bound.items():
            dims = list(shape)
            for axis, sym in symbolic[name].items():
                dims[axis] = new[sym or f"{name}[{axis}]"]
            shapes[name] = tuple(dims)
        if shapes not in trials:
            trials.append(shapes)
    return trials


#: The least absolute tolerance of :func:`check_other_sizes` (torch.testing's float32 default):
#: float32 rounding noise. A text detector's sigmoid map is all but 0 on random images (its
#: largest value 5e-6 at 2x3x672x896), so a tolerance scaled by that (1e-4 x 5e-6) failed a
#: rewrite whose outputs differed by 1.5e-7 there; at the bound sizes the values are
#: compared at two input scales without this floor.
OTHER_SIZES_ATOL = 1e-5


def check_other_sizes(original, optimized, graph: Graph, symbolic: dict,
                      rtol: float = RTOL, atol: float | None = None, seed: int = 2) -> dict:
    """Check ``optimized``, its sizes left open, against ``original`` at other sizes.

    The first binding of :func:`other_bindings` at which the original runs is used; inputs
    are N(0, 1) (integers as :func:`~taso_jax.ir.executor.random_inputs` draws them), and
    the absolute tolerance is at least :data:`OTHER_SIZES_ATOL`.
    Returns ``{"ok", "shapes", ...}`` with the comparison (:func:`compare_outputs`),
    ``"ok": None`` when the original itself runs at none of the trial sizes, and
    ``"error"`` when the optimized model does not run there.
    """
    rng = np.random.default_rng(seed)
    static = {n.name: n.types[0] for n in graph.inputs}
    bounds = graph.meta.get("integer_input_bounds") or {}
    for shapes in other_bindings(graph, symbolic):
        feeds = {}
        for name, t in static.items():
            feeds[name] = random_array(shapes.get(name, t.shape), t.dtype, rng,
                                       bounds.get(name))
        try:
            reference = _outputs(_session(original), feeds)
        except Exception:
            continue
        actual, failed = _actual(optimized, [feeds], len(reference), rtol, atol)
        r = failed or compare_outputs(actual[0], reference, rtol, atol,
                                      floor=[OTHER_SIZES_ATOL] * len(reference))
        return {**r, "shapes": {k: list(v) for k, v in shapes.items()}}
    return {"ok": None, "shapes": None}


def compare_outputs(actual, reference, rtol: float = RTOL, atol: float | None = None,
                    floor=None) -> dict:
    """Compare output arrays with their references (same order).

    Integer and boolean outputs must be equal. Float and complex outputs agree where
    ``|a - b| <= atol + rtol * |b|``, with ``atol`` by default ``ATOL`` times the largest
    finite reference magnitude of each output (a scale-aware tolerance), or the absolute
    value given. ``floor``, one float per output, raises each output's ``atol`` to at least
    that value: the rounding noise the reference itself carries on the device (see
    ``taso_jax.frontends.decorator``), where the default tolerance would be tighter than the
    reference is exact. Non-finite values must match exactly: NaN with NaN, +inf with +inf.

    Returns ``{"ok", "max_abs_err", "rtol", "atol", "outputs"}``; ``max_abs_err`` is
    ``inf`` when a non-finite value does not match. A NaN tolerance (``rtol``, ``atol`` or a
    ``floor``) fails every float output: no comparison passes by a NaN.
    """
    ok, worst = len(actual) == len(reference), 0.0
    floors = list(floor) if floor is not None else [0.0] * len(reference)
    tolerances = [rtol, *floors] + ([] if atol is None else [atol])
    if np.isnan(np.asarray(tolerances, np.float64)).any():
        ok = False  # a NaN tolerance passes nothing, even where every value is NaN
    for a, b, low in zip(actual, reference, floors, strict=False):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            ok = False
            continue
        if b.size == 0:
            continue
        if not np.issubdtype(b.dtype, np.inexact):  # integers and booleans: exactly
            diff = np.abs(a.astype(np.int64) - b.astype(np.int64)) if b.dtype != bool \
                else (a != b).astype(np.int64)
            ok &= bool(np.all(diff == 0))
            worst = max(worst, float(diff.max()))
            continue
        kind = np.complex128 if np.iscomplexobj(a) or np.iscomplexobj(b) else np.float64
        a, b = a.astype(kind), b.astype(kind)
        finite = np.isfinite(a) & np.isfinite(b)
        same = (a == b) | (np.isnan(a) & np.isnan(b))  # equal infinities, NaN with NaN
        if not np.all(finite | same):
            ok, worst = False, float("inf")
        scale = float(np.max(np.abs(b[np.isfinite(b)]), initial=0.0))
        # np.maximum and the negated test carry a NaN tolerance through: it fails, never
        # passes (err > nan is False, and Python's max(nan, x) can drop the NaN)
        tol = np.maximum(ATOL * scale if atol is None else atol, low) + rtol * np.abs(b)
        with np.errstate(invalid="ignore"):  # inf - inf where both are inf: masked out
            err = np.where(finite, np.abs(a - b), 0.0)
        if not np.all((err <= tol) | ~finite):  # non-finite values: compared above
            ok = False
        worst = max(worst, float(np.max(err)) if not np.isnan(err).any() else float("inf"))
    out = {"ok": bool(ok), "max_abs_err": worst, "rtol": rtol,
           "atol": f"{ATOL} x max|output|" if atol is None else atol,
           "outputs": len(reference)}
    if floor is not None:
        out["atol_floor"] = max(floors, default=0.0)
    return out


def proofs_cut_note(late: int) -> str:
    """The report's note where a rule file's proofs stopped at the time limit.

    ``late``: how many of its rules had not been proved by then.
    """
    return (f"the time limit's share for proving the rule file passed with {late} of its "
            "rules not yet proved: they were left out of the search (unless "
            "--allow-unverified); the proofs done are kept, so a next run goes on from them "
            "(--trust-proofs takes the file's own stamps)")


def search_report(name: str, graph: Graph, result, options: OptimizeOptions, substitutions,
                  notes=()) -> dict:
    """The report dictionary (printed by :func:`format_report`) for one search.

    ``result`` is a :class:`taso_jax.search.SearchResult` found with ``options``; costs are
    in microseconds.
    """
    unmeasurable = result.unmeasurable
    if unmeasurable:
        notes = [*notes, f"{len(unmeasurable)} kernel(s) would not run alone on stand-in "
                 f"values and were priced by the analytic model (first: {unmeasurable[0]})"]
    late = (result.rules or {}).get("not_proved_in_time")
    if late:
        notes = [*notes, proofs_cut_note(late)]
    return {
        "model": name, "notes": list(notes), "target": options.target,
        "operators_before": dict(graph.op_counts()),
        "operators_after": dict(result.graph.op_counts()),
        "cost": {"model": options.cost_model_name, "before_us": result.cost_before,
                 "after_us": result.cost_after},
        "search": {"seconds": result.seconds, "iterations": result.iterations,
                   "explored": result.explored, "stopped": result.stopped,
                   "out_of_time_in": result.out_of_time_in,
                   "alpha": options.alpha, "budget": options.budget,
                   "substitutions": len(substitutions)},
        "rules": dict(result.rules),
        "applied": dict(result.applied),
        "laws": {s.name: s.law for s in substitutions if s.name in result.applied},
        "proof": {s.name: s.proof_status for s in substitutions if s.name in result.applied},
        "end_to_end": dict(result.end_to_end or {}),
    }


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
                     "import, search, kernel measurement and end-to-end choice)")
    lines.append(f"backtracking search: {s['seconds']:.1f} s, {s['iterations']} graphs expanded, "
                 f"{s['explored']} explored, stopped: {s['stopped']}, "
                 f"{s['substitutions']} substitutions")
    if s.get("out_of_time_in"):
        lines.append(f"time limit reached during: {s['out_of_time_in']}")
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
        k = r["check"]
        scales = (f", inputs N(0,1) x {' and x '.join(f'{x:g}' for x in k['scales'])}"
                  if k.get("scales") else "")
        lines.append(f"output check ({k.get('reference', 'onnxruntime')}, original vs optimized"
                     f"{scales}, rtol {k['rtol']}, atol {k['atol']}): "
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
                     + (f"; {k['error']}" if k.get("error") else ""))
    if r.get("written"):
        lines.append(_written_line(r))
    return "\n".join(lines)


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
    constants such as masks and biases computed once).
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
    lines = []
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
