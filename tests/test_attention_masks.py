"""Attention under a constant mask: block plans read from the constant, the blocked lowering
of ``block_masked_attention``, the import that reads masks by blocks, and the search and the
decorator choosing the lowering (ops/attention_masks.py)."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import search_jax
from taso_jax.ops import OPS, ShapeError
from taso_jax.ops.attention_masks import (
    PLAN_GRAIN,
    block_plan,
    effective_mask,
    parse_plan,
    plan_spans,
)

import taso_jax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import transformer_models  # noqa: E402

_I, _J = np.arange(8)[:, None], np.arange(8)[None, :]
_DOCS = np.asarray([0, 0, 0, 1, 1, 2, 2, 2])
#: Boolean masks over 8 x 8 scores, and their plans in cells of 2 (worked by hand).
KINDS = {
    "causal": (_J <= _I, "2:PSSS/FPSS/FFPS/FFFP"),
    "sliding_window": ((_J <= _I) & (_J > _I - 3), "2:PSSS/PPSS/SPPS/SSPP"),
    "prefix_lm": ((_J <= _I) | (_J < 3), "2:FPSS/FPSS/FFPS/FFFP"),
    "packed_documents": ((_DOCS[:, None] == _DOCS[None, :]) & (_J <= _I),
                         "2:PSSS/PPSS/SPPS/SSPP"),
}


def _additive(keep, fill=-np.inf):
    return np.where(keep, 0.0, fill).astype(np.float32)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("fill", [-np.inf, float(np.finfo(np.float32).min), -1e9])
def test_plan_of_each_mask_kind(kind, fill):
    """Each cell is skipped where every entry is a fill, full where every entry is 0; the
    plan covers the scores and agrees with the constant in every entry."""
    keep, want = KINDS[kind]
    mask = _additive(keep, fill)
    plan = block_plan(mask, grain=2)
    assert plan == want
    grain, codes = parse_plan(plan, 8, 8)
    cells = np.repeat(np.repeat(codes, grain, 0), grain, 1)
    assert (mask[cells == "S"] <= -1e9).all() and (mask[cells == "F"] == 0).all()
    assert block_plan(np.broadcast_to(mask, (2, 3, 8, 8)), grain=2) == want


def test_a_flipped_entry_in_a_skipped_cell_is_not_skipped():
    """One entry of a skipped cell kept: the cell is read, not skipped. A plan that trusted
    the mask's pattern (a sliding window) would skip it."""
    keep, _ = KINDS["sliding_window"]
    keep = keep.copy()
    keep[7, 0] = True
    codes = parse_plan(block_plan(_additive(keep), grain=2), 8, 8)[1]
    assert codes[3, 0] == "P" and (codes[3, 1:] == ["S", "P", "P"]).all()
    assert plan_spans(block_plan(_additive(keep), grain=2), 8, 8, 2)[3][2] == 0


def test_plans_refused_where_nothing_is_gained_or_a_row_keeps_nothing():
    assert block_plan(np.zeros((8, 8)), grain=2) is None  # no cell skipped
    keep = KINDS["causal"][0].copy()
    keep[5] = False  # a fully masked row: its softmax is not the kept keys'
    assert block_plan(_additive(keep), grain=2) is None
    assert block_plan(_additive(KINDS["causal"][0], -100.0), grain=2) is None  # fill too big
    with pytest.raises(ShapeError):
        parse_plan("2:PS/SS", 4, 4)  # a row of cells that skips every key
    with pytest.raises(ShapeError):
        parse_plan("2:PS/FP", 6, 4)  # does not cover the scores


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("block", [2, 4, 8])
def test_blocked_lowering_equals_the_definition_for_any_mask(kind, block):
    """Both lowerings compute softmax(q @ kt + effective mask) @ v, the mask random in the
    cells the plan reads, imposed (-inf, 0) in those it skips or leaves unmasked."""
    plan = block_plan(_additive(KINDS[kind][0]), grain=2)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 3, 8, 4)).astype(np.float32)
    kt = rng.standard_normal((2, 3, 4, 8)).astype(np.float32)
    v = rng.standard_normal((2, 3, 8, 5)).astype(np.float32)
    m = rng.standard_normal((1, 1, 8, 8)).astype(np.float32)
    grain, codes = parse_plan(plan, 8, 8)
    cells = np.repeat(np.repeat(codes, grain, 0), grain, 1)
    eff = np.where(cells == "S", -np.inf, np.where(cells == "F", 0.0, m))
    want = jax.nn.softmax(q @ kt + eff, axis=-1) @ v
    np.testing.assert_array_equal(np.asarray(effective_mask(m, plan, 8, 8)), eff)
    ref = OPS["block_masked_attention"].ref
    for impl in ("naive", "blocked"):
        got = ref(q, kt, v, m, plan=plan, impl=impl, block=block)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def _mask_fn(keep, fill, additive):
    def fn(q, k, v):
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * np.float32(0.25)
        if additive:
            s = s + jnp.where(jnp.asarray(keep), 0.0, fill).astype(s.dtype)
        else:
            s = jnp.where(jnp.asarray(keep), s, fill)
        return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)

    return fn


