"""The kernel cost cache file: only its own files are written or moved, safe under concurrency."""

import sqlite3
import subprocess
import sys
import threading
import time
import warnings

import pytest
from taso_jax.search import _cost_cache
from taso_jax.search._cost_cache import APPLICATION_ID, open_cost_cache
from taso_jax.search.cost import MeasuredCostModel

ONNX_BYTES = b"\x08\x08\x12\x07pytorch\x1a\x032.1:\x8a\x01\n\x1f" + bytes(range(256)) * 4


def _no_warning_open(path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return open_cost_cache(str(path))


def test_an_onnx_model_named_as_the_cost_cache_is_left_as_it_is(tmp_path, monkeypatch):
    model = tmp_path / "model.onnx"
    model.write_bytes(ONNX_BYTES)
    monkeypatch.setenv("TASO_JAX_COST_CACHE", str(model))
    with pytest.warns(RuntimeWarning, match="not a cost cache") as caught:
        cm = MeasuredCostModel()
    assert len(caught) == 1 and cm._db is None
    assert model.read_bytes() == ONNX_BYTES
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]


def test_another_programs_sqlite_file_is_neither_written_nor_moved(tmp_path):
    other = tmp_path / "app.db"
    db = sqlite3.connect(other)
    db.execute("CREATE TABLE users (name TEXT)")
    db.commit()
    db.close()
    before = other.read_bytes()
    with pytest.warns(RuntimeWarning, match="another program"):
        assert open_cost_cache(str(other)) is None
    assert other.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.db"]


def test_a_damaged_cache_of_its_own_is_moved_to_a_free_name(tmp_path):
    path = tmp_path / "costs.sqlite"
    db = _no_warning_open(path)
    db.execute("INSERT INTO cost (device, key, micros) VALUES ('d', 'k', 1.0)")
    db.close()
    data = bytearray(path.read_bytes())
    assert int.from_bytes(data[68:72], "big") == APPLICATION_ID
    data[100:] = b"\xff" * (len(data) - 100)  # the schema page is garbage, the header not
    path.write_bytes(bytes(data))
    (tmp_path / "costs.sqlite.corrupt").write_text("an earlier one, kept")
    with pytest.warns(RuntimeWarning, match="moved to"):
        db = open_cost_cache(str(path))
    assert db is not None
    assert db.execute("SELECT count(*) FROM cost").fetchone() == (0,)
    db.close()
    assert (tmp_path / "costs.sqlite.corrupt").read_text() == "an earlier one, kept"
    assert (tmp_path / "costs.sqlite.corrupt.1").read_bytes() == bytes(data)


def test_a_damaged_file_without_the_stamp_is_not_moved(tmp_path):
    path = tmp_path / "x.sqlite"
    data = b"SQLite format 3\x00" + b"\xff" * 4000
    path.write_bytes(data)
    with pytest.warns(RuntimeWarning, match="cannot be used"):
        assert open_cost_cache(str(path)) is None
    assert path.read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.sqlite"]


def test_a_cache_without_the_stamp_is_migrated_and_stamped(tmp_path):
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE cost (device TEXT, key TEXT, micros REAL, "
               "PRIMARY KEY (device, key))")
    db.commit()
    db.close()
    db = _no_warning_open(path)
    columns = {row[1] for row in db.execute("PRAGMA table_info(cost)")}
    assert {"spread", "method"} <= columns
    assert db.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
    assert db.execute("PRAGMA user_version").fetchone()[0] == _cost_cache.SCHEMA_VERSION


def _old_cache(path):
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE cost (device TEXT, key TEXT, micros REAL, "
               "PRIMARY KEY (device, key))")
    db.commit()
    db.close()


@pytest.mark.parametrize("old", [False, True], ids=["fresh", "old"])
def test_threads_opening_one_cache_at_once_all_get_it(tmp_path, old):
    path = tmp_path / "costs.sqlite"
    if old:
        _old_cache(path)
    n = 8
    barrier = threading.Barrier(n)
    results, caught = [None] * n, []

    def run(i):
        barrier.wait()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            results[i] = open_cost_cache(str(path))
        caught.extend(str(x.message) for x in w)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert caught == []
    assert all(db is not None for db in results)
    columns = {row[1] for row in results[0].execute("PRAGMA table_info(cost)")}
    assert {"spread", "method"} <= columns


_CHILD = """
import importlib.util, os, sys, time, warnings
spec = importlib.util.spec_from_file_location("cost_cache", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
while not os.path.exists(sys.argv[3]):  # start together
    time.sleep(0.001)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    db = mod.open_cost_cache(sys.argv[2])
print(db is not None, [str(x.message) for x in w])
"""


@pytest.mark.parametrize("old", [False, True], ids=["fresh", "old"])
def test_processes_opening_one_cache_at_once_all_get_it(tmp_path, old):
    path, go = tmp_path / "costs.sqlite", tmp_path / "go"
    if old:
        _old_cache(path)
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, _cost_cache.__file__, str(path),
                               str(go)], stdout=subprocess.PIPE, text=True) for _ in range(4)]
    time.sleep(0.3)  # each has imported the module and waits
    go.touch()
    outs = [p.communicate(timeout=30)[0].strip() for p in procs]
    assert outs == ["True []"] * 4
