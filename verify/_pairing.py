"""Pairing of fingerprint classes into candidate substitutions, and pruning (stages 3 and 4).

:func:`_candidates` pairs the members of each fingerprint class with its representative (both
directions) and derives two-output rules ``(a, b) => split(t)`` from ``concat`` members;
:func:`_slice_merges` derives such rules by slicing a class's value instead. Both prune
candidates that cannot help (a target with new variables, a shared subgraph, a mere
commutation, a weight-only source, more runtime operators) and count why in the run's
statistics. :func:`_make_sub` turns a pair of expressions into a
:class:`~taso_jax.search.rules.Substitution` with symbolic sizes, and :func:`_canonical_key`
names it up to renaming of interchangeable variables, for duplicate removal.
"""

from __future__ import annotations

import itertools

import numpy as np
from taso_jax.ops import OPS, ShapeError
from taso_jax.search.pattern import PNode, attr_to_json
from taso_jax.search.rules import Substitution
from taso_jax.verify._enumeration import _Expr
from taso_jax.verify.domains import Domain

from taso_jax.ir.graph import Node, Tensor, make_node, topo_order


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
