"""Run a :class:`~taso_jax.ir.graph.Graph` as one ``jax.jit``-compiled function.

Weight-only subgraphs (nodes whose inputs are all weights, e.g. a concatenated or enlarged
kernel) are evaluated once, ahead of time, when the graph is compiled, as TASO does for
weights; the jitted function receives their values as arguments and computes only what
depends on runtime inputs. Opaque nodes run the computation their front door gave them
(:class:`~taso_jax.ir.opaque.OpaqueOp`), so every imported graph executes.
"""

from __future__ import annotations

import math
import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence

import numpy as np

from taso_jax._compile_cache import enable_persistent_cache
from taso_jax.ir.graph import Graph, Node, Tensor
from taso_jax.ops import OPS, is_float_dtype
from taso_jax.ops._lazy import LazyModule

jax = LazyModule("jax")  # imported at first use: see taso_jax.ops._lazy
jnp = LazyModule("jax.numpy")

__all__ = ["as_jax_constant", "device_constant", "CompiledGraph", "StagedGraph",
           "read_transposed", "compile_graph", "discard_compiled", "folded_values",
           "fold_values", "forget_compiled", "release_memory", "run_node", "run_nodes",
           "time_function", "time_interleaved", "random_array", "random_inputs"]


def as_jax_constant(value):
    """A weight as a JAX array, 64-bit integers saturated to 32 bits when JAX runs in 32.

    Without ``jax_enable_x64`` JAX stores int64 as int32 and wraps larger values: ONNX's
    "to the end" slice bound ``INT64_MAX`` became -1 and a region dropped its last element
    (silero-vad). Saturating keeps such bounds meaning "to the end" (and ``INT64_MIN``
    "from the start").
    """
    if (isinstance(value, np.ndarray | np.generic) and value.dtype in (np.int64, np.uint64)
            and not jax.config.jax_enable_x64):
        info = np.iinfo(np.int32)
        value = np.clip(value, info.min, info.max).astype(np.int32)
    return jnp.asarray(value)


class _SharedValues:
    """Values keyed by the identity of the objects they were made from, all held weakly.

    An entry is ``key -> (sources, values)``: weak references to the objects the values
    were computed from, checked on lookup (an ``id`` can be reused once its object is
    gone), and weak references to the values, so an entry keeps neither alive (only the
    nodes in its key, until swept). Dead entries are swept when the table has doubled since
    the last sweep. Traced values are never stored.
    """

    def __init__(self):
        self._table: dict = {}
        self._lock = threading.Lock()
        self._swept = 64

    def get(self, key, sources: Sequence) -> tuple | None:
        with self._lock:
            hit = self._table.get(key)
        if hit is None or not all(r() is s for r, s in zip(hit[0], sources, strict=True)):
            return None
        values = tuple(v() for v in hit[1])
        return values if all(v is not None for v in values) else None

    def put(self, key, sources: Sequence, values: Sequence) -> None:
        if any(isinstance(v, jax.core.Tracer) for v in values):
            return  # made under a trace: it must not leave it
        try:
            entry = (tuple(map(weakref.ref, sources)), tuple(map(weakref.ref, values)))
        except TypeError:  # something that takes no weak reference: not shared
            return
        with self._lock:
            self._table[key] = entry
            if len(self._table) > 2 * self._swept:
                self._table = {k: e for k, e in self._table.items()
                               if all(r() is not None for r in (*e[0], *e[1]))}
                self._swept = max(len(self._table), 64)


_SHARED = _SharedValues()


def device_constant(value):
    """:func:`as_jax_constant`, shared by every graph that holds the same read-only array.

    A NumPy array that cannot be written to, down to its base (the ONNX importer marks its
    initializers so; :func:`_frozen`), is copied to the device once, however many candidate
    graphs of a search fold it: each
    compiled candidate of a 100 MB ResNet-50 used to hold its own device copy of every
    weight. The copy lives only while some compiled graph still holds it. Writable arrays
    (a user's NumPy weights, which may change in place) are copied afresh every time.
    """
    if not (isinstance(value, np.ndarray) and _frozen(value)):
        return as_jax_constant(value)
    hit = _SHARED.get(("weight", id(value)), (value,))
    if hit is not None:
        return hit[0]
    out = as_jax_constant(value)
    _SHARED.put(("weight", id(value)), (value,), (out,))
    return out


