"""bfloat16 as JAX code writes it: the float types NumPy does not know, reductions that
accumulate in float32, scores taken in float32 by ``jax.nn.dot_product_attention``, flax and
equinox; each must import as the operators the rules rewrite, and the searched graph must
equal ``jax.jit`` of the function within bfloat16's rounding."""

import collections
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from taso_jax.ops import OPS, TensorType, is_float_dtype

import taso_jax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import transformer_models as tm  # noqa: E402


def test_is_float_dtype_counts_ml_dtypes():
    assert np.dtype("bfloat16").kind == "V"  # why NumPy's own test is not enough
    assert all(is_float_dtype(d) for d in ("bfloat16", "float16", "float32", "float8_e4m3fn"))
    assert not any(is_float_dtype(d) for d in ("int8", "bool", "uint16", "complex64"))


def test_bfloat16_attention_is_well_typed():
    t = TensorType((1, 2, 8, 8), "bfloat16")
    op = OPS["attention"]
    assert op.infer([t, t, t], {**op.attrs, "causal": True}) == [t]


def _ops(graph):
    return collections.Counter(n.op for n in graph.nodes)


@pytest.mark.parametrize("name", ["llama_block", "causal_attention_dpa", "nnx_attention",
                                  "eqx_attention"])
def test_imports_as_the_float32_form_does(name):
    """The softmax (its sum accumulated in float32 by jnp.sum), RMSNorm (jnp.mean likewise)
    and, where the scores are taken in float32, the product as a matmul of widened operands:
    the operators the float32 import gives, none opaque."""
    fn, w, ins = tm.MODELS[name](128, "bfloat16")
    got = _ops(taso_jax.from_jax(fn, w, *ins))
    fn, w, ins = tm.MODELS[name](128, "float32")
    want = _ops(taso_jax.from_jax(fn, w, *ins))
    for op in ("softmax", "rms_norm", "matmul", "causal_mask"):
        assert got[op] == want[op], op
    assert got["opaque"] <= want["opaque"]


@pytest.mark.parametrize("name,mixed", [("causal_attention_dpa", True), ("eqx_attention", False),
                                        ("causal_attention", False)])
def test_search_rewrites_bfloat16_attention(name, mixed):
    """The search introduces attention (scores in float32 where the code takes them so) and
    lowers it to query blocks on this CPU; the result equals jax.jit of the function within
    bfloat16's rounding (a few units of 2^-8 of the outputs' size)."""
    fn, w, ins = tm.MODELS[name](256, "bfloat16")
    g = taso_jax.from_jax(fn, w, *ins)
    result = taso_jax.search_graph(g, cost_model="analytic", end_to_end=0, time_limit=60)
    (att,) = [n for n in result.graph.nodes if n.op == "attention"]
    assert att.attr("impl") == "blocked" and att.attr("causal")
    assert (att.inputs[0].dtype == "float32") is mixed and att.inputs[2].dtype == "bfloat16"
    compiled = taso_jax.compile_graph(result.graph)
    leaves = jax.tree_util.tree_leaves((w, *ins))
    out = compiled(*(ins if len(compiled.graph.inputs) == len(ins) else leaves))[0]
    want = np.asarray(jax.jit(fn)(w, *ins), np.float32)
    err = np.max(np.abs(np.asarray(out, np.float32) - want))
    assert err <= 8 * 2.0 ** -8 * np.max(np.abs(want))


def test_causal_mask_over_4096_positions_is_recognized():
    """Its positions (an iota of 4096 x 4096) fold at import, so the mask is a causal_mask
    and no runtime comparison of positions is left."""
    fn, w, ins = tm.MODELS["causal_attention"](4096, "bfloat16", heads=1, head_dim=8)
    ops = _ops(taso_jax.from_jax(fn, w, *ins))
    assert ops["causal_mask"] == 1 and ops["where"] == 0 and ops["opaque"] == 0


def test_widen_refuses_every_narrowing():
    """``widen`` is a cast that changes no value, so laws may pass through it: its shape rule
    takes only conversions into a type that holds every value of the source."""
    op = OPS["widen"]
    for src, dst in [("bfloat16", "float32"), ("float16", "float32"), ("float32", "float64"),
                     ("bfloat16", "bfloat16")]:
        assert op.infer([TensorType((2,), src)], {"to": dst}) == [TensorType((2,), dst)]
    for src, dst in [("float32", "bfloat16"), ("bfloat16", "float16"), ("float16", "bfloat16"),
                     ("float64", "float32"), ("int32", "float64"), ("float32", "int32")]:
        with pytest.raises(taso_jax.ShapeError):
            op.infer([TensorType((2,), src)], {"to": dst})


def test_jaxpr_widening_converts_import_as_widen():
    def fn(x):
        return (x.astype("float32") * 2).astype("bfloat16")

    g = taso_jax.from_jax(fn, jax.numpy.ones((4,), "bfloat16"))
    assert _ops(g)["widen"] == 1 and _ops(g)["cast"] == 1
