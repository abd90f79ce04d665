"""Checks of a rule file's data, before and after it becomes a :class:`Substitution`.

A rule file is input: it may be nested past any use, refer from a node to itself or to a
later node (a cycle no graph can hold), hold numbers too large for any size, or values of
the wrong type. Each such problem is a :class:`RuleFileError` (a ``ValueError``) naming the
rule and the place, raised while loading, so that no malformed rule reaches the verifier or
the matcher (where it was a ``RecursionError`` or ``IndexError`` deep in a proof).
"""

from __future__ import annotations

import math
from typing import Any

from taso_jax.ops import OPS
from taso_jax.search.pattern import NodeRef, VarRef

__all__ = ["RuleFileError", "check_rule_json", "check_rule_structure", "MAX_ATTR_DEPTH",
           "MAX_INT"]

#: Nesting of an attribute value at most (a list of lists of ... scalars); shipped rules: 1.
MAX_ATTR_DEPTH = 8
#: Largest magnitude of an integer in a rule (a size, an axis, a stride): int64's.
MAX_INT = 2 ** 63 - 1


class RuleFileError(ValueError):
    """A rule file's data is malformed; the message names the rule and the place."""


def _fail(where: str, problem: str) -> RuleFileError:
    return RuleFileError(f"{where}: {problem}")


_KINDS = {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
          type(None): "null", int: "an integer", float: "a number"}


def _kind(value: Any) -> str:
    if isinstance(value, float):
        return f"the number {value}"
    return _KINDS.get(type(value), type(value).__name__)


def _expect(value: Any, kind: type, where: str, what: str) -> None:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _fail(where, f"{what} must be {_KINDS[kind]}, not {_kind(value)}")


def _check_int(value: int, where: str) -> None:
    if abs(value) > MAX_INT:
        raise _fail(where, f"integer {str(value)[:12]}... is larger than int64")


def _check_attr(value: Any, where: str, depth: int = 0) -> None:
    """Check an attribute value: a number, an int64, a string, a boolean, or a list.

    Infinities are values (a mask's fill, a clip's open bound); NaN is refused.
    """
    if isinstance(value, bool) or isinstance(value, str) or value is None:
        return
    if isinstance(value, int):
        _check_int(value, where)
    elif isinstance(value, float):
        if math.isnan(value):
            raise _fail(where, "attribute value is NaN")
    elif isinstance(value, list):
        if depth >= MAX_ATTR_DEPTH:
            raise _fail(where, f"attribute value nested more than {MAX_ATTR_DEPTH} deep")
        for v in value:
            _check_attr(v, where, depth + 1)
    else:
        raise _fail(where, f"attribute value must be a number, string or list, not "
                           f"{_kind(value)}")


def check_rule_json(d: Any, where: str) -> None:
    """Check the types and numbers of one rule's JSON form (``where`` names it).

    Raises:
        RuleFileError: a field missing or of the wrong type, an unknown operator, a size
            that is not a symbol or an integer from 0 to int64's largest, an attribute
            value that is not finite or nested too deep.
    """
    _expect(d, dict, where, "a substitution")
    if "name" in d:
        where = f"{where} ({str(d['name'])[:60]!r})"
    for key, kind in (("name", str), ("variables", dict), ("source", list), ("target", list),
                      ("outputs", list)):
        if key not in d:
            raise _fail(where, f"no {key!r}")
        _expect(d[key], kind, where, repr(key))
    for var, shape in d["variables"].items():
        _expect(shape, list, where, f"the shape of variable {var!r}")
        for dim in shape:
            if isinstance(dim, str):
                continue
            if not isinstance(dim, int) or isinstance(dim, bool):
                raise _fail(where, f"a size of variable {var!r} must be a symbol or an "
                                   f"integer, not {_kind(dim)}")
            if not 0 <= dim <= MAX_INT:
                raise _fail(where, f"size {str(dim)[:12]} of variable {var!r} is not from 0 "
                                   "to int64's largest")
    for side in ("source", "target"):
        for i, n in enumerate(d[side]):
            at = f"{where}, {side} node #{i}"
            _expect(n, dict, at, "a node")
            for key, kind in (("op", str), ("attrs", dict), ("inputs", list)):
                if key not in n:
                    raise _fail(at, f"no {key!r}")
                _expect(n[key], kind, at, repr(key))
            if n["op"] not in OPS:
                raise _fail(at, f"unknown operator {n['op'][:60]!r}")
            for k, v in n["attrs"].items():
                _check_attr(v, f"{at}, attribute {k!r}")
            for r in n["inputs"]:
                _expect(r, str, at, "an input reference")
    for pair in d["outputs"]:
        if not (isinstance(pair, list) and len(pair) == 2
                and all(isinstance(r, str) for r in pair)):
            raise _fail(where, "each output must be a pair of references [source, target]")
    provenance = d.get("provenance", {})
    _expect(provenance, dict, where, "'provenance'")
    proof = provenance.get("proof")
    if proof is not None:
        _expect(proof, dict, where, "'provenance.proof'")
        instances = proof.get("instances")
        if instances is not None:
            _expect(instances, list, where, "'provenance.proof.instances'")
            for a in instances:
                _expect(a, dict, where, "a proved instance")


def _outputs_of(node) -> int | None:
    """How many outputs a pattern node has, where its attributes say (``None``: open)."""
    count = OPS[node.op].num_outputs
    if count is None:
        return 1
    return count(dict(node.attrs))


def check_rule_structure(sub, where: str) -> None:
    """Check that a rule's references form a graph: each to a variable or an earlier node.

    Raises:
        RuleFileError: a reference to an undeclared variable, to the node itself or to a
            later one (a cycle), to an output the node does not have; a node with the wrong
            number of inputs; no outputs, or a source output that is not a source node's.
    """
    where = f"{where} ({sub.name[:60]!r})"
    variables = set(sub.variable_shapes)

    def check_ref(r, side: str, nodes, before: int, at: str) -> None:
        if isinstance(r, VarRef):
            if r.name not in variables:
                raise _fail(at, f"{r.name[:60]!r} is not a declared variable")
            return
        if not 0 <= r.node < len(nodes):
            raise _fail(at, f"{r} is not a node of the {side} (it has {len(nodes)})")
        if r.node == before:
            raise _fail(at, f"{r} refers to its own node (a cycle)")
        if r.node > before:
            raise _fail(at, f"{r} refers to a later node (nodes come in order, so a cycle)")
        count = _outputs_of(nodes[r.node])
        if count is not None and not 0 <= r.output < count:
            raise _fail(at, f"{r}: node #{r.node} ({nodes[r.node].op}) has {count} "
                            f"output{'s' if count != 1 else ''}")

    for side, nodes in (("source", sub.source), ("target", sub.target)):
        for i, n in enumerate(nodes):
            at = f"{where}, {side} node #{i}"
            arity = OPS[n.op].arity
            if arity is not None and len(n.inputs) != arity:
                raise _fail(at, f"{n.op} takes {arity} inputs, not {len(n.inputs)}")
            for r in n.inputs:
                check_ref(r, side, nodes, i, at)
    if not sub.source or not sub.outputs:
        raise _fail(where, "a rule needs a source and at least one output pair")
    for s, t in sub.outputs:
        if not isinstance(s, NodeRef):
            raise _fail(where, f"source output {s} must be a node of the source")
        check_ref(s, "source", sub.source, len(sub.source), f"{where}, outputs")
        check_ref(t, "target", sub.target, len(sub.target), f"{where}, outputs")