def _frozen(value) -> bool:
    """Whether ``value`` cannot change.

    A concrete JAX array, or a NumPy array read-only all the way down to its buffer (a
    read-only view of a writable array can still change).
    """
    if isinstance(value, np.ndarray):
        a = value
        while isinstance(a, np.ndarray):
            if a.flags.writeable:
                return False
            a = a.base
        return a is None or isinstance(a, bytes)
    return isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer)


def _cone(inputs: Sequence, cones: dict) -> tuple | None:
    """The ``(weight node, frozen array)`` pairs a value is computed from.

    ``None`` when some array can change, or when the value reads no weight (nothing to key
    it by).
    """
    out, seen = [], set()
    for t in inputs:
        c = cones[t]
        if c is None:
            return None
        for w, a in c:
            if w not in seen:
                seen.add(w)
                out.append((w, a))
    return tuple(out) or None


def run_node(node: Node, args: Sequence) -> tuple:
    """Evaluate one operator or opaque node on JAX arrays; returns a tuple of outputs.

    An opaque node runs its :class:`~taso_jax.ir.opaque.OpaqueOp` (an ONNX node through
    onnxruntime, a jaxpr equation through JAX).
    """
    if node.op == "opaque":
        return tuple(node.attr("call").evaluate(node, args))
    out = OPS[node.op].ref(*args, **dict(node.attrs))
    return tuple(out) if isinstance(out, tuple | list) else (out,)


#: Nodes from which :func:`run_nodes` evaluates them as one ``jax.jit``-compiled call rather
#: than one operator at a time. Each operator run alone compiles a small executable per
#: primitive and shape: the 105 weight-only nodes of a rewritten PP-OCRv4 recognizer
#: (padded and merged kernels) took 5.1-9.3 s that way and 1.3-1.7 s as one call
#: (2026-11-29, 2 cores, XLA:CPU, a fresh process each).
JIT_NODES = 4


def run_nodes(nodes: Sequence[Node], value: Callable) -> list[tuple]:
    """Evaluate ``nodes`` (in topological order), in one ``jax.jit``-compiled call if it can.

    ``value(tensor)`` gives each tensor the nodes read and do not make themselves (a JAX
    or NumPy array). Returns each node's outputs as a tuple, in ``nodes`` order. Fewer
    than :data:`JIT_NODES` nodes, an opaque node (it runs outside JAX), values under a
    trace (the caller's own ``jax.jit``) or an operator whose reference function reads
    values (it cannot be traced) run one operator at a time instead, with the same results
    up to XLA's fusion of neighbouring operators (the same operations, in the same order;
    a division may become a multiplication by a reciprocal).
    """
    produced = {t for n in nodes for t in n.outputs}
    ext = list(dict.fromkeys(t for n in nodes for t in n.inputs if t not in produced))
    args = [value(t) for t in ext]

    def evaluate(vals):
        env = dict(zip(ext, vals, strict=True))
        outs = []
        for n in nodes:
            res = run_node(n, [env[t] for t in n.inputs])
            env.update(zip(n.outputs, res, strict=True))
            outs.append(res)
        return outs

    if (len(nodes) >= JIT_NODES and not any(n.op == "opaque" for n in nodes)
            and not any(isinstance(a, jax.core.Tracer) for a in args)):
        try:
            return [tuple(o) for o in jax.jit(evaluate)(args)]
        except jax.errors.JAXTypeError:
            pass  # an operator that reads values: one at a time
    return [tuple(o) for o in evaluate(args)]


