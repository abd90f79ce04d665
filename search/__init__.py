"""Optimizer: cost models and TASO's cost-based backtracking search."""

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
