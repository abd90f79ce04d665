"""The output check where a model amplifies rounding: compared at the operators that do.

A rewrite that is right changes float rounding (a merged product, a folded batchnorm, a
convolution lowered to a matrix product) by a few units in the last place. Most operators
carry such a change through at its size; a few turn it into a large one: ``TopK`` reorders
near-equal values (an index that differs by 310), ``ArgMax``/``ArgMin`` and
``NonMaxSuppression`` pick another element, ``QuantizeLinear`` moves a value across a
quantization step (and every layer after it sees a whole step). Comparing such a model's
outputs cannot tell a right rewrite from a wrong one.

:func:`check_cuts` compares at those operators instead (:data:`AMPLIFIERS`). The model is
cut there: each amplifier's computed inputs (a ``TopK``'s values and a computed ``k``, a
``QuantizeLinear``'s float input, a ``NonMaxSuppression``'s boxes and scores) are compared
with the original's under the check's own tolerance (integers exactly;
:func:`~taso_jax.checks.compare_outputs`); the optimized model then continues from the
original's amplifier outputs, fed in its place, and its outputs are compared with the
original's. Every value that reaches an output or an amplifier is thus compared, on each
segment between the cuts, under the float tolerance; only the amplifying step itself is
the original's. A wrong rewrite before an amplifier (a dropped ReLU, a wrong sign) shows
in its inputs, one after it in the outputs. It runs only where the outputs' own
comparison failed.

The amplifiers of the two models are paired by operator, attributes and constant inputs
(a quantization's scale and zero point), in graph order; models whose amplifiers do not
pair are not compared this way (``None``), and their failed check stands.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter

import numpy as np

from taso_jax.checks import ATOL, CHECK_SCALES, RTOL, compare_nonfinite, compare_outputs

__all__ = ["AMPLIFIERS", "check_cuts", "judge_at_cuts", "amplifier_counts"]

log = logging.getLogger(__name__)

#: Operators whose outputs move by a large step for a rounding-sized change of their inputs,
#: with the positions of the inputs compared in their place (ONNX operator specs: TopK,
#: ArgMax, ArgMin, NonMaxSuppression (boxes, scores), QuantizeLinear,
#: DynamicQuantizeLinear).
AMPLIFIERS: dict[str, tuple[int, ...]] = {
    "TopK": (0,), "ArgMax": (0,), "ArgMin": (0,), "NonMaxSuppression": (0, 1),
    "QuantizeLinear": (0,), "DynamicQuantizeLinear": (0,),
}

#: Models larger than this (serialized, bytes) are not cut: protobuf's 2 GiB limit, and
#: twice the weights held while both cut models are built.
MAX_CUT_BYTES = 1 << 30


def amplifier_counts(model) -> Counter:
    """How many of each :data:`AMPLIFIERS` operator ``model`` (bytes, path) computes on data.

    Amplifiers of constants only (a weight quantized in the graph) are not counted: a
    rewrite may fold them ahead of time. Subgraphs (``If``, ``Loop``) are not looked into.
    """
    import onnx

    proto = onnx.load(model, load_external_data=False) if isinstance(model, str) \
        else onnx.load_from_string(model)
    return Counter(n.op_type for n in _amplifiers(proto.graph))


def _load(model):
    """``model`` (bytes or a path, external data beside it) as a ``ModelProto``."""
    import onnx

    return onnx.load(model) if isinstance(model, str) else onnx.load_from_string(model)


def _constants(graph) -> dict:
    """The graph's constant tensors by name: initializers and ``Constant`` outputs."""
    from onnx import numpy_helper

    values = {t.name: t for t in graph.initializer}
    for n in graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            values[n.output[0]] = n.attribute[0].t
    return {k: numpy_helper.to_array(t) for k, t in values.items()}


def _constant_names(graph) -> set[str]:
    """The names of the graph's initializers and ``Constant`` outputs."""
    return {t.name for t in graph.initializer} | {
        o for n in graph.node if n.op_type == "Constant" for o in n.output}


def _amplifiers(graph) -> list:
    """The :data:`AMPLIFIERS` nodes of ``graph`` whose compared inputs are not constants."""
    constant = _constant_names(graph)
    return [n for n in graph.node if n.domain in ("", "ai.onnx") and n.op_type in AMPLIFIERS
            and any(i < len(n.input) and n.input[i] and n.input[i] not in constant
                    for i in AMPLIFIERS[n.op_type])]


