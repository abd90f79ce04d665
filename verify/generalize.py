"""Numeric re-check of a candidate substitution, and generalisation of its attributes (stage 5).

:func:`check_substitution` builds a substitution's source on one shape instance of its domain,
rewrites it with the matcher and compares both graphs on random float64 inputs: the re-check
that every candidate passes on each domain instance. :func:`generalize_attributes` then turns
attribute values that the law does not depend on into attribute variables (``?groups``,
``?strides``), keeping a variable only where the rule re-checks at every alternative value
the operators' examples offer; :func:`_generalize_all` runs it over many candidates in worker
processes.
"""

from __future__ import annotations

import numpy as np
from taso_jax.ops import OPS, ShapeError, TensorType
from taso_jax.search.match import MatchState, apply, find_matches, instantiate
from taso_jax.search.pattern import AttrVar, PNode, attr_to_json, is_symbolic
from taso_jax.search.rules import Substitution
from taso_jax.verify._enumeration import _enable_x64, _instance_shape
from taso_jax.verify.domains import Domain

from taso_jax.ir.executor import evaluate
from taso_jax.ir.graph import Graph, Tensor, leaf_node

__all__ = ["check_substitution", "generalize_attributes"]


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
