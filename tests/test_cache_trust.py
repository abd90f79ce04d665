"""Caches are files, not proofs: what another process wrote is checked before it is trusted.

A graph cache entry whose graph was edited and its digest computed again, and a proof
checkpoint or proof cache whose "proved" line carries a correctly computed digest, are what a
shared or restored cache can hold (issue 60, item 5). Each test here plants one.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from taso_jax.search.rules import PNode, Substitution, load_substitutions, save_substitutions

import taso_jax
from taso_jax.cli import main
from taso_jax.frontends import graph_cache

OPTS = {"cost_model": "analytic", "budget": 20, "time_limit": 60.0, "end_to_end": 0}

# relu(a + b) = relu(a) + relu(b): false (a = 1, b = -1)
WRONG = Substitution(
    "wrong:relu-distributes", (("a", ("N",)), ("b", ("N",))),
    (PNode("ewadd", (), ("a", "b")), PNode("relu", (), ("#0",))),
    (PNode("relu", (), ("a",)), PNode("relu", (), ("b",)), PNode("ewadd", (), ("#0", "#1"))),
    (("#1", "#2"),), {})
RLIMIT = 20_000  # a small limit: a quick "no" for WRONG


def _f(w, x):
    return jnp.tanh(x @ w["a"] + x @ w["b"]) + x @ w["c"]


def _args():
    rng = np.random.default_rng(0)
    w = {k: jnp.asarray(rng.standard_normal((16, 16)), jnp.float32) for k in "abc"}
    return w, jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)


def _edit(path: Path) -> None:
    """Turn the entry's last add into a multiply, and compute its digest again."""
    data = json.loads(path.read_text())
    (last,) = [r for r in data["nodes"] if r[:2] == ["op", "ewadd"]][-1:]
    last[1] = "ewmul"
    data["digest"] = hashlib.sha256(json.dumps([data["nodes"], data["outputs"]])
                                    .encode()).hexdigest()
    path.write_text(json.dumps(data))


def _stored_entry(folder: Path) -> Path:
    """The graph cache entry of ``_f``, stored (after its check) by this process."""
    w, x = _args()
    first = taso_jax.optimize(_f, weight_argnums=0, **OPTS)
    first(w, x)
    assert first._last.report["check"]["ok"] and not first._last.cache_hit
    (path,) = folder.glob("*.json")
    return path


def test_an_edited_graph_cache_entry_is_checked_on_its_first_use_and_removed(
        tmp_path, monkeypatch):
    monkeypatch.setenv("TASO_JAX_GRAPH_CACHE", str(tmp_path))
    w, x = _args()
    ref = jax.jit(_f)(w, x)
    path = _stored_entry(tmp_path)
    _edit(path)
    monkeypatch.setattr(graph_cache, "_checked", set(), raising=False)  # as another process
    edited = taso_jax.optimize(_f, weight_argnums=0, **OPTS)
    with pytest.warns(RuntimeWarning, match="graph cache entry .* differ from the original"):
        y = edited(w, x)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
    assert edited._last.cache_hit and "it was removed" in edited.fallback_reason
    assert not path.exists()
    # the next one searches again, and stores what it checked
    fresh = taso_jax.optimize(_f, weight_argnums=0, **OPTS)
    np.testing.assert_allclose(fresh(w, x), ref, rtol=1e-5, atol=1e-5)
    assert not fresh._last.cache_hit and fresh.fallback_reason is None and path.exists()


def test_another_process_s_entry_is_checked_once_per_process(tmp_path, monkeypatch):
    monkeypatch.setenv("TASO_JAX_GRAPH_CACHE", str(tmp_path))
    w, x = _args()
    _stored_entry(tmp_path)
    monkeypatch.setattr(graph_cache, "_checked", set(), raising=False)  # as another process
    first_use = taso_jax.optimize(_f, weight_argnums=0, **OPTS)
    first_use(w, x)
    check = first_use._last.report["check"]
    assert first_use._last.cache_hit and check["ok"] and "first use" in check["reference"]
    again = taso_jax.optimize(_f, weight_argnums=0, **OPTS)
    again(w, x)
    assert again._last.cache_hit and "earlier in this process" in (
        again._last.report["check"]["reference"])


_SECOND_PROCESS = """
import json, warnings
import jax, jax.numpy as jnp, numpy as np
import taso_jax
from test_cache_trust import OPTS, _args, _f
w, x = _args()
opt = taso_jax.optimize(_f, weight_argnums=0, **OPTS)
with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)
    y = opt(w, x)
print(json.dumps({"err": float(np.max(np.abs(np.asarray(y) - np.asarray(jax.jit(_f)(w, x))))),
                  "hit": opt._last.cache_hit, "fallback": opt.fallback_reason}))
"""


def test_an_edited_graph_cache_entry_is_not_used_by_the_next_process(tmp_path, monkeypatch):
    monkeypatch.setenv("TASO_JAX_GRAPH_CACHE", str(tmp_path))
    path = _stored_entry(tmp_path)
    _edit(path)
    env = {**os.environ, "TASO_JAX_GRAPH_CACHE": str(tmp_path),
           "PYTHONPATH": str(Path(__file__).parent)}
    run = subprocess.run([sys.executable, "-c", _SECOND_PROCESS], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.splitlines()[-1])
    assert out["hit"] and out["err"] < 1e-4, out
    assert "graph cache entry" in out["fallback"] and not path.exists()


