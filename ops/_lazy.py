"""JAX, imported when first used rather than when the operators are declared.

Importing JAX loads XLA's shared libraries: about 145 MB resident (jax 0.11, CPU), three
times what onnxruntime needs. The command line optimizing an ONNX file for onnxruntime
(``--target onnxruntime``) never runs XLA, so the operator declarations, the graph IR and
the executor name JAX through these two helpers, and a process that never runs a graph
under JAX never pays for it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["LazyModule", "deferred"]


class LazyModule:
    """A module imported at the first use of one of its attributes.

    ``jnp = LazyModule("jax.numpy")`` at the top of a module stands for
    ``import jax.numpy as jnp``: ``jnp.add`` imports ``jax.numpy`` (once) and returns its
    ``add``. Each attribute is copied onto this object when first read, so later reads cost
    what a module attribute costs.

    Raises:
        ImportError: on first use, where the module cannot be imported.
        AttributeError: the module has no such attribute.
    """

    def __init__(self, name: str):
        self.__name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_LazyModule__"):  # not yet set (copy, pickle)
            raise AttributeError(attr)
        value = getattr(importlib.import_module(self.__name), attr)
        setattr(self, attr, value)
        return value

    def __repr__(self) -> str:
        return f"<lazy module {self.__name!r}>"


def deferred(module: str, name: str) -> Callable:
    """A function that calls ``module.name``, importing ``module`` at its first call.

    For a declaration that names a JAX function as its reference (``deferred("jax.numpy",
    "add")`` for ``jnp.add``): reading ``jnp.add`` while the operators are declared would
    import JAX.
    """
    fn = None

    def call(*args, **kwargs):
        nonlocal fn
        if fn is None:
            fn = getattr(importlib.import_module(module), name)
        return fn(*args, **kwargs)

    call.__name__ = name
    call.__qualname__ = f"{module}.{name}"
    call.__module__ = module
    return call