def fold_values(weights: Sequence[Node], nodes: Sequence[Node], values: Mapping,
                wanted: Collection[Tensor] | None = None) -> dict:
    """The values of weight-only ``nodes`` computed from ``values`` (weight name -> array).

    ``weights`` are the weight nodes read (each at least once by ``nodes`` or by the
    caller), ``nodes`` the operators on them, in topological order. Returns ``{tensor:
    value}`` for the weights (as given, not copied) and every output of ``nodes`` (JAX
    arrays); with ``wanted``, only what those tensors need is computed: an intermediate
    whose consumers' values are already shared is not computed again (a merged kernel's
    padded halves, once the merge is held by another candidate).

    A value computed from frozen weight arrays only (read-only NumPy arrays, concrete JAX
    arrays) is shared with every other graph that folds the same node from the
    same arrays: the IR is hash-consed, so two candidates that fold one batchnorm into one
    kernel hold the same node. It is looked up by the node and which weight holds which
    array, and computed and held once (weakly: it lives while some graph holds it). What no
    graph holds is computed in one call (:func:`run_nodes`).
    """
    env, cones = {}, {}
    for n in weights:
        t, value = n.outputs[0], values[n.name]
        env[t] = value  # copied to the device when read
        cones[t] = ((n, value),) if _frozen(value) else None
    missing = []  # (node, key, arrays) of the values no other graph has computed
    for n in nodes:
        cone = _cone(n.inputs, cones)
        # keyed by which weight holds which array: one array under two names is not the
        # same input twice
        key = None if cone is None else (n, *((w, id(a)) for w, a in cone))
        arrays = None if cone is None else [a for _, a in cone]
        got = None if key is None else _SHARED.get(key, arrays)
        if got is None:
            missing.append((n, key, arrays))
        else:
            env.update(zip(n.outputs, got, strict=True))
        for t in n.outputs:
            cones[t] = cone
    if missing and wanted is not None:
        missing = _needed_for(missing, wanted, env)
    if missing:
        outs = run_nodes([n for n, _, _ in missing], lambda t: _on_device(t, env))
        for (n, key, arrays), got in zip(missing, outs, strict=True):
            if key is not None:
                _SHARED.put(key, arrays, got)
            env.update(zip(n.outputs, got, strict=True))
    return env


def _needed_for(missing: list, wanted: Collection[Tensor], env: Mapping) -> list:
    """The entries of ``missing`` that computing the ``wanted`` tensors needs.

    ``missing`` holds ``(node, key, arrays)`` in topological order; ``env`` the values
    already known (weights, and what other graphs computed and share).
    """
    needed: set[Node] = set()
    stack = [t for t in wanted if t not in env]
    while stack:
        t = stack.pop()
        if t.node not in needed:
            needed.add(t.node)
            stack.extend(x for x in t.node.inputs if x not in env)
    return [m for m in missing if m[0] in needed]


def _on_device(t, env: dict):
    """``env[t]``, a weight copied to the device (once per read-only array)."""
    return device_constant(env[t]) if t.node.op == "weight" else env[t]


def read_transposed(graph: Graph) -> set[Node]:
    """Weight-only transposes read only by runtime matrix products.

    These stay in the runtime stage: XLA reads the weight transposed inside the product (the
    transpose becomes the dot's dimension numbers), while a folded copy costs the memory of
    the weight once more and can run slower: GPT-2's tied output projection, ``h @ wte.T``
    on XLA:CPU, took 46 ms with ``wte [50257, 768]`` read transposed and 60 ms with the
    folded ``[768, 50257]`` copy (2 cores, float32, 128 tokens).
    """
    wo = graph.weight_only
    users: dict = {}
    for n in graph.nodes:
        for t in n.inputs:
            users.setdefault(t, []).append(n)
    outputs = set(graph.outputs)
    return {n for n in graph.nodes
            if n.op == "transpose" and n in wo and n.outputs[0] not in outputs
            and n.inputs[0].node.op != "input"
            and users.get(n.outputs[0])
            and all(u.op == "matmul" and u not in wo for u in users[n.outputs[0]])}


