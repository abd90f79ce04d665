"""The cuDNN lowering of attention: its reference equals the definition on any machine, its
rules are proved, and the search offers it only where cuDNN runs (a CUDA GPU, bf16/fp16,
a head dimension it takes); the GPU figures are in docs/benchmarks.md."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from taso_jax.ops import OPS, TensorType
from taso_jax.ops import cudnn_attention as cudnn
from taso_jax.search.match import find_matches, instantiate, prepare
from taso_jax.search.rules import default_substitutions

import taso_jax
from taso_jax.ir.graph import Graph, leaf_node, make_node

RULES = {s.name: s for s in default_substitutions() if "cudnn" in s.name}


def _naive(q, kt, v, causal):
    s = q @ kt
    if causal:
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    return jax.nn.softmax(s, axis=-1) @ v


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("reps", [1, 2])
def test_reference_equals_the_definition(causal, reps):
    """Off a GPU the lowering's reference runs XLA's dot_product_attention through the same
    layout moves (heads to axis 2, keys untransposed, scale 1): it must equal the naive
    composition, K/V heads shared by groups of query heads."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4, 12, 8))
    kt = rng.standard_normal((2, 4 // reps, 8, 12))
    v = rng.standard_normal((2, 4 // reps, 12, 8))
    attrs = {"causal": causal, "offset": 0, "fill": float("-inf"), "block": 128}
    with jax.enable_x64(True):
        if reps == 1:
            got = OPS["attention"].ref(q, kt, v, **attrs, impl="cudnn")
            want = _naive(q, kt, v, causal)
        else:
            got = OPS["grouped_attention"].ref(q, kt, v, reps=reps, **attrs, impl="cudnn")
            want = _naive(q, jnp.repeat(kt, reps, axis=1), jnp.repeat(v, reps, axis=1), causal)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12, atol=1e-12)


def test_rules_are_shipped_and_proved():
    assert set(RULES) == {"lower-attention-cudnn", "lower-attention-cudnn-2",
                          "lower-grouped_attention-cudnn", "lower-grouped_attention-cudnn-2"}
    assert all(r.proof_status == "proved" for r in RULES.values())


def test_shape_rule_refuses_what_the_flag_cannot_mask():
    """The causal flag masks a square score matrix at offset 0; values need the queries'
    head dimension; a fill that gives masked keys weight is not skipped."""
    def leaves(sq, sk, dv=8):
        return [leaf_node("input", n, TensorType(s, "bfloat16")).outputs[0] for n, s in
                (("q", (1, 2, sq, 8)), ("kt", (1, 2, 8, sk)), ("v", (1, 2, sk, dv)))]

    make_node("attention", leaves(16, 16), {"causal": True, "impl": "cudnn"})
    make_node("attention", leaves(16, 24), {"impl": "cudnn"})  # not causal: any key length
    for ins, attrs, why in [
            (leaves(16, 24), {"causal": True}, "square"),
            (leaves(16, 16), {"causal": True, "offset": 1}, "square"),
            (leaves(16, 16, dv=16), {}, "head dimension"),
            (leaves(16, 16), {"causal": True, "fill": -100.0}, "fill")]:
        with pytest.raises(taso_jax.ShapeError, match=why):
            make_node("attention", ins, {**attrs, "impl": "cudnn"})


def _causal_graph(dtype, d=64, s=128):
    q, kt, v = (leaf_node("input", n, TensorType(shape, dtype)).outputs[0] for n, shape in
                (("q", (1, 4, s, d)), ("kt", (1, 4, d, s)), ("v", (1, 4, s, d))))
    out = make_node("attention", [q, kt, v], {"causal": True}).outputs[0]
    return Graph((q.node, kt.node, v.node), (out,), ("y",))


def _offered(graph, rule: str = "lower-attention-cudnn-2") -> bool:
    """Whether ``rule`` rewrites ``graph``'s attention here (the search matches, then
    prepares the rewrite: the target's node is built there)."""
    sub = next(s for s in default_substitutions() if s.name == rule)
    return any(prepare(sub, graph, m) for m in find_matches(sub, graph))


def test_not_offered_off_a_cuda_gpu():
    """On this CPU the rule's target cannot run: no match, whatever the dtype."""
    assert cudnn.cudnn_unavailable(*(TensorType((1, 1, 8, 8), "bfloat16"),) * 3)
    assert not _offered(_causal_graph("bfloat16"))
    assert not _offered(_causal_graph("float32"))


@pytest.mark.parametrize("dtype,d,cc,offered", [
    ("bfloat16", 64, 9.0, True), ("float16", 128, 8.0, True),
    ("float32", 64, 9.0, False),                          # cuDNN takes 16-bit floats only
    ("bfloat16", 12, 9.0, False),                         # not a multiple of 8
    ("bfloat16", 256, 8.0, False), ("bfloat16", 256, 9.0, True),  # 256 on Hopper only
])
def test_offered_where_cudnn_runs(monkeypatch, dtype, d, cc, offered):
    """With JAX's device taken for a CUDA GPU of compute capability ``cc``, the rule
    matches exactly where cuDNN's fused attention takes the operands."""
    monkeypatch.setattr(cudnn, "_device", lambda: ("cuda", cc))
    assert _offered(_causal_graph(dtype, d=d)) is offered


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_query_blocks_not_offered_where_cudnn_runs(monkeypatch, dtype):
    """Where cuDNN's form of the node runs, the query-blocked one is not built (slower on
    an H200, and seconds of compiles to time); in float32 it is."""
    monkeypatch.setattr(cudnn, "_device", lambda: ("cuda", 9.0))
    g = _causal_graph(dtype, s=256)
    assert _offered(g, "lower-attention-blocked-128") is (dtype == "float32")
    monkeypatch.setattr(cudnn, "_device", lambda: ("cpu", 0.0))
    assert _offered(g, "lower-attention-blocked-128")


def test_instantiate_names_the_device(monkeypatch):
    """The reason a form cannot run here reaches the caller of ``instantiate``."""
    rule = RULES["lower-attention-cudnn-2"]
    g = _causal_graph("bfloat16")
    monkeypatch.setattr(cudnn, "_device", lambda: ("cuda", 9.0))
    (m,) = list(find_matches(rule, g))
    monkeypatch.setattr(cudnn, "_device", lambda: ("cpu", 0.0))
    with pytest.raises(taso_jax.ShapeError, match="CUDA GPU"):
        instantiate(rule.target, m.vars, m.sym)


def test_priced_as_the_tiles_it_computes():
    """Causal: the tiles of 128 on and below the diagonal (9/16 of them at S=512)."""
    types = [TensorType((1, 4, 512, 64), "bfloat16"), TensorType((1, 4, 64, 512), "bfloat16"),
             TensorType((1, 4, 512, 64), "bfloat16")]
    op = OPS["attention"]
    out = op.infer(types, {**op.attrs})
    full = op.cost_flops(types, out, {**op.attrs, "causal": True})
    fused = op.cost_flops(types, out, {**op.attrs, "causal": True, "impl": "cudnn"})
    assert fused == pytest.approx(full * 10 / 16)
    assert cudnn.causal_fraction(512, 512) == pytest.approx(10 / 16)
