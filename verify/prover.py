"""Prove substitutions from the operator axioms with Z3.

A substitution's source and target become terms over the shared encoding of
:mod:`taso_jax.verify.laws`: variables are ``Tensor`` constants, symbolic sizes (``"$D"``)
and attribute variables (``"?strides"``) are integer constants, and ``dim(v, i)`` is tied to
the symbolic shape of each variable. The solver is asked whether some output can differ
while every axiom holds; ``unsat`` is a proof, and the unsat core names the axioms it used
(TASO, Jia et al., SOSP 2019, Section 4).
"""

from __future__ import annotations

import time

from taso_jax.verify.laws import Z3Encoding, all_axioms

from taso_jax.substitution import Substitution, _ref

__all__ = ["Prover"]


class Prover:
    """Holds the encoded axioms; :meth:`prove` checks one substitution.

    Args:
        axioms: ``(name, Axiom)`` pairs; defaults to every declared axiom.
        timeout_ms: Z3 time limit per substitution, in milliseconds.
    """

    def __init__(self, axioms=None, timeout_ms: int = 2000):
        self.enc = Z3Encoding()
        self.timeout_ms = timeout_ms
        axioms = all_axioms() if axioms is None else axioms
        self.formulas = [(f"{name}: {ax.law}", self.enc.formula(ax, name))
                         for name, ax in axioms]

    def _size(self, token, ints: dict):
        z3 = self.enc.z3
        if isinstance(token, int):
            return z3.IntVal(token)
        name = str(token).lstrip("$")
        terms = [ints.setdefault(p, z3.Int(p)) for p in name.split("+")]
        return sum(terms[1:], terms[0])

    def _attr(self, value, ints: dict):
        if isinstance(value, str) and value.startswith("$"):
            return self._size(value, ints)
        if isinstance(value, str) and value.startswith("?"):
            return ints.setdefault(value, self.enc.z3.Int(value))
        if isinstance(value, tuple) and any(isinstance(v, str) and v[:1] in "$?"
                                            for v in value):
            return self.enc.attr_tuple([self._attr(v, ints) for v in value])
        return self.enc.attr(value)

    def _side(self, nodes, env: dict, ints: dict):
        """A function ``(node index, output index) -> Z3 term`` for one side's pattern."""
        built: dict = {}

        def ref(r: str):
            p = _ref(r)
            return env[r] if p is None else term(*p)

        def term(i: int, k: int):
            if (i, k) not in built:
                n = nodes[i]
                ins = [ref(r) for r in n.inputs]
                attrs = {a: self._attr(v, ints) for a, v in n.attrs}
                built[(i, k)] = self.enc.apply(n.op, ins, attrs, k)
            return built[(i, k)]

        return term

    def prove(self, sub: Substitution) -> dict:
        """``{"status": "proved" | "unproved" | "unknown", "axioms": [...], "seconds"}``.

        ``unproved``: Z3 found that the axioms allow the sides to differ (a wrong or
        unprovable rule); ``unknown``: no answer within the time limit.
        """
        z3 = self.enc.z3
        t0 = time.perf_counter()
        env = {v: z3.Const(v, self.enc.T) for v, _ in sub.variables}
        ints: dict = {}
        facts = []
        for v, shape in sub.variables:
            shape = [d for d in shape if d != "..."]
            for i, d in enumerate(shape):
                size = self._size(d, ints)
                facts.append(self.enc.dim(env[v], z3.IntVal(i - len(shape))) == size)
                facts.append(size > 0)
        src = self._side(sub.source, env, ints)
        tgt = self._side(sub.target, env, ints)

        def out(term, r):
            p = _ref(r)
            return env[r] if p is None else term(*p)

        differ = z3.Or(*[out(src, s) != out(tgt, t) for s, t in sub.outputs])
        solver = z3.Solver()
        solver.set(timeout=self.timeout_ms)
        for name, f in self.formulas:
            solver.assert_and_track(f, name)
        solver.add(*facts)
        solver.add(differ)
        r = solver.check()
        status = "proved" if r == z3.unsat else "unproved" if r == z3.sat else "unknown"
        used = sorted(str(c) for c in solver.unsat_core()) if r == z3.unsat else []
        return {"status": status, "axioms": used,
                "seconds": round(time.perf_counter() - t0, 3)}
