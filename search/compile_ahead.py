"""The input compiled ahead for the end-to-end choice, while the search runs.

The choice (:mod:`taso_jax.search.choose`) begins by compiling and timing the input; for a
large graph that is seconds of the time limit spent after the search. Compiled in a
background thread while the search runs (XLA compiles without Python's lock), it is found
in :func:`taso_jax.compile_graph`'s cache when the choice begins, and its one timed call
says what a comparison needs (:func:`choice_reserve`), so the search can leave that much.
"""

from __future__ import annotations

import threading
import time

from taso_jax.search import choose
from taso_jax.search.choose import COMPARE_CALLS

from taso_jax.ir.graph import Graph

__all__ = ["COMPILE_AHEAD_NODES", "AHEAD_SECONDS_PER_NODE", "compile_ahead", "choice_reserve",
           "guessed_make_seconds"]


#: Nodes (weights included) from which :func:`compile_ahead` compiles the input in the
#: background; a smaller graph compiles in well under a second.
COMPILE_AHEAD_NODES = 200
#: Seconds per node (weights included) that compiling and running a graph is taken to cost
#: at most when it was measured beside the search (:func:`guessed_make_seconds`). NasNet-A's 676
#: nodes compiled in 4.4-4.8 s alone, and in 43 s beside the search once (2026-11-29,
#: 2 cores), which made the choice skip a 1.79x candidate ("one comparison needs 45.7 s").
AHEAD_SECONDS_PER_NODE = 0.01


def guessed_make_seconds(ahead: threading.Thread | None, graph: Graph) -> float:
    """What making a candidate is taken to cost, from :func:`compile_ahead`'s thread.

    Its ``seconds``, capped at :data:`AHEAD_SECONDS_PER_NODE` a node of ``graph``: the
    compile ran beside the search and shared the cores (and Python's lock) with it, so its
    wall time can be many times what a compile alone takes. 0.0 without a thread.
    """
    if ahead is None:
        return 0.0
    return min(ahead.seconds, AHEAD_SECONDS_PER_NODE * len(graph.nodes))


def compile_ahead(graph: Graph) -> threading.Thread | None:
    """Start compiling ``graph`` for the end-to-end choice in a background thread.

    The choice begins by compiling and running the input
    (:func:`~taso_jax.search.choose.compiled_run`), which took 15 s of a 60 s limit for a
    700-operator OCR detector on the loaded 2-core machine, after the search; compiled while
    the search runs (XLA compiles without Python's lock), the choice finds it in
    :func:`taso_jax.compile_graph`'s cache. ``None`` for a graph under
    :data:`COMPILE_AHEAD_NODES` nodes. A failure is left for the choice to meet again.
    Join the thread before the choice (it holds no lock the search needs); its ``seconds``
    is then what compiling and running the input took (0.0 where it failed), the choice's
    guess at what making a candidate takes (``choose_fastest(made_seconds=...)``), and its
    ``call_seconds`` what one more call took (``None`` until then: :func:`choice_reserve`).
    """
    if len(graph.nodes) < COMPILE_AHEAD_NODES:
        return None

    def run():
        started = time.perf_counter()
        try:
            call = choose.compiled_run(graph, choose._inputs_for(graph))
            made = time.perf_counter()
            jax.block_until_ready(call())
        except Exception:  # noqa: BLE001 - the choice compiles it again and reports why
            return
        thread.seconds = made - started
        thread.call_seconds = time.perf_counter() - made

    import jax

    thread = threading.Thread(target=run, name="taso-jax-compile-ahead", daemon=True)
    thread.seconds = 0.0
    thread.call_seconds = None  # one call of the compiled input, seconds, once known
    thread.start()
    return thread


def choice_reserve(ahead: threading.Thread | None, graph: Graph | None = None) -> float | None:
    """Seconds the end-to-end choice needs for one comparison, or ``None``.

    ``None`` until :func:`compile_ahead`'s thread has timed a call of the input. Making a
    candidate is :func:`guessed_make_seconds` of the input ``graph`` where it is given. It
    is what :func:`~taso_jax.search.choose.no_time_to_compare` asks for: making a candidate
    (taken as long as making the input) and :data:`COMPARE_CALLS` calls. The search is cut
    short to leave it (:func:`taso_jax.search.options.run_search`): a ResNet-18 at 224x224
    whose calls took 685 ms on the loaded 2-core machine searched its full budget in 21 s
    and left the choice 11 s of the 20 s it needed, so nothing was delivered.
    """
    if ahead is None or ahead.call_seconds is None:
        return None
    made = ahead.seconds if graph is None else guessed_make_seconds(ahead, graph)
    return made + COMPARE_CALLS * ahead.call_seconds
