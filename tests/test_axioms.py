"""Operator axioms: every declared axiom holds numerically; Z3 proves rules from them.

Registry-driven: the parametrization walks ``OPS[...].axioms``, so an axiom added to a
declaration is tested without touching this file.
"""

from __future__ import annotations

import pytest
from conftest import unoptimized_xla_in_workers
from taso_jax.ops import Axiom, axiom
from taso_jax.search.rules import PNode, Substitution, default_substitutions
from taso_jax.verify.laws import AxiomError, all_laws, check_axiom, check_axioms
from taso_jax.verify.prover import Prover

AXIOMS = all_laws()  # theorems are checked numerically too


def test_every_tasos_family_has_axioms():
    ops = {name for name, _ in AXIOMS}
    assert {"ewadd", "ewmul", "scalar_mul", "matmul", "conv2d", "concat", "split",
            "transpose", "enlarge"} <= ops
    assert len(AXIOMS) >= 43  # TASO used 43


def _instance_count(ax: Axiom) -> int:
    """How many instances check_axioms evaluates for ``ax`` (three draws, the later two
    sampled at 16 combinations): its cost, at about a quarter of a second each."""
    import math

    from taso_jax.verify.laws import _param_values

    combos = math.prod(len(v) for v in _param_values(ax).values())
    return combos + 2 * min(combos, 16)


#: The fast tier checks the axioms of at most this many instances: 45 of them, every one
#: without attribute variables (elementwise, matmul, transpose, attention, enlarge, ...), in
#: about 30 s; the rest (the convolution laws run to hundreds of instances, the whole set to
#: about 5,000 and ten minutes) are in the slow tier.
FAST_INSTANCES = 6


@pytest.fixture(scope="module")
def numeric_checks(request):
    """The numeric check of each axiom whose test runs, computed up front in two worker
    processes: axiom index -> result."""
    wanted = sorted({item.callspec.params["index"] for item in request.session.items
                     if item.module is request.module and item.originalname
                     == "test_axiom_holds_on_the_reference_functions"})
    with unoptimized_xla_in_workers():
        checks = check_axioms([AXIOMS[i] for i in wanted])
    return dict(zip(wanted, checks, strict=True))


@pytest.mark.parametrize("index", [
    pytest.param(i, marks=() if _instance_count(ax) <= FAST_INSTANCES else pytest.mark.slow)
    for i, (_, ax) in enumerate(AXIOMS)], ids=[f"{n}:{a.law[:40]}" for n, a in AXIOMS])
def test_axiom_holds_on_the_reference_functions(index, numeric_checks):
    r = numeric_checks[index]
    assert r["checked"] > 0 and not r["failures"], r["failures"]


@pytest.mark.slow
def test_a_broken_axiom_is_caught():
    good = next(ax for n, ax in AXIOMS if ax.law == "ewmul(ewadd(x, y), z) = "
                "ewadd(ewmul(x, z), ewmul(y, z))")
    broken = Axiom(good.law.replace("ewadd(ewmul(x, z), ewmul(y, z))",
                                    "ewadd(ewmul(x, z), y)"), good.shapes, good.params)
    assert check_axiom(broken, "broken")["failures"]
    wrong_relu = axiom("relu(ewadd(x, y)) = ewadd(relu(x), relu(y))",
                       {"x": ("N",), "y": ("N",)})
    assert check_axiom(wrong_relu, "relu")["failures"]
    # Z3 reads an attribute variable for every value, so listing only relu is not enough:
    # the check also tries the activation's other declared values and fails.
    any_activation = axiom("matmul(x, a, activation=f) = relu(matmul(x, a))",
                           {"x": ("M", "K"), "a": ("K", "N")}, f=("relu",))
    assert check_axiom(any_activation, "matmul")["failures"]
    # a side condition is part of the law: without "i != j" the interchange is false
    interchange = next(ax for n, ax in AXIOMS if "concat(concat(a, c, axis=j)" in ax.law)
    assert not check_axiom(interchange, "concat")["failures"]
    unconditional = Axiom(interchange.law, interchange.shapes, interchange.params,
                          tuple(c for c in interchange.where if c != "i != j"))
    assert check_axiom(unconditional, "concat")["failures"]
    with pytest.raises(AxiomError, match="unknown operator"):
        check_axiom(axiom("frobnicate(x) = x", {"x": ("N",)}), "bad")
    # the same through check_axioms, which reports an error against its axiom
    many = check_axioms([("broken", broken), ("relu", wrong_relu),
                         ("bad", axiom("frobnicate(x) = x", {"x": ("N",)})),
                         ("good", good)], processes=1)
    assert many[0]["failures"] and many[1]["failures"] and many[3]["checked"] > 0
    assert "unknown operator" in many[2]["failures"][0] and not many[3]["failures"]
    with pytest.raises(AxiomError, match="never well typed"):
        check_axiom(axiom("matmul(x, y) = x", {"x": (2, 3), "y": (2, 3)}), "bad")


