"""``@taso_jax.optimize``: make a JAX function faster, used the way ``jax.jit`` is.

On the first call for a given signature (pytree structure, shapes and dtypes of the array
leaves, values of the static leaves) the function is traced to a jaxpr, imported into the
graph IR (:mod:`taso_jax.frontends.jaxpr_io`), optimized by the backtracking search, and
split into two jitted stages (:class:`taso_jax.ir.executor.StagedGraph`):

* ``fold(weights)``: the weight-only subgraphs (a concatenation of kernels for merged matmuls,
  an enlarged or batchnorm-scaled kernel). It runs once per distinct set of weight arrays
  (recognized by identity, as JAX arrays are immutable) and its results are reused;
* ``run(folded, *inputs)``: everything that depends on the runtime inputs.

Before the optimized function is used, its outputs are compared with ``jax.jit`` of the
original function on the call's own arguments (random values where they are tracers). If
anything in that pipeline fails, or the outputs differ, the signature falls back to
``jax.jit`` of the original function and a warning says why: never a wrong answer.

Errors in the user's function itself (Python control flow on traced values, a shape error)
are raised as they would be by ``jax.jit``, with a note added.

Under ``jax.grad``, ``jax.vmap`` or an outer ``jax.jit`` the two stages are traced as
ordinary JAX functions, so transformations work; custom derivative rules
(``jax.custom_jvp``/``custom_vjp``) inside the function are inlined, so gradients are those
of the primal computation.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import inspect
import threading
import time
import warnings
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from taso_jax.frontends import graph_cache
from taso_jax.frontends.jaxpr_io import (
    TracedFunction,
    _fn_name,
    _is_array_leaf,
    leaves_for_call,
    normalize_argnums,
    trace_function,
)
from taso_jax.ir.executor import StagedGraph, time_interleaved
from taso_jax.ir.graph import Graph
from taso_jax.report import compare_outputs, search_report
from taso_jax.search.backtracking import SearchResult
from taso_jax.search.choose import confirm_faster, device_name
from taso_jax.search.options import SEARCH_REVISION, OptimizeOptions

__all__ = ["OptimizedFunction", "optimize_function"]

#: The optimized function must beat ``jax.jit`` of the original by this factor (median of
#: the per-round ratios) and pass a signed-rank test
#: (:func:`taso_jax.search.choose.paired_speedup`) to be used. Medians of two functions
#: compared as a whole spread up to ~10% on a 2-core CPU (a flax BERT block with nothing
#: rewritten was once taken as 1.05x faster and ran 0.72x); the paired test sees each
#: round's load on both.
MIN_SPEEDUP = 1.03
#: The decorator's default search time limit in seconds (users of jax.jit expect a first
#: call in seconds; the command line's default is the options record's 60 s).
DECORATOR_TIME_LIMIT = 10.0
#: Signatures (shapes, dtypes, static values) kept compiled per decorated function at most;
#: the least recently called is dropped (60 shapes had held 413 MB against jax.jit's 176).
SIGNATURE_CACHE = 32

#: The first call's stage that searches: the backtracking search, the searches that
#: second-guess its cost model, and the end-to-end choice among their candidates (the
#: report's ``search`` seconds count the backtracking search alone).
SEARCH_STAGE = "search and choice"

#: How ``original_kept`` starts where the time limit passed after the search.
_PAST_LIMIT = "not compiled, checked or timed against jax.jit"
#: Interleaved runs of each when the optimized function is timed against the original.
BASELINE_REPEATS = 25


def _package_version() -> str:
    try:
        from importlib.metadata import version

        return version("taso_jax")
    except Exception:  # not installed as a distribution (a source checkout)
        return "source"


class _BackgroundWorker:
    """One daemon thread that runs background optimizations in turn.

    At interpreter exit the optimizations not yet started are dropped and the one running
    (bounded by its time limit) is waited for, so exiting never waits for a queue.
    """

    def __init__(self):
        import queue

        self._jobs: queue.Queue = queue.Queue()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="taso_jax-background",
                                        daemon=True)
        self._thread.start()
        atexit.register(self._stop)

    def submit(self, fn, *args):
        from concurrent.futures import Future

        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args = job
            if self._stopping or not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits
                future.set_exception(e)

    def _stop(self) -> None:
        self._stopping = True
        self._jobs.put(None)
        self._thread.join(timeout=120)


_WORKER: _BackgroundWorker | None = None
_WORKER_LOCK = threading.Lock()


def _background_worker() -> _BackgroundWorker:
    global _WORKER
    with _WORKER_LOCK:
        if _WORKER is None:
            _WORKER = _BackgroundWorker()
        return _WORKER


#: Background optimizations queued per decorated function at most (``mode="background"``).
MAX_PENDING = 8
#: Marks a signature whose background trace failed (the function does not trace).
_UNTRACEABLE = object()


class _Fallback(Exception):
    """Internal: the optimized pipeline failed for this signature."""


@dataclass
class _Entry:
    """Everything compiled for one call signature."""

    out_tree: object
    jit_original: Callable
    graph: Graph | None = None
    result: object = None
    staged: object = None
    fold: Callable | None = None
    run: Callable | None = None
    run_donating: Callable | None = None  # run, donating the inputs the user donates
    weight_slots: list = field(default_factory=list)  # per weight name: leaf index or None
    constants: dict = field(default_factory=dict)
    fallback: str | None = None
    original_kept: str | None = None  # why jax.jit of the original runs (no fallback: a choice)
    report: dict = field(default_factory=dict)
    folded_for: tuple = ()  # (weight leaves kept alive, folded values, NumPy copies)
    folded_ids: list = field(default_factory=list)  # id() of each of those weight leaves
    full_precision: bool = False  # the stages' products run at full float32 precision
    last_call: tuple | None = None  # (arguments, array leaves) of the last concrete call
    kinds: list = field(default_factory=list)  # per array leaf: "weight" or "input"
    array_index: list = field(default_factory=list)  # array leaves' positions among all leaves
    tree: object = None  # pytree structure of the (non-static) arguments
    same_object: list = field(default_factory=list)  # leaf positions of weights and statics
    input_signature: list = field(default_factory=list)  # (position, signature) of inputs
    optimize_seconds: float = 0.0
    first_call: dict = field(default_factory=dict)  # seconds per stage of the first call
    cache_hit: bool = False  # the optimized graph came from the graph cache
    all_arrays: bool = False  # every leaf of the traced arguments is an array (jax.jit-able)
    key_leaves: dict = field(default_factory=dict)  # leaf index -> PRNG impl (typed keys)


NOISE_MARGIN = 4.0
"""How many times the reference's own rounding noise an optimized output may differ by.

