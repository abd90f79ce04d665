"""What this process may use of the machine it runs on."""

from __future__ import annotations

import os

__all__ = ["usable_cores"]


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask), at least 1.

    A process pinned with ``taskset -c 1`` on a 2-core machine gets 1, where
    ``os.cpu_count()`` says 2. Where the platform has no affinity call (macOS), the
    machine's core count.
    """
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
