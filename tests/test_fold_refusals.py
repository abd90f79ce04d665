"""A weight folded ahead of time that overflows or underflows refuses that rewrite only.

Issue 60, items 1 and 8: ``abs(x) @ W1 + abs(x) @ W2`` with ``W`` near the type's largest
value factors into ``abs(x) @ (W1 + W2)``, whose sum is inf; ``(abs(x) @ A) @ B`` with tiny
diagonal ``A``, ``B`` reorders into ``abs(x) @ (A @ B)``, whose product flushes to 0. The
search refuses those rewrites (:mod:`taso_jax.search.fold_refusals`) and keeps the others:
the verdict is ``rewritten`` where another rewrite pays, else ``unchanged``, never
``fallback``, and the report names the rewrite refused, through the Python API, the
command line and the decorator.
"""

from __future__ import annotations

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import taso_jax
from taso_jax.ir.fold_check import fold_overflow
from taso_jax.optimizer import Optimizer

DTYPES = ("float32", "float16", "bfloat16")
#: Weights whose sum overflows the type.
BIG = {"float32": 3e38, "float16": 40000.0, "bfloat16": 3e38}
#: A normal number whose square is 0 in the type.
SMALL = {"float32": 1e-25, "float16": 1e-4, "bfloat16": 1e-25}
FACTOR, REORDER = "factor-matmul-matmul-ewadd", "reorder-matmul-matmul"
UNDERFLOW = "0"  # taso_jax.ir.fold_check.UNDERFLOW, spelled out so the file imports anywhere


@pytest.fixture(scope="module")
def optimizer():
    return Optimizer(end_to_end=0, time_limit=10, budget=10, cost_model="analytic")


def _arr(values, dtype):
    return np.asarray(values, np.float32).astype(jnp.dtype(dtype))


def _two_sums(dtype):
    """Two factorable sums: one of weights whose sum overflows, one of ordinary weights."""
    rng = np.random.default_rng(0)
    b = taso_jax.new_graph()
    x = b.new_input((8, 16), dtype=dtype, name="x")
    y = b.new_input((8, 16), dtype=dtype, name="y")
    w1, w2 = (b.new_weight(data=_arr(np.full((16, 16), BIG[dtype]), dtype), name=f"w{i}")
              for i in (1, 2))
    v1, v2 = (b.new_weight(data=_arr(rng.standard_normal((16, 16)), dtype), name=f"v{i}")
              for i in (1, 2))
    a, r = b.abs(x), b.relu(y)
    b.mark_output(b.ewadd(b.matmul(a, w1), b.matmul(a, w2)))
    b.mark_output(b.ewadd(b.matmul(r, v1), b.matmul(r, v2)))
    return b.graph()


def _tiny_chain(dtype):
    """``(abs(x) @ A) @ B`` with ``A = B = c * I``: ``A @ B`` is 0 in the type."""
    b = taso_jax.new_graph()
    x = b.new_input((8, 16), dtype=dtype, name="x")
    eye = _arr(np.eye(16) * SMALL[dtype], dtype)
    a = b.new_weight(data=eye, name="a")
    w = b.new_weight(data=eye.copy(), name="b")
    b.mark_output(b.matmul(b.matmul(b.abs(x), a), w))
    return b.graph()