Two results that each carry up to the noise differ by up to twice it; twice that again
leaves room for the largest of many elements' errors."""


def _rounding_noise(flat_fn: Callable, values, reference) -> list[float]:
    """Per output, how far the original moves between default and full float32 precision.

    That is the largest change of ``reference``, ``jax.jit(flat_fn)(*values)`` at the
    device's default precision, when its matrix products and convolutions run at full
    float32 precision (``jax.default_matmul_precision("highest")``).

    On CPU the default is full precision and every entry is 0. On NVIDIA GPUs from Ampere
    on, float32 ``dot_general`` and convolutions at the default precision round their
    operands to TF32 (10 mantissa bits), so a rewrite that regroups the arithmetic (a
    batchnorm scale folded into a convolution kernel, say) differs from ``jax.jit`` of the
    original by about that rounding, which the fixed relative tolerance of
    :func:`taso_jax.report.compare_outputs` (1e-3) does not cover through 50 layers.
    Integer, boolean and empty outputs get 0; non-finite elements are skipped. Runs one more
    compile of the original, so it is called only after a failed comparison.
    """
    with jax.default_matmul_precision("highest"):
        exact = jax.tree_util.tree_leaves(jax.jit(flat_fn)(*values))
    noise = []
    for r, e in zip(reference, exact, strict=True):
        r, e = np.asarray(r), np.asarray(e)
        if r.size == 0 or not np.issubdtype(r.dtype, np.inexact):
            noise.append(0.0)
            continue
        wide = np.result_type(r.dtype, np.float64)
        diff = np.abs(r.astype(wide) - e.astype(wide))
        noise.append(float(np.max(diff[np.isfinite(diff)], initial=0.0)))
    return noise


def _default_precision_rounds() -> bool:
    """Whether the default backend's default float32 precision may round matrix products.

    XLA:CPU computes float32 products in float32 at the default precision; GPUs may use TF32
    and TPUs bfloat16 passes. Where it does not round, comparing again at full precision
    would only compile the same function twice.
    """
    return jax.default_backend() != "cpu"


def _at_full_precision(stage: Callable) -> Callable:
    """``stage`` traced with its matrix products and convolutions at full float32 precision.

    ``jax.default_matmul_precision("highest")`` is read when ``lax.dot_general`` and
    ``lax.conv_general_dilated`` are traced, and stored in each equation, so a ``jax.jit`` of
    the result runs at that precision with no per-call cost. Used where the optimized graph
    at the device's default precision differs from the original by more than the original's
    own rounding (see :meth:`OptimizedFunction._optimize`).
    """
    @functools.wraps(stage)
    def at_full_precision(*args):
        with jax.default_matmul_precision("highest"):
            return stage(*args)

    return at_full_precision


def _is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def _leaf_signature(x) -> tuple:
    """Shape, dtype and weak type of an array leaf, cheaply (this runs on every call)."""
    if type(x) in (bool, int, float, complex):
        return (type(x),)
    return (x.shape, x.dtype, getattr(x, "weak_type", False))


def _holds_tracer(out) -> bool:
    """Whether the result ``out`` of a jitted call was traced by a JAX transformation.

    Under jax.jit, grad or vmap every array a jitted function returns is a tracer, so the
    first leaf tells. A result whose type is a concrete array type met before is answered
    by its type alone (0.06 us; ``isinstance(out, jax.Array)`` takes 0.6 us).
    """
    kind = type(out)
    if kind in _CONCRETE_ARRAY_TYPES:
        return False
    if isinstance(out, jax.Array):
        if _is_tracer(out):
            return True
        _CONCRETE_ARRAY_TYPES.add(kind)
        return False
    leaves = jax.tree_util.tree_leaves(out)
    return bool(leaves) and _is_tracer(leaves[0])


#: Types of results met that are arrays and not tracers (see :func:`_holds_tracer`).
_CONCRETE_ARRAY_TYPES: set = set()


def _stored_check(check: dict | None) -> dict | None:
    """The JSON-able part of an output check's result, for the graph cache."""
    if check is None:
        return None
    return {k: v for k, v in check.items() if k != "reference"
            and isinstance(v, bool | int | float | str | type(None))}


def _hashable(x) -> bool:
    try:
        hash(x)
        return True
    except TypeError:
        return False


def _static_key(x):
    try:
        hash(x)
        return ("v", type(x), x)
    except TypeError:
        return ("id", id(x))


def _positional(fn: Callable, signature) -> Callable:
    """``fn``, taking its keyword-only parameters positionally.

    When ``fn`` has keyword-only parameters, the result takes every parameter positionally
    (keyword-only ones last, in order), so that tracing, ``weight_argnames`` and
    ``static_argnames`` treat them like any other argument. Otherwise, and for functions
    with ``*args`` or ``**kwargs``, ``fn`` is returned as it is.
    """
    if signature is None:
        return fn
    params = list(signature.parameters.values())
    kinds = {p.kind for p in params}
    kwonly = [p.name for p in params if p.kind == p.KEYWORD_ONLY]
    if not kwonly or inspect.Parameter.VAR_POSITIONAL in kinds or \
            inspect.Parameter.VAR_KEYWORD in kinds:
        return fn
    n_pos = len(params) - len(kwonly)

    def flat(*args):
        return fn(*args[:n_pos], **dict(zip(kwonly, args[n_pos:], strict=True)))

    flat.__signature__ = inspect.Signature(
        [p.replace(kind=p.POSITIONAL_OR_KEYWORD, default=p.empty) for p in params])
    flat.__name__ = getattr(fn, "__name__", "fn")
    flat.__qualname__ = getattr(fn, "__qualname__", flat.__name__)
    return flat


