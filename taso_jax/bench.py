"""End-to-end measurement: the original and optimized graphs under ``jax.jit``, side by side.

Two uses:

* :func:`choose_fastest` times a search's best few candidate graphs (and the original) on the
  current device and keeps the fastest, so the optimizer never returns a graph that runs
  slower than its input by more than the measurement's noise;
* :func:`bench_graph` and :func:`write_results` produce the benchmark table of
  ``taso-jax bench``: per model, both graphs timed in one process, interleaved, after warm-up
  (median, min and max in microseconds), the search time, the substitutions applied, and the
  rank correlation between the cost model's estimates and the measured times.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from collections import Counter
from pathlib import Path

import numpy as np

from taso_jax._io import atomic_write
from taso_jax.executor import compile_graph, random_inputs, time_function
from taso_jax.graph import Graph

__all__ = ["time_graphs", "rank_correlation", "choose_fastest", "bench_graph", "device_name",
           "merge_rows", "read_results", "results_path", "write_results", "format_table"]


def device_name() -> str:
    """The current JAX device: ``"gpu:NVIDIA H100 80GB HBM3"``, or ``"cpu:N cores"``."""
    import jax

    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return f"cpu:{os.cpu_count()} cores"
    return f"{dev.platform}:{getattr(dev, 'device_kind', '') or dev.platform}"


def time_graphs(graphs: list[Graph], repeats: int = 50, warmup: int = 3,
                seed: int = 0) -> list[dict]:
    """Wall time of each graph under ``jax.jit`` on the same random inputs, in microseconds.

    The graphs must share their runtime inputs (equivalent graphs do). Each is compiled once
    (weight-only subgraphs folded ahead of time, :func:`taso_jax.compile_graph`), warmed up,
    then run round robin ``repeats`` times, so that machine noise hits all of them alike.
    Returns ``{"median_us", "min_us", "max_us", "repeats"}`` per graph, in order.

    Raises:
        ValueError: ``repeats < 1`` or graphs whose inputs differ.
    """
    import jax

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    sig = [(n.name, n.types[0]) for n in graphs[0].inputs]
    for g in graphs[1:]:
        if [(n.name, n.types[0]) for n in g.inputs] != sig:
            raise ValueError("time_graphs: the graphs do not have the same runtime inputs")
    xs = [jax.device_put(x) for x in random_inputs(graphs[0], seed)]
    fns = [compile_graph(g) for g in graphs]
    for _ in range(warmup):
        for f in fns:
            jax.block_until_ready(f(*xs))
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for f, ts in zip(fns, times, strict=True):
            ts += time_function(lambda f=f: f(*xs), repeats=1, warmup=0)
    return [{"median_us": float(np.median(ts)), "min_us": float(np.min(ts)),
             "max_us": float(np.max(ts)), "repeats": repeats} for ts in times]


def rank_correlation(x, y) -> float:
    """Spearman's rank correlation of two equally long sequences (NaN below 3 points).

    Ties get their average rank. Source: Spearman (1904); the Pearson correlation of ranks.
    """
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) != len(y):
        raise ValueError(f"rank_correlation: lengths differ ({len(x)} vs {len(y)})")
    if len(x) < 3:
        return float("nan")

    def ranks(v):
        order = np.argsort(v, kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v), dtype=float)
        for value in np.unique(v):  # average rank for ties
            tied = v == value
            r[tied] = r[tied].mean()
        return r

    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def _measured_set(result, sample: int) -> list[tuple]:
    """The input, the candidates, and up to ``sample`` visited graphs spread evenly by cost."""
    chosen: dict = {}
    for c, g, path in [*result.visited[:1], *result.candidates]:
        chosen.setdefault(g.key, (c, g, path))
    pool = sorted(result.visited, key=lambda v: v[0])
    if sample > 0 and pool:
        for i in np.linspace(0, len(pool) - 1, min(sample, len(pool))).round().astype(int):
            c, g, path = pool[int(i)]
            chosen.setdefault(g.key, (c, g, path))
    return list(chosen.values())


def choose_fastest(result, repeats: int = 20, sample: int = 0) -> dict:
    """Time a search's candidate graphs end to end and make ``result`` the fastest.

    ``result`` is a :class:`taso_jax.search.SearchResult`. Its input graph, its
    ``candidates`` (the cheapest by estimate) and ``sample`` more of its ``visited`` graphs,
    spread evenly over their estimated costs, are timed with :func:`time_graphs`. The fastest
    by median replaces ``result.graph`` (``cost_after`` and ``applied`` follow it); when none
    is faster than the input, the input is kept, so the result is never slower than the
    input by more than the noise of this measurement. ``result`` is changed in place.

    Returns ``{"measured", "original_kept", "times_us", "estimates_us",
    "rank_correlation", "device", "repeats"}``: the rank correlation (Spearman) between the
    cost model's estimates and the measured medians over the graphs timed (``None`` when
    fewer than three graphs were timed, or all estimates are equal).
    """
    graphs = _measured_set(result, sample)
    times = time_graphs([g for _, g, _ in graphs], repeats=repeats)
    med = [t["median_us"] for t in times]
    chosen = min(range(len(graphs)), key=lambda i: (med[i], i))
    if med[chosen] >= med[0]:  # graphs[0] is the input
        chosen = 0
    cost, graph, path = graphs[chosen]
    result.graph, result.cost_after, result.applied = graph, cost, Counter(path)
    estimates = [c for c, _, _ in graphs]
    rho = rank_correlation(estimates, med)
    return {"measured": len(graphs), "original_kept": chosen == 0, "times_us": med,
            "estimates_us": estimates, "rank_correlation": None if rho != rho else rho,
            "device": device_name(), "repeats": repeats}


def bench_graph(name: str, graph: Graph, cost_model="measured", budget: int = 100,
                time_limit: float = 60.0, repeats: int = 50, candidates: int = 4,
                sample: int = 8, substitutions=None) -> dict:
    """Optimize ``graph`` and time it against the original, for one row of the benchmark.

    The search keeps its ``candidates`` cheapest graphs; they and ``sample`` more of the graphs
    it visited are timed end to end and the fastest is kept (:func:`choose_fastest`, which
    also gives the cost model's rank correlation), then the original and the chosen graph are
    timed again, interleaved, ``repeats`` times each (the input alone when it is kept: the
    speedup is then exactly 1). Times are microseconds of one call of
    the ``jax.jit``-compiled graph on the current device.

    Returns a dictionary: ``model, device, operators_before/after, estimated_us_before/after,
    search_seconds, iterations, applied, original_us, optimized_us`` (each ``median_us``,
    ``min_us``, ``max_us``), ``speedup`` (median ratio), ``end_to_end`` (what
    :func:`choose_fastest` measured, with the rank correlation).
    """
    import taso_jax
    from taso_jax.search import backtracking_search, get_cost_model

    cm = get_cost_model(cost_model) if isinstance(cost_model, str) else cost_model
    subs = taso_jax.default_substitutions() if substitutions is None else substitutions
    subs = [s for s in subs if s.proof_status == "proved"]
    t0 = time.perf_counter()
    r = backtracking_search(graph, subs, cm, budget=budget, time_limit=time_limit,
                            keep=max(1, candidates))
    search_seconds = time.perf_counter() - t0
    e2e = choose_fastest(r, repeats=max(5, repeats // 5), sample=sample)
    if r.graph.key == graph.key:  # the input is returned as is: one graph, one measurement
        before = after = time_graphs([graph], repeats=repeats)[0]
    else:
        before, after = time_graphs([graph, r.graph], repeats=repeats)
    return {
        "model": name, "device": device_name(),
        "operators_before": sum(graph.op_counts().values()),
        "operators_after": sum(r.graph.op_counts().values()),
        "estimated_us_before": r.cost_before, "estimated_us_after": r.cost_after,
        "cost_model": cost_model if isinstance(cost_model, str) else getattr(
            cost_model, "name", type(cost_model).__name__),
        "date": datetime.date.today().isoformat(),
        "search_seconds": search_seconds, "iterations": r.iterations,
        "applied": {k: v for k, v in sorted(r.applied.items(), key=lambda kv: -kv[1])},
        "original_us": before, "optimized_us": after,
        "speedup": before["median_us"] / after["median_us"],
        "end_to_end": e2e,
    }


def _short(rule: str) -> str:
    return rule.split("#")[0].split(":")[-1]


def format_table(rows: list[dict]) -> str:
    """The results as a markdown table (times in milliseconds, median [min, max])."""
    def ms(t):
        return f"{t['median_us'] / 1e3:.2f} [{t['min_us'] / 1e3:.2f}, {t['max_us'] / 1e3:.2f}]"

    lines = ["| model | operators | jax.jit (ms) | optimized (ms) | speedup | search (s) | "
             "rank corr. | applied |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        applied = Counter()
        for k, v in r["applied"].items():
            applied[_short(k)] += v
        text = ", ".join(f"{k} x{v}" for k, v in applied.most_common()) or "none"
        if r["end_to_end"]["original_kept"] and r["applied"] == {}:
            text += " (original kept)"
        rho = r["end_to_end"]["rank_correlation"]
        lines.append(f"| {r['model']} | {r['operators_before']} -> {r['operators_after']} | "
                     f"{ms(r['original_us'])} | {ms(r['optimized_us'])} | "
                     f"{r['speedup']:.2f}x | {r['search_seconds']:.1f} | "
                     f"{'n/a' if rho is None else f'{rho:.2f}'} | {text} |")
    return "\n".join(lines)


def results_path(out_dir, device: str) -> Path:
    """``<out_dir>/<device>.json``, the device name made file-safe (``gpu_NVIDIA_H100``)."""
    stem = "".join(c if c.isalnum() or c in "-." else "_" for c in device)
    return Path(out_dir) / f"{stem}.json"


def read_results(out_dir, device: str) -> list[dict]:
    """The rows of this device's results file under ``out_dir`` (``[]`` when there is none).

    Each row has its ``date`` and ``settings``; a row without them (written by an earlier
    version) takes the file's.

    Raises:
        ValueError: the file exists but is not a results file of ``taso-jax bench``; the
            message names the file.
    """
    path = results_path(out_dir, device)
    if not path.exists():
        return []
    try:
        doc = json.loads(path.read_text())
        rows = doc["results"]
        if not all(isinstance(r, dict) and "model" in r for r in rows):
            raise TypeError("a result row without a model name")
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a results file of taso-jax bench ({e}); move it away "
                         f"or pass --fresh") from e
    # rows written before rows carried their own date and settings take the file's
    return [{"date": doc.get("date"), "settings": doc.get("settings", {}), **r} for r in rows]


def merge_rows(rows: list[dict], earlier: list[dict], order: list[str] | None = None
               ) -> tuple[list[dict], list[str]]:
    """``rows`` plus the ``earlier`` rows (:func:`read_results`) of the models not in ``rows``.

    A suite too long for one command (a lent GPU machine allows 10 minutes a command) runs
    in pieces: each piece writes its models and keeps the rest. Earlier rows are kept only
    when they were measured at the same model size (``settings["small"]``) as ``rows``; a row
    of this run replaces an earlier row of the same model. The result is in ``order`` (model
    names) where given, else earlier rows first. Each row carries its own ``date`` and
    ``settings``.

    Returns ``(merged rows, names of the models kept from the earlier rows)``.
    """
    if not rows:
        return rows, []
    small = rows[0].get("settings", {}).get("small")
    new = {r["model"] for r in rows}
    kept = [r for r in earlier if r["model"] not in new
            and r.get("settings", {}).get("small") == small]
    merged = kept + rows
    if order:
        rank = {m: i for i, m in enumerate(order)}
        merged.sort(key=lambda r: rank.get(r["model"], len(rank)))
    return merged, [r["model"] for r in kept]


def write_results(rows: list[dict], out_dir, settings: dict | None = None) -> dict:
    """Write ``<device>.json``, ``<device>.md`` and ``<device>.png`` under ``out_dir``.

    The device name is made file-safe (``gpu_NVIDIA_H100_80GB_HBM3``). The chart shows the
    median run time per model, original against optimized, normalised to the original
    (TASO, SOSP 2019, Figure 7 style); it needs matplotlib and is skipped with a note in the
    returned paths when matplotlib is missing. Files are written atomically. Rows that carry
    a ``date`` other than today's (kept by :func:`merge_rows`) are listed under the table.

    Returns ``{"json": path, "markdown": path, "chart": path or None}``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = rows[0]["device"] if rows else device_name()
    date = datetime.date.today().isoformat()
    doc = {"device": device, "date": date, "settings": settings or {}, "results": rows}
    jpath = results_path(out, device)
    paths = {"json": jpath, "markdown": jpath.with_suffix(".md"), "chart": None}
    older = [f"{r['model']} ({r['date']})" for r in rows if r.get("date", date) != date]
    note = f"\nRows from earlier runs: {', '.join(older)}.\n" if older else ""
    text = {"json": json.dumps(doc, indent=1),
            "markdown": f"Device: {device}; date: {date}.\n\n{format_table(rows)}\n{note}"}
    for kind, body in text.items():
        atomic_write(paths[kind], lambda tmp, body=body: Path(tmp).write_text(body))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return paths
    fig, ax = plt.subplots(figsize=(1.4 * max(3, len(rows)) + 1, 3.2))
    xs = np.arange(len(rows))
    ax.bar(xs - 0.2, [1.0] * len(rows), 0.4, label="jax.jit", color="#999999")
    ax.bar(xs + 0.2, [1 / r["speedup"] for r in rows], 0.4, label="taso_jax", color="#3b6ea5")
    for x, r in zip(xs, rows, strict=True):
        ax.text(x + 0.2, 1 / r["speedup"] + 0.02, f"{r['speedup']:.2f}x", ha="center",
                fontsize=8)
    ax.set_xticks(xs, [r["model"] for r in rows], fontsize=8)
    ax.set_ylabel("run time (relative)")
    ax.set_ylim(0, 1.3 * max([1.0] + [1 / r["speedup"] for r in rows]))
    ax.set_title(f"{device}, {date}", fontsize=9)
    ax.legend(fontsize=8, loc="upper center", ncol=2, frameon=False)
    fig.tight_layout()
    paths["chart"] = jpath.with_suffix(".png")
    atomic_write(paths["chart"], lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)
    return paths
