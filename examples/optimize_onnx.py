"""Optimize an ONNX model file and check the result in onnxruntime.

Run: python examples/optimize_onnx.py model.onnx model.opt.onnx
"""

import sys

import onnx

import taso_jax
from taso_jax.report import compare_onnx

src, dst = sys.argv[1], sys.argv[2]
g = taso_jax.load_onnx(src)
g2 = taso_jax.optimize(g, cost_model="analytic", budget=20)  # g is unchanged
model = taso_jax.export_onnx(g2)
onnx.checker.check_model(model, full_check=True)
feeds = {n.name: x for n, x in zip(g.inputs, taso_jax.random_inputs(g), strict=True)}
print(compare_onnx(src, model.SerializeToString(), feeds))
onnx.save(model, dst)
print(f"operators {sum(g.op_counts().values())} -> {sum(g2.op_counts().values())}; "
      f"written {dst}")