def _signature(node, constants: dict) -> tuple:
    """What pairs two amplifiers: operator, attributes, and constant inputs by value."""
    compared = AMPLIFIERS[node.op_type]
    others = []
    for i, name in enumerate(node.input):
        if i in compared:
            continue
        a = constants.get(name)
        others.append("computed" if a is None else
                      (str(a.dtype), a.shape, hashlib.sha256(a.tobytes()).hexdigest()))
    attrs = sorted((a.name, a.SerializeToString()) for a in node.attribute)
    return node.op_type, tuple(attrs), tuple(others), len(node.output)


def _pairs(original, optimized) -> list | None:
    """``[(original node, optimized node)]`` of the two graphs' amplifiers, or ``None``.

    Paired by :func:`_signature`, in graph order within one signature; ``None`` where the
    two models' amplifiers differ (a count, an attribute, a scale).
    """
    a, b = _amplifiers(original), _amplifiers(optimized)
    ca, cb = _constants(original), _constants(optimized)
    groups: dict = {}
    for n in b:
        groups.setdefault(_signature(n, cb), []).append(n)
    pairs = []
    for n in a:
        rivals = groups.get(_signature(n, ca))
        if not rivals:
            return None
        pairs.append((n, rivals.pop(0)))
    return pairs if not any(groups.values()) else None


def _tapped(model, names: list[str], prefix: str):
    """``model`` with each tensor of ``names`` also an output, ``prefix`` + its position."""
    from onnx import helper

    for k, name in enumerate(names):
        model.graph.node.append(helper.make_node("Identity", [name], [f"{prefix}{k}"]))
        model.graph.output.append(helper.make_empty_tensor_value_info(f"{prefix}{k}"))
    return model


def _cut(model, nodes: list, fed: dict[str, np.ndarray], keep: list[int]):
    """``model`` without ``nodes``, whose outputs become inputs (``fed``: name -> example).

    Only the graph outputs at the positions ``keep`` stay outputs.
    """
    from onnx import helper

    drop = {id(n) for n in nodes}
    kept = [n for n in model.graph.node if id(n) not in drop]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    outputs = [model.graph.output[i] for i in keep]
    del model.graph.output[:]
    model.graph.output.extend(outputs)
    for name, value in fed.items():
        model.graph.input.append(helper.make_tensor_value_info(
            name, helper.np_dtype_to_tensor_dtype(value.dtype), value.shape))
    return model


def check_cuts(original, optimized, runs: list, rtol: float = RTOL,
               atol: float | None = None, unit: float = 0.0,
               scales=CHECK_SCALES) -> dict | None:
    """Compare two ONNX models cut at the operators that amplify rounding (module doc).

    ``original`` and ``optimized`` are bytes or paths; ``runs`` are the check's
    ``(scale, feeds, outputs)`` (:func:`~taso_jax.checks.reference_runs`); at the scales of
    ``scales`` the cut models are compared, at the others (``range_scales``) the whole
    models' non-finite values (:func:`~taso_jax.checks.compare_nonfinite`). Tolerances
    and ``unit`` as in :func:`~taso_jax.checks.compare_outputs`.

    Returns ``None`` where the original computes no amplifier on data, or where the two
    models' amplifiers do not pair (:func:`_pairs`) or cannot be cut (a model over
    :data:`MAX_CUT_BYTES`); else ``{"ok", "max_abs_err", "amplifiers", "compared",
    "note"}``: ``max_abs_err`` the largest difference of a compared input or output,
    ``amplifiers`` the operators cut at ({op: count}), ``compared`` how many tensors were
    compared at their inputs.

    Where onnxruntime refuses a cut model, the result is ``None`` too (logged): the cuts
    give no verdict, and the failed check stands.
    """
    if not amplifier_counts(original):
        return None
    try:
        orig, opt = _load(original), _load(optimized)
        pairs = _pairs(orig.graph, opt.graph)
        if not pairs or orig.ByteSize() + opt.ByteSize() > MAX_CUT_BYTES:
            return None
        return _compare_cut(orig, opt, pairs, optimized, runs, rtol, atol, unit, scales)
    except Exception as e:  # noqa: BLE001 - a cut onnxruntime refuses decides nothing
        log.info("the check at the amplifiers did not run: %s", e)
        return None


