"""The one time limit of an optimization, and why a search stopped.

An optimization is given one limit in seconds (``OptimizeOptions.time_limit``). A
:class:`Deadline` is started from it once, at the front door, and passed down explicitly;
each phase that may use only part of the limit asks for its named share (:data:`SHARES`),
which ends no later than the whole. Nothing else converts seconds into fractions.

Modelled on egg's ``Runner`` limits and ``StopReason`` (Willsey et al., POPL 2021, Section 5).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

__all__ = ["Deadline", "SHARES", "StopReason", "until"]

#: Share of the whole time limit each phase may use at most, by name. ``search``: the
#: backtracking search under the measured cost model, kernel measurement included (the
#: end-to-end choice has the rest). ``second_opinion``: each search that second-guesses the
#: cost model (the analytic search, the near ties, the search without one rule).
#: ``choice_reserve``: what the end-to-end choice keeps for itself; a second opinion that
#: would leave it less is not run. ``rule_proofs``: the proofs of a rule file that did not
#: ship with the package (``substitutions=FILE`` without ``trust_proofs``), before the search.
#: ``open_sizes``: the symbolic shape inference that carries an ONNX model's open sizes
#: into the import (given up past it: the sizes stay fixed at the binding).
SHARES = {"search": 0.7, "second_opinion": 0.1, "choice_reserve": 0.3, "rule_proofs": 0.5,
          "open_sizes": 0.15}


class StopReason(enum.StrEnum):
    """Why a search ended; equal to its string value, as reports print it."""

    QUEUE_EMPTY = "queue empty"  # every graph within alpha of the best was expanded
    BUDGET = "budget"  # ``budget`` graphs were expanded
    TIME_LIMIT = "time limit"  # the search's share of the deadline passed
    GRAPH_CACHE = "graph cache"  # no search ran: the graph was read from the graph cache
    # the search ended early, leaving the end-to-end choice the time one comparison needs
    CHOICE_RESERVE = "time kept for the end-to-end choice"


@dataclass(frozen=True)
class Deadline:
    """A point in time by which some work must end.

    Attributes:
        at: the end, in ``time.perf_counter()`` seconds.
        seconds: the length of the whole limit this deadline belongs to, in seconds (what
            the named shares are fractions of).
    """

    at: float
    seconds: float

    @classmethod
    def start(cls, seconds: float) -> Deadline:
        """A deadline ``seconds`` from now.

        Raises:
            ValueError: ``seconds`` is not a positive finite number.
        """
        if not (seconds > 0 and seconds < float("inf")):
            raise ValueError(f"a time limit must be a positive number of seconds, got {seconds}")
        return cls(time.perf_counter() + seconds, float(seconds))

    @classmethod
    def never(cls) -> Deadline:
        """A deadline that never passes (no limit)."""
        return cls(float("inf"), float("inf"))

    def left(self) -> float:
        """Seconds until the deadline, never below 0."""
        return max(0.0, self.at - time.perf_counter())

    def elapsed(self) -> float:
        """Seconds since the deadline was started (:meth:`start`)."""
        return self.seconds - (self.at - time.perf_counter())

    def passed(self) -> bool:
        """Whether the deadline has passed."""
        return time.perf_counter() > self.at

    def share(self, name: str) -> Deadline:
        """The deadline of a phase that may use the share ``name`` of the whole limit.

        It ends ``SHARES[name] * seconds`` from now, or at this deadline if that is sooner.

        Raises:
            KeyError: ``name`` is not in :data:`SHARES`.
        """
        span = SHARES[name] * self.seconds
        return Deadline(min(self.at, time.perf_counter() + span), self.seconds)

    def share_seconds(self, name: str) -> float:
        """The seconds of the share ``name`` that are still left (``share(name).left()``)."""
        return self.share(name).left()

    def keeps(self, name: str) -> bool:
        """Whether at least the share ``name`` of the whole limit is still left."""
        return self.left() >= SHARES[name] * self.seconds


def until(items: Iterable, at: float) -> Iterator:
    """The items of ``items`` while ``time.perf_counter()`` is at most ``at``.

    What lets a search stop inside one pass over a rule's matches: on a 20,000-operator
    unrolled RNN one rule matches 2.8 million (ordered) pairs of steps.
    """
    for item in items:
        if time.perf_counter() > at:
            return
        yield item
