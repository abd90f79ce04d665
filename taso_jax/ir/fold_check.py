"""Floating-point soundness of the weights a rewrite computes ahead of time.

A proved rule is an identity over the reals, not over floats: factoring
``abs(x) @ W1 + abs(x) @ W2`` into ``abs(x) @ (W1 + W2)`` pre-folds ``W1 + W2``, which
overflows to inf in float32 at ``W = 3e38`` (in float16 at 40000) while the original, at
small inputs, computes finite values. The same holds for every tensor a staged graph
computes once (:class:`~taso_jax.ir.executor.StagedGraph`): a concatenated kernel, a sum or
product of weights, a batchnorm folded into a kernel, a merged low-rank update, a cast.

:func:`fold_overflow` evaluates the weight-only operators that a rewrite created (those not
in the original graph) and finds the first whose inputs are all finite and whose output is
not, or whose output holds 0 or a subnormal number where the same operator on the same
inputs, computed in float64, is a normal number of the element type, or is nonzero and
lost half its value or more (``x * c * c`` folded to ``x * (c * c)`` with ``c = 1e-30`` in
float32: ``c * c`` flushes to 0, while ``x * c * c`` at ``x = 1e30`` is ``1e-30``). Such a
rewrite is refused: the search drops the candidates that hold it
(:mod:`taso_jax.search.fold_refusals`). One ``isfinite`` reduction per tensor read or made,
and a float64 evaluation of the operators whose output holds a zero or a subnormal number.
An exact zero (``W - W``, a zero bias) is no fault: its float64 value is zero too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from taso_jax.ir.graph import Graph, Node, Tensor

__all__ = ["FoldOverflow", "UNDERFLOW", "computes", "fold_overflow"]

#: :attr:`FoldOverflow.value` of an underflow.
UNDERFLOW = "0"
#: An element below the element type's smallest normal number (``np.finfo(dtype).tiny``)
#: is faulted as underflowed where its float64 value is at least this many times that
#: number (a value just at it may round below it in a sum accumulated in another order)...
UNDERFLOW_MARGIN = 2.0
#: ...or where it lost at least this part of its nonzero float64 value (``c * c`` with
#: ``c = 1e-30`` in float32: 0 for 1e-60).
UNDERFLOW_LOSS = 0.5


@dataclass(frozen=True)
class FoldOverflow:
    """A weight-only tensor that came out non-finite from finite values.

    Attributes:
        op: the operator that computed it (``ewadd``, ``ewmul``, ``cast``...).
        dtype: its element type (``float16``).
        shape: its shape.
        value: what it holds that its inputs did not: ``"inf"``, ``"-inf"`` or ``"nan"``
            (the first found, in that order), or ``"0"`` (an underflow: 0 or a subnormal
            number where the float64 value is a normal number of ``dtype``).
    """

    op: str
    dtype: str
    shape: tuple[int, ...]
    value: str

    @property
    def underflow(self) -> bool:
        """Whether the fault is an underflow (0 or subnormal) rather than an overflow."""
        return self.value == UNDERFLOW

    def __str__(self) -> str:
        if self.underflow:
            return (f"a pre-folded weight underflowed {self.dtype} (to 0 or a subnormal "
                    f"number, losing its float64 value; {self.op} {list(self.shape)})")
        return (f"a pre-folded weight overflowed {self.dtype} ({self.value}; "
                f"{self.op} {list(self.shape)}, from finite weights)")

    def to_json(self) -> dict:
        """The record as a JSON-able dict (the report's ``fold_check``)."""
        return {"ok": False, "op": self.op, "dtype": self.dtype, "shape": list(self.shape),
                "value": self.value, "why": str(self)}


def fold_overflow(graph: Graph, original: Graph | None = None,
                  weights: Mapping[str, object] | None = None) -> FoldOverflow | None:
    """The first pre-folded tensor of ``graph`` non-finite from finite inputs, or ``None``.

    Args:
        graph: the rewritten graph; its weight-only operators are what a staged run
            computes ahead of time (:class:`~taso_jax.ir.executor.StagedGraph`).
        original: the graph it was rewritten from; its operators (hash-consed, so the same
            nodes) are not checked: the original computes them too, and a mask made of
            ``-inf`` there is no fault of the rewrite. ``None``: every weight-only operator
            is checked.
        weights: weight values by name (the decorator's call, whose weights are
            arguments); default ``graph.weights``.

    Returns:
        A :class:`FoldOverflow` naming the operator, element type and value, or ``None``.
        Integer and boolean tensors are never faulted (they hold no inf or NaN). An
        operator with a non-finite input is not faulted either (the fault, if any, lies
        upstream), nor is one that copies values (:func:`computes`); values beyond the
        element type's range come out as inf in JAX, so an overflowing cast is caught as
        such. An underflow is judged against the operator
        run on its own inputs in float64 (:func:`_underflowed`), so an input already 0 or
        subnormal (a weight zeroed by
        :func:`~taso_jax.ir.cleanup.flush_negligible_weights`) is no fault of the fold.
    """
    from taso_jax.ir.executor import _is_float, fold_values

    old = original.node_set if original is not None else frozenset()
    wo = graph.weight_only
    new = [n for n in graph.nodes if n in wo and n not in old and computes(n)]
    if not new:
        return None
    needed: set[Node] = set()
    stack = list(new)
    while stack:
        n = stack.pop()
        if n not in needed:
            needed.add(n)
            stack.extend(t.node for t in n.inputs)
    ordered = [n for n in graph.nodes if n in needed]  # topological
    values = graph.weights if weights is None else weights
    env = _on_host(ordered, values)
    if env is None:
        env = fold_values([n for n in ordered if n.op == "weight"],
                          [n for n in ordered if n.op != "weight"], values)
    finite: dict[Tensor, bool] = {}

    def is_finite(t: Tensor) -> bool:
        if t not in finite:
            finite[t] = not _is_float(t.dtype) or _all_finite(env[t])
        return finite[t]

    for n in ordered:
        if n in old or not computes(n) or not all(is_finite(t) for t in n.inputs):
            continue
        for t in n.outputs:
            if not is_finite(t):
                return FoldOverflow(n.op, t.dtype, t.shape, _what(env[t]))
        if _underflowed(n, env):
            t = next(t for t in n.outputs if _is_float(t.dtype))
            return FoldOverflow(n.op, t.dtype, t.shape, UNDERFLOW)
    return None


def computes(node: Node) -> bool:
    """Whether ``node``, folded ahead of time, may round, overflow or underflow.

    Any operator but a weight and those that copy values (``OpDef.copies_values``: a
    concatenation, a merged grouped kernel, a transpose, a zero padding).
    """
    from taso_jax.ops import OPS

    op = OPS.get(node.op)
    return node.op != "weight" and not (op is not None and op.copies_values)


def _on_host(ordered: list[Node], values: Mapping) -> dict | None:
    """The values of ``ordered`` (weights, then operators on them) computed in NumPy.

    ``None`` where an operator has no NumPy form (``OpDef.numpy_ref``): JAX computes them
    then (:func:`~taso_jax.ir.executor.fold_values`). The search asks this of every rewrite
    that folds (:class:`~taso_jax.search.fold_refusals.FoldGate`): a batchnorm folded into
    each kernel of a ResNet-50 is an ``ewmul`` of a new shape each, and JAX compiled one
    executable for each (53 of them, 2 s of a 2 s search).
    """
    from taso_jax.ops import OPS

    refs = {}
    for n in ordered:
        op = OPS.get(n.op)
        if n.op != "weight" and (op is None or op.numpy_ref is None):
            return None
        refs[n] = None if n.op == "weight" else op.numpy_ref
    env: dict[Tensor, object] = {}
    with np.errstate(all="ignore"):  # what overflows is the finding, not a warning
        for n in ordered:
            if refs[n] is None:
                env[n.outputs[0]] = np.asarray(values[n.name])
                continue
            out = refs[n](*(env[t] for t in n.inputs), **dict(n.attrs))
            outs = tuple(out) if isinstance(out, tuple | list) else (out,)
            env.update(zip(n.outputs, (np.asarray(o) for o in outs), strict=True))
    return env


def _underflowed(node: Node, env: Mapping) -> bool:
    """Whether an output of ``node`` is 0 or subnormal where its float64 value is normal.

    The float64 value is ``node``'s operator on its own inputs (``env``'s values) widened
    to float64 (a ``cast`` is judged by its input's value). An element whose magnitude is
    below the smallest normal number of the output's type is faulted where that value is
    at least :data:`UNDERFLOW_MARGIN` times it, or is nonzero and the element lost
    :data:`UNDERFLOW_LOSS` of it or more, and only where that value is at least the type's
    epsilon times the tensor's largest: an element lost beside much larger ones changes
    no dot product it enters by more than its rounding (a float16 kernel element of 1e-6
    times a batchnorm scale of 0.02 is 0, beside elements near 0.02), as
    :func:`~taso_jax.ir.cleanup.flush_negligible_weights` holds too. Only run where some
    output element is that small; an operator that cannot run in float64 is not faulted.
    """
    import jax.numpy as jnp

    from taso_jax.ir.executor import _is_float

    outs = [(i, t) for i, t in enumerate(node.outputs) if _is_float(t.dtype)]
    small = {}
    for i, t in outs:
        info = jnp.finfo(t.dtype)
        tiny = float(info.tiny)
        got = np.abs(np.asarray(env[t]).astype(np.float64))
        if (got < tiny).any():
            small[i] = (got, tiny, float(info.eps))
    if not small:
        return False
    try:
        wide = _in_float64(node, [env[t] for t in node.inputs])
    except Exception:  # noqa: BLE001 -- an operator with no float64 form: not judged
        return False
    for i, (got, tiny, eps) in small.items():
        ref = np.abs(np.asarray(wide[i], np.float64))
        if ref.shape != got.shape:
            continue
        peak = float(ref[np.isfinite(ref)].max(initial=0.0))
        under = (got < tiny) & (ref >= eps * peak)
        normal = ref >= UNDERFLOW_MARGIN * tiny
        with np.errstate(divide="ignore", invalid="ignore"):
            lost = (ref > 0) & (np.abs(ref - got) >= UNDERFLOW_LOSS * ref)
        if (under & (normal | lost)).any():
            return True
    return False


def _in_float64(node: Node, args) -> tuple:
    """``node``'s outputs from ``args`` widened to float64 (a ``cast``: its input, widened)."""
    import jax

    from taso_jax.ir.executor import _is_float, run_node
    from taso_jax.ops import OPS

    wide = [np.asarray(a).astype(np.float64) if _is_float(np.asarray(a).dtype)
            else np.asarray(a) for a in args]
    if node.op == "cast":
        return (wide[0],)
    ref = getattr(OPS.get(node.op), "numpy_ref", None)
    if ref is not None:
        with np.errstate(all="ignore"):
            out = ref(*wide, **dict(node.attrs))
        return tuple(np.asarray(o, np.float64) for o in (out if isinstance(out, tuple | list)
                                                          else (out,)))
    with jax.enable_x64(True):
        return tuple(np.asarray(v, np.float64) for v in run_node(node, wide))


def _all_finite(value) -> bool:
    """Whether every element of ``value`` is finite, counted on the host (NumPy).

    A reduction per tensor in JAX compiled one executable per shape: 2.3 s of a 3.4 s
    check of a rewritten PP-OCRv4 recognizer's 95 folded tensors (2026-11-29, XLA:CPU).
    """
    return bool(np.isfinite(np.asarray(value)).all())


def _what(value) -> str:
    """Which non-finite value ``value`` holds: ``inf``, ``-inf`` or ``nan``."""
    import jax.numpy as jnp

    if bool(jnp.any(jnp.isposinf(value))):
        return "inf"
    if bool(jnp.any(jnp.isneginf(value))):
        return "-inf"
    return "nan"
