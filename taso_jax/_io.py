"""Atomic file writes: write a temporary file in the target folder, then rename it."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable


def atomic_write(path, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)`` and move the result onto ``path`` in one rename.

    A reader sees either the old file or the complete new one, never a partial file; on
    error the temporary file is removed and ``path`` is untouched. The file gets the usual
    permissions (0666 less the umask).
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".taso_jax.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
