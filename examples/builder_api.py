"""Build TASO's README module with the graph-builder API, optimize it, export it to ONNX.

Run: python examples/builder_api.py [out.onnx]
"""

import sys

import onnx
from taso_jax.search import AnalyticCostModel

import taso_jax

graph = taso_jax.new_graph()
x = graph.new_input(dims=(1, 64, 28, 28), name="input")
w1 = graph.new_weight(dims=(64, 64, 3, 3))
w2 = graph.new_weight(dims=(64, 64, 1, 1))
w3 = graph.new_weight(dims=(64, 64, 3, 3))
left = graph.conv2d(input=x, weight=w1, strides=(1, 1), padding="SAME", activation="RELU")
left = graph.conv2d(input=left, weight=w3, strides=(1, 1), padding="SAME")
right = graph.conv2d(input=x, weight=w2, strides=(1, 1), padding="SAME", activation="RELU")
graph.relu(graph.ewadd(left, right))

# A launch-bound GPU cost model; on a machine with a GPU, cost_model="measured" times kernels.
# end_to_end=0: a GPU cost model's choice, not timed on this machine
result = taso_jax.search_graph(graph, cost_model=AnalyticCostModel.gpu(), budget=50,
                               end_to_end=0)
print(f"estimated cost {result.cost_before:.1f} us -> {result.cost_after:.1f} us")
print("applied:", dict(result.applied))
print(result.graph)
if len(sys.argv) > 1:
    onnx.save(taso_jax.export_onnx(result.graph), sys.argv[1])
