"""taso_jax: a tensor algebra superoptimizer for JAX/XLA.

Generated and verified graph substitutions, a cost-based backtracking search, and ONNX and
JAX front doors (TASO, Jia et al., SOSP 2019, reimplemented for XLA). Typical use::

    import taso_jax, onnx
    g = taso_jax.load_onnx("model.onnx")
    g2 = taso_jax.optimize(g)                       # g is unchanged
    onnx.save(taso_jax.export_onnx(g2), "model.opt.onnx")

    @taso_jax.optimize(weight_argnums=0)            # a JAX function, used like jax.jit
    def model(params, x): ...

This module only re-exports, each name at its first use; the layers are ``taso_jax.ops``
(operator declarations), ``taso_jax.ir`` (graph IR and executor), ``taso_jax.verify``
(generation and proofs), ``taso_jax.search`` (rules, matching, search, cost models),
``taso_jax.frontends`` (ONNX and jaxpr import and export, onnxruntime), the delivery
pipeline (``taso_jax.pipeline``, ``optimizer``, ``targets``, ``checks``, ``outcome``,
``report``), and the front doors (``taso_jax.api``, ``taso_jax.decorator``, the command
line ``taso_jax.cli``).
"""

from __future__ import annotations

# Where each public name lives. They are imported on first use (PEP 562), so that
# ``import taso_jax`` does not load JAX (about 145 MB) in a process that never runs XLA:
# the command line optimizing an ONNX file for onnxruntime.
_EXPORTS = {
    "optimize": "taso_jax.api", "search_graph": "taso_jax.api",
    "from_jax": "taso_jax.frontends.jaxpr_io",
    "ModelError": "taso_jax.frontends.onnx_io", "export_onnx": "taso_jax.frontends.onnx_io",
    "load_onnx": "taso_jax.frontends.onnx_io",
    "compile_graph": "taso_jax.ir.executor", "random_inputs": "taso_jax.ir.executor",
    "Graph": "taso_jax.ir.graph", "GraphBuilder": "taso_jax.ir.graph",
    "GraphError": "taso_jax.ir.graph", "Node": "taso_jax.ir.graph",
    "Tensor": "taso_jax.ir.graph", "new_graph": "taso_jax.ir.graph",
    "OPS": "taso_jax.ops", "ShapeError": "taso_jax.ops",
    "OptimizeOptions": "taso_jax.search.options",
    "Substitution": "taso_jax.search.rules",
    "default_substitutions": "taso_jax.search.rules",
    "load_substitutions": "taso_jax.search.rules",
    "save_substitutions": "taso_jax.search.rules",
}

__all__ = ["Graph", "GraphBuilder", "GraphError", "Node", "Tensor", "new_graph", "OPS",
           "ShapeError", "ModelError", "load_onnx", "export_onnx", "compile_graph",
           "random_inputs", "Substitution", "default_substitutions", "load_substitutions",
           "save_substitutions", "optimize", "search_graph", "OptimizeOptions", "from_jax"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'taso_jax' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__version__ = "0.1.0"
