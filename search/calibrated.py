"""The calibrated cost model: a kernel priced from its FLOPs and bytes, compiling nothing.

TASO prices an operator once per configuration by running it (Jia et al., SOSP 2019,
Section 5.1); on XLA a kernel must first be compiled, which costs 0.1-1 s on a CPU and
more on a GPU, so a measured cost model spends a large model's time limit on compiles
before its search expands a graph. This model prices a kernel instead from what its
``OpDef`` declares, the arithmetic (FLOPs, ``OpDef.cost_flops``) and the bytes it reads and
writes, through curves fitted to kernels timed on the device:

    log(price in microseconds) = log(roofline) + w . x(flops, bytes, dtype, shape)

where ``roofline`` is the platform's analytic price (one launch, plus FLOPs at its peak,
plus bytes at its bandwidth) and ``x`` = [1, log flops, log bytes, the two above their knee
(a kernel past :data:`FLOP_KNEE` FLOPs or :data:`BYTE_KNEE` bytes runs at another rate
than a dispatch-bound small one: the size band), narrow dtype, log of the work per output
element, log of ``groups``, and for a matrix product or convolution the logs of the rows,
inner length and columns of the product one group computes (``OpDef.product_dims``)].
``w`` is fitted by ridge least squares on log time, hierarchically: a correction for all
kernels, shrunk towards none (so that a kernel far from every sample is priced near its
roofline, not by an extrapolated power law); one per operator family (``OpDef.family``:
the ``ops/`` module that declares it, so convolution and each of its lowerings, attention
and its lowerings, reductions, layout operators are apart), shrunk towards it; one per
operator, shrunk towards its family's; and for a grouped convolution one more, shrunk
towards its operator's (XLA:CPU runs grouped convolutions on another path than dense
ones: a depthwise 3x3 one at 1 GFLOP/s, about 20 ns an output element whatever its size).

What the curves leave, a kernel's neighbours explain: the residuals of the
:data:`NEIGHBOURS` samples of its operator nearest in log FLOPs, bytes, outputs, groups and
product sizes, weighed by a Gaussian of their distance (:data:`NEIGHBOUR_SCALE`) and
shrunk towards none (:data:`NEIGHBOUR_PRIOR`), are added to its log price. On the
development set these took the sign agreement on reproducible single rewrites (a
convolution against its lowerings, grouped convolutions densified) from 71% to 87%
(``benchmarks/results/cost_model_accuracy_cpu_2026-11-30_amd_dev.md``).

A curve's uncertainty is its leave-one-out residual (standard deviation of log time),
measured, not assumed.

Where the curves come from (:func:`load_calibration`):

* samples shipped with the package for each device class the project has measured
  (``taso_jax/data/calibration_<class>.json``: ``cpu``, this project's 2-core CPU; see
  ``benchmarks/calibrate.py``);
* samples of kernels timed on this very device, kept in the cost cache's ``samples``
  table whenever :class:`~taso_jax.search.cost.MeasuredCostModel` times one (the
  ``--cost-model measured`` search, the decisions below); they weigh
  :data:`LOCAL_WEIGHT` times a shipped sample, so the curves follow the device as
  measurements accumulate.

A device class with neither (a GPU on its first run) is priced by the analytic roofline of
its platform (:meth:`~taso_jax.search.cost.AnalyticCostModel.for_backend`) with an
uncertainty of :data:`UNFITTED_SIGMA`, so that close decisions are measured.

Measurement where it decides (:meth:`CalibratedCostModel.refine`): the forms of one node
(attention in query blocks of 128, 256 or 512 rows; a convolution and its lowerings)
whose calibrated prices lie within the curves' uncertainty of the cheapest are compiled and
timed, at most ``max_compiles`` kernels a run, and the timings are fed back into the curves.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sqlite3
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from taso_jax.ops import OPS
from taso_jax.search._kernel_timing import KERNEL_BUDGET_US
from taso_jax.search.cost import (
    AnalyticCostModel,
    CostModel,
    MeasuredCostModel,
    default_cache_path,
    priced_by_kernels,
)

from taso_jax.ir.graph import Graph, Node, composition_nodes

__all__ = ["CalibratedCostModel", "Calibration", "KernelSample", "kernel_features",
           "load_calibration", "device_class", "shipped_calibration_path", "MAX_COMPILES"]

#: FLOPs and bytes where a kernel's curve may bend: below, a CPU kernel is mostly dispatch
#: and loop overhead; above, its arithmetic or memory traffic dominates (cache sizes: a
#: 2-core machine's L2 is about 1 MiB a core).
FLOP_KNEE = 1e6
BYTE_KNEE = 2.0**20
#: Ridge strength pulling an operator's curve towards its family's, and a family's towards
#: all kernels' (in units of samples: a curve fitted to n samples moves half-way towards its
#: parent at n = RIDGE).
RIDGE = 4.0
#: Weight of a sample timed on this device against one shipped with the package.
LOCAL_WEIGHT = 4.0
#: Uncertainty (standard deviation of log time) of a price no curve was fitted for.
UNFITTED_SIGMA = 1.0
#: The largest correction of the roofline a curve may make, in log time (a factor of 1000
#: either way): a kernel far outside the samples is not priced by an extrapolation alone.
MAX_CORRECTION = math.log(1000.0)
#: Kernels one calibrated cost model may compile and time to decide between close forms.
MAX_COMPILES = 20
#: Environment variable: ``off`` fits the shipped samples alone (:func:`load_calibration`).
LOCAL_SAMPLES_ENV = "TASO_JAX_LOCAL_SAMPLES"
#: Timed runs per kernel when forms are told apart (3 rounds of 3): forms are only timed
#: where their prices differ by less than the curves' uncertainty, and a decision needs
#: their order, not a precise time.
DECISION_REPEATS = 9
#: Seconds a kernel's compilation is guessed to take before it is timed (0.1-1 s on a CPU),
#: so that a decision that cannot be timed before the deadline is left to the curves.
COMPILE_GUESS_S = 0.5
#: The same on a GPU, where XLA autotunes each matrix product: on an H200, timing the forms
#: of one causal attention (S=2048, query blocks among them) took 5-12 s of a decorator's
#: 10 s, guessed at 0.5 s a kernel.
COMPILE_GUESS_GPU_S = 2.0
#: Seconds each kernel compiled and timed so far in this process took (compile and runs
#: together), the guess for the next ones where it is larger: ``[seconds, kernels]``.
_OBSERVED = [0.0, 0]
#: How many standard deviations of the curves' uncertainty make two prices "close".
CLOSE_SIGMAS = 1.0
#: Samples of a kernel's operator whose residuals correct its price, the nearest ones.
NEIGHBOURS = 10
#: Distance (in the logs of :meth:`KernelSample.neighbourhood`) at which a neighbour's
#: weight falls to 1/e.
NEIGHBOUR_SCALE = 0.75
#: Weight of "no correction" against the neighbours' (a neighbour at distance 0 weighs 1).
NEIGHBOUR_PRIOR = 0.5


def device_class(device: str) -> str:
    """The class of a cost-cache device key: the platform before the colon.

    ``"cpu:cpu"`` -> ``"cpu"``, ``"gpu:NVIDIA H200"`` -> ``"gpu"``.
    """
    return device.split(":", 1)[0]


def shipped_calibration_path(cls: str) -> Path:
    """Where the package keeps the samples of device class ``cls`` (may not exist)."""
    return _data_dir() / f"calibration_{cls}.json"


def _data_dir() -> Path:
    from importlib.resources import files

    return Path(str(files("taso_jax") / "data"))


@dataclass(frozen=True)
class KernelSample:
    """One kernel's features and its price, a row of the calibration data.

    Attributes:
        op: operator name.
        family: its ``OpDef.family``.
        flops: FLOPs of one run (``OpDef.cost_flops``).
        bytes: bytes of its inputs read plus its outputs written.
        narrow: whether a float input or output is narrower than 32 bits (float16,
            bfloat16), which a CPU has no fast units for and a GPU's tensor cores favour.
        outputs: elements of its outputs (``flops / outputs`` is the work per element).
        groups: its ``groups`` attribute where it has one (a grouped or depthwise
            convolution runs at another rate than a dense one of the same work), else 1.
        micros: its price in microseconds (measured time less one jitted call's overhead,
            plus one launch: :class:`~taso_jax.search.cost.MeasuredCostModel`'s calibrated
            price); ``nan`` for a kernel not measured yet.
        source: where it was drawn from (a model's name), for held-out splits.
        rows, inner, cols: ``OpDef.product_dims`` of a matrix product or convolution (the
            product one group computes); 0 for other operators.
    """

    op: str
    family: str
    flops: float
    bytes: float
    narrow: bool
    micros: float = float("nan")
    source: str = ""
    outputs: float = 0.0
    groups: int = 1
    rows: float = 0.0
    inner: float = 0.0
    cols: float = 0.0

    def _product(self) -> list[float]:
        return [math.log(max(v, 1.0)) for v in (self.rows, self.inner, self.cols)]

    def x(self) -> np.ndarray:
        """The regression's feature vector (see the module docstring)."""
        lf = math.log(self.flops + 1.0)
        lb = math.log(self.bytes + 1.0)
        # the work per output element: a product's inner length, a convolution's window
        # times its group's channels (a depthwise convolution's 9 runs far below peak)
        depth = math.log(max(self.flops / max(self.outputs, 1.0), 1.0))
        return np.array([1.0, lf, lb, max(0.0, lf - math.log(FLOP_KNEE)),
                         max(0.0, lb - math.log(BYTE_KNEE)), float(self.narrow), depth,
                         math.log(max(self.groups, 1)), *self._product()])

    def neighbourhood(self) -> np.ndarray:
        """Where the kernel lies among its operator's samples (for :data:`NEIGHBOURS`).

        The logs of its FLOPs, bytes, outputs, groups and product sizes.
        """
        return np.array([math.log(self.flops + 1.0), math.log(self.bytes + 1.0),
                         math.log(max(self.outputs, 1.0)), math.log(max(self.groups, 1)),
                         *self._product()])

    def curve_keys(self) -> list[tuple]:
        """The curves that may price it, most specific first.

        A grouped convolution's, its operator's, its family's, all kernels'.
        """
        keys = [("op", self.op), ("family", self.family), ("all",)]
        return ([("grouped", self.op)] if self.groups > 1 else []) + keys

    def to_json(self) -> dict:
        """The row as a JSON object."""
        return {"op": self.op, "family": self.family, "flops": self.flops,
                "bytes": self.bytes, "narrow": self.narrow, "micros": self.micros,
                "source": self.source, "outputs": self.outputs, "groups": self.groups,
                "rows": self.rows, "inner": self.inner, "cols": self.cols}


def kernel_features(node: Node, micros: float = float("nan"), source: str = "") -> KernelSample:
    """The features of ``node``'s kernel (its FLOPs, bytes, dtype) as a :class:`KernelSample`."""
    ins = [t.type for t in node.inputs]
    opdef = OPS.get(node.op)
    if opdef is None:
        flops, family = float(sum(t.size for t in node.types)), "opaque"
    else:
        flops, family = float(opdef.cost_flops(ins, list(node.types), dict(node.attrs))), \
            opdef.family
    moved = float(sum(t.nbytes for t in ins) + sum(t.nbytes for t in node.types))
    narrow = any(t.dtype in ("float16", "bfloat16") for t in [*ins, *node.types])
    attrs = dict(node.attrs)
    groups = attrs.get("groups", 1)
    product = (0.0, 0.0, 0.0)
    if opdef is not None and opdef.product_dims is not None:
        try:
            product = tuple(float(v) for v in opdef.product_dims(ins, list(node.types),
                                                                 **attrs))
        except (TypeError, ValueError):  # an open size: no product sizes to price by
            pass
    return KernelSample(node.op, family, flops, moved, narrow, micros, source,
                        float(sum(t.size for t in node.types)),
                        int(groups) if isinstance(groups, int) else 1, *product)


@dataclass
class _Curve:
    """One fitted curve: weights over :meth:`KernelSample.x` and its uncertainty."""

    w: np.ndarray
    sigma: float
    n: float  # weighted samples it was fitted to


def _fit(xs: np.ndarray, ys: np.ndarray, weights: np.ndarray, prior: np.ndarray,
         ridge: float) -> _Curve:
    """Weighted ridge least squares of ``ys`` on ``xs``, pulled towards ``prior``.

    Minimizes ``sum w_i (y_i - x_i.b)^2 + ridge * |b - prior|^2``. The uncertainty is the
    weighted RMS of the leave-one-out residuals ``r_i / (1 - h_ii)`` (the hat matrix of the
    ridge fit), in log time.
    """
    p = xs.shape[1]
    lam, mu = ridge, prior
    sw = np.sqrt(weights)
    a = xs * sw[:, None]
    gram = a.T @ a + lam * np.eye(p)
    inv = np.linalg.inv(gram)
    w = inv @ (a.T @ (ys * sw) + lam * mu)
    resid = ys - xs @ w
    hat = np.einsum("ij,jk,ik->i", a, inv, a)
    loo = resid / np.maximum(1.0 - hat, 0.05)
    sigma = float(np.sqrt(np.sum(weights * loo**2) / max(np.sum(weights), 1e-9)))
    return _Curve(w, sigma, float(np.sum(weights)))


class Calibration:
    """Fitted curves of one device: per operator, per family, and over all kernels.

    Built by :meth:`fit` from :class:`KernelSample` rows; :meth:`predict` gives a kernel's
    log price and its uncertainty from the most specific curve there is, corrected by its
    nearest samples' residuals. With no samples at all, every kernel is priced by
    ``fallback`` (an analytic cost model) at :data:`UNFITTED_SIGMA`.
    """

    def __init__(self, fallback: AnalyticCostModel, curves: dict | None = None,
                 samples: Sequence[KernelSample] = (), weights: Sequence[float] = ()):
        self.fallback = fallback
        self.curves: dict[tuple, _Curve] = curves or {}
        self.samples = list(samples)
        self.weights = list(weights)
        # per operator: its samples' neighbourhoods, residuals from their curves, weights
        self._near: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def roofline(self, s: KernelSample) -> float:
        """The baseline the curves correct: one launch, FLOPs at peak, bytes at bandwidth."""
        f = self.fallback
        return f.launch_us + s.flops / (f.gflops * 1e3) + s.bytes / (f.gbytes * 1e3)

    @classmethod
    def fit(cls, samples: Sequence[KernelSample], fallback: AnalyticCostModel,
            weights: Sequence[float] | None = None) -> Calibration:
        """Fit curves to ``samples`` (measured ones; ``nan`` prices are ignored).

        ``weights`` (default 1 each) weigh the samples, e.g. :data:`LOCAL_WEIGHT` for
        kernels timed on this device.
        """
        weights = list(weights) if weights is not None else [1.0] * len(samples)
        kept = [(s, wt) for s, wt in zip(samples, weights, strict=True)
                if s.micros == s.micros and s.micros > 0]
        self = cls(fallback, {}, [s for s, _ in kept], [wt for _, wt in kept])
        if not kept:
            return self
        xs = np.stack([s.x() for s, _ in kept])
        ys = np.log(np.array([s.micros / self.roofline(s) for s, _ in kept]))
        wts = np.array([wt for _, wt in kept])
        self.curves[("all",)] = _fit(xs, ys, wts, np.zeros(xs.shape[1]), RIDGE)
        members: dict[tuple, list[int]] = defaultdict(list)
        for i, (s, _) in enumerate(kept):
            for key in s.curve_keys()[:-1]:
                members[key].append(i)
        for kind in ("family", "op", "grouped"):  # each curve shrunk towards its parent's
            for key, idx in members.items():
                if key[0] == kind:
                    chain = kept[idx[0]][0].curve_keys()
                    parent = self.curves[chain[chain.index(key) + 1]]
                    self.curves[key] = _fit(xs[idx], ys[idx], wts[idx], parent.w, RIDGE)
        by_op: dict[str, list[int]] = defaultdict(list)
        for i, (s, _) in enumerate(kept):
            by_op[s.op].append(i)
        for op, idx in by_op.items():
            resid = [ys[i] - xs[i] @ self.curve(kept[i][0]).w for i in idx]
            self._near[op] = (np.stack([kept[i][0].neighbourhood() for i in idx]),
                              np.array(resid), wts[idx])
        return self

    def curve(self, sample: KernelSample) -> _Curve | None:
        """The most specific curve fitted for a kernel (:meth:`KernelSample.curve_keys`)."""
        for key in sample.curve_keys():
            c = self.curves.get(key)
            if c is not None:
                return c
        return None

    def _neighbours(self, sample: KernelSample) -> float:
        """The weighted residual (log time) of the operator's samples nearest ``sample``."""
        near = self._near.get(sample.op)
        if near is None:
            return 0.0
        where, resid, wts = near
        dist = np.sqrt(((where - sample.neighbourhood()) ** 2).sum(axis=1))
        nearest = np.argsort(dist)[:NEIGHBOURS]
        w = wts[nearest] * np.exp(-(dist[nearest] / NEIGHBOUR_SCALE) ** 2)
        return float((w * resid[nearest]).sum() / (w.sum() + NEIGHBOUR_PRIOR))

    def predict(self, sample: KernelSample, node: Node | None = None) -> tuple[float, float]:
        """``(price in microseconds, uncertainty as a standard deviation of log time)``.

        Without any curve, ``fallback``'s price of ``node`` at :data:`UNFITTED_SIGMA`.

        Raises:
            ValueError: no curve was fitted and no ``node`` was given.
        """
        c = self.curve(sample)
        if c is None:
            if node is None:
                raise ValueError("an unfitted calibration prices nodes, not samples")
            return self.fallback.node_cost(node), UNFITTED_SIGMA
        # an operator fitted to few samples is as uncertain as its family at least
        fam = self.curves.get(("family", sample.family), c)
        sigma = max(c.sigma, fam.sigma if c.n < 2 * RIDGE else 0.0)
        if ("op", sample.op) not in self.curves and ("family", sample.family) \
                not in self.curves:
            sigma = max(sigma, UNFITTED_SIGMA)  # a kind of kernel never timed
        correction = float(sample.x() @ c.w) + self._neighbours(sample)
        correction = min(max(correction, -MAX_CORRECTION), MAX_CORRECTION)
        return self.roofline(sample) * math.exp(correction), sigma

    def summary(self) -> dict:
        """Per curve: samples and uncertainty (for reports and ``benchmarks/``)."""
        return {":".join(k): {"n": round(c.n, 1), "sigma": round(c.sigma, 3)}
                for k, c in sorted(self.curves.items())}


def _read_shipped(cls: str) -> list[KernelSample]:
    path = shipped_calibration_path(cls)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [KernelSample(**row) for row in data.get("samples", [])]


@functools.lru_cache(maxsize=8)
def _shipped(cls: str) -> tuple[KernelSample, ...]:
    return tuple(_read_shipped(cls))


def local_samples(db: sqlite3.Connection | None, device: str) -> list[KernelSample]:
    """The kernels timed on ``device`` and kept in the cost cache ``db``, as samples.

    Their prices are the raw times less the cached call overhead plus one launch, as
    :class:`~taso_jax.search.cost.MeasuredCostModel` prices them.
    """
    if db is None:
        return []
    try:
        rows = db.execute("SELECT op, family, flops, bytes, narrow, micros, outputs, groups, "
                          "rows, inner, cols FROM samples WHERE device=?", (device,)).fetchall()
        over = db.execute("SELECT micros FROM cost WHERE device=? AND key='call_overhead'",
                          (device,)).fetchone()
    except sqlite3.Error:
        return []
    overhead = over[0] if over else 0.0
    launch = AnalyticCostModel.gpu().launch_us if device_class(device) == "gpu" \
        else AnalyticCostModel().launch_us
    # a product timed before its product sizes were recorded would be priced as none
    return [KernelSample(op, family, flops, nbytes, bool(narrow),
                         max(micros - overhead, 0.0) + launch, "local", outputs or 0.0,
                         int(groups or 1), prows or 0.0, inner or 0.0, cols or 0.0)
            for op, family, flops, nbytes, narrow, micros, outputs, groups, prows, inner, cols
            in rows
            if prows is not None or OPS.get(op) is None or OPS[op].product_dims is None]


def load_calibration(device: str, db: sqlite3.Connection | None = None,
                     fallback: CostModel | None = None) -> Calibration:
    """The calibration of ``device`` (a cost-cache device key, ``"cpu:cpu"``).

    The package's samples for its class, and those timed on this device kept in the cost
    cache ``db`` (weighing :data:`LOCAL_WEIGHT` each; none with ``TASO_JAX_LOCAL_SAMPLES=off``,
    so that prices do not depend on what was timed before, as the tests need); ``fallback``
    (default: the analytic model of JAX's default backend) prices kernels where there are
    none.
    """
    fallback = fallback or AnalyticCostModel.for_backend()
    shipped = list(_shipped(device_class(device)))
    local = [] if os.environ.get(LOCAL_SAMPLES_ENV, "").lower() == "off" else \
        local_samples(db, device)
    return Calibration.fit(shipped + local, fallback,
                           [1.0] * len(shipped) + [LOCAL_WEIGHT] * len(local))


@dataclass
class _Stats:
    """What one calibrated cost model did (see :meth:`CalibratedCostModel.stats`)."""

    compiles: int = 0
    compile_seconds: float = 0.0
    from_cache: int = 0  # kernels a decision needed that the cost cache already held
    decisions: int = 0  # close calls settled by measurement
    over_budget: int = 0  # close calls left to the curves: the compile budget was spent
    pricing_seconds: float = 0.0
    priced: int = 0


class CalibratedCostModel(CostModel):
    """Kernels priced from fitted curves of FLOPs and bytes; measured only to decide.

    Args:
        cache_path: the cost cache (SQLite) whose ``samples`` refine the curves and where
            the kernels timed for decisions are kept; ``None`` for
            :func:`~taso_jax.search.cost.default_cache_path`, ``False`` for none.
        calibration: curves to use instead of :func:`load_calibration`'s.
        max_compiles: kernels :meth:`refine` may compile and time in this model's life.
        nhwc_convolutions: price each NCHW ``conv2d`` as the ``conv2d_nhwc`` kernel it
            runs as once the end-to-end choice keeps the NHWC candidate (as
            :class:`~taso_jax.search.cost.MeasuredCostModel` does).

    Prices are microseconds. Fusible operators are priced by their arithmetic, and fused
    operators that run as their composition as the sum of its kernels, as in the measured
    model; opaque operators analytically. Pricing compiles nothing.
    """

    name = "calibrated"

    def __init__(self, cache_path: str | bool | None = None,
                 calibration: Calibration | None = None, max_compiles: int = MAX_COMPILES,
                 nhwc_convolutions: bool = False):
        super().__init__()
        self.device = MeasuredCostModel._device()
        self._cache_path = cache_path
        self._db = None
        if calibration is None and cache_path is not False:
            from taso_jax.search._cost_cache import open_cost_cache

            self._db = open_cost_cache(cache_path or default_cache_path())
        self._analytic = AnalyticCostModel.for_backend()
        self.calibration = calibration or load_calibration(self.device, self._db,
                                                           self._analytic)
        self.max_compiles = max_compiles
        self.nhwc_convolutions = nhwc_convolutions
        self._pinned: dict[str, float] = {}  # kernel key -> measured price (us)
        self._measurer: MeasuredCostModel | None = None
        self._stats = _Stats()
        self._lock = threading.Lock()

    # -- pricing -------------------------------------------------------------------------

    def _timed_form(self, node: Node) -> Node:
        if self.nhwc_convolutions and node.op == "conv2d":
            from taso_jax.ir.layout import nhwc_form

            return nhwc_form(node)
        return node

    def kernels(self, node: Node) -> list[Node]:
        """The kernels ``node`` is priced as.

        None for opaque and fusible operators, its composition's kernels for a fused
        operator that runs as one (or those of the steps that estimate a kernel of its own,
        ``OpDef.priced_as``), else its own timed form.
        """
        if node.op == "opaque" or OPS[node.op].fusible:
            return []
        parts = composition_nodes(node, priced=True)
        if parts is not None:
            return [k for p in parts for k in self.kernels(p)]
        return [self._timed_form(node)]

    def _cost(self, node: Node) -> float:
        t0 = time.perf_counter()
        try:
            return priced_by_kernels(
                node, self._analytic, lambda k: self._kernel_price(self._timed_form(k))[0],
                estimate=True)
        finally:
            self._stats.pricing_seconds += time.perf_counter() - t0
            self._stats.priced += 1

    def _kernel_price(self, kernel: Node) -> tuple[float, float]:
        """``(price us, sigma)`` of one kernel: pinned by a measurement, else predicted."""
        pinned = self._pinned.get(MeasuredCostModel.key(kernel))
        if pinned is not None:
            return pinned, 0.0
        return self.calibration.predict(kernel_features(kernel), kernel)

    def uncertainty(self, nodes: Iterable[Node]) -> float:
        """The largest uncertainty (standard deviation of log time) of the nodes' kernels."""
        sig = [self._kernel_price(k)[1] for n in nodes for k in self.kernels(n)]
        return max(sig, default=0.0)

    # -- measurement where it decides ------------------------------------------------------

    def refine(self, forms: Sequence[Sequence[Node]], until: float | None = None) -> bool:
        """Time the kernels of the forms of one node whose prices are close; pin them.

        ``forms`` are alternative node sets that compute the same tensor (a node and its
        lowerings, each as the runtime nodes it adds). The forms priced within
        :data:`CLOSE_SIGMAS` of the curves' uncertainty of the cheapest are told apart by
        timing their kernels (the cost cache's time where it has one; else compiled, at
        most ``max_compiles`` in this model's life). The timings are pinned (they price
        those kernels from then on) and added to the curves' samples. Returns whether any
        price changed; prices handed out before then are revised, so a caller compares the
        forms again. Nothing is compiled past ``until`` (a ``time.perf_counter()`` value).
        """
        if until is not None and time.perf_counter() > until:
            return False
        prices = [sum(self.node_cost(n) for n in f) for f in forms]
        if len(prices) < 2:
            return False
        order = sorted(range(len(forms)), key=lambda i: prices[i])
        sigma = self.uncertainty(n for f in forms for n in f)
        band = math.exp(CLOSE_SIGMAS * sigma)
        close = [i for i in order if prices[i] <= prices[order[0]] * band]
        if len(close) < 2:
            return False
        kernels = {}
        for i in close:
            for n in forms[i]:
                for k in self.kernels(n):
                    key = MeasuredCostModel.key(k)
                    if key not in self._pinned:
                        kernels[key] = k
        if not kernels:
            return False
        measurer = self._measurer_model()
        fresh = {key for key in kernels if measurer._lookup(key) is None}
        if self._stats.compiles + len(fresh) > self.max_compiles or (
                until is not None
                and time.perf_counter() + self._measuring_seconds(kernels, fresh) > until):
            self._stats.over_budget += 1
            return False
        t0 = time.perf_counter()
        timed = {}
        for key, k in kernels.items():
            # the measured model's price: its time less a call's overhead, plus a launch
            t1 = time.perf_counter()
            timed[key] = measurer._cost(k)
            if key in fresh:
                _OBSERVED[0] += time.perf_counter() - t1
                _OBSERVED[1] += 1
            self._stats.compiles += key in fresh
            self._stats.from_cache += key not in fresh
            if until is not None and time.perf_counter() > until and len(timed) < len(kernels):
                # some forms timed, others not: they would be compared on different scales
                # (the timings are in the cost cache for the next run)
                self._stats.compile_seconds += time.perf_counter() - t0
                return False
        self._stats.compile_seconds += time.perf_counter() - t0
        self._pinned.update(timed)
        self._stats.decisions += 1
        self._revise()
        return True

    def _measuring_seconds(self, kernels: dict, fresh: set) -> float:
        """A guess at the seconds timing ``kernels`` takes.

        Each of the ``fresh`` ones is compiled (:data:`COMPILE_GUESS_S`, on a GPU
        :data:`COMPILE_GUESS_GPU_S`, or the mean this process has seen if more) and run
        :data:`DECISION_REPEATS` times and more (warm-ups, a retimed round) at its
        calibrated price; cached ones cost nothing.
        """
        runs = 2 * DECISION_REPEATS
        guess = COMPILE_GUESS_GPU_S if device_class(self.device) == "gpu" else COMPILE_GUESS_S
        if _OBSERVED[1]:
            guess = max(guess, _OBSERVED[0] / _OBSERVED[1])
        return sum(guess + min(runs * self._kernel_price(k)[0] * 1e-6,
                               KERNEL_BUDGET_US * 1e-6)
                   for key, k in kernels.items() if key in fresh)

    def _measurer_model(self) -> MeasuredCostModel:
        if self._measurer is None:
            self._measurer = MeasuredCostModel(cache_path=self._cache_path,
                                               repeats=DECISION_REPEATS)
        return self._measurer

    def _revise(self) -> None:
        """Forget every price handed out, so that pinned kernels price their nodes anew."""
        self._by_signature.clear()
        self._token = next(_tokens())

    def stats(self) -> dict:
        """What this model did, for reports.

        ``name``, ``compiles`` (kernels compiled and timed to settle close calls),
        ``compile_seconds``, ``from_cache``, ``decisions``, ``over_budget``, ``priced``
        (kernels priced) and ``pricing_seconds``.
        """
        s = self._stats
        return {"name": self.name, "compiles": s.compiles,
                "compile_seconds": round(s.compile_seconds, 3), "from_cache": s.from_cache,
                "decisions": s.decisions, "over_budget": s.over_budget, "priced": s.priced,
                "pricing_seconds": round(s.pricing_seconds, 3)}


def _tokens():
    from taso_jax.search import cost

    return cost._TOKENS


def graph_kernels(graph: Graph, model: CalibratedCostModel) -> list[Node]:
    """The distinct kernels (by cost-cache key) ``model`` prices ``graph``'s runtime nodes by."""
    from taso_jax.ir.graph import LEAF_OPS

    seen: dict[str, Node] = {}
    for n in graph.nodes:
        if n.weight_only or n.op in LEAF_OPS:
            continue
        for k in model.kernels(n):
            seen.setdefault(MeasuredCostModel.key(k), k)
    return list(seen.values())


def write_samples(path: str | os.PathLike, samples: Sequence[KernelSample], meta: dict) -> None:
    """Write a calibration file (``{"meta": ..., "samples": [...]}``) atomically."""
    from taso_jax._io import atomic_write

    rows = ",\n".join(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                   for k, v in s.to_json().items()}, separators=(",", ":"))
                       for s in samples)
    text = f'{{"meta": {json.dumps(meta)},\n"samples": [\n{rows}]}}\n'

    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)

    atomic_write(Path(path), write)
