"""The substitution generator on small operator sets."""

from __future__ import annotations

import pytest
from taso_jax.search.rules import PNode, Substitution
from taso_jax.verify.generator import Domain, check_substitution, generate

MM = Domain("mm", {"x": ("input", ("M", "K")), "a": ("weight", ("K", "N")),
                   "b": ("weight", ("K", "N")), "c": ("weight", ("N", "P"))},
            ({"M": 2, "K": 3, "N": 4, "P": 5}, {"M": 5, "K": 2, "N": 3, "P": 4}),
            (("matmul", {}), ("ewadd", {})))


def test_finds_matmul_laws():
    subs, stats = generate((MM,), max_ops=3, workers=1)
    laws = {s.law for s in subs}
    assert "ewadd(matmul(x, a), matmul(x, b))  =>  matmul(x, ewadd(a, b))" in laws
    assert "matmul(matmul(x, a), c)  =>  matmul(x, matmul(a, c))" in laws
    assert stats.kept == len(subs) and stats.candidates > stats.kept
    assert all(s.provenance["proof"] is None for s in subs)


def test_same_structure_over_other_shapes_is_kept():
    # The same laws over rank-3 inputs are different rules (they match other tensors).
    mm3 = Domain("mm3", {**MM.variables, "x": ("input", ("B", "M", "K"))},
                 tuple({**i, "B": 7 + j} for j, i in enumerate(MM.instances)), MM.ops)
    subs, _ = generate((MM, mm3), max_ops=2, workers=1)
    by_domain = {d: {s.law for s in subs if s.provenance["domain"] == d} for d in ("mm", "mm3")}
    assert by_domain["mm"] and by_domain["mm"] == by_domain["mm3"]


def _rule(source, target):
    v = (("a", ("M", "K")), ("b", ("M", "K")))
    return Substitution("r", v, source, target,
                        ((f"#{len(source) - 1}", f"#{len(target) - 1}"),))


RELU_DOMAIN = Domain("ew", {"a": ("input", ("M", "K")), "b": ("input", ("M", "K"))},
                     ({"M": 3, "K": 4}, {"M": 5, "K": 2}), (("ewadd", {}), ("relu", {})))


def test_near_miss_is_rejected():
    """relu(a + b) = relu(a) + relu(b) holds for many inputs (both positive), but not all."""
    wrong = _rule((PNode("ewadd", (), ("a", "b")), PNode("relu", (), ("#0",))),
                  (PNode("relu", (), ("a",)), PNode("relu", (), ("b",)),
                   PNode("ewadd", (), ("#0", "#1"))))
    right = _rule((PNode("ewadd", (), ("a", "b")), PNode("relu", (), ("#0",))),
                  (PNode("ewadd", (), ("b", "a")), PNode("relu", (), ("#0",))))
    for inst in RELU_DOMAIN.instances:
        assert check_substitution(wrong, RELU_DOMAIN, inst, seed=1) is False
        assert check_substitution(right, RELU_DOMAIN, inst, seed=1) is True
    subs, _ = generate((RELU_DOMAIN,), max_ops=3, workers=1)
    assert not any(s.law.startswith("relu(ewadd(a, b))  =>  ewadd(relu(a), relu(b))")
                   for s in subs)


@pytest.mark.slow
def test_grouped_convolution_rules_hold_for_any_number_of_groups():
    # The grouped domain enumerates at 4 groups; broad renaming ties merge_gconv's groups and
    # count to the convolution's groups, and the attribute instances check 2 and 8 groups.
    from taso_jax.verify.domains import GCONV_DOMAIN

    subs, _ = generate((GCONV_DOMAIN,), max_ops=2, workers=1)
    laws = {s.law: s for s in subs}
    dense = laws.get("conv2d(x, w, activation=?activation, dilations=?dilations, "
                     "groups=?groups, padding=?padding, strides=?strides)  =>  conv2d(x, "
                     "merge_gconv(w, count=?groups, groups=?groups), activation=?activation, "
                     "dilations=?dilations, padding=?padding, strides=?strides)")
    assert dense is not None, sorted(laws)
    assert dense.provenance["attribute_values"]["?groups"] == [4, 2, 8]
    # Halving (enumerated as 4 groups => 2): the quotient renaming writes the target's groups
    # as ?groups/2, which re-checks at 2 and 8 groups.
    halve = laws.get("conv2d(x, w, activation=?activation, dilations=?dilations, "
                     "groups=?groups, padding=?padding, strides=?strides)  =>  conv2d(x, "
                     "merge_gconv(w, count=2, groups=?groups), activation=?activation, "
                     "dilations=?dilations, groups=$?groups/2, padding=?padding, "
                     "strides=?strides)")
    assert halve is not None, sorted(laws)
    assert halve.provenance["attribute_values"]["?groups"] == [4, 2, 8]


