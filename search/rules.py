"""Graph substitutions as readable data: the rule record and rule files.

A substitution has a *source* pattern and a *target* pattern over named variables with
symbolic shapes (``["N", "C", "H", "W"]``, ``["D", "C", 1, 1]``; a leading ``"..."`` stands
for any leading dimensions), and pairs each source output with the target tensor that
replaces it. Attribute values of the form ``"$D"`` or ``"$D+C"`` are sizes taken from the
symbols bound at match time (split sizes), so a substitution found on small shapes applies to
every shape that unifies with its variables. An attribute value ``"?name"`` is an attribute
variable: it matches any value, the same value wherever it appears, and the target reuses it.

The strings of the pattern language are parsed once, into the values of
:mod:`taso_jax.search.pattern`; matching lives in :mod:`taso_jax.search.match`.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from taso_jax.ops import OPS
from taso_jax.search._rule_check import RuleFileError, check_rule_json, check_rule_structure
from taso_jax.search.pattern import (
    AttrVar,
    NodeRef,
    PNode,
    Ref,
    SizeExpr,
    attr_from_json,
    attr_to_json,
    parse_ref,
)

from taso_jax._io import atomic_write

__all__ = ["PNode", "Substitution", "RuleFileError", "load_substitutions", "save_substitutions",
           "default_substitutions", "name_rules", "readable_name", "FORMAT_VERSION"]

FORMAT_VERSION = 1


@dataclass(frozen=True)
class Substitution:
    """A verified-or-not rewrite rule ``source => target``.

    Attributes:
        name: a readable name: the law's name when written by hand (``conv_bn_fold``),
            else one derived from the law (:func:`readable_name`, e.g.
            ``merge-conv2d-conv2d``). The search reports rules by name.
        variables: ``(name, shape pattern)`` pairs.
        source, target: pattern nodes in topological order.
        outputs: ``(source ref, target ref)`` pairs; each source output is replaced.
        provenance: how it was found (generator settings, fingerprint), and ``proof``
            (``None`` until the verifier stamps it).
    """

    name: str
    variables: tuple[tuple[str, tuple], ...]
    source: tuple[PNode, ...]
    target: tuple[PNode, ...]
    outputs: tuple[tuple[Ref, Ref], ...]
    provenance: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        # References given as strings ("#1.1", "x") are parsed once, here.
        object.__setattr__(self, "outputs", tuple((parse_ref(s), parse_ref(t))
                                                  for s, t in self.outputs))

    # ---- readable form -------------------------------------------------------------------
    def expr(self, side: str, ref: Ref | str) -> str:
        """Expression string of one reference of one side (``"source"`` or ``"target"``)."""
        nodes = self.source if side == "source" else self.target
        r = parse_ref(ref)
        if not isinstance(r, NodeRef):
            return r.name
        n = nodes[r.node]
        args = [self.expr(side, x) for x in n.inputs]
        defaults = OPS[n.op].attrs
        args += [f"{k}={_fmt(v)}" for k, v in n.attrs if defaults.get(k) != v]
        s = f"{n.op}({', '.join(args)})"
        return s + (f"[{r.output}]" if r.node in self._multi_output(side) else "")

    def _multi_output(self, side: str) -> set[int]:
        """Nodes of one side some of whose outputs other than 0 are read."""
        nodes = self.source if side == "source" else self.target
        refs = [x for n in nodes for x in n.inputs]
        refs += [s if side == "source" else t for s, t in self.outputs]
        return {x.node for x in refs if isinstance(x, NodeRef) and x.output}

    @property
    def law(self) -> str:
        """``source outputs => target outputs`` as expressions."""
        src = ", ".join(self.expr("source", s) for s, _ in self.outputs)
        tgt = ", ".join(self.expr("target", t) for _, t in self.outputs)
        return f"{src}  =>  {tgt}"

    @cached_property
    def id(self) -> str:
        """A stable identity derived from the rule's content alone: ``r`` and 12 hex digits.

        It hashes the variables, both patterns and the output pairs in their rule-file form,
        so it does not depend on the name, the provenance, or the order of generation.
        """
        text = json.dumps(self._content(), sort_keys=True, separators=(",", ":"))
        return "r" + hashlib.sha256(text.encode()).hexdigest()[:12]

    @cached_property
    def variable_shapes(self) -> dict[str, tuple]:
        """Variable name -> shape pattern (the matcher reads it for every candidate)."""
        return dict(self.variables)

    @cached_property
    def source_output_refs(self) -> frozenset[NodeRef]:
        """The source tensors that the rule replaces."""
        return frozenset(s for s, _ in self.outputs)

    @cached_property
    def attribute_variables(self) -> frozenset[str]:
        """Names of the attribute variables on either side (``"?groups"``)."""
        names: set[str] = set()

        def visit(v):
            if isinstance(v, AttrVar):
                names.add(v.name)
            elif isinstance(v, SizeExpr):
                names.update(x for x in v.symbols if x.startswith("?"))
            elif isinstance(v, tuple):
                for x in v:
                    visit(x)

        for n in self.source + self.target:
            for _, v in n.attrs:
                visit(v)
        return frozenset(names)

    def _content(self) -> dict:
        """What the rule is, in its rule-file form: variables, both patterns, outputs."""
        def nodes(ns):
            return [{"op": n.op, "attrs": {k: attr_to_json(v) for k, v in n.attrs},
                     "inputs": [str(r) for r in n.inputs]} for n in ns]
        return {"variables": {k: list(v) for k, v in self.variables},
                "source": nodes(self.source), "target": nodes(self.target),
                "outputs": [[str(s), str(t)] for s, t in self.outputs]}

    def to_json(self) -> dict:
        """JSON-ready dict: the rule-file form (strings for references and symbols)."""
        return {"id": self.id, "name": self.name, "law": self.law, **self._content(),
                "provenance": self.provenance}

    @staticmethod
    def from_json(d: dict, where: str = "substitution") -> Substitution:
        """Inverse of :meth:`to_json`; ``where`` names the rule in errors.

        Raises:
            RuleFileError: malformed data (:mod:`taso_jax.search._rule_check`: wrong types,
                numbers past int64, references that do not form a graph).
            ValueError: an unknown attribute, or an ``id`` that does not match the rule's
                content (the rule was edited by hand: remove its ``id`` or regenerate the
                file).
        """
        check_rule_json(d, where)  # types, numbers and operators; then the references

        def nodes(ns):
            out = []
            for n in ns:
                out.append(PNode(n["op"], OPS[n["op"]].normalize_attrs(
                    {k: attr_from_json(v) for k, v in n["attrs"].items()}), tuple(n["inputs"])))
            return tuple(out)
        try:
            sub = Substitution(d["name"], tuple((k, tuple(v)) for k, v in d["variables"].items()),
                               nodes(d["source"]), nodes(d["target"]),
                               tuple(tuple(p) for p in d["outputs"]),
                               dict(d.get("provenance", {})))
        except RuleFileError:
            raise
        except ValueError as e:  # an unknown attribute, a malformed reference or size
            raise RuleFileError(f"{where} ({d['name'][:60]!r}): {e}") from None
        check_rule_structure(sub, where)
        if "id" in d and d["id"] != sub.id:
            raise ValueError(f"{where} ({d['name']}): id {d['id']} does not match its "
                             f"content ({sub.id}); it was edited: remove the id or regenerate")
        return sub

    # ---- proof status --------------------------------------------------------------------
    @property
    def proof_status(self) -> str:
        """The verifier's verdict: proved, unproved, unknown, or unverified (never run)."""
        proof = self.provenance.get("proof")
        return proof.get("status", "unverified") if isinstance(proof, dict) else "unverified"

    @cached_property
    def proved_instances(self) -> tuple[dict, ...] | None:
        """Attribute-variable values at which the rule is proved, if only at some.

        E.g. ``({"?axis": -1}, {"?axis": -2})``; ``None`` when it holds for every value.
        The matcher accepts only bindings that agree with one of them.
        """
        proof = self.provenance.get("proof")
        inst = proof.get("instances") if isinstance(proof, dict) else None
        if inst is None:
            return None
        return tuple({k: attr_from_json(v) for k, v in a.items()} for a in inst)


