"""Verification end to end: fingerprints, proofs, and the proof gate in the search.

* the shipped substitution set is fully proved, and the rules the examples depend on are in it;
* fingerprints separate near misses (functions that agree on many inputs, or nearly);
* a candidate that is numerically right but not provable from the axioms is rejected, and
  the search leaves it out unless ``allow_unverified`` is given;
* ``taso-jax generate`` proves what it generates and prints the counts per stage.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import jax
import numpy as np
import pytest
from taso_jax.ops import TensorType
from taso_jax.search.match import find_matches, rewrites
from taso_jax.search.pattern import AttrVar, parse_attr
from taso_jax.search.rules import PNode, Substitution, default_substitutions, load_substitutions
from taso_jax.verify._enumeration import _Fingerprinter
from taso_jax.verify.prover import Prover, bind_attributes

import taso_jax
from taso_jax.cli import main
from taso_jax.ir.graph import GraphBuilder, leaf_node, make_node

SHIPPED = default_substitutions()


def test_the_shipped_set_is_fully_proved():
    assert len(SHIPPED) > 1000
    statuses = {s.proof_status for s in SHIPPED}
    assert statuses == {"proved"}, statuses
    for s in SHIPPED:
        proof = s.provenance["proof"]
        assert proof["axioms"], s.name  # a proof names the axioms it used
        for inst in s.proved_instances or ():
            assert set(inst) <= set(s.provenance["attribute_values"]), s.name


def _shipped(source_ops: list[str], target_ops: list[str]) -> list[Substitution]:
    return [s for s in SHIPPED if [n.op for n in s.source] == source_ops
            and [n.op for n in s.target] == target_ops]


@pytest.mark.parametrize("src,tgt", [
    (["matmul", "matmul"], ["concat", "matmul", "split"]),            # TASO's matmul merge
    (["conv2d", "conv2d"], ["concat", "conv2d", "split"]),            # parallel convolutions
    (["conv2d", "ewmul"], ["transpose", "ewmul", "conv2d"]),          # scale (batchnorm) fold
    (["conv2d", "conv2d"], ["enlarge", "concat", "conv2d", "split"]),  # 1x1 + 3x3 merge
    (["matmul", "matmul", "ewadd"], ["ewadd", "matmul"]),             # x@a + x@b => x@(a+b)
    (["matmul", "matmul"], ["matmul", "matmul"]),                     # (x@a)@c => x@(a@c)
    (["ewadd", "ewmul"], ["ewmul", "ewmul", "ewadd"]),                # shift-then-scale fold
    # two biased branches of any widths (4 operators a side, PyTorch's Conv with bias)
    (["conv2d", "ewadd", "conv2d", "ewadd"], ["concat", "concat", "conv2d", "ewadd", "split"]),
    (["conv2d", "ewadd", "conv2d", "ewadd"],
     ["concat", "enlarge", "concat", "conv2d", "ewadd", "split"]),
    (["matmul", "ewadd", "matmul", "ewadd"], ["concat", "concat", "matmul", "ewadd", "split"]),
])
def test_the_rules_the_examples_need_are_proved(src, tgt):
    rules = _shipped(src, tgt)
    assert rules, f"no shipped rule {src} => {tgt}"
    assert all(s.proof_status == "proved" for s in rules)


@pytest.mark.parametrize("src,tgt", [
    (["conv2d"], ["merge_gconv", "conv2d"]),                 # fewer groups (ResNeXt, TASO)
    (["conv2d", "ewmul"], ["transpose", "ewmul", "conv2d"]),  # scale fold, grouped
])
def test_grouped_convolution_rules_are_proved_for_any_number_of_groups(src, tgt):
    rules = [s for s in _shipped(src, tgt)
             if ("groups", AttrVar("?groups")) in s.source[0].attrs]
    assert rules, f"no shipped rule {src} => {tgt} over any number of groups"
    # proved for every value (no instance restriction), not just those checked numerically
    assert any(s.proof_status == "proved" and s.proved_instances is None for s in rules)


def test_halving_the_groups_is_proved_for_any_even_number_of_groups():
    # TASO's merge_gconv with a count of 2: groups=?groups => groups=?groups/2, found by the
    # generator at 4 groups and proved for every even number (the exact division is a fact of
    # the proof, and a condition of the matcher)
    (rule,) = [s for s in _shipped(["conv2d"], ["merge_gconv", "conv2d"])
               if ("groups", parse_attr("$?groups/2")) in s.target[1].attrs]
    assert rule.proof_status == "proved" and rule.proved_instances is None
    assert ("count", 2) in rule.target[0].attrs
    # the same rule with a count of 4 but half the groups is wrong: not proved
    wrong = replace(rule, target=(replace(rule.target[0], attrs=tuple(
        (k, 4 if k == "count" else v) for k, v in rule.target[0].attrs)), rule.target[1]))
    # at a tenth of the default limit (not proved either way; at the default Z3 spends
    # minutes reaching "unknown")
    assert Prover(rlimit=200_000).prove(wrong)["status"] != "proved"


def _fingerprint(build):
    """Fingerprint key of ``build(x, y)`` on the generator's random float64 inputs."""
    fp = _Fingerprinter(seed=0)
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        x, y = (leaf_node("input", n, TensorType((4, 5), "float64")).outputs[0] for n in "xy")
        for t in (x, y):
            fp.values[t] = rng.standard_normal(t.shape)

        def run(t):
            if t not in fp.values:
                from taso_jax.ir.executor import run_node

                outs = run_node(t.node, [run(i) for i in t.node.inputs])
                for o, v in zip(t.node.outputs, outs, strict=True):
                    fp.values[o] = np.asarray(v)
            return fp.values[t]

        t = build(x, y)
        run(t)
        return fp.key(t)


