"""Automatic substitution generator (TASO, Jia et al., SOSP 2019, Section 3).

1. **Enumerate** every expression of up to ``max_ops`` operators over a *domain*: a pool of
   variables with symbolic shapes and a list of operator choices (operator + attributes).
   Expressions are hash-consed graph nodes, so a DAG that reuses a subexpression counts each
   operator once. Only the first expression of each fingerprint class is extended further
   (an expression built on a non-canonical input is redundant with one built on the canonical
   input), which keeps the enumeration small.
2. **Fingerprint** each expression by evaluating the JAX reference functions in float64 on
   random inputs and projecting the result on two fixed random vectors. Equal functions give
   equal projections up to rounding; unequal multilinear/piecewise-linear functions agree on
   random Gaussian inputs with probability zero, and the two 9-digit projections make an
   accidental collision about 1e-18 likely per pair. Every candidate is then **re-checked**
   on a second, differently sized instance of the domain with fresh random values
   (``numpy.allclose`` at 1e-9), which rejects both collisions and laws that hold only for
   particular shapes.
3. **Pair** expressions of a class into candidate substitutions (both directions), and derive
   multi-output substitutions: when ``concat(a, b)`` equals ``t``, then ``(a, b)`` can be
   replaced by the two parts of ``split(t)`` (how two convolutions that share an input
   become one).
4. **Prune**: the target may use only the source's variables; a substitution whose two sides
   share an operator node (a common subgraph) is redundant with a smaller one; a rule that
   only swaps the operands of commutative operators is dropped (matching tries both
   orders); weight-only sources are dropped (weights are precomputed, rewriting them gains
   nothing); duplicates under renaming into interchangeable variables of the domain, or
   under swapping commutative operands, are removed.
5. **Generalise attributes** (:func:`generalize_attributes`) and record the values each
   attribute variable was checked at; ``taso-jax generate`` then proves every candidate
   (:mod:`taso_jax.verify`) and keeps the proved ones.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import jax
import numpy as np
from taso_jax.ops import OPS, ShapeError, TensorType
from taso_jax.search.match import MatchState, apply, find_matches, instantiate
from taso_jax.search.pattern import AttrVar, PNode, attr_to_json, is_symbolic
from taso_jax.search.rules import Substitution, name_rules

from taso_jax.ir.executor import evaluate, run_node
from taso_jax.ir.graph import Graph, Node, Tensor, leaf_node, make_node, topo_order

__all__ = ["Domain", "DEFAULT_DOMAINS", "generate", "GeneratorStats", "check_substitution",
           "MAX_OPS_LIMIT"]


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


@dataclass
class GeneratorStats:
    """Counts per stage of one generator run (and seconds per stage)."""

    expressions: int = 0
    classes: int = 0
    candidates: int = 0
    pruned: Counter = field(default_factory=Counter)
    kept: int = 0
    seconds: dict = field(default_factory=dict)

    def summary(self) -> str:
        """One-paragraph human-readable summary."""
        pr = ", ".join(f"{k} {v}" for k, v in sorted(self.pruned.items()))
        return (f"enumerated expressions: {self.expressions}; fingerprint classes: "
                f"{self.classes}; candidate substitutions: {self.candidates}; pruned: {pr}; "
                f"kept: {self.kept}")


def _enable_x64():
    return jax.enable_x64(True)


def _instance_shape(pattern: tuple, inst: dict) -> tuple[int, ...]:
    out: list[int] = []
    for p in pattern:
        if p == "...":
            out.extend(inst["..."])
        else:
            out.append(p if isinstance(p, int) else inst[p])
    return tuple(out)


class _Fingerprinter:
    def __init__(self, seed: int):
        self.seed = seed
        self.values: dict[Tensor, np.ndarray] = {}
        self._proj: dict[tuple, np.ndarray] = {}

    def key(self, t: Tensor) -> tuple:
        return self.key_of(self.values[t], t.dtype)

    def key_of(self, value: np.ndarray, dtype: str) -> tuple:
        """The fingerprint of a value: its shape, dtype and two rounded projections."""
        shape = tuple(value.shape)
        v = value.reshape(-1)
        if shape not in self._proj:
            rng = np.random.default_rng([self.seed, *shape, 7919])
            self._proj[shape] = rng.standard_normal((2, v.size))
        p = self._proj[shape] @ v
        scale = max(float(np.sqrt(np.sum(v * v))), 1e-300) * 1e-9
        return (shape, dtype) + tuple("0" if abs(x) < scale else f"{x:.9e}" for x in p)


@dataclass
class _Expr:
    tensor: Tensor
    nodes: frozenset
    vars: frozenset


def _enumerate(domain: Domain, max_ops: int, seed: int, progress: Callable | None):
    inst = domain.instances[0]
    rng = np.random.default_rng(seed)
    fp = _Fingerprinter(seed)
    leaves: dict[str, Tensor] = {}
    for name, (kind, pat) in domain.variables.items():
        t = leaf_node(kind, name, TensorType(_instance_shape(pat, inst), "float64")).outputs[0]
        leaves[name] = t
        fp.values[t] = rng.standard_normal(t.shape)
    exprs: dict[Tensor, _Expr] = {
        t: _Expr(t, frozenset(), frozenset([n])) for n, t in leaves.items()}
    classes: dict[tuple, list[_Expr]] = {}
    reps: list[_Expr] = []
    for e in exprs.values():
        classes.setdefault(fp.key(e.tensor), []).append(e)
        reps.append(e)
    sym_values = {v: k for k, v in inst.items() if isinstance(v, int)}

    inputs = domain.input_names
    reads_input: dict[Node, bool] = {}

    def add(node: Node, ins: list[_Expr]) -> None:
        nodes = frozenset().union(*(e.nodes for e in ins)) | {node}
        if len(nodes) > size or any(t in exprs for t in node.outputs):
            return
        if domain.weight_ops is not None:
            reads_input[node] = any(e.vars & inputs for e in ins)
            if not reads_input[node] and node.op not in domain.weight_only_ops:
                return
            runtime = sum(reads_input[n] for n in nodes)
            if runtime > max_ops or len(nodes) - runtime > domain.weight_ops:
                return
        vals = run_node(node, [fp.values[e.tensor] for e in ins])
        for t, v in zip(node.outputs, vals, strict=True):
            fp.values[t] = np.asarray(v)
            e = _Expr(t, nodes, frozenset().union(*(e.vars for e in ins)))
            exprs[t] = e
            cls = classes.setdefault(fp.key(t), [])
            cls.append(e)
            if len(cls) == 1:
                new_reps.append(e)

    if domain.max_ops is not None:
        max_ops = min(max_ops, domain.max_ops)
    for size in range(1, max_ops + (domain.weight_ops or 0) + 1):
        new_reps: list[_Expr] = []
        pool = [e for e in reps if len(e.nodes) < size]
        for op, attrs in domain.ops:
            arity = OPS[op].arity or 2
            for combo in itertools.product(pool, repeat=arity):
                if sum(len(e.nodes) for e in combo) < size - 1:
                    continue
                try:
                    node = make_node(op, [e.tensor for e in combo], attrs)
                except ShapeError:
                    continue
                add(node, list(combo))
        for e in pool:
            for axis in domain.split_axes:
                d = e.tensor.shape[axis] if len(e.tensor.shape) >= -axis else 0
                for a in sym_values:
                    if 0 < a < d and (d - a) in sym_values:
                        try:
                            node = make_node("split", [e.tensor], {"axis": axis,
                                                                  "sizes": (a, d - a)})
                        except ShapeError:
                            continue
                        add(node, [e])
        reps.extend(new_reps)
        if progress:
            progress(f"{domain.name}: size {size}: {len(exprs)} expressions")
    return leaves, exprs, classes, sym_values, fp


def _symbolize(v, sym_values: dict[int, str]):
    if isinstance(v, tuple):
        return tuple(_symbolize(x, sym_values) for x in v)
    if isinstance(v, int) and not isinstance(v, bool):
        if v in sym_values:
            return "$" + sym_values[v]
        for a, b in itertools.combinations_with_replacement(sorted(sym_values), 2):
            if a + b == v:
                return f"${sym_values[a]}+{sym_values[b]}"
        raise ValueError(f"size {v} is not expressible in symbols")
    return v


def _pattern(roots: list[Tensor], nodes: frozenset, sym_values) -> tuple[tuple, list[str]]:
    order = [n for n in topo_order(roots) if n in nodes]
    index = {n: i for i, n in enumerate(order)}

    def ref(t: Tensor) -> str:
        if t.node not in index:
            return t.node.name
        return f"#{index[t.node]}" + (f".{t.index}" if t.index else "")

    pnodes = []
    for n in order:
        attrs = tuple((k, _symbolize(v, sym_values) if k == "sizes" else v) for k, v in n.attrs)
        pnodes.append(PNode(n.op, attrs, tuple(ref(t) for t in n.inputs)))
    return tuple(pnodes), [ref(t) for t in roots]


def _make_sub(domain, src_roots, src_nodes, tgt_roots, tgt_nodes, used_vars, sym_values,
              provenance) -> Substitution:
    src, src_refs = _pattern(src_roots, src_nodes, sym_values)
    tgt, tgt_refs = _pattern(tgt_roots, tgt_nodes, sym_values)
    variables = tuple((v, domain.variables[v][1]) for v in sorted(used_vars))
    name = f"{domain.name}:{'+'.join(n.op for n in src)}=>{'+'.join(n.op for n in tgt) or 'id'}"
    return Substitution(name, variables, src, tgt, tuple(zip(src_refs, tgt_refs, strict=True)),
                        provenance)


def _canonical_key(sub: Substitution, domain: Domain) -> str:
    """A text shared by substitutions that differ only in naming or operand order.

    Variables may be renamed into other interchangeable ones of the domain (same kind and
    shape), and the operands of commutative operators swapped (the matcher tries both).
    """
    import json

    groups: dict[tuple, list[str]] = {}
    for v, spec in domain.variables.items():
        groups.setdefault(spec, []).append(v)
    used: dict[tuple, list[str]] = {}
    for v, _ in sub.variables:
        used.setdefault(domain.variables[v], []).append(v)

    def nodes(ns, ren):
        out = []
        for n in ns:
            ins = [ren.get(str(r), str(r)) for r in n.inputs]
            if OPS[n.op].commutative:
                ins.sort()
            out.append([n.op, [[k, attr_to_json(v)] for k, v in n.attrs], ins])
        return out

    best = None
    # Each group's used variables may take any names of their group (in any order).
    choices = [itertools.permutations(groups[spec], len(vs)) for spec, vs in used.items()]
    for names in itertools.product(*choices):
        ren = {}
        for vs, ns in zip(used.values(), names, strict=True):
            ren.update(zip(vs, ns, strict=True))
        text = json.dumps([sorted((ren[v], list(p)) for v, p in sub.variables),
                           nodes(sub.source, ren), nodes(sub.target, ren),
                           [[ren.get(str(a), str(a)), ren.get(str(b), str(b))]
                            for a, b in sub.outputs]])
        best = text if best is None or text < best else best
    return best


def _build_source(sub: Substitution, domain: Domain, sym: dict):
    """The source pattern on fresh leaves shaped by ``sym``; raises ``ShapeError``."""
    leaves = {v: leaf_node(domain.variables[v][0], v,
                           TensorType(_instance_shape(pat, sym), "float64")).outputs[0]
              for v, pat in sub.variables}
    return leaves, instantiate(sub.source, leaves, sym)


def check_substitution(sub: Substitution, domain: Domain, instance: dict, seed: int,
                       attr_values: dict | None = None) -> bool | None:
    """Numerically check ``sub`` on one shape instance of its domain (float64, rtol 1e-9).

    ``attr_values`` gives values for attribute variables (``"?strides"``). Builds the source
    pattern as a graph, rewrites it with the matcher (so the check covers matching and
    symbolic sizes too), and compares both graphs' outputs on random inputs.

    Returns:
        ``True`` or ``False``; ``None`` when the source does not type-check on this
        instance (nothing to check).
    """
    sym = {**instance, **(attr_values or {})}
    try:
        leaves, built = _build_source(sub, domain, sym)
    except ShapeError:
        return None
    rng = np.random.default_rng(seed)
    values = {v: rng.standard_normal(t.shape) for v, t in leaves.items()}
    outs = [Tensor(built[s.node], s.output) for s, _ in sub.outputs]
    inputs = tuple(t.node for t in leaves.values() if t.node.op == "input")
    weights = {v: values[v] for v, t in leaves.items() if t.node.op == "weight"}
    g = Graph(inputs, tuple(outs), tuple(f"o{i}" for i in range(len(outs))), weights)
    rewritten = None
    for m in find_matches(sub, g, MatchState()):  # a match of exactly the source nodes
        if set(m.nodes) == set(built):
            rewritten = apply(sub, g, m) or None
            if rewritten is not None:
                break
    if rewritten is None:
        return False
    with _enable_x64():
        ins = [values[n.name] for n in inputs]
        a = evaluate(g, ins)
        b = evaluate(rewritten, ins)
    return all(np.allclose(np.asarray(x), np.asarray(y), rtol=1e-9, atol=1e-9)
               for x, y in zip(a, b, strict=True))


def _runtime_ops(nodes, domain) -> int:
    """Operators in ``nodes`` that depend on an input variable."""
    memo: dict = {}

    def runtime(n: Node) -> bool:
        if n not in memo:
            if n.op in ("input", "weight"):
                memo[n] = domain.variables[n.name][0] == "input"
            else:
                memo[n] = any(runtime(t.node) for t in n.inputs)
        return memo[n]

    return sum(runtime(n) for n in nodes)


def _alternatives(op: str, name: str, value) -> list:
    """Other values of one attribute, taken from the operator's declared examples."""
    vals = [OPS[op].attrs.get(name)] + [a[name] for _, a in OPS[op].examples if name in a]
    out = []
    for v in vals:
        if v != value and v not in out:
            out.append(v)
    return out


