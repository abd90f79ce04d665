"""How much of a spread of cold-cache runs is the search's choice, and how much is timing.

``taso-jax bench`` run three times with a cold kernel cost cache gives three speedups, each
of a different kept graph timed in its own loop: a spread of such runs mixes what the search
chose with how one loop's timing differs from the next. This benchmark separates the two.
In one process it runs the bench's search and end-to-end choice (:func:`taso_jax.bench.
search_and_choose`) ``--runs`` times on one model, each with a new, empty kernel cost cache,
and keeps each run's graph. Then it times the original and every kept graph together, round
robin in one loop (:func:`taso_jax.search.choose.time_graphs`), ``--loops`` times:

- within one loop, the kept graphs' speedups over the original differ only by what the
  searches chose (the **choice spread**);
- across loops, one graph's speedup differs only by timing (the **timing spread**).

Run: python benchmarks/choice_spread.py [MODEL] [--runs 3] [--loops 3] [--small]
     [--time-limit S] [--busy-core] [--json FILE]

``--busy-core`` keeps one core busy (a Python loop in a child process) for the whole run, the
load under which issue 17 asked for the spread. Prints a markdown table; times are
microseconds of one ``jax.jit`` call on the current device, speedups the median of per-round
ratios (:func:`taso_jax.search.paired_test.paired_speedup`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent.parent / "examples" / "models"
sys.path.insert(0, str(MODELS_DIR.parent))
from models import MODELS  # noqa: E402
from taso_jax.search.choose import device_name, paired_speedup, time_graphs  # noqa: E402
from taso_jax.search.cost import COST_CACHE_ENV  # noqa: E402
from taso_jax.search.options import OptimizeOptions  # noqa: E402

from taso_jax._io import atomic_write  # noqa: E402
from taso_jax._malloc import malloc_setting, restart_with_hugepages  # noqa: E402
from taso_jax.bench import FINAL_SECONDS, MAX_FINAL_ROUNDS, graph_digest, search_and_choose  # noqa: E402
from taso_jax.report import end_to_end_line  # noqa: E402


def _plain(value):  # numpy scalars in the end-to-end reports, for json.dumps
    return value.item() if hasattr(value, "item") else str(value)


def _spread(values: list[float]) -> float:
    return max(values) - min(values) if values else 0.0


def _spreads(loops: list[list[float]]) -> tuple[list[float], list[float]]:
    """``(choice spread per loop, across kept graphs; timing spread per graph, across loops)``."""
    return ([_spread(speedups) for speedups in loops],
            [_spread([loop[i] for loop in loops]) for i in range(len(loops[0]) if loops else 0)])


def _print_table(runs: list[dict], loops: list[list[float]]) -> None:
    """A markdown table: a row per kept graph (its speedup in each loop), then the spreads."""
    choice, timing = _spreads(loops)
    print("| kept graph | rewrites | " + " | ".join(f"loop {j + 1}" for j in range(len(loops)))
          + " | timing spread |")
    print("|---|---|" + "---|" * len(loops) + "---|")
    for i, run in enumerate(runs):
        print(f"| {run['digest']} | {sum(run['applied'].values())} | "
              + " | ".join(f"{loop[i]:.2f}x" for loop in loops) + f" | {timing[i]:.2f} |")
    print("| choice spread | | " + " | ".join(f"{c:.2f}" for c in choice) + " | |")


def main() -> int:
    restart_with_hugepages()  # steadier timings (taso_jax._malloc); TASO_JAX_HUGEPAGES=off: not
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default="nasnet_a", choices=sorted(MODELS))
    ap.add_argument("--runs", type=int, default=3, help="cold-cache searches (kept graphs)")
    ap.add_argument("--loops", type=int, default=3, help="loops timing all of them together")
    ap.add_argument("--small", action="store_true", help="the model at its small shapes")
    ap.add_argument("--time-limit", type=float, default=60.0, help="seconds for each search")
    ap.add_argument("--busy-core", action="store_true", help="keep one core busy meanwhile")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    if args.json and not Path(args.json).resolve().parent.is_dir():
        print(f"error: --json {args.json}: its folder does not exist", file=sys.stderr)
        return 2
    cfg = dict(MODELS[args.model].SMALL) if args.small else {}
    graph = MODELS[args.model].build(**cfg)
    busy = (subprocess.Popen([sys.executable, "-c", "while True: pass"])
            if args.busy_core else None)
    try:
        return _run(args, graph)
    finally:
        if busy is not None:
            busy.kill()


def _run(args, graph) -> int:
    opts = OptimizeOptions(time_limit=args.time_limit)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            os.environ[COST_CACHE_ENV] = os.path.join(tmp, f"costs{i}.sqlite")  # cold
            t0 = time.perf_counter()
            r, e2e, search_s = search_and_choose(graph, opts)
            runs.append({"graph": r.graph, "digest": graph_digest(r.graph),
                         "applied": dict(r.applied), "search_s": search_s,
                         "run_s": time.perf_counter() - t0,
                         "original_us": e2e["times_us"][0],  # as the choice screened it
                         "end_to_end": {k: v for k, v in e2e.items() if k != "device"}})
            print(f"run {i + 1}: graph {runs[-1]['digest']}, {sum(r.applied.values())} rewrites "
                  f"({', '.join(f'{k} x{v}' for k, v in r.applied.items())}), "
                  f"{runs[-1]['run_s']:.0f} s\n  {end_to_end_line(e2e)}", flush=True)
    graphs = [graph] + [run["graph"] for run in runs]
    first = min(run["original_us"] for run in runs)
    rounds = min(MAX_FINAL_ROUNDS, max(50, int(FINAL_SECONDS * 1e6 / (len(graphs) * first))))
    loops, floor_loops = [], []
    for _ in range(args.loops):
        timed = time_graphs(graphs, repeats=rounds)
        times = [t["times_us"] for t in timed]
        loops.append([paired_speedup(times[0], t)["speedup"] for t in times[1:]])
        floor_loops.append([timed[0]["min_us"] / t["min_us"] for t in timed[1:]])
    malloc = malloc_setting()
    choice, timing = _spreads(loops)
    print(f"\n{args.model}{' (small)' if args.small else ''}; device {device_name()}; "
          f"{datetime.date.today()}; {len(runs)} cold-cache searches, {args.loops} loops of "
          f"{rounds} rounds{'; one core kept busy' if args.busy_core else ''}; original "
          f"{first / 1000:.1f} ms; malloc {malloc}\n")
    _print_table(runs, loops)
    print("\nThe same loops, speedups as the ratio of fastest rounds (original's over the kept "
          "graph's):\n")
    _print_table(runs, floor_loops)
    if args.json:
        out = {"model": args.model, "small": args.small, "device": device_name(),
               "date": datetime.date.today().isoformat(), "busy_core": args.busy_core,
               "rounds": rounds, "original_us": first, "malloc": malloc,
               "runs": [{k: v for k, v in run.items() if k != "graph"} for run in runs],
               "speedups_by_loop": loops, "choice_spread": choice, "timing_spread": timing,
               "floor_speedups_by_loop": floor_loops}
        text = json.dumps(out, indent=1, default=_plain)
        atomic_write(args.json, lambda tmp: Path(tmp).write_text(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
