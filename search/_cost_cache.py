"""The SQLite file of measured kernel costs: opened, created and migrated safely.

The cache path comes from the user (``$TASO_JAX_COST_CACHE``, ``--cost-cache``), so it may
name any file: an ONNX model, another program's database. Only a file this module can
identify as its own is ever written, migrated or moved aside:

* a new or empty file, which becomes a cache;
* a SQLite file stamped with :data:`APPLICATION_ID` (``PRAGMA application_id``, bytes 68 to
  71 of the SQLite header), as every cache created or opened here is;
* a SQLite file without that stamp (a cache written before it) whose only table is ``cost``.

A damaged file is moved aside only when its header still carries the stamp, and then to a
free name (``costs.sqlite.corrupt``, ``.corrupt.1``, ...), never over an existing file.
Anything else gives one warning, and costs are measured without a cache.

Several processes may open a fresh or old cache at once (the separate commands of a
benchmark run): creation and migration run in one ``BEGIN IMMEDIATE`` transaction under a
busy timeout, so one process migrates and the others wait, then find the columns there.
"""

from __future__ import annotations

import os
import sqlite3
import stat
import warnings

__all__ = ["APPLICATION_ID", "SCHEMA_VERSION", "open_cost_cache"]

#: ``PRAGMA application_id`` of a taso_jax cost cache: "tasj" in ASCII.
APPLICATION_ID = 0x7461736A
#: ``PRAGMA user_version`` of the current schema (``spread`` and ``method`` columns; the
#: ``samples`` table of kernel features; 4: their product sizes).
SCHEMA_VERSION = 4
#: Seconds a connection waits for another process's lock (creation, migration, a write).
BUSY_TIMEOUT_S = 10.0

_SQLITE_MAGIC = b"SQLite format 3\x00"


def _header(path: str) -> bytes | None:
    """The first 100 bytes of ``path`` (the SQLite header), ``b""`` if it is empty.

    ``None`` for a file that does not exist.
    """
    try:
        with open(path, "rb") as f:
            return f.read(100)
    except FileNotFoundError:
        return None


def _stamped(header: bytes) -> bool:
    """Whether a SQLite header carries this cache's application id."""
    return (header.startswith(_SQLITE_MAGIC) and len(header) >= 72
            and int.from_bytes(header[68:72], "big") == APPLICATION_ID)


def _free_name(base: str) -> str:
    """``base``, or ``base.1``, ``base.2``, ...: the first name no file has."""
    name, n = base, 0
    while os.path.lexists(name):
        n += 1
        name = f"{base}.{n}"
    return name


def _move_aside(path: str) -> str | None:
    """Move a damaged cache to a free ``.corrupt`` name; its new path, or ``None``.

    A hard link then an unlink: the link fails rather than replace a file that appeared
    meanwhile (another process moving the same cache aside), and the name is tried again.
    """
    for _ in range(100):
        aside = _free_name(path + ".corrupt")
        try:
            os.link(path, aside)
        except FileExistsError:
            continue
        except OSError:
            return None  # no hard links here: the cache is left as it is, and not used
        try:
            os.unlink(path)
        except OSError:
            return None
        for suffix in ("-wal", "-shm"):  # a journal of the old file must not replay
            try:
                os.unlink(path + suffix)
            except OSError:
                pass
        return aside
    return None


