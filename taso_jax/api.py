"""``taso_jax.optimize``: one entry point for graphs and for JAX functions."""

from __future__ import annotations

from taso_jax.frontends.decorator import optimize_function
from taso_jax.frontends.onnxruntime_target import resolve_target
from taso_jax.ir.graph import Graph, GraphBuilder
from taso_jax.search import options as _options
from taso_jax.verify.runner import rules_for

__all__ = ["optimize", "search_graph"]


def search_graph(graph, options: _options.OptimizeOptions | None = None, *, progress=None,
                 **changes):
    """:func:`taso_jax.search.options.search_graph`, with a rule file's proofs checked.

    A ``substitutions`` rule file path is read with
    :func:`taso_jax.verify.runner.load_proved_rules`: its rules are proved again unless
    ``trust_proofs=True``. Arguments, result and errors are those of
    :func:`taso_jax.search.options.search_graph`. With ``target="onnxruntime"`` kernels and
    candidates are timed in onnxruntime against the input graph's own export
    (:func:`taso_jax.frontends.onnxruntime_target.resolve_target`).
    """
    opts = (options or _options.OptimizeOptions()).replace(**changes)
    opts, chooser = resolve_target(opts)
    return _options.search_graph(graph, opts, progress=progress, chooser=chooser,
                                 substitutions=rules_for(opts))


def optimize(graph=None, **options):
    """Optimize a graph, or make a JAX function faster (a decorator used like ``jax.jit``).

    On a :class:`~taso_jax.ir.graph.Graph` (or a ``GraphBuilder``): return the fastest
    equivalent graph found (TASO's ``taso.optimize``). The options are those of
    :class:`~taso_jax.search.options.OptimizeOptions` (``alpha=1.05, budget=100,
    time_limit=60.0, cost_model="measured", substitutions=None, allow_unverified=False,
    end_to_end=4, trust_proofs=False, target="xla", layout_candidates=True``). The input
    graph is never modified, and it is returned as is when nothing is faster.

    On a function, or with keyword options only, it is a decorator::

        @taso_jax.optimize(weight_argnums=0)
        def model(params, x): ...

    The decorator takes the same options plus ``weight_argnums`` / ``weight_argnames``
    (arguments whose array leaves are weights: weight-only subgraphs are computed once per
    distinct weight arrays), ``static_argnums`` / ``static_argnames`` and ``check`` (compare
    with ``jax.jit`` of the original at the first call of each signature; a graph read from
    the graph cache was checked by the process that stored it, and ``check="always"``
    checks it again); see
    :class:`~taso_jax.frontends.decorator.OptimizedFunction`, and ``mode="background"``
    (first calls run ``jax.jit`` of the original while the optimization runs in a thread).
    Its search time limit defaults to 10 s, and optimized graphs are kept in a cache on
    disk, so that another process skips the search (:mod:`taso_jax.frontends.graph_cache`).

    Raises:
        ValueError: an option out of range, or (functions) a ``weight_argnames`` /
            ``static_argnames`` entry that is not a parameter.
        TypeError: an unknown option.
    """
    if isinstance(graph, Graph | GraphBuilder):
        return search_graph(graph, **options).graph
    return optimize_function(graph, **options)