def test_fingerprints_separate_near_misses():
    """Equal functions give equal keys; near misses (equal on a half-space, or within 1e-7
    relative) do not. Inputs are Gaussian, so relu and identity differ on about half of them,
    and each key keeps two random projections to 9 significant digits."""
    def op(name, *ins, **attrs):
        return make_node(name, list(ins), attrs).outputs[0]

    x_plus_y = _fingerprint(lambda x, y: op("ewadd", x, y))
    assert _fingerprint(lambda x, y: op("ewadd", y, x)) == x_plus_y
    parts = _fingerprint(lambda x, y: op("split", op("concat", x, y, axis=-1), axis=-1,
                                         sizes=(5, 5)))
    assert parts == _fingerprint(lambda x, y: x)
    # relu(x) = x wherever x >= 0: a fingerprint on nonnegative inputs would collide
    assert _fingerprint(lambda x, y: op("relu", x)) != _fingerprint(lambda x, y: x)
    # a 1e-7 relative change
    assert _fingerprint(lambda x, y: op("scalar_mul", x, scalar=1 + 1e-7)) != \
        _fingerprint(lambda x, y: x)
    # the plausible, wrong distribution law
    assert _fingerprint(lambda x, y: op("relu", op("ewadd", x, y))) != \
        _fingerprint(lambda x, y: op("ewadd", op("relu", x), op("relu", y)))


# ewmul(neg(x), neg(y)) => ewmul(x, y): true (the signs cancel), but no axiom relates neg and
# ewmul, so it cannot be proved.
TRUE_UNPROVABLE = Substitution(
    "test:neg-neg", (("x", ("N", "C")), ("y", ("N", "C"))),
    (PNode("neg", (), ("x",)), PNode("neg", (), ("y",)), PNode("ewmul", (), ("#0", "#1"))),
    (PNode("ewmul", (), ("x", "y")),), (("#2", "#0"),), {})


def _neg_neg_graph():
    b = GraphBuilder()
    x, y = b.new_input((8, 16), name="x"), b.new_input((8, 16), name="y")
    b.mark_output(b.ewmul(b.neg(x), b.neg(y)))
    return b.graph()


