"""TASO's benchmark suite: every model through ``taso-jax bench``, then the search time on
ResNet-50 and NasNet-A at 1x, 2x and 4x depth (with kernel costs cached: the second search
of each graph is the one timed).

Run: python benchmarks/taso_suite.py [--small] [--cost-model measured|analytic]
Writes benchmarks/results/<device>.json, .md and .png (see ``taso-jax bench --help``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
from models import MODELS  # noqa: E402
from taso_jax.search import backtracking_search, get_cost_model  # noqa: E402

import taso_jax  # noqa: E402
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
    """Search seconds on ResNet-50 (stages) and NasNet-A (cells) repeated 1, 2 and 4 times."""
    cm = get_cost_model(cost_model)
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
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--cost-model", default="measured")
    ap.add_argument("--budget", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    rc = cli(["bench", "--cost-model", args.cost_model, "--budget", str(args.budget),
              "--repeats", str(args.repeats), "--out", args.out]
             + (["--small"] if args.small else []))
    print("\n| model | depth | operators | search (s), costs cached | graphs expanded | stopped |")
    print("|---|---|---|---|---|---|")
    for r in depth_scaling(args.cost_model, args.small, args.budget):
        print(f"| {r['model']} | {r['depth']}x | {r['operators']} | {r['seconds']:.1f} | "
              f"{r['iterations']} | {r['stopped']} |", flush=True)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
