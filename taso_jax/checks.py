"""The pipeline's measurements: output checks and the report's own timings.

The output checks compare a delivered graph with the input's reference outputs at two
input scales (:data:`CHECK_SCALES`) under one tolerance policy (:func:`compare_outputs`:
``|a - b| <= max(ATOL * max|b|, floor) + RTOL * |b|`` elementwise, integers exactly, NaN
only with NaN), and at a tiny and a huge scale of the inputs' element type
(:func:`range_scales`) where only the non-finite values are compared, and at the huge
one values flushed to 0 (:func:`compare_nonfinite`: a pre-folded weight that overflowed,
or underflowed, shows there): in
onnxruntime against the user's file (:func:`check_onnx`, the command
line), under ``jax.jit`` against the input graph (:func:`check_graphs`, the Python API),
and at other bindings of open sizes (:func:`check_other_sizes`). The noise model: float32
sums reassociate when products are merged or batchnorm is folded, which :data:`RTOL`
covers; a model whose own rounding already exceeds it is judged against that noise (the
command line's export of the unrewritten input, the decorator's run of the original at
full precision), never by loosening the tolerance. The renderings are in
:mod:`taso_jax.report`.
"""

from __future__ import annotations

import numpy as np

from taso_jax._text import one_line
from taso_jax.frontends.onnx_io import model_refusal
from taso_jax.ir.executor import _is_float, random_array, random_inputs
from taso_jax.ir.graph import Graph
from taso_jax.search.choose import device_name, time_graphs

__all__ = ["measure_speed", "measure_onnxruntime", "compare_onnx", "check_onnx",
           "reference_runs", "compare_outputs", "compare_nonfinite", "range_scales",
           "other_bindings", "check_other_sizes",
           "RTOL", "ATOL", "CHECK_SCALES", "ONNXRUNTIME_WARN", "OTHER_SIZES_ATOL",
           "check_graphs", "MAX_RTOL", "MAX_ATOL", "check_tolerances", "tolerance_problem",
           "TYPE_ULPS", "rounding_unit"]

#: Outputs agree when ``|a - b| <= ATOL * max|b| + RTOL * |b|`` elementwise (float32 sums
#: reassociate when convolutions are merged or batchnorm is folded).
RTOL, ATOL = 1e-3, 1e-4

#: The loosest tolerances an output check takes (``--rtol``/``--atol``, ``rtol=``/``atol=``).
#: The check is what catches a wrong rewrite (a rule given with ``trust_proofs``, a bug), so
#: a tolerance may widen it for a model's own rounding, never switch it off: a relative
#: 0.1 is 25 times bfloat16's rounding unit (2^-8) and 100 times :data:`RTOL`; an absolute
#: 1.0 is the size of an N(0, 1) input, so a rewrite that is wrong by the input's own
#: magnitude (a dropped ReLU or clip) still fails at the x100 scale of :data:`CHECK_SCALES`.
#: ``--atol 1e308`` had passed a trusted rule that drops a ReLU.
MAX_RTOL, MAX_ATOL = 0.1, 1.0

#: Outputs of a narrower float type than float32 (float16, bfloat16), or computed in one, are
#: compared at that type's rounding: ``rtol`` at least ``TYPE_ULPS`` units of it (float16
#: 7.8e-3, bfloat16 6.25e-2) and ``atol`` at least that times the largest reference
#: magnitude. :data:`RTOL` is one float16 unit: a merged float16 matmul, whose summed
#: weight is rounded once more, differed by two (0.00195 at values near 1).
TYPE_ULPS = 8


def rounding_unit(graph: Graph) -> float:
    """The rounding unit (``finfo.eps``) of the narrowest float type ``graph`` computes in.

    ``0.0`` where every float tensor (inputs, weights, intermediate and output values) is
    float32 or wider: the check's tolerances (:data:`RTOL`, :data:`ATOL`) are float32's.
    float16 gives 2^-10, bfloat16 2^-7 (:data:`TYPE_ULPS` of it set the check's floor).
    """
    return max((_narrow_unit(t.dtype) for n in graph.nodes for t in n.types), default=0.0)