class OptimizedFunction:
    """A JAX function wrapped by ``@taso_jax.optimize``; call it like the original.

    Attributes:
        fn: the original function.
        options: the search's :class:`~taso_jax.search.options.OptimizeOptions`.

    See :func:`taso_jax.optimize` for the arguments.
    """

    def __init__(self, fn: Callable, *, weight_argnums=(), weight_argnames=(),
                 static_argnums=(), static_argnames=(), donate_argnums=(),
                 donate_argnames=(), check: bool | str = True, mode: str = "sync",
                 **options):
        if not callable(fn):
            raise TypeError(f"taso_jax.optimize: expected a function, got {type(fn).__name__}")
        self.fn = fn
        self._weight_spec = (weight_argnums, weight_argnames)
        self._static_spec = (static_argnums, static_argnames)
        self._donate_spec = (donate_argnums, donate_argnames)
        # Names are checked now; positions once the number of arguments is known.
        normalize_argnums(fn, None, (), weight_argnames, "weight")
        normalize_argnums(fn, None, (), static_argnames, "static")
        normalize_argnums(fn, None, (), donate_argnames, "donate")
        options.setdefault("time_limit", DECORATOR_TIME_LIMIT)
        self.options = OptimizeOptions().replace(**options)
        self._optimizer_made = None
        if self.options.target != "xla":
            raise ValueError(f"taso_jax.optimize: target={self.options.target!r} applies to "
                             "ONNX models and graphs; a decorated function runs under jax.jit "
                             "(target='xla')")
        if check not in (True, False, "always"):
            raise ValueError(f"taso_jax.optimize: check must be True, False or 'always', "
                             f"got {check!r}")
        if mode not in ("sync", "background"):
            raise ValueError(f"taso_jax.optimize: mode must be 'sync' or 'background', "
                             f"got {mode!r}")
        self.check, self.mode = check, mode
        self._pending: dict = {}  # signature -> Future of its _Entry (mode="background")
        self._cache: OrderedDict = OrderedDict()  # signature -> _Entry, least recent first
        self._positions: dict[int, tuple[set, set]] = {}
        self._last: _Entry | None = None
        self._fast: tuple | None = None
        # (jax.jit of the original, its cache size, number of arguments, whether it donates)
        # while the last signature runs the original; that jitted function has compiled
        # only signatures that run the original (see __call__)
        self._kept_fast: tuple | None = None
        # (entry, pytree) while the last signature runs optimized (see _optimized_fast)
        self._opt_fast: tuple | None = None
        self._user_jits: dict[tuple, Callable] = {}
        self._kept_jits: dict[tuple, Callable] = {}
        self._kept_undecided = False
        try:
            self._signature = inspect.signature(fn)
        except (TypeError, ValueError):
            self._signature = None
        self._flat_fn = _positional(fn, self._signature)
        functools.update_wrapper(self, fn)

    # ---- calling ------------------------------------------------------------------------

    def _bind(self, args, kwargs) -> list:
        """The arguments in positional order (keyword-only ones after the positional)."""
        if not kwargs and self._flat_fn is self.fn:
            return list(args)
        if self._signature is None:
            raise TypeError(f"{_fn_name(self.fn)}: keyword arguments need an inspectable "
                            "signature")
        bound = self._signature.bind(*args, **kwargs)
        if self._flat_fn is not self.fn:  # keyword-only parameters: every one, in order
            bound.apply_defaults()
            return [bound.arguments[name] for name in self._flat_fn.__signature__.parameters]
        if bound.kwargs and not any(p.kind == p.VAR_KEYWORD
                                    for p in self._signature.parameters.values()):
            bound.apply_defaults()  # g(x, b=3.0) skipping a defaulted a: fill a in
        if bound.kwargs:
            raise TypeError(f"{_fn_name(self.fn)}: keyword arguments {sorted(bound.kwargs)} "
                            "go to **kwargs, which is not supported; pass them by name as "
                            "parameters, or close over them")
        return list(bound.args)

    def __call__(self, *args, **kwargs):
        """Run the optimized function (optimizing it first for a new signature)."""
        kept = self._kept_fast
        if kept is not None and not kwargs and len(args) == kept[2]:
            # The last signature runs jax.jit of the original: call it directly, and let
            # jax.jit's own C++ dispatch recognize the signature (0.05 us to read its cache
            # size, where comparing each argument's type, shape and dtype in Python cost
            # about 3 us a call). That jitted function keeps only signatures that run the
            # original, so a call that grows its cache has a signature it had not seen (or
            # an array now committed to a device): that call goes on through the full path,
            # which decides it, and drops that jitted function if the signature runs
            # optimized. The original's result is then computed twice, once per signature.
            # Where the call donated its inputs they are gone: it returns the original's
            # result, drops that jitted function, and the next call decides the signature.
            # Whether a JAX transformation is tracing is read from the result, after the
            # dispatch: asked before it (0.5 us of Python reading JAX's trace state), it
            # made a blocked call of a 60 us function about 3 us slower on XLA:CPU. A
            # traced call goes on through the full path, which traces the optimized stages.
            jitted, size, _, donates = kept
            out = jitted(*args)
            if jitted._cache_size() == size:
                if not _holds_tracer(out):
                    return out
            else:
                self._kept_fast = None
                if donates:
                    self._kept_jits.clear()
                    return out
                self._kept_undecided = True
        fast = self._opt_fast
        if fast is not None and not kwargs:
            out = self._optimized_fast(fast, args)
            if out is not None:
                return out
        self._opt_fast = None
        args = self._bind(args, kwargs)
        n = len(args)
        if n not in self._positions:
            weight_pos = normalize_argnums(self._flat_fn, n, *self._weight_spec, "weight")
            static_pos = normalize_argnums(self._flat_fn, n, *self._static_spec, "static")
            if weight_pos & static_pos:
                raise ValueError(f"{_fn_name(self.fn)}: argument(s) "
                                 f"{sorted(weight_pos & static_pos)} are marked both weight "
                                 "and static")
            donate_pos = normalize_argnums(self._flat_fn, n, *self._donate_spec, "donate")
            if donate_pos & (static_pos | weight_pos):
                raise ValueError(f"{_fn_name(self.fn)}: argument(s) "
                                 f"{sorted(donate_pos & (static_pos | weight_pos))} are marked "
                                 "donated and static or weight (only runtime inputs can be "
                                 "donated)")
            self._positions[n] = (weight_pos, static_pos, donate_pos)
        weight_pos, static_pos, donate_pos = self._positions[n]
        dyn = tuple(None if i in static_pos else a for i, a in enumerate(args))
        flat, tree = jax.tree_util.tree_flatten(dyn)
        entry = self._fast_lookup(flat, tree, args, static_pos)
        if entry is None:
            sig = [_leaf_signature(x) if _is_array_leaf(x) else _static_key(x) for x in flat]
            key = (tree, tuple(_static_key(args[i]) for i in sorted(static_pos)), tuple(sig))
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
            if entry is None and self.mode == "background":
                entry = self._background(key, args, flat, weight_pos, static_pos)
                if entry is None:  # still optimizing: jax.jit of the original meanwhile,
                    # without donation (the optimization still reads these arrays)
                    return self._user_jit(static_pos)(*args)
                entry.tree = tree
                self._remember(key, entry)
            if entry is None:
                entry = self._build(args, weight_pos, static_pos)
                entry.tree = tree
                self._remember(key, entry)
        self._last = entry
        leaves = [flat[i] for i in entry.array_index]
        concrete = not any(_is_tracer(x) for x in leaves)
        if concrete:
            entry.last_call = (args, leaves)
        self._fast = (entry, flat, [args[i] for i in sorted(static_pos)]) if concrete else None
        self._kept_fast = None
        if concrete and entry.all_arrays and (entry.fallback is not None
                                              or entry.original_kept is not None):
            # jax.jit of the user's function itself (its donation included), and, for the
            # next calls, the fast path straight to it
            kept_jit = self._kept_jit(static_pos, donate_pos)
            out = kept_jit(*args)
            if not kwargs:
                self._kept_fast = (kept_jit, kept_jit._cache_size(), len(args),
                                   bool(donate_pos))
            self._kept_undecided = False  # what reached it through the fast path runs the
            return out  # original too
        if self._kept_undecided:  # this signature, which the fast path's jax.jit compiled,
            self._kept_jits.clear()  # runs optimized: start that one afresh
            self._kept_undecided = False
        out = self._execute(entry, leaves, entry.kinds, concrete, donate=concrete)
        if (concrete and not kwargs and not static_pos and entry.all_arrays
                and not entry.key_leaves and entry.run_donating is None
                and entry.fallback is None and entry.original_kept is None
                and entry.folded_for and not entry.folded_for[2]):
            self._opt_fast = (entry, tree)  # every weight a JAX array: see _optimized_fast
        return out

    def _optimized_fast(self, fast: tuple, args: tuple):
        """The last signature's optimized result for ``args``, or ``None`` (full path).

        The full path's per-call work (binding, static and tracer checks, the signature
        lookup) cost about 20 us of Python a call, and XLA:CPU's worker threads, idle
        meanwhile, took several times that to wake up again: 130 us more than the runtime
        stage alone on a 1 ms NasRNN cell. Here one ``tree_flatten``, the weights' identity
        against those last folded and the inputs' shapes and dtypes are checked, and the
        runtime stage is called with the folded values. It is set only where every leaf is
        an array and nothing is static or donated, so the leaves are the entry's weights
        (``same_object``) and inputs (``input_signature``) in order; folded NumPy weights,
        whose values can change in place, send the call to the full path.
        """
        entry, tree = fast
        _, folded, copies = entry.folded_for
        flat, t = jax.tree_util.tree_flatten(args)
        # identities compared as numbers: the folded weights are held, so no other object
        # can have their ids meanwhile (1 us for NasRNN's 16 weights, against 3 us for a
        # loop of ``is``)
        if copies or t != tree or list(map(id, map(flat.__getitem__, entry.same_object))) \
                != entry.folded_ids:
            return None
        inputs = []
        for i, sig in entry.input_signature:
            x = flat[i]
            if not _is_array_leaf(x) or _is_tracer(x) or _leaf_signature(x) != sig:
                return None  # a tracer: under a transformation, the full path traces
            inputs.append(x)
        entry.last_call = (args, flat)
        out = entry.run(folded, *inputs)
        return jax.tree_util.tree_unflatten(entry.out_tree, list(out))

    def _remember(self, key, entry: _Entry) -> None:
        self._cache[key] = entry
        while len(self._cache) > SIGNATURE_CACHE:
            self._cache.popitem(last=False)  # as jax.jit's cache, bounded

    def _background(self, key, args, flat, weight_pos, static_pos) -> _Entry | None:
        """``mode="background"``: the signature's entry once its optimization has finished.

        The first call of a signature starts the optimization (trace, search, output check,
        timing against jax.jit) in a background thread and returns ``None``: the caller runs
        ``jax.jit`` of the original meanwhile. A later call gets the finished entry, which
        is used only as the optimization decided: checked, and measured faster than the
        original (else the original keeps running). Arguments with non-array leaves, or
        traced ones, are optimized in the foreground.
        """
        future = self._pending.get(key)
        if future is _UNTRACEABLE:
            return None  # jax.jit of the original raises what the user needs to see
        if future is None:
            if any(_is_tracer(x) or not _is_array_leaf(x) for x in flat):
                return self._build(args, weight_pos, static_pos)
            if sum(f is not _UNTRACEABLE for f in self._pending.values()) >= MAX_PENDING:
                return None  # enough queued: this signature is queued on a later call
            # NumPy arrays may change in place before the thread reads them: copies
            copies = jax.tree_util.tree_map(
                lambda x: np.array(x, copy=True) if isinstance(x, np.ndarray) else x, args)
            self._pending[key] = _background_worker().submit(self._build_quietly, copies,
                                                             weight_pos, static_pos)
            return None
        if not future.done():
            return None
        entry = future.result()
        if entry.jit_original is None:
            self._pending[key] = _UNTRACEABLE
            return None
        del self._pending[key]
        return entry

    def _build_quietly(self, args, weight_pos, static_pos) -> _Entry:
        """``_build`` for a background thread: never raises (a failure is a fallback)."""
        try:
            return self._build(args, weight_pos, static_pos)
        except Exception as e:  # the function does not trace: jax.jit of it raised too
            entry = _Entry(out_tree=None, jit_original=None)
            entry.fallback = f"{type(e).__name__}: {e}"
            entry.all_arrays = False
            return entry

    def wait(self, timeout: float | None = None) -> None:
        """Block until the background optimizations started so far have finished."""
        from concurrent.futures import wait

        wait([f for f in self._pending.values() if f is not _UNTRACEABLE and not f.cancelled()],
             timeout=timeout)

    def _user_jit(self, static_pos, donate_pos=frozenset()) -> Callable:
        """``jax.jit`` of the original function with these static and donated positions."""
        return self._jit_original(self._user_jits, self._flat_fn, static_pos, donate_pos)

    def _kept_jit(self, static_pos, donate_pos) -> Callable:
        """``jax.jit`` of the original for the fast path.

        It is called only with signatures that run the original. It wraps its own
        function object: ``jax.jit`` shares compiled signatures between jitted functions of
        one Python function, and :meth:`_user_jit` (which the timing against the original
        also calls, on signatures that then run optimized) must not fill this one's cache.
        """
        flat_fn = self._flat_fn

        def original(*args):
            return flat_fn(*args)

        original.__name__ = original.__qualname__ = _fn_name(self.fn)
        return self._jit_original(self._kept_jits, original, static_pos, donate_pos)

    @staticmethod
    def _jit_original(jits: dict, fn: Callable, static_pos, donate_pos) -> Callable:
        """``jits``' ``jax.jit`` of ``fn`` for these positions, made on first use."""
        key = (tuple(sorted(static_pos)), tuple(sorted(donate_pos)))
        jitted = jits.get(key)
        if jitted is None:
            jitted = jits[key] = jax.jit(fn, static_argnums=key[0], donate_argnums=key[1])
        return jitted

    def _fast_lookup(self, flat, tree, args, static_pos) -> _Entry | None:
        """The last call's entry when only the runtime inputs' values changed.

        That is: the same pytree, the same weight and static objects, inputs of the same
        shapes and dtypes.
        """
        if self._fast is None:
            return None
        entry, last, statics = self._fast
        if tree != entry.tree or len(flat) != len(last) or any(
                a is not b for a, b in zip(statics, (args[i] for i in sorted(static_pos)),
                                           strict=False)):
            return None
        for i in entry.same_object:
            if flat[i] is not last[i]:
                return None
        for i, sig in entry.input_signature:
            x = flat[i]
            if not _is_array_leaf(x) or _leaf_signature(x) != sig:
                return None
        return entry

    def _execute(self, entry: _Entry, leaves, kinds, concrete: bool = False,
                 donate: bool = False):
        leaves = leaves_for_call(leaves, entry.key_leaves)
        if entry.fallback is not None or entry.original_kept is not None:
            return entry.jit_original(*leaves)
        weights = [x for x, k in zip(leaves, kinds, strict=True) if k == "weight"]
        inputs = [x for x, k in zip(leaves, kinds, strict=True) if k == "input"]  # noqa
        run = entry.run_donating if donate and entry.run_donating is not None else entry.run
        out = run(self._folded(entry, weights, concrete), *inputs)
        return jax.tree_util.tree_unflatten(entry.out_tree, list(out))

    def _folded(self, entry: _Entry, weights, concrete: bool):
        """The folded weight-only values for these weights, computed once per weights.

        JAX arrays are immutable, so the same objects mean the same values. A NumPy weight
        can be changed in place: its values are compared with a copy taken when it was
        folded (an O(size) comparison, as cheap as the transfer ``jax.jit`` makes of a
        NumPy argument on every call), so a changed array is folded again, never served
        stale.
        """
        cached = entry.folded_for
        if concrete and cached and len(cached[0]) == len(weights) and all(
                a is b for a, b in zip(cached[0], weights, strict=True)) and all(
                np.array_equal(weights[i], copy) for i, copy in cached[2]):
            return cached[1]
        values = [entry.constants[slot] if isinstance(slot, str) else weights[slot]
                  for slot in entry.weight_slots]
        folded = entry.fold(values)
        if concrete:
            copies = [(i, np.array(w, copy=True)) for i, w in enumerate(weights)
                      if isinstance(w, np.ndarray)]
            entry.folded_for = (list(weights), folded, copies)  # keeps the arrays alive
            entry.folded_ids = list(map(id, weights))
        return folded

    # ---- optimizing ---------------------------------------------------------------------

    def _build(self, args, weight_pos, static_pos) -> _Entry:
        fn = self._flat_fn
        t_trace = time.perf_counter()
        try:
            traced = trace_function(fn, args, weight_pos, static_pos, non_arrays="static")
        except Exception as e:  # the user's function does not trace: jax.jit would fail too
            e.add_note(f"taso_jax.optimize traces {_fn_name(fn)} like jax.jit: Python control "
                       "flow on array values is not allowed (use jax.lax.cond / jnp.where, or "
                       "mark the argument with static_argnums)")
            raise
        trace_s = time.perf_counter() - t_trace
        kinds, array_index = traced.kinds, traced.array_index
        entry = _Entry(out_tree=traced.out_tree, jit_original=jax.jit(traced.flat_fn),
                       kinds=kinds, array_index=array_index)
        # jax.jit of the user's function can run it: every leaf an array, every static
        # argument hashable (our own static handling also takes unhashable ones, by id)
        entry.all_arrays = len(array_index) == traced.n_flat and all(
            _hashable(args[i]) for i in static_pos)
        entry.key_leaves = traced.key_leaves
        inputs_at = {i for i, k in zip(array_index, kinds, strict=True) if k == "input"}
        entry.same_object = [i for i in range(traced.n_flat) if i not in inputs_at]
        entry.input_signature = [(i, _leaf_signature(x)) for i, x, k in
                                 zip(array_index, traced.leaves, kinds, strict=True)
                                 if k == "input"]
        t0 = time.perf_counter()
        try:
            # The first call may come from inside jax.jit, grad or vmap of this function: the
            # search's timings and the output check run on concrete arrays, not staged out.
            with jax.ensure_compile_time_eval():
                self._optimize(entry, traced, args, static_pos)
        except Exception as e:  # anything in our pipeline: fall back, never a wrong answer
            entry.fallback = f"{type(e).__name__}: {e}"
            warnings.warn(f"taso_jax.optimize({_fn_name(fn)}): falling back to jax.jit "
                          f"of the original function ({entry.fallback})",
                          RuntimeWarning, stacklevel=3)
        entry.optimize_seconds = time.perf_counter() - t0
        entry.first_call = {"trace": trace_s, **entry.first_call,
                            "total": trace_s + entry.optimize_seconds}
        return entry

    def _optimize(self, entry, traced: TracedFunction, args, static_pos):
        clock = started = time.perf_counter()
        stages = entry.first_call

        def lap(name):
            nonlocal clock
            now = time.perf_counter()
            stages[name] = stages.get(name, 0.0) + now - clock
            clock = now

        graph = traced.to_graph(_fn_name(self.fn))
        leaves, kinds, paths = traced.leaves, traced.kinds, traced.paths
        opts = self.options
        optimizer = self._optimizer()
        subs = optimizer.rules
        key = graph_cache.cache_key(graph, self._cache_parts(subs))
        lap("import")
        hit = graph_cache.load(key, graph)
        if hit is not None:
            optimized, info = hit
            result = SearchResult(graph=optimized, cost_before=info.get("cost_before", 0.0),
                                  cost_after=info.get("cost_after", 0.0),
                                  applied=info.get("applied", Counter()), iterations=0,
                                  explored=0, seconds=0.0, stopped="graph cache")
            entry.cache_hit = True
        else:
            result = optimizer.search(graph)
        lap(SEARCH_STAGE)
        staged = StagedGraph(result.graph)
        weight_index = {p: j for j, p in enumerate(
            p for p, k in zip(paths, kinds, strict=True) if k == "weight")}
        entry.weight_slots = [weight_index.get(name, name) for name in staged.weight_names]
        entry.constants = {name: result.graph.weights[name] for name in staged.weight_names
                           if name not in weight_index}
        entry.graph, entry.result, entry.staged = graph, result, staged
        donated = self._donated_inputs(traced, args, static_pos)

        def compile_stages(full_precision: bool) -> None:
            fold, run = staged.fold, staged.run
            if full_precision:
                fold, run = _at_full_precision(fold), _at_full_precision(run)
            entry.full_precision = full_precision
            entry.fold, entry.run = jax.jit(fold), jax.jit(run)
            entry.folded_for = ()
            if donated:  # the user's calls donate; the check and the timing must not
                entry.run_donating = jax.jit(run, donate_argnums=donated)

        compile_stages(bool(hit is not None and hit[1].get("full_precision")))
        notes = []
        if graph.meta.get("opaque"):
            notes.append("kept as opaque equations: " + ", ".join(
                f"{k} x{v}" for k, v in sorted(graph.meta["opaque"].items())))
        if entry.cache_hit:
            notes.append("optimized graph and decision read from the graph cache "
                         f"({graph_cache.graph_cache_dir()}); no search was run")
        entry.report = search_report(_fn_name(self.fn), graph, result, opts, subs, notes)
        if hit is not None and hit[1].get("original_kept"):
            # Decided in an earlier process on this device: the original runs, so there is
            # nothing to compile or check.
            entry.original_kept = hit[1]["original_kept"] + " (decided earlier; graph cache)"
            entry.report["original_kept"] = entry.original_kept
            return
        if (hit is None and self.options.end_to_end > 0
                and time.perf_counter() - started > self.options.time_limit):
            # The time limit bounds the first call. Past it after the search, the compile,
            # check and timing against jax.jit that the optimized function needs (3 s and
            # 8 s more on a 120 ms stax ResNet) are skipped, and the original runs, which is
            # never slower. Not stored in the graph cache: a later process, its kernel costs
            # cached, may get further.
            entry.original_kept = (f"{_PAST_LIMIT}: the "
                                   f"time limit ({self.options.time_limit:g} s) had passed "
                                   "after the search")
            entry.report["original_kept"] = entry.original_kept
            return
        checked_before = (hit is not None and self.check is True
                          and (hit[1].get("check") or {}).get("ok") is True)
        if checked_before:
            # The process that stored this graph compared it with jax.jit of the same
            # function (the key covers the jaxpr) and stored it only because it matched;
            # compiling the original again to repeat that is what check="always" is for.
            entry.report["check"] = {**hit[1]["check"],
                                     "reference": "jax.jit of the original function, in the "
                                                  "process that stored the graph cache entry"}
            entry.folded_for = ()
        elif self.check:
            rng = np.random.default_rng(0)
            values = [rng.standard_normal(np.shape(x)).astype(jnp.result_type(x))
                      if _is_tracer(x) else x for x in leaves]
            weights = [v for v, k in zip(values, kinds, strict=True) if k == "weight"]
            inputs = [v for v, k in zip(values, kinds, strict=True) if k == "input"]
            ref = jax.tree_util.tree_leaves(entry.jit_original(*values))
            ref = [np.asarray(x) for x in ref]
            floor = None

            def compare() -> dict:
                got = entry.run(self._folded(entry, weights, True), *inputs)
                got = [np.asarray(x) for x in got]
                check = compare_outputs(got, ref, floor=floor)
                if floor is not None:
                    check.update(rounding_noise=max(noise), noise_margin=NOISE_MARGIN)
                return check

            check = compare()
            rounds = not check["ok"] and _default_precision_rounds()
            if rounds:
                noise = _rounding_noise(traced.flat_fn, values, ref)
                if any(noise):
                    floor = [NOISE_MARGIN * n for n in noise]
                    check = compare()
            if rounds and not check["ok"] and not entry.full_precision:
                # At the default precision a GPU may round the optimized graph's products to
                # TF32 where the original's ran in full float32: cuBLAS multiplies a 1x512
                # row by a 512x512 matrix in float32, and by the 512x4096 matrix of eight
                # merged ones with TF32 tensor cores (NasRNN on an H200: 1.3e-3 from
                # jax.jit of the original, whose own rounding noise was 0). The optimized
                # graph then runs with its products at full precision if that matches.
                compile_stages(True)
                again = compare()
                if again["ok"]:
                    check = {**again, "full_precision": True}
                else:  # the report keeps the comparison at the default precision
                    compile_stages(False)
            check["reference"] = "jax.jit of the original function"
            entry.report["check"] = check
            if not check["ok"]:
                raise _Fallback(f"optimized outputs differ from the original's (max abs error "
                                f"{check['max_abs_err']:.3g}); substitutions applied: "
                                f"{sorted(result.applied)}")
            entry.folded_for = ()
        lap("compile and check")
        if hit is not None:
            entry.original_kept = None  # the earlier process measured the optimized faster
        else:
            entry.original_kept = self._keep_original(entry, traced, result, args, static_pos)
            lap("timing against jax.jit")
            timed = "baseline" in entry.report or self.options.end_to_end == 0
            if timed:
                graph_cache.store(key, result.graph, graph, {
                    "cost_before": result.cost_before, "cost_after": result.cost_after,
                    "applied": dict(result.applied), "original_kept": entry.original_kept,
                    "full_precision": entry.full_precision,
                    "check": _stored_check(entry.report.get("check"))})
        entry.report["original_kept"] = entry.original_kept

    def _optimizer(self):
        """The :class:`~taso_jax.optimizer.Optimizer` of this function's options, made once."""
        from taso_jax.optimizer import Optimizer

        if self._optimizer_made is None:
            self._optimizer_made = Optimizer(self.options)
        return self._optimizer_made

    def _donated_inputs(self, traced: TracedFunction, args, static_pos) -> tuple[int, ...]:
        """Positions, among the runtime stage's arguments, of the donated input leaves."""
        donate_pos = self._positions.get(len(args), (set(), set(), set()))[2]
        if not donate_pos:
            return ()
        arg_of_flat = [i for i, a in enumerate(args) if i not in static_pos
                       for _ in jax.tree_util.tree_leaves(a)]
        inputs = [j for j, k in zip(traced.array_index, traced.kinds, strict=True)
                  if k == "input"]
        # run(consts, *inputs): input k is argument k + 1
        return tuple(k + 1 for k, j in enumerate(inputs) if arg_of_flat[j] in donate_pos)

    def _cache_parts(self, subs) -> list[str]:
        """What besides the graph an optimized graph depends on (the graph cache's key)."""
        o = self.options
        rules = hashlib.sha256(" ".join(sorted(s.id for s in subs)).encode()).hexdigest()
        settings = (f"alpha={o.alpha} budget={o.budget} time_limit={o.time_limit} "
                    f"cost={o.cost_model_name} e2e={o.end_to_end} layouts={o.layout_candidates} "
                    f"unverified={o.allow_unverified} check={bool(self.check)} "
                    f"search_revision={SEARCH_REVISION}")
        return [device_name(), jax.__version__, _package_version(), settings, rules]

    def _keep_original(self, entry: _Entry, traced: TracedFunction, result, args,
                       static_pos) -> str | None:
        """Why ``jax.jit`` of the original function should run instead, or ``None``.

        The baseline is what the user would run: ``jax.jit(fn)(*args)``. With
        ``end_to_end > 0`` it and the optimized function, with this wrapper's own per-call
        work (flattening the arguments, recognizing the weights), are timed in one loop,
        interleaved, on the call's arguments, and the optimized one must be confirmed faster
        by :func:`~taso_jax.search.choose.confirm_faster` (at least :data:`MIN_SPEEDUP`; an
        undecided first loop with the optimized ahead is extended by as many rounds once, and
        a "faster" verdict must hold in one more loop);
        with ``end_to_end=0``, a graph that the search left
        unchanged and that has no weight-only work to fold runs the original.
        """
        graph = entry.graph
        if self.options.end_to_end == 0:
            unchanged = result.graph.key == graph.key and not any(
                n.weight_only and n.op != "weight" for n in graph.nodes)
            return "the search changed nothing" if unchanged else None
        if any(_is_tracer(x) for x in traced.leaves):
            return None  # called under a transformation: nothing concrete to time
        kinds = traced.kinds
        dyn = tuple(None if i in static_pos else a for i, a in enumerate(args))
        if entry.all_arrays:  # what the user would run: jax.jit of the function itself
            user_jit = self._user_jit(static_pos)

            def original():
                return user_jit(*args)
        else:  # non-array leaves (a string in a config dict) are static, as we treat them
            leaves = traced.leaves

            def original():
                return entry.jit_original(*leaves)

        def optimized():  # what a call that hits the signature cache does
            flat, _ = jax.tree_util.tree_flatten(dyn)
            return self._execute(entry, [flat[i] for i in entry.array_index], kinds, True)

        test, ta, tb = confirm_faster(
            lambda: time_interleaved([original, optimized], BASELINE_REPEATS),
            min_speedup=MIN_SPEEDUP)
        a, b = float(np.median(ta)), float(np.median(tb))
        entry.report["baseline"] = {"jit_us": a, "optimized_us": b, "repeats": len(ta),
                                    "paired": test, "device": device_name()}
        if test["faster"]:
            return None
        return (f"jax.jit of the original is as fast or faster: {a:.1f} us against {b:.1f} us "
                f"optimized (medians of {len(ta)}, interleaved; the optimized won "
                f"{test['wins']} of {len(ta)} rounds, {test['speedup']:.2f}x)")

    # ---- inspection ---------------------------------------------------------------------

    def _entry(self) -> _Entry:
        if self._last is None:
            raise RuntimeError(f"{_fn_name(self.fn)} has not been called yet: call it once so "
                               "that it is traced and optimized for those argument shapes")
        return self._last

    @property
    def graph(self) -> Graph:
        """The imported graph for the last call's signature (before optimization)."""
        return self._entry().graph

    @property
    def optimized_graph(self) -> Graph:
        """The optimized graph for the last call's signature."""
        e = self._entry()
        return e.result.graph if e.result is not None else None

    @property
    def original_kept(self) -> str | None:
        """Why the last call's signature runs ``jax.jit`` of the original by choice, or None.

        The optimized function was not faster than ``jax.jit`` of the original, or the
        search changed nothing; ``None`` when the optimized function runs.
        """
        return self._entry().original_kept

    @property
    def fallback_reason(self) -> str | None:
        """Why the last call's signature runs ``jax.jit`` of the original (else ``None``)."""
        return self._entry().fallback

    def lower(self, *args, **kwargs):
        """Ahead-of-time lowering, as ``jax.jit(f).lower(*args)``: a ``jax.stages.Lowered``.

        The wrapper is traced under ``jax.jit``, so what is lowered is what a call of that
        signature runs: the optimized stages (the weight folding included, since the
        weights are traced values here), or the original when it was kept. Arguments may be
        arrays or ``jax.ShapeDtypeStruct``.
        """
        return jax.jit(self).lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
        """Ahead-of-time tracing, as ``jax.jit(f).trace(*args)``: a ``jax.stages.Traced``."""
        return jax.jit(self).trace(*args, **kwargs)

    def runtime_jaxpr(self):
        """The jaxpr of the runtime stage for the last signature (what runs on every call).

        Weight-only work (e.g. concatenating weights) does not appear in it.
        """
        e = self._entry()
        if e.fallback is not None:
            raise RuntimeError(f"no optimized function: {e.fallback}")
        consts = [jax.ShapeDtypeStruct(t.shape, t.dtype) for t in e.staged.const_keys]
        ins = [jax.ShapeDtypeStruct(n.types[0].shape, n.types[0].dtype)
               for n in e.staged.graph.inputs]
        run = _at_full_precision(e.staged.run) if e.full_precision else e.staged.run
        return jax.make_jaxpr(run)(consts, *ins)

    def measure(self, repeats: int = 30) -> dict:
        """Median wall times (microseconds) of the original and the optimized function.

        The original runs as the user would run it, ``jax.jit(fn)(*args)``; both run on the
        last call's arguments, interleaved in one process. Returns ``{"before_us",
        "after_us", "speedup", "device", "repeats"}``.
        """
        e = self._entry()
        if e.last_call is None:
            raise RuntimeError("measure() needs a call with concrete arguments")
        args, leaves = e.last_call
        # Both are called the way a user calls them: pytrees in, pytrees out. The baseline
        # is jax.jit of the function itself (its pytree flattening included: about 50 us a
        # call on an equinox module), as in the end-to-end choice; with non-array leaves,
        # which we treat as static, jax.jit of the flattened function.
        if e.all_arrays:
            orig_jit = self._user_jit(self._positions[len(args)][1])
            orig = lambda: orig_jit(*args)  # noqa: E731
        else:
            orig = lambda: e.jit_original(*leaves)  # noqa: E731
        opt = lambda: self(*args)  # noqa: E731
        ta, tb = time_interleaved([orig, opt], repeats)
        a, b = float(np.median(ta)), float(np.median(tb))
        return {"before_us": a, "after_us": b, "speedup": a / b if b else float("nan"),
                "device": device_name(), "repeats": repeats}

    def outcome(self, time: bool = False, repeats: int = 30):
        """The :class:`~taso_jax.outcome.Outcome` of the last call's signature.

        Its verdict: :attr:`~taso_jax.outcome.Verdict.REWRITTEN` where the optimized graph
        runs, :attr:`~taso_jax.outcome.Verdict.UNCHANGED` where ``jax.jit`` of the original
        runs because it is as fast, :attr:`~taso_jax.outcome.Verdict.TIME_LIMIT` where the
        time limit passed after the search, :attr:`~taso_jax.outcome.Verdict.FALLBACK`
        where the pipeline failed. With ``time=True`` the report's ``time`` is measured now
        (:meth:`measure`, ``repeats`` rounds).
        """
        from taso_jax.outcome import Outcome, Verdict

        e = self._entry()
        r = dict(e.report or {})
        if r:
            r["first_call"] = dict(e.first_call)
        if e.fallback is not None:
            return Outcome(Verdict.FALLBACK, r, e.graph, why=e.fallback)
        if time and e.last_call is not None:
            r["time"] = self.measure(repeats)
        if e.original_kept:
            verdict = (Verdict.TIME_LIMIT if e.original_kept.startswith(_PAST_LIMIT)
                       else Verdict.UNCHANGED)
            return Outcome(verdict, r, e.graph, why=e.original_kept)
        return Outcome(Verdict.REWRITTEN, r, e.result.graph if e.result else None)

    def report(self, time: bool = True, repeats: int = 30) -> str:
        """The report for the last call's signature, as text (:meth:`outcome` rendered).

        It gives what runs and why, the substitutions applied, the estimated cost and, with
        ``time=True``, the measured time before and after.
        """
        return f"{_fn_name(self.fn)}: " + self.outcome(time, repeats).to_text()


def optimize_function(fn=None, **options):
    """Decorator form of :func:`taso_jax.optimize` (with or without arguments)."""
    if fn is None:
        return lambda f: OptimizedFunction(f, **options)
    return OptimizedFunction(fn, **options)
