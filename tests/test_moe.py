"""The dense mixture-of-experts layer (``ops/experts.py``): the import that recognizes it,
its guarded gathered lowering, the lowering law and its rule, and the search and decorator
on the top-2-of-8 workload of ``examples/transformer_models.py``."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import search_jax
from taso_jax.ops import OPS, ShapeError, TensorType
from taso_jax.ops.experts import capacity, dense_experts
from taso_jax.search.rules import default_substitutions
from taso_jax.verify.from_laws import derived_rules
from taso_jax.verify.prover import Prover

import taso_jax
from taso_jax.ir.graph import composition_nodes, leaf_node, make_node

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import transformer_models  # noqa: E402

SIZES = {"seq": 64, "dim": 16, "hidden": 24}
RULE = "lower-gated_experts-capacity-4.0"


def _ref(*args, **attrs):
    return OPS["gated_experts"].ref(*args, **{**OPS["gated_experts"].attrs, **attrs})


def _ops(g):
    return [n.op for n in g.nodes]


def _gates(t, e, per_token, seed):
    """Gates ``[t, e]``: ``per_token`` experts of random weight per token, zeros elsewhere."""
    rng = np.random.default_rng(seed)
    g = np.zeros((t, e), np.float32)
    for row in g:
        row[rng.choice(e, per_token, replace=False)] = rng.uniform(0.1, 1.0, per_token)
    return jnp.asarray(g)


def _layer(t=64, e=8, d=16, h=24, per_token=2, seed=0):
    rng = np.random.default_rng(seed + 1)
    return (_gates(t, e, per_token, seed), jnp.asarray(rng.standard_normal((t, d)), jnp.float32),
            jnp.asarray(rng.standard_normal((e, d, h)) * d ** -0.5, jnp.float32),
            jnp.asarray(rng.standard_normal((e, h, d)) * h ** -0.5, jnp.float32))


@pytest.mark.parametrize("routing", ["uniform", "skewed"])
def test_import_recognizes_the_dense_layer(routing):
    """The registry workload imports with its experts and gating as one ``gated_experts``
    node in its dense lowering, on the flattened tokens and the two expert weights; the
    router (matmul, ``top_k``, softmax, ``one_hot``) stays as written."""
    fn, w, inputs = transformer_models.MODELS["moe_top2"](routing=routing, **SIZES)
    g = taso_jax.from_jax(fn, w, *inputs, weight_argnums=0)
    nodes = [n for n in g.nodes if n.op == "gated_experts"]
    assert len(nodes) == 1 and nodes[0].attr("impl") == "dense"
    assert nodes[0].attr("activation") == "relu"
    _, x, w1, w2 = nodes[0].inputs
    assert x.shape == (SIZES["seq"], SIZES["dim"]) and w1.node.op == w2.node.op == "weight"
    assert "softmax" in _ops(g) and "relu" not in _ops(g)


def test_import_recognizes_silu_and_leaves_other_forms():
    """SiLU experts are recognized too; an expert sum whose experts differ from the dense
    formulation (a tanh between the matmuls) stays as the user's matmuls."""
    g, x, w1, w2 = _layer()

    def silu(g, x, w1, w2):
        y = jnp.einsum("teh,ehd->ted", jax.nn.silu(jnp.einsum("td,edh->teh", x, w1)), w2)
        return jnp.einsum("te,ted->td", g, y)

    def tanh(g, x, w1, w2):
        y = jnp.einsum("teh,ehd->ted", jnp.tanh(jnp.einsum("td,edh->teh", x, w1)), w2)
        return jnp.einsum("te,ted->td", g, y)

    found = [n for n in taso_jax.from_jax(silu, g, x, w1, w2).nodes if n.op == "gated_experts"]
    assert len(found) == 1 and found[0].attr("activation") == "silu"
    assert "gated_experts" not in _ops(taso_jax.from_jax(tanh, g, x, w1, w2))