def _no_warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = fn()
    assert not [str(c.message) for c in caught if issubclass(c.category, RuntimeWarning)]
    return got


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_good_rewrite_stays_when_an_overflowing_one_is_refused(dtype, optimizer):
    graph = _two_sums(dtype)
    outcome = _no_warnings(lambda: optimizer.run(graph))
    assert outcome.verdict == "rewritten", outcome.why
    assert fold_overflow(outcome.graph, graph) is None
    refusals = outcome.report["fold_refusals"]
    assert [list(r["rules"]) for r in refusals] == [[FACTOR]]
    assert refusals[0]["value"] == "inf" and refusals[0]["dtype"] == dtype
    assert f"rewrite refused: {FACTOR}: a pre-folded weight overflowed {dtype}" in \
        outcome.to_text()
    assert outcome.to_json()["outcome"]["verdict"] == "rewritten"
    x = jnp.asarray(np.random.default_rng(1).standard_normal((8, 16)) * 1e-6,
                    jnp.dtype(dtype))
    out = taso_jax.compile_graph(outcome.graph)(x, x)
    assert all(bool(jnp.isfinite(o).all()) for o in out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_underflowing_fold_is_refused(dtype, optimizer):
    """``A @ B`` flushes to 0 where ``(x @ A) @ B`` at large ``x`` does not."""
    graph = _tiny_chain(dtype)
    outcome = _no_warnings(lambda: optimizer.run(graph))
    assert outcome.verdict == "unchanged" and outcome.graph is graph
    assert "rewrite refused" in outcome.why and f"underflowed {dtype}" in outcome.why
    (refusal,) = outcome.report["fold_refusals"]
    assert refusal["value"] == UNDERFLOW and refusal["op"] == "matmul"
    assert any(r.startswith(REORDER) for r in refusal["rules"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_fold_check_faults_underflow_but_not_exact_zeros(dtype):
    """``c * c`` flushed to 0 is a fault; ``W - W``, ``W * 0`` and a zero sum are not."""
    c = SMALL[dtype]
    b = taso_jax.new_graph()
    x = b.new_input((4, 4), dtype=dtype, name="x")
    w = b.new_weight(data=_arr(np.full((4, 4), c), dtype), name="w")
    z = b.new_weight(data=_arr(np.zeros((4, 4)), dtype), name="z")
    n = b.new_weight(data=_arr(np.full((4, 4), -c), dtype), name="n")
    exact = b.ewadd(b.ewadd(b.ewsub(w, w), b.ewmul(w, z)), b.ewadd(w, n))
    b.mark_output(b.ewadd(x, exact))
    assert fold_overflow(b.graph()) is None
    b.mark_output(b.ewmul(x, b.ewmul(w, w)))
    fault = fold_overflow(b.graph())
    assert fault is not None and fault.value == UNDERFLOW and fault.op == "ewmul"
    assert f"underflowed {dtype}" in str(fault)
    # a scale folded into a kernel one of whose elements is far below the others: that
    # product flushes to 0 and changes no output by more than the type's rounding (what
    # flush_negligible_weights holds too), so it is no fault
    small = {"float32": 1e-40, "float16": 1e-6, "bfloat16": 1e-40}[dtype]
    scale = {"float32": 1e-7, "float16": 0.02, "bfloat16": 1e-7}[dtype]
    assert float(_arr(small, dtype) * _arr(scale, dtype)) == 0.0
    b = taso_jax.new_graph()
    x = b.new_input((4, 2), dtype=dtype, name="x")
    k = b.new_weight(data=_arr([[1.0, small]] * 4, dtype), name="k")
    s = b.new_weight(data=_arr(np.full((4, 2), scale), dtype), name="s")
    b.mark_output(b.ewmul(x, b.ewmul(k, s)))
    assert fold_overflow(b.graph()) is None


def _onnx_two_sums(dtype: str) -> bytes:
    """:func:`_two_sums` as an ONNX model, built with ``onnx.helper``."""
    from onnx import TensorProto, helper, numpy_helper

    elem = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}[dtype]
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.full((16, 16), BIG[dtype], dtype), n)
             for n in ("w1", "w2")]
    inits += [numpy_helper.from_array(rng.standard_normal((16, 16)).astype(dtype), n)
              for n in ("v1", "v2")]
    nodes = [helper.make_node("Abs", ["x"], ["a"]), helper.make_node("Relu", ["y"], ["r"]),
             helper.make_node("MatMul", ["a", "w1"], ["m1"]),
             helper.make_node("MatMul", ["a", "w2"], ["m2"]),
             helper.make_node("MatMul", ["r", "v1"], ["n1"]),
             helper.make_node("MatMul", ["r", "v2"], ["n2"]),
             helper.make_node("Add", ["m1", "m2"], ["out0"]),
             helper.make_node("Add", ["n1", "n2"], ["out1"])]
    io = [helper.make_tensor_value_info(n, elem, [8, 16]) for n in ("x", "y", "out0", "out1")]
    graph = helper.make_graph(nodes, "two_sums", io[:2], io[2:], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


@pytest.mark.parametrize("dtype", ("float32", "float16"))
def test_the_command_line_refuses_the_rewrite_not_the_run(dtype, tmp_path, capsys):
    from taso_jax.cli import main

    src, out, rep = tmp_path / "m.onnx", tmp_path / "m.opt.onnx", tmp_path / "r.json"
    src.write_bytes(_onnx_two_sums(dtype))
    code = main(["optimize", str(src), "-o", str(out), "--cost-model", "analytic",
                 "--end-to-end", "0", "--no-time", "--json", str(rep)])
    text = capsys.readouterr().out
    assert code == 0 and out.exists()
    report = json.loads(rep.read_text())
    assert report["outcome"]["verdict"] in ("rewritten", "unchanged")
    assert report["outcome"]["verdict"] != "fallback" and "failed" not in text
    assert [r["rules"] for r in report["fold_refusals"]] == [[FACTOR]]
    lines = [ln for ln in text.splitlines() if ln.startswith("rewrite refused:")]
    assert len(lines) == 1 and f"overflowed {dtype}" in lines[0], text


@pytest.mark.slow
def test_the_decorator_refuses_the_rewrite_without_falling_back(monkeypatch):
    monkeypatch.setenv("TASO_JAX_GRAPH_CACHE", "off")
    big = jnp.full((64, 64), 3e38, jnp.float32)
    rng = np.random.default_rng(0)
    ws = (big, big, *(jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)
                      for _ in range(2)))

    @taso_jax.optimize(weight_argnums=0, time_limit=20, end_to_end=0, cost_model="analytic")
    def f(w, x, y):
        a, r = jnp.abs(x), jax.nn.relu(y)
        return a @ w[0] + a @ w[1], r @ w[2] + r @ w[3]

    x = jax.random.normal(jax.random.PRNGKey(0), (32, 64))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f(ws, x, x)
    assert not any("falling back" in str(c.message) for c in caught), caught
    outcome = f.outcome()
    assert outcome.verdict != "fallback"
    assert any(FACTOR in r["rules"] for r in outcome.report["fold_refusals"])
    small = f(ws, x * 1e-6, x * 1e-6)
    ref = jax.jit(f.fn)(ws, x * 1e-6, x * 1e-6)
    for got, want in zip(small, ref, strict=True):
        assert np.isfinite(np.asarray(got)).all()
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)


