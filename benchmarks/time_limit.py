"""Does ``taso-jax optimize`` end within its time limit at any model size? (issue 47)

Writes generated ONNX models of N operators (:func:`write_model`) and runs
``taso-jax optimize MODEL -o OUT --time-limit T -q --json REPORT`` on each, in a fresh
process, for each limit; prints a markdown table of the wall time of the whole command
(process start, imports and export included), its CPU time (user and system: on a loaded
machine the wall time also counts waiting for a core), and how the run ended (the search's
stop reason, the phase during which the time limit passed, and the verdict, from the JSON
report).

A model is a chain of blocks, each of two matmuls that read the same input (the shipped
rules merge them into one), their sum, a ReLU, a chain of elementwise operators, a matmul by
a weight every block shares (as an unrolled RNN's steps do: every pair of them matches
``merge-matmul-matmul-3``, and every such rewrite would make a cycle) and a residual sum: 12
operators a block, the rest a ReLU chain. A 20,000-operator model has 1,666 blocks.

Run: python benchmarks/time_limit.py [--sizes 1000 5000 20000] [--limits 1 5 60]
     [--cost-model measured] [--timeout S] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

#: Operators in one block of :func:`write_model`.
BLOCK = 12


def make_model(n: int, width: int = 16, batch: int = 4, seed: int = 0):
    """An ONNX model of ``n`` operators (``n >= BLOCK``) that gives the search work.

    Input ``x`` is ``batch x width`` float32; see the module docstring for its blocks.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, inits = [], []

    def weight(name, shape, scale):
        inits.append(numpy_helper.from_array(
            (rng.standard_normal(shape) * scale).astype(np.float32), name))
        return name

    def op(kind, inputs, name):
        nodes.append(helper.make_node(kind, inputs, [name], name=name))
        return name

    x = "x"
    shared = weight("w_shared", (width, width), 1 / width)
    for b in range(n // BLOCK):
        p = f"b{b}_"
        w1 = weight(p + "w1", (width, width), 1 / width)
        w2 = weight(p + "w2", (width, width), 1 / width)
        m1 = op("MatMul", [x, w1], p + "m1")
        m2 = op("MatMul", [x, w2], p + "m2")
        h = op("Relu", [op("Add", [m1, m2], p + "sum")], p + "relu")
        h = op("Mul", [h, weight(p + "s1", (width,), 0.5)], p + "mul1")
        h = op("Add", [h, weight(p + "a1", (width,), 0.1)], p + "add1")
        h = op("Relu", [h], p + "relu2")
        h = op("Mul", [h, weight(p + "s2", (width,), 0.5)], p + "mul2")
        h = op("Add", [h, weight(p + "a2", (width,), 0.1)], p + "add2")
        h = op("Tanh", [h], p + "tanh")
        h = op("MatMul", [h, shared], p + "m3")
        x = op("Add", [h, x], p + "res")
    for i in range(n - BLOCK * (n // BLOCK)):
        x = op("Relu", [x], f"tail{i}")
    graph = helper.make_graph(
        nodes, f"chain{n}",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, width])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [batch, width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def write_model(n: int, path: str, **kw) -> str:
    """Write :func:`make_model` of ``n`` operators to ``path``; returns ``path``."""
    import onnx

    onnx.save(make_model(n, **kw), path)
    return path


def run_once(model: str, limit: float, cost_model: str, scratch: str,
             timeout: float | None = None) -> dict:
    """One ``taso-jax optimize`` in a fresh process: wall time, exit code, how it ended."""
    out = os.path.join(scratch, "out.onnx")
    report = os.path.join(scratch, "report.json")
    if os.path.exists(report):
        os.remove(report)
    cmd = [sys.executable, "-m", "taso_jax.cli", "optimize", model, "-o", out,
           "--time-limit", str(limit), "--cost-model", cost_model, "-q", "--json", report]
    t0 = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        rc, err = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired:
        rc, err = "timeout", ""
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    row = {"wall": wall, "cpu": cpu, "rc": rc, "stopped": "", "verdict": "", "last": ""}
    if os.path.exists(report):
        with open(report) as f:
            rep = json.load(f)
        search = rep.get("search") or {}
        row["stopped"] = search.get("stopped") or rep.get("stopped", "")
        row["verdict"] = (rep.get("outcome") or {}).get("verdict", "")
        row["last"] = search.get("out_of_time_in") or rep.get("out_of_time_in") or ""
    elif rc not in (0, "timeout"):
        row["verdict"] = "error: " + (err.strip().splitlines() or [""])[-1][:80]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 5000, 20000])
    ap.add_argument("--limits", type=float, nargs="+", default=[1, 5, 60])
    ap.add_argument("--cost-model", default="measured", choices=["measured", "analytic"])
    ap.add_argument("--timeout", type=float, default=600,
                    help="kill a run after this many seconds")
    ap.add_argument("--out", help="also write the table to this file")
    args = ap.parse_args(argv)
    lines = ["| limit (s) | operators | wall time (s) | CPU time (s) | exit | search stopped "
             "| time limit reached during | verdict |", "|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    with tempfile.TemporaryDirectory(prefix="time_limit_") as scratch:
        for n in args.sizes:
            model = write_model(n, os.path.join(scratch, f"chain{n}.onnx"))
            for limit in args.limits:
                r = run_once(model, limit, args.cost_model, scratch, args.timeout)
                line = (f"| {limit:g} | {n:,} | {r['wall']:.1f} | {r['cpu']:.1f} | {r['rc']} | "
                        f"{r['stopped'] or '-'} | {r['last'] or '-'} | {r['verdict'] or '-'} |")
                lines.append(line)
                print(line, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