class StagedGraph:
    """A graph split into a weight stage and a runtime stage, as two pure JAX functions.

    ``fold(weights)`` maps the weight values (a list in ``weight_names`` order) to the values
    of the weight-only tensors that the runtime stage reads; ``run(consts, *inputs)`` computes
    the outputs from those and the runtime inputs (``graph.inputs`` order). Both can be
    ``jax.jit``-ed, differentiated and vmapped; ``run(fold(w), *x)`` is the whole graph.
    Precomputing ``fold`` once per weight value is what makes a merged or folded kernel free.
    A weight-only transpose read only by matrix products is left to the runtime stage,
    where XLA reads the weight transposed in the product (:func:`read_transposed`).
    """

    def __init__(self, graph: Graph):
        self.graph = graph
        wo = graph.weight_only
        read_in_product = read_transposed(graph)
        fold_nodes, runtime_nodes = [], []
        for n in graph.nodes:
            if n.op in ("input", "weight"):
                continue
            (fold_nodes if n in wo and n not in read_in_product else runtime_nodes).append(n)
        self.weight_names = sorted({n.name for n in graph.nodes if n.op == "weight"})
        needed = {t for n in runtime_nodes for t in n.inputs
                  if t.node in wo and t.node not in read_in_product}
        needed |= {t for t in graph.outputs if t.node in wo}
        pos = {n: i for i, n in enumerate(graph.nodes)}
        self.const_keys = sorted(needed, key=lambda t: (pos[t.node], t.index))
        self._fold_nodes, self._runtime_nodes = fold_nodes, runtime_nodes
        self._inputs = [n.outputs[0] for n in graph.inputs]

    def fold(self, weights: Sequence, host_weights: bool = False) -> list:
        """Weight-only tensor values (``const_keys`` order) from weight values.

        A value computed from frozen weight arrays only (read-only NumPy arrays, concrete
        JAX arrays) is shared with every other graph that folds the same node from the same
        arrays: the IR is hash-consed, so two candidates that fold one batchnorm into one
        kernel hold the same node. It is looked up by the node and which weight holds which
        array, and computed and held once (weakly: it lives while some graph holds it).
        With ``host_weights``, a weight that the runtime stage reads as it is comes back as
        given, not copied to the device (what an export to ONNX wants).
        """
        by_name = dict(zip(self.weight_names, weights, strict=True))
        env = fold_values([n for n in self.graph.nodes if n.op == "weight"], self._fold_nodes,
                          by_name, wanted=self.const_keys)
        return [env[t] if host_weights and t.node.op == "weight" else _on_device(t, env)
                for t in self.const_keys]

    def fold_key(self) -> tuple:
        """What :meth:`fold` computes, as hashable nodes: equal keys fold equal values.

        The IR is hash-consed, so the weight stages of two graphs that differ only in their
        runtime part (one function called at two batch sizes) have equal keys.
        """
        return (tuple(self.weight_names), tuple(self._fold_nodes), tuple(self.const_keys),
                tuple(n for n in self.graph.nodes if n.op == "weight"))

    def fold_function(self) -> Callable[[Sequence], list]:
        """:meth:`fold` as a function that holds the weight stage's nodes, not the graph.

        A compiled weight stage can then be shared by graphs of equal :meth:`fold_key`
        without keeping any one of them alive.
        """
        names, fold_nodes, const_keys, weights = self.fold_key()

        def fold(values: Sequence) -> list:
            env = fold_values(weights, fold_nodes, dict(zip(names, values, strict=True)))
            return [_on_device(t, env) for t in const_keys]

        return fold

    def run(self, consts: Sequence, *args) -> tuple:
        """Graph outputs from folded constants and runtime inputs."""
        env = dict(zip(self.const_keys, consts, strict=True))
        env.update(zip(self._inputs, args, strict=True))
        for n in self._runtime_nodes:
            for t, v in zip(n.outputs, run_node(n, [env[t] for t in n.inputs]), strict=True):
                env[t] = v
        return tuple(env[t] for t in self.graph.outputs)

    def weights_of(self, graph: Graph | None = None) -> list:
        """The weight values of ``graph`` (default: this graph) in ``weight_names`` order."""
        g = graph or self.graph
        return [g.weights[n] for n in self.weight_names]


