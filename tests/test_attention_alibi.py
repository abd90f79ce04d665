"""ALiBi causal attention (issue 61): a constant per-head bias ``[1, H, Sq, Sk]`` read by
blocks, its fully masked key blocks skipped (ops/attention_masks.py)."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import search_jax
from taso_jax.ops import OPS, TensorType
from taso_jax.ops.attention_masks import PLAN_GRAIN, block_plan, parse_plan
from taso_jax.search.calibrated import CalibratedCostModel
from taso_jax.search.cost import AnalyticCostModel

import taso_jax
from taso_jax.ir.graph import composition_nodes, leaf_node, make_node

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import transformer_models  # noqa: E402

HEADS, HEAD_DIM = 4, 16
SEQ = 4 * PLAN_GRAIN


def _alibi(slopes, n):
    """ALiBi's bias ``[1, H, n, n]`` (NumPy): ``-m_h (i - j)`` for ``j <= i``, else ``-inf``."""
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    slopes = np.asarray(slopes, np.float32)[:, None, None]
    return np.where(j <= i, -slopes * (i - j), -np.inf)[None].astype(np.float32)


def _model(seq=SEQ):
    fn, w, inputs = transformer_models.MODELS["alibi_attention"](seq=seq, heads=HEADS,
                                                                 head_dim=HEAD_DIM)
    return (lambda *a: fn(w, *a)), inputs


def _plan_and_mask(g):
    masks = [n for n in g.nodes if n.op == "block_mask"]
    assert len(masks) == 1
    return dict(masks[0].attrs)["plan"], masks[0].inputs[1]


def test_import_reads_the_per_head_bias_by_blocks():
    """The import turns the bias into one ``block_mask`` on the per-head constant
    ``[1, H, S, S]``, its plan causal: key cells above the diagonal skipped, the rest read
    (ALiBi's biases are not 0 there, so no cell is ``F``)."""
    f, inputs = _model()
    g = taso_jax.from_jax(f, *inputs)
    plan, m = _plan_and_mask(g)
    assert m.shape == (1, HEADS, SEQ, SEQ)
    grain, codes = parse_plan(plan, SEQ, SEQ)
    cells = SEQ // grain
    upper = np.triu(np.ones((cells, cells), bool), 1)
    assert (codes[upper] == "S").all() and (codes[~upper] == "P").all()
    assert not any(n.op == "ewadd" and not n.weight_only for n in g.nodes)


def _with_bias(bias):
    def fn(q, k, v):
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5 + jnp.asarray(bias)
        return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)

    return fn


def test_a_cell_is_skipped_only_where_every_head_skips_it():
    """One head whose first queries see the last keys makes that cell read; one head whose
    rows keep no entry ``>= 0`` leaves the bias an add (the import's precondition)."""
    n = 3 * PLAN_GRAIN
    _, inputs = _model(seq=n)
    bias = _alibi([0.5, 0.25, 0.125, 0.0625], n)
    plan, m = _plan_and_mask(taso_jax.from_jax(_with_bias(bias), *inputs))
    assert m.shape == bias.shape and plan == f"{PLAN_GRAIN}:PSS/PPS/PPP"
    seen = bias.copy()
    seen[0, 2, :4, -1] = -1.0
    plan, _ = _plan_and_mask(taso_jax.from_jax(_with_bias(seen), *inputs))
    assert plan == f"{PLAN_GRAIN}:PSP/PPS/PPP"
    shifted = bias.copy()
    shifted[0, 1] -= 1.0
    g = taso_jax.from_jax(_with_bias(shifted), *inputs)
    assert not any(x.op == "block_mask" for x in g.nodes)