def _compare_cut(orig, opt, pairs: list, optimized, runs: list, rtol, atol, unit,
                 scales) -> dict:
    """:func:`check_cuts` on loaded models whose amplifiers pair (``pairs``)."""
    from taso_jax.checks import _outputs, _session
    constant = _constant_names(orig.graph)  # every computed input is compared (a TopK's k)
    spots = [(a, b) for o, p in pairs for a, b in zip(o.input, p.input, strict=False)
             if a and b and a not in constant]
    fed = [(o.output[j], p.output[j]) for o, p in pairs for j in range(len(o.output))
           if o.output[j] and p.output[j]]
    fed_o, fed_p = {a for a, _ in fed}, {b for _, b in fed}
    keep = [i for i, v in enumerate(orig.graph.output) if v.name not in fed_o]
    if keep != [i for i, v in enumerate(opt.graph.output) if v.name not in fed_p]:
        return None
    n_out = len(orig.graph.output)
    tap = _session(_tapped(orig, [a for a, _ in spots] + [a for a, _ in fed], "__tap_")
                   .SerializeToString())
    whole = cut = None
    worst = {"ok": True, "max_abs_err": 0.0}
    for scale, feeds, _ in runs:
        if scale not in scales:  # the dynamic range's ends: the whole models' non-finite values
            whole = whole or _session(optimized)
            r = compare_nonfinite(_outputs(whole, feeds), _reference_at(runs, scale), rtol, atol,
                                  underflow=scale > 1.0)  # as the check itself compares
        else:
            got = _outputs(tap, feeds)
            inputs_o, amp = got[n_out:n_out + len(spots)], got[n_out + len(spots):]
            given = {b: v for (_, b), v in zip(fed, amp, strict=True)}
            if cut is None:  # the cut model is built once, typed by the first run
                cut = _session(_tapped(_cut(opt, [p for _, p in pairs], given, keep),
                                       [b for _, b in spots], "__cut_").SerializeToString())
            out = _outputs(cut, {**feeds, **given})
            r_in = compare_outputs(out[len(keep):], inputs_o, rtol, atol, unit=unit)
            r_out = compare_outputs(out[:len(keep)], [got[i] for i in keep], rtol, atol,
                                    unit=unit)
            r = {"ok": r_in["ok"] and r_out["ok"],
                 "max_abs_err": max(r_in["max_abs_err"], r_out["max_abs_err"])}
        worst = {"ok": worst["ok"] and r["ok"],
                 "max_abs_err": max(worst["max_abs_err"], r["max_abs_err"])}
        if not worst["ok"]:
            break
    counts = Counter(o.op_type for o, _ in pairs)
    return {**worst, "amplifiers": dict(counts), "compared": len(spots),
            "note": _note(worst, counts, rtol, atol)}


def judge_at_cuts(check: dict, original, optimized, runs: list, rtol: float = RTOL,
                  atol: float | None = None, unit: float = 0.0) -> dict:
    """Settle a failed output ``check`` of ``optimized`` by :func:`check_cuts`, in place.

    Where the cuts apply, ``check["rounding_cuts"]`` holds their result; where it is ok,
    ``check`` is too, its ``max_abs_err`` the cuts' and ``outputs_max_abs_err`` the
    outputs' own. Arguments as :func:`check_cuts`'s; returns ``check``.
    """
    cuts = check_cuts(original, optimized, runs, rtol, atol, unit)
    if cuts is not None and cuts["ok"]:  # the outputs' own error stays on record
        check.update(ok=True, outputs_max_abs_err=check["max_abs_err"],
                     max_abs_err=cuts["max_abs_err"])
    if cuts is not None:
        check["rounding_cuts"] = cuts
    return check


def _reference_at(runs: list, scale: float) -> list:
    """The original's outputs of the run at ``scale``."""
    return next(outputs for s, _, outputs in runs if s == scale)


def _note(result: dict, counts: Counter, rtol: float, atol: float | None) -> str:
    """The report's words for a check made at the amplifiers."""
    ops = ", ".join(f"{n} {op}" for op, n in sorted(counts.items()))
    tol = f"rtol {rtol}, atol {ATOL} x max|value|" if atol is None else \
        f"rtol {rtol}, atol {atol}"
    verdict = "agree" if result["ok"] else "do not agree"
    return (f"compared where rounding is amplified ({ops}): their inputs, and the outputs "
            f"computed from the original's {ops} results, {verdict} within the tolerance "
            f"({tol}; max abs error {result['max_abs_err']:.3g})")
