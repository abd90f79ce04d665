"""The background worker of ``@taso_jax.optimize(mode="background")``.

One daemon thread, started on first use and shared by every decorated function, runs the
first-call pipelines that background mode hands it, one after another, while the caller
runs ``jax.jit`` of the original; :data:`MAX_PENDING` bounds what one function may queue.
How a call picks up a finished optimization is the call path's business
(:meth:`taso_jax.decorator.OptimizedFunction._background`).
"""

from __future__ import annotations

import atexit
import threading

__all__ = ["MAX_PENDING"]


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
            # bound while get() waits, the last job would keep its signature's entry (the
            # compiled stages) and the call's argument copies alive after it is dropped
            job = future = fn = args = None
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
