"""rms_norm, layer_norm and their gain: recognized in the forms people write, rules read off
their laws and proved, and the gain folded into the matmul that reads it."""

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from taso_jax.search.rules import default_substitutions
from taso_jax.verify.from_laws import derived_rules
from taso_jax.verify.prover import Prover

import taso_jax

D = 16
EPS = 1e-5


def _mean(x):
    return jnp.mean(x, axis=-1, keepdims=True)


def _llama(x, g, b):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + EPS) * g


def _rms_div(x, g, b):
    return x / jnp.sqrt(_mean(x ** 2) + EPS) * g


def _layer_var(x, g, b):
    return (x - _mean(x)) / jnp.sqrt(jnp.var(x, axis=-1, keepdims=True) + EPS) * g + b


def _layer_written(x, g, b):
    c = x - _mean(x)
    return c * jax.lax.rsqrt(_mean(c * c) + EPS) * g + b


def _flax(cls):
    import flax.linen as nn

    def fn(x, g, b):
        params = {"scale": g} if cls == "RMSNorm" else {"scale": g, "bias": b}
        return getattr(nn, cls)(epsilon=EPS).apply({"params": params}, x)
    return fn


FORMS = {"llama": (_llama, "rms_norm"), "rms_div": (_rms_div, "rms_norm"),
         "layer_var": (_layer_var, "layer_norm"), "layer_written": (_layer_written, "layer_norm"),
         "flax_layer": (_flax("LayerNorm"), "layer_norm"),
         "flax_rms": (_flax("RMSNorm"), "rms_norm")}


def _check(graph, fn, args, scales=(1.0, 100.0), rtol=2e-5):
    run = taso_jax.compile_graph(graph)
    for s in scales:
        got = run(args[0] * s, *args[1:])
        got = got[0] if isinstance(got, tuple | list) else got
        want = jax.jit(fn)(args[0] * s, *args[1:])
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=rtol,
                                   atol=rtol * s)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_norm_recognized_in_each_written_form(form):
    """Each form imports as one norm operator and its gain (scale_last), and the imported
    graph computes jax.jit of the function at two input scales."""
    if form.startswith("flax"):
        pytest.importorskip("flax")
    fn, op = FORMS[form]
    key = jax.random.key(0)
    x = jax.random.normal(key, (2, 7, D)) + 0.5
    g = 1 + 0.1 * jax.random.normal(jax.random.fold_in(key, 1), (D,))
    b = 0.1 * jax.random.normal(jax.random.fold_in(key, 2), (D,))
    graph = taso_jax.from_jax(fn, x, g, b)
    ops = [n.op for n in graph.nodes]
    assert ops.count(op) == 1 and "scale_last" in ops, ops
    assert not {"sqrt", "reduce_sum", "reduce_mean", "ewdiv"} & set(ops), ops
    _check(graph, fn, (x, g, b))


def test_a_norm_over_another_axis_is_not_recognized():
    def fn(x):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-2, keepdims=True) + EPS)

    ops = [n.op for n in taso_jax.from_jax(fn, jnp.ones((2, 5, D))).nodes]
    assert "rms_norm" not in ops and "sqrt" in ops


def _onnx_model(decomposed: bool, opset: int = 17):
    rng = np.random.default_rng(0)
    g, b = (rng.standard_normal(D).astype(np.float32) for _ in range(2))
    inits = [numpy_helper.from_array(g, "g"), numpy_helper.from_array(b, "b"),
             numpy_helper.from_array(np.asarray(2.0, np.float32), "two"),
             numpy_helper.from_array(np.asarray(EPS, np.float32), "eps")]
    node = helper.make_node
    if decomposed:  # as torch exports nn.LayerNorm below opset 17
        nodes = [node("ReduceMean", ["x"], ["m"], axes=[-1]), node("Sub", ["x", "m"], ["c"]),
                 node("Pow", ["c", "two"], ["c2"]), node("ReduceMean", ["c2"], ["v"], axes=[-1]),
                 node("Add", ["v", "eps"], ["ve"]), node("Sqrt", ["ve"], ["r"]),
                 node("Div", ["c", "r"], ["n"]), node("Mul", ["n", "g"], ["ng"]),
                 node("Add", ["ng", "b"], ["y"])]
    else:
        nodes = [node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1, epsilon=EPS)]
    graph = helper.make_graph(
        nodes, "ln", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5, D])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5, D])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("decomposed", [True, False])
