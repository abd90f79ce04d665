"""ONNX LSTM and GRU as declared operators (ops/recurrent.py): import, reference, laws, export.

The reference functions are checked against the onnx wheel's own node test cases (their
expected outputs come from ONNX's NumPy reference) and against onnxruntime on models built
here; onnxruntime's CPU kernels refuse ``layout=1``, so a batch-major model is compared with
the same node in ``layout=0`` between transposes.
"""

from __future__ import annotations

import importlib
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from taso_jax.ops import OPS, ShapeError, TensorType
from taso_jax.search.match import rewrites
from taso_jax.verify.from_laws import derived_rules

import taso_jax
from taso_jax.ir.executor import compile_graph

RECURRENT = ("lstm", "gru", "lstm_scan", "gru_scan")


def _node_cases(op_type: str):
    """The onnx wheel's node test cases of one operator (``onnx.backend.test.case.node``)."""
    import onnx.backend.test.case.node as node

    node._TargetOpType = op_type  # the registry keeps the cases of the targeted operator
    start = len(node._NodeTestCases)
    name = f"onnx.backend.test.case.node.{op_type.lower()}"
    if name in sys.modules:  # its cases are made when its classes are: made again
        importlib.reload(sys.modules[name])
    else:
        importlib.import_module(name)
    return node._NodeTestCases[start:]


_CASES = {c.name: c for op in ("LSTM", "GRU") for c in _node_cases(op)}


def _ops(g) -> list[str]:
    return [n.op for n in g.nodes]


def _run(g, feeds: dict) -> list[np.ndarray]:
    out = compile_graph(g)(*[feeds[n.name] for n in g.inputs])
    return [np.asarray(o) for o in (out if isinstance(out, list | tuple) else [out])]


def _ort(model, feeds: dict) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in feeds.items() if k in names})


@pytest.mark.parametrize("name", sorted(_CASES))
def test_onnx_node_cases(name):
    """Each of the onnx wheel's LSTM/GRU node cases imports declared and gives its outputs."""
    case = _CASES[name]
    inputs, expected = case.data_sets[0]
    g = taso_jax.load_onnx(case.model)
    assert case.model.graph.node[0].op_type.lower() in _ops(g)
    assert "opaque" not in _ops(g)
    feeds = {i.name: np.asarray(v) for i, v in zip(case.model.graph.input, inputs, strict=False)}
    got = _run(g, feeds)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    if "batchwise" not in name:  # onnxruntime (CPU) refuses layout=1
        for a, b in zip(got, _ort(case.model, feeds), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def _model(kind: str, t=6, batch=3, inputs=5, hidden=4, *, direction="forward", layout=0,
           seq=False, init=False, peep=False, outs=None, seed=0, **attrs):
    """An ONNX model of one LSTM/GRU node; and the same in layout 0 (for onnxruntime)."""
    rng = np.random.default_rng(seed)
    d = 2 if direction == "bidirectional" else 1
    gates = 4 if kind == "LSTM" else 3
    x_shape = (batch, t, inputs) if layout else (t, batch, inputs)
    state = (batch, d, hidden) if layout else (d, batch, hidden)
    vals = {"W": rng.standard_normal((d, gates * hidden, inputs)) * 0.5,
            "R": rng.standard_normal((d, gates * hidden, hidden)) * 0.5,
            "B": rng.standard_normal((d, 2 * gates * hidden)) * 0.5}
    names = ["X", "W", "R", "B", "S" if seq else ""]
    graph_in = [helper.make_tensor_value_info("X", TensorProto.FLOAT, x_shape)]
    if seq:
        graph_in.append(helper.make_tensor_value_info("S", TensorProto.INT32, (batch,)))
    for s in ("H0", "C0")[:2 if kind == "LSTM" else 1]:
        if init:
            vals[s] = rng.standard_normal(state)
        names.append(s if init else "")
    if peep:
        vals["P"] = rng.standard_normal((d, 3 * hidden))
        names.append("P")
    while not names[-1]:
        names.pop()
    attrs = {"direction": direction, "hidden_size": hidden, **attrs}
    all_outs = ["Y", "Y_h", "Y_c"][:3 if kind == "LSTM" else 2]
    outs = all_outs if outs is None else outs
    y_shape = (batch, t, d, hidden) if layout else (t, d, batch, hidden)
    shapes = dict(zip(all_outs, [y_shape, state, state], strict=False))
    graph_out = [helper.make_tensor_value_info(o, TensorProto.FLOAT, shapes[o]) for o in outs if o]
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in vals.items()]

    def make(nodes):
        g = helper.make_graph(nodes, "rnn", graph_in, graph_out, inits)
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)])

    batch_major = {"layout": 1} if layout else {}
    model = make([helper.make_node(kind, names, outs, **attrs, **batch_major)])
    if not layout:
        return model, model
    renamed = {"X": "Xt", "H0": "H0t", "C0": "C0t"}
    pre = [helper.make_node("Transpose", [n], [renamed[n]], perm=[1, 0, 2])
           for n in names if n in renamed]
    inner = [o + "_0" if o else "" for o in outs]
    post = [helper.make_node("Transpose", [i], [o], perm=[2, 0, 1, 3] if o == "Y" else [1, 0, 2])
            for i, o in zip(inner, outs, strict=True) if o]
    node = helper.make_node(kind, [renamed.get(n, n) for n in names], inner, **attrs)
    return model, make([*pre, node, *post])