def _copy_cases():
    from taso_jax.ops import OPS

    return [(name, i) for name, op in sorted(OPS.items())
            if getattr(op, "copies_values", False) for i in range(len(op.examples))]


def _example_inputs(in_types, rng):
    xs = []
    for t in in_types:
        if t.dtype == "bool":
            xs.append(rng.integers(0, 2, t.shape).astype(bool))
        elif "int" in t.dtype:
            xs.append(rng.integers(0, 2, t.shape).astype(t.dtype))
        else:  # distinct values, none of them a constant an operator could make
            xs.append((rng.random(t.shape) + 1.5).astype(t.dtype))
    return xs


def test_the_operators_that_copy_values_make_none():
    """Every output element of a ``copies_values`` operator (what the fold check skips)
    is an input element, or a constant of its attributes, on each of its examples."""
    from taso_jax.ops import OPS

    from taso_jax.ir.graph import leaf_node, make_node

    cases = _copy_cases()
    names = {name for name, _ in cases}
    assert {"concat", "merge_gconv", "transpose", "enlarge"} <= names
    assert not names & {"ewadd", "ewmul", "matmul", "conv2d", "cast"}
    for name, i in cases:
        op = OPS[name]
        in_types, attrs = op.examples[i]
        node = make_node(name, [leaf_node("input", f"a{k}", t).outputs[0]
                                for k, t in enumerate(in_types)], attrs)
        xs = _example_inputs(in_types, np.random.default_rng(i))
        out = op.ref(*xs, **dict(node.attrs))
        allowed = {float(v) for x in xs if np.issubdtype(x.dtype, np.floating)
                   for v in x.ravel()}
        allowed |= {0.0, float(dict(node.attrs).get("value", 0.0))}
        for o in out if isinstance(out, tuple | list) else (out,):
            o = np.asarray(o)
            if np.issubdtype(o.dtype, np.floating):
                assert {float(v) for v in o.ravel()} <= allowed, (name, i)


