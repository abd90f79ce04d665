"""Rules read off operator laws, for rewrites longer than the generator enumerates.

The generator finds rules by enumerating graphs of at most four operators. A fused
operator's definition can be longer: ``attention(q, kt, v)`` is
``matmul(softmax(matmul(q, kt)), v)``, five operators with a mask and a scale. An axiom
declared with ``derive="rtl"`` (or ``"ltr"``) yields the rule that rewrites its right side
into its left (or the reverse). The rule is an ordinary :class:`Substitution`: the prover
proves it from the axioms like any generated rule, and it ships in the same rule file.

How a law becomes a rule:

* each operator call of a side becomes a pattern node, in evaluation order, equal calls once;
* a tensor variable keeps its symbolic shape (a leading ``"..."``, any leading dimensions,
  binds the same dimensions in every variable that has it);
* a law between two calls of operators of ``n`` outputs (``lstm(...) = lstm_scan(...)``)
  pairs each output of the source with the same output of the target;
* an attribute variable that appears on the source side becomes an attribute variable of
  the rule (``"?f"``); one that appears only on the target side is a choice, and each of its
  values in the axiom's ``params`` gives a rule of its own (``impl="blocked", block=256``).

Source: TASO (Jia et al., SOSP 2019, Section 4) for rules as proved graph equalities.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterable

from taso_jax.ops import OPS, Axiom
from taso_jax.search.rules import Substitution
from taso_jax.verify.laws import AxiomError, _parse, all_laws, law_outputs

__all__ = ["rules_from_law", "derived_rules", "ship_derived_rules", "NOT_SHIPPED"]


def _literal(node: ast.expr, where: str):
    """A constant attribute value written in a law (``-1``, ``True``, ``'blocked'``)."""
    try:
        value = ast.literal_eval(node)
    except ValueError:
        raise AxiomError(f"{where}: attribute {ast.dump(node)[:60]} is neither a constant "
                         "nor a variable") from None
    return list(value) if isinstance(value, tuple) else value  # rule files hold lists


class _Side:
    """One side of a law as pattern nodes (rule-file JSON form)."""

    def __init__(self, tensors: set[str], bound: dict, where: str):
        self.nodes: list[dict] = []
        self.tensors = tensors
        self.bound = bound  # attribute variable -> "?name" or a chosen value
        self.where = where
        self.used: set[str] = set()

    def ref(self, node: ast.expr) -> str:
        if isinstance(node, ast.Name):
            if node.id not in self.tensors:
                raise AxiomError(f"{self.where}: {node.id!r} is not a tensor variable")
            self.used.add(node.id)
            return node.id
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in OPS):
            raise AxiomError(f"{self.where}: a derived rule takes operator calls and "
                             f"variables only, not {ast.dump(node)[:60]}")
        ins = [self.ref(a) for a in node.args]
        attrs = {}
        for kw in node.keywords:
            if isinstance(kw.value, ast.Name):
                attrs[kw.arg] = self.bound[kw.value.id]
            else:
                attrs[kw.arg] = _literal(kw.value, self.where)
        entry = {"op": node.func.id, "attrs": attrs, "inputs": ins}
        if entry not in self.nodes:
            self.nodes.append(entry)
        return f"#{self.nodes.index(entry)}"


def _attribute_names(node: ast.expr) -> set[str]:
    return {kw.value.id for n in ast.walk(node) if isinstance(n, ast.Call)
            for kw in n.keywords if isinstance(kw.value, ast.Name)}


def rules_from_law(name: str, ax: Axiom) -> list[Substitution]:
    """The unproved rules that ``ax`` derives (see the module doc); ``[]`` if none.

    Raises:
        AxiomError: the law has a form a rule cannot take (a size expression, a ``where``).
    """
    if not ax.derive:
        return []
    where = f"{name}: {ax.law}"
    if ax.where:
        raise AxiomError(f"{where}: a derived rule cannot carry size conditions")
    lhs, rhs = (_parse(t, where) for t in ax.sides)
    n_out = law_outputs(ax, where)  # a law between multi-output calls pairs every output
    source, target = (rhs, lhs) if ax.derive == "rtl" else (lhs, rhs)
    params = dict(ax.params)
    matched = _attribute_names(source)
    text = ax.sides[0] if ax.derive == "rtl" else ax.sides[1]
    chosen = sorted(_attribute_names(target) - matched, key=lambda c: text.find(f"={c}"))
    shapes = {v: list(shape) for v, shape in ax.shapes}
    rules = []
    for values in itertools.product(*(params[c] for c in chosen)):
        bound = {p: f"?{p}" for p in matched} | dict(zip(chosen, values, strict=True))
        src, tgt = _Side(set(shapes), bound, where), _Side(set(shapes), bound, where)
        out_src, out_tgt = src.ref(source), tgt.ref(target)
        if not tgt.used <= src.used:
            raise AxiomError(f"{where}: the target reads variables the source does not bind")
        op = (lhs if ax.derive == "rtl" else rhs).func.id
        if ax.derive == "rtl":
            ops = dict.fromkeys(n["op"] for n in src.nodes)
            label = f"{op}-from-" + "-".join(ops)
        else:
            label = "-".join(["lower", op, *(str(v) for v in values)])
        data = {"name": label,
                "variables": {v: shapes[v] for v in sorted(src.used)},
                "source": src.nodes, "target": tgt.nodes,
                "outputs": [[out_src, out_tgt]] if n_out == 1 else
                           [[out_src, out_tgt]] + [[f"{out_src}.{i}", f"{out_tgt}.{i}"]
                                                      for i in range(1, n_out)],
                "provenance": {"method": "law", "domain": "laws", "law": f"{name}: {ax.law}",
                               "proof": None}}
        rules.append(Substitution.from_json(data))
    return rules


def derived_rules(axioms: Iterable[tuple[str, Axiom]] | None = None) -> list[Substitution]:
    """Every rule derived from the declared laws (axioms and theorems), unproved.

    Rules are named after the law's operators, and numbered where two would share a name.

    Raises:
        AxiomError: a law marked ``derive`` that no rule can express.
    """
    rules: list[Substitution] = []
    seen: dict[str, int] = {}
    for name, ax in all_laws() if axioms is None else axioms:
        for rule in rules_from_law(name, ax):
            n = seen[rule.name] = seen.get(rule.name, 0) + 1
            if n > 1:
                rule = Substitution(f"{rule.name}-{n}", rule.variables, rule.source,
                                    rule.target, rule.outputs, rule.provenance)
            rules.append(rule)
    return rules


#: Name prefixes of derived rules that are not shipped: the hoisted recurrence has no ONNX
#: form that keeps its gain (ddddocr's recogniser written 0.52x in onnxruntime and 0.58x
#: re-imported under jax.jit, though 1.44x in the IR). The laws stay; tests derive them.
NOT_SHIPPED = ("lower-lstm_scan", "lower-gru_scan")


def ship_derived_rules(path, note: str = "") -> list[str]:
    """Prove the derived rules that the rule file at ``path`` lacks and put them first.

    The rules already in the file keep their order, after the new ones (the greedy descent
    takes the first rewrite that pays, and a derived rule's source contains shorter
    generated ones). A rule that does not prove is left out, and so are those named by
    :data:`NOT_SHIPPED`. The file's generator settings record the addition under
    ``"derived_<n>"``, with ``note``. Returns the names added.

    Raises:
        OSError: the file cannot be read or written.
        ValueError: not a rule file (:func:`taso_jax.search.rules.load_substitutions`).
    """
    import datetime
    import json
    import time

    from taso_jax.search.rules import load_substitutions, save_substitutions
    from taso_jax.verify.runner import verify_substitutions

    with open(path, encoding="utf-8") as f:
        settings = json.load(f).get("generator", {})
    rules = load_substitutions(path)
    have = {r.id for r in rules}
    new = [r for r in derived_rules()
           if r.id not in have and not r.name.startswith(NOT_SHIPPED)]
    start = time.monotonic()
    stamped, _stats = verify_substitutions(new, workers=1) if new else ([], {})
    proved = [r for r in stamped if r.proof_status == "proved"]
    n = sum(k.startswith("derived") for k in settings) + 1
    settings[f"derived_{n}"] = {
        "method": "law", "added": len(proved), "not_proved": len(stamped) - len(proved),
        "seconds": round(time.monotonic() - start, 1),
        "date": datetime.date.today().isoformat(), "note": note,
        "command": f"python -m taso_jax.verify.from_laws {path} (1 worker)"}
    save_substitutions(proved + rules, path, settings)
    return [r.name for r in proved]


if __name__ == "__main__":
    import sys

    print("\n".join(ship_derived_rules(sys.argv[1], " ".join(sys.argv[2:]))))
