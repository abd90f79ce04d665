"""Targets: the runtimes a result must be fast in, registered by name.

A target is whatever :class:`Target` describes: a name (the ``target`` option's value), the
runtime it stands for, its cost model, its end-to-end choice, the report's own timing in
that runtime, how a written ONNX file folds its weight-only work, and what "speed-up"
means there. Nothing outside this package compares target names: the front doors ask the
registry (:func:`make_target`) and read the target's answers, as JAX's interpreters read
the rule a platform registered for a primitive.

The built-in targets are registered lazily, each by its module (:data:`BUILTIN`): the XLA
target never imports onnxruntime, and the onnxruntime target never imports JAX. Adding a
runtime is one module that defines its target and calls :func:`register_target`, plus its
line in :data:`BUILTIN` (or, outside the package, an import of that module);
docs/design.md, "Adding a target", shows one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from taso_jax.search import options as _options

__all__ = ["Target", "TargetSpeed", "register_target", "make_target", "target_names",
           "describe", "BUILTIN"]


@runtime_checkable
class Target(Protocol):
    """What the optimizing pipeline asks of a runtime it delivers for.

    Attributes:
        name: the ``target`` option's value (``"xla"``).
        runtime: the runtime in words, for the report (``"jax.jit"``).
        timing_key: the report entry that holds the report's own timing in that runtime
            (``"time"``, ``"onnxruntime"``): the speed-up a rewrite is said to deliver is its
            ``speedup`` (:attr:`~taso_jax.outcome.Outcome.speedup`).
        baseline: what candidates are timed against, in words (``"the input graph"``).
        times_graphs: whether the report times the input and optimized graphs in this
            runtime (:meth:`time_graphs`); otherwise it times the written files.
        second_opinions: whether the searches that second-guess a measured cost model run.
        serves_functions: whether ``@taso_jax.optimize`` on a JAX function may use it.
        runs_imported_file: whether a written ONNX file is run by importing it back (then a
            file that imports with operators kept opaque is not delivered).
        warns_in_onnxruntime: whether the report warns where the written file runs slower
            in onnxruntime (a runtime the target did not time its choice in).
        replaces_cost_model: whether the options' named cost model is replaced by the
            target's own instance for the whole pipeline.
    """

    name: str
    runtime: str
    timing_key: str
    baseline: str
    times_graphs: bool
    second_opinions: bool
    serves_functions: bool
    runs_imported_file: bool
    warns_in_onnxruntime: bool
    replaces_cost_model: bool

    def cost_model(self, options: _options.OptimizeOptions):
        """The cost model the search prices graphs with, for ``options``."""

    def chooser(self, options: _options.OptimizeOptions) -> Callable | None:
        """The end-to-end choice ``chooser(result, deadline=None) -> dict``, or ``None``.

        ``None`` is the pipeline's default (:func:`~taso_jax.search.choose.choose_fastest`).
        """

    def export_fold(self) -> Any:
        """Who computes a written file's weight-only subgraphs.

        The ``fold`` argument of :func:`~taso_jax.frontends.onnx_io.export_onnx`.
        """

    def time_graphs(self, before, after, repeats: int, deadline: float | None) -> dict:
        """The report's own timing of two graphs in this runtime, microseconds.

        ``{"before_us", "after_us", "speedup", "repeats", ...}``; called only where
        :attr:`times_graphs`.
        """


class TargetSpeed:
    """Defaults that a target class may inherit: an XLA-like runtime's answers."""

    baseline = "the input graph"
    times_graphs = False
    second_opinions = True
    serves_functions = False
    runs_imported_file = False
    warns_in_onnxruntime = False
    replaces_cost_model = True

    def export_fold(self):
        """Weight-only subgraphs computed by JAX at export."""
        return True

    def time_graphs(self, before, after, repeats: int, deadline: float | None) -> dict:
        """Not called: :attr:`times_graphs` is false."""
        raise NotImplementedError(f"target {self.name!r} times the written files")


#: The built-in targets, by name: the module that registers each (imported when needed).
BUILTIN = {
    "xla": "taso_jax.targets.xla",
    "onnxruntime": "taso_jax.targets.onnxruntime",
}

_FACTORIES: dict[str, Callable[..., Target]] = {}


def register_target(name: str, factory: Callable[..., Target], *,
                    replace: bool = False) -> None:
    """Register ``factory`` (a target class, or any callable) as target ``name``.

    ``factory(**context)`` makes the target; ``context`` holds what a front door knows
    (``original``: the user's ONNX file, ``inputs``: feeds for it, ``opset``, ``cache``:
    whether measured costs are cached on disk), and a factory takes what it needs and
    ignores the rest. The name becomes a valid ``target`` option
    (:data:`~taso_jax.search.options.TARGETS`, also the command line's ``--target``
    choices).

    Raises:
        ValueError: ``name`` is registered already (unless ``replace``).
    """
    if name in _FACTORIES and not replace and _FACTORIES[name] is not factory:
        raise ValueError(f"target {name!r} is registered already")
    _FACTORIES[name] = factory
    if name not in _options.TARGETS:
        # the options validate against this tuple; it grows with the registry
        _options.TARGETS = (*_options.TARGETS, name)


def _factory(name: str) -> Callable[..., Target]:
    if name not in _FACTORIES and name in BUILTIN:
        importlib.import_module(BUILTIN[name])
    try:
        return _FACTORIES[name]
    except KeyError:
        raise ValueError(f"target must be one of {target_names()}, got {name!r}") from None


def make_target(name: str, **context) -> Target:
    """The target registered as ``name``, made with ``context`` (:func:`register_target`).

    Raises:
        ValueError: no target of that name.
    """
    return _factory(name)(**context)


def describe(name: str) -> Target:
    """Target ``name`` made with no context: for its descriptive attributes only."""
    return make_target(name)


def target_names() -> tuple[str, ...]:
    """The names of the registered and built-in targets."""
    return tuple(dict.fromkeys((*BUILTIN, *_FACTORIES)))
