"""Benchmark ``@taso_jax.optimize`` on the transformer workloads of examples/transformer_models.py.

For each model and sequence length ``S`` (the KV cache's length for ``llama_decode``), in a
fresh persistent graph cache:

* the first call of the decorated function (tracing, search, output check and end-to-end
  choice; seconds);
* what the decorator delivers, read from its :class:`~taso_jax.outcome.Outcome`: ``rewritten``
  with the substitutions applied, or why ``jax.jit`` of the original runs (``unchanged``,
  ``time_limit``, ``fallback``), with anything found but not delivered;
* where the first call's time limit left its comparison with ``jax.jit`` to the calls
  after it (:mod:`taso_jax.call_trial`), those calls, made until it settles (how many);
* the largest absolute difference between its outputs and ``jax.jit`` of the function's;
* the decorated function and ``jax.jit`` of the original, called the way a user calls them,
  interleaved in one loop of ``--rounds`` rounds (``time_interleaved``): median microseconds,
  and the speed-up as the median of the per-round ratios, which the host's drifting load
  does not bias.

Prints a markdown table; ``--json FILE`` writes the figures. A model that cannot be built
here (transformers not installed, ``S`` past BERT's or GPT-2's position embeddings) gets a
``skipped`` row saying why. transformers is not a dependency of the project: BERT and GPT-2
need ``pip install 'transformers<5'`` (v5 removed the Flax classes). This file is not named
``transformers.py``: run as a script, its folder leads ``sys.path``, and it would be imported
in place of the library.

Cores: XLA:CPU runs one computation on every core the process may use. ``taskset -c 0``
pins the whole run to one core (as issue 45's figures were taken); without it the run uses
every core it is given. The header line says how many it had.

    python benchmarks/transformer_suite.py                              # all, S=128,1024,2048
    taskset -c 0 python benchmarks/transformer_suite.py causal_attention llama_block --seq 1024
    python benchmarks/transformer_suite.py hf_bert hf_gpt2 --seq 128 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
sys.path.insert(1, str(Path(__file__).resolve().parent))  # _bytecode, when imported as a module

import transformer_models  # noqa: E402
from _bytecode import byte_compile_package  # noqa: E402

import taso_jax  # noqa: E402
from taso_jax._io import atomic_write  # noqa: E402
from taso_jax.frontends.graph_cache import GRAPH_CACHE_ENV  # noqa: E402
from taso_jax.ir.executor import time_interleaved  # noqa: E402

COLUMNS = ("model", "S", "dtype", "jax.jit (µs)", "optimized (µs)", "speed-up", "applied",
           "first call (s)", "max abs diff", "at inputs x10 (of max |out|)")
#: The second input scale the outputs are compared at (issue 61: equal to ``jax.jit``
#: within the element type's tolerance at two input scales): float inputs times this.
SECOND_SCALE = 10.0


def _max_abs_diff(a, b) -> float:
    """The largest absolute difference between two pytrees of arrays (in float32)."""
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    if len(la) != len(lb):
        raise ValueError(f"{len(la)} outputs against {len(lb)}")
    return max((float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32)),
                              initial=0.0)) for x, y in zip(la, lb, strict=True)), default=0.0)


def _applied_text(row: dict) -> str:
    """The "applied" cell: the verdict, the substitutions delivered or found."""
    def top(applied):
        return ", ".join(f"{k} x{v}" for k, v in
                         sorted(applied.items(), key=lambda kv: -kv[1])[:3])

    settled = (f" (settled on the {row['settle_calls']} calls after the first)"
               if row.get("settle_calls") else "")
    if row["verdict"] == "rewritten":
        return (f"rewritten: {top(row['applied'])}" if row["applied"] else "rewritten") + settled
    if row["found_not_delivered"]:
        return (f"{row['verdict']} (found, not delivered: {top(row['found_not_delivered'])})"
                + settled)
    return row["verdict"] + settled


def bench(name: str, seq: int, dtype: str, rounds: int, tiny: bool, options: dict) -> dict:
    """One row: the model ``name`` at sequence length ``seq`` in ``dtype``."""
    row = {"model": name, "S": seq, "dtype": dtype}
    sizes = transformer_models.TINY[name] if tiny else {}
    try:
        fn, weights, inputs = transformer_models.MODELS[name](seq=seq, dtype=dtype, **sizes)
    except transformer_models.Unavailable as e:
        return {**row, "skipped": str(e)}
    opt = taso_jax.optimize(fn, weight_argnums=0, **options)
    t0 = time.perf_counter()
    out = jax.block_until_ready(opt(weights, *inputs))
    first = time.perf_counter() - t0
    ref = jax.jit(fn)
    expected = jax.block_until_ready(ref(weights, *inputs))
    # Where the first call's limit left the comparison with jax.jit to the next calls
    # (taso_jax.call_trial), they are made until it settles, as a user's loop would.
    settle_calls, t1 = 0, time.perf_counter()
    while getattr(opt._last, "trial", None) is not None:
        jax.block_until_ready(opt(weights, *inputs))
        settle_calls += 1
    settle_s = time.perf_counter() - t1
    report = opt.outcome().to_json()
    ta, tb = time_interleaved([lambda: ref(weights, *inputs), lambda: opt(weights, *inputs)],
                              rounds, warmup=2)
    ratios = np.asarray(ta) / np.asarray(tb)
    outcome = report["outcome"]
    return {**row, "jit_us": float(np.median(ta)), "optimized_us": float(np.median(tb)),
            "speedup": float(np.median(ratios)), "rounds_won": int(np.sum(ratios > 1.0)),
            "rounds": len(ratios), "verdict": outcome["verdict"], "why": outcome["why"],
            "applied": dict(report.get("applied", {})),
            "found_not_delivered": dict(report.get("found_not_delivered", {})
                                        .get("applied", {})),
            "first_call_s": first, "first_call_stages_s": dict(report.get("first_call", {})),
            "settle_calls": settle_calls, "settle_s": settle_s,
            "operators": sum(report.get("operators_before", {}).values()),
            "search": dict(report.get("search", {})), "max_abs_diff": _max_abs_diff(out, expected),
            **_at_second_scale(opt, ref, weights, inputs)}


def _at_second_scale(opt, ref, weights, inputs) -> dict:
    """Both functions' outputs on the float inputs times :data:`SECOND_SCALE`: the largest
    absolute difference and the largest absolute output of ``jax.jit``'s."""
    import jax.numpy as jnp

    scaled = jax.tree_util.tree_map(
        lambda x: x * SECOND_SCALE if jnp.issubdtype(jnp.result_type(x), jnp.floating) else x,
        inputs)
    want = jax.block_until_ready(ref(weights, *scaled))
    got = jax.block_until_ready(opt(weights, *scaled))
    peak = max((float(np.max(np.abs(np.asarray(x, np.float32)), initial=0.0))
                for x in jax.tree_util.tree_leaves(want)), default=0.0)
    return {"max_abs_diff_x10": _max_abs_diff(got, want), "max_abs_x10": peak}


