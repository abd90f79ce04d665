"""The first call's time budget: the original compiled beside the search, and the reserve.

The decorator's time limit covers its whole first call (:mod:`taso_jax.first_call`). Two
pieces serve that: :class:`OriginalRun` compiles and calls ``jax.jit`` of the original in a
background thread while the search runs, so that the original is compiled once and its
call time is known early; :func:`first_call_reserve` says how many seconds the search must
leave for the compile, the output check and the comparison with ``jax.jit``, from that run
or, before it has ended, from the graph's price. The constants size that comparison.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import jax
import numpy as np

from taso_jax.search.choose import COMPILE_SECONDS_PER_NODE
from taso_jax.search.paired_test import DECISIVE_ROUNDS

__all__ = ["OriginalRun", "first_call_reserve", "CONFIRM_LEAST_ROUNDS", "SPAN_SECONDS",
           "LIMIT_SLACK", "COMPILE_GUESS_S"]

#: Rounds the one comparison with ``jax.jit`` of the original runs at the least, whatever
#: the time limit leaves: with 6 rounds the signed-rank test can confirm a candidate that
#: wins every round, or 5 of them (p = 1/64, 3/64; :func:`paired_speedup` needs 5).
CONFIRM_LEAST_ROUNDS = 6
#: Seconds of interleaved calls after which a "faster" verdict of the comparison with
#: ``jax.jit`` needs no check loop (``confirm_faster``'s ``span_seconds``): they already
#: cover that long a stretch of the machine's drift. Shorter than the end-to-end choice's
#: :data:`~taso_jax.search.choose.CONFIRM_LOOP_SECONDS`, so that the comparison fits the
#: decorator's time limit: 6 rounds of a 0.2 s call span it.
SPAN_SECONDS = 2.5
#: How far past the time limit, as a share of it, the least comparison may run: beyond that
#: the original runs untimed (a call of 1 s makes 6 rounds last 12 s, more than a 10 s
#: limit holds after the search).
LIMIT_SLACK = 0.5
#: Seconds guessed for one compilation of the function before the background one has
#: ended (compiling a Llama block at S=1024 took 0.6-1.5 s on the 2-core CPU), plus a share
#: per operator (:data:`~taso_jax.search.choose.COMPILE_SECONDS_PER_NODE`).
COMPILE_GUESS_S = 1.0


class OriginalRun:
    """``jax.jit`` of the original, compiled and called on the call's arguments, in a thread.

    Started once the graph cache has missed, it compiles while the search runs (XLA
    compiles without Python's lock): ``jitted.lower(*args).compile()``, which also fills
    ``jitted``'s own cache, so the calls that follow compile nothing. Then it calls the
    compiled function once: ``compile_seconds`` and ``call_seconds`` are those two times,
    and the call's outputs (NumPy arrays) are the output check's reference. So the first
    call knows, while it searches, how long one comparison with ``jax.jit`` takes
    (:func:`first_call_reserve`), and compiles the original once. :meth:`cancel`
    skips the call where the original will run untimed anyway. A failure leaves ``error``
    set and the pipeline compiles the original itself.
    """

    def __init__(self, jitted: Callable, args: tuple):
        self.compile_seconds: float | None = None
        self.call_seconds: float | None = None
        self.outputs: list | None = None
        self.error: Exception | None = None
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(jitted, args), daemon=True,
                                        name="taso-jax-original")
        self._thread.start()

    def _run(self, jitted: Callable, args: tuple) -> None:
        try:
            t0 = time.perf_counter()
            compiled = jitted.lower(*args).compile()
            self.compile_seconds = time.perf_counter() - t0
            if self._cancelled.is_set():
                return
            t1 = time.perf_counter()
            out = jax.block_until_ready(compiled(*args))
            if self._cancelled.is_set():  # released meanwhile: the outputs are not wanted
                return
            self.outputs = [np.asarray(x) for x in jax.tree_util.tree_leaves(out)]
            self.call_seconds = time.perf_counter() - t1
        except Exception as e:  # noqa: BLE001 - the pipeline compiles it again and says why
            self.error = e

    def cancel(self) -> None:
        """Skip the call if it has not begun, and wait for the compile.

        The compile fills the cache that ``jax.jit`` of the original, run instead, reads.
        """
        self._cancelled.set()
        self._thread.join()

    def join(self, timeout: float | None = None) -> OriginalRun:
        """Wait for the thread (at most ``timeout`` seconds); ``self``."""
        self._thread.join(timeout)
        return self

    @property
    def ok(self) -> bool:
        """Whether the thread has ended with the original compiled, called and timed."""
        return self.call_seconds is not None

    def release(self) -> None:
        """Drop the reference outputs, and any the thread, still running, would store.

        A signature's entry outlives its first call: GPT-2 small's logits at S=1024 are
        200 MB.
        """
        self._cancelled.set()
        self.outputs = None



def first_call_reserve(run: OriginalRun, optimizer, graph,
                       limit_seconds: float | None = None) -> Callable[[], float]:
    """``reserve()``: seconds a first call needs after its search, before its limit.

    That is compiling the optimized stages (as long as compiling the original), one call
    of them for the output check, and the least comparison with ``jax.jit`` of the
    original (:data:`CONFIRM_LEAST_ROUNDS` rounds of both, and the two calls each that
    warm them and size the samples). Until ``run`` has timed the original, its call is
    guessed from ``graph``'s price (``optimizer``'s calibrated cost model where the search
    prices with it, else the analytic roofline) and its compile from
    :data:`COMPILE_GUESS_S`, for the original's compile too. Where that need exceeds the
    whole limit (``limit_seconds``, the first call's time limit), the comparison will be
    the decisive one instead (:data:`~taso_jax.search.paired_test.DECISIVE_ROUNDS` rounds
    of both, warmed by the check), which may run past the limit by :data:`LIMIT_SLACK` of
    it: the need is that, less the slack.
    """
    from taso_jax.search.cost import AnalyticCostModel

    model = optimizer.cost_model
    if getattr(model, "name", "") != "calibrated":  # the measured model would compile
        model = AnalyticCostModel.for_backend()
    guessed_call = model.graph_cost(graph) * 1e-6
    guessed_compile = COMPILE_GUESS_S + COMPILE_SECONDS_PER_NODE * len(graph.nodes)
    calls = 1 + 2 * (CONFIRM_LEAST_ROUNDS + 2)

    def need(compile_seconds: float, call: float) -> float:
        full = compile_seconds + calls * call
        if limit_seconds is None or full <= limit_seconds:
            return full
        decisive = compile_seconds + (1 + 2 * DECISIVE_ROUNDS) * call
        return max(decisive - LIMIT_SLACK * limit_seconds, compile_seconds + call)

    def reserve() -> float:
        if run.ok:
            return need(run.compile_seconds, run.call_seconds)
        if run.compile_seconds is not None:  # compiled; its call is running
            return need(run.compile_seconds, guessed_call) + guessed_call
        return need(2 * guessed_compile, guessed_call) + guessed_call

    return reserve
