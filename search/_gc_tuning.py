"""Fewer cyclic garbage collections while a search runs (:func:`fewer_collections`)."""

from __future__ import annotations

import contextlib
import gc
import threading

#: The youngest generation's threshold while a search runs (Python's default: 700).
SEARCH_GC_THRESHOLD = 20_000
_gc_lock = threading.Lock()
_gc_state: dict = {"depth": 0, "saved": None}


@contextlib.contextmanager
def fewer_collections():
    """Fewer cyclic garbage collections while a search runs; settings restored after.

    A search allocates millions of short-lived, acyclic objects (nodes, tensors, matches),
    which Python's collector would walk with the whole heap again and again. Here the
    objects that exist when the outermost search starts are frozen (:func:`gc.freeze`: no
    longer walked; unless the program froze some of its own, which are then left alone)
    and the youngest generation collects every 20,000 allocations instead of 700
    (measurements: docs/benchmarks.md, "Why the search and choice work as they do").
    Nested or concurrent searches share one setting; the last to finish restores it.
    """
    with _gc_lock:
        if _gc_state["depth"] == 0:
            froze = gc.get_freeze_count() == 0
            if froze:
                gc.freeze()
            threshold = gc.get_threshold()
            gc.set_threshold(max(threshold[0], SEARCH_GC_THRESHOLD), *threshold[1:])
            _gc_state["saved"] = (threshold, froze)
        _gc_state["depth"] += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_state["depth"] -= 1
            if _gc_state["depth"] == 0:
                threshold, froze = _gc_state["saved"]
                gc.set_threshold(*threshold)
                if froze:
                    gc.unfreeze()
