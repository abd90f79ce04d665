"""Substitutions: JSON form, matching rules, and the shipped default set."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from taso_jax.search.match import MatchState, NoMatch, find_matches, prepare, rewrites
from taso_jax.search.rules import PNode, Substitution, load_substitutions, save_substitutions

import taso_jax
from taso_jax import new_graph
from taso_jax.report import compare_onnx

# matmul(x, a), matmul(x, b)  =>  split(matmul(x, concat(a, b)))
MERGE = Substitution(
    "matmul_concat_merge",
    (("x", ("...", "M", "K")), ("a", ("K", "N")), ("b", ("K", "P"))),
    (PNode("matmul", (("activation", "none"),), ("x", "a")),
     PNode("matmul", (("activation", "none"),), ("x", "b"))),
    (PNode("concat", (("axis", -1),), ("a", "b")),
     PNode("matmul", (("activation", "none"),), ("x", "#0")),
     PNode("split", (("axis", -1), ("sizes", ("$N", "$P"))), ("#1",))),
    (("#0", "#2"), ("#1", "#2.1")),
    {"method": "hand-written for tests", "proof": None})


def _graph(m=4, k=5, n=6, p=7, batch=()):
    g = new_graph()
    x = g.new_input((*batch, m, k), name="x")
    a = g.new_weight((k, n), name="a")
    b = g.new_weight((k, p), name="b")
    ya, yb = g.matmul(x, a), g.matmul(x, b)
    g.mark_output(g.relu(ya), "ya")
    g.mark_output(yb, "yb")
    return g.graph()


def test_json_roundtrip(tmp_path):
    path = tmp_path / "subs.json"
    save_substitutions([MERGE], path, {"note": "test"})
    (back,) = load_substitutions(path)
    assert back == MERGE
    assert back.law == ("matmul(x, a), matmul(x, b)  =>  split(matmul(x, concat(a, b, "
                        "axis=-1)), axis=-1, sizes=['$N', '$P'])[0], split(matmul(x, concat(a, "
                        "b, axis=-1)), axis=-1, sizes=['$N', '$P'])[1]")


@pytest.mark.parametrize("batch", [(), (2, 3)])
def test_match_and_apply_is_correct(batch):
    g = _graph(n=6, p=6, batch=batch)
    graphs = list(rewrites(MERGE, g))
    assert len(graphs) == 2  # concat(a, b) and concat(b, a): both orders match
    xs = taso_jax.random_inputs(g)
    for g2 in graphs:
        assert g2.op_counts() == Counter({"matmul": 1, "split": 1, "relu": 1})
        for a, b in zip(taso_jax.compile_graph(g)(*xs), taso_jax.compile_graph(g2)(*xs),
                        strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_match_binds_each_variable_once():
    # With different widths, only the order that unifies "N" and "P" with the weights matches.
    assert len(list(rewrites(MERGE, _graph(n=6, p=7)))) == 2
    sub = Substitution(MERGE.name, (("x", ("M", "K")), ("a", ("K", "N")), ("b", ("K", "N"))),
                       MERGE.source, MERGE.target, MERGE.outputs)
    assert list(rewrites(sub, _graph(n=6, p=7))) == []


def test_match_checks_symbolic_shapes():
    # Variable shapes must unify: here "K" of a and b differs from x's last dimension.
    sub = Substitution(MERGE.name, (("x", ("M", "K")), ("a", ("K", "N")), ("b", ("K", "N"))),
                       MERGE.source, MERGE.target, MERGE.outputs)
    state = MatchState()
    assert list(rewrites(sub, _graph(n=6, p=7), state)) == []
    assert state.rejected["shape"] > 0


def test_match_refuses_internal_tensor_used_outside():
    # relu(matmul(x, a)) => matmul(x, a, activation=relu) must not fire when the matmul
    # result is also read elsewhere.
    fuse = Substitution("fuse", (("x", ("M", "K")), ("a", ("K", "N"))),
                        (PNode("matmul", (("activation", "none"),), ("x", "a")),
                         PNode("relu", (), ("#0",))),
                        (PNode("matmul", (("activation", "relu"),), ("x", "a")),),
                        (("#1", "#0"),))
    g = new_graph()
    x, a = g.new_input((3, 4), name="x"), g.new_weight((4, 5), name="a")
    y = g.matmul(x, a)
    g.mark_output(g.relu(y), "r")
    only = g.graph()
    assert len(list(rewrites(fuse, only))) == 1
    g.mark_output(y, "y")
    state = MatchState()
    assert list(rewrites(fuse, g.graph(), state)) == []
    assert state.rejected["internal_used"] == 1
    # the failed match itself is falsy and says why
    (m,) = find_matches(fuse, g.graph())
    result = prepare(fuse, g.graph(), m)
    assert not result and isinstance(result, NoMatch) and result.reason == "internal_used"
    assert prepare(fuse, only, next(find_matches(fuse, only)))


def test_match_refuses_cycles():
    # matmul(x, a) and matmul(relu(matmul(x, a)) ...) cannot merge: the second input depends
    # on the first output.
    sub = Substitution("merge_rows", (("x", ("M", "K")), ("y", ("M", "K")), ("a", ("K", "N"))),
                       (PNode("matmul", (("activation", "none"),), ("x", "a")),
                        PNode("matmul", (("activation", "none"),), ("y", "a"))),
                       (PNode("concat", (("axis", -2),), ("x", "y")),
                        PNode("matmul", (("activation", "none"),), ("#0", "a")),
                        PNode("split", (("axis", -2), ("sizes", ("$M", "$M"))), ("#1",))),
                       (("#0", "#2"), ("#1", "#2.1")))
    g = new_graph()
    x, a = g.new_input((4, 4), name="x"), g.new_weight((4, 4), name="a")
    y1 = g.matmul(x, a)
    y2 = g.matmul(g.relu(y1), a)
    g.mark_output(y2, "out")
    g.mark_output(y1, "y1")
    state = MatchState()
    assert list(rewrites(sub, g.graph(), state)) == []
    assert state.rejected["cycle"] >= 1


def test_attributes_must_match():
    g = new_graph()
    x = g.new_input((3, 4), name="x")
    a, b = g.new_weight((4, 5), name="a"), g.new_weight((4, 5), name="b")
    g.matmul(x, a, activation="relu")
    g.matmul(x, b)
    assert list(rewrites(MERGE, g.graph())) == []


def test_default_set_loads_and_is_generated():
    subs = taso_jax.default_substitutions()
    assert len(subs) > 100
    methods = {s.provenance["method"] for s in subs}
    assert methods == {"fingerprint", "law"}  # generated, and read off operator laws
    laws = {s.law for s in subs}
    assert "matmul(matmul(x, a), c)  =>  matmul(x, matmul(a, c))" in laws
    assert "ewadd(matmul(x, a), matmul(x, b))  =>  matmul(x, ewadd(a, b))" in laws


def test_a_quotient_attribute_applies_only_where_the_division_is_exact():
    # groups=?groups => groups=?groups/2 (halving a grouped convolution's groups)
    def attrs(groups):
        return tuple(sorted({"activation": "?a", "dilations": "?d", "groups": groups,
                             "padding": "?p", "strides": "?s"}.items()))

    halve = Substitution(
        "halve", (("x", ("N", "C", "H", "W")), ("w", ("D", "E", "K", "K"))),
        (PNode("conv2d", attrs("?groups"), ("x", "w")),),
        (PNode("merge_gconv", (("count", 2), ("groups", "?groups")), ("w",)),
         PNode("conv2d", attrs("$?groups/2"), ("x", "#0"))),
        (("#0", "#1"),))
    assert "groups=$?groups/2" in halve.law

    def conv(groups, channels):
        g = new_graph(seed=0)
        x = g.new_input((1, channels, 6, 6), name="x")
        g.mark_output(g.conv2d(x, g.new_weight((channels, 2, 3, 3)), groups=groups), "y")
        return g.graph()

    g = conv(32, 64)
    (out,) = list(rewrites(halve, g))
    (c,) = out.by_op["conv2d"]
    assert c.attr("groups") == 16 and c.inputs[1].type.shape == (64, 4, 3, 3)
    # checked by onnxruntime, the original against the rewritten model
    check = compare_onnx(taso_jax.export_onnx(g).SerializeToString(),
                         taso_jax.export_onnx(out).SerializeToString(),
                         {"x": taso_jax.random_inputs(g)[0]})
    assert check["ok"], check
    state = MatchState()
    assert list(rewrites(halve, conv(3, 6), state)) == []  # 3 groups do not halve
    assert state.rejected["target_shape"] == 1
    assert Substitution.from_json(halve.to_json()) == halve


def test_the_shipped_file_round_trips_through_the_typed_patterns_unchanged():
    import json
    from importlib.resources import files

    text = files("taso_jax").joinpath("data/substitutions.json").read_text()
    doc = json.loads(text)
    subs = taso_jax.default_substitutions()
    assert len(subs) == len(doc["substitutions"])
    for s, d in zip(subs, doc["substitutions"], strict=True):
        assert json.loads(json.dumps(s.to_json())) == d, s.name


def test_pattern_strings_are_parsed_once_into_typed_values():
    from taso_jax.search.pattern import AttrVar, NodeRef, SizeExpr, SizeTerm, VarRef

    assert MERGE.source[0].inputs == (VarRef("x"), VarRef("a"))
    assert MERGE.target[1].inputs == (VarRef("x"), NodeRef(0, 0))
    assert MERGE.outputs[1] == (NodeRef(1, 0), NodeRef(2, 1))
    sizes = dict(MERGE.target[2].attrs)["sizes"]
    assert sizes == (SizeExpr((SizeTerm("N"),)), SizeExpr((SizeTerm("P"),)))
    half = PNode("conv2d", (("groups", "$?groups/2"), ("padding", "?p")), ("x", "#0.1"))
    assert dict(half.attrs)["groups"] == SizeExpr((SizeTerm("?groups", 2),))
    assert dict(half.attrs)["padding"] == AttrVar("?p")
    assert [str(r) for r in half.inputs] == ["x", "#0.1"]
    with pytest.raises(ValueError, match="bad node reference"):
        PNode("relu", (), ("#a",))


def test_rules_with_one_first_node_share_its_bindings_and_match_alike():
    # MatchState keeps the bindings of a rule's first source node per (node, variable
    # shapes), shared by every rule with that first node: matches must not change.
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
    from models import MODELS
    g = MODELS["nasnet_a"].build(**MODELS["nasnet_a"].SMALL)
    subs = taso_jax.default_substitutions()
    shared = MatchState()
    n_matches = 0
    for sub in subs:
        alone = list(find_matches(sub, g, MatchState()))
        together = list(find_matches(sub, g, shared))
        assert together == alone, sub.name
        n_matches += len(alone)
    assert n_matches > 100
    caches = {id(shared.first_cache(sub)) for sub in subs}
    assert len(caches) < len(subs) / 4