def _survives_canon(sub: Substitution, domain: Domain, values: dict, op: str, name: str,
                    value) -> bool:
    """Whether building ``sub``'s source with ``values`` keeps ``value`` on an ``op`` node.

    An operator's canonicalization may rewrite it into another value (axis 1 to -3).
    """
    for inst in domain.instances + domain.attribute_instances:
        try:
            _, built = _build_source(sub, domain, {**inst, **values})
        except ShapeError:
            continue
        return any(n.op == op and dict(n.attrs).get(name) == value for n in built)
    return True


def generalize_attributes(sub: Substitution, domain: Domain, seed: int) -> Substitution:
    """Turn attributes that both sides share into attribute variables where the law allows.

    For each ``(operator, attribute, value)`` used on the source side, the value becomes
    ``"?attribute"``, first wherever the same integer appears in any attribute on either
    side (so ``conv2d(x, w, groups=4) => conv2d(x, merge_gconv(w, groups=4, count=4),
    groups=1)`` becomes a law for any number of groups), then also as a quotient where an
    attribute of the same name holds a divisor (``groups=4 => groups=2`` becomes
    ``groups=?groups => groups=?groups/2``), else only on that operator's attribute. A
    generalised substitution is kept if it re-checks on every domain instance (and attribute
    instance) for every alternative value from the operator's examples that type-checks, and
    at least one does. E.g. folding a per-channel scale into a kernel holds for any stride,
    padding and dilation, but not with a fused relu.

    The values each variable was checked at (the original first) are recorded in
    ``provenance["attribute_values"]``; the verifier proves a rule at those values when it
    cannot prove it for every value, and the matcher then accepts only those.
    """
    fixed: dict = {}  # attribute variables introduced so far, at their original values
    values: dict = {}  # attribute variable -> the values it was checked at (original first)
    instances = domain.instances + domain.attribute_instances
    for p in sub.source:
        for k, v in p.attrs:
            if is_symbolic(v) or k == "sizes":
                continue
            var = f"?{k}"
            current = [(n.op, a, x) for n in sub.source + sub.target for a, x in n.attrs]
            if AttrVar(var) in (x for _, _, x in current) or (p.op, k, v) not in current:
                continue  # the name is taken, or a broad renaming already took this value
            for mode in _renamings(v):
                cand = _rename_attribute(sub, p.op, k, v, var, mode)
                if cand is None:
                    continue
                validated = _validate_values(cand, domain, instances, fixed, p.op, k, v, var,
                                             seed)
                if validated is not None:
                    sub = cand
                    fixed[var] = v
                    values[var] = validated
                    break
    if values:
        sub.provenance["attribute_values"] = {k: [attr_to_json(x) for x in v]
                                              for k, v in values.items()}
    return sub