@pytest.mark.parametrize("block", [PLAN_GRAIN, 2 * PLAN_GRAIN])
def test_blocked_lowering_equals_the_definition_with_the_imported_mask(block):
    """With the plan the import read from ALiBi's bias and a per-head mask random in the
    read cells, ``block_masked_attention``'s lowerings compute its definition (the law the
    search's rules come from) at inputs N(0,1) and x10."""
    n = 2 * PLAN_GRAIN
    _, inputs = _model(seq=n)
    bias = _alibi([0.5, 0.25, 0.125, 0.0625], n)
    plan, _ = _plan_and_mask(taso_jax.from_jax(_with_bias(bias), *inputs))
    rng = np.random.default_rng(0)
    noise = np.where(np.isfinite(bias), rng.standard_normal(bias.shape), -np.inf)
    noise = noise.astype(np.float32)
    q, kt, v = (rng.standard_normal(s).astype(np.float32)
                for s in ((2, HEADS, n, 8), (2, HEADS, 8, n), (2, HEADS, n, 5)))
    ref = OPS["block_masked_attention"].ref
    for scale in (1.0, 10.0):
        want = jax.nn.softmax((q * scale) @ kt + noise, axis=-1) @ v
        for impl in ("naive", "blocked"):
            got = ref(q * scale, kt, v, noise, plan=plan, impl=impl, block=block)
            # float32 rounding grows with the scores' size: the two summation orders
            # differed by 5e-6 at x10 on an AMD EPYC (2026-11-30), 1e-6 on earlier CPUs
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5,
                                       atol=2e-6 * scale)


def test_search_lowers_alibi_to_query_blocks_equal_at_two_scales():
    """The search lowers ALiBi attention (S=256) to query blocks that skip the masked key
    blocks, and the graph equals ``jax.jit`` of the original at the inputs and with the
    queries x10."""
    f, inputs = _model()
    _, out, run = search_jax(f, inputs)
    atts = [n for n in out.nodes if n.op == "block_masked_attention"]
    assert len(atts) == 1 and dict(atts[0].attrs)["impl"] == "blocked"
    assert atts[0].inputs[3].shape == (1, HEADS, SEQ, SEQ)
    for scale in (1.0, 10.0):
        args = [inputs[0] * scale, *inputs[1:]]
        np.testing.assert_allclose(np.asarray(run(*args)), np.asarray(jax.jit(f)(*args)),
                                   rtol=1e-4, atol=1e-5)


def test_decorator_delivers_alibi_equal_to_jax_jit_at_two_scales():
    """``@taso_jax.optimize`` (analytic cost, no end-to-end timing, the output check on)
    delivers the blocked form, equal to ``jax.jit`` of the original at N(0,1) and x10."""
    fn, w, inputs = transformer_models.MODELS["alibi_attention"](seq=SEQ, heads=HEADS,
                                                                 head_dim=HEAD_DIM)
    opt = taso_jax.optimize(fn, weight_argnums=0, cost_model="analytic", end_to_end=0)
    for scale in (1.0, 10.0):
        args = [inputs[0] * scale, *inputs[1:]]
        np.testing.assert_allclose(np.asarray(opt(w, *args)),
                                   np.asarray(jax.jit(fn)(w, *args)), rtol=1e-4, atol=1e-5)
    graph = opt.optimized_graph
    assert graph is not None and opt.fallback_reason is None
    assert any(n.op == "block_masked_attention" and dict(n.attrs)["impl"] == "blocked"
               for n in graph.nodes)


def _alibi_fn(slopes_of):
    def fn(w, q, k, v):
        n = q.shape[2]
        i, j = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
        slopes = slopes_of(w)[:, None, None]
        bias = jnp.where(j <= i, -slopes * (i - j).astype(q.dtype), -jnp.inf)[None]
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5 + bias
        return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)

    return fn