def _warn(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def _is_own(db: sqlite3.Connection) -> bool:
    """Whether an open SQLite file is a cost cache (or empty, so that it may become one).

    The stamp and the tables are read in one read transaction: read apart, another
    process's migration could commit between them, showing an unstamped file with the
    tables of a current cache.
    """
    _while_locked(db.execute, "BEGIN")
    try:
        application = db.execute("PRAGMA application_id").fetchone()[0]
        tables = {row[0] for row in db.execute(
            "SELECT name FROM sqlite_master WHERE type='table' AND name NOT LIKE 'sqlite_%'")}
    finally:
        if db.in_transaction:
            db.execute("COMMIT")
    if application != 0:
        return application == APPLICATION_ID
    return tables <= {"cost", "samples"}


def _migrate(db: sqlite3.Connection) -> None:
    """Create or bring up to date the ``cost`` table, in one write transaction."""
    db.execute("BEGIN IMMEDIATE")  # one process at a time; the others wait (busy timeout)
    try:
        db.execute("CREATE TABLE IF NOT EXISTS cost (device TEXT, key TEXT, micros REAL, "
                   "spread REAL, method INTEGER, PRIMARY KEY (device, key))")
        # features and raw times of measured kernels, which fit the calibrated cost model's
        # curves (taso_jax.search.calibrated)
        db.execute("CREATE TABLE IF NOT EXISTS samples (device TEXT, key TEXT, op TEXT, "
                   "family TEXT, flops REAL, bytes REAL, narrow INTEGER, micros REAL, "
                   "outputs REAL, groups INTEGER, rows REAL, inner REAL, cols REAL, "
                   "PRIMARY KEY (device, key))")
        _add_columns(db, "samples", (("outputs", "REAL"), ("groups", "INTEGER"),
                                     ("rows", "REAL"), ("inner", "REAL"), ("cols", "REAL")))
        columns = {row[1] for row in db.execute("PRAGMA table_info(cost)")}
        # caches written before spreads, then timing methods, were recorded (a time of
        # no method is measured again)
        for column, kind in (("spread", "REAL"), ("method", "INTEGER")):
            if column not in columns:
                try:
                    db.execute(f"ALTER TABLE cost ADD COLUMN {column} {kind}")
                except sqlite3.OperationalError as e:  # added by a writer of an older version
                    if "duplicate column" not in str(e):
                        raise
        db.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        db.execute("SELECT count(*) FROM cost").fetchone()
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


def _add_columns(db: sqlite3.Connection, table: str, wanted) -> None:
    """Add the ``(name, type)`` columns ``wanted`` that ``table`` lacks (an older cache)."""
    columns = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
    for column, kind in wanted:
        if column not in columns:
            try:
                db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
            except sqlite3.OperationalError as e:  # added by a writer of another process
                if "duplicate column" not in str(e):
                    raise


def _while_locked(step, *args) -> None:
    """Run ``step`` again while SQLite says the database is locked, up to the busy timeout.

    Switching an old cache to WAL journaling needs the file to itself, and SQLite answers
    "database is locked" at once, without its busy handler, where another process holds a
    read lock at that moment (four processes opening one old cache together).
    """
    import time

    end = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            step(*args)
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > end:
                raise
            time.sleep(0.01)


def open_cost_cache(path: str) -> sqlite3.Connection | None:
    """The SQLite cost cache at ``path``, created if absent; ``None`` where none can be used.

    The connection is in autocommit mode with a busy timeout of :data:`BUSY_TIMEOUT_S`
    and WAL journaling, usable from several threads (writes must be serialized by the
    caller). Never raises for a bad file: each case below gives one ``RuntimeWarning``
    and ``None`` (costs are then measured without a cache):

    * the path is not a regular file (a folder, a device, a pipe), or its folder cannot
      be made;
    * the file is not a SQLite file, or is another program's SQLite file: it is neither
      written nor moved;
    * the file cannot be opened or written (permissions, a lock held too long).

    A damaged cache that carries :data:`APPLICATION_ID` is moved to a free ``.corrupt``
    name (see :func:`_move_aside`) and a new cache is started in its place.
    """
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    except OSError as e:
        _warn(f"kernel cost cache {path}: {e.strerror}; measuring without a cache")
        return None
    for attempt in range(2):
        try:
            st = os.stat(path)
        except FileNotFoundError:
            st = None
        except OSError as e:
            _warn(f"kernel cost cache {path}: {e.strerror}; measuring without a cache")
            return None
        if st is not None and not stat.S_ISREG(st.st_mode):
            _warn(f"kernel cost cache {path} is not a regular file; measuring without a cache")
            return None
        try:
            header = _header(path)
        except OSError as e:
            _warn(f"kernel cost cache {path}: {e.strerror}; measuring without a cache")
            return None
        if header and not header.startswith(_SQLITE_MAGIC):
            _warn(f"kernel cost cache {path} is not a cost cache (not a SQLite file); it is "
                  "left as it is and costs are measured without a cache")
            return None
        db = None
        try:
            db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, check_same_thread=False,
                                 isolation_level=None)
            db.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            if not _is_own(db):
                db.close()
                _warn(f"kernel cost cache {path} is another program's SQLite file; it is "
                      "left as it is and costs are measured without a cache")
                return None
            _while_locked(db.execute, "PRAGMA journal_mode=WAL")
            _while_locked(_migrate, db)
            return db
        except sqlite3.DatabaseError as e:
            if db is not None:
                db.close()
            damaged = "not a database" in str(e) or "malformed" in str(e)
            if attempt == 0 and damaged and _stamped(_header(path) or b""):
                aside = _move_aside(path)
                if aside is not None:
                    _warn(f"kernel cost cache {path} is damaged ({e}); moved to {aside} and "
                          "started anew")
                    continue
            _warn(f"kernel cost cache {path} cannot be used ({e}); measuring without a "
                  "cache")
            return None
    return None