def _narrow_unit(dtype) -> float:
    """``finfo(dtype).eps`` for a float type narrower than float32, else ``0.0``."""
    import ml_dtypes

    if not _is_float(dtype):
        return 0.0
    eps = float(ml_dtypes.finfo(np.dtype(dtype)).eps)
    return eps if eps > float(np.finfo(np.float32).eps) else 0.0


def tolerance_problem(name: str, value: float | None) -> str | None:
    """Why ``value`` cannot be the tolerance ``name`` (``"rtol"``, ``"atol"``), or None.

    ``None`` (the default: :data:`RTOL`, or :data:`ATOL` scaled) is fine; otherwise the
    value must be finite, >= 0 and at most :data:`MAX_RTOL` or :data:`MAX_ATOL`.
    """
    ceiling = {"rtol": MAX_RTOL, "atol": MAX_ATOL}[name]
    if value is None or 0 <= value <= ceiling:  # NaN fails both comparisons
        return None
    return (f"a tolerance must be a finite number >= 0 and at most {ceiling} (a looser one "
            "lets a wrong rewrite pass the output check)")


def check_tolerances(rtol: float | None, atol: float | None) -> None:
    """Refuse output-check tolerances that :func:`tolerance_problem` finds fault with.

    Raises:
        ValueError: ``rtol`` or ``atol`` NaN, infinite, negative or above its ceiling
            (:data:`MAX_RTOL`, :data:`MAX_ATOL`), naming it (``atol=2.0: ...``).
    """
    for name, value in (("rtol", rtol), ("atol", atol)):
        problem = tolerance_problem(name, value)
        if problem:
            raise ValueError(f"{name}={value}: {problem}")


def measure_speed(before: Graph, after: Graph, repeats: int = 30, seed: int = 0,
                  deadline: float | None = None) -> dict:
    """Median wall time in microseconds of both graphs under ``jax.jit``, same process.

    Runs are interleaved (before, after, before, ...) after warm-up so that machine noise
    hits both alike; fewer runs (at least 3) once ``deadline`` (``time.perf_counter()``) has
    passed. Returns ``{"before_us", "after_us", "speedup", "device", "repeats"}``.
    """
    if after.key == before.key:  # the same graph: time it once
        ta = tb = time_graphs([before], repeats=repeats, warmup=2, seed=seed,
                              deadline=deadline)[0]
    else:
        ta, tb = time_graphs([before, after], repeats=repeats, warmup=2, seed=seed,
                             deadline=deadline)
    repeats = ta["repeats"]
    a, b = ta["median_us"], tb["median_us"]
    return {"before_us": a, "after_us": b, "speedup": a / b if b else float("nan"),
            "device": device_name(), "repeats": repeats}


def measure_onnxruntime(original, optimized, inputs: dict, repeats: int = 20,
                        deadline: float | None = None, seconds: float | None = None) -> dict:
    """Median wall time in microseconds of both ONNX models in onnxruntime, same process.

    What a user of the ONNX file runs: CPU execution provider, onnxruntime's default
    threads, runs interleaved after warm-up. A rewrite that pays under XLA can cost in
    onnxruntime (a grouped convolution made dense). Returns ``{"before_us", "after_us",
    "speedup", "repeats"}``.
    """
    from taso_jax.frontends.onnxruntime_target import time_onnx_models

    times = time_onnx_models([original, optimized], inputs, repeats=repeats, deadline=deadline,
                             seconds=seconds)
    repeats = len(times[0])
    a, b = float(np.median(times[0])), float(np.median(times[1]))
    return {"before_us": a, "after_us": b, "speedup": a / b if b else float("nan"),
            "repeats": repeats}


#: A written model slower than this fraction of the original in onnxruntime is warned about.
ONNXRUNTIME_WARN = 0.95


