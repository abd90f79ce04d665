"""Benchmark ``@taso_jax.optimize`` on the JAX models in ``examples/jax_models.py``.

For each model, in a fresh persistent graph cache:

* the first call: optimize with the measured cost model (kernels timed on this machine's JAX
  device, cached), check the outputs against ``jax.jit`` of the original, time it against
  ``jax.jit`` of the original; its seconds, split into the decorator's stages;
* the steady state: the decorated function and ``jax.jit`` of the original, called the way a
  user calls them, in one loop, interleaved in alternating order (medians, min and max of
  ``--repeats`` rounds, in microseconds; the speedup is the median of the per-round ratios,
  which the machine's drifting load does not bias);
* for models with a hand-rewritten form (``jax_models.HAND_REWRITTEN``: NasRNN with its
  matmuls merged by hand), ``jax.jit`` of that form in the same loop: the speedup a person
  gets by hand on this machine, the ceiling to read the optimized speedup against;
* the first call in a second process that shares the graph cache (``--no-second-process``
  skips it);
* the decorator's per-call overhead over ``jax.jit`` where it runs the original: the median
  of the per-round differences, in microseconds (``--overhead-rounds``).

Prints a markdown table; ``--json FILE`` writes the figures.

    python benchmarks/jax_models.py                  # all models
    python benchmarks/jax_models.py nasrnn eqx_mlp   # some
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import jax_models  # noqa: E402

import taso_jax  # noqa: E402
from taso_jax._io import atomic_write  # noqa: E402
from taso_jax.frontends.graph_cache import GRAPH_CACHE_ENV  # noqa: E402
from taso_jax.ir.executor import time_interleaved  # noqa: E402

DTYPE = "float32"  # --dtype: the element type of every model's float weights and inputs


def _in_dtype(tree):
    """``tree`` with its floating-point array leaves cast to :data:`DTYPE`."""
    if DTYPE == "float32":
        return tree
    import jax.numpy as jnp

    return jax.tree_util.tree_map(
        lambda x: x.astype(DTYPE) if hasattr(x, "dtype") and jnp.issubdtype(
            x.dtype, jnp.floating) else x, tree)


def _model(name: str):
    fn, weights, inputs = jax_models.MODELS[name]()
    return fn, _in_dtype(weights), _in_dtype(inputs)


def _decorate(name: str, budget: int, time_limit: float, cost_model: str):
    fn, weights, inputs = _model(name)
    opt = taso_jax.optimize(fn, weight_argnums=0, budget=budget, time_limit=time_limit,
                            cost_model=cost_model)
    return fn, weights, inputs, opt


def first_call(name: str, budget: int, time_limit: float, cost_model: str) -> dict:
    """Seconds of the decorated function's first call (a new process's view)."""
    fn, weights, inputs, opt = _decorate(name, budget, time_limit, cost_model)
    t0 = time.perf_counter()
    jax.block_until_ready(opt(weights, *inputs))
    e = opt._last
    return {"seconds": time.perf_counter() - t0, "cache_hit": bool(e.cache_hit),
            "runs": "jax.jit original" if opt.original_kept else "optimized"}


def bench(name: str, repeats: int, budget: int, time_limit: float, cost_model: str,
          second_process: bool) -> dict:
    fn, weights, inputs, opt = _decorate(name, budget, time_limit, cost_model)
    t0 = time.perf_counter()
    jax.block_until_ready(opt(weights, *inputs))
    first = time.perf_counter() - t0
    if opt.fallback_reason:
        raise SystemExit(f"{name}: fell back to jax.jit: {opt.fallback_reason}")
    ref = jax.jit(fn)
    fns = [lambda: ref(weights, *inputs), lambda: opt(weights, *inputs)]
    hand = jax_models.HAND_REWRITTEN.get(name)
    if hand is not None:
        hand_fn, hand_weights = hand(fn, weights, inputs)
        hand_fn = jax.jit(hand_fn)
        fns.append(lambda: hand_fn(hand_weights, *inputs))
    ta, tb, *th = time_interleaved(fns, repeats, warmup=2)
    ratios = np.asarray(ta) / np.asarray(tb)
    r = opt._last.result
    row = {"model": name, "operators_before": sum(opt.graph.op_counts().values()),
           "operators_after": sum(r.graph.op_counts().values()),
           "applied": dict(r.applied), "search_s": r.seconds, "first_call_s": first,
           "first_call_stages_s": dict(opt._last.first_call),
           "jit_us": [float(np.median(ta)), float(np.min(ta)), float(np.max(ta))],
           "optimized_us": [float(np.median(tb)), float(np.min(tb)), float(np.max(tb))],
           "speedup": float(np.median(ratios)),
           "rounds_won": int(np.sum(ratios > 1.0)), "repeats": repeats,
           "runs": "jax.jit original" if opt.original_kept else "optimized",
           "max_abs_err": opt._last.report["check"]["max_abs_err"]}
    if th:
        row["hand_us"] = float(np.median(th[0]))
        row["hand_speedup"] = float(np.median(np.asarray(ta) / np.asarray(th[0])))
    if second_process:
        cmd = [sys.executable, __file__, "--second-process", name, "--budget", str(budget),
               "--time-limit", str(time_limit), "--cost-model", cost_model, "--dtype", DTYPE]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=os.environ)
        row["second_process"] = json.loads(out.stdout.strip().splitlines()[-1])
    return row


def overhead(name: str, rounds: int) -> dict | None:
    """Per-call microseconds the decorator adds to ``jax.jit`` where it runs the original.

    With no rules the graph stays unchanged; where the first call then measures the
    original as fast, the decorated function takes its fast path to ``jax.jit`` of the
    function itself. ``None`` where it measured the staged graph (weight-only work folded)
    faster.
    """
    fn, weights, inputs = _model(name)
    opt = taso_jax.optimize(fn, weight_argnums=0, substitutions=[])
    jax.block_until_ready(opt(weights, *inputs))
    if not opt.original_kept:
        return None
    ref = jax.jit(fn)
    ta, tb = time_interleaved([lambda: ref(weights, *inputs), lambda: opt(weights, *inputs)],
                              rounds, warmup=20)
    diff = np.asarray(tb) - np.asarray(ta)
    return {"model": name, "jit_us": float(np.median(ta)), "decorated_us": float(np.median(tb)),
            "overhead_us": float(np.median(diff)), "rounds": rounds}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="*", default=[m for m in jax_models.MODELS
                                                 if m != "tiny_attention"])
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--budget", type=int, default=100)
    p.add_argument("--time-limit", type=float, default=60.0)
    p.add_argument("--cost-model", default="measured", choices=["measured", "analytic"])
    p.add_argument("--overhead-rounds", type=int, default=2000)
    p.add_argument("--no-second-process", action="store_true")
    p.add_argument("--second-process", metavar="MODEL", help=argparse.SUPPRESS)
    p.add_argument("--json")
    p.add_argument("--dtype", default="float32",
                   help="element type of the float weights and inputs, e.g. bfloat16")
    a = p.parse_args(argv)
    global DTYPE
    DTYPE = a.dtype
    if a.second_process:  # the child: one first call, its figures as one JSON line
        print(json.dumps(first_call(a.second_process, a.budget, a.time_limit, a.cost_model)))
        return 0
    if a.json and Path(a.json).is_dir():
        raise SystemExit(f"--json {a.json}: is a folder")
    if GRAPH_CACHE_ENV not in os.environ:  # cold first calls, and a cache the child shares
        os.environ[GRAPH_CACHE_ENV] = tempfile.mkdtemp(prefix="taso_jax_graphs_")
    dev = jax.devices()[0]
    device = f"{dev.platform}:{getattr(dev, 'device_kind', '')}"
    rows = [bench(m, a.repeats, a.budget, a.time_limit, a.cost_model, not a.no_second_process)
            for m in a.models]
    over = [o for m in ("tiny_attention", "eqx_mlp") if a.overhead_rounds > 0
            for o in [overhead(m, a.overhead_rounds)] if o is not None]
    print(f"\ndevice {device} ({os.cpu_count()} cores), jax {jax.__version__}, {DTYPE}, "
          f"{a.cost_model} "
          f"cost model; times: median (min-max) of {a.repeats} interleaved rounds; speedup: "
          "median of the per-round ratios\n")
    print("| model | operators | jax.jit (us) | optimized (us) | speedup | rounds won | runs | "
          "by hand | first call | of which search | second process | substitutions applied |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ap = ", ".join(f"{k} x{v}" for k, v in
                       sorted(r["applied"].items(), key=lambda kv: -kv[1])[:3]) or "none"
        j, o = r["jit_us"], r["optimized_us"]
        sp = r.get("second_process")
        second = f"{sp['seconds']:.1f} s" + ("" if sp["cache_hit"] else " (miss)") if sp else "-"
        by_hand = f"{r['hand_speedup']:.2f}x" if "hand_speedup" in r else "-"
        print(f"| {r['model']} | {r['operators_before']} -> {r['operators_after']} | "
              f"{j[0]:.0f} ({j[1]:.0f}-{j[2]:.0f}) | {o[0]:.0f} ({o[1]:.0f}-{o[2]:.0f}) | "
              f"{r['speedup']:.2f}x | {r['rounds_won']}/{r['repeats']} | {r['runs']} | "
              f"{by_hand} | "
              f"{r['first_call_s']:.1f} s | "
              f"{r['first_call_stages_s'].get('search and choice', 0.0):.1f} s | {second} | {ap} |")
    for r in rows:
        st = ", ".join(f"{k} {v:.1f} s" for k, v in r["first_call_stages_s"].items())
        print(f"\n{r['model']} first call: {st}", end="")
    print()
    if over:
        print("\n| function (runs jax.jit of the original) | jax.jit (us) | decorated (us) | "
              "overhead (us, median of per-round differences) |")
        print("|---|---|---|---|")
        for o in over:
            print(f"| {o['model']} | {o['jit_us']:.1f} | {o['decorated_us']:.1f} | "
                  f"{o['overhead_us']:.2f} ({100 * o['overhead_us'] / o['jit_us']:.1f}%) |")
    if a.json:
        data = json.dumps({"device": device, "jax": jax.__version__, "dtype": DTYPE, "rows": rows,
                           "overhead": over}, indent=1)
        atomic_write(a.json, lambda tmp: Path(tmp).write_text(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
