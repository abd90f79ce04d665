"""``@taso_jax.optimize`` on real flax and equinox models, NasRNN, transformations, bad input.

Every output is compared with ``jax.jit`` of the original function (the independent
executor). Measured CPU times are printed (``-s``) and collected for the end-of-run summary;
they are never asserted.
"""

from __future__ import annotations

import json
import re
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import taso_jax
from taso_jax.report import ATOL, RTOL

sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
import jax_models  # noqa: E402
from conftest import MODEL_REPORTS, slow_cases  # noqa: E402

#: Deterministic and fast for tests (the estimate decides: no end-to-end timing); the README
#: figures use the measured cost model and the default end-to-end choice.
OPTS = {"cost_model": "analytic", "budget": 20, "time_limit": 60.0, "end_to_end": 0}


def _assert_close(got, ref):
    got, ref = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)
    assert len(got) == len(ref)
    for a, b in zip(got, ref, strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert a.shape == b.shape
        scale = np.max(np.abs(b))
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL * scale)


def _run_model(name, **extra):
    fn, weights, inputs = jax_models.MODELS[name]()
    opt = taso_jax.optimize(fn, weight_argnums=0, **{**OPTS, **extra})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback would be a failure here
        got = opt(weights, *inputs)
    _assert_close(got, jax.jit(fn)(weights, *inputs))
    assert opt.fallback_reason is None
    report = opt.report(repeats=10)
    print(f"\n{name}:\n{report}")
    t = opt.measure(repeats=10)
    r = opt._last.result
    MODEL_REPORTS.append(
        f"@optimize {name:<13} operators {sum(opt.graph.op_counts().values()):>4} -> "
        f"{sum(r.graph.op_counts().values()):<4} estimated cost {r.cost_before:>9.0f} -> "
        f"{r.cost_after:>9.0f} us  search {r.seconds:5.1f} s  applied "
        f"{sum(r.applied.values())}  CPU time {t['before_us']:.0f} -> {t['after_us']:.0f} us "
        f"({t['speedup']:.2f}x, median of {t['repeats']}, jax.jit vs optimized with the "
        "end-to-end choice off: the analytic estimate alone decides)")
    return opt, report


@pytest.mark.slow
@pytest.mark.parametrize("name", ["flax_bert_block", "eqx_mlp", "eqx_convnet", "flax_lstm",
                                  "flax_vit_block", "eqx_attention", "flax_causal_lm",
                                  "flax_cnn_bn", "stax_resnet"])
def test_real_models_match_jax_jit(name):
    opt, report = _run_model(name)
    if opt.original_kept == "the search changed nothing":
        # unchanged, and folding its weight-only work could not reach MIN_SPEEDUP: jax.jit
        # of the original runs, nothing to check
        assert opt.optimized_graph.key == opt.graph.key
        assert "running jax.jit of the original function" in report
    else:
        assert "output check (jax.jit of the original function" in report
    assert "measured time" in report
    assert opt.graph.meta["source"] == "jaxpr"


@pytest.mark.slow
def test_flax_resnet50_folds_batchnorm_into_convolutions():
    opt, report = _run_model("flax_resnet50", budget=2)
    before, after = opt.graph.op_counts(), opt.optimized_graph.op_counts()
    # 53 batchnorms, each a scale and a shift on the NHWC tensor; folding removes the scales.
    # (a block's shortcut convolution may merge with its first convolution: same input)
    assert before["conv2d"] == 53 and after["conv2d"] <= 53
    assert after["ewmul"] < before["ewmul"], (before, after)
    # the report prints the law of the fold: the scale moves onto the kernel
    assert re.search(r"=>  conv2d\(\w+, ewmul\(\w+, transpose\(", report), report
    assert opt.graph.meta["source"] == "jaxpr"


@pytest.mark.slow
def test_nasrnn_weight_concatenation_is_precomputed():
    fn, weights, inputs = jax_models.make_nasrnn(hidden=64, steps=2)
    opt = taso_jax.optimize(fn, weight_argnums=0, **OPTS)
    _assert_close(opt(weights, *inputs), jax.jit(fn)(weights, *inputs))
    assert opt.optimized_graph.op_counts()["matmul"] < opt.graph.op_counts()["matmul"]
    eqns = opt.runtime_jaxpr().eqns
    prims = {e.primitive.name for e in eqns}
    # The only concatenation left at run time joins the two steps' input rows (the row
    # merge: both go through one matmul); the weights are concatenated ahead of time.
    concats = [e for e in eqns if e.primitive.name == "concatenate"]
    assert all(e.params["dimension"] == 0 and e.outvars[0].aval.shape == (2, 64)
               for e in concats), "weights are concatenated at run time"
    assert "dot_general" in prims
    # The folded weights are computed once per distinct weight arrays, then reused.
    folded = opt._last.folded_for[1]
    opt(weights, *inputs)
    assert opt._last.folded_for[1] is folded
    new_w = jax.tree_util.tree_map(lambda a: a * 0.5, weights)
    _assert_close(opt(new_w, *inputs), jax.jit(fn)(new_w, *inputs))
    assert opt._last.folded_for[1] is not folded


@pytest.mark.slow
def test_end_to_end_choice_runs_the_fastest_measured_graph():
    # By default the first call times the search's cheapest graphs and the original under
    # jax.jit and keeps the fastest; whichever wins, outputs match the original.
    # (It screens them; the decorator's own comparison with jax.jit then confirms the pick.)
    fn, weights, inputs = jax_models.make_nasrnn(hidden=64, steps=2)
    opt = taso_jax.optimize(fn, weight_argnums=0, cost_model="analytic", budget=20,
                            time_limit=60.0)
    _assert_close(opt(weights, *inputs), jax.jit(fn)(weights, *inputs))
    e = opt._last.result.end_to_end
    assert e["measured"] >= 2 and len(e["times_us"]) == e["measured"]
    kept = opt.optimized_graph
    if e["original_kept"]:
        assert kept.key == opt.graph.key
    else:  # the input is timed first; the pick's fastest round was below its own
        assert e["floors_us"][e["chosen"]] < e["floors_us"][0]
        assert kept.op_counts()["matmul"] < opt.graph.op_counts()["matmul"]
    assert "end-to-end choice" in opt.report(time=False)
    # end_to_end=0 trusts the estimate and times nothing
    opt0 = taso_jax.optimize(fn, weight_argnums=0, cost_model="analytic", budget=20,
                             end_to_end=0)
    opt0(weights, *inputs)
    assert not opt0._last.result.end_to_end