def _renamings(v) -> tuple[str, ...]:
    """For integers: broad renaming (every equal integer), then quotient, then narrow."""
    if isinstance(v, int) and not isinstance(v, bool):
        return ("broad", "quotient", "narrow")
    return ("narrow",)


def _rename_attribute(sub: Substitution, op: str, k: str, v, var: str,
                      mode: str) -> Substitution | None:
    """``sub`` with ``op``'s attribute ``k == v`` as ``var``, in one of three modes.

    * ``"narrow"``: only that attribute of ``op``;
    * ``"broad"``: every attribute equal to ``v`` as well (a merge_gconv's ``groups`` and
      ``count`` with the convolution's ``groups``);
    * ``"quotient"``: as broad, and every other attribute named ``k`` whose integer value
      divides ``v`` as ``var`` over the quotient: halving the groups of a convolution,
      ``groups=4 => groups=2``, becomes ``groups=?groups => groups=?groups/2`` (TASO's
      merge_gconv with a count of 2). The matcher applies such a rule only where the
      division is exact.

    Returns ``None`` when broad or quotient renaming changes nothing more than the narrower
    mode before it.
    """
    def new_value(n, a, x):
        if (mode == "narrow" and n.op == op and a == k and x == v
                or mode != "narrow" and type(x) is type(v) and x == v):
            return var
        if (mode == "quotient" and a == k and type(x) is type(v) and 0 < x < v
                and v % x == 0):
            return f"${var}/{v // x}"
        return None

    def rename(nodes):
        return tuple(PNode(n.op, tuple((a, new_value(n, a, x) or x) for a, x in n.attrs),
                           n.inputs) for n in nodes)

    nodes = sub.source + sub.target
    if mode == "broad" and not any(new_value(n, a, x) and not (n.op == op and a == k)
                                   for n in nodes for a, x in n.attrs):
        return None
    if mode == "quotient" and not any(str(new_value(n, a, x)).startswith("$")
                                      for n in nodes for a, x in n.attrs):
        return None
    return Substitution(sub.name, sub.variables, rename(sub.source), rename(sub.target),
                        sub.outputs, sub.provenance)


