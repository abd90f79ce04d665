"""The measured cost model: every kernel compiled with ``jax.jit`` and timed on the device.

Each operator, with its attributes, input shapes and dtypes, is compiled on the current JAX
backend (GPU when present, else CPU) and timed; the time in microseconds is cached in SQLite
in the user cache directory, keyed by device kind, operator, attributes, shapes and dtypes.
A call of a jitted function from Python pays a fixed dispatch cost that a whole-graph
``jax.jit`` pays once, not per operator; the model measures it (an almost empty jitted
call) and prices each operator at its measured time less that cost, plus one kernel
launch. ``--cost-model measured`` selects it; the calibrated model
(:mod:`taso_jax.search.calibrated`) fits its curves to these times and uses it to settle
close calls. Its names are also importable from :mod:`taso_jax.search.cost`.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
import warnings

import numpy as np
from taso_jax.ops import OPS
from taso_jax.search._cost_cache import open_cost_cache
from taso_jax.search._kernel_timing import (
    KERNEL_BUDGET_US,
    ROUNDS,
    robust_time,
    stand_in_rounds,
)
from taso_jax.search.cost import (
    AnalyticCostModel,
    CostModel,
    _passed,
    _work,
    priced_by_kernels,
)

from taso_jax._compile_cache import enable_persistent_cache
from taso_jax._text import one_line
from taso_jax.ir.graph import Node, composition_nodes

__all__ = ["MeasuredCostModel", "MEASURE_METHOD", "CONTRADICTION", "MAX_RETIMED",
           "sibling_key", "CPU_CORE_PEAK_GFLOPS", "cpu_peak_gflops", "COST_CACHE_ENV",
           "default_cache_path"]


#: Version of the way a kernel is timed, stored with every cached time. A cached time taken
#: by another method is measured again. 3: the fastest single run of :data:`ROUNDS` rounds,
#: each on its own copy of the inputs (2026-11-24); 2: the same on one copy; 1 (the fastest
#: round's median) and older, unversioned times were found as much as 3x too high (a 1x512
#: by 512x512 matmul at 100 us against 29 us measured again), enough to stop a NasRNN's
#: matmul merges halfway.
MEASURE_METHOD = 3

#: How far a kernel's price may stray from a kernel of its family with inputs at least (or
#: at most) as large, before both are timed again side by side
#: (:meth:`MeasuredCostModel._consistent`), and how many such pairs one cost model times.
CONTRADICTION = 1.1
MAX_RETIMED = 32

def sibling_key(node: Node) -> tuple | None:
    """What ``node`` shares with every form of it that differs only in ``groups``, or ``None``.

    For an operator that declares its kernel's input-channel axis (``grouped_kernel_axis``
    in :mod:`taso_jax.ops`, the convolutions): the operator, the attributes but ``groups``,
    the data input's type, and the kernel's shape without that axis (a 1x176x14x14 NCHW
    input with a 176x1x5x5 depthwise kernel and with a 176x22x5x5 kernel at ``groups=8``
    share it). Halving and densifying rewrites trade such forms, so they are priced side
    by side (:meth:`MeasuredCostModel._measure_beside`). ``None`` for other operators.
    """
    opdef = OPS.get(node.op)
    axis = opdef.grouped_kernel_axis if opdef is not None else None
    if axis is None or len(node.inputs) < 2:
        return None
    kernel = node.inputs[1]
    return (node.op, tuple(kv for kv in node.attrs if kv[0] != "groups"),
            node.inputs[0].type, kernel.shape[:axis] + kernel.shape[axis + 1:], kernel.dtype,
            tuple(t.type for t in node.inputs[2:]))

#: An upper bound on one CPU core's float32 (or float64) arithmetic rate in GFLOP/s: two
#: 16-lane fused multiply-add units (AVX-512) at 4 GHz. The floor of a kernel not yet
#: measured (:meth:`MeasuredCostModel.node_floor`) is its FLOPs at this rate on every core.
#: This project's 2-core CPU ran a dense 960x960 3x3 convolution on 1x960x7x7 at about 190
#: GFLOP/s in onnxruntime, against the 512 this allows.
CPU_CORE_PEAK_GFLOPS = 256.0


def cpu_peak_gflops() -> float:
    """:data:`CPU_CORE_PEAK_GFLOPS` on every core this process may use (GFLOP/s)."""
    from taso_jax._machine import usable_cores

    return CPU_CORE_PEAK_GFLOPS * usable_cores()

#: Environment variable naming the SQLite file of measured kernel costs, where it is set.
COST_CACHE_ENV = "TASO_JAX_COST_CACHE"


def default_cache_path() -> str:
    """The kernel cost cache file: ``$TASO_JAX_COST_CACHE``, else the user cache's.

    The user cache's is ``<user cache dir>/taso_jax/costs.sqlite`` (platformdirs). Setting
    the variable lets a cache travel with a checkout, e.g. between the separate commands of a
    benchmark run on a lent GPU machine, whose user cache is wiped between them.
    """
    path = os.environ.get(COST_CACHE_ENV)
    if path:
        return path
    import platformdirs

    return os.path.join(platformdirs.user_cache_dir("taso_jax"), "costs.sqlite")


class MeasuredCostModel(CostModel):
    """Operator costs measured as ``jax.jit``-compiled kernels on the current device.

    Args:
        cache_path: SQLite file; ``None`` for :func:`default_cache_path` (the user cache, or
            ``$TASO_JAX_COST_CACHE``), ``False`` for no cache.
        repeats: timed runs per operator (median is kept).
        calibrate: price an operator at ``max(measured - call_overhead_us, 0) + launch``
            microseconds, where ``call_overhead_us`` is the median time of a jitted call
            that adds 1 to a 1-element array (Python dispatch, argument handling, one tiny
            kernel) and ``launch`` is the analytic preset's per-kernel cost (2 us on a CPU,
            5 us on a GPU): timed alone, a small kernel is mostly dispatch, which one
            compiled graph pays once. With ``False`` the raw medians are used.
        nhwc_convolutions: price each NCHW convolution (``conv2d``) as the NHWC convolution
            of the same sizes (``conv2d_nhwc``, NHWC x HWIO), the form it runs in once the
            end-to-end choice keeps a graph's NHWC candidate
            (:func:`taso_jax.ir.layout.to_nhwc`): the two layouts rank a grouped
            convolution against its dense form differently on XLA:CPU. Other operators are
            priced as they are.

    Each distinct (device kind, operator, attributes, input types) is measured once, ever:
    compiling a kernel takes on the order of a second on a GPU. The cache holds the raw
    times (and the call overhead, under the key ``"call_overhead"``), so calibration can be
    turned on or off without measuring again, each with its spread and the
    :data:`MEASURE_METHOD` it was timed by; a time taken by another method is measured again.
    """

    name = "measured"

    def __init__(self, cache_path: str | bool | None = None, repeats: int = 15,
                 calibrate: bool = True, nhwc_convolutions: bool = False):
        super().__init__()
        self.device = self._device()
        self.repeats = repeats
        self.calibrate = calibrate
        self.nhwc_convolutions = nhwc_convolutions
        self._overhead: float | None = None
        self.measured = 0
        self.measure_seconds = 0.0  # compiling and timing kernels, seconds
        self.estimated = 0  # kernels priced analytically: past measure_until, not measured
        self.unmeasurable: list[str] = []  # kernels that would not run alone, and why
        self.retimed = 0  # pairs of contradicting kernels timed again (see _consistent)
        self.paired = 0  # kernels timed beside a sibling (see _measure_beside)
        # sibling_key -> (node, raw us): the first form of a convolution priced here
        self._anchors: dict[tuple, tuple[Node, float]] = {}
        self._jitted: dict[str, object] = {}  # cache key -> jitted convolution
        # family -> {input shapes: (node, raw us, (flops, bytes))}
        self._families: dict[tuple, dict] = {}
        self._db = None
        self._lock = threading.Lock()
        if cache_path is not False:
            # a file that is not this program's cache is never written or moved; a
            # damaged cache of its own is moved aside (open_cost_cache)
            self._db = open_cost_cache(cache_path or default_cache_path())
        self._analytic = self._fallback()  # opaque and fused operators

    @staticmethod
    def _device() -> str:
        """The cache's device key: JAX's first device, ``"platform:device kind"``."""
        import jax

        dev = jax.devices()[0]
        return f"{dev.platform}:{getattr(dev, 'device_kind', dev.platform)}"

    @staticmethod
    def _fallback() -> AnalyticCostModel:
        """The analytic model that prices what is not measured (opaque operators)."""
        return AnalyticCostModel.for_backend()

    @staticmethod
    def key(node: Node) -> str:
        """Cache key: operator, attributes, input types."""
        return repr((node.op, node.attrs, tuple(t.type for t in node.inputs)))

    def _cost(self, node: Node) -> float:
        return priced_by_kernels(node, self._analytic, self._kernel_cost)

    def _kernel_cost(self, node: Node) -> float:
        """The calibrated measured price (us) of one kernel (not opaque, fused or composed)."""
        node = self._timed_form(node)
        micros = self._priced(node, self.key(node))
        if micros is None:
            return self._analytic.node_cost(node)
        if not self.calibrate:
            return micros
        return max(micros - self.call_overhead_us, 0.0) + self._analytic.launch_us

    def _price(self, node: Node, measure_until: float | None) -> float:
        """:meth:`_cost`, or past ``measure_until`` the analytic price of an unmeasured kernel.

        A search passes its deadline, so that measuring a large model's kernels cannot run
        past its time limit; each kernel so priced is counted in ``estimated``.
        """
        if _passed(measure_until) and self._unmeasured(node):
            self.estimated += 1
            return self._analytic.node_cost(self._timed_form(node))
        return self._cost(node)

    def would_measure(self, node: Node, measure_until: float | None = None) -> bool:
        """Whether :meth:`node_cost` would time a kernel for ``node`` (see ``_would_measure``)."""
        return self._known(node) is None and self._would_measure(node, measure_until)

    def _would_measure(self, node: Node, measure_until: float | None = None) -> bool:
        """Whether :meth:`node_cost` would time a kernel for ``node``.

        It would where :meth:`_unmeasured` and ``measure_until`` has not passed.
        """
        return not _passed(measure_until) and self._unmeasured(node)

    def _unmeasured(self, node: Node) -> bool:
        """Whether ``node`` is priced by a timed kernel that is not in the cache yet.

        Opaque and fused nodes are priced without timing anything; a node priced as its
        composition (``OpDef.composition``) by the kernels of that composition.
        """
        if node.op == "opaque" or OPS[node.op].fusible:
            return False
        parts = composition_nodes(node)
        if parts is not None:
            return any(self._unmeasured(p) for p in parts)
        return self._lookup(self.key(self._timed_form(node))) is None

    def _timed_form(self, node: Node) -> Node:
        """The kernel timed to price ``node``: itself, or its NHWC form (``nhwc_convolutions``)."""
        if self.nhwc_convolutions and node.op == "conv2d":
            from taso_jax.ir.layout import nhwc_form

            return nhwc_form(node)
        return node

    def peak_gflops(self) -> float | None:
        """An upper bound on this device's float32 arithmetic rate (GFLOP/s), or ``None``.

        On a CPU, :data:`CPU_CORE_PEAK_GFLOPS` times the usable cores; on other devices
        ``None`` (a GPU's tensor cores leave no bound worth the risk), and kernels not yet
        measured get no floor but the launch.
        """
        return cpu_peak_gflops() if self.device.startswith("cpu:") else None

    def node_floor(self, node: Node, measure_until: float | None = None) -> float:
        """:meth:`node_cost` where it is known or needs no measurement; else a lower bound.

        A kernel not yet measured, all of whose inputs and outputs are float32 or float64,
        is bounded by its FLOPs at :meth:`peak_gflops` plus one launch (calibrated) and
        costs no measurement. Other dtypes (8- and 16-bit types have far faster
        units) and devices without a bound get the launch alone.
        """
        known = self._known(node)
        if known is None:
            known = self._by_signature.get(self.signature(node))
        if known is not None or not self._would_measure(node, measure_until):
            return known if known is not None else self.node_cost(node, measure_until)
        floor = self._analytic.launch_us if self.calibrate else 0.0
        peak = self.peak_gflops()
        types = [t.type for t in node.inputs] + list(node.types)
        if peak is not None and all(t.dtype in ("float32", "float64") for t in types):
            floor += _work(node)[0] / (peak * 1e3)
        return floor

    def stats(self) -> dict:
        """What this model did, for reports.

        ``name``, ``compiles`` (kernels compiled and timed), ``compile_seconds``,
        ``estimated`` (kernels priced analytically past the deadline).
        """
        return {"name": self.name, "compiles": self.measured,
                "compile_seconds": round(self.measure_seconds, 3), "estimated": self.estimated}

    @property
    def call_overhead_us(self) -> float:
        """Median time of an almost empty ``jax.jit`` call on this device, microseconds."""
        if self._overhead is None:
            self._overhead = self._cached("call_overhead", self._measure_overhead)
        return self._overhead

    def _lookup(self, key: str) -> float | None:
        """The cached raw median for ``key``, or ``None``."""
        if self._db is None:
            return None
        try:
            row = self._db.execute("SELECT micros FROM cost WHERE device=? AND key=? "
                                   "AND method=?", (self.device, key, MEASURE_METHOD)).fetchone()
        except sqlite3.Error as e:
            self._drop_cache(e)
            return None
        return row[0] if row else None

    def _cached(self, key: str, measure) -> float:
        """The cached raw median for ``key``, measured (and stored) on a miss.

        ``measure()`` returns microseconds, or ``(microseconds, spread)`` (see
        :meth:`_robust_time`); the spread is stored beside the time. A cache that fails
        while in use (a disk error, a file locked too long) is dropped with a warning: costs
        are then measured without it, never lost or wrong.
        """
        cached = self._lookup(key)
        if cached is not None:
            return cached
        t0 = time.perf_counter()
        measured = measure()
        self.measure_seconds += time.perf_counter() - t0
        micros, spread = measured if isinstance(measured, tuple) else (measured, None)
        self.measured += 1
        self._store(key, micros, spread)
        return micros

    def _store(self, key: str, micros: float, spread: float | None) -> None:
        if self._db is None:
            return
        try:
            with self._lock:
                self._db.execute(
                    "INSERT OR REPLACE INTO cost (device, key, micros, spread, method) "
                    "VALUES (?, ?, ?, ?, ?)", (self.device, key, micros, spread, MEASURE_METHOD))
                self._db.commit()
        except sqlite3.Error as e:
            self._drop_cache(e)

    def _robust_time(self, run) -> tuple[float, float]:
        """``(microseconds, spread)`` of ``run()``: :func:`.robust_time` at ``repeats``."""
        return robust_time(run, self.repeats)

    def _drop_cache(self, error: Exception) -> None:
        warnings.warn(f"kernel cost cache disabled for this run ({error}); costs are measured "
                      "without it", RuntimeWarning, stacklevel=4)
        self._db = None

    def _measure_overhead(self) -> tuple[float, float]:
        import jax

        x = jax.device_put(np.zeros((1,), np.float32))
        fn = jax.jit(lambda a: a + 1)
        return self._robust_time(lambda: fn(x))

    def _runner(self, node: Node) -> list:
        """:data:`ROUNDS` calls, each running ``node`` once as a jitted kernel.

        On the seeded random inputs of
        :func:`~taso_jax.search._kernel_timing.stand_in_rounds`, one copy a round.
        """
        import jax

        from taso_jax.ir.executor import run_node

        enable_persistent_cache()  # kernels compiled once, across runs
        key = self.key(node)
        fn = self._jitted.get(key) or jax.jit(lambda *a: run_node(node, a))
        if sibling_key(node) is not None:  # an anchor is timed again beside each sibling
            self._jitted[key] = fn
        return [lambda args=args: fn(*args) for args in stand_in_rounds(
            [t.type for t in node.inputs])]

    def _measure(self, node: Node) -> tuple[float, float]:
        return self._robust_time(self._runner(node))

    def _priced(self, node: Node, key: str) -> float | None:
        """The (cached) measured time of ``node`` in microseconds, or ``None``.

        ``None`` means the kernel will not run alone. A kernel timed on its own gets
        stand-in values (:meth:`_runner`), on which a runtime can refuse it (onnxruntime
        refuses an integer ``Div`` whose constant divisor holds a zero, or a ``Gather`` index
        beyond a one-row table). Such a kernel is priced by the analytic model instead, and
        named in :attr:`unmeasurable`: the costs only guide the search, and the end-to-end
        choice times whole graphs.
        """
        try:
            micros = self._consistent(node, key,
                                      self._cached(key, lambda: self._measure_beside(node)))
        except Exception as e:  # noqa: BLE001 - any refusal of a stand-in kernel
            self.unmeasurable.append(f"{node.op}: {type(e).__name__}: "
                                     f"{one_line(str(e), 240)}")
            return None
        siblings = sibling_key(node)
        if siblings is not None:
            self._anchors.setdefault(siblings, (node, micros))
        self._store_sample(node, key, micros)
        return micros

    def _store_sample(self, node: Node, key: str, micros: float) -> None:
        """Keep ``node``'s features and raw time (us) for the calibrated model's curves."""
        if self._db is None or node.op not in OPS:
            return
        from taso_jax.search.calibrated import kernel_features

        f = kernel_features(node)
        try:
            with self._lock:
                self._db.execute(
                    "INSERT OR REPLACE INTO samples (device, key, op, family, flops, bytes, "
                    "narrow, micros, outputs, groups, rows, inner, cols) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (self.device, key, f.op, f.family, f.flops, f.bytes, int(f.narrow), micros,
                     f.outputs, f.groups, f.rows, f.inner, f.cols))
                self._db.commit()
        except sqlite3.Error as e:
            self._drop_cache(e)

    def _measure_beside(self, node: Node) -> tuple[float, float | None]:
        """``(microseconds, spread)`` of ``node``, timed beside its anchor sibling if any.

        A convolution whose other form (:func:`sibling_key`, another ``groups``) was
        priced first by this cost model, the anchor, is timed with it in alternating rounds
        (:meth:`_retime_pair`) and priced at the anchor's price times the ratio of the two;
        the spread is then not recorded (``None``): the forms, priced alone at different
        moments of a loaded machine, ranked differently from one cold cache to the next.
        Other kernels, and the first form priced, are timed alone (:meth:`_measure`).
        """
        siblings = sibling_key(node)
        anchor = self._anchors.get(siblings) if siblings is not None else None
        if anchor is None or self.key(anchor[0]) == self.key(node):
            return self._measure(node)
        other, other_micros = anchor
        mine, theirs = self._retime_pair(node, other)
        self.paired += 1
        return other_micros * mine / max(theirs, 1e-9), None

    def _consistent(self, node: Node, key: str, micros: float) -> float:
        """``micros`` for ``node``, or its time relative to a kernel it contradicts.

        Kernels of one family (operator, attributes, input ranks and dtypes) are priced
        alone, at different moments, on a machine whose speed drifts, and a pair of prices
        taken in different states can invert a decision. So ``node``'s price (``micros``,
        its raw time in microseconds under cache key ``key``) is checked against each kernel of
        its family already priced here whose input shapes are all at least as large, or all
        at most as large. It contradicts one when it is :data:`CONTRADICTION` times dearer
        than a larger kernel (or cheaper than a smaller one), or when the larger of the two
        costs more than :data:`CONTRADICTION` times the smaller's price scaled by their
        ratio of work (the larger of the FLOP and byte ratios). Then the two are timed again
        in alternating rounds, under the same conditions, and ``node`` is priced at the
        other's price times the ratio of the two. Prices already handed out never change
        (the search adds and subtracts them). At most :data:`MAX_RETIMED` pairs per cost
        model. Returns microseconds.
        """
        family = (node.op, node.attrs, tuple((len(t.shape), t.dtype) for t in node.inputs))
        shapes = tuple(t.shape for t in node.inputs)
        members = self._families.setdefault(family, {})
        if shapes in members:
            return micros
        work = _work(node)
        for other_shapes, (other, other_micros, other_work) in list(members.items()):
            if self.retimed >= MAX_RETIMED:
                break
            le = all(a <= b for sa, sb in zip(shapes, other_shapes, strict=True)
                     for a, b in zip(sa, sb, strict=True))
            ge = all(a >= b for sa, sb in zip(shapes, other_shapes, strict=True)
                     for a, b in zip(sa, sb, strict=True))
            if not (le or ge):
                continue
            (small, small_work), (large, large_work) = (
                ((micros, work), (other_micros, other_work)) if le
                else ((other_micros, other_work), (micros, work)))
            scale = max(large_work[0] / max(small_work[0], 1.0),
                        large_work[1] / max(small_work[1], 1.0), 1.0)
            if small <= CONTRADICTION * large and large <= CONTRADICTION * small * scale:
                continue
            self.retimed += 1
            mine, theirs = self._retime_pair(node, other)
            micros = other_micros * mine / max(theirs, 1e-9)
            self._store(key, micros, None)
            break
        members[shapes] = (node, micros, work)
        return micros

    def _retime_pair(self, a: Node, b: Node) -> tuple[float, float]:
        """Fastest single runs of ``a`` and ``b``, timed in alternating rounds (us).

        Each is run once, warmed up, first; as in :meth:`_robust_time`, a kernel whose runs
        would last more than :data:`KERNEL_BUDGET_US` then gets fewer runs a round (at least
        one) and no warm-ups (two of a Llama block's kernels at S=1024 took 5-7 s to retime
        on the loaded 2-core machine, past the search's share of a 10 s limit).
        """
        from taso_jax.ir.executor import time_function

        runs = [self._runner(a), self._runner(b)]
        per_round = [max(3, self.repeats // ROUNDS)] * 2
        # one warmed-up run of each first: a long kernel's rounds are cut before they start
        best = [float(min(time_function(r[0], repeats=1, warmup=1))) for r in runs]
        long = [t * self.repeats > KERNEL_BUDGET_US for t in best]
        for i in (0, 1):
            if long[i]:
                per_round[i] = max(1, int(KERNEL_BUDGET_US / (best[i] * ROUNDS)))
        for r in range(2 * ROUNDS):
            order = (0, 1) if r % 2 == 0 else (1, 0)
            for i in order:
                run = runs[i][r % len(runs[i])]
                warmup = 2 if r < 2 * len(runs[i]) and not long[i] else 0
                t = time_function(run, repeats=per_round[i], warmup=warmup)
                best[i] = min(best[i], float(min(t)))
        return best[0], best[1]
