"""Prove substitutions from the operator axioms with Z3.

A substitution's source and target become terms over the shared encoding of
:mod:`taso_jax.verify.laws`: variables are ``Tensor`` constants, symbolic sizes (``"$D"``)
and attribute variables (``"?strides"``) are integer constants, and ``dim(v, i)`` is tied to
the symbolic shape of each variable. The solver is asked whether some output can differ
while every axiom holds; ``unsat`` is a proof, and the unsat core names the axioms it used
(TASO, Jia et al., SOSP 2019, Section 4).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import replace

from taso_jax.ops import ShapeError
from taso_jax.search.pattern import (
    AttrVar,
    NodeRef,
    PNode,
    SizeExpr,
    attr_from_json,
    is_symbolic,
    resolve_attr,
)
from taso_jax.search.rules import Substitution
from taso_jax.verify.laws import Z3Encoding, all_axioms, law_operators

__all__ = ["Prover", "bind_attributes", "CORE_OPERATORS", "DEFAULT_RLIMIT"]

#: Z3 resource limit per proof attempt (see :class:`Prover`).
DEFAULT_RLIMIT = 2_000_000

#: Operators whose laws any proof may need, whatever the rule's own operators: TASO's
#: families (Jia et al., SOSP 2019, Table 3) and the activations fused into matmul and conv2d.
CORE_OPERATORS = frozenset({"ewadd", "ewmul", "scalar_mul", "matmul", "conv2d", "concat",
                            "split", "transpose", "enlarge", "relu", "sigmoid", "tanh"})


class Prover:
    """Holds the encoded axioms; :meth:`prove` checks one substitution.

    Args:
        axioms: ``(name, Axiom)`` pairs; defaults to every declared axiom.
        rlimit: Z3 resource limit per proof attempt (``rlimit``: a count of solver steps,
            the same on any machine under any load); past it the attempt is ``unknown``.
            The default is about 100 times what the hardest proof of the shipped set took
            (20,894 in a sample of 246 proved attempts; the attempts that end ``unknown``
            burn 1-3 million).
        timeout_ms: an optional wall-clock limit per attempt, in milliseconds; off by
            default, since a status that depends on the machine's load is not repeatable.
        max_instances: most attribute-value combinations proved one by one (see
            :meth:`prove`).
        max_quantifier_instances: Z3 quantifier instantiations per attempt at most
            (``smt.qi.max_instances``); past it the attempt ends as ``unknown``, and the
            resource limit bounds the attempts that fail. A status should not depend on
            what the process proved before; a rule that re-proves only in some processes
            is dropped from the shipped set (docs/generator_and_verifier.md).
    """

    def __init__(self, axioms=None, rlimit: int | None = None, timeout_ms: int | None = None,
                 max_instances: int = 16, max_quantifier_instances: int = 200_000):
        self.enc = Z3Encoding()
        # Z3 does not always honour a time limit while instantiating quantifiers (a rule that
        # needs an absent law ran 80 s under a 1 s limit); the resource limit and a cap on
        # instantiations bound every attempt. This is a process-wide Z3 setting.
        self.enc.z3.set_param("smt.qi.max_instances", max_quantifier_instances)
        self.rlimit = DEFAULT_RLIMIT if rlimit is None else int(rlimit)
        self.timeout_ms = timeout_ms
        self.max_instances = max_instances
        axioms = all_axioms() if axioms is None else axioms
        self.formulas = [(f"{name}: {ax.law}", self.enc.formula(ax, name))
                         for name, ax in axioms]
        self._operators = [law_operators(ax) for _, ax in axioms]

    def _size(self, size: int | str | SizeExpr, ints: dict, guards: list):
        """A size as a Z3 integer: a constant, a shape symbol, or a size expression.

        A quotient term ``?groups/2`` becomes a fresh integer ``q`` with the guard
        ``2 q = ?groups``: the matcher applies the rule only where the division is exact.
        """
        z3 = self.enc.z3
        if isinstance(size, int):
            return z3.IntVal(size)
        if isinstance(size, str):
            return ints.setdefault(size, z3.Int(size))
        terms = []
        for term in size.terms:
            t = ints.setdefault(term.symbol, z3.Int(term.symbol))
            if term.divisor != 1:
                q = z3.Int(str(term))
                guards.append(q * term.divisor == t)
                t = q
            terms.append(t)
        return sum(terms[1:], terms[0])

    def _attr(self, value, ints: dict, guards: list):
        if isinstance(value, SizeExpr):
            return self._size(value, ints, guards)
        if isinstance(value, AttrVar):
            return ints.setdefault(value.name, self.enc.z3.Int(value.name))
        if isinstance(value, tuple) and is_symbolic(value):
            return self.enc.attr_tuple([self._attr(v, ints, guards) for v in value])
        return self.enc.attr(value)

    def _side(self, nodes, env: dict, ints: dict, guards: list):
        """A function ``reference -> Z3 term`` for one side's pattern."""
        built: dict = {}

        def term(r):
            if not isinstance(r, NodeRef):
                return env[r.name]
            if r not in built:
                n = nodes[r.node]
                ins = [term(x) for x in n.inputs]
                attrs = {a: self._attr(v, ints, guards) for a, v in n.attrs}
                built[r] = self.enc.apply(n.op, ins, attrs, r.output)
            return built[r]

        return term

    def prove(self, sub: Substitution) -> dict:
        """``{"status": "proved" | "unproved" | "unknown", "axioms": [...], "seconds"}``.

        ``unproved``: Z3 found that the axioms allow the sides to differ (a wrong or
        unprovable rule); ``unknown``: no answer within the resource limit.

        A rule with attribute variables (``"?axis"``) is first proved for every value. If
        that fails and its provenance lists the values it was generated and checked at
        (``attribute_values``), each combination of those values is proved on its own (at
        most ``max_instances``, stopping at the first failure); the result then carries
        ``"instances"``, the combinations proved, and the matcher applies the rule only at
        those.

        All of that is tried first with the rule's near axioms (:meth:`_near_axioms`) and,
        where it does not prove the rule, again with every axiom. A proof from fewer axioms
        is a proof from all of them, so this changes how fast a status comes, not which:
        only an ``unknown`` with every axiom could become ``proved``.
        """
        t0 = time.perf_counter()
        near = self._near_axioms(sub)
        if near is not None:
            result = self._prove(sub, near)
            if result["status"] == "proved":
                return {**result, "seconds": round(time.perf_counter() - t0, 3)}
        return {**self._prove(sub, None), "seconds": round(time.perf_counter() - t0, 3)}

    def _near_axioms(self, sub: Substitution) -> list[int] | None:
        """Indices of the axioms a proof of ``sub`` is tried with first, or ``None``.

        Those whose operators are all the rule's own or TASO's families
        (:data:`CORE_OPERATORS`). Every axiom asserted makes each solver step dearer and
        gives the quantifier instantiation more to try: with the recurrent, quantized,
        norm and attention laws in the registry a convolution rule took 64 s against 11 s
        with its near axioms. ``None`` where that leaves every axiom in.
        """
        ops = {n.op for n in (*sub.source, *sub.target)} | CORE_OPERATORS
        near = [k for k, used in enumerate(self._operators) if used <= ops]
        return near if len(near) < len(self.formulas) else None

    def _prove(self, sub: Substitution, axioms: list[int] | None) -> dict:
        """:meth:`prove` with the axioms of these indices (``None``: all), untimed."""
        first = self._prove_one(sub, axioms)
        values = {k: v for k, v in (sub.provenance.get("attribute_values") or {}).items()
                  if k in sub.attribute_variables}
        if first["status"] == "proved" or not values:
            return first
        result = first
        # The fused activation and the axis decide which law applies; strides, padding and
        # dilation usually carry through symbolically. So bind those two first, then all.
        staged = {k: v for k, v in values.items() if k in _SELECTORS}
        for stage in ([staged] if staged and len(staged) < len(values) else []) + [values]:
            result = self._prove_instances(sub, stage, axioms)
            if result["status"] == "proved":
                break
        return result

    def _prove_instances(self, sub: Substitution, values: dict,
                         axioms: list[int] | None = None) -> dict:
        combos = list(itertools.product(*values.values()))
        if len(combos) > self.max_instances:
            return {"status": "unknown", "axioms": [],
                    "failed_instance": f"{len(combos)} attribute combinations"}
        used: set = set()
        instances = []
        for combo in combos:
            assignment = dict(zip(values, combo, strict=True))
            r = self._prove_one(bind_attributes(sub, assignment), axioms)
            if r["status"] != "proved":
                return {"status": r["status"], "axioms": [], "failed_instance": assignment}
            used.update(r["axioms"])
            instances.append(assignment)
        return {"status": "proved", "axioms": sorted(used), "instances": instances}

    def _prove_one(self, sub: Substitution, axioms: list[int] | None = None) -> dict:
        z3 = self.enc.z3
        env = {v: z3.Const(v, self.enc.T) for v, _ in sub.variables}
        ints: dict = {}
        guards: list = []  # exact divisions, gathered while the sides are built
        facts = []
        for v, shape in sub.variables:
            shape = [d for d in shape if d != "..."]
            for i, d in enumerate(shape):
                size = self._size(d, ints, guards)
                facts.append(self.enc.dim(env[v], z3.IntVal(i - len(shape))) == size)
                facts.append(size > 0)
        src = self._side(sub.source, env, ints, guards)
        tgt = self._side(sub.target, env, ints, guards)
        differ = z3.Or(*[src(s) != tgt(t) for s, t in sub.outputs])
        facts += guards
        solver = z3.Solver()
        solver.set(rlimit=self.rlimit)
        if self.timeout_ms:
            solver.set(timeout=self.timeout_ms)
        for k in range(len(self.formulas)) if axioms is None else axioms:
            name, f = self.formulas[k]
            solver.assert_and_track(f, name)
        solver.add(*facts)
        solver.add(differ)
        r = solver.check()
        status = "proved" if r == z3.unsat else "unproved" if r == z3.sat else "unknown"
        used = sorted(str(c) for c in solver.unsat_core()) if r == z3.unsat else []
        return {"status": status, "axioms": used}


_SELECTORS = ("?activation", "?axis")


def bind_attributes(sub: Substitution, assignment: dict) -> Substitution:
    """``sub`` with attribute variables replaced by values (JSON lists become tuples).

    ``assignment`` maps ``"?name"`` to a value, e.g. ``{"?axis": -1}``.
    """
    values = {k: attr_from_json(x) for k, x in assignment.items()}

    def value(v):
        if isinstance(v, AttrVar) and v.name in values:
            return values[v.name]
        if isinstance(v, SizeExpr) and all(name in values for name in v.symbols):
            try:  # ?groups/2 with ?groups bound
                return resolve_attr(v, values)
            except ShapeError:  # not exact at this value: left symbolic
                return v
        return v

    def bind(nodes):
        return tuple(PNode(n.op, tuple((k, value(v)) for k, v in n.attrs), n.inputs)
                     for n in nodes)

    return replace(sub, source=bind(sub.source), target=bind(sub.target))