class CompiledGraph:
    """A graph compiled with ``jax.jit``; call with the runtime inputs in ``graph.inputs`` order.

    Attributes:
        graph: the compiled graph.
        folded: values of the weight-only tensors that the runtime part reads (device arrays).
        fold_seconds: wall time spent evaluating weight-only subgraphs (seconds).
    """

    def __init__(self, graph: Graph):
        self.graph = graph
        self.staged = StagedGraph(graph)
        t0 = time.perf_counter()
        self.folded = self.staged.fold(self.staged.weights_of())
        self.fold_seconds = time.perf_counter() - t0
        self._const_keys = self.staged.const_keys
        self._jitted = jax.jit(self.staged.run)

    def __call__(self, *args) -> tuple:
        """Run on runtime inputs (arrays in ``graph.inputs`` order); returns output arrays."""
        if len(args) != len(self.graph.inputs):
            names = [n.name for n in self.graph.inputs]
            raise TypeError(f"expected {len(names)} inputs {names}, got {len(args)}")
        return self._jitted(self.folded, *args)


def compile_graph(graph: Graph) -> CompiledGraph:
    """Fold weight-only subgraphs and ``jax.jit`` the rest (see :class:`CompiledGraph`).

    The last :data:`COMPILED_CACHE` graphs compiled are kept (by object identity), so the
    end-to-end choice, the report's timing and the export of one result compile it once:
    a 385-operator OCR model took about 4 s per compile on 2 cores. Compiles go through
    XLA's persistent cache (:func:`taso_jax._compile_cache.enable_persistent_cache`).
    """
    enable_persistent_cache()
    with _COMPILED_LOCK:
        hit = _COMPILED.get(id(graph))
        if hit is not None and hit.graph is graph:
            _COMPILED.move_to_end(id(graph))
            return hit
    compiled = CompiledGraph(graph)
    with _COMPILED_LOCK:
        _COMPILED[id(graph)] = compiled
        while len(_COMPILED) > COMPILED_CACHE:
            _COMPILED.popitem(last=False)
    return compiled


def folded_values(graph: Graph) -> tuple[list, list]:
    """``(tensors, values)``: the weight-only tensors the runtime part of ``graph`` reads.

    Taken from :func:`compile_graph`'s cache when the graph was compiled, otherwise folded
    without compiling or caching anything (an export to ONNX needs the values, not an
    executable: each cached candidate of a 100 MB model held its folded weights); weights
    read as they are then come back as the graph holds them (host arrays, not copied).
    """
    with _COMPILED_LOCK:
        hit = _COMPILED.get(id(graph))
    if hit is not None and hit.graph is graph:
        return list(hit._const_keys), list(hit.folded)
    staged = StagedGraph(graph)
    return list(staged.const_keys), staged.fold(staged.weights_of(), host_weights=True)


#: Compiled graphs kept by :func:`compile_graph` (least recently used dropped).
COMPILED_CACHE = 8
_COMPILED: OrderedDict[int, CompiledGraph] = OrderedDict()
_COMPILED_LOCK = threading.Lock()


def forget_compiled(keep: Sequence[Graph] = ()) -> None:
    """Drop the compiled graphs :func:`compile_graph` keeps, except those of ``keep``.

    After an end-to-end choice only the input and the chosen graph are run again; the
    other candidates' executables and folded weights (about 150 MB each for ResNet-50)
    would otherwise stay until pushed out.
    """
    ids = {id(g) for g in keep}
    with _COMPILED_LOCK:
        for k in [k for k in _COMPILED if k not in ids]:
            del _COMPILED[k]
    release_memory()