@pytest.mark.slow
def test_first_call_inside_jit_and_grad_is_optimized_not_a_fallback():
    # Traced from the start: the end-to-end timing and the output check still run on
    # concrete arrays (jax.ensure_compile_time_eval), so nothing falls back to jax.jit.
    fn, weights, inputs = jax_models.make_nasrnn(hidden=32, steps=1)
    opt = taso_jax.optimize(fn, weight_argnums=0, cost_model="analytic", budget=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _assert_close(jax.jit(opt)(weights, *inputs), jax.jit(fn)(weights, *inputs))
        assert opt.fallback_reason is None and opt._last.result.end_to_end["measured"] >= 2
        opt2 = taso_jax.optimize(fn, weight_argnums=0, cost_model="analytic", budget=10)
        loss = lambda f: lambda w: sum(jnp.sum(y) for y in  # noqa: E731
                                       jax.tree_util.tree_leaves(f(w, *inputs)))
        _assert_close(jax.grad(loss(opt2))(weights), jax.grad(loss(fn))(weights))
        assert opt2.fallback_reason is None


@pytest.mark.slow
def test_grad_and_vmap_of_the_optimized_function():
    fn, weights, (x,) = jax_models.make_eqx_mlp(batch=4)
    opt = taso_jax.optimize(fn, weight_argnums=0, **OPTS)
    loss = lambda f: lambda w, x: jnp.sum(f(w, x) ** 2)  # noqa: E731
    _assert_close(jax.grad(loss(opt))(weights, x), jax.grad(loss(fn))(weights, x))
    _assert_close(jax.grad(loss(opt), argnums=1)(weights, x),
                  jax.grad(loss(fn), argnums=1)(weights, x))
    xs = jnp.stack([x, 2 * x])
    _assert_close(jax.vmap(opt, in_axes=(None, 0))(weights, xs),
                  jax.vmap(fn, in_axes=(None, 0))(weights, xs))
    _assert_close(jax.jit(opt)(weights, x), fn(weights, x))


def test_plain_decorator_retraces_per_shape_and_keeps_static_leaves():
    calls = []

    @taso_jax.optimize
    def f(x, cfg):
        calls.append(1)
        return jnp.tanh(x) * cfg["scale"] if cfg["mode"] == "tanh" else x

    a = f(jnp.ones((2, 3)), {"mode": "tanh", "scale": 2.0})
    np.testing.assert_allclose(a, np.tanh(1.0) * 2.0 * np.ones((2, 3)), rtol=1e-6)
    f(jnp.zeros((2, 3)), {"mode": "tanh", "scale": 3.0})  # same signature: no retrace
    n = len(calls)
    f(jnp.ones((4, 3)), {"mode": "tanh", "scale": 2.0})  # new shape: retrace
    assert len(calls) > n
    b = f(jnp.ones((4, 3)), {"mode": "id", "scale": 2.0})  # static leaf changed: retrace
    np.testing.assert_allclose(b, np.ones((4, 3)))


def test_weight_argnames_and_keyword_call():
    @taso_jax.optimize(weight_argnames="w", **OPTS)
    def f(w, x):
        return x @ w["a"] + x @ w["b"]

    w = {"a": jnp.eye(4), "b": 2 * jnp.eye(4)}
    x = jnp.arange(8.0).reshape(2, 4)
    np.testing.assert_allclose(f(w, x=x), 3 * x, rtol=1e-6)
    assert {n.name for n in f.graph.inputs} == {"x"}


def test_python_control_flow_on_values_is_a_clear_error():
    @taso_jax.optimize
    def f(x):
        return x if x.sum() > 0 else -x

    with pytest.raises(jax.errors.ConcretizationTypeError) as info:
        f(jnp.ones(3))
    assert any("taso_jax.optimize" in n for n in getattr(info.value, "__notes__", []))


def test_bad_argnums_name_the_argument():
    with pytest.raises(ValueError, match="weight_argnames: 'params' is not a parameter"):
        taso_jax.optimize(lambda w, x: x, weight_argnames="params")
    f = taso_jax.optimize(lambda w, x: x * w, weight_argnums=2)
    with pytest.raises(ValueError, match="weight_argnums: position 2 is out of range"):
        f(jnp.ones(2), jnp.ones(2))
    g = taso_jax.optimize(lambda w, x: x * w, weight_argnums=0, static_argnums=0)
    with pytest.raises(ValueError, match="both weight and static"):
        g(jnp.ones(2), jnp.ones(2))


def test_failure_in_the_pipeline_falls_back_with_a_warning(monkeypatch):
    import taso_jax.optimizer as optimizer

    def broken(*a, **k):
        raise RuntimeError("search exploded")

    monkeypatch.setattr(optimizer, "run_search", broken)

    @taso_jax.optimize(**OPTS)
    def f(x):
        return jnp.tanh(x) + 1

    with pytest.warns(RuntimeWarning, match="falling back to jax.jit.*search exploded"):
        y = f(jnp.ones(3))
    np.testing.assert_allclose(y, np.tanh(1.0) + 1, rtol=1e-6)
    assert "search exploded" in f.fallback_reason
    assert "not optimized" in f.report()


def test_wrong_rewrite_is_caught_by_the_check_and_falls_back(monkeypatch):
    from taso_jax.search.rules import PNode, Substitution

    import taso_jax.first_call_check as first_call_check

    # on CPU the default precision is full float32: nothing is compiled again to compare at
    # full precision
    again = []
    monkeypatch.setattr(first_call_check, "_rounding_noise", lambda *a: again.append(1) or [0.0])
    monkeypatch.setattr(first_call_check, "_at_full_precision", lambda f: again.append(1) or f)

    # relu(a) => a: wrong. Unproved, so it is left out unless allowed; allowed in, the
    # first-call check against jax.jit must catch it.
    bad = Substitution("bad:relu=>id", (("a", ("...",)),),
                       (PNode("relu", (), ("a",)),), (), (("#0", "a"),), {})

    @taso_jax.optimize(cost_model="analytic", substitutions=[bad], allow_unverified=True,
                       end_to_end=0)
    def f(x):
        return jax.nn.relu(x) * 3.0

    x = jnp.linspace(-1, 1, 8)
    with pytest.warns(RuntimeWarning, match="outputs differ"):
        y = f(x)
    np.testing.assert_allclose(y, np.maximum(np.asarray(x), 0) * 3.0, rtol=1e-6)
    assert jax.default_backend() != "cpu" or again == []


@pytest.mark.slow
def test_an_optimized_signature_is_called_through_the_short_path_and_never_served_stale(
        monkeypatch):
    from taso_jax.decorator import OptimizedFunction

    def fn(w, x):
        return jax.nn.relu(x @ w["a"]) + jnp.tanh(x @ w["b"])

    key = jax.random.split(jax.random.key(3), 4)
    w = {"a": jax.random.normal(key[0], (16, 16)), "b": jax.random.normal(key[1], (16, 16))}
    w2 = {"a": jax.random.normal(key[2], (16, 16)), "b": jax.random.normal(key[3], (16, 16))}
    opt = taso_jax.optimize(fn, weight_argnums=0, cost_model="analytic", end_to_end=0)
    ref = jax.jit(fn)
    x = jnp.ones((4, 16))
    _assert_close(opt(w, x), ref(w, x))
    assert opt.original_kept is None and opt.fallback_reason is None  # runs optimized
    full = []
    bind = OptimizedFunction._bind
    monkeypatch.setattr(OptimizedFunction, "_bind",
                        lambda self, a, k: full.append(1) or bind(self, a, k))
    for scale in (2.0, -3.0):  # new input values: the short path
        _assert_close(opt(w, x * scale), ref(w, x * scale))
    assert not full
    _assert_close(opt(w2, x), ref(w2, x))  # new weight arrays: the full path folds them
    _assert_close(opt(w2, x * 5), ref(w2, x * 5))
    _assert_close(opt(w, jnp.ones((2, 16))), ref(w, jnp.ones((2, 16))))  # another shape
    _assert_close(opt(w, x), ref(w, x))
    assert len(full) == 3
    # under a transformation, with the short path set: an input is a tracer (the weights
    # are the same concrete arrays under vmap and grad of x), so the full path traces the
    # optimized stages, and no tracer is kept as the last call
    transformed = [lambda f: jax.vmap(f, in_axes=(None, 0))(w, jnp.stack([x, -x])),
                   lambda f: jax.grad(lambda x: jnp.sum(f(w, x) ** 2))(x),
                   lambda f: jax.jit(f)(w, x)]
    for run in transformed:
        _assert_close(opt(w, x), ref(w, x))
        assert opt._opt_fast is not None
        before = len(full)
        _assert_close(run(opt), run(ref))
        assert len(full) == before + 1
        assert not any(isinstance(a, jax.core.Tracer)
                       for a in jax.tree_util.tree_leaves(opt._last.last_call))
    full.clear()
    w_np = jax.tree_util.tree_map(np.array, w)  # NumPy weights always take the full path
    _assert_close(opt(w_np, x), ref(w_np, x))
    w_np["a"] *= 2  # changed in place
    _assert_close(opt(w_np, x), ref(w_np, x))
    assert len(full) == 2


@pytest.mark.parametrize("device_noise, accepted", [(2e-2, True), (1e-6, False)])
def test_the_check_allows_what_the_devices_default_precision_already_rounds(device_noise,
                                                                            accepted,
                                                                            monkeypatch):
    from taso_jax.search.rules import PNode, Substitution

    import taso_jax.first_call_check as first_call_check

    monkeypatch.setattr(first_call_check, "_default_precision_rounds", lambda: True)  # as on a GPU

    # On GPUs, float32 products at the default precision round to TF32, so a regrouped graph
    # differs from jax.jit of the original by about that rounding. Simulated on CPU (which
    # always computes in full float32): the function adds `device_noise` unless traced at
    # full precision. The rewrite relu(a) => a is off by up to 0.03 on these inputs: within
    # 4x a noise of 0.02 it passes the check, against a noise of 1e-6 it falls back.
    bad = Substitution("bad:relu=>id", (("a", ("...",)),),
                       (PNode("relu", (), ("a",)),), (), (("#0", "a"),), {})

    @taso_jax.optimize(cost_model="analytic", substitutions=[bad], allow_unverified=True,
                       end_to_end=0)
    def f(x):
        y = jax.nn.relu(x) * 3.0
        if jax.config.jax_default_matmul_precision != "highest":
            y = y + device_noise
        return y

    x = jnp.linspace(-1e-2, 1, 64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = f(x)
    fell_back = any("outputs differ" in str(w.message) for w in caught)
    assert fell_back is not accepted
    if accepted:
        check = f._entry().report["check"]
        assert check["ok"] and check["rounding_noise"] == pytest.approx(device_noise, rel=1e-3)
        assert "full float32 precision" in f.report(time=False)
        np.testing.assert_allclose(y, np.asarray(x) * 3.0 + device_noise, rtol=1e-5)
    else:
        np.testing.assert_allclose(y, np.maximum(np.asarray(x), 0) * 3.0 + device_noise,
                                   rtol=1e-5)


@pytest.mark.slow
def test_a_graph_the_default_precision_rounds_more_than_the_original_runs_at_full_precision(
        monkeypatch, tmp_path):
    import taso_jax.first_call_check as first_call_check
    import taso_jax.traced_source as traced_source

    # On a GPU, cuBLAS may run the merged matmuls at TF32 where the original's smaller ones
    # ran in float32 (NasRNN on an H200: 1.3e-3 off, the original's own noise 0). Simulated
    # on CPU: the optimized stages are off by 1e-2 unless traced at full float32 precision;
    # the original is not.
    class RoundingStages(traced_source.StagedGraph):
        def run(self, consts, *args):
            out = super().run(consts, *args)
            if jax.config.jax_default_matmul_precision != "highest":
                out = tuple(o + 1e-2 for o in out)
            return out

    monkeypatch.setattr(traced_source, "StagedGraph", RoundingStages)
    monkeypatch.setattr(first_call_check, "_default_precision_rounds", lambda: True)  # as on a GPU
    monkeypatch.setenv("TASO_JAX_GRAPH_CACHE", str(tmp_path))
    fn, weights, inputs = jax_models.make_nasrnn(hidden=32, steps=1)
    ref = jax.jit(fn)(weights, *inputs)
    for first in (True, False):  # the second reads the graph cache, with no check
        opt = taso_jax.optimize(fn, weight_argnums=0, cost_model="analytic", end_to_end=0)
        _assert_close(opt(weights, *inputs), ref)
        entry = opt._entry()
        assert opt.fallback_reason is None and entry.full_precision
        assert entry.cache_hit is not first
        assert "HIGHEST" in str(opt.runtime_jaxpr())
    assert "full float32 precision" in opt.report(time=False)
    # a rewrite that is wrong at every precision still falls back
    from taso_jax.search.rules import PNode, Substitution

    bad = Substitution("bad:relu=>id", (("a", ("...",)),),
                       (PNode("relu", (), ("a",)),), (), (("#0", "a"),), {})
    f = taso_jax.optimize(lambda x: jax.nn.relu(x) * 3.0, cost_model="analytic",
                          substitutions=[bad], allow_unverified=True, end_to_end=0)
    with pytest.warns(RuntimeWarning, match="outputs differ"):
        f(jnp.linspace(-1, 1, 64))
    assert not f._entry().full_precision


def test_compare_outputs_floor_raises_the_absolute_tolerance_per_output():
    from taso_jax.report import compare_outputs

    ref = [np.ones(4, np.float32), np.ones(4, np.float32)]
    got = [r + np.float32(0.01) for r in ref]
    assert not compare_outputs(got, ref)["ok"]
    assert not compare_outputs(got, ref, floor=[0.02, 0.0])["ok"]
    ok = compare_outputs(got, ref, floor=[0.02, 0.02])
    assert ok["ok"] and ok["atol_floor"] == 0.02


@pytest.mark.parametrize("name", ["flax_bert_block", "eqx_convnet", "eqx_mlp"])
def test_jax_to_onnx_matches_onnxruntime(name, tmp_path):
    import onnx
    import onnxruntime as ort

    fn, weights, inputs = jax_models.MODELS[name]()
    g = taso_jax.from_jax(fn, weights, *inputs, weight_argnums=0)
    model = taso_jax.export_onnx(g)
    onnx.checker.check_model(model, full_check=True)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {n.name: np.asarray(x) for n, x in zip(g.inputs, jax.tree_util.tree_leaves(inputs),
                                                  strict=True)}
    _assert_close(sess.run(None, feeds), jax.jit(fn)(weights, *inputs))


@pytest.mark.slow
def test_opaque_jax_primitives_export_through_jax2onnx_or_name_the_extra(monkeypatch):
    import onnxruntime as ort

    def f(x, w):
        h = x @ w
        return jnp.cumsum(h, axis=1) + jnp.sort(h, axis=-1)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    w = rng.standard_normal((8, 8)).astype(np.float32)
    g = taso_jax.from_jax(f, x, w)
    assert g.meta["opaque"] == {"cumsum": 1, "sort": 1}
    model = taso_jax.export_onnx(g)  # the two opaque equations converted by jax2onnx
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"x": x, "w": w})[0]
    np.testing.assert_allclose(got, np.asarray(f(x, w)), rtol=1e-5, atol=1e-5)
    monkeypatch.setitem(sys.modules, "jax2onnx", None)  # the extra not installed
    with pytest.raises(ValueError, match=r"'cumsum' .*pip install 'taso_jax\[onnx-export\]'"):
        taso_jax.export_onnx(g)


