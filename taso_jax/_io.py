"""Output files: atomic writes, and the files an output may not be.

A write goes to a temporary file in the target folder, then one rename; which files an
output may not replace (:class:`NamedFiles`) are compared as files, not as paths.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Callable, Iterator

__all__ = ["atomic_write", "naming_output", "OutputError", "TEMP_PREFIX", "NamedFiles",
           "same_file"]

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


def _identity(path) -> tuple[str, tuple[int, int] | None]:
    """``path`` resolved, and its file's ``(st_dev, st_ino)`` where it exists (else None)."""
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError:
        return real, None
    return real, (st.st_dev, st.st_ino)


def _same(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] or (a[1] is not None and a[1] == b[1])


def same_file(a, b) -> bool:
    """Whether paths ``a`` and ``b`` name one file.

    They do where they resolve to one path (symbolic links followed, ``..`` and ``.``
    removed) or, where both exist, are one file on one device (``os.path.samefile``: a
    hard link, a bind mount, a path through a mount elsewhere).
    """
    return _same(_identity(a), _identity(b))


class NamedFiles:
    """Files, each with what it is (``"the input model"``), recognized as files.

    The command line's outputs are checked against its inputs and against each other with
    it: a path names a file held here by :func:`same_file`'s rule, so a hard link or a
    symbolic link to an input is that input. Identities are read when a path is added.
    Iterating gives the resolved paths.
    """

    def __init__(self) -> None:
        self._files: list[tuple[tuple, str]] = []  # (_identity, what)

    def add(self, path, what: str) -> None:
        """Hold ``path`` as ``what``."""
        self._files.append((_identity(path), what))

    def what(self, path) -> str | None:
        """What the file ``path`` names is (the first held that it is), or ``None``."""
        ident = _identity(path)
        return next((what for held, what in self._files if _same(ident, held)), None)

    def __iter__(self) -> Iterator[str]:
        return iter([held[0] for held, _ in self._files])
