"""Layout normalization: sink transposes through layout-agnostic operators and cancel them.

A program written in NHWC (flax, TensorFlow through tf2onnx) reaches the IR as NCHW
convolutions wrapped in transposes: ``transpose(conv2d(transpose(x)))``, with the batchnorm
scale, bias add and activation in between in NHWC. The substitutions are stated on NCHW
(``conv2d`` then ``ewmul`` by a ``[1, C, 1, 1]`` scale), so they would not match. This pass
rewrites the graph so that every tensor is carried in the layout of its producer and a
transpose is emitted only where an operator needs its input in a given layout:

* ``transpose(transpose(u, p), q)`` is ``transpose(u, p∘q)``, and disappears when that is the
  identity;
* an operator declared with ``layout="elementwise"`` (NumPy broadcasting) applies to the
  untransposed tensor; its other operands are transposed to match (free for weights, which
  are folded ahead of time);
* ``layout="reduce"`` and ``layout="axis"`` operators apply with their axes renumbered.

The result computes exactly the same values (a transpose only moves elements). Runtime
operands other than the leading one are transposed only when all operands already agree;
otherwise the operator's inputs are materialized in their original layout.

:func:`to_nhwc` uses the same pass the other way: it puts a finished graph's convolutions in
NHWC (``conv2d_nhwc``) and lets the transposes between them cancel, a layout candidate for
the end-to-end choice.
"""

from __future__ import annotations

from taso_jax.ir.graph import Graph, Node, Tensor, leaf_node, make_node, rebuild_node
from taso_jax.ops import OPS

__all__ = ["sink_transposes", "squeeze_unit_axes", "to_nhwc", "nhwc_form",
           "has_nchw_convolutions"]

Perm = tuple[int, ...] | None  # None: identity


def _compose(p: Perm, q: tuple[int, ...]) -> Perm:
    """``transpose(transpose(u, p), q) == transpose(u, r)``; returns r (None if identity)."""
    r = tuple(q) if p is None else tuple(p[i] for i in q)
    return None if r == tuple(range(len(r))) else r


def _inverse(p: tuple[int, ...]) -> tuple[int, ...]:
    inv = [0] * len(p)
    for i, x in enumerate(p):
        inv[x] = i
    return tuple(inv)


