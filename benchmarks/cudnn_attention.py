"""Causal attention's lowerings side by side on one device: naive, query-blocked, cuDNN.

For each sequence length ``S`` and element type, one causal self-attention of ``B x H``
heads of dimension ``D`` (keys transposed, scale folded into the queries, as the
``attention`` operator takes them) is compiled with ``jax.jit`` in each of its lowerings
(``taso_jax.ops.attention``: ``naive``, ``blocked`` in query blocks of 256 rows, ``cudnn``)
and, for reference, as ``jax.nn.dot_product_attention`` with cuDNN given the mask as a
tensor instead of the causal flag. Printed: the median microseconds of interleaved rounds
(``time_interleaved``), each form's speed-up over the naive form (median of per-round
ratios), and its largest absolute difference from the naive form computed in float32.
Forms that cannot run here (cuDNN off a CUDA GPU, or in float32) say why.

    python benchmarks/cudnn_attention.py --seq 1024,2048,4096 --dtype bfloat16,float32
    python benchmarks/cudnn_attention.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from taso_jax.ops import OPS, TensorType
from taso_jax.ops.cudnn_attention import cudnn_unavailable

from taso_jax._io import atomic_write
from taso_jax.ir.executor import time_interleaved


def _forms(sq: int):
    """The naive and blocked forms (name -> (function of q, kt, v, why not)), and cuDNN
    given the causal mask as a tensor."""
    ref = OPS["attention"].ref
    attrs = {"causal": True, "offset": 0, "fill": float("-inf")}

    def masked_cudnn(q, kt, v):
        bsnd = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
        mask = jnp.tril(jnp.ones((sq, sq), bool))[None, None]
        out = jax.nn.dot_product_attention(bsnd(q), bsnd(jnp.swapaxes(kt, -1, -2)), bsnd(v),
                                           mask=mask, scale=1.0, implementation="cudnn")
        return bsnd(out)

    forms = {"naive": (lambda q, kt, v: ref(q, kt, v, **attrs, impl="naive", block=128), None),
             "blocked": (lambda q, kt, v: ref(q, kt, v, **attrs, impl="blocked", block=256),
                         None)}
    return forms, masked_cudnn


def run(seqs, dtypes, batch: int, heads: int, dim: int, rounds: int) -> list[dict]:
    rows = []
    for dtype in dtypes:
        for sq in seqs:
            rng = np.random.default_rng(0)
            shapes = [(batch, heads, sq, dim), (batch, heads, dim, sq), (batch, heads, sq, dim)]
            host = [rng.standard_normal(s).astype(np.float32) for s in shapes]
            host[0] *= np.float32(dim ** -0.5)
            args = [jnp.asarray(x, dtype) for x in host]
            types = [TensorType(s, dtype) for s in shapes]
            forms, masked = _forms(sq)
            why = cudnn_unavailable(*types)
            if why is None:
                forms["cudnn"] = (lambda q, kt, v: OPS["attention"].ref(
                    q, kt, v, causal=True, offset=0, fill=float("-inf"), impl="cudnn",
                    block=128), None)
                forms["cudnn, mask tensor"] = (masked, None)
            else:
                forms["cudnn"] = (None, why)
            want = np.asarray(jax.jit(forms["naive"][0])(*[jnp.asarray(x) for x in host]))
            live = {k: jax.jit(f) for k, (f, _) in forms.items() if f is not None}
            errs = {}
            for k, f in list(live.items()):
                try:
                    errs[k] = float(np.max(np.abs(np.asarray(f(*args), np.float32) - want)))
                except Exception as e:  # noqa: BLE001  (a form this device refuses)
                    forms[k] = (None, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
                    del live[k]
            names = list(live)
            times = time_interleaved([lambda f=live[k], a=args: f(*a) for k in names],
                                     repeats=rounds)
            base = times[names.index("naive")]
            for k, (_f, why_not) in forms.items():
                row = {"S": sq, "dtype": dtype, "form": k, "heads": heads, "dim": dim,
                       "batch": batch}
                if k in live:
                    t = times[names.index(k)]
                    row.update(us=float(np.median(t)), speedup=float(np.median(
                        np.asarray(base) / np.asarray(t))), max_abs_diff=errs[k])
                else:
                    row["skipped"] = why_not
                rows.append(row)
    return rows


def table(rows) -> str:
    out = ["| S | dtype | form | µs | vs naive | max abs diff vs float32 |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            out.append(f"| {r['S']} | {r['dtype']} | {r['form']} | - | - | {r['skipped']} |")
        else:
            out.append(f"| {r['S']} | {r['dtype']} | {r['form']} | {r['us']:.0f} | "
                       f"{r['speedup']:.2f}x | {r['max_abs_diff']:.2e} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", default="1024,2048,4096")
    ap.add_argument("--dtype", default="bfloat16,float32")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    d = jax.devices()[0]
    print(f"device {d.platform}:{getattr(d, 'device_kind', '')}, jax {jax.__version__}; "
          f"B={a.batch} H={a.heads} D={a.dim}; median of {a.rounds} interleaved rounds")
    rows = run([int(s) for s in a.seq.split(",")], a.dtype.split(","), a.batch, a.heads,
               a.dim, a.rounds)
    print(table(rows))
    if a.json:
        text = json.dumps({"device": f"{d.platform}:{d.device_kind}", "rows": rows}, indent=1)
        atomic_write(a.json, lambda tmp: Path(tmp).write_text(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
