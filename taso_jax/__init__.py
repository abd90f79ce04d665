"""taso_jax: a tensor algebra superoptimizer for JAX/XLA.

Generated graph substitutions, a cost-based backtracking search, and ONNX/JAX front doors
(TASO, Jia et al., SOSP 2019, reimplemented for XLA). Typical use::

    import taso_jax, onnx
    g = taso_jax.load_onnx("model.onnx")
    g2 = taso_jax.optimize(g)                       # g is unchanged
    onnx.save(taso_jax.export_onnx(g2), "model.opt.onnx")

    @taso_jax.optimize(weight_argnums=0)            # a JAX function, used like jax.jit
    def model(params, x): ...
"""

from __future__ import annotations

from taso_jax.executor import compile_graph, random_inputs
from taso_jax.graph import Graph, GraphBuilder, GraphError, Node, Tensor, new_graph
from taso_jax.jaxpr_io import from_jax
from taso_jax.onnx_io import ModelError, export_onnx, load_onnx
from taso_jax.ops import OPS, ShapeError
from taso_jax.substitution import (
    Substitution,
    default_substitutions,
    load_substitutions,
    save_substitutions,
)

__all__ = ["Graph", "GraphBuilder", "GraphError", "Node", "Tensor", "new_graph", "OPS",
           "ShapeError", "ModelError", "load_onnx", "export_onnx", "compile_graph",
           "random_inputs", "Substitution", "default_substitutions", "load_substitutions",
           "save_substitutions", "optimize", "search_graph", "from_jax"]

__version__ = "0.1.0"


def search_graph(graph, alpha: float = 1.05, budget: int = 300, time_limit: float = 60.0,
                 cost_model="measured", substitutions=None, progress=None,
                 allow_unverified: bool = False, end_to_end: int = 0):
    """Run the backtracking search and return a :class:`taso_jax.search.SearchResult`.

    Args:
        graph: a :class:`Graph` or a :class:`GraphBuilder` (its unused tensors become
            outputs, as in TASO).
        alpha: relaxation factor (TASO's default 1.05).
        budget: maximum graphs expanded.
        time_limit: maximum seconds for the whole search.
        cost_model: ``"measured"`` (kernels timed on the current JAX device, cached),
            ``"analytic"`` (FLOPs and bytes), or a :class:`taso_jax.search.CostModel`.
        substitutions: list of :class:`Substitution`; defaults to the shipped set.
        progress: ``progress(iterations, best_cost)`` callback.
        allow_unverified: also use substitutions that the verifier has not proved (TASO,
            SOSP 2019, Section 4: only verified substitutions are sound to apply). By
            default they are left out, with a ``UserWarning`` saying how many; the result's
            ``rules`` records what was used either way.
        end_to_end: when > 0, the search keeps this many of its cheapest graphs, times them
            and the input under ``jax.jit`` on the current device, and returns the fastest,
            or the input when none is faster (:func:`taso_jax.bench.choose_fastest`);
            ``result.end_to_end`` records the times.

    Raises:
        ValueError: bad ``alpha``, ``budget`` or ``cost_model``.
    """
    from taso_jax.search import backtracking_search, get_cost_model

    if isinstance(graph, GraphBuilder):
        graph = graph.graph()
    if isinstance(cost_model, str):
        cost_model = get_cost_model(cost_model)
    subs = default_substitutions() if substitutions is None else list(substitutions)
    proved = [s for s in subs if s.proof_status == "proved"]
    unproved = len(subs) - len(proved)
    if unproved and not allow_unverified:
        import warnings

        warnings.warn(f"{unproved} of {len(subs)} substitutions are not proved and are not "
                      "used (run `taso-jax verify` on them, or pass allow_unverified=True / "
                      "--allow-unverified to use them anyway)", UserWarning, stacklevel=2)
        subs = proved
    result = backtracking_search(graph, subs, cost_model, alpha=alpha, budget=budget,
                                 time_limit=time_limit, progress=progress,
                                 keep=max(1, end_to_end))
    if end_to_end > 0 and len(result.candidates) > 1:
        from taso_jax.bench import choose_fastest

        result.end_to_end = choose_fastest(result)
    result.rules = {"used": len(subs), "proved": len(proved),
                    "unverified_used": unproved if allow_unverified else 0,
                    "unverified_left_out": 0 if allow_unverified else unproved}
    return result


def optimize(graph=None, **options):
    """Optimize a graph, or make a JAX function faster (decorator).

    On a :class:`Graph` (or :class:`GraphBuilder`): return the cheapest equivalent graph
    found (TASO's ``taso.optimize``); options are those of :func:`search_graph`
    (``alpha=1.05, budget=300, time_limit=60.0, cost_model="measured", substitutions=None,
    allow_unverified=False``).
    The input graph is never modified, and it is returned as is when nothing is cheaper.

    On a function, or with keyword options only, it is a decorator used like ``jax.jit``::

        @taso_jax.optimize(weight_argnums=0)
        def model(params, x): ...

    Decorator options: ``weight_argnums`` / ``weight_argnames`` (arguments whose array
    leaves are weights: weight-only subgraphs are computed once per distinct weight arrays),
    ``static_argnums`` / ``static_argnames`` (hashable arguments that are not traced),
    ``alpha``, ``budget`` (default 100), ``time_limit`` (default 60 s), ``cost_model``,
    ``substitutions`` (a list or a rule file path), ``allow_unverified`` (also use rules
    that are not proved), ``end_to_end`` (default 4: time the search's 4 cheapest graphs
    and the original under ``jax.jit`` on the device at the first call of each signature
    and run the fastest, so the result is never slower than the original beyond noise;
    0 trusts the cost model) and ``check`` (compare with ``jax.jit``
    of the original on the first call of each signature). Non-array pytree leaves are
    static. See :class:`taso_jax.decorator.OptimizedFunction` (``report()``,
    ``optimized_graph``, ``runtime_jaxpr()``).

    Raises:
        ValueError: bad ``alpha``/``budget``/``cost_model`` (graphs), or a
            ``weight_argnames``/``static_argnames`` entry that is not a parameter (functions;
            positions are checked at the first call).
    """
    if isinstance(graph, Graph | GraphBuilder):
        return search_graph(graph, **options).graph
    from taso_jax.decorator import optimize_function

    return optimize_function(graph, **options)
