"""The pattern language of substitutions, parsed once into frozen values.

A rule file writes patterns as JSON strings; this module is the one place that reads them:

* a **reference** to a tensor is a variable name (``"x"``), read as :class:`VarRef`, or
  ``"#i"`` / ``"#i.k"`` for output ``k`` of pattern node ``i`` of the same side, read as
  :class:`NodeRef`;
* an **attribute variable** ``"?groups"`` (:class:`AttrVar`) matches any value, the same
  value wherever it appears, and the target reuses it;
* a **size expression** ``"$D"``, ``"$D+C"`` or ``"$?groups/2"`` (:class:`SizeExpr`) is a
  sum of terms, each a symbol (a shape symbol such as ``D`` or an attribute variable) or a
  symbol over an integer; it is computed from the symbols bound earlier in a match, and a
  rule does not apply where a division is not exact.

:func:`parse_ref` and :func:`parse_attr` turn strings into these values; ``str()`` of a value
is its rule-file form, so a rule file round-trips unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from taso_jax.ops import ShapeError
from taso_jax.ops.dims import is_open

__all__ = ["NodeRef", "VarRef", "Ref", "AttrVar", "SizeTerm", "SizeExpr", "PNode",
           "parse_ref", "parse_attr", "is_symbolic", "resolve_attr", "attr_to_json",
           "attr_from_json"]


@dataclass(frozen=True)
class NodeRef:
    """Output ``output`` of pattern node ``node`` (index in its side): ``"#node.output"``."""

    node: int
    output: int = 0

    def __str__(self) -> str:
        return f"#{self.node}" + (f".{self.output}" if self.output else "")


@dataclass(frozen=True)
class VarRef:
    """A pattern variable (an input or weight of the rule), e.g. ``"x"``."""

    name: str

    def __str__(self) -> str:
        return self.name


Ref = NodeRef | VarRef


def parse_ref(text: str | NodeRef | VarRef) -> Ref:
    """``"#2.1"`` -> ``NodeRef(2, 1)``, ``"x"`` -> ``VarRef("x")``; values pass through.

    Raises:
        ValueError: a malformed node reference (``"#a"``).
    """
    if isinstance(text, NodeRef | VarRef):
        return text
    if not text.startswith("#"):
        return VarRef(text)
    i, _, k = text[1:].partition(".")
    try:
        return NodeRef(int(i), int(k or 0))
    except ValueError:
        raise ValueError(f"bad node reference {text!r} (expected #i or #i.k)") from None


@dataclass(frozen=True)
class AttrVar:
    """An attribute variable, ``"?name"``; ``name`` keeps the ``?`` (its key in bindings)."""

    name: str

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class SizeTerm:
    """One term of a size expression: ``symbol`` over ``divisor`` (1: the symbol itself)."""

    symbol: str
    divisor: int = 1

    def __str__(self) -> str:
        return self.symbol + (f"/{self.divisor}" if self.divisor != 1 else "")

    def resolve(self, sym: dict) -> int:
        """The term's value under the binding ``sym``.

        Raises:
            KeyError: the symbol is not bound.
            ShapeError: the division is not exact (the rule does not apply there).
        """
        value = sym[self.symbol]
        q, r = divmod(value, self.divisor)
        if r or is_open(r):  # exact at every binding of the model's open sizes, or no match
            raise ShapeError(f"{self.symbol} = {value} is not divisible by {self.divisor}")
        return q


@dataclass(frozen=True)
class SizeExpr:
    """A size computed from bound symbols: ``"$D+C"``, ``"$?groups/2"``."""

    terms: tuple[SizeTerm, ...]

    def __str__(self) -> str:
        return "$" + "+".join(str(t) for t in self.terms)

    @staticmethod
    def parse(text: str) -> SizeExpr:
        """Parse ``"$D+C"``. Raises ``ValueError`` on a malformed expression."""
        terms = []
        for part in text[1:].split("+"):
            name, slash, den = part.partition("/")
            if not name or (slash and not den.isdigit()) or (slash and int(den) < 1):
                raise ValueError(f"bad size expression {text!r}")
            terms.append(SizeTerm(name, int(den) if slash else 1))
        return SizeExpr(tuple(terms))

    @property
    def symbols(self) -> tuple[str, ...]:
        """The symbols the expression reads."""
        return tuple(t.symbol for t in self.terms)

    def resolve(self, sym: dict) -> int:
        """The sum of the terms under ``sym`` (raises like :meth:`SizeTerm.resolve`)."""
        return sum(t.resolve(sym) for t in self.terms)


def parse_attr(value: Any) -> Any:
    """An attribute value with ``"?name"`` and ``"$..."`` strings parsed (tuples too)."""
    if isinstance(value, str):
        if value.startswith("?"):
            return AttrVar(value)
        if value.startswith("$"):
            return SizeExpr.parse(value)
        return value
    if isinstance(value, tuple | list):
        return tuple(parse_attr(v) for v in value)
    return value


def is_symbolic(value: Any) -> bool:
    """Whether an attribute value holds an attribute variable or a size expression."""
    if isinstance(value, AttrVar | SizeExpr):
        return True
    return isinstance(value, tuple) and any(is_symbolic(v) for v in value)


def resolve_attr(value: Any, sym: dict) -> Any:
    """A concrete attribute value under the binding ``sym``.

    Raises:
        KeyError: an unbound symbol or attribute variable.
        ShapeError: a division that is not exact.
    """
    if isinstance(value, SizeExpr):
        return value.resolve(sym)
    if isinstance(value, AttrVar):
        return sym[value.name]
    if isinstance(value, tuple):
        return tuple(resolve_attr(v, sym) for v in value)
    return value


def attr_to_json(value: Any) -> Any:
    """The rule-file form of an attribute value (strings for symbols, lists for tuples)."""
    if isinstance(value, AttrVar | SizeExpr):
        return str(value)
    if isinstance(value, tuple):
        return [attr_to_json(v) for v in value]
    return value


def attr_from_json(value: Any) -> Any:
    """Inverse of :func:`attr_to_json` for plain values: lists become tuples."""
    return tuple(attr_from_json(v) for v in value) if isinstance(value, list) else value


@dataclass(frozen=True)
class PNode:
    """A pattern node: operator, attributes (sorted pairs), inputs as references.

    Strings given for inputs and attribute values are parsed on construction
    (:func:`parse_ref`, :func:`parse_attr`), so a pattern is parsed exactly once, wherever
    it comes from (a rule file, the generator, a test).
    """

    op: str
    attrs: tuple[tuple[str, Any], ...]
    inputs: tuple[Ref, ...]

    def __post_init__(self):
        object.__setattr__(self, "inputs", tuple(parse_ref(r) for r in self.inputs))
        object.__setattr__(self, "attrs", tuple((k, parse_attr(v)) for k, v in self.attrs))