def test_import_recognizes_scattered_gates_and_batches():
    """Gates written by a scatter (``zeros.at[rows, chosen].set(weights)``) and a batch of 2
    flattened to tokens import as ``gated_experts`` too: the gates may be anything."""
    fn, w, (x,) = transformer_models.MODELS["moe_top2"](batch=2, **SIZES)

    def scattered(w, x):
        tokens = x.reshape(-1, x.shape[-1])
        top, chosen = jax.lax.top_k(tokens @ w["router"], 2)
        rows = jnp.arange(tokens.shape[0])[:, None]
        gates = jnp.zeros((tokens.shape[0], 8), x.dtype).at[rows, chosen].set(
            jax.nn.softmax(top, axis=-1))
        h = jax.nn.relu(jnp.einsum("td,edh->teh", tokens, w["w1"]))
        y = jnp.einsum("teh,ehd->ted", h, w["w2"])
        return jnp.einsum("te,ted->td", gates, y).reshape(x.shape)

    for f in (fn, scattered):
        g = taso_jax.from_jax(f, w, x, weight_argnums=0)
        nodes = [n for n in g.nodes if n.op == "gated_experts"]
        assert len(nodes) == 1 and nodes[0].inputs[1].shape == (2 * SIZES["seq"], SIZES["dim"])
    np.testing.assert_allclose(np.asarray(jax.jit(scattered)(w, x)),
                               np.asarray(jax.jit(fn)(w, x)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scale", [1.0, 1e3])
@pytest.mark.parametrize("per_token", [1, 2, 8])
def test_lowering_law_numerically(per_token, scale):
    """``impl="capacity"`` equals the dense form for gates of 1, 2 (both fit 4T/E slots) and 8
    experts per token (none fits: the guard takes the dense form), at two input scales."""
    g, x, w1, w2 = _layer(per_token=per_token, seed=per_token)
    want = np.asarray(jax.jit(lambda *a: _ref(*a))(g, x * scale, w1, w2))
    got = np.asarray(jax.jit(lambda *a: _ref(*a, impl="capacity"))(g, x * scale, w1, w2))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * scale)


def test_guard_takes_each_branch():
    """Where every expert has at most ``C`` tokens the gathered form runs: an expert that no
    token uses may hold ``inf`` weights without reaching the output (the dense form adds
    ``0 * inf = NaN``, the module's precondition). One token over ``C`` and the guard runs
    the dense form, NaN included."""
    g, x, w1, w2 = _layer(per_token=1, seed=3)
    g = g.at[:, 7].set(0.0)  # expert 7 unused
    w1 = w1.at[7].set(jnp.inf)
    run = jax.jit(lambda *a: _ref(*a, impl="capacity"))
    assert np.isfinite(np.asarray(run(g, x, w1, w2))).all()
    assert np.isnan(np.asarray(jax.jit(lambda *a: _ref(*a))(g, x, w1, w2))).any()
    c = capacity(64, 8, 4.0)
    crowded = g.at[: c + 1].set(jnp.zeros(8).at[0].set(1.0))  # c + 1 tokens on expert 0
    assert np.isnan(np.asarray(run(crowded, x, w1, w2))).any()


def test_shape_rule_and_pricing_forms():
    """The shape rule refuses mismatched experts; the dense node's composition and the
    gathered node's pricing steps build at the workload's shapes ([E, C, d] for C = T/2)."""
    types = [TensorType((256, 8), "float32"), TensorType((256, 512), "float32"),
             TensorType((8, 512, 1024), "float32"), TensorType((8, 1024, 512), "float32")]
    with pytest.raises(ShapeError):
        OPS["gated_experts"].infer([*types[:3], types[2]], dict(OPS["gated_experts"].attrs))
    leaves = [leaf_node("input", f"i{k}", t).outputs[0]
              for k, t in enumerate(types)]
    dense = make_node("gated_experts", leaves, {})
    gathered = make_node("gated_experts", leaves, {"impl": "capacity"})
    assert composition_nodes(dense)[-1].types[0].shape == (256, 512)
    priced = composition_nodes(gathered, priced=True)
    assert [n.types[0].shape for n in priced if n.op == "matmul"] == [(8, 128, 1024),
                                                                     (8, 128, 512)]
    assert composition_nodes(gathered) is None  # the measured model times the kernel itself


def test_rule_shipped_and_proved():
    """The lowering rule read off the law is in the shipped set, stamped proved, and proves
    again here."""
    rule = next(r for r in derived_rules() if r.name == RULE)
    shipped = {s.id: s for s in default_substitutions()}
    assert shipped[rule.id].proof_status == "proved"
    assert Prover().prove(rule)["status"] == "proved"


@pytest.mark.parametrize("routing", ["uniform", "skewed"])
def test_search_lowers_and_stays_equal(routing):
    """The search (analytic cost: half the expert rows) lowers the workload to the guarded
    gathered form, which equals ``jax.jit`` of the original at the inputs and x1000; under
    skewed routing (every token on experts 0 and 1) that is the guard's dense fallback."""
    fn, w, inputs = transformer_models.MODELS["moe_top2"](routing=routing, **SIZES)

    def f(x):
        return fn(w, x)

    _, out, run = search_jax(f, inputs)
    nodes = [n for n in out.nodes if n.op == "gated_experts"]
    assert len(nodes) == 1 and nodes[0].attr("impl") == "capacity"
    for scale in (1.0, 1e3):
        x = inputs[0] * scale
        np.testing.assert_allclose(np.asarray(run(x)), np.asarray(jax.jit(f)(x)),
                                   rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.slow
def test_decorator_rewrites_uniform_and_stays_exact_on_skewed_calls():
    """Under the decorator's defaults, the search lowers the workload at T=256 (small
    widths) to the gathered form (delivered where it times faster than ``jax.jit``, as it
    did at 2.8 s here); called again with skewed router weights the delivered function
    still equals ``jax.jit`` of the original."""
    fn, w, inputs = transformer_models.MODELS["moe_top2"](seq=256, dim=64, hidden=128)
    _, ws, skewed = transformer_models.MODELS["moe_top2_skewed"](seq=256, dim=64, hidden=128)
    opt = taso_jax.optimize(fn, weight_argnums=0)
    for weights, args in ((w, inputs), (ws, skewed)):
        np.testing.assert_allclose(np.asarray(opt(weights, *args)),
                                   np.asarray(jax.jit(fn)(weights, *args)),
                                   rtol=1e-5, atol=1e-6)
    report = opt.outcome().to_json()
    found = {**report.get("applied", {}),
             **report.get("found_not_delivered", {}).get("applied", {})}
    assert found.get(RULE) == 1, report["outcome"]  # delivered where it timed faster


def test_dense_reference_is_the_einsum_formulation():
    """``dense_experts`` is the Mixtral-style einsum chain, checked against NumPy."""
    g, x, w1, w2 = (np.asarray(a, np.float64) for a in _layer(t=8, e=4, d=5, h=3))
    y = np.stack([np.maximum(x @ w1[e], 0) @ w2[e] for e in range(4)], axis=1)
    want = (g[:, :, None] * y).sum(axis=1)
    np.testing.assert_allclose(np.asarray(dense_experts(*(jnp.asarray(a, jnp.float32) for a in
                                                          (g, x, w1, w2)))), want, rtol=1e-5,
                               atol=1e-6)
