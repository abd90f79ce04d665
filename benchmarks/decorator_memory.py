"""Does ``@taso_jax.optimize`` release what it kept for a signature it dropped? (issue 47)

The decorator keeps at most ``SIGNATURE_CACHE`` (32) signatures per function; the least
recently called one is dropped, with its executables, folded weights and graphs. This probe
calls a small MLP (two matmuls by weights that the search merges, a ReLU, a third matmul)
on ``--shapes`` different batch sizes, in a fresh process per mode, and prints the resident
memory (RSS) growth from the first call's to the last's:

* ``jit``: ``jax.jit`` of the function (its own cache of executables grows with every shape);
* ``taso``: ``taso_jax.optimize`` of it; also how many of the dropped signatures' records
  are still alive after ``gc.collect()`` (weak references to them; 0 expected).

The decorator's growth should stay within ``jax.jit``'s plus a bounded amount (what 32
signatures hold).

Run: python benchmarks/decorator_memory.py [--shapes 120] [--width 256] [--mode both]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def rss_mb() -> float:
    """Resident memory of this process, in MB (Linux ``/proc``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def probe(mode: str, shapes: int, width: int) -> dict:
    """Call the MLP on ``shapes`` batch sizes under ``mode``; RSS and survivors."""
    import gc
    import weakref

    import jax
    import jax.numpy as jnp
    import numpy as np

    import taso_jax
    from taso_jax.ir.executor import release_memory

    rng = np.random.default_rng(0)
    w1, w2, w3 = (jnp.asarray(rng.standard_normal((width, width), np.float32) / width)
                  for _ in range(3))

    def mlp(x, w1, w2, w3):
        return jax.nn.relu(x @ w1 + x @ w2) @ w3

    fn = (jax.jit(mlp) if mode == "jit" else
          taso_jax.optimize(mlp, weight_argnums=(1, 2, 3), cost_model="analytic",
                            time_limit=2.0))
    refs, start, t0 = [], None, time.perf_counter()
    for b in range(1, shapes + 1):
        x = jnp.asarray(rng.standard_normal((b, width), np.float32))
        jax.block_until_ready(fn(x, w1, w2, w3))
        if mode == "taso":
            refs.append(weakref.ref(fn._last))
        if b == 1:
            gc.collect()
            release_memory()
            start = rss_mb()
    gc.collect()
    release_memory()
    end = rss_mb()
    from taso_jax.decorator import SIGNATURE_CACHE

    dropped = refs[:-SIGNATURE_CACHE]
    return {"mode": mode, "shapes": shapes, "rss_first_mb": round(start, 1),
            "rss_last_mb": round(end, 1), "growth_mb": round(end - start, 1),
            "seconds": round(time.perf_counter() - t0, 1),
            "dropped_alive": sum(r() is not None for r in dropped) if refs else None,
            "dropped": len(dropped) if refs else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", type=int, default=120)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--mode", choices=["jit", "taso", "both"], default="both")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(probe(args.mode, args.shapes, args.width)))
        return 0
    modes = ["jit", "taso"] if args.mode == "both" else [args.mode]
    print("| mode | shapes | RSS after the first call (MB) | after the last (MB) | growth (MB) "
          "| dropped signatures still alive | seconds |")
    print("|---|---|---|---|---|---|---|")
    for mode in modes:
        run = subprocess.run([sys.executable, __file__, "--child", "--mode", mode,
                              "--shapes", str(args.shapes), "--width", str(args.width)],
                             capture_output=True, text=True)
        if run.returncode:
            print(run.stderr[-2000:], file=sys.stderr)
            return 1
        r = json.loads(run.stdout.strip().splitlines()[-1])
        alive = "-" if r["dropped"] is None else f"{r['dropped_alive']} of {r['dropped']}"
        print(f"| {mode} | {r['shapes']} | {r['rss_first_mb']} | {r['rss_last_mb']} | "
              f"{r['growth_mb']} | {alive} | {r['seconds']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
