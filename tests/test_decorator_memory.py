"""A signature dropped from ``@taso_jax.optimize``'s cache is released, with what it held.

Weak references to each dropped signature's record, its graphs, its compiled stages and its
folded weights must die once the record leaves the cache (``gc.collect()`` run). The memory
this frees is measured by ``benchmarks/decorator_memory.py``, not here.
"""

from __future__ import annotations

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import taso_jax

OPTS = {"cost_model": "analytic", "budget": 20, "time_limit": 60.0, "end_to_end": 0}


def _held(entry) -> dict:
    """Weak references to what a signature's record holds, by name."""
    refs = {"entry": weakref.ref(entry)}
    if entry.result is not None:
        refs["optimized graph"] = weakref.ref(entry.result.graph)
        refs["search result"] = weakref.ref(entry.result)
    if entry.graph is not None:
        refs["imported graph"] = weakref.ref(entry.graph)
    for name in ("staged", "run", "fold"):
        value = getattr(entry, name)
        if value is not None:
            try:
                refs[name] = weakref.ref(value)
            except TypeError:
                pass
    for k, v in enumerate(entry.folded_for[1] if entry.folded_for else ()):
        try:
            refs[f"folded weight {k}"] = weakref.ref(v)
        except TypeError:
            pass
    return refs


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "background"])
def test_dropped_signatures_release_their_graphs_stages_and_folded_weights(monkeypatch,
                                                                           mode):
    import taso_jax.decorator as decorator

    monkeypatch.setattr(decorator, "SIGNATURE_CACHE", 2)
    rng = np.random.default_rng(0)
    w1, w2 = (jnp.asarray(rng.standard_normal((8, 8), np.float32)) for _ in range(2))

    @taso_jax.optimize(weight_argnums=(1, 2), mode=mode, **OPTS)
    def mlp(x, w1, w2):
        return jax.nn.relu(x @ w1 + x @ w2)

    held = []
    for n in range(1, 6):
        x = jnp.ones((n, 8))
        for _ in range(3 if mode == "background" else 1):
            out = mlp(x, w1, w2)
            if mode == "background":
                mlp.wait()
        np.testing.assert_allclose(out, jax.nn.relu(x @ w1 + x @ w2), rtol=1e-5, atol=1e-5)
        held.append(_held(mlp._last))
    assert mlp._last.result is not None and mlp._last.folded_for  # optimized, folded
    gc.collect()
    # the compiled weight stage is one for every batch size (the same weights fold alike):
    # the kept signatures hold it, so it is the one thing of the dropped ones still alive
    shared = held[-1]["fold"]()
    assert all(refs["fold"]() is shared for refs in held)
    alive = [(n + 1, name) for n, refs in enumerate(held[:-2])
             for name, r in refs.items() if r() is not None and name != "fold"]
    assert alive == [], alive
    # the two kept signatures still hold theirs
    assert all(r() is not None for r in held[-1].values())
    # and once no signature holds the weight stage, it goes too (in background mode the
    # worker thread, idle, must not hold the last signature it built)
    mlp._cache.clear()
    mlp._last = mlp._fast = mlp._opt_fast = None
    del shared, out
    gc.collect()
    assert held[-1]["fold"]() is None


def _live_modules(name: str) -> int:
    """How many compiled executables alive in this process are named for function ``name``.

    ``jax.jit`` names a module ``jit_`` and the function's qualified name, ``.<locals>.``
    written ``._locals_.``.
    """
    gc.collect()
    return sum(e.hlo_modules()[0].name.endswith("." + name)
               for e in jax.devices()[0].client.live_executables())


def test_the_original_compiled_for_the_first_call_goes_once_the_signature_is_decided():
    # The output check and the timing compile jax.jit of the original for each signature.
    # A signature that runs optimized never calls it again, so it must not stay compiled
    # as long as the decorated function (issue 60: 40 shapes grew RSS by 1.9x jax.jit's own
    # growth, one original executable per signature beside the optimized stages). One
    # that runs the original keeps it compiled once, as jax.jit would.
    rng = np.random.default_rng(1)
    w1, w2 = (jnp.asarray(rng.standard_normal((8, 8), np.float32)) for _ in range(2))

    @taso_jax.optimize(weight_argnums=(1, 2), **{**OPTS, "end_to_end": 1})
    def mlp_checked_once(x, w1, w2):
        return jax.nn.relu(x @ w1 + x @ w2)

    kept = 0
    for n in range(1, 4):
        x = jnp.ones((n, 8))
        out = mlp_checked_once(x, w1, w2)
        np.testing.assert_allclose(out, jax.nn.relu(x @ w1 + x @ w2), rtol=1e-5, atol=1e-5)
        assert mlp_checked_once._last.fallback is None
        kept += mlp_checked_once._last.original_kept is not None
    assert mlp_checked_once._last.original_warm  # the first call did compile the original
    live = _live_modules("mlp_checked_once")
    assert live <= kept, (live, kept)
    # measure() compiles it again, held by the last signature's entry
    mlp_checked_once.measure(repeats=3)
    assert _live_modules("mlp_checked_once") == live + 1