@pytest.mark.slow
def test_a_numerically_equal_but_unprovable_rule_is_rejected():
    g = _neg_neg_graph()
    rewritten = next(rewrites(TRUE_UNPROVABLE, g))
    ins = taso_jax.random_inputs(g, seed=0)
    from taso_jax.ir.executor import evaluate

    np.testing.assert_allclose(evaluate(g, ins)[0], evaluate(rewritten, ins)[0], rtol=1e-6)
    assert Prover().prove(TRUE_UNPROVABLE)["status"] != "proved"


def test_the_search_uses_only_proved_rules_unless_allowed():
    g = _neg_neg_graph()
    with pytest.warns(UserWarning, match="1 of 1 substitutions are not proved"):
        r = taso_jax.search_graph(g, cost_model="analytic", substitutions=[TRUE_UNPROVABLE],
                                  budget=5)
    assert not r.applied and r.rules["unverified_left_out"] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = taso_jax.search_graph(g, cost_model="analytic", substitutions=[TRUE_UNPROVABLE],
                                  budget=5, allow_unverified=True, end_to_end=0)
    assert r.applied["test:neg-neg"] == 1 and r.rules["unverified_used"] == 1
    from taso_jax.search.options import OptimizeOptions

    from taso_jax.report import format_report, search_report

    text = format_report(search_report("t", g, r, OptimizeOptions(cost_model="analytic", budget=5),
                                       [TRUE_UNPROVABLE]))
    assert "NOT PROVED" in text and "unproved rules allowed" in text


def test_a_rule_proved_at_some_attribute_values_matches_only_those():
    # relu(concat(x, y, axis=?axis)) => concat(relu(x), relu(y), axis=?axis), proved at -1
    rule = Substitution(
        "test:relu-concat", (("x", ("N", "C")), ("y", ("N", "C"))),
        (PNode("concat", (("axis", "?axis"),), ("x", "y")), PNode("relu", (), ("#0",))),
        (PNode("relu", (), ("x",)), PNode("relu", (), ("y",)),
         PNode("concat", (("axis", "?axis"),), ("#0", "#1"))), (("#1", "#2"),),
        {"attribute_values": {"?axis": [-1]},
         "proof": {"status": "proved", "axioms": ["x"], "instances": [{"?axis": -1}]}})
    assert Prover().prove(bind_attributes(rule, {"?axis": -2}))["status"] == "proved"

    def graph(axis):
        b = GraphBuilder()
        x, y = b.new_input((4, 4), name="x"), b.new_input((4, 4), name="y")
        b.mark_output(b.relu(b.concat(x, y, axis=axis)))
        return b.graph()

    assert list(find_matches(rule, graph(-1)))
    assert not list(find_matches(rule, graph(-2)))  # proved at -1 only: not applied at -2


@pytest.mark.slow
def test_generate_proves_what_it_keeps_and_prints_counts(tmp_path, capsys):
    out, report = tmp_path / "rules.json", tmp_path / "unproved.txt"
    assert main(["generate", "--max-ops", "1", "-o", str(out), "--report", str(report),
                 "--workers", "1", "-q"]) == 0
    text = capsys.readouterr().out
    for stage in ("enumerated expressions", "fingerprint classes", "candidate substitutions",
                  "pruned", "verified against", "proved", "written"):
        assert stage in text, stage
    rules = load_substitutions(out)
    assert rules and all(s.proof_status == "proved" for s in rules)


