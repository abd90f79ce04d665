"""The end-to-end choice: time a search's cheapest graphs and its input, keep the fastest.

The cost model ranks graphs; the device decides. :func:`choose_fastest` times the input and
the search's cheapest candidates under ``jax.jit`` on the current device, interleaved, and
keeps the fastest by median, so the optimizer never returns a graph that runs slower than
its input by more than the noise of the measurement. :func:`rank_correlation` says how well
the cost model's order agreed with the measured one.
"""

from __future__ import annotations

import os
import time
from collections import Counter

import numpy as np

from taso_jax.ir.executor import compile_graph, random_inputs, time_interleaved
from taso_jax.ir.graph import Graph

__all__ = ["device_name", "time_graphs", "rank_correlation", "choose_fastest",
           "measured_set", "keep_fastest"]


def device_name() -> str:
    """The current JAX device: ``"gpu:NVIDIA H100 80GB HBM3"``, or ``"cpu:N cores"``."""
    import jax

    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return f"cpu:{os.cpu_count()} cores"
    return f"{dev.platform}:{getattr(dev, 'device_kind', '') or dev.platform}"


def time_graphs(graphs: list[Graph], repeats: int = 50, warmup: int = 3,
                seed: int = 0, deadline: float | None = None) -> list[dict]:
    """Wall time of each graph under ``jax.jit`` on the same random inputs, in microseconds.

    The graphs must share their runtime inputs (equivalent graphs do). Each is compiled once
    (weight-only subgraphs folded ahead of time, :func:`taso_jax.compile_graph`), warmed up,
    then run round robin ``repeats`` times, so that machine noise hits all of them alike
    (fewer once ``deadline``, a ``time.perf_counter()`` value, has passed; at least 3).
    Returns ``{"median_us", "min_us", "max_us", "repeats"}`` per graph, in order; past the
    deadline, graphs whose compilation would overrun it are left out of the list (the
    first two are always timed).

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
    fns, slowest = [], 0.0
    for g in graphs:
        if (deadline is not None and len(fns) >= 2
                and time.perf_counter() + slowest > deadline):
            break  # compiling one more would run past the deadline
        t0 = time.perf_counter()
        fn = compile_graph(g)
        jax.block_until_ready(fn(*xs))  # jax.jit compiles on the first call
        slowest = max(slowest, time.perf_counter() - t0)
        fns.append(fn)
    times = time_interleaved([lambda f=f: f(*xs) for f in fns], repeats, warmup, deadline)
    return [{"median_us": float(np.median(ts)), "min_us": float(np.min(ts)),
             "max_us": float(np.max(ts)), "repeats": len(ts)} for ts in times]


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
    pool = sorted(result.visited, key=lambda v: v.cost)
    if sample > 0 and pool:
        for i in np.linspace(0, len(pool) - 1, min(sample, len(pool))).round().astype(int):
            c, g, path = pool[int(i)]
            chosen.setdefault(g.key, (c, g, path))
    return list(chosen.values())


def choose_fastest(result, repeats: int = 20, sample: int = 0,
                   deadline: float | None = None) -> dict:
    """Time a search's candidate graphs end to end and make ``result`` the fastest.

    ``result`` is a :class:`taso_jax.search.SearchResult`. Its input graph, its
    ``candidates`` (the cheapest by estimate) and ``sample`` more of its ``visited`` graphs,
    spread evenly over their estimated costs, are timed with :func:`time_graphs`. The fastest
    by median replaces ``result.graph`` (``cost_after`` and ``applied`` follow it); when none
    is faster than the input, the input is kept, so the result is never slower than the
    input by more than the noise of this measurement. ``result`` is changed in place.
    Past ``deadline`` (a ``time.perf_counter()`` value) fewer rounds are timed (at least 3).

    Returns ``{"measured", "original_kept", "chosen", "times_us", "estimates_us",
    "rank_correlation", "device", "repeats"}``: the rank correlation (Spearman) between the
    cost model's estimates and the measured medians over the graphs timed (``None`` when
    fewer than three graphs were timed, or all estimates are equal).
    """
    graphs = measured_set(result, sample, deadline)
    times = time_graphs([g for _, g, _ in graphs], repeats=repeats, deadline=deadline)
    return keep_fastest(result, graphs[:len(times)], [t["median_us"] for t in times],
                        times[0]["repeats"], device_name())


def measured_set(result, sample: int = 0, deadline: float | None = None) -> list[tuple]:
    """What an end-to-end choice times: ``(cost, graph, path)``, the input first.

    The input, the candidates, and up to ``sample`` visited graphs spread evenly by
    estimated cost; past ``deadline`` (``time.perf_counter()``), the input and the
    cheapest candidate only.
    """
    graphs = _measured_set(result, sample)
    if deadline is not None and time.perf_counter() > deadline:
        graphs = graphs[:2]
    return graphs


def keep_fastest(result, graphs: list[tuple], medians: list[float], repeats: int,
                 device: str, noise: float = 1.0, **extra) -> dict:
    """Make ``result`` the fastest of ``graphs`` (input first) by median; the report dict.

    A candidate replaces the input only if its median is below ``noise`` times the
    input's. ``result.graph``, ``cost_after`` and ``applied`` follow the choice. Returns
    the dict :func:`choose_fastest` documents, with ``extra`` entries added.
    """
    chosen = min(range(len(graphs)), key=lambda i: (medians[i], i))
    if medians[chosen] >= noise * medians[0]:  # graphs[0] is the input
        chosen = 0
    cost, graph, path = graphs[chosen]
    result.graph, result.cost_after, result.applied = graph, cost, Counter(path)
    estimates = [c for c, _, _ in graphs]
    rho = rank_correlation(estimates, medians)
    return {"measured": len(graphs), "original_kept": chosen == 0, "chosen": chosen,
            "times_us": list(medians), "estimates_us": estimates,
            "rank_correlation": None if rho != rho else rho, "device": device,
            "repeats": repeats, **extra}