def _session(model):
    from taso_jax.frontends.onnxruntime_target import ort_session

    return ort_session(model, trim=True)


def _outputs(session, inputs: dict) -> list:
    """The session's outputs on ``inputs``, owning their memory (they are kept)."""
    from taso_jax.frontends.onnxruntime_target import owned_run

    return owned_run(session, inputs)


def _reference(original, inputs: dict, hint: str | None = None) -> list:
    """The original model's outputs on ``inputs``; a model that does not run is bad input.

    ``original`` is ONNX bytes, a path or an onnxruntime session of either. ``hint`` ends
    the error in place of the advice to give ``--input-shape``; the error is then a
    :class:`~taso_jax.frontends.onnx_io.ValueSizedModel` (random values fed where sizes are
    read are the likely cause).
    """
    try:
        session = original if hasattr(original, "run") else _session(original)
        return _outputs(session, inputs)
    except Exception as e:  # the user's model itself, not ours
        shapes = ", ".join(f"{k}={list(np.shape(v))}" for k, v in inputs.items())
        message = (f"the original model does not run in onnxruntime on random inputs "
                   f"({shapes}): {one_line(str(e), 400)} ("
                   f"{hint or 'if it expects other sizes, give them with --input-shape'})")
        raise model_refusal(message, hint) from e


def _actual(optimized, inputs_list: list, reference_count: int, rtol, atol):
    """The optimized model's outputs per input set, or the failed check if it cannot run."""
    try:
        sess = _session(optimized)
        return [_outputs(sess, inputs) for inputs in inputs_list], None
    except Exception as e:  # ours: the check fails, and says why
        return None, {"ok": False, "max_abs_err": float("inf"), "rtol": rtol,
                      "atol": f"{ATOL} x max|output|" if atol is None else atol,
                      "outputs": reference_count,
                      "error": "the optimized model does not run: "
                               f"{one_line(str(e), 400)}"}


def compare_onnx(original, optimized, inputs: dict, rtol: float = RTOL,
                 atol: float | None = None) -> dict:
    """Run both ONNX models (bytes or paths) in onnxruntime on ``inputs``; compare outputs.

    Returns what :func:`compare_outputs` returns; a check that failed because the optimized
    model does not run carries ``"error"``.

    Raises:
        ValueError: a tolerance refused by :func:`check_tolerances`.
        ModelError: the original model does not run on ``inputs``.
    """
    check_tolerances(rtol, atol)
    reference = _reference(original, inputs)
    actual, failed = _actual(optimized, [inputs], len(reference), rtol, atol)
    return failed or compare_outputs(actual[0], reference, rtol, atol)


#: Scales of the random inputs an output check runs at: N(0, 1), then x100 (a rewrite that is
#: right near zero only, such as dropping a clip, shows at large inputs).
CHECK_SCALES = (1.0, 100.0)


def range_scales(graph: Graph, scales=CHECK_SCALES) -> tuple[float, ...]:
    """A tiny and a huge input scale across the dynamic range of ``graph``'s float inputs.

    Of the narrowest float input type (the least largest value: float16 before bfloat16
    before float32): ``tiny ** 0.5`` (float32 and bfloat16 1.1e-19, float16 7.8e-3), where
    ``1 / x`` and ``x * x`` stay normal, and ``max ** 0.25`` (float32 4.3e9), where
    products of two inputs, and their sums, stay far from overflow; the huge one only where
    it is above every scale of ``scales`` (float16's 16 is not). A graph without float
    inputs it scales (float ids cast to indices are not) has none. At these
    scales only the non-finite values are compared (:func:`compare_nonfinite`): a weight
    summed ahead of time that overflowed (``abs(x) @ (W1 + W2)``, inf) gives inf where the
    original, at tiny inputs, is finite; values are not compared, so that subnormal
    rounding cannot fail a rewrite that is right.
    """
    import ml_dtypes

    indices = graph.meta.get("integer_input_bounds") or {}  # float ids are never scaled
    floats = [n.types[0].dtype for n in graph.inputs
              if _is_float(n.types[0].dtype) and n.name not in indices]
    if not floats:
        return ()
    info = min((ml_dtypes.finfo(d) for d in floats), key=lambda f: float(f.max))
    tiny, huge = float(info.tiny) ** 0.5, float(info.max) ** 0.25
    return (tiny, huge) if huge > max(scales, default=1.0) else (tiny,)


