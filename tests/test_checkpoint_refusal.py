"""``--checkpoint`` names a text file that is not a checkpoint: refused, the file untouched.

A checkpoint is appended to; notes or a rule file named by mistake got proof lines written
into them. A file with complete lines none of which is a proof record is refused before
any work (exit 2, one line); a checkpoint cut short before its first line was complete
still resumes.
"""

from __future__ import annotations

import json

import pytest
from taso_jax.search.rules import default_substitutions, save_substitutions

from taso_jax.cli import main
from taso_jax.cli_files import UsageError, check_checkpoint_text

ONE_RULE = "ra7cf510783c0"  # a shipped rule proved quickly (see test_verify_cli.py)


def _rule_file(tmp_path):
    src = tmp_path / "rules.json"
    save_substitutions([s for s in default_substitutions() if s.id == ONE_RULE], src)
    return src


@pytest.mark.parametrize("text", [
    "my notes\nabout the proofs\n",
    json.dumps({"substitutions": []}) + "\n",  # a rule file, or any JSON document
    "[1, 2, 3]\n{\"id\": 3}\n",  # JSON lines, but no proof record
])
def test_a_text_file_that_is_not_a_checkpoint_is_refused(tmp_path, capsys, text):
    src, ckpt = _rule_file(tmp_path), tmp_path / "notes.txt"
    ckpt.write_text(text)
    code = main(["verify", str(src), "--workers", "1", "-q", "--checkpoint", str(ckpt)])
    err = capsys.readouterr().err
    assert code == 2 and ckpt.read_text() == text
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "not a checkpoint file" in lines[0], err
    assert "Traceback" not in err


def test_a_checkpoint_cut_short_or_with_one_good_line_is_accepted(tmp_path):
    record = {"id": "r0", "limits": {}, "result": {"status": "unproved"}, "digest": "0"}
    cases = {"cut.jsonl": json.dumps(record)[:20],  # cut before its first line ended
             "one.jsonl": "garbage\n" + json.dumps(record) + "\n" + json.dumps(record)[:9],
             "blank.jsonl": "\n\n",
             "empty.jsonl": ""}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        check_checkpoint_text(str(tmp_path / name))  # no UsageError
    (tmp_path / "bad.jsonl").write_text("garbage\n" + json.dumps(record)[:20])
    with pytest.raises(UsageError, match="not a checkpoint file"):
        check_checkpoint_text(str(tmp_path / "bad.jsonl"))


def test_a_cut_short_checkpoint_resumes(tmp_path, capsys):
    src, ckpt = _rule_file(tmp_path), tmp_path / "proofs.jsonl"
    ckpt.write_text('{"id": "' + ONE_RULE + '", "lim')  # the run stopped mid-line
    assert main(["verify", str(src), "--workers", "1", "-q", "--checkpoint", str(ckpt)]) == 0
    assert "proved: 1" in capsys.readouterr().out
    assert any(ONE_RULE in line for line in ckpt.read_text().splitlines()[1:])

