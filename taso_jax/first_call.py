"""The first call of a signature: trace, import, then the delivery pipeline (a mixin).

:class:`FirstCallPipeline` holds what ``@taso_jax.optimize`` does the first time it meets a
call signature, and :class:`~taso_jax.decorator.OptimizedFunction` inherits it: ``_build``
traces the function and fills an ``_Entry``; ``_optimize`` imports the jaxpr, makes the
optimizer and runs the delivery pipeline (:meth:`Optimizer.run
<taso_jax.optimizer.Optimizer.run>`, :func:`taso_jax.pipeline.deliver`) on a
:class:`~taso_jax.traced_source.TracedSource`, whose hooks read the graph cache, split the
result into jitted stages, check it against ``jax.jit`` of the original
(:mod:`taso_jax.first_call_check`) and time it against that original
(:mod:`taso_jax.first_call_timing`). The pipeline decides the verdict and makes the
:class:`~taso_jax.outcome.Outcome`, kept on the entry. The call path that uses the finished
entry is in :mod:`taso_jax.decorator`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import time
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp

from taso_jax.first_call_timing import _PAST_LIMIT
from taso_jax.frontends import graph_cache
from taso_jax.frontends.jaxpr_io import TracedFunction, _fn_name, trace_function
from taso_jax.frontends.onnx_model import ImportTimeLimit
from taso_jax.frontends.signature_entry import _Entry, _is_tracer, _leaf_signature
from taso_jax.outcome import Verdict
from taso_jax.pipeline import stopped_before
from taso_jax.records import PhaseTimes
from taso_jax.search.choose import device_name
from taso_jax.search.limits import Deadline
from taso_jax.search.options import SEARCH_REVISION
from taso_jax.search.rules import RuleFileError
from taso_jax.traced_source import TracedSource, _Laps

__all__ = ["FirstCallPipeline"]


@functools.cache
def _shipped_rules() -> tuple:
    """The shipped rule set, read once per process for every decorated function.

    Reading and parsing it took 1.5-2 s of each first call on the loaded 2-core machine
    (1,039 rules); the rules are frozen records, so one tuple serves every function.
    """
    from taso_jax.search.rules import default_substitutions

    return tuple(default_substitutions())


def _proves_rule_file(options) -> bool:
    """Whether making the optimizer proves a rule file's rules (a path, not trusted)."""
    subs = options.substitutions
    return (isinstance(subs, str) or hasattr(subs, "__fspath__")) and not options.trust_proofs


def _rule_file_error(error: Exception, substitutions) -> bool:
    """Whether ``error`` is about the caller's rule file: malformed, or not readable.

    Such an error is raised to the caller, not hidden behind a fallback to ``jax.jit``: it
    names the file and what is wrong (a
    :class:`~taso_jax.search.rules.RuleFileError`, which the command line reports with exit
    code 2, or the ``OSError`` of reading it).
    """
    if isinstance(error, RuleFileError):
        return True
    if not isinstance(error, OSError) or error.filename is None:
        return False
    if not (isinstance(substitutions, str) or hasattr(substitutions, "__fspath__")):
        return False
    return os.fspath(error.filename) == os.fspath(substitutions)


def _package_version() -> str:
    try:
        from importlib.metadata import version

        return version("taso_jax")
    except Exception:  # not installed as a distribution (a source checkout)
        return "source"


def _tracing() -> bool:
    """Whether a JAX transformation is tracing here (an array made now is a tracer)."""
    return _is_tracer(jnp.zeros(()))