def test_an_unchanged_function_runs_jax_jit_of_the_original():
    # nothing to rewrite and no weight-only work: the optimized path would only add work
    @taso_jax.optimize(**OPTS)
    def f(x, y):
        return jnp.tanh(x) * y

    x, y = jnp.ones((2, 3)), jnp.full((2, 3), 2.0)
    np.testing.assert_allclose(f(x, y), np.tanh(1.0) * 2.0, rtol=1e-6)
    assert f.original_kept == "the search changed nothing" and f.fallback_reason is None
    assert "running jax.jit of the original function" in f.report(time=False)


def test_the_optimized_function_must_beat_jax_jit_of_the_original_when_timed(monkeypatch):
    import taso_jax.first_call_timing as first_call_timing

    # with timing on, a function the search did change is still measured against jax.jit
    # of the original; here the optimized run is made to look slow, so the original runs
    monkeypatch.setattr(first_call_timing, "MIN_SPEEDUP", 1e9)

    @taso_jax.optimize(weight_argnums=0, **{**OPTS, "end_to_end": 2})
    def cell(w, x):
        return x @ w["a"] + x @ w["b"]  # x@a + x@b => x@(a+b): a rewrite the search makes

    w = {"a": jnp.ones((4, 5)), "b": jnp.ones((4, 5))}
    x = jnp.ones((3, 4))
    np.testing.assert_allclose(cell(w, x), 8.0 * np.ones((3, 5)), rtol=1e-6)
    assert cell.original_kept.startswith("jax.jit of the original is as fast")
    assert cell.optimized_graph.op_counts() != cell.graph.op_counts()


