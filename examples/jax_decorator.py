"""``@taso_jax.optimize`` on a NasRNN-style cell: the README's worked example.

Eight matmuls read the input ``x`` and eight read the state ``h``. The search merges each
group into one matmul on concatenated weights. Because ``w`` is marked as weights, the
concatenation runs once, not on every call. Run ``python examples/jax_decorator.py``
(add ``--analytic`` for a deterministic run: the analytic cost model, trusted as it is,
without timing the cheapest graphs against the original on this machine).
"""

import sys

import jax
import jax.numpy as jnp

import taso_jax

HIDDEN = 256
keys = jax.random.split(jax.random.key(0), 16)
w = {"wx": [jax.random.normal(k, (HIDDEN, HIDDEN)) / 16 for k in keys[:8]],
     "wh": [jax.random.normal(k, (HIDDEN, HIDDEN)) / 16 for k in keys[8:]]}
x = jax.random.normal(jax.random.key(1), (1, HIDDEN))
h = jnp.zeros((1, HIDDEN))
ANALYTIC = "--analytic" in sys.argv
options = {"cost_model": "analytic", "end_to_end": 0} if ANALYTIC else {}


@taso_jax.optimize(weight_argnums=0, **options)
def cell(w, x, h):
    m = [x @ a + h @ b for a, b in zip(w["wx"], w["wh"], strict=True)]
    s = [jax.nn.sigmoid(m[0]) * jnp.tanh(m[1]), jax.nn.relu(m[2]) * jax.nn.sigmoid(m[3]),
         jax.nn.sigmoid(m[4]) * jnp.tanh(m[5]), jnp.tanh(m[6]) * jax.nn.relu(m[7])]
    return jnp.tanh((s[0] + s[1]) * (s[2] + s[3]))


h1 = cell(w, x, h)          # traced, optimized, compiled and checked on this first call
h2 = cell(w, x, h1)         # the merged weights are reused
print(cell.report(repeats=20))
runtime = {e.primitive.name for e in cell.runtime_jaxpr().eqns}
print("matmuls per call:", cell.optimized_graph.op_counts()["matmul"],
      "(was", str(cell.graph.op_counts()["matmul"]) + ")")
print("weights concatenated at run time:", "concatenate" in runtime)