def test_onnx_layer_norm_imported_and_exported(decomposed):
    """ONNX's LayerNormalization and its decomposed form import as layer_norm, scale_last
    and ewadd; imported and re-exported, the model agrees with onnxruntime on the original."""
    model = _onnx_model(decomposed)
    graph = taso_jax.load_onnx(model)
    ops = [n.op for n in graph.nodes]
    assert "layer_norm" in ops and "scale_last" in ops, ops
    assert not {"sqrt", "reduce_mean", "ewdiv", "pow"} & set(ops), ops
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    out = taso_jax.export_onnx(graph)
    onnx.checker.check_model(out)
    sess = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])
    run = taso_jax.compile_graph(graph)
    for s in (1.0, 100.0):
        x = (np.random.default_rng(1).standard_normal((3, 5, D)) * s).astype(np.float32)
        want = ref.run(None, {"x": x})[0]
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, rtol=1e-4, atol=1e-4)
        got = run(x)
        got = got[0] if isinstance(got, tuple | list) else got
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


NEW_RULES = {"rms_norm-from-ewmul-reduce_mean-scalar_add-sqrt-ewdiv",
             "layer_norm-from-reduce_mean-ewsub-ewmul-scalar_add-sqrt-ewdiv",
             "matmul-from-scale_last-matmul", "grouped_attention-from-repeat-attention",
             "grouped_attention-from-repeat-transpose-attention"}


def test_derived_rules_shipped_and_proved():
    """The rules read off the norm, gain and grouped-attention laws are shipped first, stamped
    proved, and proved again here from the axioms."""
    rules = {r.name: r for r in derived_rules() if r.name in NEW_RULES}
    assert set(rules) == NEW_RULES
    shipped = {s.id: s for s in default_substitutions()}
    prover = Prover()
    for name, rule in rules.items():
        assert shipped[rule.id].proof_status == "proved", name
        assert prover.prove(rule)["status"] == "proved", name


def test_builder_composition_becomes_rms_norm():
    """The law's composition, built by hand, matches the derived rule, and the rewritten
    graph (one rms_norm) computes the same."""
    from taso_jax.search.match import find_matches, prepare

    from taso_jax.ir.graph import GraphBuilder

    b = GraphBuilder()
    x = b.new_input((4, D), name="x")
    ms = b.reduce_mean(b.ewmul(x, x), axes=(-1,), keepdims=True)
    b.mark_output(b.ewdiv(x, b.sqrt(b.scalar_add(ms, scalar=EPS))))
    graph = b.graph()
    rule = next(r for r in default_substitutions() if r.name.startswith("rms_norm-from"))
    (match,) = find_matches(rule, graph)
    rewritten = graph.replace(prepare(rule, graph, match).mapping)
    assert [n.op for n in rewritten.nodes if n.op != "input"] == ["rms_norm"], rewritten
    xs = np.random.default_rng(0).standard_normal((4, D)).astype(np.float32)
    for s in (1.0, 100.0):
        want, got = (taso_jax.compile_graph(g)(xs * s) for g in (graph, rewritten))
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5)


def _projections(w, x):
    h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + EPS) * w["g"]
    return jax.nn.silu(h @ w["a"]) * (h @ w["b"])


@pytest.mark.slow
def test_gain_folded_into_the_matmuls_that_read_it():
    """matmul(scale_last(rms_norm(x), g), W) becomes matmul(rms_norm(x), scale_rows(W, g)):
    no gain is applied at run time, and the outputs are the same at two scales."""
    key = jax.random.key(3)
    w = {"g": 1 + 0.1 * jax.random.normal(key, (D,)),
         "a": jax.random.normal(jax.random.fold_in(key, 1), (D, 24)) * 0.2,
         "b": jax.random.normal(jax.random.fold_in(key, 2), (D, 24)) * 0.2}
    x = jax.random.normal(jax.random.fold_in(key, 3), (2, 9, D))
    graph = taso_jax.from_jax(_projections, w, x, weight_argnums=0)
    result = taso_jax.search_graph(graph, cost_model="analytic", end_to_end=0, time_limit=60)
    runtime = {n.op for n in result.graph.nodes if not n.weight_only}
    assert "scale_last" not in runtime and "rms_norm" in runtime, result.graph
    assert "matmul-from-scale_last-matmul" in result.applied
    run = taso_jax.compile_graph(result.graph)
    for s in (1.0, 100.0):
        got = run(x * s)
        got = got[0] if isinstance(got, tuple | list) else got
        np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(_projections)(w, x * s)),
                                   rtol=1e-4, atol=1e-4)