@pytest.mark.slow
def test_a_kept_signature_dispatches_to_jax_jit_of_the_original(monkeypatch):
    """No staging on the fast path: later calls go straight to jax.jit of the function."""
    import taso_jax.decorator as decorator
    import taso_jax.first_call_timing as first_call_timing

    monkeypatch.setattr(first_call_timing, "MIN_SPEEDUP", 1e9)  # the original is always kept

    @taso_jax.optimize(weight_argnums=0, **{**OPTS, "end_to_end": 2})
    def cell(w, x):
        return x @ w["a"] + x @ w["b"]

    w = {"a": jnp.ones((4, 5)), "b": jnp.ones((4, 5))}
    x = jnp.ones((3, 4))
    cell(w, x)
    assert cell.original_kept
    calls = []
    original_execute = decorator.OptimizedFunction._execute
    monkeypatch.setattr(decorator.OptimizedFunction, "_execute",
                        lambda *a, **k: calls.append(1) or original_execute(*a, **k))
    np.testing.assert_allclose(cell(w, x + 1.0), 16.0 * np.ones((3, 5)), rtol=1e-6)
    assert calls == []  # the jitted original ran directly, without the wrapper's staging
    # another shape: jax.jit of the original compiles it (its cache grows), and the same
    # call goes on to optimize (and time) it for its own signature
    np.testing.assert_allclose(cell(w, jnp.ones((2, 4))), 8.0 * np.ones((2, 5)), rtol=1e-6)
    assert calls and cell.graph.inputs[0].types[0].shape == (2, 4)
    assert cell._kept_fast is not None and not cell._kept_undecided  # kept too: fast again

    @jax.jit
    def outer(w, x):  # under a transformation, the full path traces the optimized stages
        return cell(w, x)

    calls.clear()
    np.testing.assert_allclose(outer(w, x), 8.0 * np.ones((3, 5)), rtol=1e-6)
    assert calls  # traced: told from the jitted original's result, after its dispatch
    calls.clear()
    np.testing.assert_allclose(jax.vmap(cell, in_axes=(None, 0))(w, jnp.stack([x, 2 * x])),
                               np.stack([8.0, 16.0])[:, None, None] * np.ones((2, 3, 5)),
                               rtol=1e-6)
    assert calls
    np.testing.assert_allclose(cell(w, x), 8.0 * np.ones((3, 5)), rtol=1e-6)
    assert cell._kept_fast is not None  # a traced call leaves the fast path as it was


def test_a_kept_signature_compiles_the_original_once(monkeypatch):
    """The original compiled for the first call's check and timing is the one the kept
    signature's later calls run: jax.jit compiles it once, not twice."""
    import logging

    import taso_jax.first_call_timing as first_call_timing

    monkeypatch.setattr(first_call_timing, "MIN_SPEEDUP", 1e9)  # the original is always kept
    compiles = []

    class Count(logging.Handler):
        def emit(self, record):
            text = record.getMessage()
            if "Finished XLA compilation of jit(" in text and "kept_cell" in text:
                compiles.append(1)

    handler = Count()
    logging.getLogger("jax").addHandler(handler)
    logged = jax.config.jax_log_compiles
    jax.config.update("jax_log_compiles", True)
    try:
        @taso_jax.optimize(weight_argnums=0, **{**OPTS, "end_to_end": 2})
        def kept_cell(w, x):
            return x @ w["a"] + x @ w["b"]

        w = {"a": jnp.ones((4, 5)), "b": jnp.ones((4, 5))}
        x = jnp.ones((3, 4))
        for k in range(3):
            np.testing.assert_allclose(kept_cell(w, x + k), (8.0 + 8 * k) * np.ones((3, 5)))
        assert kept_cell.original_kept and kept_cell._kept_fast is not None
    finally:
        logging.getLogger("jax").removeHandler(handler)
        jax.config.update("jax_log_compiles", logged)
    assert len(compiles) == 1, compiles


@pytest.mark.slow
def test_nasrnn_on_one_dimensional_vectors_merges_its_matmuls():
    """x @ W with x of shape (hidden,) imports as a (1, hidden) row, so the merges apply."""
    fn, weights, (xs, h0) = jax_models.make_nasrnn(hidden=64, steps=2)
    xs1, h1 = xs[:, 0, :], h0[0]
    assert xs1.ndim == 2 and h1.ndim == 1
    opt = taso_jax.optimize(fn, weight_argnums=0, **OPTS)
    _assert_close(opt(weights, xs1, h1), jax.jit(fn)(weights, xs1, h1))
    assert opt.graph.op_counts()["matmul"] == 32
    # per step, the 8 input and the 8 state matmuls merge (28 merges); then both steps'
    # input rows go through one matmul with the merged weight (the row merge): 3 are left
    assert opt.optimized_graph.op_counts()["matmul"] == 3
    applied = opt._last.result.applied
    assert applied.get("merge-matmul-matmul") == 28 and applied.get("merge-matmul-matmul-3") == 1


@pytest.mark.parametrize("name", slow_cases(sorted(jax_models.HAND_REWRITTEN), ["nasrnn"]))
def test_the_hand_rewritten_ceilings_compute_the_original(name):
    """The benchmark reads the optimizer's speedup against a hand rewrite: it must be one."""
    fn, weights, inputs = jax_models.MODELS[name](hidden=32, steps=3)
    hand, hand_weights = jax_models.HAND_REWRITTEN[name](fn, weights, inputs)
    assert jax.tree.structure(hand_weights) != jax.tree.structure(weights)  # merged ahead
    _assert_close(jax.jit(hand)(hand_weights, *inputs), jax.jit(fn)(weights, *inputs))


_CACHE_SCRIPT = """
import sys, jax
sys.path.insert(0, {examples!r})
import jax_models, taso_jax
fn, w, ins = jax_models.make_nasrnn(hidden=64, steps=2)
opt = taso_jax.optimize(fn, weight_argnums=0, cost_model="analytic", end_to_end=0)
jax.block_until_ready(opt(w, *ins))
e = opt._last
stage = e.first_call["search and choice"]
print("HIT" if e.cache_hit else "MISS", sum(e.result.applied.values()), stage)
"""


@pytest.mark.slow
def test_the_graph_cache_is_hit_in_a_second_process(tmp_path):
    import subprocess

    env = {**__import__("os").environ, "TASO_JAX_GRAPH_CACHE": str(tmp_path / "graphs")}
    script = _CACHE_SCRIPT.format(examples=str(Path(__file__).parent.parent / "examples"))
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                           text=True, timeout=300) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    first, second = (r.stdout.split() for r in runs)
    assert first[0] == "MISS" and second[0] == "HIT"
    assert first[1] == second[1] and int(first[1]) > 0  # the same rewrites, not searched again
    assert len(list((tmp_path / "graphs").glob("*.json"))) == 1


@pytest.mark.slow
def test_the_graph_cache_rebuilds_the_graph_and_refuses_a_different_function(tmp_path,
                                                                           monkeypatch):
    from taso_jax.frontends import graph_cache

    monkeypatch.setenv("TASO_JAX_GRAPH_CACHE", str(tmp_path))
    fn, weights, inputs = jax_models.make_nasrnn(hidden=32, steps=1)
    first = taso_jax.optimize(fn, weight_argnums=0, **OPTS)
    first(weights, *inputs)
    again = taso_jax.optimize(fn, weight_argnums=0, **OPTS)
    _assert_close(again(weights, *inputs), jax.jit(fn)(weights, *inputs))
    assert again._last.cache_hit
    assert again.optimized_graph.key == first.optimized_graph.key  # hash-consed: identical
    assert "graph cache" in again.report(time=False)

    def other(w, xs, h):  # one operator differs: another key
        return fn(w, xs, h) * 2.0

    changed = taso_jax.optimize(other, weight_argnums=0, **OPTS)
    _assert_close(changed(weights, *inputs), jax.jit(other)(weights, *inputs))
    assert not changed._last.cache_hit
    # a corrupt file is a miss, not an error
    for f in tmp_path.glob("*.json"):
        f.write_text("{not json")
    broken = taso_jax.optimize(fn, weight_argnums=0, **OPTS)
    _assert_close(broken(weights, *inputs), jax.jit(fn)(weights, *inputs))
    assert not broken._last.cache_hit
    assert graph_cache.graph_cache_dir() == str(tmp_path)


