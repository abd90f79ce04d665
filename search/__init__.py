"""Optimizer: rules, matching, TASO's backtracking search, cost models, end-to-end choice.

* :mod:`.pattern`: the pattern language (references, size expressions, attribute variables),
  parsed once into frozen values;
* :mod:`.rules`: the :class:`~.rules.Substitution` record and rule files;
* :mod:`.match`: matching a rule in a graph (:class:`~.match.Match`, falsy
  :class:`~.match.NoMatch` with a reason) and building its target;
* :mod:`.backtracking`: the cost-based backtracking search (TASO, SOSP 2019, Algorithm 2);
* :mod:`.descent`: the greedy descent that runs before it (pairs and chains of rewrites);
* :mod:`.second_opinions`: extra searches whose graphs second-guess the cost model;
* :mod:`.cost`: analytic and measured cost models;
* :mod:`.choose`: timing the cheapest candidates end to end;
* :mod:`.options`: :class:`~.options.OptimizeOptions` and :func:`~.options.search_graph`.
"""

from taso_jax.search.backtracking import SearchResult, backtracking_search
from taso_jax.search.cost import (
    AnalyticCostModel,
    CostModel,
    MeasuredCostModel,
    get_cost_model,
    graph_cost,
)

__all__ = ["SearchResult", "backtracking_search", "AnalyticCostModel", "CostModel",
           "MeasuredCostModel", "get_cost_model", "graph_cost"]
