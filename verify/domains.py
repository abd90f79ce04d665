"""Enumeration domains of the substitution generator.

A :class:`Domain` is a pool of variables with symbolic shapes, the size instances they are
enumerated and re-checked at, and the operator choices the generator combines; this module
declares that record and the shipped domains (:data:`DEFAULT_DOMAINS`), with the bound
``taso-jax generate --max-ops`` accepts (:data:`MAX_OPS_LIMIT`). To let the generator find
rules about a new operator, add it to a domain's ``ops`` here.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Domain", "CONV_DOMAIN", "MATMUL_DOMAIN", "AFFINE_DOMAIN", "GCONV_DOMAIN",
           "CONV_BRANCH_DOMAIN", "MATMUL_BRANCH_DOMAIN", "MATMUL_ROWS_DOMAIN",
           "DEFAULT_DOMAINS", "MAX_OPS_LIMIT"]


@dataclass(frozen=True)
class Domain:
    """A typed variable pool and operator choices for enumeration.

    Attributes:
        name: short name used in substitution ids.
        variables: name -> (kind ``"input"``/``"weight"``, symbolic shape).
        instances: symbol -> size maps; the first is enumerated, the others re-check
            candidates. In the first, symbol values must be distinct (split sizes are mapped
            back to symbols by value). ``"..."`` maps to a tuple of leading dimensions.
        ops: ``(operator, attributes)`` choices.
        split_axes: axes on which ``split`` into two parts is enumerated.
        attribute_instances: further size maps used only when generalising attributes,
            for attribute values that need other shapes (a kernel of ``C / groups`` input
            channels for another number of groups).
        max_ops: operators per side at most in this domain, whatever the run's bound
            (``None``: the run's bound). The dense domains stop at 3: one operator more
            multiplies their enumeration about 20 times.
        weight_ops: when set, the operator bound counts only operators that read an input,
            and each expression may hold up to this many weight-only operators more (they
            are computed once, ahead of time: free at run time, as in TASO's cost model).
            ``None``: every operator counts.
        weight_only_ops: with ``weight_ops``, the operators that may build a weight-only
            expression: those that lay weights out (concatenate, pad, transpose). Adding two
            weights ahead of time is a variable of the rule already.
        slice_merges: also derive two-output rules ``(a, b) => split(t)`` by slicing each
            expression ``t`` and looking its parts up among the fingerprint classes, so
            the concatenation of ``a`` and ``b`` need not be enumerated: two biased
            branches ``conv(x, w1) + b1`` and ``conv(x, w2) + b2`` (4 operators) merge into
            ``conv(x, concat(w1, w2)) + concat(b1, b2)`` (4 operators), where the
            concatenation route would need 5.
        class_pairs: derive rules from pairs of members of a fingerprint class (and
            ``concat`` members). Off for domains that exist only for their slice merges:
            their single-output rules repeat the dense domains' or chain bias additions.
        merged_ops: when set, a slice merge is kept where its merged side runs fewer of
            these operators than its source, whatever it adds around them (a concatenation
            of two inputs): ``matmul(x, w), matmul(y, w) => split(matmul(concat(x, y), w))``
            reads the weight once for two. ``()``: fewer runtime operators of any kind.
    """

    name: str
    variables: dict[str, tuple[str, tuple]]
    instances: tuple[dict, ...]
    ops: tuple[tuple[str, dict], ...]
    split_axes: tuple[int, ...] = ()
    attribute_instances: tuple[dict, ...] = ()
    max_ops: int | None = None
    weight_ops: int | None = None
    weight_only_ops: tuple[str, ...] = ("concat", "enlarge", "transpose")
    slice_merges: bool = False
    class_pairs: bool = True
    merged_ops: tuple[str, ...] = ()

    @property
    def input_names(self) -> frozenset[str]:
        """The variables of kind ``"input"`` (the others are weights)."""
        return frozenset(v for v, (kind, _) in self.variables.items() if kind == "input")


CONV_DOMAIN = Domain(
    "conv",
    variables={"x": ("input", ("N", "C", "H", "W")),
               "w1": ("weight", ("D", "C", "K", "K")), "w2": ("weight", ("D", "C", "K", "K")),
               "w3": ("weight", ("D", "C", 1, 1)), "s": ("weight", (1, "D", 1, 1))},
    instances=({"N": 2, "C": 3, "D": 4, "H": 6, "W": 7, "K": 3},
               {"N": 1, "C": 5, "D": 3, "H": 9, "W": 8, "K": 5}),
    ops=(("conv2d", {}), ("relu", {}), ("ewadd", {}), ("ewmul", {}), ("concat", {"axis": -3}),
         ("concat", {"axis": -4}), ("enlarge", {}), ("transpose", {"perm": (1, 0, 2, 3)})),
    split_axes=(-3, -4), max_ops=3)

MATMUL_DOMAIN = Domain(
    "matmul",
    variables={"x": ("input", ("...", "M", "K")), "y": ("input", ("...", "M", "K")),
               "a": ("weight", ("K", "N")), "b": ("weight", ("K", "N")),
               "c": ("weight", ("N", "P"))},
    instances=({"...": (), "M": 3, "K": 4, "N": 5, "P": 6},
               {"...": (2,), "M": 5, "K": 3, "N": 4, "P": 2}),
    ops=(("matmul", {}), ("matmul", {"activation": "relu"}), ("relu", {}), ("ewadd", {}),
         ("concat", {"axis": -1}), ("concat", {"axis": -2})),
    split_axes=(-1, -2), max_ops=3)

#: Per-channel affine maps after a convolution, with two distinct per-channel weights (the
#: shape in which flax and other NHWC front ends express batchnorm: (y - mean) * s + b),
#: so that shift-then-scale chains fold into the kernel too.
AFFINE_DOMAIN = Domain(
    "affine",
    variables={"x": ("input", ("N", "C", "H", "W")), "y": ("input", ("N", "D", "H", "W")),
               "w": ("weight", ("D", "C", "K", "K")),
               "a": ("weight", (1, "D", 1, 1)), "b": ("weight", (1, "D", 1, 1))},
    instances=({"N": 2, "C": 3, "D": 4, "H": 6, "W": 7, "K": 3},
               {"N": 1, "C": 5, "D": 3, "H": 9, "W": 8, "K": 5}),
    ops=(("conv2d", {}), ("ewadd", {}), ("ewmul", {}), ("transpose", {"perm": (1, 0, 2, 3)})),
    max_ops=3)

#: Grouped convolutions (ResNeXt, separable convolutions): a kernel of E = C / 4 input
#: channels, so that the rewrites that change the number of groups (TASO's merge_gconv) and
#: the folds and fusions of grouped convolutions are found. The attribute instances give the
#: shapes for 2 and 8 groups.
GCONV_DOMAIN = Domain(
    "gconv",
    variables={"x": ("input", ("N", "C", "H", "W")), "w": ("weight", ("D", "E", "K", "K")),
               "s": ("weight", (1, "D", 1, 1))},
    instances=({"N": 1, "C": 8, "E": 2, "D": 12, "H": 5, "W": 6, "K": 3},
               {"N": 2, "C": 12, "E": 3, "D": 8, "H": 6, "W": 5, "K": 1}),
    ops=(("conv2d", {"groups": 4}), ("conv2d", {"groups": 2}), ("conv2d", {}),
         ("merge_gconv", {"groups": 4, "count": 4}), ("merge_gconv", {"groups": 4, "count": 2}),
         ("relu", {}), ("ewmul", {}), ("transpose", {"perm": (1, 0, 2, 3)})),
    attribute_instances=({"N": 1, "C": 6, "E": 3, "D": 4, "H": 5, "W": 6, "K": 3},
                         {"N": 1, "C": 16, "E": 2, "D": 8, "H": 4, "W": 5, "K": 3}),
    max_ops=3)

#: Parallel branches as exporters write them: convolutions of different widths (``D`` and
#: ``E`` output channels) sharing an input, each with its own bias, and a 1x1 kernel next to
#: a KxK one (inception modules, squeezenet's fire modules). Each branch has up to 2
#: operators that read the input, so the merged sources have up to 4, with up to 3
#: weight-only operators (concatenated kernels and biases, an enlarged kernel) on the
#: merged side; slice merges find how two biased convolutions become one.
CONV_BRANCH_DOMAIN = Domain(
    "convbranch",
    variables={"x": ("input", ("N", "C", "H", "W")),
               "w1": ("weight", ("D", "C", "K", "K")), "w2": ("weight", ("E", "C", "K", "K")),
               "w3": ("weight", ("E", "C", 1, 1)),
               "b1": ("weight", (1, "D", 1, 1)), "b2": ("weight", (1, "E", 1, 1))},
    # no size is the sum of two channel counts in both instances (a split of C + D
    # channels must not be read as W)
    instances=({"N": 2, "C": 6, "D": 4, "E": 5, "H": 13, "W": 14, "K": 3},
               {"N": 1, "C": 5, "D": 3, "E": 2, "H": 9, "W": 10, "K": 5}),
    ops=(("conv2d", {}), ("ewadd", {}), ("concat", {"axis": -3}), ("concat", {"axis": -4}),
         ("enlarge", {})),
    split_axes=(-3,), max_ops=2, weight_ops=3, slice_merges=True, class_pairs=False)

#: Dense layers with biases sharing an input (the query, key and value projections of
#: attention, Gemm with a bias in exported models), of different widths ``N`` and ``P``.
MATMUL_BRANCH_DOMAIN = Domain(
    "matmulbranch",
    variables={"x": ("input", ("...", "M", "K")),
               "w1": ("weight", ("K", "N")), "w2": ("weight", ("K", "P")),
               "b1": ("weight", ("N",)), "b2": ("weight", ("P",))},
    instances=({"...": (), "M": 3, "K": 4, "N": 5, "P": 6},
               {"...": (2,), "M": 5, "K": 3, "N": 4, "P": 2}),
    ops=(("matmul", {}), ("ewadd", {}), ("concat", {"axis": -1})),
    split_axes=(-1,), max_ops=2, weight_ops=2, slice_merges=True, class_pairs=False)

#: Dense layers applied to two inputs with the same weight (an RNN's input projection at
#: each time step, a layer shared by two towers): the rows of ``x [..., M, K]`` and
#: ``y [..., L, K]`` go through one matmul, whose weight is then read once. With a bias,
#: the source has 4 operators.
MATMUL_ROWS_DOMAIN = Domain(
    "matmulrows",
    variables={"x": ("input", ("...", "M", "K")), "y": ("input", ("...", "L", "K")),
               "w": ("weight", ("K", "N")), "b": ("weight", ("N",))},
    # M + L is no other symbol's size in either instance
    instances=({"...": (), "M": 3, "L": 2, "K": 4, "N": 7},
               {"...": (2,), "M": 2, "L": 5, "K": 3, "N": 4}),
    ops=(("matmul", {}), ("ewadd", {}), ("concat", {"axis": -2})),
    split_axes=(-2,), max_ops=3, weight_ops=0, slice_merges=True, class_pairs=False,
    merged_ops=("matmul",))

#: The most operators per side ``taso-jax generate --max-ops`` accepts: TASO's own bound. The
#: shipped domains stop at their own ``max_ops`` (3 at most) whatever is asked; a domain
#: without one is enumerated to the run's bound, and each operator more multiplies a dense
#: domain's enumeration about 20 times (time and memory).
MAX_OPS_LIMIT = 4

DEFAULT_DOMAINS = (CONV_DOMAIN, MATMUL_DOMAIN, AFFINE_DOMAIN, GCONV_DOMAIN, CONV_BRANCH_DOMAIN,
                   MATMUL_BRANCH_DOMAIN, MATMUL_ROWS_DOMAIN)