class _Sinker:
    def __init__(self, graph: Graph, channels_last: bool = False):
        self.graph = graph
        self.wo = graph.weight_only
        self.lazy: dict[Tensor, tuple[Tensor, Perm]] = {}
        self.channels_last = channels_last

    def transpose(self, t: Tensor, perm: Perm) -> Tensor:
        if perm is None:
            return t
        if t.node.op == "transpose":  # the inner transposes of weights fold together too
            return self.transpose(t.node.inputs[0], _compose(t.node.attr("perm"), perm))
        return make_node("transpose", [t], {"perm": perm}).outputs[0]

    def materialize(self, t: Tensor) -> Tensor:
        u, p = self.lazy[t]
        return self.transpose(u, p)

    def run(self) -> Graph:
        for n in self.graph.nodes:
            if n.op in ("input", "weight"):
                self.lazy[n.outputs[0]] = (n.outputs[0], None)
                continue
            if n.op == "transpose":
                u, p = self.lazy[n.inputs[0]]
                self.lazy[n.outputs[0]] = (u, _compose(p, n.attr("perm")))
                continue
            if self.channels_last and self._channels_last(n):
                continue
            kind = OPS[n.op].layout if n.op in OPS else None
            done = False
            if kind is not None and n not in self.wo:
                done = {"elementwise": self._elementwise, "reduce": self._reduce,
                        "axis": self._axis}[kind](n)
            elif n.op in OPS and OPS[n.op].trailing and n not in self.wo:
                done = self._trailing(n)
            if not done:
                ins = [self.materialize(t) for t in n.inputs]
                new = rebuild_node(n, ins)
                for t, nt in zip(n.outputs, new.outputs, strict=True):
                    self.lazy[t] = (nt, None)
        outs = tuple(self.materialize(t) for t in self.graph.outputs)
        return Graph(self.graph.inputs, outs, self.graph.output_names, self.graph.weights,
                     self.graph.meta)

    def _channels_last(self, n: Node) -> bool:
        """Run ``n`` on an NHWC tensor (held transposed) as its ``OpDef.channels_last``."""
        from taso_jax.ops.conv import NHWC_TO_NCHW

        form = OPS[n.op].channels_last if n.op in OPS else None
        if form is None or n in self.wo:
            return False
        u, p = self.lazy[n.inputs[0]]
        if p != NHWC_TO_NCHW:
            return False
        new = make_node(form, [u], n.attr_dict)
        self.lazy[n.outputs[0]] = (new.outputs[0], NHWC_TO_NCHW)
        return True

    def _lead(self, n: Node) -> Perm:
        """The layout to compute ``n`` in: that of its first full-rank transposed operand."""
        rank = len(n.types[0].shape)
        for t in n.inputs:
            u, p = self.lazy[t]
            if p is not None and len(t.shape) == rank and u.node not in self.wo:
                return p
        return None

    def _operand(self, t: Tensor, p: tuple[int, ...], rank: int) -> Tensor | None:
        """``t`` in layout ``p`` (so that transposing it by ``p`` gives ``t``), or None."""
        u, q = self.lazy[t]
        if q == p:
            return u
        if t.node not in self.wo and t.type.size > 1:
            return None  # a runtime tensor in another layout: no gain in moving transposes
        x = self.transpose(u, q)
        if x.type.size == 1:  # a scalar needs no transpose, only the rank
            return x if len(x.shape) == rank else make_node(
                "reshape", [x], {"shape": (1,) * rank}).outputs[0]
        if len(x.shape) < rank:  # NumPy broadcasting aligns on the right
            x = make_node("reshape", [x], {"shape": (1,) * (rank - len(x.shape)) + x.shape}
                          ).outputs[0]
        return self.transpose(x, _inverse(p))

    def _elementwise(self, n: Node) -> bool:
        p = self._lead(n)
        if p is None:
            return False
        rank = len(n.types[0].shape)
        ins = [self._operand(t, p, rank) for t in n.inputs]
        if any(x is None for x in ins):
            return False
        new = rebuild_node(n, ins)
        for t, nt in zip(n.outputs, new.outputs, strict=True):
            self.lazy[t] = (nt, p)
        return True

    def _reduce(self, n: Node) -> bool:
        u, p = self.lazy[n.inputs[0]]
        if p is None:
            return False
        rank = len(p)
        axes = sorted({a % rank for a in n.attr("axes")})
        new_axes = tuple(sorted(p[a] for a in axes))
        keep = n.attr("keepdims")
        new = make_node(n.op, [u], {**n.attr_dict, "axes": new_axes})
        if keep:
            out_perm = p
        else:  # renumber the surviving axes of u in the order the original output has them
            left = [d for d in range(rank) if d not in new_axes]
            out_perm = _compose(None, tuple(left.index(p[i]) for i in range(rank)
                                            if i not in axes))
        self.lazy[n.outputs[0]] = (new.outputs[0], out_perm)
        return True

    def _trailing(self, n: Node) -> bool:
        """A one-input operator on its last ``trailing`` axes, past a transpose of the others.

        ``causal_mask`` of grouped-query scores held as ``[G, B, K, T, S]``: the transpose
        leaves the last two axes in place, so it commutes with the operator.
        """
        if len(n.inputs) != 1 or len(n.outputs) != 1:
            return False
        u, p = self.lazy[n.inputs[0]]
        k, rank = OPS[n.op].trailing, len(n.types[0].shape)
        if p is None or rank < k or tuple(p[rank - k:]) != tuple(range(rank - k, rank)):
            return False
        new = rebuild_node(n, [u])
        self.lazy[n.outputs[0]] = (new.outputs[0], p)
        return True

    def _axis(self, n: Node) -> bool:
        p = self._lead(n)
        if p is None:
            return False
        rank = len(p)
        ins = [self._operand(t, p, rank) for t in n.inputs]
        if any(x is None for x in ins) or any(len(x.shape) != rank for x in ins):
            return False
        axis = n.attr("axis") % rank
        new = make_node(n.op, ins, {**n.attr_dict, "axis": p[axis]})
        for t, nt in zip(n.outputs, new.outputs, strict=True):
            self.lazy[t] = (nt, p)
        return True


