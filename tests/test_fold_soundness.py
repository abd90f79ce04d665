"""Floating-point soundness of pre-folded weights (issue 60, item 1).

A proved rule is not a proved float program: ``abs(x) @ W1 + abs(x) @ W2`` factored into
``abs(x) @ (W1 + W2)`` pre-folds a sum that overflows where the original, at small
inputs, is finite. Each kind of fold is built with weights that overflow in float32,
float16 and bfloat16; the search must refuse the rewrite
(:func:`taso_jax.ir.fold_check.fold_overflow`, :mod:`taso_jax.search.fold_refusals`), and
the output check must see the difference at a tiny input scale
(:func:`taso_jax.checks.range_scales`).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import taso_jax
from taso_jax.checks import check_graphs, compare_nonfinite, compare_outputs, range_scales
from taso_jax.ir.executor import compile_graph
from taso_jax.ir.fold_check import fold_overflow
from taso_jax.optimizer import Optimizer

DTYPES = ("float32", "float16", "bfloat16")
#: Weights whose sum (or square, times 16) overflows the type, whose products with tiny
#: inputs do not.
SUM_BIG = {"float32": 3e38, "float16": 40000.0, "bfloat16": 3e38}
PRODUCT_BIG = {"float32": 1e20, "float16": 100.0, "bfloat16": 1e20}
#: A kernel and a scale whose elementwise product overflows the type.
SCALE_BIG = {"float32": 1e20, "float16": 300.0, "bfloat16": 1e20}
#: A rank-4 update ``A @ B`` that overflows the type.
LORA_BIG = {"float32": 1e20, "float16": 150.0, "bfloat16": 1e20}


def _full(shape, value, dtype):
    return np.full(shape, value, np.float32).astype(jnp.dtype(dtype))


def _matmul_sum(dtype):
    """``abs(x) @ W1 + abs(x) @ W2``: factored into ``abs(x) @ (W1 + W2)`` (a sum)."""
    b = taso_jax.new_graph()
    x = b.new_input((8, 16), dtype=dtype, name="x")
    w1 = b.new_weight(data=_full((16, 16), SUM_BIG[dtype], dtype), name="w1")
    w2 = b.new_weight(data=_full((16, 16), SUM_BIG[dtype], dtype), name="w2")
    a = b.abs(x)
    b.mark_output(b.ewadd(b.matmul(a, w1), b.matmul(a, w2)))
    return b.graph()


def _conv_sum(dtype):
    """``conv(relu(x), W1) + conv(relu(x), W2)``: one convolution by ``W1 + W2``."""
    b = taso_jax.new_graph()
    x = b.new_input((1, 4, 8, 8), dtype=dtype, name="x")
    w1 = b.new_weight(data=_full((4, 4, 3, 3), SUM_BIG[dtype], dtype), name="w1")
    w2 = b.new_weight(data=_full((4, 4, 3, 3), SUM_BIG[dtype], dtype), name="w2")
    a = b.relu(x)
    b.mark_output(b.ewadd(b.conv2d(a, w1, strides=(1, 1), padding="same"),
                          b.conv2d(a, w2, strides=(1, 1), padding="same")))
    return b.graph()


def _conv_scale(dtype):
    """``conv(x, W) * s`` (a batchnorm's scale): folded into the kernel, ``W * s``."""
    b = taso_jax.new_graph()
    x = b.new_input((1, 4, 8, 8), dtype=dtype, name="x")
    w = b.new_weight(data=_full((4, 4, 3, 3), SCALE_BIG[dtype], dtype), name="w")
    s = b.new_weight(data=_full((1, 4, 1, 1), SCALE_BIG[dtype], dtype), name="s")
    b.mark_output(b.ewmul(b.conv2d(x, w, strides=(1, 1), padding="same"), s))
    return b.graph()


def _matmul_chain(dtype):
    """``(abs(x) @ A) @ B``: reordered into ``abs(x) @ (A @ B)`` (a product of weights)."""
    b = taso_jax.new_graph()
    x = b.new_input((8, 16), dtype=dtype, name="x")
    w1 = b.new_weight(data=_full((16, 16), PRODUCT_BIG[dtype], dtype), name="w1")
    w2 = b.new_weight(data=_full((16, 16), PRODUCT_BIG[dtype], dtype), name="w2")
    b.mark_output(b.matmul(b.matmul(b.abs(x), w1), w2))
    return b.graph()


def _lora(dtype):
    """``abs(x) @ W + (abs(x) @ A) @ B``: the low-rank update merged, ``W + A @ B``."""
    b = taso_jax.new_graph()
    x = b.new_input((8, 16), dtype=dtype, name="x")
    w = b.new_weight(data=_full((16, 16), LORA_BIG[dtype], dtype), name="w")
    la = b.new_weight(data=_full((16, 4), LORA_BIG[dtype], dtype), name="a")
    lb = b.new_weight(data=_full((4, 16), LORA_BIG[dtype], dtype), name="b")
    ax = b.abs(x)
    b.mark_output(b.ewadd(b.matmul(ax, w), b.matmul(b.matmul(ax, la), lb)))
    return b.graph()


def _merged(dtype):
    """``abs(x) @ W1`` and ``abs(x) @ W2``: one product by ``concat(W1, W2)``, then split."""
    b = taso_jax.new_graph()
    x = b.new_input((8, 16), dtype=dtype, name="x")
    w1 = b.new_weight(data=_full((16, 16), SUM_BIG[dtype], dtype), name="w1")
    w2 = b.new_weight(data=_full((16, 16), SUM_BIG[dtype], dtype), name="w2")
    ax = b.abs(x)
    b.mark_output(b.matmul(ax, w1))
    b.mark_output(b.matmul(ax, w2))
    return b.graph()


FOLDS = {"matmul_sum": _matmul_sum, "conv_sum": _conv_sum, "conv_scale": _conv_scale,
         "matmul_chain": _matmul_chain, "lora": _lora}
#: The rule each kind is rewritten by (that the test reaches the fold it means to).
RULES = {"matmul_sum": "factor-matmul-matmul-ewadd", "conv_sum": "factor-conv2d-conv2d-ewadd",
         "conv_scale": "expand-conv2d-ewmul", "matmul_chain": "reorder-matmul-matmul",
         "lora": "matmul-from-matmul-ewadd", "merged": "merge-matmul-matmul"}


@pytest.fixture(scope="module")
def optimizer():
    # priced analytically: which rewrites pay must not follow the calibration's curves
    return Optimizer(end_to_end=0, time_limit=10, budget=10, cost_model="analytic")


def _tiny_inputs(graph, scale=1e-6):
    x = np.random.default_rng(0).standard_normal(graph.inputs[0].types[0].shape) * scale
    return jnp.asarray(x, jnp.dtype(graph.inputs[0].types[0].dtype))


def _finite(graph, x) -> bool:
    return all(bool(jnp.isfinite(y).all()) for y in compile_graph(graph)(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", sorted(FOLDS))
def test_an_overflowing_fold_is_not_delivered(kind, dtype, optimizer):
    """The search finds the fold and refuses it, saying why; the graph delivered gives the
    original's finite outputs at small inputs."""
    graph = FOLDS[kind](dtype)
    unchecked = optimizer.search(graph, fold_weights=lambda g: None)
    assert any(r.startswith(RULES[kind]) for r in unchecked.applied), unchecked.applied
    overflow = fold_overflow(unchecked.graph, graph)
    assert overflow is not None and overflow.dtype == dtype and overflow.value == "inf"
    searched = optimizer.search(graph)
    assert fold_overflow(searched.graph, graph) is None
    assert any(r.startswith(RULES[kind]) for f in searched.fold_refusals for r in f.rules)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        outcome = optimizer.run(graph)
    assert outcome.verdict in ("unchanged", "rewritten")  # another candidate may win
    assert fold_overflow(outcome.graph, graph) is None
    if outcome.verdict == "unchanged":
        assert outcome.graph is graph
        assert "overflowed " + dtype in outcome.why and "rewrite refused" in outcome.why
    assert outcome.report["fold_refusals"][0]["op"] == overflow.op
    x = _tiny_inputs(graph)
    assert _finite(graph, x) and _finite(outcome.graph, x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_output_check_sees_an_overflowed_sum_at_tiny_inputs(dtype, optimizer):
    """At x1 and x100 both graphs give inf; at the tiny scale the original is finite."""
    graph = _matmul_sum(dtype)
    rewritten = optimizer.search(graph, fold_weights=lambda g: None).graph
    check = check_graphs(graph, rewritten)
    assert not check["ok"] and check["failed_scale"] in range_scales(graph)
    assert check["nonfinite"] == {"not finite where the original is finite": 8 * 16}


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_concatenation_of_large_weights_is_delivered(dtype, optimizer):
    """Concatenating never rounds: merged products of weights near the type's largest
    value are delivered, and pass the check at every scale."""
    graph = _merged(dtype)
    outcome = optimizer.run(graph)
    assert outcome.verdict == "rewritten", outcome.why
    assert "fold_refusals" not in outcome.report
    assert outcome.report["check"]["ok"] and outcome.report["check"]["range_scales"]


def test_a_weight_only_operator_of_the_original_is_not_faulted():
    """A mask of -inf the original builds from finite weights is its own, not the
    rewrite's; an operator reading a non-finite value is not faulted either."""
    b = taso_jax.new_graph()
    x = b.new_input((4, 4), name="x")
    w = b.new_weight(data=np.zeros((4, 4), np.float32), name="w")
    mask = b.log(w)  # -inf from finite weights
    b.mark_output(b.ewadd(x, b.transpose(mask, perm=(1, 0))))
    graph = b.graph()
    assert fold_overflow(graph) is not None  # with no original, everything is checked
    assert fold_overflow(graph, graph) is None
    b2 = taso_jax.new_graph()
    x = b2.new_input((4, 4), name="x")
    w = b2.new_weight(data=np.zeros((4, 4), np.float32), name="w")
    mask = b2.log(w)
    b2.mark_output(b2.ewadd(x, mask))
    original = b2.graph()
    assert fold_overflow(graph, original) is None  # the transpose reads -inf


@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
def test_a_cast_beyond_the_type_is_faulted(dtype):
    """A float32 weight cast ahead of time to a type it does not fit comes out inf."""
    b = taso_jax.new_graph()
    x = b.new_input((4, 4), dtype=dtype, name="x")
    w = b.new_weight(data=np.full((4, 4), 1e5 if dtype == "float16" else 3e38, np.float32),
                     name="w")
    big = b.scalar_mul(w, scalar=10.0) if dtype == "bfloat16" else w
    b.mark_output(b.ewadd(x, b.cast(big, to=dtype)))
    overflow = fold_overflow(b.graph())
    assert overflow is not None and overflow.value == "inf"


def test_compare_nonfinite():
    """Only where the original is finite must the rewrite be; inf matches inf of its sign."""
    inf, nan = np.inf, np.nan
    ref = np.array([1.0, inf, -inf, inf, nan], np.float32)
    assert compare_nonfinite([np.array([2.0, inf, -inf, 5.0, inf], np.float32)], [ref])["ok"]
    for bad, what in ((np.array([inf, inf, -inf, inf, 0.0]), "not finite where the original"
                       " is finite"),
                      (np.array([1.0, nan, -inf, inf, 0.0]), "NaN where the original is inf"),
                      (np.array([1.0, -inf, -inf, inf, 0.0]), "inf of the other sign")):
        r = compare_nonfinite([bad.astype(np.float32)], [ref])
        assert not r["ok"] and r["nonfinite"] == {what: 1} and r["max_abs_err"] == np.inf


def test_bfloat16_outputs_are_compared_as_floats():
    """bfloat16 is no ``np.inexact``: its outputs were compared as integers (inf included)."""
    bf = jnp.bfloat16
    ref = np.array([1.0, 2.0], bf)
    assert compare_outputs([np.array([1.0, 2.001], bf)], [ref])["ok"]
    assert not compare_outputs([np.array([1.0, np.inf], bf)], [ref])["ok"]


def test_range_scales_follow_the_narrowest_input_type():
    for dtype, tiny in (("float32", 1.1e-19), ("bfloat16", 1.1e-19), ("float16", 7.8e-3)):
        scales = range_scales(_matmul_sum(dtype))
        assert scales[0] == pytest.approx(tiny, rel=0.01)
        assert len(scales) == (1 if dtype == "float16" else 2)


def test_the_decorator_refuses_an_overflowing_fold(monkeypatch, tmp_path):
    """Issue 60's decorator case: 'rewritten', then inf on a later call with small inputs;
    now the rewrite is refused, with no warning of a fallback."""
    monkeypatch.setenv("TASO_JAX_GRAPH_CACHE", "off")
    w = (jnp.full((64, 64), 3e38, jnp.float32), jnp.full((64, 64), 3e38, jnp.float32))

    @taso_jax.optimize(weight_argnums=0, time_limit=20, end_to_end=0)
    def f(ws, x):
        a = jnp.abs(x)
        return a @ ws[0] + a @ ws[1]

    x = jax.random.normal(jax.random.PRNGKey(0), (32, 64))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f(w, x)
    assert not any("falling back" in str(c.message) for c in caught), caught
    assert f.outcome().verdict != "fallback"
    small = np.asarray(f(w, x * 1e-6))
    assert np.isfinite(small).all()
    np.testing.assert_allclose(small, np.asarray(jax.jit(f.fn)(w, x * 1e-6)), rtol=1e-6)


def test_the_command_line_refuses_an_overflowing_fold(tmp_path, capsys):
    """The ONNX front door runs the same pipeline: the faulty fold is refused, the report
    says why, and the concatenation of the same weights (which never rounds) is kept."""
    from taso_jax.cli import main

    src, out = tmp_path / "m.onnx", tmp_path / "m.opt.onnx"
    src.write_bytes(taso_jax.export_onnx(_matmul_sum("float32")).SerializeToString())
    code = main(["optimize", str(src), "-o", str(out), "--cost-model", "analytic",
                 "--end-to-end", "0", "--no-time", "-q"])
    text = capsys.readouterr()
    assert code == 0 and out.exists()
    assert "fallback" not in text.out and "rewrite refused" in text.out, text
    assert "overflowed float32" in text.out, text
