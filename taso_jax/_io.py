"""Atomic file writes: write a temporary file in the target folder, then rename it."""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Callable, Iterator

__all__ = ["atomic_write", "naming_output", "OutputError", "TEMP_PREFIX"]

#: Names of the temporary files and folders written beside an output.
TEMP_PREFIX = ".taso_jax."


class OutputError(OSError):
    """An output file could not be written; ``filename`` is the path the user gave."""


def _ours(filename) -> bool:
    """Whether an error's file name is none, or a temporary file or folder of ours."""
    if filename is None:
        return True
    parts = os.fspath(filename).replace(os.sep, "/").split("/")
    return any(p.startswith(TEMP_PREFIX) for p in parts)


@contextlib.contextmanager
def naming_output(path) -> Iterator[None]:
    """Report an ``OSError`` of writing ``path`` under ``path``, the name the user gave.

    A full disk or a failed rename names no file, or a temporary one (``.taso_jax.*``) that
    no longer exists; such an error is raised again as ``OSError(errno, "cannot write:
    <reason>", path)``. An error that names another file (an input read while writing) is
    raised as it is.

    Raises:
        OutputError: as described (an ``OSError``, ``errno`` kept).
    """
    try:
        yield
    except OSError as e:
        if isinstance(e, OutputError) or not _ours(e.filename):
            raise
        reason = e.strerror or (os.strerror(e.errno) if e.errno else str(e)) or "error"
        raise OutputError(e.errno or errno.EIO, f"cannot write: {reason}",
                          os.fspath(path)) from e


def atomic_write(path, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)`` and move the result onto ``path`` in one rename.

    A reader sees either the old file or the complete new one, never a partial file; on
    error the temporary file is removed and ``path`` is untouched. The file gets the usual
    permissions (0666 less the umask).

    Raises:
        OSError: writing failed: an :class:`OutputError` naming ``path`` where the error
            named no file or the temporary one (a full disk, a folder not writable).
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    with naming_output(path):
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=TEMP_PREFIX, suffix=".tmp")
        os.close(fd)
        try:
            write(tmp)
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
            os.replace(tmp, path)
        except BaseException:
            if os.path.lexists(tmp):
                os.unlink(tmp)
            raise
