"""A full disk while writing an output: one line naming the output path, nothing left."""

from __future__ import annotations

import hashlib
import os
import tempfile
import types

import pytest
from conftest import model_path
from taso_jax.search.rules import default_substitutions, save_substitutions

from taso_jax import _io
from taso_jax.cli import main

FAST = ["--cost-model", "analytic", "--budget", "3", "-q", "--no-time"]


@pytest.fixture
def full_disk(monkeypatch):
    """Every temporary file of an atomic write is /dev/full: each write fails with ENOSPC."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")

    def mkstemp(**kw):
        fd, tmp = tempfile.mkstemp(**kw)
        os.close(fd)
        os.unlink(tmp)
        os.symlink("/dev/full", tmp)
        return os.open(tmp, os.O_WRONLY), tmp

    monkeypatch.setattr(_io, "tempfile", types.SimpleNamespace(mkstemp=mkstemp))


def _digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.iterdir())}


def _names_the_output(capsys, rc, path):
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2, err
    assert err == [f"taso-jax: error: {path}: cannot write: No space left on device"], err


@pytest.mark.slow
def test_optimize_names_its_output_on_a_full_disk(tmp_path, capsys, full_disk):
    out = tmp_path / "out.onnx"
    _names_the_output(capsys, main(["optimize", *FAST, "-o", str(out)]), out)
    assert list(tmp_path.iterdir()) == []
    report = tmp_path / "r.json"
    _names_the_output(capsys, main(["optimize", *FAST, "--json", str(report)]), report)
    assert list(tmp_path.iterdir()) == []


def test_optimize_names_its_output_when_the_input_is_written_back(tmp_path, capsys,
                                                                  full_disk):
    src = tmp_path / "m.onnx"
    src.write_bytes(model_path("tv_squeezenet1_1").read_bytes())
    before = _digests(tmp_path)
    out = tmp_path / "m.opt.onnx"
    rc = main(["optimize", str(src), *FAST, "--budget", "0", "--end-to-end", "0"])
    _names_the_output(capsys, rc, out)
    assert _digests(tmp_path) == before


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["-o", "--report"])
def test_verify_names_its_output_on_a_full_disk(tmp_path, capsys, full_disk, flag):
    src = tmp_path / "rules.json"
    from test_verify_cli import WRONG

    rules = [default_substitutions()[0], WRONG]
    with pytest.MonkeyPatch.context() as m:  # the input itself is written on a good disk
        m.setattr(_io, "tempfile", tempfile)
        save_substitutions(rules, src)
    before = _digests(tmp_path)
    out = tmp_path / "out.txt"
    rc = main(["verify", str(src), "-q", "--workers", "1", flag, str(out)])
    _names_the_output(capsys, rc, out)
    assert _digests(tmp_path) == before


def test_generate_names_its_output_on_a_full_disk(tmp_path, capsys, full_disk, monkeypatch):
    from taso_jax.verify import generator

    small = generator.Domain("mm", {"x": ("input", ("M", "K")), "a": ("weight", ("K", "N"))},
                             ({"M": 2, "K": 3, "N": 4}, {"M": 5, "K": 2, "N": 3}),
                             (("matmul", {}), ("ewadd", {})))
    monkeypatch.setattr(generator, "DEFAULT_DOMAINS", (small,))
    out = tmp_path / "s.json"
    rc = main(["generate", "--max-ops", "2", "--no-verify", "-q", "-o", str(out)])
    _names_the_output(capsys, rc, out)
    assert list(tmp_path.iterdir()) == []


def test_an_error_reading_an_input_while_writing_keeps_the_input_name(tmp_path):
    src = tmp_path / "missing.onnx"
    with pytest.raises(OSError) as e:
        _io.atomic_write(tmp_path / "o", lambda tmp: open(src).close())
    assert e.value.filename == str(src)
    assert list(tmp_path.iterdir()) == []
