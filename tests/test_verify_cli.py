"""``taso-jax verify``: proves a rule file, stamps proofs, lists and fails on the rest."""

from __future__ import annotations

import json
import os
import time

import pytest
from conftest import returns_soon
from taso_jax.search.rules import (
    PNode,
    Substitution,
    default_substitutions,
    load_substitutions,
    save_substitutions,
)

from taso_jax.cli import main

PROVABLE = ["ra7cf510783c0", "r73eac692a396", "rda5cf32b2990"]  # ids (see test_axioms.py)
WRONG = Substitution(
    "wrong:relu-distributes", (("a", ("N",)), ("b", ("N",))),
    (PNode("ewadd", (), ("a", "b")), PNode("relu", (), ("#0",))),
    (PNode("relu", (), ("a",)), PNode("relu", (), ("b",)), PNode("ewadd", (), ("#0", "#1"))),
    (("#1", "#2"),), {})


def _rules(ids):
    """The shipped rules with these stable ids."""
    subs = {s.id: s for s in default_substitutions()}
    return [subs[i] for i in ids]


def test_verify_stamps_proofs_and_exits_zero(tmp_path, capsys):
    src, out = tmp_path / "rules.json", tmp_path / "proved.json"
    save_substitutions(_rules(PROVABLE), src)
    assert main(["verify", str(src), "-o", str(out), "--workers", "1", "-q",
                 "--report", str(tmp_path / "unproved.txt")]) == 0
    text = capsys.readouterr().out
    assert "proved: 3; not proved: 0" in text
    for s in load_substitutions(out):
        proof = s.provenance["proof"]
        assert proof["status"] == "proved" and proof["axioms"], proof
    assert not (tmp_path / "unproved.txt").exists()


@pytest.mark.slow
def test_verify_lists_what_it_cannot_prove_and_exits_nonzero(tmp_path, capsys):
    src, report = tmp_path / "rules.json", tmp_path / "unproved.txt"
    save_substitutions(_rules(PROVABLE[:1]) + [WRONG], src)
    before = src.read_bytes()
    assert main(["verify", str(src), "--workers", "1", "-q", "--report", str(report)]) == 1
    assert src.read_bytes() == before  # the input file is never rewritten
    listed = report.read_text()
    assert "wrong:relu-distributes" in listed and _rules(PROVABLE[:1])[0].name not in listed
    assert "proved: 1" in capsys.readouterr().out


def test_verify_bad_file_is_a_usage_error(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"substitutions": [{"name": "x"}]}))
    assert main(["verify", str(bad), "-q"]) == 2
    assert "not a valid substitution file" in capsys.readouterr().err


@pytest.mark.slow
def test_verification_runs_in_a_process_pool():
    from taso_jax.verify.runner import verify_substitutions

    subs = _rules(PROVABLE) * 3 + [WRONG]
    stamped, stats = verify_substitutions(subs, workers=2)
    assert stats["counts"]["proved"] == 9
    assert stamped[-1].provenance["proof"]["status"] != "proved"
    assert [s.name for s in stamped] == [s.name for s in subs]


def test_proofs_are_bounded_by_solver_steps_not_wall_clock():
    """A rule's status depends on Z3's resource limit (steps), not on the machine's load."""
    from taso_jax.verify.prover import DEFAULT_RLIMIT, Prover
    from taso_jax.verify.runner import verify_substitutions

    rule = _rules(PROVABLE[:1])[0]
    assert Prover().prove(rule)["status"] == "proved"
    assert Prover(rlimit=1).prove(rule)["status"] == "unknown"  # out of steps at once
    stamped, _ = verify_substitutions([rule], workers=1)
    proof = stamped[0].provenance["proof"]
    assert proof["rlimit"] == DEFAULT_RLIMIT and "timeout_ms" not in proof


@pytest.mark.slow
def test_a_local_dask_cluster_of_two_workers_proves_like_the_pool(tmp_path, capsys):
    """The cluster engine (Dask LocalCluster, 2 worker processes) gives the same stamps."""
    from taso_jax.verify.runner import verify_substitutions

    subs = _rules(PROVABLE) * 3 + [WRONG]
    stamped, stats = verify_substitutions(subs, workers=2, cluster="local")
    assert stats["engine"] == "dask (local)" and stats["counts"]["proved"] == 9
    assert stamped[-1].proof_status != "proved"
    # the command line: same answer, and it says which engine ran
    path = tmp_path / "rules.json"
    save_substitutions(_rules(PROVABLE), path)
    assert main(["verify", str(path), "-q", "--cluster", "local", "--workers", "2"]) == 0
    assert "proved: 3" in capsys.readouterr().out