def test_the_first_draw_checks_every_attribute_combination():
    """check_axioms samples the attribute combinations only on its later shape draws."""
    import itertools

    import numpy as np
    from taso_jax.verify.laws import _instances, _param_values

    conv = next(ax for n, ax in AXIOMS if n == "conv2d" and "groups=q" in ax.law
                and len(list(itertools.product(*_param_values(ax).values()))) > 16)
    combos = {tuple(sorted(a.items())) for _, a in _instances(conv, np.random.default_rng(0),
                                                              1)}
    assert len(combos) == len(list(itertools.product(*_param_values(conv).values())))
    later = list(_instances(conv, np.random.default_rng(1), 1, sample=16))
    assert len(later) == 16 and len({tuple(sorted(a.items())) for _, a in later}) == 16


#: The Z3 limit at which a wrong rule is shown not to be proved (the default: 2,000,000).
WRONG_RLIMIT = 200_000


@pytest.fixture(scope="module")
def prover():
    return Prover()


def _rule(rule_id):
    """The shipped rule with this stable id."""
    return next(s for s in default_substitutions() if s.id == rule_id)


@pytest.mark.parametrize("rule_id", [
    "ra7cf510783c0",  # ewmul(a, ewadd(y, a)) => ewadd(ewmul(y, a), ewmul(a, a)): a shift
    "r73eac692a396",  # ewadd(a, ewadd(y, y)) => ewadd(y, ewadd(y, a)): reassociation
    "rda5cf32b2990",  # matmul(matmul(x, a), ewadd(c, c)) => matmul(matmul(x, ewadd(a, a)), c)
    "r8d57ed2ea067",  # TASO's matmul merge: x@a, x@b => split(x @ concat(a, b))
    "r235c747a0f7b",  # merging convolutions that share x: split(conv2d(x, concat(w1, w2)))
    "rae899ad73438",  # folding a scale into the kernel: s * conv2d(x, w) => conv2d(x, w * s^T)
])
def test_generated_rules_are_proved_with_their_axioms(prover, rule_id):
    r = prover.prove(_rule(rule_id))
    assert r["status"] == "proved", r
    assert r["axioms"], "a proof names the axioms it used"


def test_a_wrong_rule_is_not_proved(prover):
    # relu(a + b) => relu(a) + relu(b): plausible, and false.
    wrong = Substitution(
        "wrong:relu-distributes", (("a", ("N",)), ("b", ("N",))),
        (PNode("ewadd", (), ("a", "b")), PNode("relu", (), ("#0",))),
        (PNode("relu", (), ("a",)), PNode("relu", (), ("b",)), PNode("ewadd", (), ("#0", "#1"))),
        (("#1", "#2"),), {})
    assert prover.prove(wrong)["status"] != "proved"


_X = ("N", "C", "H", "W")


def test_two_branch_convolutions_are_proved_one_grouped_convolution():
    # concat(conv(x, w), conv(y, v)) => conv(concat(x, y), concat(w, v), groups=2)
    # Both under one smaller resource limit: the true rule is proved within it, and the false
    # one (groups=4) is not. At the default limit (2,000,000) Z3 spends 160 s and 2.5 GB
    # before it gives up on the false one; at 300,000, a quarter of a second.
    prover = Prover(rlimit=300_000)
    rule = Substitution(
        "test:branches=>grouped", (("x", _X), ("y", _X), ("w", ("D", "C", 3, 3)),
                                   ("v", ("D", "C", 3, 3))),
        (PNode("conv2d", (), ("x", "w")), PNode("conv2d", (), ("y", "v")),
         PNode("concat", (("axis", -3),), ("#0", "#1"))),
        (PNode("concat", (("axis", -3),), ("x", "y")),
         PNode("concat", (("axis", -4),), ("w", "v")),
         PNode("conv2d", (("groups", 2),), ("#0", "#1"))),
        (("#2", "#2"),), {})
    assert prover.prove(rule)["status"] == "proved"
    wrong = Substitution(rule.name, rule.variables, rule.source,
                         rule.target[:2] + (PNode("conv2d", (("groups", 4),), ("#0", "#1")),),
                         rule.outputs, {})
    assert prover.prove(wrong)["status"] != "proved"


def test_merge_gconv_is_proved_to_keep_the_convolution(prover):
    # conv(x, w, groups=4) => conv(x, merge_gconv(w, groups=4, count=2), groups=2)
    rule = Substitution(
        "test:merge_gconv", (("x", _X), ("w", ("D", "E", 3, 3))),
        (PNode("conv2d", (("groups", 4),), ("x", "w")),),
        (PNode("merge_gconv", (("count", 2), ("groups", 4)), ("w",)),
         PNode("conv2d", (("groups", 2),), ("x", "#0"))),
        (("#0", "#1"),), {})
    assert prover.prove(rule)["status"] == "proved"
    wrong = Substitution(rule.name, rule.variables, rule.source,
                         (rule.target[0], PNode("conv2d", (("groups", 1),), ("x", "#0"))),
                         rule.outputs, {})
    # At a tenth of the default limit: the wrong rule is not proved either way, but at the
    # default Z3 spends 5 to 7 minutes (two attempts) reaching "unknown".
    assert Prover(rlimit=WRONG_RLIMIT).prove(wrong)["status"] != "proved"


def test_every_law_is_one_literal_line_in_the_operator_files():
    # A law is read where it is declared: written out whole, not assembled from pieces.
    from pathlib import Path

    root = Path(__file__).parent.parent / "ops"
    source = "\n".join(p.read_text() for p in sorted(root.glob("*.py")))
    missing = [ax.law for _, ax in all_laws() if f'"{ax.law}"' not in source]
    assert not missing, missing[:3]
