"""Optimization reports: measured run times, the output check, and the printed summary."""

from __future__ import annotations

import numpy as np

from taso_jax.ir.graph import Graph
from taso_jax.search.choose import device_name, time_graphs
from taso_jax.search.options import OptimizeOptions

__all__ = ["measure_speed", "compare_onnx", "compare_outputs", "search_report", "format_report",
           "RTOL", "ATOL"]

#: Outputs agree when ``|a - b| <= ATOL * max|b| + RTOL * |b|`` elementwise (float32 sums
#: reassociate when convolutions are merged or batchnorm is folded).
RTOL, ATOL = 1e-3, 1e-4


def measure_speed(before: Graph, after: Graph, repeats: int = 30, seed: int = 0) -> dict:
    """Median wall time in microseconds of both graphs under ``jax.jit``, same process.

    Runs are interleaved (before, after, before, ...) after warm-up so that machine noise
    hits both alike. Returns ``{"before_us", "after_us", "speedup", "device", "repeats"}``.
    """
    ta, tb = time_graphs([before, after], repeats=repeats, warmup=2, seed=seed)
    a, b = ta["median_us"], tb["median_us"]
    return {"before_us": a, "after_us": b, "speedup": a / b if b else float("nan"),
            "device": device_name(), "repeats": repeats}


def compare_onnx(original, optimized, inputs: dict) -> dict:
    """Run both ONNX models (bytes or paths) in onnxruntime on ``inputs``; compare outputs.

    Returns ``{"ok", "max_abs_err", "rtol", "atol", "outputs"}``; ``atol`` is relative to the
    largest reference magnitude of each output.
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    s0 = ort.InferenceSession(original, so, providers=["CPUExecutionProvider"])
    s1 = ort.InferenceSession(optimized, so, providers=["CPUExecutionProvider"])
    return compare_outputs(s1.run(None, inputs), s0.run(None, inputs))


def compare_outputs(actual, reference) -> dict:
    """Compare output arrays with their references (same order) within ``RTOL``/``ATOL``.

    Returns ``{"ok", "max_abs_err", "rtol", "atol", "outputs"}``; NaN matches NaN, and
    ``atol`` is relative to the largest finite reference magnitude of each output.
    """
    ok, worst = len(actual) == len(reference), 0.0
    for a, b in zip(actual, reference, strict=False):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.shape != b.shape:
            ok = False
            continue
        if b.size == 0:
            continue
        scale = float(np.max(np.abs(b[np.isfinite(b)]), initial=0.0))
        err = np.abs(a - b)
        both_nan = np.isnan(a) & np.isnan(b)
        bad = ~both_nan & ~(err <= ATOL * scale + RTOL * np.abs(b))
        if bad.any():
            ok = False
        worst = max(worst, float(np.max(np.where(both_nan, 0, err))))
    return {"ok": ok, "max_abs_err": worst, "rtol": RTOL, "atol": f"{ATOL} x max|output|",
            "outputs": len(reference)}


def search_report(name: str, graph: Graph, result, options: OptimizeOptions, substitutions,
                  notes=()) -> dict:
    """The report dictionary (printed by :func:`format_report`) for one search.

    ``result`` is a :class:`taso_jax.search.SearchResult` found with ``options``; costs are
    in microseconds.
    """
    return {
        "model": name, "notes": list(notes),
        "operators_before": dict(graph.op_counts()),
        "operators_after": dict(result.graph.op_counts()),
        "cost": {"model": options.cost_model_name, "before_us": result.cost_before,
                 "after_us": result.cost_after},
        "search": {"seconds": result.seconds, "iterations": result.iterations,
                   "explored": result.explored, "stopped": result.stopped,
                   "alpha": options.alpha, "budget": options.budget,
                   "substitutions": len(substitutions)},
        "rules": dict(getattr(result, "rules", {})),
        "applied": dict(result.applied),
        "laws": {s.name: s.law for s in substitutions if s.name in result.applied},
        "proof": {s.name: s.proof_status for s in substitutions if s.name in result.applied},
        "end_to_end": dict(getattr(result, "end_to_end", {}) or {}),
    }


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
        lines.append(f"measured time ({t['device']}, jax.jit, median of {t['repeats']}): "
                     f"{t['before_us']:.1f} us -> {t['after_us']:.1f} us "
                     f"({t['speedup']:.2f}x)")
    s = r["search"]
    lines.append(f"search: {s['seconds']:.1f} s, {s['iterations']} graphs expanded, "
                 f"{s['explored']} explored, stopped: {s['stopped']}, "
                 f"{s['substitutions']} substitutions")
    e = r.get("end_to_end") or {}
    if e:
        verdict = ("kept the original: no candidate ran faster" if e["original_kept"] else
                   "kept the fastest")
        lines.append(f"end-to-end choice ({e['device']}, jax.jit, median of {e['repeats']}): "
                     f"timed {e['measured']} graphs ("
                     + ", ".join(f"{t:.0f}" for t in e["times_us"]) + f" us); {verdict}")
    rules = r.get("rules") or {}
    if rules:
        line = f"rules used: {rules['used']} ({rules['proved']} proved)"
        if rules.get("unverified_used"):
            line += (f"; WARNING: {rules['unverified_used']} unproved rules allowed "
                     "(--allow-unverified)")
        elif rules.get("unverified_left_out"):
            line += f"; {rules['unverified_left_out']} unproved rules left out"
        lines.append(line)
    if r["applied"]:
        lines.append("substitutions applied:")
        for name, n in sorted(r["applied"].items(), key=lambda kv: -kv[1]):
            status = r.get("proof", {}).get(name, "proved")
            lines.append(f"  {n:>3} x {name}"
                         + ("" if status == "proved" else f"  [NOT PROVED: {status}]"))
            if name in r.get("laws", {}):
                lines.append(f"        {r['laws'][name]}")
    else:
        lines.append("substitutions applied: none (the input graph is returned unchanged)")
    if r.get("check"):
        k = r["check"]
        lines.append(f"output check ({k.get('reference', 'onnxruntime')}, original vs optimized, "
                     f"rtol {k['rtol']}, "
                     f"atol {k['atol']}): {'ok' if k['ok'] else 'MISMATCH'}, max abs error "
                     f"{k['max_abs_err']:.3g}")
    if r.get("written"):
        lines.append(f"written: {r['written']}")
    return "\n".join(lines)
