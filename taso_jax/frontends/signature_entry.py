"""What a decorated function keeps for one call signature, and how a signature is read.

:class:`_Entry` is the record that the first-call pipeline
(:mod:`taso_jax.first_call`) builds for a signature and that every later call of
it reads (:mod:`taso_jax.decorator`): the traced function, the jitted stages, the
folded weights, the decision and the report. Beside it, the per-leaf helpers both sides key
a signature with: an array leaf's shape, dtype and weak type, a static leaf's value (or
identity when unhashable), and whether a leaf is a tracer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import jax

from taso_jax.ir.graph import Graph

__all__: list[str] = []


@dataclass
class _Entry:
    """Everything compiled for one call signature."""

    out_tree: object
    jit_original: Callable
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
    # the first call's background compile and calls of the original (first_call._OriginalRun)
    original_run: object = None


def _is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def _leaf_signature(x) -> tuple:
    """Shape, dtype and weak type of an array leaf, cheaply (this runs on every call)."""
    if type(x) in (bool, int, float, complex):
        return (type(x),)
    return (x.shape, x.dtype, getattr(x, "weak_type", False))


def _hashable(x) -> bool:
    try:
        hash(x)
        return True
    except TypeError:
        return False


def _static_key(x):
    try:
        hash(x)
        return ("v", type(x), x)
    except TypeError:
        return ("id", id(x))
