"""TASO's benchmark suite: every model through ``taso-jax bench``, then the search time on
ResNet-50 and NasNet-A at 1x, 2x and 4x depth (with kernel costs cached: the second search
of each graph is the one timed).

Run: python benchmarks/taso_suite.py [MODEL ...] [--small] [--cost-model measured|analytic]
     [--no-scaling | --scaling-only] [--cost-cache FILE] [--fresh] [--out DIR]
     [--time-limit S] [--candidates N] [--sample N] [--retime N]
Writes benchmarks/results/<device>.json, .md and .png (see ``taso-jax bench --help``) and
<device>_scaling.md. Rows of models not named are kept from an earlier run on the same
device, so that the suite can run in pieces (a lent GPU machine allows 10 minutes a command).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent.parent / "examples" / "models"
sys.path.insert(0, str(MODELS_DIR.parent))
from models import MODELS  # noqa: E402
from taso_jax.search import backtracking_search  # noqa: E402
from taso_jax.search.choose import device_name  # noqa: E402
from taso_jax.search.cost import COST_CACHE_ENV  # noqa: E402
from taso_jax.search.options import OptimizeOptions  # noqa: E402

import taso_jax  # noqa: E402
from taso_jax._io import atomic_write  # noqa: E402
from taso_jax._malloc import restart_with_hugepages  # noqa: E402
from taso_jax.bench import results_path  # noqa: E402
from taso_jax.cli import main as cli  # noqa: E402


def _deeper(name: str, k: int, small: bool) -> dict:
    """The configuration of ``name`` with its repeated part ``k`` times as deep."""
    cfg = dict(MODELS[name].SMALL) if small else {}
    if name == "resnet50":
        cfg["blocks"] = tuple(k * b for b in cfg.get("blocks", (3, 4, 6, 3)))
    else:  # nasnet_a: normal cells per stage
        cfg["cells"] = k * cfg.get("cells", 5)
    return cfg


def depth_scaling(cost_model: str, small: bool, budget: int) -> list[dict]:
    """Search seconds on ResNet-50 (stages) and NasNet-A (cells) repeated 1, 2 and 4 times.

    The cost model is made as the optimizer and ``taso-jax bench`` make it (on XLA:CPU,
    convolutions priced in NHWC, the layout the end-to-end choice keeps).
    """
    cm = OptimizeOptions(cost_model=cost_model).make_cost_model()
    subs = [s for s in taso_jax.default_substitutions() if s.proof_status == "proved"]
    rows = []
    for name in ("resnet50", "nasnet_a"):
        for k in (1, 2, 4):
            g = MODELS[name].build(**_deeper(name, k, small))
            backtracking_search(g, subs, cm, budget=budget)  # fills the kernel cost cache
            t0 = time.perf_counter()
            r = backtracking_search(g, subs, cm, budget=budget)
            rows.append({"model": name, "depth": k, "operators": sum(g.op_counts().values()),
                         "seconds": time.perf_counter() - t0, "iterations": r.iterations,
                         "stopped": r.stopped})
    return rows


def main() -> int:
    restart_with_hugepages()  # steadier timings (taso_jax._malloc); TASO_JAX_HUGEPAGES=off: not
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", help="models to bench (default: all six)")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--cost-model", default="measured")
    ap.add_argument("--budget", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--time-limit", type=float, default=60.0,
                    help="seconds for each model's search, kernel measurement included")
    ap.add_argument("--candidates", type=int, default=4)
    ap.add_argument("--sample", type=int, default=8)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--cost-cache", help="SQLite kernel cost cache (sets TASO_JAX_COST_CACHE)")
    ap.add_argument("--fresh", action="store_true", help="drop earlier rows of this device")
    ap.add_argument("--dtype", default="float32", help="element type of inputs and weights")
    ap.add_argument("--retime", type=int, default=0, metavar="N",
                    help="time each model's original and kept graph N more times")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--no-scaling", action="store_true", help="skip the depth scaling")
    mode.add_argument("--scaling-only", action="store_true", help="only the depth scaling")
    args = ap.parse_args()
    if args.cost_cache:
        os.environ[COST_CACHE_ENV] = os.path.abspath(args.cost_cache)
    rc = 0
    if not args.scaling_only:
        rc = cli(["bench", "--cost-model", args.cost_model, "--budget", str(args.budget),
                  "--repeats", str(args.repeats), "--out", args.out,
                  "--time-limit", str(args.time_limit), "--candidates", str(args.candidates),
                  "--sample", str(args.sample), "--retime", str(args.retime), "--dtype", args.dtype,
                  "--models-dir", str(MODELS_DIR), *args.models]
                 + (["--small"] if args.small else []) + (["--fresh"] if args.fresh else []))
    if rc or args.no_scaling:
        return rc
    lines = [f"Device: {device_name()}; date: {datetime.date.today().isoformat()}; search "
             f"budget {args.budget} graphs; {'small' if args.small else 'full-size'} models.",
             "", "| model | depth | operators | search (s), costs cached | graphs expanded | "
             "stopped |", "|---|---|---|---|---|---|"]
    print("\n" + "\n".join(lines), flush=True)
    for r in depth_scaling(args.cost_model, args.small, args.budget):
        lines.append(f"| {r['model']} | {r['depth']}x | {r['operators']} | "
                     f"{r['seconds']:.1f} | {r['iterations']} | {r['stopped']} |")
        print(lines[-1], flush=True)
    path = results_path(args.out, device_name())
    path = path.with_name(f"{path.stem}_scaling.md")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: Path(tmp).write_text("\n".join(lines) + "\n"))
    print(f"written: {path}")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
