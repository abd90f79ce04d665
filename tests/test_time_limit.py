"""The time limit is a limit (issue 47): at any model size a run ends within it, plus a margin.

The cycle check of a match does bounded work on a long graph, and ``taso-jax optimize`` of a
generated 5,000-operator model (``benchmarks/time_limit.py``) ends within its time limit plus
the margin that docs/benchmarks.md gives.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

import pytest
from taso_jax.search.match import CYCLE_WALK, _creates_cycle

from taso_jax.cli import main
from taso_jax.ir.graph import new_graph

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from time_limit import write_model  # noqa: E402

#: Seconds past ``--time-limit`` a run may end (docs/benchmarks.md, "The time limit"): the
#: model's import, one onnxruntime run of it, and the write of the result (about 4.5 s of
#: CPU for 5,000 operators on this project's CPU), with room for a loaded machine.
MARGIN = 12.0


class _Counting(set):
    """A set that counts its membership tests: the cycle check tests each node it walks."""

    tests = 0

    def __contains__(self, item):
        self.tests += 1
        return super().__contains__(item)


@functools.lru_cache(maxsize=2)
def _chain(n: int):
    """A chain of ``n`` matmuls by one shared weight (an unrolled RNN): ``(graph, ws)``."""
    b = new_graph()
    x = b.new_input((2, 8))
    w = b.new_weight((8, 8))
    outs = []
    for _ in range(n):
        x = b.relu(b.matmul(x, w))
        outs.append(x)
    b.mark_output(x)
    return b.graph(), outs


def _walked(graph, matched, late) -> tuple[bool, int]:
    counting = _Counting(matched)
    return _creates_cycle(graph, counting, late), counting.tests


def _brute(graph, matched, var_tensors) -> bool:
    """Whether a matched node reaches a variable, by a full walk."""
    stack, seen = [t.node for t in var_tensors], set()
    while stack:
        n = stack.pop()
        if n in matched:
            return True
        if n not in seen:
            seen.add(n)
            stack.extend(t.node for t in n.inputs)
    return False


def test_the_cycle_check_walks_a_bounded_number_of_nodes():
    g, outs = _chain(10_000)
    nodes = g.by_op["matmul"]
    first, last = nodes[0], nodes[-1]
    # the pair (first matmul, last matmul) would read its own output: a cycle, far apart
    cyclic, tests = _walked(g, {first, last}, [outs[-2]])
    assert cyclic and tests <= CYCLE_WALK + 2
    # the other way round: a variable upstream of every matched node is never walked
    assert _walked(g, {last}, [outs[0]]) == (False, 0)
    # near each other the walk answers alone, as before
    assert _walked(g, {nodes[5], nodes[7]}, [outs[6]])[0]
    assert not _walked(g, {nodes[5]}, [g.inputs[0].outputs[0]])[0]


def test_the_cycle_check_agrees_with_a_full_walk():
    g, outs = _chain(300)
    mm = g.by_op["matmul"]
    relus = g.by_op["relu"]
    cases = [({mm[i], mm[j]}, [outs[k]]) for i, j, k in
             [(0, 299, 298), (10, 20, 5), (10, 200, 150), (200, 10, 250), (3, 4, 2)]]
    cases += [({relus[100]}, [outs[100]]), ({mm[150]}, [outs[149], outs[151]])]
    for matched, late in cases:
        for walk in (0, 4, CYCLE_WALK, 10**6):
            assert _creates_cycle(g, matched, late, walk=walk) == _brute(g, matched, late)


def test_cycle_checks_on_a_long_chain_are_fast():
    # every pair of steps of an unrolled RNN matches merge-matmul-matmul-3; a walk per pair
    # took O(N) each (issue 47: 431 s of a 20,000-operator model's search)
    g, outs = _chain(10_000)
    mm = g.by_op["matmul"]
    t0 = time.perf_counter()
    for i in range(0, 10_000, 10):
        assert _creates_cycle(g, {mm[i], mm[-1]}, [outs[-2]])
    assert time.perf_counter() - t0 < 5.0


@pytest.mark.parametrize("limit", [3])
def test_optimize_ends_within_the_time_limit_on_a_5000_operator_model(tmp_path, limit,
                                                                       capsys):
    model = write_model(5000, str(tmp_path / "chain5000.onnx"))
    report = tmp_path / "report.json"
    t0 = time.perf_counter()
    rc = main(["optimize", model, "-o", str(tmp_path / "out.onnx"), "--time-limit",
               str(limit), "--cost-model", "analytic", "-q", "--json", str(report)])
    wall = time.perf_counter() - t0
    assert rc == 0
    assert wall < limit + MARGIN, wall
    rep = json.loads(report.read_text())
    assert rep["wall_seconds"] < limit + MARGIN
    assert (tmp_path / "out.onnx").exists()


@pytest.mark.slow
def test_the_import_of_a_20000_operator_model_stops_at_the_time_limit(tmp_path, capsys):
    import hashlib

    model = Path(write_model(20_000, str(tmp_path / "chain20000.onnx")))
    digest = hashlib.sha256(model.read_bytes()).hexdigest()
    out, report = tmp_path / "out.onnx", tmp_path / "report.json"
    t0 = time.perf_counter()
    rc = main(["optimize", str(model), "-o", str(out), "--time-limit", "2", "--cost-model",
               "analytic", "-q", "--json", str(report)])
    wall = time.perf_counter() - t0
    assert rc == 0 and wall < 2 + MARGIN, wall
    rep = json.loads(report.read_text())
    assert rep["out_of_time_in"] == "import" and rep["outcome"]["verdict"] == "time_limit"
    assert "during the import" in rep["outcome"]["why"]
    assert "during the import" in capsys.readouterr().out
    # the input, byte for byte, and the input itself untouched
    assert hashlib.sha256(out.read_bytes()).hexdigest() == digest
    assert hashlib.sha256(model.read_bytes()).hexdigest() == digest


def test_load_onnx_raises_import_time_limit_once_the_model_is_checked(tmp_path):
    from taso_jax.search.limits import Deadline

    from taso_jax.frontends.onnx_io import ImportTimeLimit, ModelError, load_onnx

    model = write_model(120, str(tmp_path / "m.onnx"))
    passed = Deadline(time.perf_counter() - 1, 1.0)
    with pytest.raises(ImportTimeLimit, match="after ONNX's checker"):
        load_onnx(model, deadline=passed)
    (tmp_path / "bad.onnx").write_bytes(b"not onnx")
    with pytest.raises(ModelError):  # a bad model is refused, limit or not
        load_onnx(str(tmp_path / "bad.onnx"), deadline=passed)
    assert load_onnx(model, deadline=Deadline.start(600)).meta["onnx_nodes"] == 120


class _PassesOnLook:
    """A deadline that passes at its ``n``-th look (a huge import, without the wait)."""

    def __init__(self, n: int):
        self.n, self.looks = n, 0

    def passed(self) -> bool:
        self.looks += 1
        return self.looks >= self.n


def _long_function(n: int):
    """``x -> ...`` of ``n`` elementwise equations (multiply and add by literals)."""
    import jax.numpy as jnp

    def f(w, x):
        for _ in range(n // 2):
            x = x * 1.0001 + 0.5
        return jnp.tanh(x @ w)

    return f


def test_the_jaxpr_import_stops_at_its_deadline():
    import numpy as np
    from taso_jax.search.limits import Deadline

    from taso_jax.frontends.jaxpr_io import trace_function
    from taso_jax.frontends.onnx_io import ImportTimeLimit

    f = _long_function(1200)
    traced = trace_function(f, (np.eye(4, dtype=np.float32), np.ones((2, 4), np.float32)),
                            {0})
    assert len(traced.closed.jaxpr.eqns) > 1024
    deadline = _PassesOnLook(3)  # before the equations, at 256, at 512
    with pytest.raises(ImportTimeLimit, match="512 equations imported"):
        traced.to_graph("f", deadline=deadline)
    assert deadline.looks == 3
    with pytest.raises(ImportTimeLimit, match="before the equations"):
        traced.to_graph("f", deadline=Deadline(time.perf_counter() - 1, 1.0))
    # with time to spare it imports as before
    g = traced.to_graph("f", deadline=Deadline.start(600))
    assert g.by_op.get("matmul") and g.meta["source"] == "jaxpr"


def test_a_decorated_function_too_long_to_import_runs_jax_jit_with_the_reason(
        tmp_path, monkeypatch):
    import warnings

    import jax
    import numpy as np

    import taso_jax

    monkeypatch.setenv("TASO_JAX_GRAPH_CACHE", str(tmp_path))
    f = _long_function(1200)
    w, x = np.eye(4, dtype=np.float32), np.ones((2, 4), np.float32)
    opt = taso_jax.optimize(f, weight_argnums=0, cost_model="analytic", time_limit=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a choice made under the limit, not a failure
        y = opt(w, x)
    np.testing.assert_allclose(y, jax.jit(f)(w, x), rtol=1e-6)
    assert opt.fallback_reason is None
    assert opt.original_kept.startswith("not compiled, checked or timed against jax.jit: the "
                                        "time limit passed during the import")
    assert opt._last.graph is None and opt._last.result is None
    out = opt.outcome()
    assert out.verdict.value == "time_limit" and out.to_json()["out_of_time_in"] == "import"
    assert "during the import" in opt.report(time=False)
    assert opt._last.first_call["import"] < 1.0
    assert not list(tmp_path.rglob("*.json"))  # nothing stored in the graph cache
    np.testing.assert_allclose(opt(w, x * 2), jax.jit(f)(w, x * 2), rtol=1e-6)


def _shipped_rules(n: int, path: Path) -> Path:
    """A rule file of the first ``n`` shipped rules with three operators or fewer in all."""
    from taso_jax.search.rules import default_substitutions, save_substitutions

    small = [s for s in default_substitutions() if len(s.source) + len(s.target) <= 3]
    save_substitutions(small[:n], path)
    return path


def test_a_rule_file_proof_stops_at_its_deadline_and_the_next_load_goes_on(
        tmp_path, monkeypatch):
    from taso_jax.verify import runner

    rules = _shipped_rules(6, tmp_path / "rules.json")
    cache = tmp_path / "proofs"
    proved = []
    real = runner._prove_json
    monkeypatch.setattr(runner, "_prove_json",
                        lambda job: proved.append(job[0]) or real(job))
    # six rules prove in this process; the deadline passes at its third look: some proved
    # (the looks before the first proof depend on how the file is read), not all
    subs = runner.load_proved_rules(rules, cache_dir=str(cache), deadline=_PassesOnLook(3))
    done = len(proved)
    assert 1 <= done < 6
    stamps = [s.provenance["proof"] for s in subs]
    assert [p["status"] for p in stamps[done:]] == ["unverified"] * (6 - done)
    assert all(p["why"] == runner.NOT_PROVED_IN_TIME for p in stamps[done:])
    assert all(p["status"] == "proved" for p in stamps[:done])
    assert not list(cache.glob("*.json")), "a cut proof is not the file's proof"
    (partial,) = cache.glob("*.partial.jsonl")
    assert len(partial.read_text().splitlines()) == done
    # the next load proves only the ones left, then caches the file's proof
    proved.clear()
    again = runner.load_proved_rules(rules, cache_dir=str(cache))
    assert len(proved) == 6 - done and all(s.proof_status == "proved" for s in again)
    assert list(cache.glob("*.json")) and not list(cache.glob("*.partial.jsonl"))


def test_optimize_with_a_rule_file_too_long_to_prove_stops_at_the_limit(
        tmp_path, capsys, monkeypatch):
    import hashlib
    import warnings

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the proof cache
    model = Path(write_model(40, str(tmp_path / "m.onnx")))
    digest = hashlib.sha256(model.read_bytes()).hexdigest()
    rules = _shipped_rules(400, tmp_path / "rules.json")
    out, report = tmp_path / "out.onnx", tmp_path / "r.json"
    limit = 3.0
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "N of 400 are not proved"
        rc = main(["optimize", str(model), "-o", str(out), "--substitutions", str(rules),
                   "--time-limit", str(limit), "--cost-model", "analytic", "-q",
                   "--no-time", "--json", str(report)])
    wall = time.perf_counter() - t0
    assert rc == 0 and wall < limit + MARGIN, wall
    rep = json.loads(report.read_text())
    counts = rep["rules"]
    n = len(json.loads(rules.read_text())["substitutions"])
    assert 0 < counts["not_proved_in_time"] <= counts["unverified_left_out"]
    assert counts["used"] + counts["unverified_left_out"] == n
    assert rep["search"]["out_of_time_in"] in ("", "rule proofs", "search")
    assert rep["outcome"]["verdict"] == "time_limit"
    why = rep["outcome"]["why"]
    assert "during the rule proofs" in why or "while the rule file was proved" in why, why
    assert any("not yet proved" in n for n in rep["notes"])
    assert "not yet proved" in capsys.readouterr().out
    # the input, byte for byte, and the input itself untouched
    assert hashlib.sha256(out.read_bytes()).hexdigest() == digest
    assert hashlib.sha256(model.read_bytes()).hexdigest() == digest


def test_a_cut_import_of_a_model_with_external_data_writes_the_same_model(tmp_path, capsys):
    # Past the limit during the import, the input is written back: byte for byte, or with
    # its external data inlined (a copy alone would point at the input's data file). That
    # copy is onnx's own reading of the input, which refuses a data file too short for its
    # tensors; here it runs in onnxruntime and gives the input's outputs exactly.
    import hashlib

    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(
        np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32), "w")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["y"])]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y], [w]),
                              opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    src = tmp_path / "in" / "m.onnx"
    src.parent.mkdir()
    onnx.save(model, src, save_as_external_data=True, location="m.data", size_threshold=0)
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in src.parent.iterdir()}
    out, report = tmp_path / "out" / "o.onnx", tmp_path / "r.json"
    out.parent.mkdir()
    assert main(["optimize", str(src), "-o", str(out), "--time-limit", "0.001", "-q",
                 "--json", str(report)]) == 0
    rep = json.loads(report.read_text())
    assert rep["out_of_time_in"] == "import" and rep["written_copy_of_input"] == "inlined"
    assert [p.name for p in out.parent.iterdir()] == ["o.onnx"]  # self-contained
    feed = {"x": np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)}
    want = ort.InferenceSession(str(src)).run(None, feed)[0]
    got = ort.InferenceSession(str(out)).run(None, feed)[0]
    np.testing.assert_array_equal(got, want)
    assert before == {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                      for p in src.parent.iterdir()}
    # a data file too short for its tensors is refused (exit 2), limit or not
    (src.parent / "m.data").write_bytes((src.parent / "m.data").read_bytes()[:8000])
    assert main(["optimize", str(src), "-o", str(tmp_path / "out" / "p.onnx"),
                 "--time-limit", "0.001", "-q"]) == 2
    assert "exceeds available data" in capsys.readouterr().err
    assert not (tmp_path / "out" / "p.onnx").exists()


def test_a_search_cut_by_the_limit_says_so_instead_of_no_faster_graph():
    # time_limit=0.001: the search ends before it expands a graph; "no faster equivalent
    # graph was found" would claim a search that did not happen
    import taso_jax

    b = taso_jax.new_graph()
    x = b.new_input((4, 8))
    b.ewadd(b.matmul(x, b.new_weight((8, 8))), b.matmul(x, b.new_weight((8, 8))))
    r = taso_jax.search_graph(b.graph(), time_limit=0.001, cost_model="analytic", budget=5,
                              end_to_end=0)
    assert r.out_of_time_in
    assert r.outcome.verdict.value == "time_limit"
    assert r.outcome.why.startswith("the time limit passed during the ")
    roomy = taso_jax.search_graph(b.graph(), time_limit=600, cost_model="analytic",
                                  budget=5, end_to_end=0)
    assert not roomy.out_of_time_in and roomy.outcome.verdict.value == "rewritten"


def test_a_model_input_of_2_to_the_40_elements_is_refused_in_one_line(tmp_path, capsys):
    import onnx
    from onnx import TensorProto, helper

    big = [1 << 20, 1 << 20]
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, big)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, big)]),
        opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.save(model, tmp_path / "m.onnx")
    out = tmp_path / "o.onnx"
    assert main(["optimize", str(tmp_path / "m.onnx"), "-o", str(out), "-q",
                 "--cost-model", "analytic"]) == 2  # was 1, "internal error: MemoryError"
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "input 'x' has shape 1048576x1048576" in err[0]
    assert not out.exists()


def test_a_decorated_function_proves_its_rule_file_under_the_time_limit(tmp_path,
                                                                         monkeypatch):
    # as on the command line, a rule file's proofs take at most their share of the first
    # call's limit; the rules not proved by then are left out, and the next signature's
    # first call goes on with the proofs (the optimizer is not kept)
    import warnings

    import jax
    import numpy as np

    import taso_jax

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the proof cache
    monkeypatch.setenv("TASO_JAX_GRAPH_CACHE", str(tmp_path / "graphs"))
    rules = _shipped_rules(400, tmp_path / "rules.json")
    limit = 2.0

    def f(x, w1, w2):
        return x @ w1 + x @ w2

    opt = taso_jax.optimize(f, substitutions=str(rules), time_limit=limit,
                            cost_model="analytic")
    x, w = np.ones((4, 8), np.float32), np.eye(8, dtype=np.float32)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "N of 400 are not proved"
        y = opt(x, w, 2 * w)
    wall = time.perf_counter() - t0
    np.testing.assert_allclose(y, jax.jit(f)(x, w, 2 * w), rtol=1e-6)
    assert wall < limit + MARGIN, wall
    assert opt.fallback_reason is None
    assert opt._last.report["rules"]["not_proved_in_time"] > 0
    assert opt._optimizer_made is None  # the next first call proves on
    assert "not yet proved" in opt.report(time=False)