def _validate_values(cand: Substitution, domain: Domain, instances: tuple, fixed: dict,
                     op: str, k: str, v, var: str, seed: int) -> list | None:
    """The values ``var`` holds at (``v`` first), or ``None`` if one fails or none is tried."""
    validated = [v]
    for alt in _alternatives(op, k, v):
        if not _survives_canon(cand, domain, {**fixed, var: alt}, op, k, alt):
            continue  # an alias of another value (axis 1 is axis -3 at rank 4)
        tried = False
        for j, inst in enumerate(instances):  # cheapest refutation first
            res = check_substitution(cand, domain, inst, seed + 17 * j, {**fixed, var: alt})
            if res is None:
                continue
            tried = True
            if not res:
                return None
        if tried:
            validated.append(alt)
    return validated if len(validated) > 1 else None


def _generalize_one(args):
    sub, domain, seed = args
    return generalize_attributes(sub, domain, seed)


def _generalize_all(subs: list[Substitution], domain: Domain, seed: int,
                    workers: int | None) -> list[Substitution]:
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    workers = workers or os.cpu_count() or 1
    jobs = [(s, domain, seed) for s in subs]
    if workers == 1 or len(subs) < 50:
        return [_generalize_one(j) for j in jobs]
    ctx = multiprocessing.get_context("spawn")  # JAX is threaded: never fork it
    with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        return list(pool.map(_generalize_one, jobs, chunksize=16))