def discard_compiled(graph: Graph) -> None:
    """Drop ``graph``'s compiled form from :func:`compile_graph`'s cache, if it is there."""
    with _COMPILED_LOCK:
        hit = _COMPILED.get(id(graph))
        if hit is not None and hit.graph is graph:
            del _COMPILED[id(graph)]


def release_memory() -> None:
    """Collect garbage and hand the C heap's free pages back to the system (glibc only).

    XLA compiles and onnxruntime sessions free their scratch memory into ``malloc``'s
    arenas, which keep it: after timing five ResNet-50 candidates, ``malloc_trim`` took
    the resident size from 877 MB to 660 MB with every candidate still alive. Without
    glibc (macOS, musl) only the garbage collection runs.
    """
    import gc

    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _malloc_trim():
    global _TRIM
    if _TRIM is False:
        import ctypes
        import ctypes.util

        try:
            _TRIM = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _TRIM = None
    return _TRIM


_TRIM = False


#: Whether a dtype is a floating type, bfloat16 and the other ml_dtypes floats included
#: (read without importing JAX, which the ONNX import's probes must not load).
_is_float = is_float_dtype


def random_array(shape, dtype, rng: np.random.Generator, high: int | range | None = None
                 ) -> np.ndarray:
    """A random array of ``shape`` and ``dtype``.

    Floats are standard normal, booleans random, integers in ``[0, high)`` (valid token ids
    and masks for the shared models; ``high`` 8 by default), or drawn from ``high`` when it
    is a ``range`` (sequence lengths: ``range(1, T + 1)``). With ``high`` given, a float
    array holds such indices too: a float input that a model casts to indices (Keras
    embedding ids) must stay inside its table.
    """
    if np.dtype(dtype) == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    if _is_float(dtype) and high is None:
        return rng.standard_normal(shape).astype(dtype)
    low, stop = (high.start, high.stop) if isinstance(high, range) else (
        0, 8 if high is None else high)
    return rng.integers(low, stop, shape).astype(dtype)


def random_inputs(graph: Graph, seed: int = 0) -> list[np.ndarray]:
    """Seeded random values for the graph's runtime inputs (:func:`random_array`).

    An input that the ONNX import found indexing a table (an integer one of fewer than 8
    rows, or a float one cast to indices) is drawn below that size, and a sequence length
    inside its ``range``
    (``graph.meta["integer_input_bounds"]``,
    :func:`taso_jax.frontends.onnx_io.index_bounds`). An input that carries a default (an
    ONNX initializer named among the graph's inputs, ``graph.meta["input_defaults"]``) is
    given its default: what a caller who does not override it feeds (a sequence position
    drawn at random indexed past the sequence).
    """
    rng = np.random.default_rng(seed)
    bounds = graph.meta.get("integer_input_bounds") or {}
    defaults = graph.meta.get("input_defaults") or {}
    return [np.array(defaults[n.name]) if n.name in defaults
            else random_array(n.types[0].shape, n.types[0].dtype, rng, bounds.get(n.name))
            for n in graph.inputs]


def _blocker() -> Callable:
    """``jax.block_until_ready``, or no wait where JAX was never imported.

    A timing of onnxruntime sessions, whose results are NumPy arrays, then does not import it.
    """
    if "jax" in sys.modules:
        return jax.block_until_ready
    return lambda x: x


