"""Head-to-head timing loops of the end-to-end choice, kept inside its time limit.

:func:`taso_jax.search.choose.choose_fastest` screens its candidates against the input,
then confirms the best in loops of its own, and may time it against a near tie: the loops
here. Each is priced before it begins from the screened times, so that none starts that
cannot reach the rounds a verdict needs before the deadline (issue 60, item 7).
"""

from __future__ import annotations

import numpy as np
from taso_jax.search.paired_test import LOOP_LEAST_ROUNDS, halfway, loops_fit

from taso_jax.ir.executor import discard_compiled, time_interleaved

__all__ = ["HeadToHead"]


class HeadToHead:
    """The confirmation and duel loops of the end-to-end choice, after its screening.

    Those of :func:`~taso_jax.search.choose.choose_fastest`. One or two compiled candidates
    are held at a time (:meth:`hold`), made by ``make`` where not held (``made``: seconds
    each making took so far). Each loop stops halfway to ``deadline`` at the latest
    (:func:`halfway`), so that the loop checking a "faster" verdict has time left; a loop
    whose least rounds, and its check loop's, cannot end before the deadline is not begun
    (:func:`loops_fit`): it would be cut short, and overrun the time limit (a 1.1 s-a-call
    layout model's did by 5 s). ``times``: the screened rounds (microseconds) of
    ``graphs``, which price the loops; each loop lasts ``min_seconds`` at least,
    ``repeats`` rounds or more.
    """

    def __init__(self, graphs, times, base, best, best_run, make, made, repeats, deadline,
                 min_seconds: float = 0.0):
        self.graphs, self.base, self.make, self.made = graphs, base, make, made
        self.repeats, self.deadline, self.min_seconds = repeats, deadline, min_seconds
        self.held = {best: best_run}  # the compiled graphs being timed
        self.calls_us = [float(np.median(t)) for t in times]
        self.begun: set = set()

    def hold(self, *keep) -> list:
        """The compiled candidates ``keep``, made if not held; no others are held."""
        for j in [j for j in self.held if j not in keep]:
            discard_compiled(self.graphs[j][1])
            del self.held[j]
        for j in keep:
            if j not in self.held:
                self.held[j] = self.make(self.graphs[j][1])
        return [self.held[j] for j in keep]

    def fits(self, *keep) -> bool:
        """Whether a loop of ``keep`` (and, the first time, its check loop) fits."""
        loops = 1 if keep in self.begun else 2
        self.begun.add(keep)
        make_s = max(self.made) * sum(1 for j in keep if j not in self.held)
        return loops_fit([self.calls_us[j] for j in keep], loops, self.deadline, make_s)

    def confirm(self, i: int) -> tuple[list, list]:
        """A loop of the input against candidate ``i``: ``(input times, its times)``."""
        if not self.fits(0, i):
            return [], []
        return time_interleaved([self.base, *self.hold(i)], self.repeats, 1,
                                halfway(self.deadline), min_seconds=self.min_seconds,
                                least=LOOP_LEAST_ROUNDS)

    def duel(self, i: int, j: int) -> tuple[list, list]:
        """A loop of the confirmed candidate ``i`` against a near tie ``j``."""
        if not self.fits(i, j):
            return [], []
        return time_interleaved(self.hold(i, j), self.repeats, 1, halfway(self.deadline),
                                min_seconds=self.min_seconds, least=LOOP_LEAST_ROUNDS)
