"""Benchmark ``@taso_jax.optimize`` on the JAX models in ``examples/jax_models.py``.

For each model: optimize with the measured cost model (kernels timed on this machine's JAX
device, cached), check the outputs against ``jax.jit`` of the original, then time both in the
same process, interleaved, after warm-up (median, min and max of ``--repeats`` runs, in
microseconds). Prints a markdown table; ``--json`` writes the figures.

    python benchmarks/jax_models.py                  # all models
    python benchmarks/jax_models.py nasrnn eqx_mlp   # some
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import jax_models  # noqa: E402

import taso_jax  # noqa: E402
from taso_jax.bench import rule_family  # noqa: E402
from taso_jax.ir.executor import time_function  # noqa: E402


def bench(name: str, repeats: int, budget: int, time_limit: float, cost_model: str) -> dict:
    fn, weights, inputs = jax_models.MODELS[name]()
    opt = taso_jax.optimize(fn, weight_argnums=0, budget=budget, time_limit=time_limit,
                            cost_model=cost_model)
    t0 = time.perf_counter()
    jax.block_until_ready(opt(weights, *inputs))
    first_call = time.perf_counter() - t0
    if opt.fallback_reason:
        raise SystemExit(f"{name}: fell back to jax.jit: {opt.fallback_reason}")
    ref = jax.jit(fn)
    orig = lambda: ref(weights, *inputs)  # noqa: E731
    new = lambda: opt(weights, *inputs)  # noqa: E731
    for f in (orig, new, orig, new):
        jax.block_until_ready(f())
    ta, tb = [], []
    for i in range(repeats):  # the order alternates: the second of a pair runs slower
        pair = [(orig, ta), (new, tb)]
        for f, ts in (pair if i % 2 == 0 else pair[::-1]):
            ts += time_function(f, repeats=1, warmup=0)
    r = opt._last.result
    check = opt._last.report["check"]
    return {"model": name, "operators_before": sum(opt.graph.op_counts().values()),
            "operators_after": sum(r.graph.op_counts().values()),
            "applied": dict(r.applied), "search_s": r.seconds, "first_call_s": first_call,
            "jit_us": [float(np.median(ta)), float(np.min(ta)), float(np.max(ta))],
            "optimized_us": [float(np.median(tb)), float(np.min(tb)), float(np.max(tb))],
            "speedup": float(np.median(ta) / np.median(tb)),
            "runs": "jax.jit original" if opt.original_kept else "optimized",
            "max_abs_err": check["max_abs_err"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="*", default=list(jax_models.MODELS))
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--budget", type=int, default=100)
    p.add_argument("--time-limit", type=float, default=60.0)
    p.add_argument("--cost-model", default="measured", choices=["measured", "analytic"])
    p.add_argument("--json")
    a = p.parse_args(argv)
    dev = jax.devices()[0]
    device = f"{dev.platform}:{getattr(dev, 'device_kind', '')}"
    rows = [bench(m, a.repeats, a.budget, a.time_limit, a.cost_model) for m in a.models]
    print(f"\ndevice {device}, jax {jax.__version__}, {a.cost_model} cost model, median "
          f"(min-max) of {a.repeats} interleaved runs\n")
    print("| model | operators | jax.jit (us) | optimized (us) | speedup | search | runs | "
          "substitutions applied |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ap = ", ".join(f"{rule_family(k)} x{v}" for k, v in
                       sorted(r["applied"].items(), key=lambda kv: -kv[1])[:3]) or "none"
        j, o = r["jit_us"], r["optimized_us"]
        print(f"| {r['model']} | {r['operators_before']} -> {r['operators_after']} | "
              f"{j[0]:.0f} ({j[1]:.0f}-{j[2]:.0f}) | {o[0]:.0f} ({o[1]:.0f}-{o[2]:.0f}) | "
              f"{r['speedup']:.2f}x | {r['search_s']:.1f} s | {r['runs']} | {ap} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": device, "jax": jax.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
