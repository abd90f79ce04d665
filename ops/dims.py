"""Open sizes in the IR: a dimension that is an integer at the bound sizes and an expression.

A model that leaves sizes open (ONNX ``dim_param``: a batch size ``N``, an image height
``H``, a sequence length ``T``) is imported at one binding of them, where the search and the
cost model work; every size that follows from an open one is a :class:`Dim`: an ``int``
(its value at that binding, so every shape rule, the executor and the cost model read it
as they read any size) that also carries its expression over the open sizes, a SymPy
expression (``N``, ``2*N``, ``floor(H/2) + 1``, ``C*H*W``).

Arithmetic on a :class:`Dim` (``+ - * // %`` and unary minus, with integers or other
:class:`Dim` values) computes both the value and the expression, so a shape rule written
for plain integers carries expressions through without knowing of them; any other use (an
``int()`` call, NumPy, a float) gives a plain value, which is a size fixed at the binding.
A :class:`Dim` equals (``==``) and hashes as its value, so graphs, caches and keys at the
binding behave as before; :func:`same_size` is the stricter test, equal at every binding,
that a substitution's shape conditions use (:func:`taso_jax.search.match.unify_shape`).

Export reads the expressions back (:func:`symbols_of`, :func:`is_open`): a reshape, slice,
split or expand whose sizes are open is written with those sizes computed from the graph
inputs' shapes at run time (``Shape``, ``Gather``, integer arithmetic), so the written
model runs at other sizes too, and the output check compares it with the original at a
second binding. SymPy is imported only when a model has open sizes.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["Dim", "symbol", "expr_of", "is_open", "same_size", "same_value", "symbols_of",
           "open_dims", "from_expression", "parse_expression"]


def _sympy():
    import sympy

    return sympy


@functools.lru_cache(maxsize=4096)
def symbol(name: str):
    """The SymPy symbol of an open size named ``name`` (an integer, at least 0)."""
    return _sympy().Symbol(name, integer=True, nonnegative=True)


def expr_of(d: Any):
    """The expression of a size: a :class:`Dim`'s, or a SymPy integer for a plain int."""
    if isinstance(d, Dim):
        return d.expr
    return _sympy().Integer(int(d))


def is_open(d: Any) -> bool:
    """Whether ``d`` is a :class:`Dim`, a size that follows from the model's open sizes."""
    return isinstance(d, Dim)


def open_dims(shape) -> bool:
    """Whether any size of ``shape`` is open."""
    return any(isinstance(d, Dim) for d in shape)


def same_size(a: Any, b: Any) -> bool:
    """Whether sizes ``a`` and ``b`` are equal at every binding of the open sizes.

    Two plain integers are compared by value; where either is a :class:`Dim`, their values
    at the bound sizes and their expressions must both agree (so ``N`` bound at 1 is not
    the size 1, and two sizes both bound at 224, ``H`` and ``W``, are not one size).
    """
    if not (isinstance(a, Dim) or isinstance(b, Dim)):
        return a == b
    return int(a) == int(b) and _equal(expr_of(a), expr_of(b))


@functools.lru_cache(maxsize=65536)
def _equal(ea, eb) -> bool:
    """Whether two size expressions are equal at every binding (``False`` where unproved).

    Evaluated first at a few bindings (:data:`_PROBE_SIZES`): a difference there settles
    it without SymPy's ``simplify``, which takes half a second on the nested floors of a
    network of strided convolutions and upsamplings (sizes that agree only where the
    input's side is a multiple of 32). Only expressions equal at every probe are proved.
    """
    if ea == eb:
        return True
    diff = ea - eb
    if diff.is_Number:
        return diff == 0
    if _differs_somewhere(diff):
        return False
    return _sympy().simplify(diff) == 0


#: Values each open size takes at the bindings :func:`_equal` evaluates first (none is 0,
#: which an expression may divide by).
_PROBE_SIZES = (1, 2, 3, 5, 7, 16, 33, 64, 97, 224)


def _differs_somewhere(diff) -> bool:
    """Whether the expression ``diff`` is a nonzero number at some probe binding."""
    sp = _sympy()
    syms = sorted(diff.free_symbols, key=lambda s: s.name)
    n = len(_PROBE_SIZES)
    for k in range(n):
        point = {s: sp.Integer(_PROBE_SIZES[(k + 3 * i) % n]) for i, s in enumerate(syms)}
        value = diff.xreplace(point)
        if value.is_Number and value.is_finite and value != 0:
            return True
    return False


def same_value(a: Any, b: Any) -> bool:
    """:func:`same_size` through tuples (attribute values such as a reshape's target)."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, int) and isinstance(b, int) and not isinstance(a, bool):
        return same_size(a, b)
    return a == b


def symbols_of(d: Any) -> frozenset[str]:
    """The names of the open sizes that ``d``'s expression reads (empty for an int)."""
    if not isinstance(d, Dim):
        return frozenset()
    return frozenset(s.name for s in d.expr.free_symbols)


@functools.lru_cache(maxsize=65536)
def _combine(op: str, ea, eb):
    sp = _sympy()
    if op == "+":
        return ea + eb
    if op == "-":
        return ea - eb
    if op == "*":
        return ea * eb
    if op == "//":
        return sp.floor(ea / eb)
    if op == "%":
        return ea - eb * sp.floor(ea / eb)
    raise ValueError(op)