class FirstCallPipeline:
    """The first-call pipeline of :class:`~taso_jax.decorator.OptimizedFunction`.

    A mixin: it reads the host's ``fn``, ``_flat_fn``, ``options``, ``check``,
    ``_positions`` and ``_optimizer_made``, and its source
    (:class:`~taso_jax.traced_source.TracedSource`) calls the host's ``_execute``,
    ``_folded`` and ``_entry_jit``.
    """

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
        # jax.jit of the user's function can run it: every leaf an array (static arguments
        # are hashable, as the signature's key requires)
        entry.all_arrays = len(array_index) == traced.n_flat
        entry.key_leaves = traced.key_leaves
        inputs_at = {i for i, k in zip(array_index, kinds, strict=True) if k == "input"}
        entry.same_object = [i for i in range(traced.n_flat) if i not in inputs_at]
        entry.input_signature = [(i, _leaf_signature(x)) for i, x, k in
                                 zip(array_index, traced.leaves, kinds, strict=True)
                                 if k == "input"]
        entry.first_call["trace"] = trace_s
        t0 = time.perf_counter()
        try:
            # The first call may come from inside jax.jit, grad or vmap of this function: the
            # search's timings and the output check run on concrete arrays, not staged out.
            # A concrete call needs no such context, and its jitted stages and the original
            # compiled under it would be compiled again for the calls that follow (jax.jit
            # keys its cache by that context too: 0.9 s more on a Llama block's next call).
            staged_out = any(_is_tracer(x) for x in traced.leaves) or _tracing()
            with jax.ensure_compile_time_eval() if staged_out else contextlib.nullcontext():
                entry.outcome = self._optimize(entry, traced, args, static_pos)
        except Exception as e:  # anything in our pipeline: fall back, never a wrong answer
            if _rule_file_error(e, self.options.substitutions):
                raise  # the caller's own setting, as a bad argnum is: not ours to hide
            entry.fallback = f"{type(e).__name__}: {e}"
            fc = entry.first_call
            entry.outcome = stopped_before(
                Verdict.FALLBACK, entry.report, entry.fallback, graph=entry.graph,
                phases=PhaseTimes(import_s=fc["trace"] + fc.get("import", 0.0),
                                  total_s=trace_s + time.perf_counter() - t0))
        if entry.fallback is not None:
            warnings.warn(f"taso_jax.optimize({_fn_name(fn)}): falling back to jax.jit "
                          f"of the original function ({entry.fallback})",
                          RuntimeWarning, stacklevel=3)
        if entry.original_run is not None:  # whatever the outcome, the reference goes
            entry.original_run.release()
        if entry.trial is None:  # else its calls run it in turn (taso_jax.call_trial)
            self._hand_over_original(entry, static_pos, len(args))  # or drop it
        entry.optimize_seconds = time.perf_counter() - t0
        entry.first_call["total"] = trace_s + entry.optimize_seconds
        return entry

    def _optimize(self, entry, traced: TracedFunction, args, static_pos):
        """The first call's pipeline for ``entry``: import, deliver; the outcome.

        The jaxpr is imported, then :meth:`Optimizer.run
        <taso_jax.optimizer.Optimizer.run>` runs the delivery pipeline on a
        :class:`~taso_jax.traced_source.TracedSource`.
        One deadline covers the import, the search and what follows (the trace is
        ``jax.jit``'s own work); seconds per step go to ``entry.first_call``.
        """
        lap = _Laps(entry.first_call)
        deadline = Deadline.start(self.options.time_limit)
        try:
            graph = traced.to_graph(_fn_name(self.fn), deadline=deadline)
        except ImportTimeLimit as e:  # a huge function: jax.jit of it, never stored
            lap("import")
            entry.original_kept = (f"{_PAST_LIMIT}: {e} (time limit "
                                   f"{self.options.time_limit:g} s)")
            entry.report = {"model": _fn_name(self.fn), "imported": False,
                            "time_limit": self.options.time_limit, "out_of_time_in": "import",
                            "original_kept": entry.original_kept}
            return stopped_before(Verdict.TIME_LIMIT, entry.report, entry.original_kept)
        made = time.perf_counter()
        optimizer = self._optimizer(deadline)
        if not _proves_rule_file(self.options):
            # reading the rules (once per function, 1-3 s for the shipped set) is not the
            # import's or the search's time: the deadline moves by what it took
            made = time.perf_counter() - made
            deadline = Deadline(deadline.at + made, deadline.seconds)
        key = graph_cache.cache_key(graph, self._cache_parts(optimizer.rules))
        lap("import")
        source = TracedSource(self, entry, traced, args, static_pos, graph, key, lap,
                              entry.first_call["trace"] + entry.first_call["import"])
        return optimizer.run(source, deadline=deadline)

    def _optimizer(self, deadline: Deadline):
        """The :class:`~taso_jax.optimizer.Optimizer` of this function's options, made once.

        A rule file's proofs (``substitutions=FILE`` without ``trust_proofs``) run under the
        first call's ``deadline``, with at most its ``rule_proofs`` share, as on the command
        line. Where they were cut, the optimizer is not kept: the next signature's first call
        goes on with the proofs from where these stopped (their checkpoint).
        """
        from taso_jax.optimizer import Optimizer

        if self._optimizer_made is not None:
            return self._optimizer_made
        shipped = self.options.substitutions is None
        made = Optimizer(self.options, rules=_shipped_rules() if shipped else None,
                         deadline=deadline if _proves_rule_file(self.options) else None)
        if "not_proved_in_time" not in made.rule_counts:
            self._optimizer_made = made
        return made

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

    def _original_call(self, entry: _Entry, traced: TracedFunction, args,
                       static_pos) -> tuple[Callable, tuple] | None:
        """What the user would run and its arguments, ``(jitted, args)``, or ``None``.

        ``jax.jit`` of the function itself where every leaf is an array (the one that the
        comparison calls); else ``jax.jit`` of the traced function on the array leaves
        (non-array leaves are static, as we treat them). ``None`` under a transformation:
        nothing concrete to call.
        """
        if any(_is_tracer(x) for x in traced.leaves):
            return None
        if entry.all_arrays:
            return self._entry_jit(entry, static_pos), tuple(args)
        return entry.jit_original, tuple(traced.leaves)
