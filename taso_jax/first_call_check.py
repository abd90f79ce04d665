"""The decorator's output check: the optimized stages against ``jax.jit`` of the original.

The first call (:mod:`taso_jax.first_call`) runs the staged graph on the call's values
(random ones for tracers) and compares its outputs with the original's
(:func:`~taso_jax.checks.compare_outputs`). Where they differ on a device whose default
precision rounds matrix products, the original's own rounding noise
(:func:`_rounding_noise`) widens the tolerance by :data:`NOISE_MARGIN`, and failing that
the stages run at full float32 precision if that matches. :func:`compare_with_original`
is that policy, which :class:`~taso_jax.traced_source.TracedSource` gives the pipeline as
its check.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from taso_jax.checks import compare_outputs
from taso_jax.frontends.jaxpr_io import TracedFunction
from taso_jax.frontends.signature_entry import _is_tracer

__all__ = ["compare_with_original", "NOISE_MARGIN"]


NOISE_MARGIN = 4.0
"""How many times the reference's own rounding noise an optimized output may differ by.

Two results that each carry up to the noise differ by up to twice it; twice that again
leaves room for the largest of many elements' errors."""


def _rounding_noise(flat_fn: Callable, values, reference) -> list[float]:
    """Per output, how far the original moves between default and full float32 precision.

    That is the largest change of ``reference``, ``jax.jit(flat_fn)(*values)`` at the
    device's default precision, when its matrix products and convolutions run at full
    float32 precision (``jax.default_matmul_precision("highest")``).

    On CPU the default is full precision and every entry is 0. On NVIDIA GPUs from Ampere
    on, float32 ``dot_general`` and convolutions at the default precision round their
    operands to TF32 (10 mantissa bits), so a rewrite that regroups the arithmetic (a
    batchnorm scale folded into a convolution kernel, say) differs from ``jax.jit`` of the
    original by about that rounding, which the fixed relative tolerance of
    :func:`taso_jax.checks.compare_outputs` (1e-3) does not cover through 50 layers.
    Integer, boolean and empty outputs get 0; non-finite elements are skipped. Runs one more
    compile of the original, so it is called only after a failed comparison.
    """
    with jax.default_matmul_precision("highest"):
        exact = jax.tree_util.tree_leaves(jax.jit(flat_fn)(*values))
    noise = []
    for r, e in zip(reference, exact, strict=True):
        r, e = np.asarray(r), np.asarray(e)
        if r.size == 0 or not np.issubdtype(r.dtype, np.inexact):
            noise.append(0.0)
            continue
        wide = np.result_type(r.dtype, np.float64)
        diff = np.abs(r.astype(wide) - e.astype(wide))
        noise.append(float(np.max(diff[np.isfinite(diff)], initial=0.0)))
    return noise


def _default_precision_rounds() -> bool:
    """Whether the default backend's default float32 precision may round matrix products.

    XLA:CPU computes float32 products in float32 at the default precision; GPUs may use TF32
    and TPUs bfloat16 passes. Where it does not round, comparing again at full precision
    would only compile the same function twice.
    """
    return jax.default_backend() != "cpu"


def _at_full_precision(stage: Callable) -> Callable:
    """``stage`` traced with its matrix products and convolutions at full float32 precision.

    ``jax.default_matmul_precision("highest")`` is read when ``lax.dot_general`` and
    ``lax.conv_general_dilated`` are traced, and stored in each equation, so a ``jax.jit`` of
    the result runs at that precision with no per-call cost. Used where the optimized graph
    at the device's default precision differs from the original by more than the original's
    own rounding (see :func:`compare_with_original`).
    """
    @functools.wraps(stage)
    def at_full_precision(*args):
        with jax.default_matmul_precision("highest"):
            return stage(*args)

    return at_full_precision


def _stored_check(check: dict | None) -> dict | None:
    """The JSON-able part of an output check's result, for the graph cache."""
    if check is None:
        return None
    return {k: v for k, v in check.items() if k != "reference"
            and isinstance(v, bool | int | float | str | type(None))}