def sink_transposes(graph: Graph) -> Graph:
    """Return an equivalent graph with transposes sunk and cancelled (see module doc).

    Shapes and layouts of inputs and outputs are unchanged; weights are shared, not copied.
    """
    return _Sinker(graph).run()


def has_nchw_convolutions(graph: Graph) -> bool:
    """Whether ``graph`` runs any ``conv2d`` (NCHW) at run time."""
    return any(n.op == "conv2d" and not n.weight_only for n in graph.nodes)


def nhwc_form(node: Node) -> Node:
    """The ``conv2d_nhwc`` node that :func:`to_nhwc` runs in place of a ``conv2d`` node.

    ``conv2d(x, w)`` with ``x`` NCHW and ``w`` OIHW becomes ``conv2d_nhwc(x', w')``, ``x'``
    NHWC and ``w'`` HWIO placeholder leaves of the transposed sizes, same attributes. The
    measured cost model prices a convolution by it
    (:class:`taso_jax.search.cost.MeasuredCostModel`, ``nhwc_convolutions``).
    """
    from taso_jax.ops import TensorType
    from taso_jax.ops.conv import NCHW_TO_NHWC, OIHW_TO_HWIO

    x, w = node.inputs[:2]
    leaves = [leaf_node(kind, name, TensorType(tuple(t.shape[i] for i in perm), t.dtype))
              for kind, name, t, perm in (("input", "x", x, NCHW_TO_NHWC),
                                          ("weight", "w", w, OIHW_TO_HWIO))]
    return make_node("conv2d_nhwc", [n.outputs[0] for n in leaves], node.attr_dict)


def to_nhwc(graph: Graph) -> Graph:
    """The same computation with every runtime convolution in NHWC (``conv2d_nhwc``).

    Each ``conv2d(x, w)`` (NCHW x OIHW) becomes ``transpose(conv2d_nhwc(transpose(x),
    transpose(w)))``; then :func:`sink_transposes` carries activations in NHWC from one
    convolution to the next through elementwise, reduction and axis operators, and runs the
    pools between them in NHWC (``maxpool2d_nhwc``, ``avgpool2d_nhwc``: XLA:CPU pools NCHW
    about 3x slower), so that only the graph's inputs and outputs, and operators with a
    fixed layout, keep a transpose. Kernel transposes are weight-only and folded ahead of
    time. Inputs, outputs and values are unchanged: XLA:CPU runs NHWC convolutions up to
    ~2x faster, other backends may not, so the end-to-end choice times the result
    (:func:`taso_jax.search.choose.choose_fastest`).
    """
    from taso_jax.ops.conv import NCHW_TO_NHWC, NHWC_TO_NCHW, OIHW_TO_HWIO

    env: dict[Tensor, Tensor] = {}
    changed = False
    for n in graph.nodes:
        if not n.inputs:
            continue
        ins = [env.get(t, t) for t in n.inputs]
        if n.op == "conv2d" and not n.weight_only:
            xt = make_node("transpose", [ins[0]], {"perm": NCHW_TO_NHWC}).outputs[0]
            wt = make_node("transpose", [ins[1]], {"perm": OIHW_TO_HWIO}).outputs[0]
            y = make_node("conv2d_nhwc", [xt, wt], n.attr_dict).outputs[0]
            env[n.outputs[0]] = make_node("transpose", [y], {"perm": NHWC_TO_NCHW}).outputs[0]
            changed = True
            continue
        new = rebuild_node(n, ins)
        for t, nt in zip(n.outputs, new.outputs, strict=True):
            env[t] = nt
    if not changed:
        return graph
    outs = tuple(env.get(t, t) for t in graph.outputs)
    return _Sinker(Graph(graph.inputs, outs, graph.output_names, graph.weights, graph.meta),
                   channels_last=True).run()