def test_a_bias_read_at_run_time_is_not_taken_as_constant():
    """The same per-head bias is read by blocks when its slopes are literals, and left an
    add when they are an argument (a weight or an input), whose values a later call may
    change: the plan would be read from values the function does not hold."""
    slopes = np.asarray([0.5, 0.25, 0.125, 0.0625], np.float32)
    _, inputs = _model()
    literal = taso_jax.from_jax(_alibi_fn(lambda w: jnp.asarray(slopes)), {}, *inputs,
                                weight_argnums=0)
    assert [n.op for n in literal.nodes].count("block_mask") == 1
    runtime = _alibi_fn(lambda w: w["slopes"])
    w = {"slopes": jnp.asarray(slopes)}
    for g in (taso_jax.from_jax(runtime, w, *inputs, weight_argnums=0),
              taso_jax.from_jax(runtime, w, *inputs)):
        assert not any(n.op == "block_mask" for n in g.nodes)
        assert any(n.op == "ewadd" and n.inputs[0].shape == (1, HEADS, SEQ, SEQ)
                   for n in g.nodes)


def test_the_blocked_form_is_priced_by_the_scores_it_computes():
    """At S=1024, 12 heads, the calibrated model prices the blocked lowering under ALiBi's
    bias as the matmuls and softmax of its key spans (``OpDef.priced_as``): below the naive
    form (which computes every score), as in the analytic model, and the same under the
    per-head bias as under a mask shared by the heads. Priced as one kernel by the attention
    family's curve, it cost 6x the naive form under the per-head bias (its 48 MB counted as
    bytes moved) and 1.6x under a shared mask, where it ran 1.4-1.5x faster."""
    s, h = 1024, 12

    def t(name, shape):
        return leaf_node("input", name, TensorType(shape, "float32")).outputs[0]

    q, kt, v = t("q", (1, h, s, 64)), t("kt", (1, h, 64, s)), t("v", (1, h, s, 64))
    plan = block_plan(_alibi(2.0 ** (-8.0 * np.arange(1, h + 1) / h), s))
    for model in (CalibratedCostModel(cache_path=False), AnalyticCostModel()):
        price = {}
        for heads in (1, h):
            m = t("m", (1, heads, s, s))
            for impl in ("naive", "blocked"):
                node = make_node("block_masked_attention", [q, kt, v, m],
                                 {"plan": plan, "impl": impl, "block": 128})
                price[heads, impl] = model.node_cost(node)
        assert price[h, "blocked"] == pytest.approx(price[1, "blocked"], rel=1e-6)
        assert price[h, "blocked"] < 0.8 * price[h, "naive"]
    # the measured model times the blocked kernel itself, not its 8 spans' pieces
    assert composition_nodes(node) is None
    assert [p.op for p in composition_nodes(node, priced=True)].count("softmax") == 8


def test_a_mask_that_differs_over_the_batch_is_read_with_the_scores_leading_axes():
    """A constant mask ``[2, S, S]`` reshaped to ``[2, 1, S, S]`` (one per sequence of the
    batch) is read with its batch axis under scores ``[2, 1, S, S]``, and lowered; under
    scores ``[2, 2, S, S]`` (two heads) it stays an add, which no rule bringing
    ``block_mask`` into attention would take. Both compute the function at N(0,1) and
    x10."""
    n = 4 * PLAN_GRAIN
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    per_batch = np.stack([np.where(j <= i, 0.0, -np.inf),
                          np.where((j <= i) & (j > i - PLAN_GRAIN // 2), 0.0, -np.inf)])

    def f(q, k, v):
        mask = jnp.asarray(per_batch, q.dtype).reshape(2, 1, n, n)
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5 + mask
        return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)

    for heads in (1, 2):
        inputs = [jax.random.normal(jax.random.key(s), (2, heads, n, 16)) for s in range(3)]
        g, out, run = search_jax(f, inputs)
        if heads == 1:
            assert _plan_and_mask(g)[1].shape == (2, 1, n, n)
            assert any(x.op == "block_masked_attention" for x in out.nodes)
        else:
            assert not any(x.op == "block_mask" for x in g.nodes)
        for scale in (1.0, 10.0):
            args = [inputs[0] * scale, *inputs[1:]]
            np.testing.assert_allclose(np.asarray(run(*args)), np.asarray(jax.jit(f)(*args)),
                                       rtol=1e-4, atol=1e-5)