def _scaled(x: np.ndarray, scale: float) -> np.ndarray:
    """``x`` times ``scale`` in its own type (a float array; bfloat16 included)."""
    return x * np.asarray(scale, x.dtype)


def reference_runs(original, graph: Graph, scales=CHECK_SCALES, seed: int = 1,
                   nonfinite: bool = True) -> list[tuple[float, dict, list]]:
    """``(scale, inputs, outputs)`` of the original model at each input scale.

    Float inputs are N(0, 1) times the scale; integer and boolean inputs are not scaled,
    nor are float inputs that the model casts to indices (``integer_input_bounds``). With
    ``nonfinite``, the scales of :func:`range_scales` follow ``scales`` (where
    :func:`check_onnx` compares the non-finite values only). Run before a long search, so
    that a model that does not run fails at once.

    Raises:
        ModelError: the original model does not run on these inputs.
    """
    base = dict(zip((n.name for n in graph.inputs), random_inputs(graph, seed=seed),
                    strict=True))
    try:
        session = _session(original)  # one session for every scale
    except Exception:
        session = original  # _reference reports the failure, in one line
    runs = []
    indices = graph.meta.get("integer_input_bounds") or {}
    hint = graph.meta.get("value_sized_hint")
    for scale in (*scales, *(range_scales(graph, scales) if nonfinite else ())):
        feeds = {k: (_scaled(v, scale) if _is_float(v.dtype) and k not in indices else v)
                 for k, v in base.items()}
        runs.append((scale, feeds, _reference(session, feeds, hint)))
    return runs


def check_onnx(original, optimized, graph: Graph, rtol: float = RTOL,
               atol: float | None = None, scales=CHECK_SCALES, seed: int = 1,
               references: list | None = None) -> dict:
    """Compare the optimized model with the original at each input scale; ok if all are.

    ``references`` are :func:`reference_runs` of the original when already made; runs at
    scales not in ``scales`` (:func:`range_scales`) compare the non-finite values only
    (:func:`compare_nonfinite`). Returns the comparison of the worst scale, with
    ``"scales"`` (the scales compared in full), ``"range_scales"`` (the others run) and
    ``"failed_scale"`` (the first failing one, or ``None``).

    Raises:
        ValueError: a tolerance refused by :func:`check_tolerances`.
        ModelError: the original model does not run on the check's inputs.
    """
    check_tolerances(rtol, atol)
    runs = references if references is not None else reference_runs(original, graph,
                                                                     scales, seed)
    actual, failed = _actual(optimized, [feeds for _, feeds, _ in runs], len(runs[0][2]),
                             rtol, atol)
    full = [s for s, _, _ in runs if s in scales]
    ranged = [s for s, _, _ in runs if s not in scales]
    if failed:
        return {**failed, "failed_scale": runs[0][0], "scales": full, "range_scales": ranged}
    worst = _worst_scale(((scale, got, reference) for (scale, _, reference), got
                          in zip(runs, actual, strict=True)), rtol, atol, full,
                         rounding_unit(graph))
    worst.update(scales=full, range_scales=ranged)
    return worst