def _make(value: int, expr) -> int:
    """A :class:`Dim`, or a plain int where the expression is a constant."""
    if expr.is_Integer:
        return int(value)
    return Dim(value, expr)


@functools.lru_cache(maxsize=4096)
def parse_expression(text: str):
    """``text`` (``"2*N"``, ``"floor(H/2) + 1"``) as a SymPy expression over size symbols.

    Names become :func:`symbol` s (integers, at least 0); None where SymPy cannot parse it.
    Parsed once per text (onnxruntime's symbolic inference repeats a few expressions over
    thousands of values).
    """
    if text.isidentifier():
        return symbol(text)
    sp = _sympy()
    try:
        parsed = sp.sympify(text, locals={"floor": sp.floor, "ceiling": sp.ceiling,
                                          "Max": sp.Max, "Min": sp.Min})
    except Exception:  # noqa: BLE001 - unparsable: no expression
        return None
    if not isinstance(parsed, sp.Expr):
        return None
    return parsed.subs({s: symbol(s.name) for s in parsed.free_symbols})


def from_expression(value: int, text: str, known: frozenset[str] | None = None) -> int:
    """A size from an expression written as text (onnxruntime's symbolic shape inference).

    ``text`` is parsed by :func:`parse_expression`; ``value`` is its value at the bound
    sizes. When ``known`` is given, an expression that reads any other name (an
    inference's fresh ``unk__3``) is no expression of the open sizes, and the plain
    ``value`` is returned. The expression must evaluate to ``value`` at the binding, which
    the caller checks (:meth:`Dim.evaluate`).
    """
    parsed = parse_expression(text)
    if parsed is None:
        return int(value)
    if known is not None and not {s.name for s in parsed.free_symbols} <= known:
        return int(value)
    return _make(value, parsed)


#: ``[True]`` once this process has made a :class:`Dim`: from then on, hash-consing tells
#: nodes apart by their sizes' expressions too (:func:`taso_jax.ir.graph.intern_node`).
MADE = [False]


class Dim(int):
    """A size: its value at the bound sizes (the ``int``) and its expression over open sizes.

    ``Dim(224, H)`` is 224 wherever an integer is read, and ``H`` where the export writes
    it. Arithmetic with integers or other :class:`Dim` values keeps both (a result whose
    expression is a constant is a plain ``int``); the expression of a ``Dim`` made by
    arithmetic always evaluates to its value at the binding. ``repr`` and ``str`` print the
    value, so printed shapes and cache keys are as at the binding. Pickled, it is the plain
    value (a size fixed at the binding).
    """

    expr: Any

    def __new__(cls, value: int, expr) -> Dim:
        """A size of ``value`` at the bound sizes and ``expr`` (SymPy) over the open ones."""
        self = super().__new__(cls, int(value))
        self.expr = expr
        MADE[0] = True
        return self

    def __reduce__(self):
        return (int, (int(self),))

    def __repr__(self) -> str:
        return int.__repr__(self)

    __str__ = __repr__

    def describe(self) -> str:
        """``"value (expression)"``, for messages and reports."""
        return f"{int(self)} ({self.expr})"

    def _binary(self, other, op: str, reverse: bool = False):
        if not isinstance(other, int) or isinstance(other, bool):
            return NotImplemented
        a, b = (other, self) if reverse else (self, other)
        va, vb = int(a), int(b)
        if op == "+":
            value = va + vb
        elif op == "-":
            value = va - vb
        elif op == "*":
            value = va * vb
        elif op == "//":
            value = va // vb
        else:
            value = va % vb
        return _make(value, _combine(op, expr_of(a), expr_of(b)))

    def __add__(self, other):
        return self._binary(other, "+")

    def __radd__(self, other):
        return self._binary(other, "+", True)

    def __sub__(self, other):
        return self._binary(other, "-")

    def __rsub__(self, other):
        return self._binary(other, "-", True)

    def __mul__(self, other):
        return self._binary(other, "*")

    def __rmul__(self, other):
        return self._binary(other, "*", True)

    def __floordiv__(self, other):
        return self._binary(other, "//")

    def __rfloordiv__(self, other):
        return self._binary(other, "//", True)

    def __mod__(self, other):
        return self._binary(other, "%")

    def __rmod__(self, other):
        return self._binary(other, "%", True)

    def __divmod__(self, other):
        q, r = self // other, self % other
        return NotImplemented if q is NotImplemented else (q, r)

    def __rdivmod__(self, other):
        q, r = other // self, other % self
        return (q, r)

    def __neg__(self):
        return _make(-int(self), -self.expr)

    def __pos__(self):
        return self

    def __abs__(self):
        return self if int(self) >= 0 else -self

    def __index__(self) -> int:
        return int.__int__(self)

    def __int__(self) -> int:
        return int.__int__(self)

    def evaluate(self, binding: dict[str, int]) -> int:
        """The value at another ``binding`` (open size name -> value)."""
        return _evaluate(self.expr, tuple(sorted(binding.items())))


@functools.lru_cache(maxsize=65536)
def _evaluate(expr, binding: tuple) -> int:
    values = dict(binding)
    return int(expr.subs({s: values[s.name] for s in expr.free_symbols}))