def _table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        head = f"| {r['model']} | {r['S']} | {r['dtype']} | "
        if "skipped" in r or "failed" in r:
            what = f"skipped: {r['skipped']}" if "skipped" in r else f"failed: {r['failed']}"
            lines.append(head + f"- | - | - | {what} | - | - | - |")
            continue
        lines.append(head + f"{r['jit_us']:.0f} | {r['optimized_us']:.0f} | "
                     f"{r['speedup']:.2f}x ({r['rounds_won']}/{r['rounds']}) | "
                     f"{_applied_text(r)} | {r['first_call_s']:.1f} | {r['max_abs_diff']:.2g} | "
                     f"{r['max_abs_diff_x10']:.2g} ({r['max_abs_x10']:.3g}) |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="*", default=list(transformer_models.MODELS),
                   help=f"of {', '.join(transformer_models.MODELS)} (default: all)")
    p.add_argument("--seq", default="128,1024,2048",
                   help="comma-separated sequence lengths (default: 128,1024,2048)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=30, help="interleaved timing rounds")
    p.add_argument("--tiny", action="store_true",
                   help="the models at the tiny sizes of transformer_models.TINY")
    p.add_argument("--budget", type=int, help="the decorator's budget (default: its own)")
    p.add_argument("--time-limit", type=float,
                   help="the decorator's time limit, seconds (default: its own)")
    p.add_argument("--cost-model", choices=["measured", "analytic"],
                   help="the decorator's cost model (default: its own)")
    p.add_argument("--json", help="write the figures to this file")
    a = p.parse_args(argv)
    unknown = sorted(set(a.models) - set(transformer_models.MODELS))
    if unknown:
        p.error(f"unknown models {unknown}; choose from {list(transformer_models.MODELS)}")
    try:
        seqs = [int(s) for s in a.seq.split(",") if s.strip()]
    except ValueError:
        p.error(f"--seq {a.seq!r}: expected comma-separated integers")
    if a.json and Path(a.json).is_dir():
        p.error(f"--json {a.json}: is a folder")
    options = {k: v for k, v in (("budget", a.budget), ("time_limit", a.time_limit),
                                 ("cost_model", a.cost_model)) if v is not None}
    if GRAPH_CACHE_ENV not in os.environ:  # cold first calls
        os.environ[GRAPH_CACHE_ENV] = tempfile.mkdtemp(prefix="taso_jax_graphs_")
    byte_compile_package()  # as an installed wheel has it
    dev = jax.devices()[0]
    device = f"{dev.platform}:{getattr(dev, 'device_kind', '')}"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    rows = []
    for name in a.models:
        for seq in seqs:
            try:
                row = bench(name, seq, a.dtype, a.rounds, a.tiny, options)
            except Exception as e:  # one model's failure is its row, not the run's end
                traceback.print_exc()
                row = {"model": name, "S": seq, "dtype": a.dtype,
                       "failed": f"{type(e).__name__}: {e}".splitlines()[0][:200]}
            rows.append(row)
            if "skipped" in row:
                print(f"{name} S={seq}: skipped: {row['skipped']}", flush=True)
            elif "failed" not in row:
                print(f"{name} S={seq}: {row['speedup']:.2f}x, {_applied_text(row)}, "
                      f"first call {row['first_call_s']:.1f} s", flush=True)
    print(f"\ndevice {device} ({cores} cores for this process), jax {jax.__version__}, "
          f"{a.dtype}; times: medians of {a.rounds} interleaved rounds; speed-up: median of "
          "the per-round ratios (rounds the optimized function won)\n")
    print(_table(rows))
    for r in rows:
        if "verdict" not in r:
            continue
        stages = ", ".join(f"{k} {v:.1f} s" for k, v in r["first_call_stages_s"].items())
        search = r["search"]
        print(f"\n{r['model']} S={r['S']}: {r['operators']} operators; search "
              f"{search.get('seconds', 0.0):.1f} s, {search.get('explored', 0)} graphs explored, "
              f"stopped: {search.get('stopped', '-')}; first call: {stages}"
              + (f"\n  {r['why']}" if r.get("why") else ""), end="")
    print()
    if a.json:
        data = json.dumps({"device": device, "cores": cores, "jax": jax.__version__,
                           "dtype": a.dtype, "rounds": a.rounds, "tiny": a.tiny,
                           "options": options, "rows": rows}, indent=1)
        atomic_write(a.json, lambda tmp: Path(tmp).write_text(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