def _worst_scale(runs, rtol: float, atol: float | None, full, unit: float = 0.0) -> dict:
    """The worst comparison of ``(scale, actual, reference)`` runs.

    Runs at a scale of ``full`` are compared in full (:func:`compare_outputs`), the others
    by their non-finite values (:func:`compare_nonfinite`), ``unit`` the graph's rounding
    (:func:`rounding_unit`). Runs are compared in order
    until one fails; the result is the first failing comparison, else the one with the
    largest error, with ``"failed_scale"`` (``None`` when all pass).
    """
    worst = None
    for scale, got, reference in runs:
        r = (compare_outputs(got, reference, rtol, atol, unit=unit) if scale in full
             else compare_nonfinite(got, reference, rtol, atol, underflow=scale > 1.0))
        r["failed_scale"] = None if r["ok"] else scale
        if worst is None or (worst["ok"] and not r["ok"]) or (
                r["ok"] == worst["ok"] and r["max_abs_err"] > worst["max_abs_err"]):
            worst = r
        if not r["ok"]:
            break
    return worst


def check_graphs(original: Graph, optimized: Graph, rtol: float = RTOL,
                 atol: float | None = None, scales=CHECK_SCALES, seed: int = 1) -> dict:
    """Compare two graphs' outputs under ``jax.jit`` at each input scale; ok if all are.

    The check the Python API makes where no independent executor of the original is at
    hand: both graphs are compiled with :func:`~taso_jax.ir.executor.compile_graph` and run
    on the same seeded random inputs, floats scaled by each of ``scales`` (integer and
    boolean inputs, and inputs the graph uses as indices, are not scaled), then by each of
    :func:`range_scales`, where only the non-finite values are compared
    (:func:`compare_nonfinite`). Tolerances as in :func:`compare_outputs`. Returns the
    comparison of the worst scale, with ``"scales"``, ``"range_scales"`` and
    ``"failed_scale"`` (the first failing one, or ``None``), and ``"reference"``.

    Raises:
        ValueError: a tolerance refused by :func:`check_tolerances`.
    """
    from taso_jax.ir.executor import compile_graph

    check_tolerances(rtol, atol)
    base = random_inputs(original, seed=seed)
    indices = original.meta.get("integer_input_bounds") or {}
    run_a, run_b = compile_graph(original), compile_graph(optimized)
    ranged = range_scales(original, scales)

    def runs():  # each scale's outputs are computed only when the comparison reaches it
        for scale in (*scales, *ranged):
            xs = [_scaled(x, scale) if _is_float(x.dtype) and n.name not in indices else x
                  for n, x in zip(original.inputs, base, strict=True)]
            yield (scale, [np.asarray(y) for y in _as_list(run_b(*xs))],
                   [np.asarray(y) for y in _as_list(run_a(*xs))])

    worst = _worst_scale(runs(), rtol, atol, scales, rounding_unit(original))
    worst.update(scales=list(scales), range_scales=list(ranged),
                 reference="jax.jit of the input graph")
    return worst


def _as_list(out) -> list:
    return list(out) if isinstance(out, list | tuple) else [out]


def other_bindings(graph: Graph, symbolic: dict) -> list[dict[str, tuple[int, ...]]]:
    """Input shapes at sizes other than those ``graph`` was optimized at, to try in order.

    ``symbolic`` is :func:`taso_jax.frontends.onnx_io.symbolic_dims` of the original model.
    The first trial (for 2 to 4 symbols) moves every symbol by a different factor (the
    k-th: a size bound to 1 becomes k + 2, any other k + 2 times its size), so that sizes
    equal at the binding (a
    square image's H and W, a batch and a length both bound to 1) differ there: a graph
    that holds one of them for the other fails. Then the trials of one factor: a
    batch-like symbol (bound to 1) becomes 2, any other one doubles, for every symbol, then
    the batch-like ones only, then the others only. Symbols with a name move together; an
    unnamed open axis moves alone.
    """
    bound = {n.name: n.types[0].shape for n in graph.inputs if n.name in symbolic}
    symbols: dict[str, tuple[int, bool]] = {}
    for name, axes in symbolic.items():
        for axis, sym in axes.items():
            if name in bound:
                v = bound[name][axis]
                symbols.setdefault(sym or f"{name}[{axis}]", (v, v == 1))
    trials = []
    for which in ("distinct", "all", "batch", "rest"):
        if which == "distinct":
            new = {sym: (k + 2) * v for k, (sym, (v, _)) in enumerate(symbols.items())}
            if len(set(new.values())) < len(new) or not 2 <= len(new) <= 4:
                continue
        else:
            new = {sym: (2 if v == 1 else 2 * v) if which == "all" or
                   (which == "batch") == batch else v for sym, (v, batch) in symbols.items()}
        if new == {sym: v for sym, (v, _) in symbols.items()}:
            continue
        shapes = {}
        for name, shape in bound.items():
            dims = list(shape)
            for axis, sym in symbolic[name].items():
                dims[axis] = new[sym or f"{name}[{axis}]"]
            shapes[name] = tuple(dims)
        if shapes not in trials:
            trials.append(shapes)
    return trials


