"""taso_jax: a tensor algebra superoptimizer for JAX/XLA.

Generated and verified graph substitutions, a cost-based backtracking search, and ONNX and
JAX front doors (TASO, Jia et al., SOSP 2019, reimplemented for XLA). Typical use::

    import taso_jax, onnx
    g = taso_jax.load_onnx("model.onnx")
    g2 = taso_jax.optimize(g)                       # g is unchanged
    onnx.save(taso_jax.export_onnx(g2), "model.opt.onnx")

    @taso_jax.optimize(weight_argnums=0)            # a JAX function, used like jax.jit
    def model(params, x): ...

This module only re-exports; the layers are ``taso_jax.ops`` (operator declarations),
``taso_jax.ir`` (graph IR and executor), ``taso_jax.verify`` (generation and proofs),
``taso_jax.search`` (rules, matching, search, cost models), ``taso_jax.frontends`` (ONNX,
jaxpr, decorator) and the command line ``taso_jax.cli``.
"""

from __future__ import annotations

from taso_jax.api import optimize, search_graph
from taso_jax.frontends.jaxpr_io import from_jax
from taso_jax.frontends.onnx_io import ModelError, export_onnx, load_onnx
from taso_jax.ir.executor import compile_graph, random_inputs
from taso_jax.ir.graph import Graph, GraphBuilder, GraphError, Node, Tensor, new_graph
from taso_jax.ops import OPS, ShapeError
from taso_jax.search.options import OptimizeOptions
from taso_jax.search.rules import (
    Substitution,
    default_substitutions,
    load_substitutions,
    save_substitutions,
)

__all__ = ["Graph", "GraphBuilder", "GraphError", "Node", "Tensor", "new_graph", "OPS",
           "ShapeError", "ModelError", "load_onnx", "export_onnx", "compile_graph",
           "random_inputs", "Substitution", "default_substitutions", "load_substitutions",
           "save_substitutions", "optimize", "search_graph", "OptimizeOptions", "from_jax"]

__version__ = "0.1.0"
