"""What the mixture-of-experts guard costs when it falls back (``ops/experts.py``).

Decorates the ``moe_top2`` workload of ``examples/transformer_models.py`` with
``@taso_jax.optimize`` at its defaults, makes the first call on uniform routing (where the
search lowers the layer to its gathered form and the decorator, timing it, delivers it), and
then times the delivered function against ``jax.jit`` of the original, interleaved, on the
uniform weights and on the skewed ones (every token on experts 0 and 1: each expert's count
exceeds the capacity, so the guard runs the dense form). Prints, per routing, the medians
(milliseconds), the speed-up (median of the per-round ratios, rounds won) and the largest
absolute difference from ``jax.jit`` of the original.

    python benchmarks/moe_fallback.py --rounds 20
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import transformer_models  # noqa: E402

import taso_jax  # noqa: E402
from taso_jax.ir.executor import time_interleaved  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20, help="interleaved timing rounds")
    p.add_argument("--seq", type=int, default=256, help="tokens T")
    args = p.parse_args(argv)
    fn, uniform, (xu,) = transformer_models.make_moe_top2(seq=args.seq)
    _, skewed, (xs,) = transformer_models.make_moe_top2(seq=args.seq, routing="skewed")
    opt = taso_jax.optimize(fn, weight_argnums=0)
    t0 = time.perf_counter()
    jax.block_until_ready(opt(uniform, xu))
    report = opt.outcome().to_json()
    print(f"first call (uniform routing) {time.perf_counter() - t0:.1f} s: "
          f"{report['outcome']['verdict']}, applied {dict(report.get('applied', {}))}")
    ref = jax.jit(fn)
    for name, w, x in (("uniform", uniform, xu), ("skewed", skewed, xs)):
        diff = float(np.max(np.abs(np.asarray(opt(w, x)) - np.asarray(ref(w, x)))))
        ta, tb = time_interleaved([lambda w=w, x=x: ref(w, x), lambda w=w, x=x: opt(w, x)],
                                  args.rounds, warmup=2)
        ratios = np.asarray(ta) / np.asarray(tb)
        print(f"{name}: jax.jit {np.median(ta) / 1e3:.1f} ms, optimized "
              f"{np.median(tb) / 1e3:.1f} ms, {np.median(ratios):.3f}x "
              f"({int(np.sum(ratios > 1))}/{len(ratios)}), max abs diff {diff:.2g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