#: The least absolute tolerance of :func:`check_other_sizes` (torch.testing's float32 default):
#: float32 rounding noise. A text detector's sigmoid map is all but 0 on random images (its
#: largest value 5e-6 at 2x3x672x896), so a tolerance scaled by that (1e-4 x 5e-6) failed a
#: rewrite whose outputs differed by 1.5e-7 there; at the bound sizes the values are
#: compared at two input scales without this floor.
OTHER_SIZES_ATOL = 1e-5


def check_other_sizes(original, optimized, graph: Graph, symbolic: dict,
                      rtol: float = RTOL, atol: float | None = None, seed: int = 2,
                      judge=None) -> dict:
    """Check ``optimized``, its sizes left open, against ``original`` at other sizes.

    The first binding of :func:`other_bindings` at which the original runs is used; inputs
    are N(0, 1) (integers as :func:`~taso_jax.ir.executor.random_inputs` draws them), and
    the absolute tolerance is at least :data:`OTHER_SIZES_ATOL`.
    Returns ``{"ok", "shapes", ...}`` with the comparison (:func:`compare_outputs`),
    ``"ok": None`` when the original itself runs at none of the trial sizes, and
    ``"error"`` when the optimized model does not run there. ``judge(check, original,
    optimized, runs)``, where given, settles a failed comparison in place (as
    :func:`~taso_jax.rounding_cuts.judge_at_cuts` does); ``runs`` is
    ``[(1.0, feeds, reference outputs)]``.

    Raises:
        ValueError: a tolerance refused by :func:`check_tolerances`.
    """
    check_tolerances(rtol, atol)
    rng = np.random.default_rng(seed)
    static = {n.name: n.types[0] for n in graph.inputs}
    bounds = graph.meta.get("integer_input_bounds") or {}
    defaults = graph.meta.get("input_defaults") or {}
    for shapes in other_bindings(graph, symbolic):
        feeds = {}
        for name, t in static.items():
            feeds[name] = (np.array(defaults[name]) if name in defaults else
                           random_array(shapes.get(name, t.shape), t.dtype, rng,
                                        bounds.get(name)))
        try:
            reference = _outputs(_session(original), feeds)
        except Exception:
            continue
        actual, failed = _actual(optimized, [feeds], len(reference), rtol, atol)
        r = failed or compare_outputs(actual[0], reference, rtol, atol,
                                      floor=[OTHER_SIZES_ATOL] * len(reference),
                                      unit=rounding_unit(graph))
        if not r["ok"] and not failed and judge is not None:
            judge(r, original, optimized, [(1.0, feeds, reference)])
        return {**r, "shapes": {k: list(v) for k, v in shapes.items()}}
    return {"ok": None, "shapes": None}


