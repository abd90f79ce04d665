"""The one import context that ONNX and jaxpr importers see.

An operator declaration registers importers (``taso_jax.ops.onnx_importer`` and
``taso_jax.ops.jaxpr_importer``); each is called as ``fn(ctx, inputs, **attributes)`` with an
:class:`ImportContext`, whichever front door is importing.
"""

from __future__ import annotations

import numpy as np

from taso_jax.ir.executor import run_node
from taso_jax.ir.graph import Tensor, leaf_node, make_node
from taso_jax.ops import OPS, TensorType
from taso_jax.ops.dims import is_open

__all__ = ["ImportContext"]


class ImportContext:
    """What an operator's importer sees while a model or a jaxpr is imported.

    Attributes:
        weights: weight name -> array; :meth:`weight` adds to it.
        constants: names of the weights whose *values* may be read at import time
            (:meth:`const`); ``None`` means every weight (an ONNX initializer is fixed). A JAX
            function's weight arguments are not constants: the graph must stay valid when it
            is called again with other weight values.
        opset: the model's ONNX opset (``None`` for a jaxpr).
        source_op: the ONNX op type or JAX primitive being imported (``"MaxPool"``,
            ``"sub"``): importers registered for several read it.
        out_types: the :class:`TensorType` of each output of that node or equation.
        out_fixed: per output, one flag per axis where the symbolic inference of a model's
            open sizes reached it: whether that size is a number at every binding (an
            importer must not take it for an open size that equals it at the binding);
            ``None`` where nothing is known.
        dedupe_literals: equal constant arrays become one weight (jaxpr literals repeat).
    """

    def __init__(self, weights: dict[str, np.ndarray], opset: int | None = None,
                 constants: set[str] | None = None, dedupe_literals: bool = False):
        self.weights = weights
        self.opset = opset
        self.constants = constants
        self.source_op = ""
        self.out_types: list[TensorType] = []
        self.out_fixed: list[tuple | None] = []
        self.static_axes: dict | None = None  # value name -> flags (the ONNX import sets it)
        self._dedupe = dedupe_literals
        self._literals: dict[tuple, Tensor] = {}
        self._cache: dict[Tensor, np.ndarray | None] = {}

    def op(self, name: str, inputs, **attrs):
        """A node of a declared operator: its tensor, or a list for several outputs.

        Raises:
            ShapeError: the operator's shape rule rejects the inputs.
        """
        node = make_node(name, inputs, attrs)
        return node.outputs[0] if len(node.types) == 1 else list(node.outputs)

    def type(self, t: Tensor) -> TensorType:
        """The static type of a tensor."""
        return t.type

    def weight(self, array, prefix: str = "const") -> Tensor:
        """A new weight holding ``array`` (a constant: its value may be read back)."""
        array = np.asarray(array)
        key = (array.dtype.str, array.shape, array.tobytes()) if self._dedupe else None
        if key is not None and key in self._literals:
            return self._literals[key]
        i = len(self.weights)
        while f"{prefix}_{i}" in self.weights:
            i += 1
        name = f"{prefix}_{i}"
        self.weights[name] = array
        if self.constants is not None:
            self.constants.add(name)
        t = leaf_node("weight", name, TensorType(array.shape, str(array.dtype))).outputs[0]
        if key is not None:
            self._literals[key] = t
        return t

    def scalar(self, value, dtype: str) -> Tensor:
        """A 0-d constant of ``dtype``."""
        return self.weight(np.asarray(value, dtype))

    def transpose(self, t: Tensor, perm) -> Tensor:
        """``t`` transposed by ``perm`` (``t`` itself for the identity)."""
        perm = tuple(int(p) for p in perm)
        return t if perm == tuple(range(len(perm))) else self.op("transpose", [t], perm=perm)

    def reshape(self, t: Tensor, shape) -> Tensor:
        """``t`` reshaped to ``shape`` (``t`` itself when the shape is already that).

        Open sizes (:class:`~taso_jax.ops.dims.Dim`) stay open.
        """
        shape = tuple(d if is_open(d) else int(d) for d in shape)
        return t if t.shape == shape else self.op("reshape", [t], shape=shape)

    def weight_only(self, t: Tensor) -> bool:
        """Whether ``t`` depends on weights and constants only (computed ahead of time)."""
        return t.node.weight_only

    def const(self, t: Tensor):
        """The value of a tensor computed from constants only, else ``None``.

        The weight-only nodes it depends on are folded in dependency order with an explicit
        stack: a chain of thousands of constant operators (an exporter's unfolded arithmetic)
        would exceed Python's recursion limit if folded by recursion.
        """
        if t in self._cache:
            return self._cache[t]
        if not self.weight_only(t):
            return None
        todo = [t.node]
        while todo:
            n = todo[-1]
            if Tensor(n, 0) in self._cache:
                todo.pop()
                continue
            waiting = [x.node for x in n.inputs if x not in self._cache]
            if waiting:
                todo.extend(waiting)
                continue
            todo.pop()
            self._fold(n)
        return self._cache[t]

    def _fold(self, n) -> None:
        """Cache the values of ``n``'s outputs (``None`` where unknown); its inputs' are cached."""
        values = [None] * len(n.types)
        if n.op == "weight":
            if self.constants is None or n.name in self.constants:
                values = [self.weights[n.name]]
        elif n.op in OPS:
            args = [self._cache[x] for x in n.inputs]
            if all(a is not None for a in args):
                exact = OPS[n.op].numpy_ref  # folds without loading JAX
                outs = (exact(*args, **dict(n.attrs)),) if exact else run_node(n, args)
                values = [np.asarray(v).astype(n.types[i].dtype) for i, v in enumerate(outs)]
        for i, v in enumerate(values):
            self._cache[Tensor(n, i)] = v
