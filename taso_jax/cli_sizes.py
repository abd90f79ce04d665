"""Where the written ONNX file keeps the input's open sizes: checked at other sizes.

A model is optimized at one binding of its symbolic sizes; :func:`_keep_sizes_open`
decides whether its written form keeps them open (checked against the original at other
sizes), is written at the bound sizes, or is not written at all.
"""

from __future__ import annotations

from taso_jax._text import one_line
from taso_jax.cli_files import _parse_shapes

__all__ = ["_keep_sizes_open", "differ_note"]


def differ_note(check: dict) -> str:
    """The report's note where the output check failed and the input is written back.

    At a scale of :func:`~taso_jax.checks.range_scales` only the ends of the number range
    are compared (:func:`~taso_jax.checks.compare_nonfinite`): a failure there names the
    scale and what differed, since sums taken in another order can overflow or cancel
    differently at inputs that large; elsewhere it is a fault to report.
    """
    scale = check.get("failed_scale")
    if check.get("nonfinite_only") and scale is not None:
        what = ", ".join(f"{n} {k}" for k, n in sorted(check.get("nonfinite", {}).items()))
        return (f"the optimized model's outputs differ from the original's at the end of the "
                f"number range only (inputs x{scale:.3g}: {what or 'a size'}), where sums "
                f"taken in another order overflow or cancel differently: the input is "
                f"written back unchanged")
    return ("the optimized model's outputs differ from the original's (a fault in a "
            "rewrite or in taso_jax, please report it): the input is written back unchanged")


def _keep_sizes_open(data: bytes, general: bytes, original: str, graph, report: dict, args):
    """The serialized model to write: ``general``, ``data`` or ``None``.

    ``general`` is the optimized model with the input's open sizes open again, ``data`` the
    same at the sizes it was optimized at.

    The model was optimized at one binding of its symbolic sizes; written with them open,
    it is checked against the original at other sizes
    (:func:`taso_jax.checks.check_other_sizes`; where rounding is amplified, at the
    amplifiers, :func:`~taso_jax.rounding_cuts.judge_at_cuts`). Where that fails (a
    rewritten Reshape holds a fixed size), the model is written at the sizes it was
    optimized at if the user fixed them (``--input-shape`` for every input with open
    sizes), or if the original itself runs at none of the other sizes tried. Otherwise it
    returns ``None``: a model that accepts fewer sizes than the input is no drop-in
    replacement, and the input is kept.
    """
    from taso_jax.checks import check_other_sizes, rounding_unit
    from taso_jax.rounding_cuts import judge_at_cuts

    def judge(check, original, optimized, runs):  # where the model amplifies rounding
        judge_at_cuts(check, original, optimized, runs, args.rtol, args.atol,
                      rounding_unit(graph))

    symbolic = graph.meta["symbolic_dims"]
    other = check_other_sizes(original, general, graph, symbolic, rtol=args.rtol,
                              atol=args.atol, judge=judge)
    report["other_sizes"] = other
    if other["ok"]:
        shapes = ", ".join(f"{k}={','.join(map(str, v))}" for k, v in other["shapes"].items())
        report["notes"].append(f"symbolic sizes kept open in the written model; it matches "
                               f"the original at other sizes too ({shapes})")
        return general
    if other["ok"] is None:
        why = "the original runs at none of the other sizes tried"
    else:
        shapes = ", ".join(f"{k}={','.join(map(str, v))}" for k, v in other["shapes"].items())
        why = (f"with them open it does not match the original at {shapes}"
               + (f" ({one_line(other['error'], 240)})" if other.get("error") else ""))
        given = _parse_shapes(args.input_shape)
        if not all(name in given for name in symbolic
                   if name in {n.name for n in graph.inputs}):
            bound = ", ".join(f"{n.name}={','.join(map(str, n.types[0].shape))}"
                              for n in graph.inputs if n.name in symbolic)
            report["notes"].append(
                f"kept the input: the optimized graph holds the sizes it was optimized at "
                f"({bound}); {why}. To get it for fixed sizes, give them with --input-shape")
            return None
    report["notes"].append("written with the sizes it was optimized at, not symbolic: "
                           + why)
    return data