def compare_outputs(actual, reference, rtol: float = RTOL, atol: float | None = None,
                    floor=None, unit: float = 0.0) -> dict:
    """Compare output arrays with their references (same order).

    Integer and boolean outputs must be equal. Float and complex outputs agree where
    ``|a - b| <= atol + rtol * |b|``, with ``atol`` by default ``ATOL`` times the largest
    finite reference magnitude of each output (a scale-aware tolerance), or the absolute
    value given. ``floor``, one float per output, raises each output's ``atol`` to at least
    that value: the rounding noise the reference itself carries on the device (see
    ``taso_jax.decorator``), where the default tolerance would be tighter than the
    reference is exact. Non-finite values must match exactly: NaN with NaN, +inf with +inf.
    An output of a float type narrower than float32, or of a graph computing in one
    (``unit``: :func:`rounding_unit`), is compared at that type's rounding: ``rtol`` and the
    scale-aware ``atol`` at least :data:`TYPE_ULPS` units of it (reported as ``"type_rtol"``).

    Returns ``{"ok", "max_abs_err", "rtol", "atol", "outputs"}``; ``max_abs_err`` is
    ``inf`` when a non-finite value does not match. A NaN tolerance (``rtol``, ``atol`` or a
    ``floor``) fails every float output: no comparison passes by a NaN.

    Raises:
        ValueError: ``rtol`` or ``atol`` above its ceiling (:data:`MAX_RTOL`,
            :data:`MAX_ATOL`), infinity included.
    """
    if rtol > MAX_RTOL or (atol is not None and atol > MAX_ATOL):
        check_tolerances(rtol, atol)  # raises, naming the one too loose
    ok, worst = len(actual) == len(reference), 0.0
    floors = list(floor) if floor is not None else [0.0] * len(reference)
    tolerances = [rtol, *floors] + ([] if atol is None else [atol])
    if np.isnan(np.asarray(tolerances, np.float64)).any():
        ok = False  # a NaN tolerance passes nothing, even where every value is NaN
    widest = 0.0  # the type rounding's share of rtol, where it widened one
    for a, b, low in zip(actual, reference, floors, strict=False):
        a, b = np.asarray(a), np.asarray(b)
        typed = min(TYPE_ULPS * max(unit, _narrow_unit(b.dtype)), MAX_RTOL)
        if a.shape != b.shape:
            ok = False
            continue
        if b.size == 0:
            continue
        if not (np.issubdtype(b.dtype, np.inexact) or _is_float(b.dtype)):  # exactly
            diff = np.abs(a.astype(np.int64) - b.astype(np.int64)) if b.dtype != bool \
                else (a != b).astype(np.int64)
            ok &= bool(np.all(diff == 0))
            worst = max(worst, float(diff.max()))
            continue
        kind = np.complex128 if np.iscomplexobj(a) or np.iscomplexobj(b) else np.float64
        a, b = a.astype(kind), b.astype(kind)
        finite = np.isfinite(a) & np.isfinite(b)
        same = (a == b) | (np.isnan(a) & np.isnan(b))  # equal infinities, NaN with NaN
        if not np.all(finite | same):
            ok, worst = False, float("inf")
        scale = float(np.max(np.abs(b[np.isfinite(b)]), initial=0.0))
        # np.maximum and the negated test carry a NaN tolerance through: it fails, never
        # passes (err > nan is False, and Python's max(nan, x) can drop the NaN)
        widest = max(widest, typed)
        tol = (np.maximum(ATOL * scale if atol is None else atol, max(low, typed * scale))
               + max(rtol, typed) * np.abs(b))
        with np.errstate(invalid="ignore"):  # inf - inf where both are inf: masked out
            err = np.where(finite, np.abs(a - b), 0.0)
        if not np.all((err <= tol) | ~finite):  # non-finite values: compared above
            ok = False
        worst = max(worst, float(np.max(err)) if not np.isnan(err).any() else float("inf"))
    out = {"ok": bool(ok), "max_abs_err": worst, "rtol": rtol,
           "atol": f"{ATOL} x max|output|" if atol is None else atol,
           "outputs": len(reference)}
    if floor is not None:
        out["atol_floor"] = max(floors, default=0.0)
    if widest > rtol:
        out["type_rtol"] = widest
    return out


