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
original function on the call's own arguments (random values where they are tracers), and
it is timed against that function in one interleaved comparison, which alone decides
whether it runs (the end-to-end choice before it only screens the candidates). If
anything in that pipeline fails, or the outputs differ, the signature falls back to
``jax.jit`` of the original function and a warning says why: never a wrong answer.

Errors in the user's function itself (Python control flow on traced values, a shape error)
are raised as they would be by ``jax.jit``, with a note added.

Under ``jax.grad``, ``jax.vmap`` or an outer ``jax.jit`` the two stages are traced as
ordinary JAX functions, so transformations work; custom derivative rules
(``jax.custom_jvp``/``custom_vjp``) inside the function are inlined, so gradients are those
of the primal computation.

The call path is here: binding the arguments, the signature cache and its fast paths,
running the staged graph, folding the weights, background mode, and the inspection and
report methods. The first call of a signature runs the pipeline that
:class:`~taso_jax.first_call.FirstCallPipeline` holds (which
:class:`OptimizedFunction` inherits: the delivery pipeline on a traced source); what is
kept per signature is
:mod:`taso_jax.frontends.signature_entry`'s ``_Entry``; background optimizations run on
:mod:`taso_jax.frontends.background`'s worker thread.
"""

from __future__ import annotations

import functools
import inspect
from collections import OrderedDict
from collections.abc import Callable

import jax
import numpy as np

from taso_jax.call_trial import trial_call
from taso_jax.first_call import FirstCallPipeline
from taso_jax.first_call_check import _at_full_precision
from taso_jax.frontends.background import _UNTRACEABLE, MAX_PENDING, _background_worker
from taso_jax.frontends.jaxpr_io import (
    _fn_name,
    _is_array_leaf,
    leaves_for_call,
    normalize_argnums,
)
from taso_jax.frontends.signature_entry import (
    _Entry,
    _is_tracer,
    _leaf_signature,
    _static_key,
    unhashable_static,
)
from taso_jax.ir.executor import time_interleaved
from taso_jax.ir.graph import Graph
from taso_jax.search.choose import device_name
from taso_jax.search.options import OptimizeOptions

__all__ = ["OptimizedFunction", "optimize_function"]

#: The decorator's default time limit in seconds (users of jax.jit expect a first call in
#: seconds; the command line's default is the options record's 60 s). It bounds the whole
#: first call after the trace: the import, the search and the end-to-end choice's screening
#: end early enough to leave the compile, the output check and the one comparison with
#: jax.jit of the function their time (``first_call_budget.first_call_reserve``), which the
#: comparison then sizes its rounds to; only its least loop may run past the limit, by at most
#: ``first_call_budget.LIMIT_SLACK`` of it, else the original runs untimed.
DECORATOR_TIME_LIMIT = 10.0
#: Signatures (shapes, dtypes, static values) kept compiled per decorated function at most;
#: the least recently called is dropped (60 shapes had held 413 MB against jax.jit's 176).
SIGNATURE_CACHE = 32


def _serves_functions(target: str) -> bool:
    """Whether the registered target ``target`` can run a decorated JAX function."""
    from taso_jax.targets import describe

    return describe(target).serves_functions


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


class OptimizedFunction(FirstCallPipeline):
    """A JAX function wrapped by ``@taso_jax.optimize``; call it like the original.

    Attributes:
        fn: the original function.
        options: the search's :class:`~taso_jax.search.options.OptimizeOptions`.

    See :func:`taso_jax.optimize` for the arguments.
    """

    def __init__(self, fn: Callable, *, weight_argnums=(), weight_argnames=(),
                 static_argnums=(), static_argnames=(), donate_argnums=(),
                 donate_argnames=(), check: bool | str = True, mode: str = "sync",
                 settle_on_calls: bool = True, **options):
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
        if not _serves_functions(self.options.target):
            raise ValueError(f"taso_jax.optimize: target={self.options.target!r} applies to "
                             "ONNX models and graphs; a decorated function runs under jax.jit "
                             "(target='xla')")
        if check not in (True, False, "always"):
            raise ValueError(f"taso_jax.optimize: check must be True, False or 'always', "
                             f"got {check!r}")
        if mode not in ("sync", "background"):
            raise ValueError(f"taso_jax.optimize: mode must be 'sync' or 'background', "
                             f"got {mode!r}")
        self.check, self.mode, self.settle_on_calls = check, mode, bool(settle_on_calls)
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

    # Over 80 lines: the call path is one function on purpose; each helper call on it costs
    # microseconds a call that users of small functions pay (the fast path above it is timed
    # against jax.jit of the original by the end-to-end comparison).
    def __call__(self, *args, **kwargs):
        """Run the optimized function (optimizing it first for a new signature).

        Raises:
            ValueError: a static argument is not hashable (as ``jax.jit`` raises).
            TypeError: a non-array leaf (static here) is not hashable.
        """
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
            try:
                out = jitted(*args)
            except ValueError:  # jax.jit's own refusal of an unhashable static: ours names it
                self._raise_unhashable(args, self._positions[len(args)][1])
                raise
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
        return self._call_in_full(args, kwargs)

    def _argument_positions(self, n: int) -> tuple[set, set, set]:
        """``(weight, static, donated)`` positions among ``n`` bound arguments (cached).

        Raises:
            ValueError: an argument marked weight and static, or donated and static/weight.
        """
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
        return self._positions[n]

    def _call_in_full(self, args, kwargs):
        """Run a call the fast paths did not take (:meth:`__call__`).

        Its signature's entry is found, built or optimized, then run.
        """
        args = self._bind(args, kwargs)
        weight_pos, static_pos, donate_pos = self._argument_positions(len(args))
        dyn = tuple(None if i in static_pos else a for i, a in enumerate(args))
        flat, tree = jax.tree_util.tree_flatten(dyn)
        entry = self._fast_lookup(flat, tree, args, static_pos)
        if entry is None:
            try:
                sig = [_leaf_signature(x) if _is_array_leaf(x) else _static_key(x)
                       for x in flat]
                key = (tree, tuple(_static_key(args[i]) for i in sorted(static_pos)),
                       tuple(sig))
            except TypeError:  # an unhashable static value: refused, as by jax.jit
                self._raise_unhashable(args, static_pos)
                raise
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
        if concrete and entry.trial is not None:  # the comparison the first call left out
            return trial_call(self, entry, args, leaves, static_pos)
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

    def _raise_unhashable(self, args, static_pos) -> None:
        """Raise :func:`unhashable_static`'s error for ``args``, if it finds one."""
        error = unhashable_static(self._flat_fn, args, static_pos)
        if error is not None:
            raise error from None

    def _optimized_fast(self, fast: tuple, args: tuple):
        """The last signature's optimized result for ``args``, or ``None`` (full path).

        The full path's per-call work (binding, static and tracer checks, the signature
        lookup) delays the runtime stage, and XLA:CPU's worker threads, idle meanwhile,
        take longer to wake (docs/benchmarks.md, "Why the search and choice work as they
        do"). Here one ``tree_flatten``, the weights' identity
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

    def _entry_jit(self, entry: _Entry, static_pos) -> Callable:
        """``jax.jit`` of the original for one signature's first call, held by its entry.

        The output check, the timing against the original and :meth:`measure` call it. It
        wraps its own function object, so its compiled signature goes with the entry: the
        first call drops it once decided (a signature that runs optimized never runs it
        again; one that runs the original runs :meth:`_kept_jit`), and an entry evicted
        from the cache takes it along. Compiled in :meth:`_user_jit`, it would stay as
        long as the decorated function, one executable per signature ever called.
        """
        if entry.user_jit is None:
            flat_fn = self._flat_fn

            def original(*args):
                return flat_fn(*args)

            original.__name__ = original.__qualname__ = _fn_name(self.fn)
            entry.user_jit = jax.jit(original, static_argnums=tuple(sorted(static_pos)))
        return entry.user_jit

    def _hand_over_original(self, entry: _Entry, static_pos, n_args: int) -> None:
        """Drop ``entry``'s compiled original once its first call has decided.

        Where the signature runs the original (kept, or a fallback) without donated inputs,
        and the fast path's :meth:`_kept_jit` for its positions is not made yet, that
        ``jax.jit`` becomes it instead: its cache holds this one signature, which runs the
        original, so the fast path's cache-size test holds, and the original is compiled
        once, not once for the check and the timing and again for the calls (4-9 s of a
        first call of transformers' Flax models under load).
        """
        jitted, entry.user_jit = entry.user_jit, None
        donate_pos = self._positions.get(n_args, (set(), set(), set()))[2]
        key = (tuple(sorted(static_pos)), ())
        if (jitted is not None and not donate_pos and entry.all_arrays
                and (entry.fallback is not None or entry.original_kept is not None)):
            self._kept_jits.setdefault(key, jitted)

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
        if entry.fallback is not None or entry.original_kept is not None:
            return entry.jit_original(*leaves_for_call(leaves, entry.key_leaves))
        return self._staged(entry, leaves, kinds, concrete, donate)()

    def _staged(self, entry: _Entry, leaves, kinds, concrete: bool, donate: bool = False):
        """The optimized stages' call on ``leaves``, its weights folded now (a thunk)."""
        leaves = leaves_for_call(leaves, entry.key_leaves)
        weights = [x for x, k in zip(leaves, kinds, strict=True) if k == "weight"]
        inputs = [x for x, k in zip(leaves, kinds, strict=True) if k == "input"]  # noqa
        run = entry.run_donating if donate and entry.run_donating is not None else entry.run
        folded = self._folded(entry, weights, concrete)
        return lambda: jax.tree_util.tree_unflatten(entry.out_tree, list(run(folded, *inputs)))

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
        search changed nothing; ``None`` when it runs (or the calls still compare the two).
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
            orig_jit = self._entry_jit(e, self._positions[len(args)][1])
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

        The delivery pipeline made it on the signature's first call
        (:func:`taso_jax.pipeline.deliver`). Its verdict:
        :attr:`~taso_jax.outcome.Verdict.REWRITTEN` where the optimized graph runs,
        :attr:`~taso_jax.outcome.Verdict.UNCHANGED` where ``jax.jit`` of the original runs
        because it is as fast, :attr:`~taso_jax.outcome.Verdict.TIME_LIMIT` where the time
        limit passed before the optimized function could be compiled, checked and timed,
        :attr:`~taso_jax.outcome.Verdict.FALLBACK` where the pipeline failed. Its report
        gains the first call's seconds per step (``first_call``) and, with ``time=True``,
        ``time`` measured now (:meth:`measure`, ``repeats`` rounds).
        """
        e = self._entry()
        later = {"first_call": dict(e.first_call)} if e.report else {}
        if time and e.fallback is None and e.last_call is not None:
            later["time"] = self.measure(repeats)
        return e.outcome.with_report(**later) if later else e.outcome

    def report(self, time: bool = True, repeats: int = 30) -> str:
        """The report for the last call's signature, as text (:meth:`outcome` rendered).

        It gives what runs and why, the substitutions applied, the estimated cost and, with
        ``time=True``, the measured time before and after.
        """
        return f"{_fn_name(self.fn)}: " + self.outcome(time, repeats).to_text(
            delivered_input="running jax.jit of the original function")


def optimize_function(fn=None, **options):
    """Decorator form of :func:`taso_jax.optimize` (with or without arguments)."""
    if fn is None:
        return lambda f: OptimizedFunction(f, **options)
    return OptimizedFunction(fn, **options)
