"""The transformer registry (examples/transformer_models.py) at tiny sizes, and its benchmark
runner (benchmarks/transformer_suite.py) end to end on one tiny model."""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import transformer_models  # noqa: E402

SEQ = 8


def _runner():
    """benchmarks/transformer_suite.py as a module, without putting benchmarks/ on the path."""
    spec = importlib.util.spec_from_file_location("transformer_suite",
                                                  ROOT / "benchmarks" / "transformer_suite.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: Models checked against themselves run op by op (the decode step is checked against the
#: prefill instead, below: stronger, and one compile where running it op by op took 4 s).
EAGER_CHECKED = sorted(set(transformer_models.MODELS) - {"llama_decode"})


@functools.cache
def _built(name: str):
    """The model at its tiny size, and its outputs under ``jax.jit``."""
    try:
        fn, weights, inputs = transformer_models.MODELS[name](
            seq=SEQ, **transformer_models.TINY[name])
    except transformer_models.Unavailable as e:
        pytest.skip(str(e))
    return fn, weights, inputs, jax.tree_util.tree_leaves(jax.jit(fn)(weights, *inputs))


@pytest.mark.parametrize("name", EAGER_CHECKED)
def test_model_runs_and_jax_jit_of_it_agrees(name):
    fn, weights, inputs, got = _built(name)
    want = jax.tree_util.tree_leaves(fn(weights, *inputs))
    assert len(got) == len(want) >= 1
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype == np.float32
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_the_decode_step_is_the_prefills_last_row():
    """Decoding the last token against the K/V cache of the ones before it gives the
    prefill's last output row, and writes that token's K/V into the cache's last slot."""
    prefill, weights, (x,), (y_all,) = _built("llama_block")
    decode, *_ = _built("llama_decode")
    tiny = transformer_models.TINY["llama_decode"]
    _, k, v = jax.jit(transformer_models._llama_attention_in, static_argnums=(3, 4))(
        weights, x, jnp.arange(SEQ), tiny["heads"], tiny["kv_heads"])
    stale = jnp.full_like(k[:, -1:], 7.0)  # the last slot before the step: overwritten
    k_cache = jnp.concatenate([k[:, :-1], stale], axis=1)
    v_cache = jnp.concatenate([v[:, :-1], stale], axis=1)
    y, k2, v2 = jax.jit(decode)(weights, x[:, -1:], k_cache, v_cache, jnp.int32(SEQ - 1))
    np.testing.assert_allclose(np.asarray(y[:, 0]), np.asarray(y_all[:, -1]), rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(k2), np.asarray(k), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(v2), np.asarray(v), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["llama_decode", "nnx_attention"])
def test_dtype_reaches_weights_and_float_inputs(name):
    _, weights, inputs = transformer_models.MODELS[name](
        seq=SEQ, dtype="bfloat16", **transformer_models.TINY[name])
    leaves = jax.tree_util.tree_leaves((weights, inputs))
    assert {x.dtype for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)} == {
        np.dtype("bfloat16")}
    assert all(x.dtype != np.float32 for x in leaves)


def test_a_model_past_its_positions_is_unavailable():
    pytest.importorskip("transformers")
    with pytest.raises(transformer_models.Unavailable, match="position embeddings"):
        transformer_models.make_hf_bert(seq=128, **transformer_models.TINY["hf_bert"])


@pytest.mark.slow
def test_runner_end_to_end_on_a_tiny_model(tmp_path, monkeypatch, capsys):
    from taso_jax.frontends.graph_cache import GRAPH_CACHE_ENV

    monkeypatch.setenv(GRAPH_CACHE_ENV, str(tmp_path / "graphs"))
    out = tmp_path / "rows.json"
    assert _runner().main(["causal_attention", "--tiny", "--seq", str(SEQ), "--rounds", "3",
                           "--cost-model", "analytic", "--budget", "5", "--time-limit", "5",
                           "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert f"| causal_attention | {SEQ} | float32 | " in table
    (row,) = json.loads(out.read_text())["rows"]
    assert row["rounds"] == 3 and row["jit_us"] > 0 and row["optimized_us"] > 0
    assert row["speedup"] > 0 and row["first_call_s"] > 0
    assert row["verdict"] in {"rewritten", "unchanged", "time_limit"}
    assert row["max_abs_diff"] <= 1e-5
    # the second input scale: outputs of both at float inputs x10, against jax.jit's peak
    assert row["max_abs_x10"] > 0 and row["max_abs_diff_x10"] <= 1e-5 * row["max_abs_x10"]
