"""Cost models: the cost of a graph is the sum of its runtime operators' costs.

Weight-only nodes cost nothing: they are computed once, ahead of time (TASO, Jia et al.,
SOSP 2019, Section 5.1). Input, weight and opaque nodes are priced like the rest: an opaque
node is identical in every candidate graph, so it shifts all costs equally.

* :class:`MeasuredCostModel` (:mod:`taso_jax.search.measured`): each operator compiled
  with ``jax.jit`` on the current JAX backend and timed, the times cached in SQLite.
* :class:`AnalyticCostModel`: FLOPs over peak plus bytes moved over bandwidth, in
  microseconds; deterministic, used by tests and ``--cost-model analytic``.

Both price operators that XLA fuses into a neighbouring kernel (declared ``fusible``:
elementwise and layout operators) by their arithmetic alone.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterable, Sequence

from taso_jax.ops import OPS

from taso_jax.ir.graph import LEAF_OPS, Graph, Node, composition_nodes

__all__ = ["CostModel", "AnalyticCostModel", "fused_cost", "MeasuredCostModel", "graph_cost",
           "get_cost_model", "MEASURE_METHOD", "CONTRADICTION", "MAX_RETIMED", "sibling_key",
           "CPU_CORE_PEAK_GFLOPS", "cpu_peak_gflops", "COST_CACHE_ENV", "default_cache_path"]


#: One number per cost model, for the prices it leaves on nodes: a node holds no reference
#: to the model (a graph kept in a cache would keep its model alive), and no number is
#: reused (an ``id`` can be).
_TOKENS = itertools.count()


class CostModel:
    """Base class: ``node_cost(node)`` in microseconds, memoized per node and per signature.

    A node's cost depends only on its signature: operator, attributes, input types and
    output types. A rewrite rebuilds every node downstream of it (the IR is hash-consed), so
    most nodes of a rewritten graph are new objects with a signature already priced.
    """

    name = "base"
    #: Kernels that would not run alone, and why (:class:`MeasuredCostModel` fills its own).
    unmeasurable: Sequence[str] = ()

    def __init__(self):
        self._by_signature: dict[tuple, float] = {}
        self._held: list | None = None
        self._token = next(_TOKENS)  # names this model on the nodes it priced

    @contextlib.contextmanager
    def holding_nodes(self):
        """Keep every node priced inside the block alive until the block ends.

        A search prices a rewrite's nodes before it builds the rewrite; held, they are
        found interned (with their price and match caches) when it is built. Released at
        the end of the outermost block, they do not outlive the search into the end-to-end
        choice.
        """
        outer = self._held
        if outer is None:
            self._held = []
        try:
            yield
        finally:
            if outer is None:
                self._held = None

    def node_cost(self, node: Node, measure_until: float | None = None) -> float:
        """Estimated run time of one node in microseconds.

        ``measure_until`` (a ``time.perf_counter()`` value; ``None``: no limit) is when a
        model that times kernels stops: past it, a kernel not in its cache is priced
        analytically. The price is kept on the node (``node.price``), not in a table here.
        """
        c = self._known(node)
        if c is None:
            sig = self.signature(node)
            c = self._by_signature.get(sig)
            if c is None:
                c = self._by_signature[sig] = float(self._price(node, measure_until))
            node.price = (self._token, c)
            if self._held is not None:
                self._held.append(node)
        return c

    def _known(self, node: Node) -> float | None:
        """The price this cost model gave ``node``, if it was the last to price it."""
        p = node.price
        return p[1] if p is not None and p[0] == self._token else None

    def signature(self, node: Node) -> tuple:
        """What a node's cost depends on: operator, attributes, input and output types."""
        return (node.op, node.attrs, tuple(t.type for t in node.inputs), node.types)

    def node_floor(self, node: Node, measure_until: float | None = None) -> float:
        """A lower bound on :meth:`node_cost` in microseconds, found without measuring.

        The search prunes a rewrite whose cost, with its new nodes at their floors, already
        passes its alpha-relaxed limit; only rewrites that may be kept have their kernels
        measured. Here the floor is the cost itself (a model that measures nothing);
        :class:`MeasuredCostModel` bounds a kernel not yet measured by its arithmetic.
        ``measure_until``: as for :meth:`node_cost`.
        """
        return self.node_cost(node, measure_until)

    def would_measure(self, node: Node, measure_until: float | None = None) -> bool:
        """Whether pricing ``node`` before ``measure_until`` would time a kernel.

        Never here (a model that measures nothing); :class:`MeasuredCostModel`: where its
        kernel is not in the cache yet and ``measure_until`` has not passed.
        """
        return False

    def _price(self, node: Node, measure_until: float | None) -> float:
        """The price of a node not priced before; subclasses that time kernels override it."""
        return self._cost(node)

    def _cost(self, node: Node) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def graph_cost(self, graph: Graph, measure_until: float | None = None) -> float:
        """Sum of runtime node costs (weight-only nodes are free), microseconds.

        ``measure_until``: as for :meth:`node_cost`.
        """
        return sum(self.node_cost(n, measure_until) for n in graph.nodes
                   if not n.weight_only and n.op not in LEAF_OPS)


def _passed(measure_until: float | None) -> bool:
    """Whether the ``time.perf_counter()`` value ``measure_until`` has passed (never: ``None``)."""
    return measure_until is not None and time.perf_counter() > measure_until


LOWERING_PENALTY = 2.0  #: analytic factor on a lowering (``OpDef.lowering``): not a tie