@pytest.mark.slow
def test_a_first_call_past_its_time_limit_runs_the_original_without_timing_it(tmp_path,
                                                                              monkeypatch):
    # The time limit bounds the first call: past it, the 25-round timing against jax.jit is
    # skipped and jax.jit of the original runs (never slower); nothing is cached, so a later
    # process with more of its kernel costs cached may still get further.
    monkeypatch.setenv("TASO_JAX_GRAPH_CACHE", str(tmp_path))
    fn, weights, inputs = jax_models.make_nasrnn(hidden=32, steps=1)
    opt = taso_jax.optimize(fn, weight_argnums=0, cost_model="analytic", budget=5,
                            time_limit=1e-3)
    _assert_close(opt(weights, *inputs), jax.jit(fn)(weights, *inputs))
    assert opt.fallback_reason is None
    # (at 1 ms the limit passes during the import already: issue 47, the import is cut)
    assert opt.original_kept.startswith("not compiled, checked or timed against jax.jit: the "
                                        "time limit")
    assert "0.001 s" in opt.original_kept
    assert "baseline" not in opt._last.report and "check" not in opt._last.report
    assert not list(tmp_path.rglob("*.json"))
    # with time to spare, the same function is timed against jax.jit
    timed = taso_jax.optimize(fn, weight_argnums=0, cost_model="analytic", budget=5,
                              time_limit=60.0)
    timed(weights, *inputs)
    assert "baseline" in timed._last.report
    assert timed.original_kept is None or "not timed" not in timed.original_kept


def test_a_numpy_weight_changed_in_place_is_folded_again():
    """Weights are recognized by identity; a NumPy array can change under the same id."""

    @taso_jax.optimize(weight_argnums=0, **OPTS)
    def cell(w, x):
        return x @ w["a"] + x @ w["b"]  # folded ahead of time into x @ (a + b)

    w = {"a": np.ones((4, 5), np.float32), "b": np.ones((4, 5), np.float32)}
    x = jnp.ones((3, 4))
    np.testing.assert_allclose(cell(w, x), 8.0, rtol=1e-6)
    assert cell.original_kept is None and cell.fallback_reason is None
    w["a"][:] = 10.0  # same object, new values
    np.testing.assert_allclose(cell(w, x), jax.jit(cell.fn)(w, x), rtol=1e-6)
    np.testing.assert_allclose(cell(w, x), 44.0, rtol=1e-6)


def test_the_signature_cache_is_bounded(monkeypatch):
    import taso_jax.decorator as decorator

    monkeypatch.setattr(decorator, "SIGNATURE_CACHE", 3)

    @taso_jax.optimize(**OPTS)
    def f(x):
        return jnp.tanh(x) * 2.0

    for n in range(1, 6):
        np.testing.assert_allclose(f(jnp.ones((n, 2))), 2.0 * np.tanh(1.0), rtol=1e-6)
    assert len(f._cache) == 3
    f(jnp.ones((5, 2)))  # the most recent signatures are kept
    assert len(f._cache) == 3


def test_keyword_only_arguments_are_traced_like_the_others():
    @taso_jax.optimize(weight_argnames="w", static_argnames="act", **OPTS)
    def cell(x, *, w, act="tanh", scale=2.0):
        y = x @ w["a"] + x @ w["b"]
        return (jnp.tanh(y) if act == "tanh" else jax.nn.relu(y)) * scale

    w = {"a": jnp.ones((4, 5)), "b": jnp.ones((4, 5))}
    x = jnp.ones((3, 4)) * 0.1
    ref = jax.jit(cell.fn, static_argnames="act")
    np.testing.assert_allclose(cell(x, w=w), ref(x, w=w), rtol=1e-6)
    np.testing.assert_allclose(cell(x, w=w, act="relu", scale=3.0),
                               ref(x, w=w, act="relu", scale=3.0), rtol=1e-6)
    assert cell.fallback_reason is None
    assert cell.optimized_graph.op_counts()["matmul"] == 1  # x@a + x@b merged: w is weights


def test_background_mode_runs_the_original_until_the_checked_result_is_ready():
    fn, weights, inputs = jax_models.make_nasrnn(hidden=32, steps=1)
    opt = taso_jax.optimize(fn, weight_argnums=0, mode="background", **OPTS)
    ref = jax.jit(fn)(weights, *inputs)
    _assert_close(opt(weights, *inputs), ref)  # at once: jax.jit of the original
    assert opt._last is None or opt._last.result is None  # nothing optimized was used yet
    opt.wait(timeout=300)
    _assert_close(opt(weights, *inputs), ref)
    e = opt._last
    assert e is not None and e.report["check"]["ok"]  # checked before it was swapped in
    assert opt.optimized_graph.op_counts()["matmul"] < opt.graph.op_counts()["matmul"]
    with pytest.raises(ValueError, match="mode"):
        taso_jax.optimize(fn, mode="eager")


@pytest.mark.slow
def test_background_mode_never_swaps_in_a_wrong_result(monkeypatch):
    import taso_jax.first_call_check as first_call_check

    real = first_call_check.compare_outputs

    def always_differ(*a, **k):
        r = real(*a, **k)
        return {**r, "ok": False, "max_abs_err": 1.0}

    monkeypatch.setattr(first_call_check, "compare_outputs", always_differ)
    fn, weights, inputs = jax_models.make_nasrnn(hidden=32, steps=1)
    opt = taso_jax.optimize(fn, weight_argnums=0, mode="background", **OPTS)
    ref = jax.jit(fn)(weights, *inputs)
    opt(weights, *inputs)
    opt.wait(timeout=300)
    _assert_close(opt(weights, *inputs), ref)
    assert opt.fallback_reason and "differ" in opt.fallback_reason


def test_lower_trace_and_jax_export_of_the_optimized_function():
    @taso_jax.optimize(weight_argnums=0, **OPTS)
    def cell(w, x):
        return x @ w["a"] + x @ w["b"]

    w = {"a": jnp.ones((4, 5)), "b": jnp.ones((4, 5))}
    spec = jax.ShapeDtypeStruct((3, 4), jnp.float32)
    lowered = cell.lower(w, spec)
    assert lowered.as_text().count("dot_general") == 1  # the two matmuls were merged
    assert type(cell.trace(w, spec)).__name__ == "Traced"
    exported = jax.export.export(jax.jit(cell))(w, spec)
    np.testing.assert_allclose(exported.call(w, jnp.ones((3, 4))), 8.0, rtol=1e-6)


@pytest.mark.parametrize("keep", [False, True])
def test_donate_argnums_follows_jax_jit(monkeypatch, keep):
    import taso_jax.first_call_timing as first_call_timing

    if keep:
        monkeypatch.setattr(first_call_timing, "MIN_SPEEDUP", 1e9)  # the original runs (fast path)

    def f(w, x):
        return x @ w["s"] + x @ w["t"]  # same shape as x: its buffer can be reused

    w = {"s": jnp.full((4, 4), 0.5), "t": jnp.full((4, 4), 0.75)}
    plain = jnp.ones((3, 4))
    jax.jit(f, donate_argnums=1)(w, plain)
    opt = taso_jax.optimize(f, weight_argnums=0, donate_argnums=1,
                            **{**OPTS, "end_to_end": 2 if keep else 0})
    for _ in range(2):  # the first call (optimizing) and a later one
        x = jnp.ones((3, 4))
        np.testing.assert_allclose(opt(w, x), 5.0, rtol=1e-6)
        assert x.is_deleted() == plain.is_deleted()
    assert bool(opt.original_kept) == keep
    for _ in range(2):  # a new shape: on the fast path its donated input is gone after the
        x = jnp.ones((2, 4))  # first try, so that call returns the original's result
        np.testing.assert_allclose(opt(w, x), 5.0, rtol=1e-6)
        assert x.is_deleted() == plain.is_deleted()
    assert opt.graph.inputs[0].types[0].shape == (2, 4)  # optimized by the second call
    with pytest.raises(ValueError, match="donated"):
        taso_jax.optimize(f, weight_argnums=0, donate_argnums=0)(w, jnp.ones((3, 4)))