#: ``jax.jit`` of a weight stage by its nodes (``StagedGraph.fold_key``) and precision,
#: held while some signature's entry holds it: the signatures of one function at other
#: batch sizes fold the same weights alike, and need not compile one weight stage each.
_FOLD_JITS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _shared_fold(staged, full_precision: bool) -> Callable:
    """``jax.jit`` of ``staged``'s weight stage, shared with equal weight stages."""
    key = (staged.fold_key(), full_precision)
    jitted = _FOLD_JITS.get(key)
    if jitted is None:
        fold = staged.fold_function()
        jitted = jax.jit(_at_full_precision(fold) if full_precision else fold)
        _FOLD_JITS[key] = jitted
    return jitted


def _compile_stages(entry, full_precision: bool) -> None:
    """``jax.jit`` of ``entry``'s staged graph, its products at full precision if asked.

    The user's calls donate the inputs they donate (``entry.donated``); the check and the
    timing must not, so a donating runner is compiled beside the plain one.
    """
    run = entry.staged.run
    if full_precision:
        run = _at_full_precision(run)
    entry.full_precision = full_precision
    entry.fold, entry.run = _shared_fold(entry.staged, full_precision), jax.jit(run)
    entry.folded_for = ()
    if entry.donated:
        entry.run_donating = jax.jit(run, donate_argnums=entry.donated)


def compare_with_original(host, entry, traced: TracedFunction, args, static_pos) -> dict:
    """The optimized stages' outputs against the original's, under the module's policy.

    ``host`` is the decorated function (its ``_folded`` weights and ``_entry_jit``). The
    reference is the background run's outputs (:class:`~taso_jax.first_call_budget.
    OriginalRun`), else ``jax.jit`` of the function on the call's arguments, else of the
    traced function on random values for the tracers. The stages may be left compiled at
    full precision.
    """
    leaves, kinds = traced.leaves, traced.kinds
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(np.shape(x)).astype(jnp.result_type(x))
              if _is_tracer(x) else x for x in leaves]
    weights = [v for v, k in zip(values, kinds, strict=True) if k == "weight"]
    inputs = [v for v, k in zip(values, kinds, strict=True) if k == "input"]
    run = entry.original_run
    # with a background run of the original, the stages compile and run while it does
    # (a graph cache hit: nothing else overlaps it)
    early = entry.run(host._folded(entry, weights, True), *inputs) if run else None
    if run is not None and run.join().ok:
        # the background run's outputs: what the timing against it calls, compiled once
        ref = run.outputs
        entry.original_warm = True
    elif entry.all_arrays and not any(_is_tracer(x) for x in leaves):
        # jax.jit of the function itself, as the timing against it calls it: one
        # compile of the original serves both
        ref = jax.tree_util.tree_leaves(host._entry_jit(entry, static_pos)(*args))
        entry.original_warm = True
    else:
        ref = jax.tree_util.tree_leaves(entry.jit_original(*values))
    ref = [np.asarray(x) for x in ref]
    floor, noise = None, []

    def compare() -> dict:
        nonlocal early
        got = (early if early is not None else
               entry.run(host._folded(entry, weights, True), *inputs))
        early = None
        check = compare_outputs([np.asarray(x) for x in got], ref, floor=floor)
        if floor is not None:
            check.update(rounding_noise=max(noise), noise_margin=NOISE_MARGIN)
        return check

    check = compare()
    rounds = not check["ok"] and _default_precision_rounds()
    if rounds:
        noise = _rounding_noise(traced.flat_fn, values, ref)
        if any(noise):
            floor = [NOISE_MARGIN * n for n in noise]
            check = compare()
    if rounds and not check["ok"] and not entry.full_precision:
        # At the default precision a GPU may round the optimized graph's products to
        # TF32 where the original's ran in full float32: cuBLAS multiplies a 1x512 row
        # by a 512x512 matrix in float32, and by the 512x4096 matrix of eight merged
        # ones with TF32 tensor cores (NasRNN on an H200: 1.3e-3 from jax.jit of the
        # original, whose own rounding noise was 0). The optimized graph then runs with
        # its products at full precision if that matches.
        _compile_stages(entry, True)
        again = compare()
        if again["ok"]:
            return {**again, "full_precision": True}
        _compile_stages(entry, False)  # the report keeps the default precision's
    return check
