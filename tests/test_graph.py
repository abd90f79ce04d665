"""Graph IR: hash-consing, immutability, rewriting, builder, executor."""

from __future__ import annotations

import numpy as np
import pytest

from taso_jax import GraphError, ShapeError, compile_graph, new_graph, random_inputs
from taso_jax.ir.graph import make_node


def _two_convs():
    g = new_graph()
    x = g.new_input((1, 3, 8, 8), name="x")
    w1 = g.new_weight((4, 3, 3, 3), name="w1")
    w2 = g.new_weight((4, 3, 1, 1), name="w2")
    return g, x, w1, w2


def test_structurally_equal_nodes_are_the_same_object():
    g, x, w1, _ = _two_convs()
    a = make_node("conv2d", [x, w1], {"padding": "same"})
    b = make_node("conv2d", [x, w1], {})  # same after filling defaults
    c = make_node("conv2d", [x, w1], {"activation": "relu"})
    assert a is b
    assert a is not c


def test_canonical_axes_make_equal_nodes():
    g, x, _, _ = _two_convs()
    assert make_node("concat", [x, x], {"axis": 1}) is make_node("concat", [x, x], {"axis": -3})


def test_replace_builds_new_graph_and_keeps_old():
    g, x, w1, w2 = _two_convs()
    y = g.relu(g.conv2d(x, w1))
    g.mark_output(y, "y")
    graph = g.graph()
    conv = graph.by_op["conv2d"][0].outputs[0]
    alt = make_node("conv2d", [x, make_node("enlarge", [w2, w1]).outputs[0]]).outputs[0]
    g2 = graph.replace({conv: alt})
    assert g2.key != graph.key
    assert graph.by_op["conv2d"][0].outputs[0] == conv  # unchanged
    assert "enlarge" in g2.by_op and "enlarge" not in graph.by_op
    # Replacing back gives exactly the original graph (hash-consing).
    assert g2.replace({alt: conv}).key == graph.key


def test_weight_only_nodes_and_op_counts():
    g, x, w1, w2 = _two_convs()
    k = g.concat([w1, g.enlarge(w2, w1)], axis=0)
    g.conv2d(x, k)
    graph = g.graph()
    assert graph.op_counts() == {"conv2d": 1}
    assert graph.op_counts(include_weight_only=True) == {"conv2d": 1, "concat": 1,
                                                         "enlarge": 1}


def test_builder_errors():
    g, x, w1, _ = _two_convs()
    with pytest.raises(GraphError, match="duplicate"):
        g.new_input((1,), name="x")
    with pytest.raises(ShapeError):
        g.matmul(x, w1)
    with pytest.raises(GraphError, match="tensors"):
        g.relu(3)
    with pytest.raises(AttributeError):
        _ = g.no_such_operator


def test_executor_folds_weights_and_matches_reference():
    g, x, w1, w2 = _two_convs()
    k = g.concat([w1, g.enlarge(w2, w1)], axis=0)
    y = g.conv2d(x, k, activation="RELU")
    graph = g.graph()
    cg = compile_graph(graph)
    assert len(cg.folded) == 1  # one precomputed kernel, not two weights
    xs = random_inputs(graph)
    from taso_jax.ops import OPS

    kernel = np.concatenate([graph.weights["w1"],
                             np.pad(graph.weights["w2"], ((0, 0), (0, 0), (1, 1), (1, 1)))])
    want = OPS["conv2d"].ref(xs[0], kernel, strides=(1, 1), padding="same", dilations=(1, 1),
                             groups=1, activation="relu")
    np.testing.assert_allclose(np.asarray(cg(*xs)[0]), np.asarray(want), rtol=1e-5)
    assert y.shape == (1, 8, 8, 8)
