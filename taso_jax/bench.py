"""The benchmark table of ``taso-jax bench``: original and optimized graphs under ``jax.jit``.

:func:`bench_graph` and :func:`write_results` give, per model, both graphs timed in one
process, interleaved, after warm-up (median, min and max in microseconds), the search time,
the substitutions applied, and the rank correlation between the cost model's estimates and
the measured times. The end-to-end choice itself is part of optimizing and lives in
:mod:`taso_jax.search.choose`.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import re
from collections import Counter
from pathlib import Path

import numpy as np

from taso_jax._io import atomic_write
from taso_jax.ir.executor import MIN_SAMPLE_US
from taso_jax.ir.graph import Graph, TensorType, leaf_node, rebuild_node, topo_order
from taso_jax.optimizer import Optimizer
from taso_jax.search.choose import choose_fastest, device_name, rank_correlation, time_graphs
from taso_jax.search.options import OptimizeOptions
from taso_jax.search.paired_test import paired_speedup

__all__ = ["bench_graph", "with_float_dtype", "search_and_choose", "graph_digest", "rule_family",
           "merge_rows", "read_results", "results_path", "write_results", "format_table"]


def bench_graph(name: str, graph: Graph, cost_model="measured", budget: int = 100,
                time_limit: float = 60.0, repeats: int = 50, candidates: int = 4,
                sample: int = 8, substitutions=None, layouts: bool = True,
                retimes: int = 0) -> dict:
    """Optimize ``graph`` and time it against the original, for one row of the benchmark.

    The optimizer's pipeline runs with these settings (:func:`search_and_choose`): the
    search keeps its ``candidates`` cheapest graphs; they, the candidates that second-guess
    its cost model (:func:`~taso_jax.search.options.add_second_opinions`) and the NHWC forms
    of the input and of the cheapest (``layouts``) are timed end to end and the fastest
    confirmed faster is kept (:func:`choose_fastest`), as ``taso-jax optimize`` does.
    The cost model's rank correlation is taken apart, over the input and ``sample`` more of the
    graphs the search visited (never kept). Then the original and the chosen graph are timed
    again, interleaved, ``repeats`` rounds or as many as fit in :data:`FINAL_SECONDS` (at most
    :data:`MAX_FINAL_ROUNDS`; the input alone when it is kept: the speedup is then exactly 1).
    Times are microseconds of one call of the ``jax.jit``-compiled graph on the current device.
    With ``retimes``, the same two graphs are timed that many more times, each as long as the
    final timing: how far the speedup of one fixed pair moves between loops, apart from which
    graph the search chose (a spread of runs with different choices mixes both).

    Returns a dictionary: ``model, device, operators_before/after, estimated_us_before/after,
    search_seconds, iterations, applied, original_us, optimized_us`` (each ``median_us``,
    ``min_us``, ``max_us``), ``speedup`` (the median of the per-round ratios, which a
    machine's drifting load does not bias), ``speedup_of_medians``, ``end_to_end`` (what
    :func:`choose_fastest` measured, with the rank correlation), ``kept_digest`` (a content
    hash of the graph kept, equal across processes for equal graphs: :func:`graph_digest`),
    ``retimed_speedups`` (one per retime). ``search_seconds`` covers every search: the
    backtracking search and the second opinions (what older result files cover:
    docs/benchmarks.md, "Why the search and choice work as they do").
    """
    opts = OptimizeOptions(budget=budget, time_limit=time_limit, cost_model=cost_model,
                           substitutions=substitutions, layout_candidates=layouts)
    r, e2e, search_seconds = search_and_choose(graph, opts, candidates=candidates)
    if sample > 0:  # ...and the cost model's rank correlation over more graphs, apart
        e2e.update(_rank_correlation(r, sample))
    # Short calls get more rounds: under load the median of 50 per-round ratios of a 3 ms
    # call moved by +-0.1 between loops (TASO's NasRNN, one of two cores taken).
    rounds = min(MAX_FINAL_ROUNDS, max(repeats, int(FINAL_SECONDS * 1e6 / (
        2 * max(e2e["times_us"][0], MIN_SAMPLE_US)))))
    if r.graph.key == graph.key:  # the input is returned as is: one graph, one measurement
        before = after = time_graphs([graph], repeats=rounds)[0]
        speedup = 1.0
    else:
        before, after = time_graphs([graph, r.graph], repeats=rounds)
        speedup = paired_speedup(before["times_us"], after["times_us"])["speedup"]
    retimed = [1.0 if r.graph.key == graph.key else paired_speedup(
        *(t["times_us"] for t in time_graphs([graph, r.graph], repeats=rounds)))["speedup"]
        for _ in range(max(0, retimes))]
    before, after = ({k: v for k, v in t.items() if k != "times_us"} for t in (before, after))
    return {
        "model": name, "device": device_name(),
        "operators_before": sum(graph.op_counts().values()),
        "operators_after": sum(r.graph.op_counts().values()),
        "estimated_us_before": r.cost_before, "estimated_us_after": r.cost_after,
        "cost_model": opts.cost_model_name,
        "date": datetime.date.today().isoformat(),
        "search_seconds": search_seconds, "iterations": r.iterations,
        "applied": {k: v for k, v in sorted(r.applied.items(), key=lambda kv: -kv[1])},
        "original_us": before, "optimized_us": after,
        "speedup": speedup,
        "speedup_of_medians": before["median_us"] / after["median_us"],
        "end_to_end": e2e,
        "kept_digest": graph_digest(r.graph),
        "retimed_speedups": retimed,
    }


def with_float_dtype(graph: Graph, dtype: str) -> Graph:
    """``graph`` with its floating-point inputs and weights of element type ``dtype``.

    Every operator is rebuilt on the new leaves, so its output types follow (the shape rules
    carry the input's element type). For the benchmark suite in reduced precision
    (``taso-jax bench --dtype bfloat16``); ``dtype`` is a NumPy or ml_dtypes name.

    Raises:
        TypeError: ``dtype`` is not a floating-point type.
    """
    import jax.numpy as jnp

    target = jnp.dtype(dtype)
    if not jnp.issubdtype(target, jnp.floating):
        raise TypeError(f"{dtype!r} is not a floating-point type")

    def floating(t: TensorType) -> bool:
        return bool(jnp.issubdtype(jnp.dtype(t.dtype), jnp.floating))

    new, weights = {}, dict(graph.weights)
    for n in topo_order(graph.outputs + tuple(t for i in graph.inputs for t in i.outputs)):
        if n.op in ("input", "weight"):
            t = n.types[0]
            if floating(t):
                new[n] = leaf_node(n.op, n.name, TensorType(t.shape, target.name))
                if n.op == "weight":
                    weights[n.name] = np.asarray(weights[n.name]).astype(target)
            else:
                new[n] = n
        else:
            new[n] = rebuild_node(n, [type(t)(new[t.node], t.index) for t in n.inputs])
    return Graph(tuple(new[i] for i in graph.inputs),
                 tuple(type(t)(new[t.node], t.index) for t in graph.outputs),
                 graph.output_names, weights, graph.meta)


def search_and_choose(graph: Graph, opts: OptimizeOptions, candidates: int = 4) -> tuple:
    """The bench's search and end-to-end choice for ``graph``: the optimizer's own pipeline.

    :meth:`taso_jax.optimizer.Optimizer.search` with ``opts`` and ``end_to_end=candidates``
    (search, second opinions, end-to-end choice under one deadline), holding every graph the
    search visited (for the cost model's rank correlation). Where no choice ran (one
    candidate and no NHWC form), the input is timed alone by
    :func:`~taso_jax.search.choose.choose_fastest`. Returns ``(result, end_to_end, seconds)``:
    the :class:`~taso_jax.search.SearchResult` whose ``graph`` is the graph kept, what the
    choice measured, and the seconds of the searches (the backtracking search and the
    second opinions, not the choice).
    """
    r = Optimizer(opts, end_to_end=candidates).search(graph, record=None)
    e2e = dict(r.end_to_end) or choose_fastest(r)  # nothing to choose: the input timed
    return r, e2e, r.seconds + r.second_opinion_seconds


def graph_digest(graph: Graph) -> str:
    """A short content hash of ``graph`` (12 hex digits of SHA-256), equal across processes.

    Built over the operators in topological order: each operator's name, attributes, output
    types and the digests of its inputs, so two graphs with the same operators wired the same
    way get the same digest however they were reached. Weight values are not hashed (weights
    are named; a rewrite's new weights are operators over them). Used to tell whether two runs
    of the search kept the same graph. An opaque region is hashed by its callable's ``repr``,
    which may hold a memory address: graphs with opaque regions may differ between processes.
    """
    seen: dict = {}
    for n in graph.nodes:
        ins = ",".join(f"{seen[t.node]}:{t.index}" for t in n.inputs)
        text = f"{n.op}|{n.attrs!r}|{[(t.shape, t.dtype) for t in n.types]!r}|{ins}"
        seen[n] = hashlib.sha256(text.encode()).hexdigest()[:16]
    outs = ",".join(f"{seen[t.node]}:{t.index}" for t in graph.outputs)
    return hashlib.sha256(outs.encode()).hexdigest()[:12]


#: Seconds the final timing of :func:`bench_graph` aims at (more rounds for short calls).
FINAL_SECONDS = 4.0
#: Rounds of that timing at most.
MAX_FINAL_ROUNDS = 400


def _rank_correlation(result, sample: int) -> dict:
    """The cost model's rank correlation (Spearman) over visited graphs, timed apart.

    The input and ``sample`` visited graphs spread evenly by estimate are timed in one
    interleaved loop of 5 rounds; they are timed for the cost model's sake only, never kept.
    """
    pool = sorted(result.visited, key=lambda v: v.cost)
    picked = {result.visited[0].graph.key: result.visited[0]}
    for i in np.linspace(0, len(pool) - 1, min(sample, len(pool))).round().astype(int):
        picked.setdefault(pool[int(i)].graph.key, pool[int(i)])
    graphs = list(picked.values())
    if len(graphs) < 3:
        return {"rank_correlation": None, "correlation_graphs": len(graphs)}
    medians = [t["median_us"] for t in time_graphs([v.graph for v in graphs], repeats=5)]
    rho = rank_correlation([v.cost for v in graphs[:len(medians)]], medians)
    return {"rank_correlation": None if rho != rho else rho,
            "correlation_graphs": len(medians)}


def rule_family(name: str) -> str:
    """A rule's name without its number (``merge-conv2d-conv2d-3`` -> ``merge-conv2d-conv2d``).

    Names of rule files written before stable names (``conv:conv2d+conv2d=>...#3``) lose
    their domain and number.
    """
    return re.sub(r"-\d+$", "", name.split("#")[0].split(":")[-1])


def format_table(rows: list[dict]) -> str:
    """The results as a markdown table (times in milliseconds, median [min, max])."""
    def ms(t):
        return f"{t['median_us'] / 1e3:.2f} [{t['min_us'] / 1e3:.2f}, {t['max_us'] / 1e3:.2f}]"

    lines = ["| model | operators | jax.jit (ms) | optimized (ms) | speedup | search (s) | "
             "rank corr. | applied |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        applied = Counter()
        for k, v in r["applied"].items():
            applied[rule_family(k)] += v
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