@pytest.mark.slow
def test_biased_matmul_branches_merge_by_slicing():
    # Two dense layers of different widths, each with its own bias, sharing an input: the
    # merged form's concatenation of both branches would need 5 operators; slicing finds it
    # with 2 operators per branch (and the weight-only concatenations free).
    from taso_jax.verify.domains import MATMUL_BRANCH_DOMAIN

    subs, stats = generate((MATMUL_BRANCH_DOMAIN,), max_ops=4, workers=1)
    laws = {s.law for s in subs}
    assert ("ewadd(b1, matmul(x, w1, activation=?activation)), ewadd(b2, matmul(x, w2, "
            "activation=?activation))  =>  split(ewadd(concat(b1, b2, axis=-1), matmul(x, "
            "concat(w1, w2, axis=-1), activation=?activation)), axis=-1, sizes=['$N', '$P'])[0]"
            in " ".join(laws))
    assert all(s.provenance["derivation"] == "slice" for s in subs)
    # only one of each merge and its output-swapped twin, no weight-only sources
    assert stats.pruned["output_order"] > 0 and stats.pruned["weight_only_subexpression"] > 0
    assert len(subs) == len({s.name.rstrip("-0123456789") for s in subs})


@pytest.mark.slow
def test_rows_of_two_inputs_through_one_weight_merge_by_slicing():
    # The same weight applied to two inputs: slicing the matmul of their concatenated rows
    # finds the merge; merges that only concatenate elementwise work are not kept.
    from taso_jax.verify.domains import MATMUL_ROWS_DOMAIN

    subs, stats = generate((MATMUL_ROWS_DOMAIN,), max_ops=4, workers=1)
    laws = [s.law for s in subs]
    assert ("matmul(x, w, activation=?activation), matmul(y, w, activation=?activation)  =>  "
            "split(matmul(concat(x, y, axis=-2), w, activation=?activation), axis=-2, "
            "sizes=['$M', '$L'])[0]") in " ".join(laws)
    # each kept merge reads its weight once where the source read it twice
    assert all(sum(n.op == "matmul" for n in s.source) == 2
               and sum(n.op == "matmul" for n in s.target) == 1 for s in subs), laws
    assert stats.pruned["split_gains_nothing"] > 0


@pytest.mark.slow
def test_a_slice_merge_is_checked_on_other_sizes():
    # Slicing at a size that is another symbol's value by coincidence (C + D == W) must not
    # survive the re-check on the second instance.
    conv = Domain("cb", {"x": ("input", ("N", "C", "H", "W")),
                         "w1": ("weight", ("D", "C", 1, 1)), "w2": ("weight", ("E", "C", 1, 1))},
                  ({"N": 2, "C": 3, "D": 4, "E": 5, "H": 6, "W": 7},
                   {"N": 1, "C": 5, "D": 3, "E": 2, "H": 9, "W": 10}),
                  (("conv2d", {}), ("concat", {"axis": -3}), ("concat", {"axis": -4})),
                  split_axes=(-3,), max_ops=2, weight_ops=1, slice_merges=True,
                  class_pairs=False)
    subs, stats = generate((conv,), max_ops=2, workers=1)
    laws = " ".join(s.law for s in subs)
    assert "split(conv2d(x, concat(w1, w2, axis=-4)" in laws
    assert "$W" not in laws and stats.pruned["failed_recheck"] > 0
