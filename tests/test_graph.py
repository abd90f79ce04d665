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


def test_graphs_share_device_copies_of_read_only_weights_only():
    from taso_jax.ir.executor import StagedGraph

    rng = np.random.default_rng(0)
    frozen = rng.standard_normal((64, 32, 3, 3)).astype(np.float32)
    mutable = rng.standard_normal((64, 32, 3, 3)).astype(np.float32)
    two, three = np.full((64, 1, 1, 1), 2.0, np.float32), np.full((64, 1, 1, 1), 3.0, np.float32)
    for a in (frozen, two, three):
        a.flags.writeable = False  # as the ONNX importer leaves its initializers

    def graph(w1, w2, scale):
        g = new_graph()
        x = g.new_input((1, 32, 8, 8), name="x")
        a = g.new_weight(data=w1, name="a")
        b = g.new_weight(data=w2, name="b")
        s = g.new_weight(data=scale, name="s")
        g.mark_output(g.conv2d(x, g.ewmul(a, s)), "y")  # a * s is folded
        g.mark_output(g.conv2d(x, b), "z")
        return g.graph()

    g1, g2 = graph(frozen, mutable, two), graph(frozen, mutable, two)
    s1, s2 = StagedGraph(g1), StagedGraph(g2)
    f1, f2 = s1.fold(s1.weights_of()), s2.fold(s2.weights_of())
    assert len(f1) == 2 and f1[0] is f2[0]  # one folded kernel for both graphs
    assert f1[1] is not f2[1]  # a writable weight is copied afresh: it may change
    mutable[...] = 0  # ...and a change is seen by the next fold
    assert float(np.abs(np.asarray(s1.fold(s1.weights_of())[1])).max()) == 0.0
    g3 = graph(frozen, mutable, three)  # another scale: another folded kernel
    s3 = StagedGraph(g3)
    f3 = s3.fold(s3.weights_of())
    assert f3[0] is not f1[0]
    np.testing.assert_allclose(np.asarray(f3[0]), frozen * 3.0, rtol=1e-6)
    # an export wants host arrays: a weight read as it is is not copied to the device
    host = s1.fold(s1.weights_of(), host_weights=True)
    assert host[1] is mutable and host[0] is f1[0]



def test_a_weight_read_transposed_by_a_product_is_not_folded_into_a_copy():
    """A weight-only transpose that only products read stays in the runtime stage (XLA reads
    the weight transposed inside the product); one that another operator reads too is
    folded, as is arithmetic on weights."""
    from taso_jax.ir.executor import StagedGraph

    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    v = rng.standard_normal((8, 16)).astype(np.float32)
    g = new_graph()
    x = g.new_input((4, 8), name="x")
    read = g.transpose(g.new_weight(data=w, name="w"), perm=(1, 0))  # only a product reads it
    both = g.transpose(g.ewmul(g.new_weight(data=v, name="v"), g.new_weight(data=v, name="u")),
                       perm=(1, 0))  # [16, 8]: a product and an addition read it
    h = g.matmul(x, read)
    g.mark_output(g.ewadd(g.matmul(h, both), g.reduce_sum(both, axes=(0,), keepdims=True)), "y")
    graph = g.graph()
    staged = StagedGraph(graph)
    assert sorted(t.node.op for t in staged.const_keys) == ["reduce_sum", "transpose", "weight"]
    assert [t.node.name for t in staged.const_keys if t.node.op == "weight"] == ["w"]
    x0 = np.ones((4, 8), np.float32)
    ref = (x0 @ w.T) @ (v * v).T + (v * v).T.sum(axis=0, keepdims=True)
    np.testing.assert_allclose(np.asarray(compile_graph(graph)(x0)[0]), ref, rtol=1e-4)


def test_a_shared_fold_is_keyed_by_which_weight_holds_which_array():
    from taso_jax.ir.executor import StagedGraph, _frozen

    one, ten = np.ones((4,), np.float32), np.full((4,), 10.0, np.float32)
    for a in (one, ten):
        a.flags.writeable = False

    def graph(c):  # (a + b) + c: the same nodes, c bound to either array
        g = new_graph()
        x = g.new_input((4,), name="x")
        a, b = g.new_weight(data=one, name="a"), g.new_weight(data=ten, name="b")
        g.mark_output(g.ewadd(x, g.ewadd(g.ewadd(a, b), g.new_weight(data=c, name="c"))), "y")
        return g.graph()

    folds = [StagedGraph(g).fold(StagedGraph(g).weights_of()) for g in (graph(one), graph(ten))]
    assert [float(np.asarray(f[0])[0]) for f in folds] == [12.0, 21.0]
    view = np.ones(4, np.float32)[:]  # read-only view of a writable array: it can change
    view.flags.writeable = False
    assert not _frozen(view) and _frozen(one)


