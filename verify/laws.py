"""Operator axioms: one law language, two readings (numeric and Z3).

An :class:`~taso_jax.ops.Axiom` is an equation in Python call syntax over declared operators.
This module reads it twice:

* **numerically** (:func:`check_axiom`): both sides are evaluated by the operators' JAX
  reference functions, in float64, on random inputs for several shape instances and every
  attribute value listed, so a wrong axiom is caught before it proves anything;
* **symbolically** (:class:`Z3Encoding`): tensors are constants of an uninterpreted sort,
  each operator an uninterpreted function whose integer arguments encode its attributes, and
  the axiom a universally quantified equation (TASO, Jia et al., SOSP 2019, Section 4).

Attribute values are encoded as integers: ints as themselves, other values (strings, floats,
``None``) as distinct negative codes, tuples through an uninterpreted constructor ``tupN``.
``dim(x, k)`` is an uninterpreted size function. Shapes are not otherwise modelled, as in
TASO: a law that needs a shape relation states it through ``dim``.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterable

import numpy as np
from taso_jax.ops import OPS, Axiom, ShapeError, TensorType

__all__ = ["all_axioms", "all_laws", "check_axiom", "check_axioms", "evaluate", "Z3Encoding",
           "law_operators",
           "AxiomError", "IllTypedAxiom", "law_outputs"]


class AxiomError(ValueError):
    """An axiom that does not parse, names an unknown operator, or never type-checks."""


class IllTypedAxiom(AxiomError):
    """No instance of an axiom's shape draws types: both sides fail on every one."""


def _parse(text: str, where: str) -> ast.expr:
    try:
        return ast.parse(text, mode="eval").body
    except SyntaxError as e:
        raise AxiomError(f"{where}: cannot parse {text!r} ({e.msg})") from None


_ARITH = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
          ast.Mult: lambda a, b: a * b}

_COMPARE = {ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b,
            ast.Lt: lambda a, b: a < b, ast.LtE: lambda a, b: a <= b}


def _condition(text: str, where: str):
    """``(lhs, operator, rhs)`` of a side condition, or ``None`` for a definition.

    Conditions read ``"i != j"``, ``"i < 0"`` or ``"dim(x, k) == dim(y, k)"``; definitions
    ``"name = expression"``.
    """
    try:
        node = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None  # "s = dim(a, k)" is a statement, not an expression
    if (isinstance(node, ast.Compare) and len(node.ops) == 1
            and type(node.ops[0]) in _COMPARE):
        return node.left, type(node.ops[0]), node.comparators[0]
    raise AxiomError(f"{where}: condition {text!r}: use ==, !=, < or <= between two terms")


def all_axioms() -> list[tuple[str, Axiom]]:
    """Every declared axiom as ``(operator name, axiom)``, in registry order.

    Theorems (``Axiom.theorem``) are left out: the prover must not assume them.
    """
    return [(name, ax) for name, ax in all_laws() if not ax.theorem]


def all_laws() -> list[tuple[str, Axiom]]:
    """Every declared law, axioms and theorems, as ``(operator name, law)``."""
    return [(name, ax) for name, op in OPS.items() for ax in op.axioms]


# ---- numeric reading ----------------------------------------------------------------------

def evaluate(node: ast.expr, env: dict, where: str = "axiom"):
    """Evaluate a parsed law expression with the reference functions.

    ``env`` maps tensor variables to arrays and attribute variables to values.

    Raises:
        ShapeError: a side that is not well typed for these shapes and attributes.
        AxiomError: unknown names or operators.
    """
    if isinstance(node, ast.Name):
        if node.id not in env:
            raise AxiomError(f"{where}: unknown name {node.id!r}")
        return env[node.id]
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -evaluate(node.operand, env, where)
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
        return _ARITH[type(node.op)](evaluate(node.left, env, where),
                                     evaluate(node.right, env, where))
    if isinstance(node, ast.Tuple):
        return tuple(evaluate(e, env, where) for e in node.elts)
    if isinstance(node, ast.Subscript):
        return evaluate(node.value, env, where)[evaluate(node.slice, env, where)]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        name = node.func.id
        if name == "dim":
            x, k = (evaluate(a, env, where) for a in node.args)
            return int(np.shape(x)[k])
        if name not in OPS:
            raise AxiomError(f"{where}: unknown operator {name!r}")
        op = OPS[name]
        ins = [evaluate(a, env, where) for a in node.args]
        attrs = {kw.arg: evaluate(kw.value, env, where) for kw in node.keywords}
        attrs = dict(op.normalize_attrs(attrs))
        types = [TensorType(np.shape(x), str(np.asarray(x).dtype)) for x in ins]
        op.infer(types, attrs)  # ShapeError when not well typed
        out = op.ref(*ins, **attrs)
        return tuple(np.asarray(o) for o in out) if isinstance(out, tuple | list) \
            else np.asarray(out)
    raise AxiomError(f"{where}: unsupported syntax {ast.dump(node)[:60]}")


