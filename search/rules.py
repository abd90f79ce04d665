"""Graph substitutions as readable data, and matching them against a graph.

A substitution has a *source* pattern and a *target* pattern over named variables with
symbolic shapes (``["N", "C", "H", "W"]``, ``["D", "C", 1, 1]``; a leading ``"..."`` stands
for any leading dimensions), and pairs each source output with the target tensor that
replaces it. Attribute values of the form ``"$D"`` or ``"$D+C"`` are sizes taken from the
symbols bound at match time (split sizes), so a substitution found on small shapes applies to
every shape that unifies with its variables. An attribute value ``"?name"`` is an attribute
variable: it matches any value, the same value wherever it appears, and the target reuses it.

Matching (TASO, Jia et al., SOSP 2019, Section 5) binds source nodes to graph nodes with the
same operator and attributes, variables to tensors consistently, checks the symbolic shapes,
refuses opaque nodes, internal source tensors that are read outside the match or are graph
outputs, and bindings that would create a cycle; the target is then built with shape checks
and must produce the source outputs' types.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from taso_jax.ops import OPS, ShapeError

from taso_jax.ir.graph import Graph, Node, Tensor, make_node

__all__ = ["PNode", "Substitution", "load_substitutions", "save_substitutions",
           "default_substitutions", "instantiate", "FORMAT_VERSION"]

FORMAT_VERSION = 1


@dataclass(frozen=True)
class PNode:
    """A pattern node: operator, attributes (sorted pairs), inputs as references.

    A reference is a variable name, or ``"#i"`` / ``"#i.k"`` for output ``k`` of pattern
    node ``i`` of the same side. An attribute value is a constant, an attribute variable
    (``"?groups"``: any value, the same wherever it appears), or a size expression: ``"$"``
    and terms joined by ``+``, each a symbol (a shape symbol ``D`` or an attribute
    variable), or a symbol over an integer (``"$?groups/2"``). A size expression is computed
    from symbols bound earlier in the pattern; a rule does not apply where a division is not
    exact.
    """

    op: str
    attrs: tuple[tuple[str, Any], ...]
    inputs: tuple[str, ...]


def _ref(ref: str) -> tuple[int, int] | None:
    if not ref.startswith("#"):
        return None
    i, _, k = ref[1:].partition(".")
    return int(i), int(k or 0)


def _resolve_term(term: str, sym: dict) -> int:
    """One term of a size expression: a symbol, or a symbol over an integer (``?groups/2``).

    Raises ``ShapeError`` when the division is not exact: the rule does not apply there.
    """
    name, slash, den = term.partition("/")
    if not slash:
        return sym[name]
    q, r = divmod(sym[name], int(den))
    if r:
        raise ShapeError(f"{name} = {sym[name]} is not divisible by {den}")
    return q


def _resolve_attr(v: Any, sym: dict) -> Any:
    if isinstance(v, str) and v.startswith("$"):
        return sum(_resolve_term(t, sym) for t in v[1:].split("+"))
    if isinstance(v, str) and v.startswith("?"):
        return sym[v]
    if isinstance(v, tuple):
        return tuple(_resolve_attr(x, sym) for x in v)
    return v


def _attrs_match(pattern: tuple, host: tuple, sym: dict) -> dict | None:
    """Extended binding if the pattern's attributes match the host's, else ``None``.

    ``"?name"`` values are attribute variables: bound to the host's value on first use, and
    required to be equal wherever else they appear.
    """
    if len(pattern) != len(host):
        return None
    for (k1, v1), (k2, v2) in zip(pattern, host, strict=True):
        if k1 != k2:
            return None
        if isinstance(v1, str) and v1.startswith("?"):
            if v1 not in sym:
                sym = {**sym, v1: v2}
            elif sym[v1] != v2:
                return None
            continue
        try:
            if _resolve_attr(v1, sym) != v2:
                return None
        except (KeyError, ShapeError):
            return None
    return sym


def unify_shape(pattern: tuple, shape: tuple[int, ...], sym: dict) -> dict | None:
    """Extend symbol binding ``sym`` so that ``pattern`` matches ``shape``, or ``None``."""
    sym = dict(sym)
    if pattern and pattern[0] == "...":
        rest = pattern[1:]
        if len(shape) < len(rest):
            return None
        lead = tuple(shape[: len(shape) - len(rest)])
        if sym.setdefault("...", lead) != lead:
            return None
        pattern, shape = rest, shape[len(shape) - len(rest):]
    if len(pattern) != len(shape):
        return None
    for p, d in zip(pattern, shape, strict=True):
        if isinstance(p, int):
            if p != d:
                return None
        elif sym.setdefault(p, d) != d:
            return None
    return sym


@dataclass(frozen=True)
class Substitution:
    """A verified-or-not rewrite rule ``source => target``.

    Attributes:
        name: identifier (law name when known, else a generated id).
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
    outputs: tuple[tuple[str, str], ...]
    provenance: dict = field(default_factory=dict, compare=False, hash=False)

    # ---- readable form -------------------------------------------------------------------
    def expr(self, side: str, ref: str) -> str:
        """Expression string of one reference of one side (``"source"`` or ``"target"``)."""
        nodes = self.source if side == "source" else self.target
        r = _ref(ref)
        if r is None:
            return ref
        n = nodes[r[0]]
        args = [self.expr(side, x) for x in n.inputs]
        defaults = OPS[n.op].attrs
        args += [f"{k}={_fmt(v)}" for k, v in n.attrs if defaults.get(k) != v]
        s = f"{n.op}({', '.join(args)})"
        return s + (f"[{r[1]}]" if self._multi_output(side, r[0]) else "")

    def _multi_output(self, side: str, i: int) -> bool:
        """Whether some reference reads an output other than 0 of node ``i``."""
        nodes = self.source if side == "source" else self.target
        refs = [x for n in nodes for x in n.inputs]
        refs += [s if side == "source" else t for s, t in self.outputs]
        return any(x.startswith(f"#{i}.") and not x.endswith(".0") for x in refs)

    @property
    def law(self) -> str:
        """``source outputs => target outputs`` as expressions."""
        src = ", ".join(self.expr("source", s) for s, _ in self.outputs)
        tgt = ", ".join(self.expr("target", t) for _, t in self.outputs)
        return f"{src}  =>  {tgt}"

    def to_json(self) -> dict:
        """JSON-ready dict (lists instead of tuples)."""
        def nodes(ns):
            return [{"op": n.op, "attrs": {k: _jsonable(v) for k, v in n.attrs},
                     "inputs": list(n.inputs)} for n in ns]
        return {"name": self.name, "law": self.law,
                "variables": {k: list(v) for k, v in self.variables},
                "source": nodes(self.source), "target": nodes(self.target),
                "outputs": [list(p) for p in self.outputs], "provenance": self.provenance}

    @staticmethod
    def from_json(d: dict) -> Substitution:
        """Inverse of :meth:`to_json`. Raises ``KeyError``/``ValueError`` on malformed data."""
        def nodes(ns):
            out = []
            for n in ns:
                if n["op"] not in OPS:
                    raise ValueError(f"substitution {d.get('name')}: unknown operator {n['op']!r}")
                out.append(PNode(n["op"], OPS[n["op"]].normalize_attrs(
                    {k: _from_jsonable(v) for k, v in n["attrs"].items()}), tuple(n["inputs"])))
            return tuple(out)
        return Substitution(d["name"], tuple((k, tuple(v)) for k, v in d["variables"].items()),
                            nodes(d["source"]), nodes(d["target"]),
                            tuple(tuple(p) for p in d["outputs"]), dict(d.get("provenance", {})))

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
        return tuple({k: _from_jsonable(v) for k, v in a.items()} for a in inst)

    # ---- matching ------------------------------------------------------------------------
    @property
    def _var_shapes(self) -> dict[str, tuple]:
        return dict(self.variables)

    def matches(self, graph: Graph, stats: Counter | None = None,
                near: set | None = None) -> Iterator[dict]:
        """Yield bindings ``{"nodes": [host node per source node], "vars": {...}, "sym": {...}}``.

        ``stats`` (optional) counts why candidate bindings were rejected. ``near`` (optional)
        restricts the host of the first source node to a set of nodes (a local search around
        a recent rewrite).
        """
        stats = stats if stats is not None else Counter()
        shapes = self._var_shapes
        n_src = len(self.source)
        bound_nodes: list[Node | None] = [None] * n_src

        def host_of(ref: str, var: dict) -> Tensor | None:
            r = _ref(ref)
            if r is None:
                return var.get(ref)
            node = bound_nodes[r[0]]
            return None if node is None else Tensor(node, r[1])

        allowed = self.proved_instances

        def extend(i: int, var: dict, sym: dict) -> Iterator[dict]:
            if i == n_src:
                if allowed is not None and not any(all(sym.get(k) == v for k, v in a.items())
                                                   for a in allowed):
                    stats["unproved_instance"] += 1  # proved only at other attribute values
                    return
                yield {"nodes": list(bound_nodes), "vars": dict(var), "sym": dict(sym)}
                return
            p = self.source[i]
            anchors = [host_of(r, var) for r in p.inputs]
            anchor = next((t for t in anchors if t is not None), None)
            if anchor is not None:
                cands = [n for n in graph.consumers.get(anchor, ()) if n.op == p.op]
            else:
                cands = graph.by_op.get(p.op, [])
                if near is not None:
                    cands = [n for n in cands if n in near]
            for h in dict.fromkeys(cands):
                if h in bound_nodes:
                    continue
                # Nothing is bound before the first node: its bindings depend on it alone.
                found = (self._first_bindings(h, shapes, stats) if i == 0 else
                         self._host_bindings(p, h, var, sym, host_of, shapes, stats))
                for bound in found:
                    bound_nodes[i] = h
                    yield from extend(i + 1, *bound)
                    bound_nodes[i] = None

        yield from extend(0, {}, {})

    def __getstate__(self):
        # The per-node match cache holds graph nodes: it is not part of the rule.
        return {k: v for k, v in self.__dict__.items() if k != "_first_cache"}

    def _first_bindings(self, h: Node, shapes: dict, stats: Counter) -> list[tuple]:
        """``(vars, symbols)`` for each way the first source node binds to host node ``h``.

        Nodes are immutable and hash-consed, and the first source node reads variables only,
        so the result depends on ``h`` alone: it is computed once per node and kept, which
        spares the search re-matching every unchanged node of each graph it expands.
        """
        cache = self.__dict__.get("_first_cache")
        if cache is None:
            cache = {}
            object.__setattr__(self, "_first_cache", cache)
        found = cache.get(h)
        if found is None:
            found = cache[h] = self._host_bindings(self.source[0], h, {}, {},
                                                   lambda ref, var: var.get(ref), shapes, stats)
        return found

    def _host_bindings(self, p: PNode, h: Node, var: dict, sym: dict, host_of, shapes: dict,
                       stats: Counter) -> list[tuple]:
        """Each ``(vars, symbols)`` that binds pattern node ``p`` to host node ``h``.

        ``var`` and ``sym`` are extended; a commutative operator is tried in both operand
        orders.
        """
        if len(h.inputs) != len(p.inputs):
            return []
        sym_a = _attrs_match(p.attrs, h.attrs, sym)
        if sym_a is None:
            stats["attrs"] += 1
            return []
        orders = [h.inputs]
        if OPS[p.op].commutative and h.inputs[0] != h.inputs[1]:
            orders.append(h.inputs[::-1])
        found = []
        for host_inputs in orders:
            bound = self._bind_inputs(p, host_inputs, var, sym_a, host_of, shapes, stats)
            # Sizes in attributes ("$D") can only be checked once shapes are bound.
            if bound is not None and _attrs_match(p.attrs, h.attrs, bound[1]) is not None:
                found.append(bound)
        return found

    @staticmethod
    def _bind_inputs(p, host_inputs, var, sym, host_of, shapes, stats):
        """Bind a pattern node's inputs to host tensors: ``(vars, symbols)`` or ``None``."""
        var = dict(var)
        for r, t in zip(p.inputs, host_inputs, strict=True):
            want = host_of(r, var)
            if want is not None:
                if want != t:
                    return None
                continue
            if t.dtype not in _FLOAT_DTYPES:
                return None
            sym = unify_shape(shapes[r], t.shape, sym)
            if sym is None:
                stats["shape"] += 1
                return None
            var[r] = t
        return var, sym

    def apply(self, graph: Graph, binding: dict, stats: Counter | None = None) -> Graph | None:
        """The rewritten graph for one binding from :meth:`matches`, or ``None`` if invalid."""
        mapping = self.prepare(graph, binding, stats)
        return None if mapping is None else graph.replace(mapping)

    def prepare(self, graph: Graph, binding: dict, stats: Counter | None = None):
        """Validate a binding and build the target's nodes.

        Returns the tensor mapping that :meth:`Graph.replace` takes, or ``None`` if the
        rewrite is invalid. The built nodes are left in ``binding["created"]`` (searches
        price them before building a graph).
        """
        stats = stats if stats is not None else Counter()
        hosts: list[Node] = binding["nodes"]
        var, sym = binding["vars"], binding["sym"]
        matched = set(hosts)
        if all(h in graph.weight_only for h in hosts):
            stats["weight_only"] += 1
            return None  # rewriting weight-only work changes nothing at run time
        out_refs = {s for s, _ in self.outputs}
        for i, h in enumerate(hosts):
            for k, t in enumerate(h.outputs):
                if f"#{i}.{k}" in out_refs or (k == 0 and f"#{i}" in out_refs):
                    continue
                if t in graph.output_set or any(
                        c not in matched for c in graph.consumers.get(t, ())):
                    stats["internal_used"] += 1
                    return None
        if self._creates_cycle(graph, matched, var.values()):
            stats["cycle"] += 1
            return None
        try:
            built = instantiate(self.target, var, sym)
        except (ShapeError, KeyError):
            stats["target_shape"] += 1
            return None
        binding["created"] = built  # the target's nodes, for searches that look near them
        mapping: dict[Tensor, Tensor] = {}
        for s, t in self.outputs:
            rs, rt = _ref(s), _ref(t)
            src = Tensor(hosts[rs[0]], rs[1])
            tgt = var[t] if rt is None else Tensor(built[rt[0]], rt[1])
            if src.type != tgt.type:
                stats["output_type"] += 1
                return None
            mapping[src] = tgt
        return mapping

    @staticmethod
    def _creates_cycle(graph: Graph, matched: set[Node], var_tensors) -> bool:
        pos = _positions(graph)
        first = min(pos[n] for n in matched)
        stack = [t.node for t in var_tensors if pos[t.node] >= first]
        seen: set[Node] = set()
        while stack:
            n = stack.pop()
            if n in matched:
                return True
            if n in seen:
                continue
            seen.add(n)
            stack.extend(t.node for t in n.inputs if pos[t.node] >= first)
        return False

    def rewrites(self, graph: Graph, stats: Counter | None = None) -> Iterator[Graph]:
        """Every graph obtained by applying this substitution once."""
        for b in self.matches(graph, stats):
            g = self.apply(graph, b, stats)
            if g is not None:
                yield g


_FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})


def _positions(graph: Graph) -> dict[Node, int]:
    pos = graph.__dict__.get("_positions")
    if pos is None:
        pos = {n: i for i, n in enumerate(graph.nodes)}
        graph.__dict__["_positions"] = pos
    return pos


def instantiate(nodes: tuple[PNode, ...], variables: dict[str, Tensor], sym: dict) -> list[Node]:
    """Build pattern nodes on tensors bound to their variables, resolving symbolic attributes.

    Raises:
        ShapeError: a node's shape rule rejects the bound tensors.
        KeyError: an unbound variable, symbol or attribute variable.
    """
    built: list[Node] = []
    for p in nodes:
        ins = [variables[r] if (rr := _ref(r)) is None else Tensor(built[rr[0]], rr[1])
               for r in p.inputs]
        built.append(make_node(p.op, ins, {k: _resolve_attr(v, sym) for k, v in p.attrs}))
    return built


def _fmt(v: Any) -> str:
    return str(list(v)) if isinstance(v, tuple) else str(v)


def _jsonable(v: Any) -> Any:
    return [_jsonable(x) for x in v] if isinstance(v, tuple) else v


def _from_jsonable(v: Any) -> Any:
    return tuple(_from_jsonable(x) for x in v) if isinstance(v, list) else v


def save_substitutions(subs: list[Substitution], path, settings: dict | None = None) -> None:
    """Write substitutions as versioned JSON, atomically (temporary file then rename)."""
    from taso_jax._io import atomic_write

    doc = {"format": "taso_jax.substitutions", "version": FORMAT_VERSION,
           "generator": settings or {}, "substitutions": [s.to_json() for s in subs]}

    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")

    atomic_write(path, write)


def load_substitutions(path) -> list[Substitution]:
    """Read a substitution file written by :func:`save_substitutions`.

    Raises:
        ValueError: not a substitution file, or a newer format version.
    """
    with open(path) as f:
        doc = json.load(f)
    if doc.get("format") != "taso_jax.substitutions":
        raise ValueError(f"{path}: not a taso_jax substitution file")
    if doc.get("version", 0) > FORMAT_VERSION:
        raise ValueError(f"{path}: format version {doc['version']} is newer than "
                         f"{FORMAT_VERSION}")
    return [Substitution.from_json(d) for d in doc["substitutions"]]


def default_substitutions() -> list[Substitution]:
    """The generated substitution set shipped inside the package."""
    from importlib.resources import files

    return load_substitutions(files("taso_jax").joinpath("data/substitutions.json"))