def test_weight_only_nodes_fold_in_one_call_as_they_do_one_at_a_time(monkeypatch):
    """Four or more weight-only nodes are evaluated as one jax.jit call (run_nodes): the
    same values as one operator at a time, and shared with the next graph that folds the
    same nodes from the same arrays."""
    import taso_jax.ir.executor as executor
    from taso_jax.ir.executor import StagedGraph

    rng = np.random.default_rng(2)
    arrays = [rng.standard_normal((8, 8)).astype(np.float32) for _ in range(3)]
    for a in arrays:
        a.flags.writeable = False

    def graph():
        g = new_graph()
        x = g.new_input((4, 8), name="x")
        a, b, c = (g.new_weight(data=v, name=n) for v, n in zip(arrays, "abc", strict=True))
        k = g.ewadd(g.ewmul(g.ewadd(a, b), c), g.ewmul(a, c))  # four weight-only nodes
        g.mark_output(g.ewadd(g.matmul(x, k), g.reduce_sum(k, axes=(0,), keepdims=True)), "y")
        return g.graph()

    jitted = []
    real_jit = executor.jax.jit
    monkeypatch.setattr(executor.jax, "jit", lambda f, *a, **k: jitted.append(f) or
                        real_jit(f, *a, **k))
    staged = StagedGraph(graph())
    first = staged.fold(staged.weights_of())  # held, as a compiled graph holds them
    together = [np.asarray(v) for v in first]
    assert len(jitted) == 1  # one call for the four nodes
    monkeypatch.setattr(executor, "JIT_NODES", 10**9)  # one operator at a time
    apart = StagedGraph(graph())
    executor._SHARED._table.clear()
    second = apart.fold(apart.weights_of())
    alone = [np.asarray(v) for v in second]
    assert len(jitted) == 1
    for u, v in zip(together, alone, strict=True):
        np.testing.assert_allclose(u, v, rtol=1e-6)
    a, b, c = arrays
    np.testing.assert_allclose(together[0], (a + b) * c + a * c, rtol=1e-5)
    again = StagedGraph(graph())
    assert again.fold(again.weights_of())[0] is second[0]  # shared with the graph before


def test_forget_caches_drops_derived_properties_and_they_come_back_equal():
    b, x, w1, _ = _two_convs()
    b.mark_output(b.relu(b.conv2d(x, w1)), "y")
    g = b.graph()
    before = (list(g.nodes), dict(g.consumers), dict(g.positions))
    g.forget_caches(keep=("nodes",))
    assert "nodes" in g.__dict__ and "consumers" not in g.__dict__
    g.forget_caches()
    assert not {"nodes", "consumers", "positions"} & set(g.__dict__)
    assert (list(g.nodes), dict(g.consumers), dict(g.positions)) == before


def test_a_fold_computes_only_what_the_runtime_reads(monkeypatch):
    """An intermediate weight-only value whose consumer another graph already holds is not
    computed again: the second graph's fold evaluates only its own new node."""
    import taso_jax.ir.executor as executor
    from taso_jax.ir.executor import StagedGraph

    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal((8, 8)).astype(np.float32) for _ in range(2)]
    for a in arrays:
        a.flags.writeable = False

    def graph(extra):
        g = new_graph()
        x = g.new_input((4, 8), name="x")
        a, b = (g.new_weight(data=v, name=n) for v, n in zip(arrays, "ab", strict=True))
        k = g.relu(g.ewmul(g.ewadd(a, b), b))  # ewadd feeds only ewmul
        y = g.matmul(x, k)
        if extra:
            y = g.ewadd(y, g.reduce_sum(g.ewmul(k, a), axes=(0,), keepdims=True))
        g.mark_output(y, "y")
        return g.graph()

    first = StagedGraph(graph(False))
    held = first.fold(first.weights_of())  # noqa: F841 - held, as a compiled graph holds it
    ran = []
    real = executor.run_node
    monkeypatch.setattr(executor, "run_node", lambda n, args: ran.append(n.op) or real(n, args))
    monkeypatch.setattr(executor, "JIT_NODES", 10**9)  # one operator at a time, counted
    second = StagedGraph(graph(True))
    values = second.fold(second.weights_of())
    assert sorted(ran) == ["ewmul", "reduce_sum"], ran  # not ewadd, ewmul, relu again
    a, b = arrays
    k = np.maximum((a + b) * b, 0)
    np.testing.assert_allclose(np.asarray(values[-1]), (k * a).sum(0, keepdims=True),
                               rtol=1e-5)
