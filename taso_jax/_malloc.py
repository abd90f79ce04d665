"""Steadier CPU timings: glibc's malloc on transparent huge pages, for benchmark processes.

XLA:CPU takes each call's buffers from ``malloc``. With glibc's defaults, buffers above the
mmap threshold can be mapped and unmapped on every call, so that every call faults its
memory in again in 4 KiB pages. On the 2-core host of docs/benchmarks.md, TASO's NasNet-A
(446 operators) took 1,300-1,600 minor page faults a call, and the same compiled graph's
median call moved between 152 and 226 ms from one 3-second loop to the next on an idle
machine. Its CPU time moved with it, so this is neither the other
core's load nor the timer. With the glibc tunable ``glibc.malloc.hugetlb=1`` (glibc 2.35
and later: malloc asks for transparent huge pages with ``madvise``) the same graph took
0-12 faults a call and ran 105-106 ms, four loops out of four. With one of the two cores
busy, one graph pair's speedup (the median of per-round ratios) then moved by 0.07 between
loops, against 0.27-0.35 with the default malloc; idle, the medians still moved, but the
minima held (docs/benchmarks.md, 2026-11-27).

glibc reads its tunables once, at process start, so a process that wants them has to be
started again: :func:`restart_with_hugepages` does that for the benchmark scripts and
``taso-jax bench``. The optimizer itself (``taso-jax optimize``, the decorator) runs in the
user's process as the user started it, and its end-to-end choice is timed under the same
allocator the user's model runs under.
"""

from __future__ import annotations

import functools
import os
import platform
import sys

__all__ = ["HUGEPAGE_TUNABLE", "HUGEPAGES_ENV", "malloc_setting", "restart_with_hugepages"]

#: The glibc tunable that backs malloc's memory with transparent huge pages (glibc 2.35+).
HUGEPAGE_TUNABLE = "glibc.malloc.hugetlb=1"
#: Set to ``off`` to keep glibc's default malloc in the benchmark processes.
HUGEPAGES_ENV = "TASO_JAX_HUGEPAGES"


@functools.cache
def _glibc_with_hugetlb() -> bool:
    """Whether this is Linux with a glibc that knows ``glibc.malloc.hugetlb`` (2.35+).

    Cached: ``platform.libc_ver`` reads the interpreter's executable to find out.
    """
    if not sys.platform.startswith("linux"):
        return False
    lib, version = platform.libc_ver()
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        return False
    return lib == "glibc" and (major, minor) >= (2, 35)


def malloc_setting(environ=None) -> str:
    """The malloc this process runs with: ``"glibc.malloc.hugetlb=1"`` or ``"default"``.

    Read from ``GLIBC_TUNABLES`` (a colon-separated list) of ``environ`` (default
    ``os.environ``), which glibc read when this process started.
    """
    env = os.environ if environ is None else environ
    tunables = env.get("GLIBC_TUNABLES", "").split(":")
    return HUGEPAGE_TUNABLE if HUGEPAGE_TUNABLE in tunables and _glibc_with_hugetlb() \
        else "default"


def restart_with_hugepages(argv=None, environ=None, execve=os.execve) -> None:
    """Start this process again with :data:`HUGEPAGE_TUNABLE`, unless it has it or can't.

    Nothing happens where the tunable is in effect already, where the platform is not
    Linux with glibc 2.35 or later, or where ``TASO_JAX_HUGEPAGES=off``. Otherwise the
    process is replaced (``os.execve``) by the same interpreter with the same command line
    (``argv``, default ``sys.orig_argv``: interpreter flags included) and ``GLIBC_TUNABLES``
    extended with the tunable; this function then does not return. Call it first thing in
    a benchmark's ``main``, before any work or output that a restart would repeat.

    Raises:
        OSError: the interpreter could not be started again (from ``os.execve``).
    """
    env = dict(os.environ if environ is None else environ)
    if (env.get(HUGEPAGES_ENV, "").lower() == "off" or not _glibc_with_hugetlb()
            or malloc_setting(env) != "default"):
        return
    env["GLIBC_TUNABLES"] = ":".join(t for t in (env.get("GLIBC_TUNABLES"), HUGEPAGE_TUNABLE)
                                     if t)
    args = list(sys.orig_argv if argv is None else argv)
    sys.stdout.flush()
    sys.stderr.flush()
    execve(sys.executable, args, env)