def readable_name(sub: Substitution) -> str:
    """A name derived from the rule's law: a verb, then the source's operators.

    The verb says what the rule does to the operators that run: ``cancel`` (the target is
    one of the variables: ``split(concat(a, b)) => a``), ``reorder`` (the same operators in
    another order), ``merge`` (operators of one kind become one, their outputs split:
    TASO's convolution and matmul merges), ``factor`` (operators of one kind become fewer
    without a split: ``x@a + x@b => x@(a+b)``), ``fuse`` (fewer operators), ``expand``
    (more operators: usually work moved onto weights, where it is done ahead of time),
    else ``rewrite``. E.g. ``merge-conv2d-conv2d``, ``fuse-conv2d-ewmul``. Names are not
    unique; :func:`name_rules` numbers those that coincide.
    """
    src = Counter(n.op for n in sub.source)
    tgt = Counter(n.op for n in sub.target)
    fewer = [op for op, k in src.items() if k >= 2 and tgt[op] < k]
    if not sub.target:
        verb = "cancel"
    elif src == tgt:
        verb = "reorder"
    elif fewer and "split" in tgt:
        verb = "merge"
    elif fewer:
        verb = "factor"
    elif sum(tgt.values()) < sum(src.values()):
        verb = "fuse"
    elif sum(tgt.values()) > sum(src.values()):
        verb = "expand"
    else:
        verb = "rewrite"
    return "-".join([verb, *(n.op for n in sub.source)])