def test_biased_branches_of_different_widths_merge_into_one_convolution():
    # An inception module as exported: 1x1 convolutions of 8 and 5 channels on one input,
    # each with its bias (Conv's third input); one convolution and one addition remain.
    b = GraphBuilder()
    x = b.new_input((1, 6, 9, 9), name="x")
    outs = []
    for width in (8, 5):
        y = b.conv2d(x, b.new_weight((width, 6, 1, 1)), padding="same")
        outs.append(b.relu(b.ewadd(y, b.new_weight((1, width, 1, 1)))))
    b.mark_output(b.concat(*outs, axis=-3))
    g = b.graph()
    r = taso_jax.search_graph(g, cost_model="analytic", end_to_end=0, budget=10)
    assert any(name.startswith("merge-conv2d-ewadd-conv2d-ewadd") for name in r.applied)
    counts = r.graph.op_counts()
    assert counts["conv2d"] == 1 and counts["ewadd"] == 1
    from taso_jax.ir.executor import evaluate

    xs = taso_jax.random_inputs(g, seed=3)
    np.testing.assert_allclose(np.asarray(evaluate(r.graph, xs)[0]),
                               np.asarray(evaluate(g, xs)[0]), rtol=1e-5, atol=1e-5)


def test_two_inputs_through_one_weight_merge_their_rows():
    # One dense layer applied to two inputs (an RNN's input projection at two time steps):
    # their rows are concatenated and the weight is read once.
    b = GraphBuilder()
    w = b.new_weight((16, 32))
    x, y = b.new_input((3, 16), name="x"), b.new_input((5, 16), name="y")
    b.mark_output(b.relu(b.matmul(x, w)))
    b.mark_output(b.matmul(y, w))
    g = b.graph()
    rule = next(s for s in default_substitutions() if s.name == "merge-matmul-matmul-3")
    assert rule.provenance["proof"]["status"] == "proved"
    assert Prover().prove(rule)["status"] == "proved"
    r = taso_jax.search_graph(g, substitutions=[rule], cost_model="analytic", end_to_end=0,
                              budget=5)
    assert r.applied == {"merge-matmul-matmul-3": 1}
    assert r.graph.op_counts()["matmul"] == 1 and r.graph.op_counts()["concat"] == 1
    from taso_jax.ir.executor import evaluate

    xs = taso_jax.random_inputs(g, seed=5)
    for got, ref in zip(evaluate(r.graph, xs), evaluate(g, xs), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_a_proof_is_tried_with_the_rules_near_axioms_first_and_then_with_all():
    from taso_jax.verify.laws import all_axioms
    from taso_jax.verify.prover import CORE_OPERATORS

    conv = next(s for s in SHIPPED if {n.op for n in s.source + s.target} == {"ewadd",
                                                                               "conv2d"})
    prover = Prover()
    near = prover._near_axioms(conv)
    assert near is not None and len(near) < len(prover.formulas)
    names = [prover.formulas[k][0] for k in near]
    assert not any(n.startswith(("lstm", "gru", "quantize_linear", "attention", "rms_norm"))
                   for n in names)
    assert all(prover._operators[k] <= CORE_OPERATORS for k in near)
    r = prover.prove(conv)
    assert r["status"] == "proved" and set(r["axioms"]) <= set(names)
    # A rule whose proof needs a law outside its near axioms is proved all the same: the
    # law of transpose's inverse, marked here as if it named an operator the rule lacks.
    (involution,) = [(n, ax) for n, ax in all_axioms() if n == "transpose"
                     and ax.law == "transpose(transpose(w, perm=(1, 0, 2, 3)), "
                                   "perm=(1, 0, 2, 3)) = w"]
    twice = Substitution(
        "transpose-twice", (("w", (2, 3, 4, 5)),),
        (PNode("transpose", (("perm", (1, 0, 2, 3)),), ("w",)),
         PNode("transpose", (("perm", (1, 0, 2, 3)),), ("#0",)),
         PNode("ewadd", (), ("#1", "w"))),
        (PNode("ewadd", (), ("w", "w")),), (("#2", "#0"),), {})
    small = Prover(axioms=[involution])
    small._operators[0] = frozenset({"lstm"})
    assert 0 not in (small._near_axioms(twice) or [])
    assert small.prove(twice)["status"] == "proved"
