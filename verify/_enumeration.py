"""Enumeration and fingerprinting of expressions over a domain (generator stages 1 and 2).

:func:`_enumerate` builds every expression of up to ``max_ops`` operators over a
:class:`~taso_jax.verify.domains.Domain` as hash-consed graph nodes, extending only the first
expression of each fingerprint class, and evaluates each in float64 on random inputs;
:class:`_Fingerprinter` keys a value by its shape, dtype and two rounded random projections,
so that expressions computing the same function fall into one class. The pairing of classes
into substitutions is in :mod:`taso_jax.verify._pairing`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np
from taso_jax.ops import OPS, ShapeError, TensorType
from taso_jax.verify.domains import Domain

from taso_jax.ir.executor import run_node
from taso_jax.ir.graph import Node, Tensor, leaf_node, make_node


def _enable_x64():
    return jax.enable_x64(True)


def _instance_shape(pattern: tuple, inst: dict) -> tuple[int, ...]:
    out: list[int] = []
    for p in pattern:
        if p == "...":
            out.extend(inst["..."])
        else:
            out.append(p if isinstance(p, int) else inst[p])
    return tuple(out)


class _Fingerprinter:
    def __init__(self, seed: int):
        self.seed = seed
        self.values: dict[Tensor, np.ndarray] = {}
        self._proj: dict[tuple, np.ndarray] = {}

    def key(self, t: Tensor) -> tuple:
        return self.key_of(self.values[t], t.dtype)

    def key_of(self, value: np.ndarray, dtype: str) -> tuple:
        """The fingerprint of a value: its shape, dtype and two rounded projections."""
        shape = tuple(value.shape)
        v = value.reshape(-1)
        if shape not in self._proj:
            rng = np.random.default_rng([self.seed, *shape, 7919])
            self._proj[shape] = rng.standard_normal((2, v.size))
        p = self._proj[shape] @ v
        scale = max(float(np.sqrt(np.sum(v * v))), 1e-300) * 1e-9
        return (shape, dtype) + tuple("0" if abs(x) < scale else f"{x:.9e}" for x in p)


@dataclass
class _Expr:
    tensor: Tensor
    nodes: frozenset
    vars: frozenset


def _enumerate(domain: Domain, max_ops: int, seed: int, progress: Callable | None):
    inst = domain.instances[0]
    rng = np.random.default_rng(seed)
    fp = _Fingerprinter(seed)
    leaves: dict[str, Tensor] = {}
    for name, (kind, pat) in domain.variables.items():
        t = leaf_node(kind, name, TensorType(_instance_shape(pat, inst), "float64")).outputs[0]
        leaves[name] = t
        fp.values[t] = rng.standard_normal(t.shape)
    exprs: dict[Tensor, _Expr] = {
        t: _Expr(t, frozenset(), frozenset([n])) for n, t in leaves.items()}
    classes: dict[tuple, list[_Expr]] = {}
    reps: list[_Expr] = []
    for e in exprs.values():
        classes.setdefault(fp.key(e.tensor), []).append(e)
        reps.append(e)
    sym_values = {v: k for k, v in inst.items() if isinstance(v, int)}

    inputs = domain.input_names
    reads_input: dict[Node, bool] = {}

    def add(node: Node, ins: list[_Expr]) -> None:
        nodes = frozenset().union(*(e.nodes for e in ins)) | {node}
        if len(nodes) > size or any(t in exprs for t in node.outputs):
            return
        if domain.weight_ops is not None:
            reads_input[node] = any(e.vars & inputs for e in ins)
            if not reads_input[node] and node.op not in domain.weight_only_ops:
                return
            runtime = sum(reads_input[n] for n in nodes)
            if runtime > max_ops or len(nodes) - runtime > domain.weight_ops:
                return
        vals = run_node(node, [fp.values[e.tensor] for e in ins])
        for t, v in zip(node.outputs, vals, strict=True):
            fp.values[t] = np.asarray(v)
            e = _Expr(t, nodes, frozenset().union(*(e.vars for e in ins)))
            exprs[t] = e
            cls = classes.setdefault(fp.key(t), [])
            cls.append(e)
            if len(cls) == 1:
                new_reps.append(e)

    if domain.max_ops is not None:
        max_ops = min(max_ops, domain.max_ops)
    for size in range(1, max_ops + (domain.weight_ops or 0) + 1):
        new_reps: list[_Expr] = []
        pool = [e for e in reps if len(e.nodes) < size]
        for op, attrs in domain.ops:
            arity = OPS[op].arity or 2
            for combo in itertools.product(pool, repeat=arity):
                if sum(len(e.nodes) for e in combo) < size - 1:
                    continue
                try:
                    node = make_node(op, [e.tensor for e in combo], attrs)
                except ShapeError:
                    continue
                add(node, list(combo))
        for e in pool:
            for axis in domain.split_axes:
                d = e.tensor.shape[axis] if len(e.tensor.shape) >= -axis else 0
                for a in sym_values:
                    if 0 < a < d and (d - a) in sym_values:
                        try:
                            node = make_node("split", [e.tensor], {"axis": axis,
                                                                  "sizes": (a, d - a)})
                        except ShapeError:
                            continue
                        add(node, [e])
        reps.extend(new_reps)
        if progress:
            progress(f"{domain.name}: size {size}: {len(exprs)} expressions")
    return leaves, exprs, classes, sym_values, fp