def name_rules(subs: list[Substitution]) -> list[Substitution]:
    """``subs`` with readable names (:func:`readable_name`), unique within the list.

    Rules whose names coincide are numbered ``-2``, ``-3``... in the order of their
    :attr:`Substitution.id`, so a rule's name depends on the set, never on the order of
    generation. The list's order is kept.
    """
    base = {s.id: readable_name(s) for s in subs}
    groups: dict[str, list[str]] = {}
    for rid in sorted(base):
        groups.setdefault(base[rid], []).append(rid)
    final = {rid: name if k == 0 else f"{name}-{k + 1}"
             for name, ids in groups.items() for k, rid in enumerate(ids)}
    return [replace(s, name=final[s.id]) for s in subs]


def _fmt(v: Any) -> str:
    """An attribute value as a law shows it (a tuple as a list, symbols as written)."""
    return str(list(_plain(v))) if isinstance(v, tuple) else str(_plain(v))


def _plain(v: Any) -> Any:
    if isinstance(v, AttrVar | SizeExpr):
        return str(v)
    return tuple(_plain(x) for x in v) if isinstance(v, tuple) else v


def save_substitutions(subs: list[Substitution], path, settings: dict | None = None) -> None:
    """Write substitutions as versioned JSON, atomically (temporary file then rename)."""
    doc = {"format": "taso_jax.substitutions", "version": FORMAT_VERSION,
           "generator": settings or {}, "substitutions": [s.to_json() for s in subs]}

    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")

    atomic_write(path, write)


def _parse_int(text: str) -> int:
    """``json``'s integer parser, refusing before conversion what int64 cannot hold."""
    if len(text.lstrip("-")) > 19:
        raise RuleFileError(f"an integer of {len(text.lstrip('-')):,} digits (larger than "
                            "int64)")
    return int(text)


def load_substitutions(path) -> list[Substitution]:
    """Read a substitution file written by :func:`save_substitutions`.

    Raises:
        RuleFileError: not a substitution file (not UTF-8 or not JSON, nested too deep, an
            integer past int64, not the format, a newer format version, a malformed rule);
            the message names the file and what is wrong with it. A ``ValueError``, which
            the command line reports in one line with exit code 2.
        OSError: the file cannot be read.
    """
    from taso_jax._text import one_line

    with open(path, encoding="utf-8") as f:
        try:
            return _rules_in(json.load(f, parse_int=_parse_int))
        except RecursionError:  # json's decoder recurses once per level
            problem = "JSON nested too deep"
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            # json's JSONDecodeError and UnicodeDecodeError are ValueErrors, and say only
            # where in the text: the file is named here, for every caller
            problem = one_line(str(e), 300) if isinstance(e, ValueError) else (
                f"{type(e).__name__}: {one_line(str(e), 300)}")
    raise RuleFileError(f"{path}: not a valid substitution file ({problem})")


def _rules_in(doc) -> list[Substitution]:
    """The rules of a parsed substitution file (:func:`load_substitutions`)."""
    if not isinstance(doc, dict) or doc.get("format") != "taso_jax.substitutions":
        raise RuleFileError("not a taso_jax substitution file")
    version = doc.get("version", 0)
    if not isinstance(version, int) or isinstance(version, bool):
        raise RuleFileError(f"format version {str(version)[:20]!r} is not an integer")
    if version > FORMAT_VERSION:
        raise RuleFileError(f"format version {doc['version']} is newer than {FORMAT_VERSION} "
                            "(written by a newer taso_jax)")
    rules = doc.get("substitutions")
    if not isinstance(rules, list):
        raise RuleFileError("'substitutions' must be a list of rules")
    return [Substitution.from_json(d, f"substitution {i}") for i, d in enumerate(rules)]


def default_substitutions() -> list[Substitution]:
    """The generated substitution set shipped inside the package."""
    from importlib.resources import files

    return load_substitutions(files("taso_jax").joinpath("data/substitutions.json"))