def compare_nonfinite(actual, reference, rtol: float = RTOL, atol: float | None = None,
                      underflow: bool = False) -> dict:
    """Compare outputs by their non-finite values only (the scales of :func:`range_scales`).

    For each float output: where the reference is finite the actual value must be too; where
    the reference is +inf or -inf the actual must not be NaN nor the opposite infinity (a
    finite value is allowed: the rewrite overflowed less); where the reference is NaN
    anything goes. Integer, boolean and complex outputs, and finite values, are not
    compared (subnormal rounding at tiny inputs is not a fault). With ``underflow`` (the
    huge scale, where no input is tiny), a value 0 or subnormal where the reference is a
    normal number of at least twice the type's smallest and :data:`ATOL` of the output's
    largest magnitude fails too, in more than :data:`FLUSHED_SHARE` of those: a weight
    product folded ahead of time that flushed to 0 (``x * (c * c)``, ``c = 1e-23`` in
    float32) where the original at large inputs is not.

    Returns ``{"ok", "max_abs_err", "rtol", "atol", "outputs", "nonfinite_only": True}``
    (``rtol``/``atol`` as :func:`compare_outputs` would report them); ``max_abs_err`` is
    ``inf`` where a value does not match, else 0, and a failure adds ``"nonfinite"``: how
    many elements failed, and of what kind (``"inf where the original is finite"``...).
    """
    import ml_dtypes

    ok, bad = len(actual) == len(reference), {}
    for a, b in zip(actual, reference, strict=False):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            ok = False
            continue
        if not _is_float(b.dtype) or b.size == 0:
            continue
        tiny = float(ml_dtypes.finfo(b.dtype).tiny)
        a, b = a.astype(np.float64), b.astype(np.float64)
        kinds = (("not finite where the original is finite", np.isfinite(b) & ~np.isfinite(a)),
                 ("NaN where the original is inf", np.isinf(b) & np.isnan(a)),
                 ("inf of the other sign", np.isinf(b) & np.isinf(a) & (a != b)))
        if underflow:
            normal = _clearly_normal(b, tiny)
            flushed = normal & np.isfinite(a) & (np.abs(a) < tiny)  # 0 or subnormal
            if flushed.sum() > FLUSHED_SHARE * normal.sum():
                kinds += (("0 or subnormal where the original is normal", flushed),)
        for what, where in kinds:
            if where.any():
                bad[what] = bad.get(what, 0) + int(where.sum())
    ok = ok and not bad
    out = {"ok": bool(ok), "max_abs_err": 0.0 if ok else float("inf"), "rtol": rtol,
           "atol": f"{ATOL} x max|output|" if atol is None else atol,
           "outputs": len(reference), "nonfinite_only": True}
    if bad:
        out["nonfinite"] = bad
    return out


#: The share of an output's clearly normal elements (:func:`_clearly_normal`) that may be 0
#: or subnormal in the rewrite at the huge input scale. A weight product folded ahead of
#: time that flushed to 0 empties a channel or more; a lone element is a sum that cancels,
#: huge terms to a small difference, taken in another order (U^2-Net-p after its columns
#: lowerings: 1 element of 102,400 in one of 7 outputs, its sigmoid of about -9).
FLUSHED_SHARE = 1e-3


def _clearly_normal(b: np.ndarray, tiny: float) -> np.ndarray:
    """Where finite ``b`` is clearly a normal number.

    Clearly: at least twice ``tiny`` and :data:`ATOL` of ``b``'s largest finite magnitude
    (what the value comparison at the usual scales lets go as noise).
    """
    finite = np.isfinite(b)
    if not finite.any():
        return np.zeros(b.shape, bool)
    floor = max(2.0 * tiny, ATOL * float(np.abs(b[finite]).max()))
    return finite & (np.abs(b) >= floor)