def _proved_line(rule_id: str, rlimit: int) -> str:
    """A checkpoint line saying ``rule_id`` is proved, its digest computed as the runner does."""
    from taso_jax.verify import runner
    from taso_jax.verify.laws import all_axioms

    axioms = hashlib.sha256("\n".join(f"{n}: {a.law}" for n, a in all_axioms())
                            .encode()).hexdigest()
    limits = {"rlimit": rlimit, "axioms": axioms[:16]}
    result = {"status": "proved", "axioms": ["ewadd-commutative"], "seconds": 0.1}
    return json.dumps({"id": rule_id, "limits": limits, "result": result,
                       "digest": runner.checkpoint_digest(rule_id, axioms, limits, result)})


def test_a_checkpoint_line_with_a_correct_digest_does_not_prove_a_wrong_rule(tmp_path,
                                                                             capsys):
    src, ckpt = tmp_path / "rules.json", tmp_path / "proofs.jsonl"
    save_substitutions([WRONG], src)
    ckpt.write_text(_proved_line(WRONG.id, RLIMIT) + "\n")
    assert main(["verify", str(src), "--workers", "1", "-q", "--checkpoint", str(ckpt),
                 "--rlimit", str(RLIMIT)]) == 1
    out = capsys.readouterr().out
    assert "proved: 0" in out and "1 that the checkpoint says are proved, proved again" in out
    # --trust-proofs takes the line as it is: the caller vouches for the file
    ckpt.write_text(_proved_line(WRONG.id, RLIMIT) + "\n")
    assert main(["verify", str(src), "--workers", "1", "-q", "--checkpoint", str(ckpt),
                 "--rlimit", str(RLIMIT), "--trust-proofs"]) == 0
    assert "proved: 1" in capsys.readouterr().out


def _cache_path(folder: Path, rules: Path, rlimit: int) -> Path:
    return folder / f"{hashlib.sha256(rules.read_bytes()).hexdigest()}-r{rlimit}.json"


@pytest.mark.parametrize("planted", ["checkpoint", "proof cache"])
def test_a_planted_proof_does_not_make_a_rule_file_s_wrong_rule_proved(tmp_path, planted):
    from taso_jax.verify import runner

    src, cache = tmp_path / "rules.json", tmp_path / "proofs"
    save_substitutions([WRONG], src)
    cached = _cache_path(cache, src, RLIMIT)
    cache.mkdir()
    if planted == "checkpoint":
        cached.with_name(cached.stem + ".partial.jsonl").write_text(
            _proved_line(WRONG.id, RLIMIT) + "\n")
    else:
        stamp = {"status": "proved", "axioms": ["ewadd-commutative"], "rlimit": RLIMIT}
        save_substitutions([_stamped(WRONG, stamp)], cached)
    (rule,) = runner.load_proved_rules(src, rlimit=RLIMIT, cache_dir=str(cache))
    assert rule.proof_status != "proved"
    (trusted,) = runner.load_proved_rules(src, rlimit=RLIMIT, cache_dir=str(cache),
                                          trust_proofs=True)
    assert trusted.proof_status == "unverified"  # the file's own stamp: none


def _stamped(sub: Substitution, proof: dict) -> Substitution:
    from dataclasses import replace

    return replace(sub, provenance={**sub.provenance, "proof": proof})


def test_a_proof_cache_resumes_what_cannot_make_a_rule_usable(tmp_path, monkeypatch):
    """A cached "not proved" is kept (not tried again); this process's own proofs are reused;
    a cached "proved" that this process did not prove is proved again."""
    from taso_jax.search.rules import default_substitutions
    from taso_jax.verify import runner

    provable = [s for s in default_substitutions() if s.id == "ra7cf510783c0"]
    src, cache = tmp_path / "rules.json", tmp_path / "proofs"
    save_substitutions([WRONG, *provable], src)
    calls = []
    real = runner._prove_json
    monkeypatch.setattr(runner, "_prove_json", lambda job: calls.append(job[0]) or real(job))
    monkeypatch.setattr(runner, "_PROVED_HERE", {})  # as a fresh process
    first = runner.load_proved_rules(src, rlimit=RLIMIT, cache_dir=str(cache))
    assert calls == [0, 1]
    assert first[0].proof_status != "proved" and first[1].proof_status == "proved"
    calls.clear()
    runner.load_proved_rules(src, rlimit=RLIMIT, cache_dir=str(cache))
    assert calls == []  # a "not proved" from the cache, and a proof of this process
    monkeypatch.setattr(runner, "_PROVED_HERE", {})  # another process, the same cache
    again = runner.load_proved_rules(src, rlimit=RLIMIT, cache_dir=str(cache))
    assert calls == [1] and again[1].proof_status == "proved"


def test_optimize_does_not_apply_a_rule_proved_by_a_planted_checkpoint(tmp_path, capsys,
                                                                      monkeypatch):
    from taso_jax.verify.prover import DEFAULT_RLIMIT
    from test_cli import FAST, _clip_model_and_wrong_rule

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the proof cache
    src, rules = _clip_model_and_wrong_rule(tmp_path)  # clip(x) => x, stamped by hand
    (rule,) = load_substitutions(rules)
    folder = tmp_path / "cache" / "taso_jax" / "proofs"
    folder.mkdir(parents=True)
    cached = _cache_path(folder, rules, DEFAULT_RLIMIT)
    cached.with_name(cached.stem + ".partial.jsonl").write_text(
        _proved_line(rule.id, DEFAULT_RLIMIT) + "\n")
    out = tmp_path / "o.onnx"
    with pytest.warns(UserWarning, match="1 of 1 substitutions are not proved"):
        code = main(["optimize", str(src), "-o", str(out), "--substitutions", str(rules),
                     *FAST, "--no-time", "--end-to-end", "0"])
    assert code == 0 and "substitutions applied: none" in capsys.readouterr().out