@pytest.mark.slow
def test_generate_on_a_local_dask_cluster_gives_the_rules_of_one_process(tmp_path):
    """`taso-jax generate --cluster local` runs each domain as a task on the cluster and
    writes the same rules, in the same order, as generation in this process."""
    from taso_jax.search.rules import load_substitutions
    from taso_jax.verify.generator import DEFAULT_DOMAINS, generate

    names = ["matmulrows", "matmulbranch"]
    by_name = {d.name: d for d in DEFAULT_DOMAINS}
    here, _ = generate([by_name[n] for n in names], max_ops=3, workers=1)
    out = tmp_path / "rules.json"
    assert main(["generate", "--max-ops", "3", "--domains", ",".join(names), "--no-verify",
                 "--allow-unverified", "--cluster", "local", "--workers", "2", "-q",
                 "-o", str(out)]) == 0
    there = load_substitutions(out)
    assert len(here) > 0
    assert [s.id for s in there] == [s.id for s in here]
    assert [s.name for s in there] == [s.name for s in here]


@pytest.mark.slow
def test_an_interrupted_verification_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    import taso_jax.verify.runner as runner

    subs = _rules(PROVABLE)
    ckpt = tmp_path / "proofs.jsonl"
    calls = []
    real = runner._prove_json
    monkeypatch.setattr(runner, "_prove_json", lambda job: calls.append(job[0]) or real(job))
    runner.verify_substitutions(subs[:2], workers=1, checkpoint=ckpt)  # "interrupted"
    assert len(ckpt.read_text().splitlines()) == 2
    calls.clear()
    stamped, stats = runner.verify_substitutions(subs, workers=1, checkpoint=ckpt)
    assert stats["resumed"] == 2 and calls == [2]  # only the third rule was proved now
    assert [s.proof_status for s in stamped] == ["proved"] * 3
    # a checkpoint made under other limits is not used
    calls.clear()
    _, other = runner.verify_substitutions(subs, workers=1, checkpoint=ckpt, rlimit=10**7)
    assert other["resumed"] == 0 and len(calls) == 3


def _one_error_line(capsys, *expected):
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("taso-jax: error:"), err
    for text in expected:
        assert text in err[0], err[0]


def test_verify_never_writes_over_its_input_file(tmp_path, capsys):
    src = tmp_path / "rules.json"
    save_substitutions([WRONG], src)
    before = src.read_bytes()
    for flag in ("--report", "-o", "--checkpoint"):
        assert main(["verify", str(src), "-q", "--workers", "1", flag, str(src)]) == 2
        _one_error_line(capsys, flag, "the input rule file")
        assert src.read_bytes() == before
    # nor one output over another, nor a folder
    out = tmp_path / "out.json"
    assert main(["verify", str(src), "-q", "-o", str(out), "--report", str(out)]) == 2
    _one_error_line(capsys, "--report", "the output file (-o)")
    assert main(["verify", str(src), "-q", "--report", str(tmp_path)]) == 2
    _one_error_line(capsys, "--report", "is not a regular file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rules.json"]
    from importlib.resources import files

    shipped = str(files("taso_jax").joinpath("data/substitutions.json"))
    assert main(["verify", "-q", "-o", shipped]) == 2
    _one_error_line(capsys, "the shipped rule set")


