"""``taso_jax.optimize``: one entry point for graphs and for JAX functions."""

from __future__ import annotations

from taso_jax.decorator import optimize_function
from taso_jax.ir.graph import Graph, GraphBuilder
from taso_jax.optimizer import Optimizer
from taso_jax.search import options as _options

__all__ = ["optimize", "search_graph"]

#: Keywords of :func:`search_graph` and :func:`optimize` on a graph besides the options.
_RUN_KEYWORDS = ("check", "rtol", "atol")


def search_graph(graph, options: _options.OptimizeOptions | None = None, *, progress=None,
                 **changes):
    """Optimize ``graph`` with statistics: :meth:`taso_jax.optimizer.Optimizer.run`.

    Args:
        graph: a :class:`~taso_jax.ir.graph.Graph` (unchanged), or a
            :class:`~taso_jax.ir.graph.GraphBuilder` (its unused tensors are the outputs).
        options: the settings (:class:`~taso_jax.search.options.OptimizeOptions`).
        progress: ``progress(iterations, best cost in microseconds)`` after each expansion.
        **changes: settings that override ``options`` (``budget=30``, ``end_to_end=0``...),
            and ``check`` (default ``True``: a rewritten graph is compared with the input
            under ``jax.jit`` at two input scales, and at two more for non-finite values
            (:func:`~taso_jax.checks.range_scales`), and the input is returned, with a
            ``RuntimeWarning``, where they differ or a weight computed ahead of time
            overflows), ``rtol``, ``atol`` (its tolerances,
            at most :data:`~taso_jax.checks.MAX_RTOL` and :data:`~taso_jax.checks.MAX_ATOL`).

    A rule file named by ``substitutions`` is proved again unless ``trust_proofs=True``
    (:func:`taso_jax.verify.runner.load_proved_rules`), within half the time limit: the
    rules not proved by then are left out, and the next call goes on with their proofs.
    With ``target="onnxruntime"`` kernels and candidates are timed in onnxruntime against
    the input graph's own export.

    Returns:
        The :class:`~taso_jax.search.backtracking.SearchResult`; its ``graph`` is the graph
        delivered (the input where nothing faster was confirmed or the check failed),
        ``outcome`` the :class:`~taso_jax.outcome.Outcome`, ``rules`` the rule counts and
        ``end_to_end`` what was timed.

    Raises:
        ValueError: a setting out of range (a tolerance above its ceiling too), or a rule
            file that is not one.
        TypeError: an unknown setting.
    """
    from taso_jax.search.limits import Deadline

    run = {k: changes.pop(k) for k in _RUN_KEYWORDS if k in changes}
    opts = (options or _options.OptimizeOptions()).replace(**changes)
    # one deadline for a rule file's proofs and the search
    deadline = Deadline.start(opts.time_limit)
    outcome = Optimizer(opts, deadline=deadline).run(graph, progress=progress,
                                                     deadline=deadline, **run)
    result = outcome.result
    result.graph, result.outcome = outcome.graph, outcome
    return result


def optimize(graph=None, **options):
    """Optimize a graph, or make a JAX function faster (a decorator used like ``jax.jit``).

    On a :class:`~taso_jax.ir.graph.Graph` (or a ``GraphBuilder``): return the fastest
    equivalent graph found (TASO's ``taso.optimize``), checked against the input under
    ``jax.jit`` (:func:`search_graph`; ``check=False`` skips that). The options are those of
    :class:`~taso_jax.search.options.OptimizeOptions` (``alpha=1.05, budget=100,
    time_limit=60.0, cost_model="calibrated", substitutions=None, allow_unverified=False,
    end_to_end=4, trust_proofs=False, target="xla", layout_candidates=True``). The input
    graph is never modified, and it is returned as is when nothing is faster.

    On a function, or with keyword options only, it is a decorator::

        @taso_jax.optimize(weight_argnums=0)
        def model(params, x): ...

    The decorator takes the same options plus ``weight_argnums`` / ``weight_argnames``
    (arguments whose array leaves are weights: weight-only subgraphs are computed once per
    distinct weight arrays), ``static_argnums`` / ``static_argnames`` and ``check`` (compare
    with ``jax.jit`` of the original at the first call of each signature; a graph read from
    the graph cache is checked on its first use in each process, and ``check="always"``
    checks it every time); see
    :class:`~taso_jax.decorator.OptimizedFunction`, ``mode="background"``
    (first calls run ``jax.jit`` of the original while the optimization runs in a thread),
    and ``settle_on_calls`` (default ``True``: where the time limit left the comparison with
    ``jax.jit`` out, the next calls run the two in turn until a paired test decides,
    :mod:`taso_jax.call_trial`).
    Its search time limit defaults to 10 s, and optimized graphs are kept in a cache on
    disk, so that another process skips the search (:mod:`taso_jax.frontends.graph_cache`).

    Raises:
        ValueError: an option out of range, or (functions) a ``weight_argnames`` /
            ``static_argnames`` entry that is not a parameter; at a call, an unhashable
            static argument (as ``jax.jit``: static values are hashed and compared by value).
        TypeError: an unknown option; at a call, an unhashable non-array leaf.
    """
    if isinstance(graph, Graph | GraphBuilder):
        return search_graph(graph, **options).graph
    return optimize_function(graph, **options)