def _commutative_form(t: Tensor, memo: dict | None = None) -> str:
    """An expression's text with the operands of commutative operators sorted."""
    memo = {} if memo is None else memo
    if t in memo:
        return memo[t]
    n = t.node
    if n.op in ("input", "weight"):
        out = n.name
    else:
        ins = [_commutative_form(x, memo) for x in n.inputs]
        if OPS[n.op].commutative:
            ins.sort()
        out = f"{n.op}{n.attrs}({','.join(ins)})[{t.index}]"
    memo[t] = out
    return out


def _candidates(domain, classes, sym_values, max_ops, seed, stats, monotone):
    prov = {"method": "fingerprint", "domain": domain.name, "max_ops": max_ops, "seed": seed,
            "proof": None}

    def valid(src: _Expr, tgt: _Expr) -> str | None:
        if not src.nodes:
            return "bare_variable_source"
        if not tgt.vars <= src.vars:
            return "target_uses_new_variable"
        if src.nodes & tgt.nodes:
            return "common_subgraph"
        if _commutative_form(src.tensor) == _commutative_form(tgt.tensor):
            return "commutation"  # the matcher already tries both operand orders
        if all(domain.variables[v][0] == "weight" for v in src.vars):
            return "weight_only"
        if monotone and _runtime_ops(tgt.nodes, domain) > _runtime_ops(src.nodes, domain):
            return "adds_runtime_operators"
        return None

    for cls in classes.values():
        # Pair every member with the class representative (its smallest expression), both
        # ways; a rule between two other members is the composition of two of these.
        rep = cls[0]
        pairs = [(m, rep) for m in cls[1:]] + [(rep, m) for m in cls[1:]]
        for src, tgt in pairs:
            stats.candidates += 1
            why = valid(src, tgt)
            if why:
                stats.pruned[why] += 1
                continue
            try:
                yield _make_sub(domain, [src.tensor], src.nodes, [tgt.tensor], tgt.nodes,
                                src.vars, sym_values, dict(prov))
            except ValueError:
                stats.pruned["symbolic_size"] += 1
        # Multi-output: concat(a, b) == t  gives  (a, b) => split(t).
        for c in cls:
            n = c.tensor.node
            if (n.op != "concat" or len(n.inputs) != 2 or n.inputs[0] == n.inputs[1]
                    or any(t.node.op in ("input", "weight") for t in n.inputs)):
                continue
            for t in cls[:1]:
                if t is c or t.tensor.node.op == "concat":
                    continue
                # Keep the split form only where it merges work: the target must run fewer
                # operators than the two sources (weight-only operators are free; the split
                # becomes slices that XLA fuses into their consumers).
                if _runtime_ops(t.nodes, domain) >= _runtime_ops(c.nodes - {n}, domain):
                    stats.pruned["split_gains_nothing"] += 1
                    continue
                stats.candidates += 1
                why = valid(c, t)
                if why:
                    stats.pruned[why] += 1
                    continue
                axis = n.attr("axis")
                sizes = tuple(x.shape[axis] for x in n.inputs)
                try:
                    split = make_node("split", [t.tensor], {"axis": axis, "sizes": sizes})
                    yield _make_sub(domain, list(n.inputs), c.nodes - {n}, list(split.outputs),
                                    t.nodes | {split}, c.vars, sym_values, dict(prov))
                except (ShapeError, ValueError):
                    stats.pruned["symbolic_size"] += 1