def time_function(fn: Callable[[], object], repeats: int = 20, warmup: int = 2) -> list[float]:
    """Wall times in microseconds of ``fn()`` (blocking on JAX results), after warm-up."""
    block = _blocker()
    for _ in range(warmup):
        block(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        block(fn())
        times.append((time.perf_counter() - t0) * 1e6)
    return times


def time_interleaved(fns: Sequence[Callable[[], object]], repeats: int = 20,
                     warmup: int = 2, deadline: float | None = None,
                     min_sample_us: float | None = None,
                     min_seconds: float = 0.0,
                     call_us: float | None = None,
                     least: int | None = None) -> list[list[float]]:
    """Microseconds per call of each ``fn()``, sampled round robin ``repeats`` times.

    Each is warmed up first; interleaving makes machine noise hit all of them alike, so
    their medians can be compared (a ratio taken in one loop); the rounds rotate the order,
    forwards then backwards, so every function runs in every position, and after each of
    its neighbours in ``fns``, equally often. A sample
    is the mean of enough calls (each one blocked on) that the fastest function's sample
    lasts ``min_sample_us`` (default :data:`MIN_SAMPLE_US`): one call of a 2 ms function
    on 2 shared cores varies by +-50% from call to call, and a round's verdict then says
    little. With a ``deadline`` (a ``time.perf_counter()`` value) the rounds stop once it
    has passed and at least ``least`` (default :data:`MIN_ROUNDS`) were run. With
    ``min_seconds``, rounds go on past ``repeats`` until the loop has lasted that long, up
    to ``5 * repeats`` rounds: short calls get more rounds, long ones no more. ``call_us``:
    microseconds the fastest call is known to take (the decorator has timed the original),
    which spares the one call of each that otherwise sizes the samples.
    """
    block = _blocker()
    for _ in range(warmup):
        for fn in fns:
            block(fn())
    once = [time_function(fn, repeats=1, warmup=0)[0] for fn in fns] if call_us is None \
        else [call_us]
    want = MIN_SAMPLE_US if min_sample_us is None else min_sample_us
    calls = max(1, min(MAX_CALLS, math.ceil(want / max(min(once), 1.0))))
    times: list[list[float]] = [[] for _ in fns]
    pairs = list(zip(fns, times, strict=True))
    orders = [pairs[k:] + pairs[:k] for k in range(len(pairs))]
    if len(pairs) > 2:
        back = pairs[::-1]
        orders += [back[k:] + back[:k] for k in range(len(back))]
    started = time.perf_counter()
    for r in range(5 * repeats if min_seconds > 0 else repeats):
        if (deadline is not None and r >= (MIN_ROUNDS if least is None else least)
                and time.perf_counter() > deadline):
            break
        if r >= repeats and time.perf_counter() - started >= min_seconds:
            break
        # each round starts one function further on, the functions in order, then as many
        # rounds in reverse order: every function runs in every position, and after each of
        # its neighbours in the list, equally often. The function run second in a round
        # measured 3-5% slower than the same function run first (flax BERT block, 2 cores),
        # and the function run just before matters too: on a 1-D NasRNN (16 MB of weights,
        # a 32 MB cache) one compiled function measured 1.59x when it always ran right after
        # jax.jit of the original, and 1.94-2.07x when it ran after a function sharing its
        # weights (docs/benchmarks.md, 2026-11-27). For two functions this is the order
        # reversed every other round, as before.
        for fn, ts in orders[r % len(orders)]:
            t0 = time.perf_counter()
            for _ in range(calls):
                block(fn())
            ts.append((time.perf_counter() - t0) * 1e6 / calls)
    return times


#: Microseconds a timing sample lasts at least (see :func:`time_interleaved`).
MIN_SAMPLE_US = 5000.0
#: Calls a timing sample averages at most.
MAX_CALLS = 1000
#: Rounds a deadline-bounded timing runs at least (a median of fewer says little).
MIN_ROUNDS = 3


def evaluate(graph: Graph, inputs: Sequence, weights=None) -> tuple:
    """Evaluate a graph eagerly, operator by operator (no ``jax.jit``).

    Used for small graphs such as substitution patterns, where compiling would cost more
    than running. ``weights`` overrides ``graph.weights`` by name.
    """
    weights = graph.weights if weights is None else weights
    env = dict(zip((n.outputs[0] for n in graph.inputs), inputs, strict=True))
    for n in graph.nodes:
        if n.op == "input":
            continue
        if n.op == "weight":
            env[n.outputs[0]] = as_jax_constant(weights[n.name])
            continue
        for t, v in zip(n.outputs, run_node(n, [env[t] for t in n.inputs]), strict=True):
            env[t] = v
    return tuple(env[t] for t in graph.outputs)
