"""What a decorated function keeps for one call signature, and how a signature is read.

:class:`_Entry` is the record that the first-call pipeline
(:mod:`taso_jax.first_call`) builds for a signature and that every later call of
it reads (:mod:`taso_jax.decorator`): the traced function, the jitted stages, the
folded weights, the decision and the report. Beside it, the per-leaf helpers both sides key
a signature with: an array leaf's shape, dtype and weak type, a static leaf's value
(hashable, as ``jax.jit`` requires of static arguments), and whether a leaf is a tracer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import jax

from taso_jax.frontends.jaxpr_io import _fn_name, _is_array_leaf, _path_name, argument_names
from taso_jax.ir.graph import Graph

__all__ = ["unhashable_static"]


@dataclass
class _Entry:
    """Everything compiled for one call signature."""

    out_tree: object
    jit_original: Callable
    user_jit: Callable | None = None  # jax.jit of the function, for the first call's checks
    graph: Graph | None = None
    result: object = None
    staged: object = None
    fold: Callable | None = None
    run: Callable | None = None
    run_donating: Callable | None = None  # run, donating the inputs the user donates
    donated: tuple = ()  # positions, among run's arguments, of the inputs the user donates
    weight_slots: list = field(default_factory=list)  # per weight name: leaf index or None
    constants: dict = field(default_factory=dict)
    fallback: str | None = None
    original_kept: str | None = None  # why jax.jit of the original runs (no fallback: a choice)
    report: dict = field(default_factory=dict)
    folded_for: tuple = ()  # (weight leaves kept alive, folded values, NumPy copies)
    folded_ids: list = field(default_factory=list)  # id() of each of those weight leaves
    full_precision: bool = False  # the stages' products run at full float32 precision
    last_call: tuple | None = None  # (arguments, array leaves) of the last concrete call
    kinds: list = field(default_factory=list)  # per array leaf: "weight" or "input"
    array_index: list = field(default_factory=list)  # array leaves' positions among all leaves
    tree: object = None  # pytree structure of the (non-static) arguments
    same_object: list = field(default_factory=list)  # leaf positions of weights and statics
    input_signature: list = field(default_factory=list)  # (position, signature) of inputs
    optimize_seconds: float = 0.0
    first_call: dict = field(default_factory=dict)  # seconds per stage of the first call
    cache_hit: bool = False  # the optimized graph came from the graph cache
    all_arrays: bool = False  # every leaf of the traced arguments is an array (jax.jit-able)
    key_leaves: dict = field(default_factory=dict)  # leaf index -> PRNG impl (typed keys)
    original_warm: bool = False  # the output check compiled and ran jax.jit of the function
    # the first call's background compile and call of the original (first_call_budget.OriginalRun)
    original_run: object = None
    # seconds the search was to leave for the compile, check and comparison, when it began
    reserved_s: float | None = None
    # the first call's Outcome (taso_jax.outcome), made by the delivery pipeline
    outcome: object = None
    # the comparison the time limit left out, run on the next calls (taso_jax.call_trial)
    trial: object = None


def _is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def _leaf_signature(x) -> tuple:
    """Shape, dtype and weak type of an array leaf, cheaply (this runs on every call)."""
    if type(x) in (bool, int, float, complex):
        return (type(x),)
    return (x.shape, x.dtype, getattr(x, "weak_type", False))


def _static_key(x) -> tuple:
    """A static value's part of a signature key: its type and the value itself.

    The key is hashed and compared by value (``==``), as ``jax.jit`` compares static
    arguments.

    Raises:
        TypeError: ``x`` is not hashable (:func:`unhashable_static` says which one).
    """
    hash(x)
    return (type(x), x)


def _unhashable(x) -> bool:
    try:
        hash(x)
        return False
    except TypeError:
        return True


def unhashable_static(fn: Callable, args, static_pos) -> Exception | None:
    """The error for the first static value among ``args`` that is not hashable, or None.

    A static argument (``static_argnums``/``static_argnames``) that is not hashable gets
    the ``ValueError`` that ``jax.jit`` raises for it; a non-array leaf of another
    argument (static here, as in ``equinox.filter_jit``) gets a ``TypeError``, as
    ``jax.jit`` raises for a non-array leaf. Each names the argument (and pytree path).
    A signature keyed by such a value's identity would serve a stale result once the value
    changed in place (a NumPy array, a list).
    """
    names = argument_names(fn, len(args))
    for i, a in enumerate(args):
        if i in static_pos:
            if _unhashable(a):
                return ValueError(
                    f"{_fn_name(fn)}: Non-hashable static arguments are not supported, as in "
                    f"jax.jit: static argument {names[i]!r} is a {type(a).__name__}; pass a "
                    "hashable value (a tuple, a frozen dataclass)")
            continue
        for path, leaf in jax.tree_util.tree_flatten_with_path(a)[0]:
            if not _is_array_leaf(leaf) and _unhashable(leaf):
                return TypeError(
                    f"{_fn_name(fn)}: argument {_path_name(names[i], path)!r} is a "
                    f"{type(leaf).__name__}, neither an array nor hashable: non-array leaves "
                    "are static and must be hashable (jax.jit refuses non-array leaves)")
    return None
