"""Prototype a new operator end to end: a fused dense layer ``linear(x, w, b) = x @ w + b``.

The operator is not part of taso_jax. This script declares it in one place (reference
function, shape rule, ONNX export, one axiom), then lets the rest of the system pick it up:

1. the axiom is checked against the JAX reference functions on random inputs;
2. the generator enumerates expressions over ``linear``, ``matmul``, ``ewadd`` and ``concat``
   and pairs those with equal fingerprints into candidate substitutions;
3. Z3 proves each candidate from the declared axioms (the new one and the existing matmul,
   ewadd and concat laws); unproved candidates are dropped;
4. the search applies the proved rules to a graph with two ``linear`` layers that read the
   same input: they merge into one, with concatenated weights and biases that are computed
   once, ahead of time.

Run: ``python examples/new_operator.py`` (about a minute on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import time

import jax.numpy as jnp
import numpy as np
from taso_jax.ops import OpDef, ShapeError, TensorType, axiom, declare
from taso_jax.verify.generator import Domain, generate
from taso_jax.verify.laws import check_axiom
from taso_jax.verify.prover import Prover

import taso_jax

# ---- 1. the declaration ---------------------------------------------------------------------

def _linear(x, w, b):
    """``x @ w + b``: x [..., M, K], w [K, N], b [1, N] (broadcast over rows)."""
    return jnp.matmul(x, w) + b


def _linear_shape(ts):
    x, w, b = ts
    if len(x.shape) < 2 or len(w.shape) != 2 or x.shape[-1] != w.shape[0]:
        raise ShapeError(f"linear: cannot multiply {x.shape} by {w.shape}")
    if b.shape != (1, w.shape[1]):
        raise ShapeError(f"linear: bias {b.shape} is not (1, {w.shape[1]})")
    if not x.dtype == w.dtype == b.dtype:
        raise ShapeError(f"linear: dtypes {x.dtype}, {w.dtype}, {b.dtype} differ")
    return [TensorType(x.shape[:-1] + (w.shape[1],), x.dtype)]


def _linear_onnx(ctx, ins, outs):
    ctx.node("Add", [ctx.tmp("MatMul", ins[:2]), ins[2]], outs)


LINEAR = OpDef(
    name="linear", ref=_linear, shape=_linear_shape, arity=3, to_onnx=_linear_onnx,
    flops=lambda ins, outs, **_: 2.0 * outs[0].size * ins[0].shape[-1] + outs[0].size,
    examples=(([TensorType((3, 4), "float32"), TensorType((4, 5), "float32"),
                TensorType((1, 5), "float32")], {}),),
    axioms=(axiom("linear(x, w, b) = ewadd(matmul(x, w), b)",
                  {"x": ("M", "K"), "w": ("K", "N"), "b": (1, "N")}),),
    doc="dense layer x @ w + b (ONNX MatMul then Add; Gemm without transposes)")

DOMAIN = Domain(
    "linear",
    variables={"x": ("input", ("...", "M", "K")),
               "a": ("weight", ("K", "N")), "c": ("weight", ("K", "N")),
               "b": ("weight", (1, "N")), "d": ("weight", (1, "N"))},
    instances=({"...": (), "M": 3, "K": 4, "N": 5}, {"...": (2,), "M": 2, "K": 3, "N": 6}),
    ops=(("linear", {}), ("matmul", {}), ("ewadd", {}), ("concat", {"axis": -1})),
    split_axes=(-1,))


def two_dense_layers(batch: int = 64, width: int = 512):
    """Two dense layers written with the new operator, reading the same input, summed."""
    g = taso_jax.new_graph()
    x = g.new_input(dims=(batch, width), name="x")
    rng = np.random.default_rng(0)
    outs = []
    for _ in range(2):
        w = g.new_weight(data=rng.standard_normal((width, width)).astype(np.float32))
        bias = g.new_weight(data=rng.standard_normal((1, width)).astype(np.float32))
        outs.append(g.relu(g.linear(x, w, bias)))
    g.ewadd(*outs)
    return g.graph()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-ops", type=int, default=3, help="operators per side (3)")
    args = p.parse_args(argv)

    declare(LINEAR)
    print(f"declared: {LINEAR.name}: {LINEAR.doc}")
    for ax in LINEAR.axioms:
        r = check_axiom(ax, LINEAR.name)
        assert not r["failures"], r["failures"]
        print(f"axiom: {ax.law}  (holds on {r['checked']} random instances)")

    t0 = time.perf_counter()
    candidates, stats = generate([DOMAIN], max_ops=args.max_ops, workers=1)
    print(f"generated in {time.perf_counter() - t0:.1f} s: {stats.summary()}")

    prover = Prover()
    proved = []
    for s in candidates:
        proof = prover.prove(s)
        s.provenance["proof"] = proof
        if proof["status"] == "proved":
            proved.append(s)
    print(f"proved {len(proved)} of {len(candidates)} candidates")
    new = [s for s in proved if any(n.op == "linear" for n in s.source + s.target)]
    print(f"new substitutions that involve linear ({len(new)}), for example:")
    # two layers with their own weights and biases become one, then a split
    merges = [s for s in new if len(s.outputs) > 1 and len(s.variables) == 5]
    for s in (sorted(new, key=lambda s: len(s.law))[:4] + merges[:2]):
        print(f"  {s.law}")
        used = [a.split(": ", 1)[1] for a in s.provenance["proof"]["axioms"]]
        print(f"      from: {'; '.join(used)}")

    graph = two_dense_layers()
    # end_to_end=0: the analytic cost model's choice (a CPU may time the merge as a tie)
    result = taso_jax.search_graph(graph, cost_model="analytic", substitutions=proved,
                                   budget=50, end_to_end=0)
    print(f"search on two dense layers sharing x: {dict(graph.op_counts())} -> "
          f"{dict(result.graph.op_counts())}")
    print("applied: " + ", ".join(f"{n} x{k}" for k, n in result.applied.items()))
    # Checked by an independent executor: both graphs exported to ONNX (linear becomes
    # MatMul + Add) and run in onnxruntime.
    from taso_jax.report import compare_onnx

    feeds = {n.name: v for n, v in zip(graph.inputs, taso_jax.random_inputs(graph, seed=0),
                                       strict=True)}
    check = compare_onnx(taso_jax.export_onnx(graph).SerializeToString(),
                         taso_jax.export_onnx(result.graph).SerializeToString(), feeds)
    print(f"onnxruntime, original vs optimized: max abs difference {check['max_abs_err']:.2e}, "
          f"ok: {check['ok']}")
    return 0 if check["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
