"""Optimize every shared model and light_* model; print operators, estimated cost, measured
time (original vs optimized under jax.jit, interleaved, same process) and search time.

Run: python benchmarks/shared_models.py [--cost-model measured|analytic] [--budget N]
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from pathlib import Path

import onnx

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from conftest import light_models, randomize_weights, shared_models_dir  # noqa: E402

import taso_jax  # noqa: E402
from taso_jax.report import measure_speed  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cost-model", default="measured")
    ap.add_argument("--budget", type=int, default=30)
    ap.add_argument("--time-limit", type=float, default=60)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    paths = sorted(glob.glob(str((shared_models_dir() or Path("tests/data")) / "*.onnx")))
    paths += light_models(large=True)
    subs = taso_jax.default_substitutions()
    print(f"| model | operators | estimated cost ({args.cost_model}) | measured time, jax.jit "
          "| search | applied |")
    print("|---|---|---|---|---|---|")
    for p in paths:
        name = os.path.basename(p)[:-5]
        if args.only and args.only not in name:
            continue
        model = onnx.load(p)
        if name.startswith("light_"):
            model = randomize_weights(model)  # constant weights overflow to 1e9 otherwise
        g = taso_jax.load_onnx(model)
        r = taso_jax.search_graph(g, cost_model=args.cost_model, budget=args.budget,
                                  time_limit=args.time_limit, substitutions=subs)
        t = measure_speed(g, r.graph, repeats=args.repeats)
        ops0, ops1 = sum(g.op_counts().values()), sum(r.graph.op_counts().values())
        applied = ", ".join(f"{n} x{c}" for n, c in
                            sorted(r.applied.items(), key=lambda kv: -kv[1])) or "none"
        print(f"| {name} | {ops0} -> {ops1} | {r.cost_before:.0f} -> {r.cost_after:.0f} us "
              f"({r.cost_before / r.cost_after:.3f}x) | {t['before_us']:.0f} -> "
              f"{t['after_us']:.0f} us ({t['speedup']:.2f}x) | {r.seconds:.1f} s | {applied} |",
              flush=True)


if __name__ == "__main__":
    main()