@pytest.mark.slow
def test_a_cached_rewrite_that_overflows_on_new_weights_is_refused(monkeypatch, tmp_path):
    """A graph cache entry found with ordinary weights, called in a later process (a new
    decorator) with weights whose sum overflows: refused, no fallback, entry dropped."""
    monkeypatch.setenv("TASO_JAX_GRAPH_CACHE", str(tmp_path))

    def fn(w, x):
        a = jnp.abs(x)
        return a @ w[0] + a @ w[1]

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
    ordinary = tuple(jnp.asarray(rng.standard_normal((64, 64)), jnp.float32) for _ in "ab")
    first = taso_jax.optimize(fn, weight_argnums=0, time_limit=20, end_to_end=0,
                              cost_model="analytic")
    first(ordinary, x)
    assert first.outcome().verdict == "rewritten" and list(tmp_path.iterdir())
    big = (jnp.full((64, 64), 3e38, jnp.float32),) * 2
    later = taso_jax.optimize(fn, weight_argnums=0, time_limit=20, end_to_end=0,
                              cost_model="analytic")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = later(big, x * 1e-6)
    assert not any("falling back" in str(c.message) for c in caught), caught
    outcome = later.outcome()
    assert outcome.verdict == "unchanged" and "rewrite refused" in outcome.why
    assert outcome.report["search"]["stopped"] == "graph cache"  # not searched again
    assert np.isfinite(np.asarray(got)).all()
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))  # float16 has no huge scale
def test_the_output_check_sees_an_underflowed_fold_at_the_huge_scale(dtype):
    """``A @ B`` flushed to 0 (``c = 1e-23``): at the huge input scale the original's
    outputs are normal numbers, the rewrite's 0."""
    from taso_jax.checks import check_graphs, compare_nonfinite, range_scales

    def chain(folded: bool):
        b = taso_jax.new_graph()
        x = b.new_input((8, 16), dtype=dtype, name="x")
        eye = _arr(np.eye(16) * 1e-23, dtype)
        a, w = b.new_weight(data=eye, name="a"), b.new_weight(data=eye.copy(), name="b")
        ax = b.abs(x)
        b.mark_output(b.matmul(ax, b.matmul(a, w)) if folded else b.matmul(b.matmul(ax, a), w))
        return b.graph()

    graph, rewritten = chain(False), chain(True)
    check = check_graphs(graph, rewritten)
    assert not check["ok"] and check["failed_scale"] == range_scales(graph)[1]
    assert "0 or subnormal where the original is normal" in check["nonfinite"]
    # a subnormal where the original is one too, or at the tiny scale, is no fault
    sub = np.array([1e-39, 1.0], np.float32)
    assert compare_nonfinite([sub], [sub * np.float32(2)], underflow=True)["ok"]
    assert compare_nonfinite([np.zeros(2, np.float32)], [np.ones(2, np.float32)])["ok"]


def test_a_lone_element_cancelling_to_0_at_the_huge_scale_is_no_flushed_fold():
    """One element of 10,000 at 0 where the original's is 1e-3 (a sum of huge terms
    cancelling, taken in another order) passes; a channel of them (1%) does not, and the
    note then names the scale and what differed instead of blaming a rewrite."""
    from taso_jax.checks import FLUSHED_SHARE, compare_nonfinite
    from taso_jax.cli_sizes import differ_note

    ref = np.ones((100, 100), np.float32)
    ref[3, 7] = 1e-3
    lone = ref.copy()
    lone[3, 7] = 0.0
    assert 1 <= FLUSHED_SHARE * ref.size < 100
    assert compare_nonfinite([lone], [ref], underflow=True)["ok"]
    channel = ref.copy()
    channel[5] = 0.0
    check = compare_nonfinite([channel], [ref], underflow=True)
    assert not check["ok"] and check["nonfinite"] == {
        "0 or subnormal where the original is normal": 100}
    note = differ_note({**check, "failed_scale": 4.3e9})
    assert "inputs x4.3e+09: 100 0 or subnormal" in note and "fault" not in note
    assert "fault in a rewrite" in differ_note({"ok": False, "max_abs_err": 0.5})


@pytest.mark.parametrize("dtype", ("float32", "float16"))
def test_candidates_holding_a_faulty_fold_are_dropped_after_the_search(dtype, optimizer):
    """What a second opinion found, outside the search's gate: dropped before the choice,
    the cheapest admissible graph standing in, the refusal named."""
    from taso_jax.search.fold_refusals import refuse_faulty_folds

    graph = _two_sums(dtype)
    result = optimizer.search(graph, fold_weights=lambda g: None)  # no gate
    assert fold_overflow(result.graph, graph) is not None
    refusals = refuse_faulty_folds(result, graph)
    assert [list(r.rules) for r in refusals] == [[FACTOR]] and refusals[0].graphs >= 1
    assert result.fold_refusals == refusals
    assert fold_overflow(result.graph, graph) is None
    assert all(fold_overflow(c.graph, graph) is None for c in result.candidates)
    assert result.candidates and result.cost_after == min(c.cost for c in result.candidates
                                                          if c.graph is result.graph)