@pytest.mark.slow
def test_prng_keys_int_and_bf16_arguments_are_optimized_not_fallen_back():
    @taso_jax.optimize(weight_argnums=0, **OPTS)
    def noisy(w, key, x):
        h = x @ w["a"] + x @ w["b"]  # merged
        return h + 0.01 * jax.random.normal(key, h.shape)

    w = {"a": jnp.ones((4, 5)), "b": jnp.ones((4, 5))}
    for key in (jax.random.key(0), jax.random.PRNGKey(0)):  # typed and raw uint32 keys
        x = jnp.ones((3, 4))
        np.testing.assert_allclose(noisy(w, key, x), jax.jit(noisy.fn)(w, key, x),
                                   rtol=1e-6)
        assert noisy.fallback_reason is None
        assert noisy.optimized_graph.op_counts()["matmul"] == 1
    np.testing.assert_allclose(noisy(w, jax.random.key(1), jnp.ones((3, 4))),
                               jax.jit(noisy.fn)(w, jax.random.key(1), jnp.ones((3, 4))),
                               rtol=1e-6)  # another key value, same signature

    @taso_jax.optimize(weight_argnums=0, **OPTS)
    def emb(w, ids):
        h = w["e"][ids]
        return h @ w["a"] + h @ w["b"]

    we = {"e": jnp.arange(40.0).reshape(10, 4), "a": jnp.ones((4, 4)),
          "b": jnp.ones((4, 4))}
    ids = jnp.array([1, 2, 3])
    np.testing.assert_allclose(emb(we, ids), jax.jit(emb.fn)(we, ids), rtol=1e-6)
    assert emb.fallback_reason is None

    @taso_jax.optimize(weight_argnums=0, **OPTS)
    def half(w, x):
        return x @ w["a"] + x @ w["b"]

    wb = {"a": jnp.ones((4, 4), jnp.bfloat16), "b": jnp.ones((4, 4), jnp.bfloat16)}
    xb = jnp.ones((3, 4), jnp.bfloat16)
    assert half(wb, xb).dtype == jnp.bfloat16 and half.fallback_reason is None
    np.testing.assert_allclose(np.asarray(half(wb, xb), np.float32), 8.0)


def test_keyword_arguments_after_skipped_defaults_and_hashable_statics_run():
    @taso_jax.optimize(**OPTS)
    def f(x, a=1.0, b=2.0):
        return jnp.tanh(x) * a + b

    x = jnp.ones(3)
    np.testing.assert_allclose(f(x, b=3.0), np.tanh(1.0) + 3.0, rtol=1e-6)

    @taso_jax.optimize(static_argnums=(1,), **{**OPTS, "end_to_end": 2})
    def g(x, cfg):
        return x * cfg[0] + 1.0

    for _ in range(2):  # the first call and the fast path of a kept signature
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no fallback
            np.testing.assert_allclose(g(x, (2.0,)), 3.0, rtol=1e-6)


def test_static_arguments_are_keyed_by_value_and_unhashable_ones_refused():
    """As ``jax.jit``: a static argument is hashed and compared by value, so an equal value
    reuses the signature and another value is another signature; a NumPy array, list or
    dict, which could change in place behind a signature keyed by identity, is refused
    with ``jax.jit``'s ValueError, naming the argument."""

    @taso_jax.optimize(static_argnames="scale", **OPTS)
    def g(x, scale):
        return x * scale[0] + 1.0

    x = jnp.ones(3)
    np.testing.assert_allclose(g(x, (2.0,)), 3.0)
    np.testing.assert_allclose(g(x, (3.0,)), 4.0)  # another value: another signature
    np.testing.assert_allclose(g(x, tuple([3.0])), 4.0)  # an equal value: the same one
    assert len(g._cache) == 2
    for bad in (np.array([2.0]), [2.0], {0: 2.0}):
        with pytest.raises(ValueError, match=r"Non-hashable static arguments are not "
                           r"supported.*'scale'"):
            g(x, bad)
    with pytest.raises(ValueError, match="'scale'"):
        g(x, scale=[2.0])
    assert len(g._cache) == 2


def test_a_static_numpy_array_changed_in_place_is_never_served_stale():
    @taso_jax.optimize(static_argnums=1, **OPTS)
    def g(x, table):
        return x * float(table[0])

    x, table = jnp.ones(3), np.array([2.0])
    with pytest.raises(ValueError, match="Non-hashable"):
        g(x, table)
    table[0] = 5.0
    with pytest.raises(ValueError, match="Non-hashable"):
        g(x, table)  # never 2.0 from a signature keyed by the array's identity


def test_unhashable_non_array_leaves_are_refused_like_jax_jit():
    """Non-array leaves are static (as ``equinox.filter_jit``): a hashable one is keyed by
    value, an unhashable one is refused with a TypeError naming its path, as ``jax.jit``
    refuses a non-array leaf."""

    @taso_jax.optimize(**OPTS)
    def g(x, cfg):
        return x * len(cfg["names"][1]) + 1.0

    x = jnp.ones(3)
    np.testing.assert_allclose(g(x, {"names": ("a", "bc")}), 3.0)
    np.testing.assert_allclose(g(x, {"names": ("a", "bcd")}), 4.0)
    with pytest.raises(TypeError, match=r"cfg\['names'\]\[1\].*set.*hashable"):
        g(x, {"names": ("a", {"b", "c"})})


@pytest.mark.slow
def test_a_graph_cache_hit_skips_the_check_unless_always(tmp_path, monkeypatch):
    """The stored graph was checked by the process that stored it: a hit does not compile
    the original again to repeat the check, unless ``check="always"``; a file whose graph
    records were damaged is a miss."""
    monkeypatch.setenv("TASO_JAX_GRAPH_CACHE", str(tmp_path))
    fn, weights, inputs = jax_models.make_nasrnn(hidden=32, steps=1)
    first = taso_jax.optimize(fn, weight_argnums=0, **OPTS)
    first(weights, *inputs)
    assert first._last.report["check"]["ok"] and not first._last.cache_hit
    hit = taso_jax.optimize(fn, weight_argnums=0, **OPTS)
    _assert_close(hit(weights, *inputs), jax.jit(fn)(weights, *inputs))
    assert hit._last.cache_hit
    assert "process that stored" in hit._last.report["check"]["reference"]
    again = taso_jax.optimize(fn, weight_argnums=0, check="always", **OPTS)
    again(weights, *inputs)
    assert again._last.cache_hit
    assert again._last.report["check"]["reference"] == "jax.jit of the original function"
    (path,) = tmp_path.glob("*.json")
    data = json.loads(path.read_text())
    data["nodes"][-1][1] = "ewmul" if data["nodes"][-1][1] != "ewmul" else "ewadd"
    path.write_text(json.dumps(data))
    damaged = taso_jax.optimize(fn, weight_argnums=0, **OPTS)
    _assert_close(damaged(weights, *inputs), jax.jit(fn)(weights, *inputs))
    assert not damaged._last.cache_hit
    with pytest.raises(ValueError, match="check must be"):
        taso_jax.optimize(fn, check="sometimes")


@pytest.mark.slow
def test_the_fast_path_never_serves_the_original_for_an_optimized_signature(monkeypatch):
    """Signatures alternate between one that runs the original and one that runs optimized:
    the optimized one is never answered by the fast path's jax.jit of the original."""
    import taso_jax.decorator as decorator
    import taso_jax.traced_source as traced_source

    monkeypatch.setattr(traced_source, "keep_original",
                        lambda host, entry, traced, result, args, static_pos, *deadline:
                        "kept for the test" if args[1].shape[0] == 3 else None)

    @taso_jax.optimize(weight_argnums=0, **{**OPTS, "end_to_end": 2})
    def cell(w, x):
        return x @ w["a"] + x @ w["b"]

    w = {"a": jnp.ones((4, 5)), "b": jnp.ones((4, 5))}
    kept, optimized = jnp.ones((3, 4)), jnp.ones((2, 4))
    calls = []
    original_execute = decorator.OptimizedFunction._execute
    monkeypatch.setattr(decorator.OptimizedFunction, "_execute",
                        lambda *a, **k: calls.append(a[2][-1].shape) or original_execute(*a, **k))
    for _ in range(3):
        for x in (kept, optimized):
            calls.clear()
            np.testing.assert_allclose(cell(w, x), 8.0 * np.ones((x.shape[0], 5)), rtol=1e-6)
            assert (calls[-1:] == [(2, 4)]) if x is optimized else (calls == []), calls