@pytest.mark.slow
def test_verify_without_report_leaves_an_existing_unproved_txt_alone(
        tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = tmp_path / "rules.json"
    save_substitutions([WRONG], src)
    (tmp_path / "unproved.txt").write_text("my notes\n")
    assert main(["verify", str(src), "--workers", "1", "-q"]) == 1
    assert (tmp_path / "unproved.txt").read_text() == "my notes\n"
    out = capsys.readouterr().out
    assert "not proved:" in out and "wrong:relu-distributes" in out  # printed instead
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rules.json", "unproved.txt"]


@pytest.mark.parametrize("kind", ["device", "fifo", "folder"])
def test_verify_reads_only_regular_rule_files(tmp_path, capsys, kind):
    path = {"device": "/dev/zero", "folder": str(tmp_path)}.get(kind, str(tmp_path / "p"))
    if kind == "fifo":
        os.mkfifo(path)
    assert returns_soon(lambda: main(["verify", path, "-q"])) == 2
    _one_error_line(capsys, "rule file", "is not a regular file")


@pytest.mark.parametrize("args, expected", [
    (["--max-ops", "1000000000"], "--max-ops"), (["--max-ops", "0"], "--max-ops"),
    (["--seed", "-1"], "--seed"), (["--workers", "0"], "--workers"),
    (["--workers", "100000"], "--workers"),
    # an empty list is not "every domain" (that is the longest generation there is)
    (["--domains", ""], "names no domain"), (["--domains", ","], "names no domain"),
    (["--domains", "conv,nope"], "unknown domain(s) 'nope'")])
def test_generate_refuses_out_of_range_numbers_before_any_work(tmp_path, capsys, args,
                                                               expected):
    out = tmp_path / "s.json"
    assert main(["generate", "-q", "-o", str(out), *args]) == 2
    _one_error_line(capsys, expected)
    assert not out.exists()


def _link(kind: str, target, link):
    """``link`` made a hard or symbolic link to ``target``."""
    if kind == "hard":
        os.link(target, link)
    else:
        os.symlink(target, link)
    return link


@pytest.mark.parametrize("kind", ["hard", "symbolic"])
@pytest.mark.parametrize("flag", ["--checkpoint", "-o", "--report"])
def test_verify_never_writes_over_its_input_file_through_a_link(tmp_path, capsys, kind,
                                                                 flag):
    # a hard link is the input file under another path: a checkpoint named by one had its
    # lines appended to the rule file, since only resolved paths were compared
    src = tmp_path / "rules.json"
    save_substitutions([WRONG], src)
    before = src.read_bytes()
    link = _link(kind, src, tmp_path / "link.json")
    assert main(["verify", str(src), "-q", "--workers", "1", flag, str(link)]) == 2
    _one_error_line(capsys, flag, "the input rule file")
    assert src.read_bytes() == before


@pytest.mark.parametrize("kind", ["hard", "symbolic"])
def test_no_two_outputs_of_verify_or_generate_are_one_file_through_a_link(tmp_path, capsys,
                                                                          kind):
    src = tmp_path / "rules.json"
    save_substitutions([WRONG], src)
    out = tmp_path / "out.json"
    out.write_text("mine")
    link = _link(kind, out, tmp_path / "link.txt")
    assert main(["verify", str(src), "-q", "-o", str(out), "--report", str(link)]) == 2
    _one_error_line(capsys, "--report", "the output file (-o)")
    assert main(["generate", "-q", "-o", str(out), "--checkpoint", str(link)]) == 2
    _one_error_line(capsys, "-o", "the checkpoint (--checkpoint)")
    assert out.read_text() == "mine"


def test_generate_checks_its_output_paths_before_any_work(tmp_path, capsys, monkeypatch):
    started = time.perf_counter()
    assert main(["generate", "-q", "-o", str(tmp_path)]) == 2
    _one_error_line(capsys, "-o", "is not a regular file")
    assert main(["generate", "-q", "-o", str(tmp_path / "s.json"), "--report",
                 str(tmp_path / "s.json")]) == 2
    _one_error_line(capsys, "--report", "the output file (-o)")
    # the default output is written only where no such file is
    monkeypatch.chdir(tmp_path)
    (tmp_path / "substitutions.json").write_text("mine")
    assert main(["generate", "-q"]) == 2
    _one_error_line(capsys, "substitutions.json", "already exists")
    assert (tmp_path / "substitutions.json").read_text() == "mine"
    assert time.perf_counter() - started < 5  # refused before generating anything


def test_a_forged_checkpoint_line_does_not_make_a_false_rule_proved(tmp_path, capsys):
    import hashlib

    import taso_jax.verify.runner as runner
    from taso_jax.verify.laws import all_axioms
    src, ckpt = tmp_path / "rules.json", tmp_path / "proofs.jsonl"
    save_substitutions([WRONG], src)
    axioms = hashlib.sha256("\n".join(f"{n}: {a.law}" for n, a in all_axioms())
                            .encode()).hexdigest()
    limits = {"rlimit": 20_000, "axioms": axioms[:16]}  # a small limit: a quick "no"
    result = {"status": "proved", "axioms": ["ewadd-commutative"], "seconds": 0.1}

    def line(**extra):
        return json.dumps({"id": WRONG.id, "limits": limits, "result": result, **extra})

    ckpt.write_text("\n".join([
        line(),  # the format of the earlier checkpoints: no digest
        line(digest="0" * 64),  # a wrong digest
        line(digest=runner.checkpoint_digest(WRONG.id, "f" * 64, limits, result)),  # other axioms
        line(digest=runner.checkpoint_digest(WRONG.id, axioms, {**limits, "rlimit": 1},
                                             result)),  # other limits
    ]) + "\n")
    assert main(["verify", str(src), "--workers", "1", "-q", "--checkpoint", str(ckpt),
                 "--rlimit", "20000"]) == 1
    out = capsys.readouterr().out
    assert "proved: 0" in out and "from the checkpoint" not in out
    # the line this program writes, for the real result, is taken on a rerun
    stamped, stats = runner.verify_substitutions([WRONG], workers=1, checkpoint=ckpt,
                                                 rlimit=20_000)
    assert stats["resumed"] == 1 and stamped[0].proof_status != "proved"