def _slice_merges(domain, classes, sym_values, fp, max_ops, seed, stats):
    """Two-output rules ``(a, b) => split(t)`` found by slicing ``t`` (``Domain.slice_merges``).

    Each class representative ``t`` that reads an input is cut in two along each split axis,
    at every pair of symbol sizes; when both parts are values of enumerated classes, their
    representatives ``a`` and ``b`` are a source that ``split(t)`` replaces. Kept only where
    it merges work: ``t`` runs fewer operators than ``a`` and ``b`` together, reads no
    variable they do not, and shares no operator with them. Sources with weight-only
    operators are dropped (a variable of the rule matches such a subgraph already), and of
    a merge and the same merge with its outputs swapped, only one is kept (the matcher
    finds the branches in either order).
    """
    prov = {"method": "fingerprint", "derivation": "slice", "domain": domain.name,
            "max_ops": max_ops, "seed": seed, "proof": None}
    reps = [cls[0] for cls in classes.values()]
    by_key = {k: cls[0] for k, cls in classes.items()}
    inputs = domain.input_names
    for t in reps:
        if not t.nodes or not (t.vars & inputs):
            continue
        value = fp.values[t.tensor]
        for axis in domain.split_axes:
            shape = t.tensor.shape
            if len(shape) < -axis:
                continue
            d = shape[axis]
            for size in sorted(sym_values):
                if not (0 < size < d and (d - size) in sym_values):
                    continue
                lo, hi = np.split(value, [size], axis=axis)
                a = by_key.get(fp.key_of(lo, t.tensor.dtype))
                b = by_key.get(fp.key_of(hi, t.tensor.dtype))
                if a is None or b is None or a is b or not a.nodes or not b.nodes:
                    continue
                stats.candidates += 1
                src_nodes = a.nodes | b.nodes
                if not (a.vars & inputs and b.vars & inputs):
                    why = "weight_only"
                elif sorted(a.vars) > sorted(b.vars):
                    why = "output_order"  # the same merge with the outputs swapped
                elif _runtime_ops(src_nodes, domain) < len(src_nodes):
                    why = "weight_only_subexpression"  # a variable matches it already
                elif a.nodes & b.nodes or t.nodes & (a.nodes | b.nodes):
                    why = "common_subgraph"
                elif not t.vars <= a.vars | b.vars:
                    why = "target_uses_new_variable"
                elif (sum(n.op in domain.merged_ops for n in t.nodes)
                      >= sum(n.op in domain.merged_ops for n in src_nodes)
                      if domain.merged_ops else
                      _runtime_ops(t.nodes, domain) >= len(src_nodes)):
                    why = "split_gains_nothing"
                else:
                    why = None
                if why:
                    stats.pruned[why] += 1
                    continue
                try:
                    split = make_node("split", [t.tensor], {"axis": axis,
                                                           "sizes": (size, d - size)})
                    yield _make_sub(domain, [a.tensor, b.tensor], a.nodes | b.nodes,
                                    list(split.outputs), t.nodes | {split}, a.vars | b.vars,
                                    sym_values, dict(prov))
                except (ShapeError, ValueError):
                    stats.pruned["symbolic_size"] += 1