def _bytes(types: Iterable) -> float:
    return float(sum(t.nbytes for t in types))


def fused_cost(node: Node, gflops: float) -> float:
    """Cost of an operator that XLA fuses into a neighbouring kernel, in microseconds.

    Such an operator launches no kernel and moves no memory of its own (the kernel it joins
    does both); only its arithmetic remains, at ``gflops`` GFLOP/s.
    """
    flops = OPS[node.op].cost_flops([t.type for t in node.inputs], list(node.types),
                                    dict(node.attrs))
    return flops / (gflops * 1e3)


class AnalyticCostModel(CostModel):
    """Roofline estimate: ``max(flops / peak, bytes / bandwidth) + launch`` in microseconds.

    Args:
        gflops: peak arithmetic rate in GFLOP/s (default 100, a CPU core pair).
        gbytes: memory bandwidth in GB/s (default 20).
        launch_us: fixed cost per operator in microseconds (kernel launch / dispatch).
    """

    name = "analytic"

    def __init__(self, gflops: float = 100.0, gbytes: float = 20.0, launch_us: float = 2.0):
        super().__init__()
        self.gflops, self.gbytes, self.launch_us = gflops, gbytes, launch_us

    @classmethod
    def gpu(cls) -> AnalyticCostModel:
        """Preset for a datacenter GPU: 50 TFLOP/s, 2 TB/s, 5 us per kernel launch."""
        return cls(gflops=50_000.0, gbytes=2_000.0, launch_us=5.0)

    @classmethod
    def for_backend(cls) -> AnalyticCostModel:
        """The GPU preset when JAX's default backend is a GPU, else the CPU defaults."""
        import jax

        return cls.gpu() if jax.default_backend() == "gpu" else cls()

    def _cost(self, node: Node) -> float:
        opdef = OPS.get(node.op)
        if opdef is not None and opdef.fusible:
            return fused_cost(node, self.gflops)
        flops, moved = _work(node)
        roofline = max(flops / (self.gflops * 1e3), moved / (self.gbytes * 1e3))
        # a lowering ties here with what it implements (ties filled squeezenet's budget)
        scale = LOWERING_PENALTY if opdef is not None and opdef.lowering else 1.0
        return scale * roofline + self.launch_us


def priced_by_kernels(node: Node, analytic: AnalyticCostModel, kernel_price,
                      estimate: bool = False) -> float:
    """A node's price in microseconds, by what it runs as under ``jax.jit``.

    An opaque node at ``analytic``'s price; a fusible one by its arithmetic alone (timed
    alone it would be charged a whole kernel; under ``jax.jit`` it joins its neighbour's);
    a fused operator that runs as its composition as the sum of that composition's prices
    (timed as one kernel it would look cheaper than the same kernels one by one, though XLA
    compiles both alike: GPT-2 small's twelve masked attentions, so introduced, ran 0.92x);
    any other by ``kernel_price(node)``; with ``estimate`` (a model that prices kernels
    without timing them), one that runs as a kernel of its own by the steps of its
    ``OpDef.priced_as`` where it declares them. The measured and calibrated models share it.
    """
    if node.op == "opaque":
        return analytic.node_cost(node)
    if OPS[node.op].fusible:
        return fused_cost(node, analytic.gflops)
    parts = composition_nodes(node, priced=estimate)
    if parts is not None:
        return sum(priced_by_kernels(p, analytic, kernel_price, estimate) for p in parts)
    return kernel_price(node)


def _work(node: Node) -> tuple[float, float]:
    """``(flops, bytes moved)`` of one operator (its inputs read, its outputs written)."""
    ins = [t.type for t in node.inputs]
    opdef = OPS.get(node.op)
    if opdef is None:
        flops = float(sum(t.size for t in node.types))
    else:
        flops = float(opdef.cost_flops(ins, list(node.types), dict(node.attrs)))
    return flops, _bytes(ins) + _bytes(node.types)


#: The cost models that can be named by a string.
COST_MODEL_NAMES = ("calibrated", "measured", "analytic")


def get_cost_model(name: str = "calibrated", **kw) -> CostModel:
    """A cost model by name: ``"calibrated"``, ``"measured"`` or ``"analytic"``.

    ``"calibrated"``: curves fitted to timed kernels, compiling only to decide close calls
    (:class:`~taso_jax.search.calibrated.CalibratedCostModel`); ``"measured"``: every
    kernel timed; ``"analytic"``: a roofline.

    ``kw`` goes to the model's constructor. Raises ``ValueError`` for another name.
    """
    if name == "calibrated":
        from taso_jax.search.calibrated import CalibratedCostModel

        return CalibratedCostModel(**kw)
    if name == "measured":
        return MeasuredCostModel(**kw)
    if name == "analytic":
        return AnalyticCostModel(**kw) if kw else AnalyticCostModel.for_backend()
    raise ValueError(f"unknown cost model {name!r} (use one of {', '.join(COST_MODEL_NAMES)})")


def graph_cost(graph: Graph, model: CostModel) -> float:
    """Convenience: ``model.graph_cost(graph)`` in microseconds."""
    return model.graph_cost(graph)


# The measured model and its constants, importable from here as before
# (search/measured.py imports this module's base classes, so this import comes last).
from taso_jax.search.measured import (  # noqa: E402
    CONTRADICTION,
    COST_CACHE_ENV,
    CPU_CORE_PEAK_GFLOPS,
    MAX_RETIMED,
    MEASURE_METHOD,
    MeasuredCostModel,
    cpu_peak_gflops,
    default_cache_path,
    sibling_key,
)