def law_operators(ax: Axiom) -> frozenset[str]:
    """The declared operators a law's two sides call (``dim`` and arithmetic are not)."""
    return frozenset(node.func.id for side in ax.sides for node in ast.walk(_parse(side, ax.law))
                     if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                     and node.func.id in OPS)


def _attribute_uses(ax: Axiom) -> dict[str, list[tuple[str, str]]]:
    """Attribute variable -> ``(operator, attribute)`` pairs it is passed to in the law."""
    uses: dict = {}
    for side in ax.sides:
        for node in ast.walk(_parse(side, ax.law)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                for kw in node.keywords:
                    if isinstance(kw.value, ast.Name):
                        uses.setdefault(kw.value.id, []).append((node.func.id, kw.arg))
    return uses


def _param_values(ax: Axiom) -> dict[str, tuple]:
    """The values each attribute variable is validated at.

    Those the axiom lists, then the default and example values of every operator attribute
    it is passed to. The Z3 reading
    quantifies over *every* value, so a law that holds only for some (a fused activation
    other than relu) must fail here, not prove wrong rules.
    """
    out = {}
    uses = _attribute_uses(ax)
    for p, listed in ax.params:
        vals = list(listed)
        for op, attr in uses.get(p, ()):
            if op in OPS and attr in OPS[op].attrs:
                decl = OPS[op]
                for v in [decl.attrs[attr]] + [e[attr] for _, e in decl.examples if attr in e]:
                    v = dict(decl.normalize_attrs({attr: v}))[attr]
                    if v not in vals:
                        vals.append(v)
        out[p] = tuple(vals)
    return out


def _size_symbols(ax: Axiom) -> list[str]:
    """Names in the symbolic shapes that are not attribute variables: drawn at random."""
    params = {p for p, _ in ax.params}
    names = {n.id for _, shape in ax.shapes for d in shape if isinstance(d, str)
             for n in ast.walk(_parse(d, ax.law)) if isinstance(n, ast.Name)}
    return sorted(names - params)


def _concrete_shape(shape: tuple, env: dict, where: str) -> tuple[int, ...]:
    """A symbolic shape at given sizes; a dimension may be an expression such as ``"g*E"``.

    A leading ``"..."`` (any leading dimensions) is checked as one of size 2.
    """
    if shape[:1] == ("...",):
        return (2, *_concrete_shape(shape[1:], env, where))
    return tuple(int(evaluate(_parse(d, where), env, where)) if isinstance(d, str) else int(d)
                 for d in shape)


def _instances(ax: Axiom, rng, n_shapes: int,
               sample: int | None = None) -> Iterable[tuple[dict, dict]]:
    """``(sizes, attributes)`` instances of an axiom, for its numeric check.

    ``n_shapes`` size draws, each with every combination of attribute values, or with
    ``sample`` of them drawn at random where there are more (a convolution's strides x
    padding x dilations x groups x activation run to hundreds, and each instance is an XLA
    compilation).
    """
    symbols = _size_symbols(ax)
    params = _param_values(ax)
    combos = list(itertools.product(*params.values())) or [()]
    for _ in range(n_shapes):
        sizes = {s: int(rng.integers(2, 6)) for s in symbols}
        picked = combos
        if sample is not None and len(combos) > sample:
            picked = [combos[i] for i in sorted(rng.choice(len(combos), sample,
                                                           replace=False))]
        for combo in picked:
            yield sizes, dict(zip(params, combo, strict=True))


def check_axiom(ax: Axiom, where: str = "axiom", seed: int = 0, n_shapes: int = 3,
                sample: int | None = None) -> dict:
    """Validate an axiom numerically on random float64 inputs.

    Each of ``n_shapes`` size draws is checked with every combination of the attribute
    values (:func:`_param_values`), or with ``sample`` combinations drawn at random when
    there are more.

    Returns ``{"checked": int, "skipped": int, "failures": [message, ...]}``; an instance
    whose sides are not both well typed is skipped.

    Raises:
        AxiomError: the law does not parse, or no instance is well typed.
    """
    import jax

    lhs, rhs = (_parse(t, where) for t in ax.sides)
    rng = np.random.default_rng(seed)
    out = {"checked": 0, "skipped": 0, "failures": []}
    with jax.enable_x64(True):
        for sizes, attrs in _instances(ax, rng, n_shapes, sample):
            env = dict(attrs)
            try:
                for v, shape in ax.shapes:
                    env[v] = rng.standard_normal(_concrete_shape(shape, {**sizes, **attrs},
                                                                 where))
                for d in ax.where:
                    cond = _condition(d, where)
                    if cond is not None:  # a side condition: the law says nothing if false
                        a, op, b = cond
                        if not _COMPARE[op](evaluate(a, env, where), evaluate(b, env, where)):
                            raise ValueError(f"condition {d} fails")
                        continue
                    name, expr = (x.strip() for x in d.split("=", 1))
                    value = evaluate(_parse(expr, where), env, where)
                    if env.setdefault(name, value) != value:  # a condition that fails here
                        raise ValueError(f"{name}: {env[name]} != {value}")
                a, b = evaluate(lhs, env, where), evaluate(rhs, env, where)
            except (ShapeError, TypeError, ValueError, IndexError) as e:
                if isinstance(e, AxiomError):
                    raise
                out["skipped"] += 1
                continue
            out["checked"] += 1
            a, b = (x if isinstance(x, tuple) else (x,) for x in (a, b))
            ok = len(a) == len(b) and all(
                np.shape(x) == np.shape(y) and np.allclose(x, y, rtol=1e-9, atol=1e-9 * max(
                    1.0, float(np.max(np.abs(y), initial=0.0)))) for x, y in zip(a, b,
                                                                                 strict=False))
            if not ok:
                out["failures"].append(f"{where}: {ax.law} fails for sizes {sizes}, "
                                       f"attributes {attrs}")
    if out["checked"] == 0:
        raise IllTypedAxiom(f"{where}: {ax.law} is never well typed for the shapes and "
                            "attributes given")
    return out


def _check_draw(task: tuple) -> dict:
    """One shape draw of one axiom (a :func:`check_axioms` task), never raising.

    A draw none of whose instances types counts nothing; any other error is the draw's
    failure.
    """
    ax, where, seed, sample = task
    try:
        return check_axiom(ax, where, seed=seed, n_shapes=1, sample=sample)
    except IllTypedAxiom:
        return {"checked": 0, "skipped": 0, "failures": []}
    except Exception as e:  # noqa: BLE001  (reported against its axiom by check_axioms)
        return {"checked": 0, "skipped": 0, "failures": [f"{type(e).__name__}: {e}"]}


def check_axioms(items: Iterable[tuple[str, Axiom]], n_shapes: int = 3,
                 processes: int = 2, sample: int | None = 16) -> list[dict]:
    """:func:`check_axiom` for many axioms, their shape draws spread over worker processes.

    ``items`` are ``(where, axiom)`` pairs. Each axiom is checked on ``n_shapes`` shape draws
    (seeds 0, 1, ...), each a task of its own, so that one axiom with many attribute values
    is shared out too. The first draw checks every combination of the attribute values
    listed; each further draw ``sample`` of them at random (``None``: every one again).
    This keeps every combination checked while the convolution laws, whose combinations
    number in the hundreds, cost a third of what three full draws would. Nearly all the
    time goes into compiling the reference functions for each instance (about 0.17 s a
    compile on XLA:CPU, one core), and the compiled kernels, gigabytes over the registry,
    leave with the workers.
    ``processes <= 1`` runs the tasks here.

    Returns one ``{"checked", "skipped", "failures"}`` per item, in order; an item none of
    whose draws types has a failure saying so, and an error a draw raised (an
    :class:`AxiomError`, say) becomes a failure naming it instead of being raised.
    """
    items = list(items)
    tasks = [(ax, where, seed, None if seed == 0 else sample)
             for where, ax in items for seed in range(n_shapes)]
    if processes <= 1:
        done = [_check_draw(t) for t in tasks]
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # spawned, not forked: the parent has JAX's threads running
        with ProcessPoolExecutor(processes,
                                 mp_context=multiprocessing.get_context("spawn")) as pool:
            done = list(pool.map(_check_draw, tasks))
    out = []
    for k, (where, ax) in enumerate(items):
        r = {"checked": 0, "skipped": 0, "failures": []}
        for d in done[k * n_shapes:(k + 1) * n_shapes]:
            for key in r:
                r[key] += d[key]
        if r["checked"] == 0 and not r["failures"]:
            r["failures"].append(f"{where}: {ax.law} is never well typed for the shapes "
                                 "and attributes given")
        out.append(r)
    return out


def law_outputs(ax: Axiom, where: str = "axiom") -> int:
    """How many outputs a law equates.

    ``n`` when both sides are calls of operators of ``n > 1`` outputs
    (``lstm(...) = lstm_scan(...)``: each output equals its counterpart), else 1 (a
    subscript, ``split(...)[0]``, picks one output).

    Raises:
        AxiomError: the two sides are multi-output calls with different output counts.
    """
    counts = []
    for text in ax.sides:
        node = _parse(text, where)
        n = 1
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in OPS and OPS[node.func.id].num_outputs is not None:
            op = OPS[node.func.id]
            attrs = dict(op.attrs)
            for kw in node.keywords:
                try:
                    attrs[kw.arg] = ast.literal_eval(kw.value)
                except ValueError:
                    attrs.pop(kw.arg, None)
            try:
                n = op.num_outputs(attrs) or 1
            except (KeyError, TypeError):
                n = 1
        counts.append(n)
    if counts[0] != counts[1] and max(counts) > 1:
        raise AxiomError(f"{where}: {ax.law} equates {counts[0]} outputs with {counts[1]}")
    return counts[0]


# ---- Z3 reading ---------------------------------------------------------------------------

def _mentions_all(term, variables) -> bool:
    """Whether a Z3 term contains every one of ``variables`` (constants before binding)."""
    seen, stack = set(), [term]
    while stack:
        t = stack.pop()
        if t.num_args() == 0:
            seen.add(t.get_id())
        stack.extend(t.children())
    return all(v.get_id() in seen for v in variables)


def _has_arithmetic(term) -> bool:
    """Whether a Z3 term applies + - or * (interpreted: not allowed in a trigger)."""
    import z3

    stack = [term]
    while stack:
        t = stack.pop()
        if z3.is_add(t) or z3.is_sub(t) or z3.is_mul(t):
            return True
        stack.extend(t.children())
    return False


class Z3Encoding:
    """Operators as uninterpreted functions over a ``Tensor`` sort (see module doc).

    One encoding is shared by the axioms and the substitutions being proved, so that their
    terms meet. ``attr(value)`` encodes a concrete attribute value; ``term(text, env)``
    encodes a law expression with ``env`` binding names to Z3 terms.
    """

    def __init__(self):
        import z3

        self.z3 = z3
        self.T = z3.DeclareSort("Tensor")
        self._funcs: dict = {}
        self._codes: dict = {}
        self.dim = z3.Function("dim", self.T, z3.IntSort(), z3.IntSort())

    def func(self, name: str, n_inputs: int):
        """The uninterpreted function of an operator: output index, attributes, inputs."""
        key = (name, n_inputs)
        if key not in self._funcs:
            z3 = self.z3
            n_attrs = len(OPS[name].attrs) + 1
            self._funcs[key] = z3.Function(name if OPS[name].arity is not None
                                           else f"{name}{n_inputs}",
                                           *([z3.IntSort()] * n_attrs),
                                           *([self.T] * n_inputs), self.T)
        return self._funcs[key]

    def attr(self, value):
        """Integer term for a concrete attribute value (distinct values, distinct terms)."""
        z3 = self.z3
        if isinstance(value, bool):
            return z3.IntVal(int(value))
        if isinstance(value, int | np.integer):
            return z3.IntVal(int(value))
        if isinstance(value, tuple | list):
            if not value:
                return z3.IntVal(-999_999)
            return self.attr_tuple([self.attr(v) for v in value])
        key = (type(value).__name__, value)
        if key not in self._codes:
            self._codes[key] = -1_000_000 - len(self._codes)
        return z3.IntVal(self._codes[key])

    def apply(self, name: str, inputs: list, attrs: dict, index: int = 0):
        """``name(inputs, **attrs)[index]`` as a Z3 term; attribute values may be Z3 terms."""
        op = OPS[name]
        full = {**op.attrs, **attrs}
        args = [self.z3.IntVal(index)]
        for k in sorted(op.attrs):
            v = full[k]
            args.append(v if isinstance(v, self.z3.ExprRef) else self.attr(v))
        return self.func(name, len(inputs))(*args, *inputs)

    def term(self, node: ast.expr, env: dict, where: str = "axiom", index: int = 0):
        """Encode a parsed law expression (see :func:`evaluate` for the syntax)."""
        if isinstance(node, ast.Name):
            if node.id not in env:
                raise AxiomError(f"{where}: unknown name {node.id!r}")
            return env[node.id]
        if isinstance(node, ast.Constant):
            return self.attr(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -self.term(node.operand, env, where)
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
            return _ARITH[type(node.op)](self.term(node.left, env, where),
                                         self.term(node.right, env, where))
        if isinstance(node, ast.Tuple):
            return self.attr_tuple([self.term(e, env, where) for e in node.elts])
        if isinstance(node, ast.Subscript):
            i = node.slice.value if isinstance(node.slice, ast.Constant) else None
            if not isinstance(i, int):
                raise AxiomError(f"{where}: output index must be an integer constant")
            return self.term(node.value, env, where, index=i)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            name = node.func.id
            if name == "dim":
                x, k = (self.term(a, env, where) for a in node.args)
                return self.dim(x, k)
            if name not in OPS:
                raise AxiomError(f"{where}: unknown operator {name!r}")
            ins = [self.term(a, env, where) for a in node.args]
            attrs = {kw.arg: self.term(kw.value, env, where) for kw in node.keywords}
            return self.apply(name, ins, attrs, index)
        raise AxiomError(f"{where}: unsupported syntax {ast.dump(node)[:60]}")

    def attr_tuple(self, items: list):
        """A tuple attribute whose items are Z3 integer terms."""
        n = len(items)
        key = ("tup", n)
        if key not in self._funcs:
            self._funcs[key] = self.z3.Function(f"tup{n}", *([self.z3.IntSort()] * (n + 1)))
        return self._funcs[key](*items)

    def formula(self, ax: Axiom, where: str = "axiom"):
        """The axiom as ``ForAll(variables, lhs == rhs)``."""
        z3 = self.z3
        env = {v: z3.Const(v, self.T) for v, _ in ax.shapes}
        env.update({p: z3.Int(p) for p, _ in ax.params})
        conditions = []
        for d in ax.where:
            cond = _condition(d, where)
            if cond is not None:
                a, op, b = cond
                conditions.append(_COMPARE[op](self.term(a, env, where),
                                               self.term(b, env, where)))
                continue
            name, expr = (x.strip() for x in d.split("=", 1))
            env[name] = z3.Int(name)
            conditions.append(env[name] == self.term(_parse(expr, where), env, where))
        sides = [_parse(t, where) for t in ax.sides]
        n = law_outputs(ax, where)
        lhs, rhs = ([self.term(side, env, where, index=i) for i in range(n)] for side in sides)
        eq = z3.And(*[a == b for a, b in zip(lhs, rhs, strict=True)]) if n > 1 \
            else lhs[0] == rhs[0]
        body = eq if not conditions else z3.Implies(z3.And(*conditions), eq)
        bound = list(env.values())
        # Trigger on a side that mentions every variable (Z3's own choice may be a size term).
        # A side with arithmetic in it (groups=g + g) or a bare variable cannot trigger.
        patterns = [side for side in (*lhs, *rhs)
                    if _mentions_all(side, bound) and not _has_arithmetic(side)]
        try:
            return z3.ForAll(bound, body, patterns=patterns)
        except z3.Z3Exception:  # no side can trigger (a bare variable): Z3 chooses
            return z3.ForAll(bound, body)