def _domain_run(domain: Domain, max_ops: int, seed: int, progress: Callable | None,
                monotone: bool, workers: int | None
                ) -> tuple[list[tuple[str, Substitution | None]], GeneratorStats]:
    """One domain's generation: enumerate, pair, prune, re-check, generalise attributes.

    Returns ``(records, stats)``: a record per candidate that is not a renaming of an
    earlier one of this domain, in order, as ``(canonical key, substitution)``; the
    substitution is ``None`` when it failed the re-check on the domain's instances, and
    has its attributes generalised otherwise. Renamings across domains are left to the
    caller (:func:`generate`), which sees the domains in order.
    """
    stats = GeneratorStats()
    t0 = time.perf_counter()
    with _enable_x64():
        leaves, exprs, classes, sym_values, fp = _enumerate(domain, max_ops, seed, progress)
    stats.expressions += len(exprs) - len(leaves)
    stats.classes += len(classes)
    t1 = time.perf_counter()
    stats.seconds[f"{domain.name}: enumerate"] = round(t1 - t0, 2)
    cands = (list(_candidates(domain, classes, sym_values, max_ops, seed, stats, monotone))
             if domain.class_pairs else [])
    if domain.slice_merges:
        cands += _slice_merges(domain, classes, sym_values, fp, max_ops, seed, stats)
    records: list[tuple[str, Substitution | None]] = []
    seen: set[str] = set()
    for sub in cands:
        key = _canonical_key(sub, domain)
        if key in seen:
            stats.pruned["renaming_duplicate"] += 1
            continue
        seen.add(key)
        if not all(check_substitution(sub, domain, inst, seed + i + 1)
                   for i, inst in enumerate(domain.instances)):  # None fails too
            records.append((key, None))
            continue
        sub.provenance["checked_instances"] = [
            {k: list(v) if isinstance(v, tuple) else v for k, v in inst.items()}
            for inst in domain.instances]
        records.append((key, sub))
    stats.seconds[f"{domain.name}: pair+prune+check"] = round(time.perf_counter() - t1, 2)
    t2 = time.perf_counter()
    passed = [i for i, (_, sub) in enumerate(records) if sub is not None]
    general = _generalize_all([records[i][1] for i in passed], domain, seed, workers)
    for i, sub in zip(passed, general, strict=True):
        records[i] = (records[i][0], sub)
    stats.seconds[f"{domain.name}: generalize attributes"] = round(time.perf_counter() - t2, 2)
    return records, stats