def _feeds(model, scale=1.0, seed=1):
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in model.graph.input:
        shape = [d.dim_value for d in i.type.tensor_type.shape.dim]
        if i.type.tensor_type.elem_type == TensorProto.INT32:
            feeds[i.name] = rng.integers(1, 7, shape).astype(np.int32)  # lengths 1..T
        else:
            feeds[i.name] = (rng.standard_normal(shape) * scale).astype(np.float32)
    return feeds


_BUILT = [
    ("LSTM", {"direction": "bidirectional", "layout": 1, "seq": True, "init": True}),
    ("LSTM", {"direction": "reverse", "seq": True, "peep": True}),
    ("LSTM", {"clip": 0.7, "input_forget": 1, "init": True}),
    ("GRU", {"direction": "bidirectional", "seq": True, "linear_before_reset": 1}),
    ("GRU", {"direction": "reverse", "layout": 1, "init": True}),
    ("GRU", {"clip": 0.5, "seq": True, "init": True}),
]


@pytest.mark.parametrize(("kind", "attrs"), _BUILT, ids=[f"{k}-{i}" for i, (k, _) in
                                                          enumerate(_BUILT)])
def test_reference_equals_onnxruntime(kind, attrs):
    """Bidirectional, reverse, layout=1, sequence lengths, initial states, peepholes, clip,
    input_forget and linear_before_reset, against onnxruntime."""
    model, model0 = _model(kind, **attrs)
    g = taso_jax.load_onnx(model)
    assert kind.lower() in _ops(g)
    feeds = _feeds(model)
    for a, b in zip(_run(g, feeds), _ort(model0, feeds), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    if attrs.get("seq"):  # Y is zero past each sequence's length
        y = _run(g, feeds)[0]
        steps = y.shape[1] if attrs.get("layout") else y.shape[0]
        for b, n in enumerate(feeds["S"]):
            past = y[b, n:] if attrs.get("layout") else y[n:, :, b]
            assert n == steps or not past.any()


def test_a_node_with_unused_outputs_imports():
    """An LSTM whose Y is left unnamed and whose Y_c is unused imports declared."""
    model, _ = _model("LSTM", outs=["", "Y_h"])
    g = taso_jax.load_onnx(model)
    assert "lstm" in _ops(g) and "opaque" not in _ops(g)
    feeds = _feeds(model)
    np.testing.assert_allclose(_run(g, feeds)[0], _ort(model, feeds)[0], rtol=1e-4, atol=1e-5)


def test_other_activations_stay_opaque():
    model, _ = _model("GRU", activations=["Relu", "Tanh"])
    g = taso_jax.load_onnx(model)
    assert "gru" not in _ops(g) and "opaque" in _ops(g)


def test_shape_rule_refuses_bad_shapes():
    f = "float32"
    good = [TensorType((5, 2, 3), f), TensorType((1, 12, 3), f), TensorType((1, 12, 4), f),
            TensorType((1, 24), f), TensorType((1, 2, 4), f)]
    assert OPS["gru"].infer(good, dict(OPS["gru"].attrs))[0].shape == (5, 1, 2, 4)
    bad = {1: TensorType((1, 12, 2), f), 2: TensorType((1, 8, 4), f), 3: TensorType((1, 12), f),
           4: TensorType((2, 2, 4), f)}
    for k, t in bad.items():
        with pytest.raises(ShapeError):
            OPS["gru"].infer(good[:k] + [t] + good[k + 1:], dict(OPS["gru"].attrs))
    with pytest.raises(ShapeError):  # two directions need two sets of weights
        OPS["gru"].infer(good, {**OPS["gru"].attrs, "direction": "bidirectional"})
    with pytest.raises(ShapeError):
        OPS["gru"].infer(good + [TensorType((2,), "float32")], dict(OPS["gru"].attrs))


def _hoisted(g):
    """``g`` with every recurrence rewritten by the hoisting rules read off the laws."""
    rules = [r for r in derived_rules() if r.name.startswith(("lower-lstm_scan",
                                                                "lower-gru_scan"))]
    assert len(rules) == 4
    for rule in rules:
        while (nxt := next(iter(rewrites(rule, g)), None)) is not None:
            g = nxt
    return g


@pytest.mark.parametrize(("kind", "attrs"), [
    ("LSTM", {"direction": "bidirectional", "init": True, "peep": True}),
    ("GRU", {"direction": "reverse", "layout": 1, "linear_before_reset": 1}),
    ("GRU", {"init": True}),
])
def test_hoisted_round_trip_equals_the_original_in_onnxruntime(kind, attrs):
    """Import, hoist the input projection (the derived rule), export: the written model
    equals the original in onnxruntime at two input scales, and so does the graph in JAX."""
    model, model0 = _model(kind, t=7, **attrs)
    g = taso_jax.load_onnx(model)
    h = _hoisted(g)
    assert {"rnn_project", f"{kind.lower()}_scan"} <= set(_ops(h))
    assert kind.lower() not in _ops(h)
    written = taso_jax.export_onnx(h)
    onnx.checker.check_model(written, full_check=True)
    plain = taso_jax.export_onnx(g)
    for scale in (1.0, 100.0):
        feeds = _feeds(model, scale)
        want = _ort(model0, feeds)
        for got in (_ort(written, feeds), _ort(plain, feeds), _run(h, feeds)):
            for a, b in zip(got, want, strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_the_search_hoists_where_the_cost_model_says_it_pays():
    """With a cost model that prices the input product inside the recurrence higher, the
    search applies the derived rule and the result equals the input."""
    from taso_jax.search.cost import AnalyticCostModel

    class StepCost(AnalyticCostModel):
        """The analytic model, with a step's input product costing 4x inside a scan."""

        def _cost(self, node):
            cost = super()._cost(node)
            return cost * 4 if node.op in ("lstm", "gru") else cost

    model, _ = _model("LSTM", t=20, inputs=32, hidden=8)
    g = taso_jax.load_onnx(model)
    from proof_store import proved_set

    rules = proved_set("lstm_scan hoisting")  # proved once, kept in tests/data
    assert rules and all(r.proof_status == "proved" for r in rules)
    r = taso_jax.search_graph(g, cost_model=StepCost(), budget=10, end_to_end=0,
                              substitutions=rules)
    assert "lstm_scan" in _ops(r.graph), r.applied
    feeds = _feeds(model)
    for a, b in zip(_run(r.graph, feeds), _run(g, feeds), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", RECURRENT)
def test_declared_with_examples_and_laws(name):
    op = OPS[name]
    assert op.examples and op.to_onnx and op.doc and op.num_outputs({}) in (2, 3)
    if name in ("lstm", "gru"):
        assert len(op.axioms) == 2 and all(ax.derive == "ltr" for ax in op.axioms)