def _count_confirmations(monkeypatch) -> list:
    """Patch ``confirm_faster`` where the choice and the first call use it; count its calls."""
    import taso_jax.search.choose as choose

    import taso_jax.first_call_timing as first_call_timing

    calls, real = [], choose.confirm_faster

    def counting(*args, **kwargs):
        calls.append(kwargs.get("span_seconds"))
        return real(*args, **kwargs)

    monkeypatch.setattr(choose, "confirm_faster", counting)
    monkeypatch.setattr(first_call_timing, "confirm_faster", counting)
    return calls


@pytest.mark.slow
def test_one_comparison_against_jax_jit_decides_a_first_call(monkeypatch):
    """The end-to-end choice only screens; the timing against jax.jit of the function is the
    first call's one comparison, and the report gives its verdict."""
    calls = _count_confirmations(monkeypatch)
    fn, weights, inputs = jax_models.make_nasrnn(hidden=64, steps=2)
    opt = taso_jax.optimize(fn, weight_argnums=0, cost_model="analytic", budget=20)
    _assert_close(opt(weights, *inputs), jax.jit(fn)(weights, *inputs))
    e, report = opt._last.result.end_to_end, opt._last.report
    assert e["confirmed_by"] == "caller" and e["paired"] is None and e["duel"] is None
    if opt.optimized_graph.key == opt.graph.key:  # nothing picked: nothing compiled or timed
        assert calls == [] and "baseline" not in report and "check" not in report
        assert opt.original_kept == "the search changed nothing"
    else:
        assert len(calls) == 1 and report["check"]["ok"]
        paired = report["baseline"]["paired"]
        assert (opt.original_kept is None) == paired["faster"]
        if opt.original_kept:  # the reason quotes that comparison's rounds
            assert f"won {paired['wins']} of {paired['rounds']} rounds" in opt.original_kept


def test_a_rewrite_is_timed_once_against_jax_jit(monkeypatch):
    # one candidate: no screening; its one comparison decides, its verdict is the report's
    calls = _count_confirmations(monkeypatch)

    @taso_jax.optimize(weight_argnums=0, **{**OPTS, "end_to_end": 2})
    def cell(w, x):
        return x @ w["a"] + x @ w["b"]  # x@a + x@b => x@(a+b), folded

    w = {"a": jnp.ones((64, 64)), "b": jnp.ones((64, 64))}
    np.testing.assert_allclose(cell(w, jnp.ones((8, 64))), 128.0, rtol=1e-6)
    assert len(calls) == 1
    baseline = cell._last.report["baseline"]
    assert baseline["repeats"] == baseline["paired"]["rounds"] >= 10
    assert (cell.original_kept is None) == baseline["paired"]["faster"]



@pytest.mark.parametrize("work", ["layout", "arithmetic"])
def test_an_unchanged_function_with_weight_work_is_timed_only_where_folding_could_pay(
        monkeypatch, work):
    """A graph the search leaves unchanged is compiled, checked and timed against jax.jit
    only where the weight-only work its staged form folds once could reach MIN_SPEEDUP:
    weights read transposed and reshaped cost nothing under jax.jit either; a weight
    normalized on every call (a sum and a division over the whole weight) may."""
    calls = _count_confirmations(monkeypatch)

    @taso_jax.optimize(weight_argnums=0, **{**OPTS, "end_to_end": 2})
    def f(w, x):
        if work == "layout":
            return (jnp.tanh(x @ w.T) @ w) * w.reshape(-1)[:64]
        return jnp.tanh(x @ (w / jnp.sqrt(jnp.sum(w * w, axis=0)))) @ w[:64]

    w = jnp.asarray(np.random.default_rng(0).standard_normal((256, 64)), jnp.float32)
    x = jnp.ones((4, 64 if work == "layout" else 256))
    _assert_close(f(w, x), jax.jit(f.__wrapped__)(w, x))
    changed = f.optimized_graph.key != f.graph.key
    if work == "layout" and not changed:
        assert f.original_kept == "the search changed nothing" and calls == []
    if work == "arithmetic":
        assert len(calls) == 1 and "baseline" in f._last.report

def test_an_unchanged_function_is_not_compiled_checked_or_timed(monkeypatch):
    calls = _count_confirmations(monkeypatch)

    @taso_jax.optimize(**{**OPTS, "end_to_end": 2})
    def f(x, y):
        return jnp.tanh(x) * y

    np.testing.assert_allclose(f(jnp.ones(3), jnp.ones(3)), np.tanh(1.0), rtol=1e-6)
    assert f.original_kept == "the search changed nothing" and calls == []
    assert "check" not in f._last.report and "baseline" not in f._last.report
    assert f._last.run._cache_size() == 0  # the optimized stages were never compiled


def test_a_rewrite_from_constants_computed_once_names_them_as_its_source():
    """Issue 59 (b): "result: rewritten" beside "substitutions applied: none (the input graph
    is returned unchanged)" read as a contradiction; the report must say what made it faster.
    """

    @taso_jax.optimize(weight_argnums=0, **OPTS)
    def masked(w, x):
        mask = jnp.tril(jnp.ones((8, 8), jnp.float32))  # a constant: rebuilt by every call
        bias = jnp.where(mask > 0, 0.0, -1e4).astype(jnp.float32)
        return jnp.tanh(x @ w) + bias

    w, x = jnp.ones((8, 8)) / 8, jnp.ones((8, 8))
    _assert_close(masked(w, x), jax.jit(masked.fn)(w, x))
    outcome = masked.outcome()
    assert outcome.verdict == "rewritten"
    text = masked.report(time=False)
    assert "returned unchanged" not in text
    assert "what made it faster:" in text and "constants computed once" in text
    assert outcome.to_json()["folded"]["constants"]


def test_a_reserve_ends_the_search_before_the_callers_own_work():
    """run_search ends the search (and the choice) reserve() seconds before the deadline;
    a reserve past the deadline leaves no search at all."""
    from taso_jax.search.limits import Deadline, StopReason

    from taso_jax.optimizer import Optimizer

    fn, weights, inputs = jax_models.make_nasrnn(hidden=16, steps=2)
    graph = taso_jax.optimize(fn, weight_argnums=0, **OPTS)
    graph(weights, *inputs)
    g = graph.graph
    opt = Optimizer(**{**OPTS, "end_to_end": 2})
    free = opt.search(g, Deadline.start(30.0))
    cut = opt.search(g, Deadline.start(30.0), reserve=lambda: 1e6)
    assert free.stopped != StopReason.CHOICE_RESERVE and free.iterations > 0
    assert cut.iterations == 0 and cut.graph.key == g.key


def test_the_first_call_compiles_the_original_once_in_the_background(monkeypatch):
    """The original is compiled and called while the search runs; its outputs are the
    check's reference and its call time sizes the comparison (no timing call of its own)."""
    import taso_jax.first_call_timing as first_call_timing

    timed = []
    real = first_call_timing.time_function
    monkeypatch.setattr(first_call_timing, "time_function",
                        lambda *a, **k: timed.append(1) or real(*a, **k))

    @taso_jax.optimize(weight_argnums=0, **{**OPTS, "end_to_end": 2})
    def cell(w, x):
        return x @ w["a"] + x @ w["b"]

    w = {"a": jnp.ones((64, 64)), "b": jnp.ones((64, 64))}
    np.testing.assert_allclose(cell(w, jnp.ones((8, 64))), 128.0, rtol=1e-6)
    entry = cell._last
    assert entry.original_run is not None and entry.original_run.ok
    assert entry.original_run.call_seconds > 0 and entry.original_warm
    if "baseline" in entry.report:
        assert timed == [] and entry.report["check"]["ok"]