# ---- unit axes ----------------------------------------------------------------------------
# jax.nn.dot_product_attention computes in a 5-D layout ([batch, kv heads, query, group, key]
# and its transposes) that has a group axis of size 1 for plain multi-head attention: the
# scores reach the scale, the mask and the softmax through reshapes and transposes that only
# insert, remove or move unit axes. Such a reshape keeps every element in place (row-major
# order ignores unit axes), so it passes through any operator that acts on trailing axes the
# reshape leaves alone; sinking it there and merging the reshapes that meet leaves the
# 4-D composition that attention's laws are stated on.

def _squeezed(shape) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


def _unit_only(n: Node) -> bool:
    """``n`` is a reshape, or a transpose, that only inserts, removes or moves unit axes."""
    if n.op == "reshape":
        return _squeezed(n.inputs[0].shape) == _squeezed(n.types[0].shape)
    if n.op == "transpose":
        shape = n.inputs[0].shape
        moved = [a for a in n.attr("perm") if shape[a] != 1]
        return moved == sorted(moved)
    return False


def _trailing(n: Node) -> int | None:
    """How many trailing axes ``n`` acts on, independently over the leading ones; else None."""
    d = OPS.get(n.op)
    if d is None:
        return None
    if d.layout == "elementwise":
        return 0
    if d.layout == "axis" and len(n.inputs) == 1:
        axis = n.attr("axis")
        return -axis if axis < 0 else None
    return d.trailing


class _Squeezer:
    """Carries each tensor as ``reshape(base, shape)`` while only unit axes differ."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.wo = graph.weight_only
        self.base: dict[Tensor, Tensor] = {}

    def materialize(self, t: Tensor) -> Tensor:
        u = self.base[t]
        if u.shape == t.shape:
            return u
        return make_node("reshape", [u], {"shape": tuple(t.shape)}).outputs[0]

    def _through(self, n: Node) -> bool:
        """Apply ``n`` to the bases of its inputs where the reshapes commute with it."""
        k = _trailing(n)
        if k is None or n in self.wo or len(n.outputs) != 1:
            return False
        out = n.types[0].shape
        if any(t.shape != out for t in n.inputs):
            return False  # broadcasting: the reshape would not pass through the other operand
        runtime = [self.base[t] for t in n.inputs if t.node not in self.wo]
        if not runtime:
            return False
        shape = runtime[0].shape
        if shape == out or any(b.shape != shape for b in runtime):
            return False
        if k and (len(shape) < k or tuple(shape[-k:]) != tuple(out[-k:])):
            return False
        # Weight-only operands (a broadcast fill, a constant mask) are reshaped to match:
        # that reshape is folded ahead of time.
        bases = [make_node("reshape", [self.materialize(t)], {"shape": tuple(shape)}).outputs[0]
                 if t.node in self.wo else self.base[t] for t in n.inputs]
        new = rebuild_node(n, bases)
        self.base[n.outputs[0]] = new.outputs[0]
        return True

    def run(self) -> Graph:
        for n in self.graph.nodes:
            if n.op in ("input", "weight"):
                self.base[n.outputs[0]] = n.outputs[0]
            elif _unit_only(n) and n not in self.wo:
                self.base[n.outputs[0]] = self.base[n.inputs[0]]
            elif not self._through(n):
                new = rebuild_node(n, [self.materialize(t) for t in n.inputs])
                for t, nt in zip(n.outputs, new.outputs, strict=True):
                    self.base[t] = nt
        outs = tuple(self.materialize(t) for t in self.graph.outputs)
        return Graph(self.graph.inputs, outs, self.graph.output_names, self.graph.weights,
                     self.graph.meta)


def squeeze_unit_axes(graph: Graph) -> Graph:
    """Return an equivalent graph with the reshapes that only move unit axes sunk and merged.

    A reshape or transpose that only inserts, removes or moves axes of size 1 is carried
    lazily and passes through elementwise operators (operands of one shape), one-input
    ``layout="axis"`` operators over a negative axis, and operators declaring
    ``OpDef.trailing``, as long as the trailing axes they act on are unchanged; it is written
    out, as one reshape, where something else reads the tensor. Values are unchanged (such a
    reshape moves no element). Inputs, outputs and their shapes are unchanged.
    """
    return _Squeezer(graph).run()