@pytest.mark.parametrize("additive,fill", [(True, -np.inf), (True, -1e9),
                                           (False, float(np.finfo(np.float32).min))])
def test_flipped_entry_read_end_to_end(additive, fill):
    """A sliding window with one entry of a skipped cell kept (the last query sees the first
    key) imports with that cell read, lowers to query blocks, and computes the function: the
    output of the last query differs from the unflipped window's."""
    n = 2 * PLAN_GRAIN + PLAN_GRAIN // 2
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    keep = (j <= i) & (j > i - PLAN_GRAIN // 2)
    flipped = keep.copy()
    flipped[-1, 0] = True
    args = [jax.random.normal(jax.random.key(s), (1, 2, n, 16)) for s in range(3)]
    g, out, run = search_jax(_mask_fn(flipped, fill, additive), args)
    plans = [dict(x.attrs)["plan"] for x in g.nodes if x.op == "block_mask"]
    assert len(plans) == 1 and parse_plan(plans[0], n, n)[1][-1, 0] == "P"
    atts = [x for x in out.nodes if x.op == "block_masked_attention"]
    assert len(atts) == 1 and dict(atts[0].attrs)["impl"] == "blocked"
    want = jax.jit(_mask_fn(flipped, fill, additive))(*args)
    np.testing.assert_allclose(np.asarray(run(*args)), np.asarray(want), rtol=1e-5, atol=1e-6)
    unflipped = jax.jit(_mask_fn(keep, fill, additive))(*args)
    assert not np.allclose(np.asarray(unflipped)[..., -1, :], np.asarray(want)[..., -1, :])


_WORKLOADS = {"sliding_window_attention": {"window": 64}, "prefix_lm_attention": {"prefix": 64},
              "packed_documents_attention": {}}


@pytest.mark.parametrize("name", sorted(_WORKLOADS))
def test_workloads_lowered_and_equal_at_two_scales(name):
    """Each masked workload (S=256) is lowered to query blocks by the search and equals
    ``jax.jit`` of the original at the inputs and with the queries x10."""
    fn, w, inputs = transformer_models.MODELS[name](seq=4 * PLAN_GRAIN, heads=2, head_dim=16,
                                                    **_WORKLOADS[name])

    def f(*a):
        return fn(w, *a)

    _, out, run = search_jax(f, inputs)
    atts = [x for x in out.nodes if x.op == "block_masked_attention"]
    assert len(atts) == 1 and dict(atts[0].attrs)["impl"] == "blocked"
    assert "S" in dict(atts[0].attrs)["plan"]
    for scale in (1.0, 10.0):
        args = [inputs[0] * scale, *inputs[1:]]
        np.testing.assert_allclose(np.asarray(run(*args)), np.asarray(jax.jit(f)(*args)),
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(_WORKLOADS))
def test_decorator_delivers_block_masked_attention(name):
    """Under the decorator's defaults (measured cost, end-to-end check) each masked workload
    at S=1024 runs as block_masked_attention, equal to ``jax.jit`` at the inputs and with the
    queries x10."""
    sizes = {"sliding_window_attention": {"window": 256},
             "prefix_lm_attention": {"prefix": 256}}.get(name, {})
    fn, w, inputs = transformer_models.MODELS[name](seq=1024, heads=4, head_dim=32, **sizes)
    opt = taso_jax.optimize(fn, weight_argnums=0)
    for scale in (1.0, 10.0):
        args = [inputs[0] * scale, *inputs[1:]]
        np.testing.assert_allclose(np.asarray(opt(w, *args)), np.asarray(jax.jit(fn)(w, *args)),
                                   rtol=1e-4, atol=1e-5)
    assert "block_masked_attention" in str(opt.outcome().to_json().get("applied", {}))
