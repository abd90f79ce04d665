"""Where a searched attention graph's time goes on a GPU (the third call's diagnostic).

    python diag.py causal_attention_dpa,causal_attention 1024     # from the repository root

For each transformer workload and sequence length (bfloat16): ``jax.jit`` of the function,
the imported graph and the graph the analytic search delivers, timed interleaved (median
microseconds of 30 rounds), the attention nodes of the searched graph, and a census of each
compiled program's entry computation (fusions, custom calls and their targets).
"""

import re
import sys

import jax
import numpy as np

sys.path.insert(0, "examples")
import transformer_models as tm  # noqa: E402

import taso_jax  # noqa: E402
from taso_jax.ir.executor import time_interleaved  # noqa: E402


def census(hlo: str):
    """Instruction kinds and custom-call targets of an HLO module's entry computation."""
    entry = hlo[hlo.find("ENTRY"):]
    kinds = re.findall(r"= \S+ (fusion|custom-call|copy|transpose|convert|dot)\(", entry)
    return {k: kinds.count(k) for k in set(kinds)}, re.findall(r'custom_call_target="([^"]+)"',
                                                              entry)


def main(names: str, seqs: str) -> None:
    for name in names.split(","):
        for seq in (int(s) for s in seqs.split(",")):
            fn, w, ins = tm.MODELS[name](seq, "bfloat16")
            g = taso_jax.from_jax(fn, w, *ins)
            r = taso_jax.search_graph(g, cost_model="analytic", end_to_end=0, time_limit=20)
            att = [(n.op, n.attr("impl"), n.inputs[0].dtype) for n in r.graph.nodes
                   if "attention" in n.op]
            c0, c1 = taso_jax.compile_graph(g), taso_jax.compile_graph(r.graph)
            flat = list(ins) if len(c1.graph.inputs) == len(ins) else \
                jax.tree_util.tree_leaves((w, *ins))
            jf = jax.jit(fn)
            calls = [lambda jf=jf, w=w, ins=ins: jf(w, *ins),
                     lambda c0=c0, flat=flat: c0(*flat), lambda c1=c1, flat=flat: c1(*flat)]
            times = time_interleaved(calls, repeats=30)
            med = [float(np.median(t)) for t in times]
            print(f"{name} S={seq}: jit {med[0]:.0f} us, imported graph {med[1]:.0f} us, "
                  f"searched graph {med[2]:.0f} us; attention {att}")
            print("  jit original:", census(jf.lower(w, *ins).compile().as_text()))
            print("  imported:", census(c0._jitted.lower(c0.folded, *flat).compile().as_text()))
            print("  searched:", census(c1._jitted.lower(c1.folded, *flat).compile().as_text()))
            print("  searched ops:", [n.op for n in r.graph.nodes
                                      if n.op not in ("input", "weight")])


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