def _domain_task(domain: Domain, max_ops: int, seed: int, monotone: bool
                 ) -> tuple[list[tuple[str, dict | None]], GeneratorStats]:
    """A cluster task: :func:`_domain_run` in a worker, substitutions as JSON."""
    records, stats = _domain_run(domain, max_ops, seed, None, monotone, workers=1)
    return [(key, None if sub is None else sub.to_json()) for key, sub in records], stats


def _cluster_domains(domains, max_ops: int, seed: int, monotone: bool, cluster: str,
                     workers: int | None, progress: Callable | None):
    """Yield ``(domain index, records, stats)`` as each domain's task finishes on Dask."""
    from taso_jax.verify.runner import dask_client

    with dask_client(cluster, workers or os.cpu_count() or 1) as client:
        # the largest domains first, so that no worker starts one last
        order = sorted(range(len(domains)), key=lambda i: -len(domains[i].ops) * (
            1 + len(domains[i].variables)) * domains[i].max_ops)
        futures = {client.submit(_domain_task, domains[i], max_ops, seed, monotone,
                                 pure=False): i for i in order}
        from dask.distributed import as_completed

        for future in as_completed(list(futures)):
            i = futures[future]
            records, stats = future.result()
            if progress:
                progress(f"{domains[i].name}: done on the cluster")
            yield i, [(key, None if d is None else Substitution.from_json(d))
                      for key, d in records], stats


def generate(domains=None, max_ops: int = 3, seed: int = 0,
             progress: Callable[[str], None] | None = None, monotone: bool = True,
             workers: int | None = None, cluster: str | None = None
             ) -> tuple[list[Substitution], GeneratorStats]:
    """Generate substitutions over ``domains`` with expressions of up to ``max_ops`` operators.

    Args:
        domains: variable pools and operator choices (:class:`Domain`); default
            :data:`DEFAULT_DOMAINS`.
        max_ops: size bound on each side, in operators (TASO used 4).
        seed: seed for fingerprints and re-checks; the output is deterministic for a seed.
        progress: called with a status line per stage.
        monotone: keep only substitutions whose target runs no more operators than the
            source (weight-only operators are free); the search's alpha relaxation then
            explores sideways moves, and the rule set stays small enough to match quickly.
        workers: processes for attribute generalisation (default: one per core; 1 runs
            in this process); with ``cluster="local"``, the cluster's worker processes.
        cluster: ``None`` (domains one after another, here), ``"local"`` (a Dask
            ``LocalCluster``) or a scheduler address (``tcp://host:8786``): each domain
            is then generated as one task on a worker (enumeration, fingerprints,
            pruning, re-check and attribute generalisation in one process). The result
            is the same as without a cluster: renamings across domains are pruned here,
            in domain order.

    Returns:
        The kept substitutions and the per-stage counts.

    Raises:
        RuntimeError: a cluster was asked for and Dask is not installed.
    """
    domains = DEFAULT_DOMAINS if domains is None else tuple(domains)
    stats = GeneratorStats()
    if cluster is None:
        runs = (_domain_run(d, max_ops, seed, progress, monotone, workers) for d in domains)
    else:
        done = {i: (records, st) for i, records, st in _cluster_domains(
            domains, max_ops, seed, monotone, cluster, workers, progress)}
        runs = (done[i] for i in range(len(domains)))
    kept: list[Substitution] = []
    seen: set[str] = set()
    for domain, (records, st) in zip(domains, runs, strict=True):
        stats.expressions += st.expressions
        stats.classes += st.classes
        stats.candidates += st.candidates
        stats.pruned.update(st.pruned)
        stats.seconds.update(st.seconds)
        for key, sub in records:
            if key in seen:
                stats.pruned["renaming_duplicate"] += 1
            elif sub is None:
                stats.pruned["failed_recheck"] += 1
            else:
                kept.append(sub)
            seen.add(key)
        if progress and cluster is None:
            progress(f"{domain.name}: {len(kept)} kept so far")
    # Generalising attributes can make two candidates one rule (found with activation=none
    # and with relu, both become ?activation): keep the first of each content id.
    first: dict[str, Substitution] = {}
    for s in kept:
        first.setdefault(s.id, s)
    unique = list(first.values())
    stats.pruned["duplicate after generalising attributes"] += len(kept) - len(unique)
    kept = name_rules([replace(s, provenance={**s.provenance, "generated_name": s.name})
                       for s in unique])
    stats.kept = len(kept)
    return kept, stats
