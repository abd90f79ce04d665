"""XLA's persistent compilation cache, turned on for every optimization.

A second optimization of the same model compiles the same kernels and candidates again:
on a CPU each takes 0.1-1 s (a 512x512 product chain: 0.33 s compiled, 0.065 s read back).
JAX can keep compiled executables on disk (``jax_compilation_cache_dir``); this module
points it at ``<user cache dir>/taso_jax/xla`` with no minimum compile time or entry size,
so that every kernel and candidate is kept, and bounds it at :data:`MAX_BYTES` (JAX drops
the least recently used entries past it).

A cache directory the user chose (``jax.config`` or ``$JAX_COMPILATION_CACHE_DIR``) is left
as it is, and ``TASO_JAX_COMPILE_CACHE=off`` turns this off.
"""

from __future__ import annotations

import os
import threading

__all__ = ["enable_persistent_cache", "COMPILE_CACHE_ENV", "MAX_BYTES"]

#: Environment variable: ``off`` leaves JAX's compilation cache alone; a path puts it there.
COMPILE_CACHE_ENV = "TASO_JAX_COMPILE_CACHE"
#: Size of the cache directory past which JAX evicts its least recently used entries.
MAX_BYTES = 2 * 2**30

_lock = threading.Lock()
_done: list[str | None] = []


def enable_persistent_cache() -> str | None:
    """Turn on JAX's persistent compilation cache, once per process; its folder or ``None``.

    ``None`` where it is turned off (``TASO_JAX_COMPILE_CACHE=off``), where the user set
    a folder of their own (that one is used, untouched), or where the folder cannot be
    made (compiles then simply go uncached).
    """
    with _lock:
        if _done:
            return _done[0]
        _done.append(_enable())
        return _done[0]


def _enable() -> str | None:
    import jax

    setting = os.environ.get(COMPILE_CACHE_ENV, "")
    if setting.lower() in ("off", "0", "no", "false"):
        return None
    if jax.config.jax_compilation_cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return None  # the user's own cache
    if setting:
        path = setting
    else:
        import platformdirs

        path = os.path.join(platformdirs.user_cache_dir("taso_jax"), "xla")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return path