def test_a_comparison_that_cannot_fit_the_limit_keeps_the_original_untimed(monkeypatch):
    """Where the least comparison with jax.jit would run past the limit by more than its
    slack, the original runs and the verdict is the time limit's, not a measured one."""
    import taso_jax.first_call_timing as first_call_timing

    monkeypatch.setattr(first_call_timing, "LIMIT_SLACK", -1e6)  # nothing ever fits

    @taso_jax.optimize(weight_argnums=0, **{**OPTS, "end_to_end": 2})
    def cell(w, x):
        return x @ w["a"] + x @ w["b"]

    w = {"a": jnp.ones((64, 64)), "b": jnp.ones((64, 64))}
    np.testing.assert_allclose(cell(w, jnp.ones((8, 64))), 128.0, rtol=1e-6)
    if cell.optimized_graph.key != cell.graph.key:
        assert cell.original_kept.startswith("checked but not timed against jax.jit")
        assert cell._last.report["baseline"]["skipped"]
        assert cell.outcome().verdict.value == "time_limit"


def test_an_original_timed_slowly_beside_the_search_is_timed_again_alone(monkeypatch):
    """jax.jit's original is first called beside the search and the compiles, sharing the
    cores; where that one slow sample would leave the comparison untimed, the original is
    called once alone, and the comparison runs."""
    import taso_jax.first_call_budget as first_call_budget
    import taso_jax.first_call_timing as first_call_timing

    real = first_call_budget.OriginalRun._run

    def shared(self, jitted, args):
        real(self, jitted, args)
        if self.call_seconds is not None:
            self.call_seconds = 1.0  # as if it had shared the cores

    monkeypatch.setattr(first_call_budget.OriginalRun, "_run", shared)
    # about 10 s past the limit may be spent: 16 calls of 1 s do not fit, of 1 ms do
    monkeypatch.setattr(first_call_timing, "LIMIT_SLACK", -0.8)

    @taso_jax.optimize(weight_argnums=0, **{**OPTS, "end_to_end": 2})
    def cell(w, x):
        return x @ w["a"] + x @ w["b"]

    w = {"a": jnp.ones((64, 64)), "b": jnp.ones((64, 64))}
    np.testing.assert_allclose(cell(w, jnp.ones((8, 64))), 128.0, rtol=1e-6)
    assert cell._last.original_run.call_seconds == 1.0
    if cell.optimized_graph.key != cell.graph.key:
        assert not (cell.original_kept or "").startswith("checked but not timed")
        assert not cell._last.report["baseline"].get("skipped")


def test_a_first_call_whose_comparison_cannot_fit_the_limit_says_so(monkeypatch):
    """Where compiling, checking and comparing once needs more than the whole limit, the
    search gets no time and the reason names that need, not a search that overran."""
    import taso_jax.first_call_budget as first_call_budget

    real = first_call_budget.OriginalRun._run

    def slow(self, jitted, args):
        real(self, jitted, args)
        if self.call_seconds is not None:
            self.call_seconds = 10.0  # each call of the original: 16 of them need 160 s

    monkeypatch.setattr(first_call_budget, "COMPILE_GUESS_S", 1e4)
    monkeypatch.setattr(first_call_budget.OriginalRun, "_run", slow)

    @taso_jax.optimize(weight_argnums=0, **{**OPTS, "end_to_end": 2, "time_limit": 5.0})
    def cell(w, x):
        return x @ w["a"] + x @ w["b"]

    w = {"a": jnp.ones((64, 64)), "b": jnp.ones((64, 64))}
    np.testing.assert_allclose(cell(w, jnp.ones((8, 64))), 128.0, rtol=1e-6)
    assert cell._last.reserved_s > 5.0
    assert "more than the time limit (5 s) holds" in cell.original_kept
    assert cell.outcome().verdict.value == "time_limit"


def test_a_guess_that_leaves_the_search_nothing_waits_for_the_original_s_timing(monkeypatch):
    """A guessed need past the whole limit (a cost model that overprices the original's
    call) is not taken on trust: the search waits for the original's own timing, and a
    fast original leaves it its time."""
    import taso_jax.first_call_budget as first_call_budget

    monkeypatch.setattr(first_call_budget, "COMPILE_GUESS_S", 1e4)

    @taso_jax.optimize(weight_argnums=0, **{**OPTS, "end_to_end": 2, "time_limit": 30.0})
    def cell(w, x):
        return x @ w["a"] + x @ w["b"]

    w = {"a": jnp.ones((64, 64)), "b": jnp.ones((64, 64))}
    np.testing.assert_allclose(cell(w, jnp.ones((8, 64))), 128.0, rtol=1e-6)
    assert cell._last.original_run.ok
    assert cell._last.reserved_s < 30.0
    assert not (cell.original_kept or "").startswith("not compiled, checked or timed")


def test_the_first_calls_reference_outputs_are_not_kept():
    """The background run's outputs serve the output check only: the signature's entry,
    kept for every later call, does not hold them."""

    @taso_jax.optimize(weight_argnums=0, **{**OPTS, "end_to_end": 2})
    def cell(w, x):
        return x @ w["a"] + x @ w["b"]

    w = {"a": jnp.ones((64, 64)), "b": jnp.ones((64, 64))}
    cell(w, jnp.ones((8, 64)))
    run = cell._last.original_run
    assert run is not None and run.outputs is None


def test_the_decorator_s_outcome_is_made_by_the_delivery_pipeline(monkeypatch, tmp_path):
    """Issue 59: the decorator's first call runs ``pipeline.deliver`` like the other front
    doors; its outcome, rewritten or fallen back, is the pipeline's, and its text and JSON
    reports tell the same story."""
    import taso_jax.first_call_check as first_call_check
    import taso_jax.pipeline as pipeline

    monkeypatch.setenv("TASO_JAX_GRAPH_CACHE", str(tmp_path))
    made, real_make = [], pipeline.make_outcome
    monkeypatch.setattr(pipeline, "make_outcome",
                        lambda *a, **k: made.append(real_make(*a, **k)) or made[-1])

    def cell(w, x):
        return x @ w["a"] + x @ w["b"]

    w = {"a": jnp.ones((16, 16)) / 16, "b": jnp.ones((16, 16)) / 8}
    x = jnp.ones((4, 16))
    merged = taso_jax.optimize(cell, weight_argnums=0, **OPTS)
    _assert_close(merged(w, x), jax.jit(cell)(w, x))
    assert len(made) == 1 and merged._last.outcome is made[0]
    outcome = merged.outcome()
    assert outcome.verdict == made[0].verdict == "rewritten" and outcome.result is not None
    data, text = outcome.to_json(), merged.report(time=False)
    assert data["outcome"]["delivered"] == "optimized" and data["phases"]["search_s"] >= 0
    assert text.split(": ", 1)[1].startswith("result: rewritten")
    assert all(name in text for name in data["applied"])

    real = first_call_check.compare_outputs
    monkeypatch.setattr(first_call_check, "compare_outputs",
                        lambda *a, **k: {**real(*a, **k), "ok": False, "max_abs_err": 1.0})
    wrong = taso_jax.optimize(lambda w, x: cell(w, x) * 2, weight_argnums=0,
                              **{**OPTS, "budget": 21})  # not the first's graph cache entry
    with pytest.warns(RuntimeWarning, match="falling back.*differ from the original"):
        wrong(w, x)
    assert len(made) == 2 and wrong._last.outcome is made[1]
    outcome = wrong.outcome()
    data, text = outcome.to_json(), wrong.report(time=False)
    assert outcome.verdict == "fallback" and data["outcome"]["why"] == wrong.fallback_reason
    assert data["outcome"]["delivered"] == "input" and wrong.fallback_reason in text
    assert data["check"]["ok"] is False and data["kept_input_because"] == outcome.why
