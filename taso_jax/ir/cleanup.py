"""The cleanup every imported graph gets: identity chains removed, sizes read where fixed.

Two kinds of clean-up need no pass here, since the IR is built that way: a node whose
outputs reach no graph output is not in the graph (:attr:`Graph.nodes` walks back from the
outputs), and two nodes with the same operator, attributes and inputs are one node
(hash-consing). :func:`simplify` removes what is left of the chains exporters write:

* ``reshape(x, shape(x)) = x`` (sizes equal at every binding of the open sizes,
  :func:`~taso_jax.ops.dims.same_size`);
* ``reshape(reshape(x, s), t) = reshape(x, t)`` (a reshape reads elements in row-major
  order, so only the last target counts; ONNX operator spec, Reshape);
* ``cast(x, dtype(x)) = x`` (ONNX Cast to the input's own type is the identity);
* ``transpose(x, (0, 1, ..., n-1)) = x`` and
  ``transpose(transpose(x, p), q) = transpose(x, p[q])`` (ONNX Transpose: output axis
  ``i`` is input axis ``perm[i]``);
* ``reduce(transpose(x, p), axes) = transpose(reduce(x, p[axes]), q)`` for an operator
  declared ``layout="reduce"`` (``ReduceMean``, ``ReduceSum``, ...): the reduction reads the
  same elements; ``q`` puts the axes left in the order the transposed tensor had them,
  and is no transpose at all where they keep their order (``keepdims=0``), or a reshape
  that only moves axes of size 1 (``keepdims=1``). Taken where no transpose is left after
  it, or where the reduction was the transpose's only reader (the transpose left is of the
  smaller, reduced tensor). onnxruntime's transpose optimizer does the same on its own (a
  ``Transpose`` then ``ReduceMean`` ran as one ``ReduceMean``); the search and the cost
  model see the simpler graph.
* ``x * 1 = x``, ``x / 1 = x``, ``x + 0 = x``, ``x - 0 = x`` where the constant's
  broadcast leaves ``x``'s type as it is (a ``Mul`` by 1.0 that exporters leave, which
  also keeps onnxruntime from fusing the convolution before it with what follows).

A graph output keeps its name, type and open sizes: only the tensor computing it changes,
to one equal at every binding.

:func:`flush_negligible_weights` is the one step that is not an identity: it zeroes the
elements of a weight, read as a dot product's operand, that are too small to change any sum
they enter in floating point but make a CPU slow (see there).

Sizes that a model reads at run time (an ONNX ``Shape``, kept opaque) are another matter:
the front door that knows what the opaque node is folds them
(:func:`taso_jax.frontends.onnx_cleanup.fold_static_sizes`) before this pass.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np

from taso_jax.ir.graph import Graph, Node, Tensor, intern_node, leaf_node, make_node
from taso_jax.ops import OPS, get_op
from taso_jax.ops.dims import same_size

__all__ = ["simplify", "rebuild", "flush_negligible_weights", "negligible_limit"]


def _same_shape(a, b) -> bool:
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b, strict=True))


#: ``op -> (neutral value, the operand positions it may take)``: ``x * 1 = x``, ``x / 1 =
#: x``, ``x + 0 = x``, ``x - 0 = x`` (exact in IEEE arithmetic, but for the sign of a zero).
_NEUTRAL = {"ewmul": (1, (0, 1)), "ewdiv": (1, (1,)), "ewadd": (0, (0, 1)), "ewsub": (0, (1,))}
#: The largest constant looked at for a neutral element (elements).
_NEUTRAL_MAX_SIZE = 1 << 16


def _neutral_operand(node: Node, weights) -> tuple[Tensor, str] | None:
    """``x`` for ``x * 1``, ``x / 1``, ``x + 0`` or ``x - 0``, else ``None``.

    Only where the constant's broadcast leaves ``x``'s type as it is (sizes equal at every
    binding, same element type).
    """
    value, places = _NEUTRAL[node.op]
    for k in places:
        c, x = node.inputs[k], node.inputs[1 - k]
        if c.node.op != "weight" or c.node.name not in weights:
            continue
        array = weights[c.node.name]
        if (array.size <= _NEUTRAL_MAX_SIZE and np.all(array == value)
                and x.dtype == node.types[0].dtype
                and _same_shape(x.shape, node.types[0].shape)):
            return x, f"{node.op}_neutral"
    return None


def _reduce_of_transpose(node: Node, readers: Counter) -> tuple[Tensor, str] | None:
    """``reduce(x, p[axes])`` for ``reduce(transpose(x, p), axes)``, put back in order.

    ``None`` where a transpose would be left after the reduction and the transpose before
    it has readers besides ``node`` (``readers``: tensor -> how many nodes and graph
    outputs read it; a tensor not counted there counts as read elsewhere).
    """
    t = node.inputs[0]
    axes = node.attr("axes")
    if t.node.op != "transpose" or not axes:  # no axes: no reduction (the IR's convention)
        return None
    x, perm = t.node.inputs[0], tuple(t.node.attr("perm"))
    rank = len(perm)
    reduced = {a % rank for a in axes}
    inner = tuple(sorted(perm[a] for a in reduced))
    left = [d for d in range(rank) if d not in inner]  # the axes of x the output keeps
    order = tuple(left.index(perm[i]) for i in range(rank) if i not in reduced)
    y = make_node(node.op, [x], {**node.attr_dict, "axes": inner}).outputs[0]
    out = node.types[0].shape
    if order == tuple(range(len(order))):  # the axes left keep their order
        if _same_shape(y.shape, out):
            return y, "reduce_of_transpose"
        # keepdims: only axes of size 1 move, which keeps the row-major order
        return make_node("reshape", [y], {"shape": tuple(out)}).outputs[0], \
            "reduce_of_transpose"
    if readers.get(t, 2) > 1:
        return None
    if node.attr("keepdims"):
        return make_node("transpose", [y], {"perm": perm}).outputs[0], "reduce_of_transpose"
    return make_node("transpose", [y], {"perm": order}).outputs[0], "reduce_of_transpose"


def _simpler(node: Node, weights, readers: Counter) -> tuple[Tensor, str] | None:
    """An equal, simpler tensor for ``node``'s output and the law used, or ``None``."""
    if node.op in _NEUTRAL:
        return _neutral_operand(node, weights)
    if node.op in OPS and OPS[node.op].layout == "reduce":
        return _reduce_of_transpose(node, readers)
    if node.op == "reshape":
        (x,) = node.inputs
        if _same_shape(x.shape, node.types[0].shape) and x.dtype == node.types[0].dtype:
            return x, "reshape_to_own_shape"
        if x.node.op == "reshape":  # only the last target counts
            inner = x.node.inputs[0]
            if _same_shape(inner.shape, node.types[0].shape):
                return inner, "reshape_chain"
            return make_node("reshape", [inner], node.attr_dict).outputs[0], "reshape_chain"
    elif node.op == "cast":
        (x,) = node.inputs
        if x.dtype == node.types[0].dtype:
            return x, "cast_to_own_type"
    elif node.op == "transpose":
        (x,) = node.inputs
        perm = tuple(node.attr("perm"))
        if x.node.op == "transpose":  # transpose(transpose(u, p), q) = transpose(u, p[q])
            p = tuple(x.node.attr("perm"))
            x, perm = x.node.inputs[0], tuple(p[i] for i in perm)
            if perm != tuple(range(len(perm))):
                return (make_node("transpose", [x], {"perm": perm}).outputs[0],
                        "transpose_chain")
            return x, "transpose_chain"
        if perm == tuple(range(len(perm))):
            return x, "transpose_identity"
    return None


def rebuild(graph: Graph, replace: Callable[[Node], tuple[Tensor, str] | None],
            weights: dict | None = None, readers: Counter | None = None
            ) -> tuple[Graph, Counter]:
    """``graph`` with each node rebuilt on its new inputs and offered to ``replace``.

    One pass in topological order: a node whose inputs changed is rebuilt (hash-consing
    merges it with an equal node), then ``replace(node)`` may give an equal tensor (a
    tuple of them, one per output, for a node of several) to use instead and the name of
    the law used (counted). ``replace`` sees a node's inputs
    already replaced, so chains collapse in one pass. ``weights`` are added to the graph's
    (a ``replace`` that makes constants puts them there). ``readers`` (tensor -> how many
    nodes and graph outputs read it), where given, is kept up to date for the pass: a
    rebuilt or replacing tensor takes over the readers of the one it stands for.

    Returns:
        ``(graph, counts)``: the new graph (the same object where nothing changed) and how
        often each law was used.
    """
    counts: Counter = Counter()
    new: dict[Tensor, Tensor] = {}
    for n in graph.nodes:
        if not n.inputs:
            continue
        ins = tuple(new.get(t, t) for t in n.inputs)
        m = n if ins == n.inputs else intern_node(n.op, n.attrs, ins, n.types)
        if readers is not None and m is not n:
            for t, u in zip(n.outputs, m.outputs, strict=True):
                readers[u] += readers[t]
        found = replace(m)
        if found is not None:
            value, law = found
            counts[law] += 1
            values = value if isinstance(value, tuple) and not isinstance(value, Tensor) \
                else (value,)
            new.update(zip(n.outputs, values, strict=True))
            if readers is not None:
                for t, v in zip(n.outputs, values, strict=True):
                    readers[v] += readers[t]
            continue
        if m is not n:
            for t, u in zip(n.outputs, m.outputs, strict=True):
                new[t] = u
    if not new:
        return graph, counts
    outputs = tuple(new.get(t, t) for t in graph.outputs)
    return Graph(graph.inputs, outputs, graph.output_names,
                 {**graph.weights, **(weights or {})}, graph.meta), counts


def simplify(graph: Graph) -> tuple[Graph, Counter]:
    """``graph`` without identity reshapes, casts, transposes and neutral elements.

    Reductions of a transposed tensor read the tensor itself (the module's law).

    The laws are the module's; each output keeps its name and its type (equal sizes at
    every binding). Returns ``(graph, counts)``: counts by law, empty where nothing was
    simplified (and then the graph is ``graph`` itself).
    """
    readers = Counter(t for n in graph.nodes for t in n.inputs)
    readers.update(graph.outputs)
    return rebuild(graph, lambda node: _simpler(node, graph.weights, readers))


def negligible_limit(array: np.ndarray) -> float:
    """The magnitude below which an element of ``array`` is zeroed as a dot product's operand.

    For float32 ``min(2**-100, 2**-46 * max|array|)``, in general ``min(tiny * 2**(nmant + 3),
    eps**2 * max|array|)`` of the element type (``numpy.finfo``); 0.0 (nothing zeroed) for
    types other than float32 and float64 (float16 runs converted to float32 on a CPU). Why:
    :func:`flush_negligible_weights`.
    """
    if array.dtype not in (np.float32, np.float64) or array.size == 0:
        return 0.0
    info = np.finfo(array.dtype)
    largest = float(np.max(np.abs(array)))
    return min(float(info.tiny) * 2.0 ** (info.nmant + 3), float(info.eps) ** 2 * largest)


def flush_negligible_weights(graph: Graph) -> tuple[Graph, Counter]:
    """``graph`` with the negligible elements of weights read as dot-product operands zeroed.

    An operand of a dot product (``OpDef.dot_operands``: a convolution's kernel, a matmul's
    weight) that is a float32 weight loses each element ``w`` with ``|w| <``
    :func:`negligible_limit` (``2**-100``): ``w * x`` is then a subnormal number wherever
    ``|x| < 2**-26``, which costs an x86 CPU without flush-to-zero a microcode assist of
    some hundred cycles per multiply-add (onnxruntime's MLAS kernels run with subnormals
    on: one 480x480 1x1 convolution of paddleocr's PP-OCRv4 recognizer, 3,530 subnormal
    and 18,063 more such kernel elements of 230,400, took 54 ms instead of 0.9 ms), while
    the term dropped, ``|w * x| < 2**-100 * |x|``, changes no output whose magnitude is over
    ``2**-76 * |x|`` (float32 resolves ``2**-24``). A tensor whose elements are all tiny
    keeps them (the limit is also ``eps**2`` of its largest element). The weight becomes a
    new one (``<name>_flushed``), so other readers of it keep its values (a weight no other
    node reads leaves the graph's weights); a weight with no such element is left as it
    is. Returns ``(graph, counts)`` as :func:`rebuild`, counted once per dot product
    changed (``negligible_weight_zeroed``).
    """
    made: dict[str, np.ndarray] = {}
    flushed: dict[str, Tensor | None] = {}

    def flush(t: Tensor) -> Tensor | None:
        name = t.node.name
        if name not in flushed:
            flushed[name] = None
            array = np.asarray(graph.weights[name])
            limit = negligible_limit(array)
            small = (np.abs(array) < limit) & (array != 0)
            if small.any():
                new = f"{name}_flushed"
                while new in graph.weights or new in made:
                    new += "_"
                made[new] = np.where(small, np.zeros((), array.dtype), array)
                flushed[name] = leaf_node("weight", new, t.node.types[0]).outputs[0]
        return flushed[name]

    def replace(node: Node):
        ins = list(node.inputs)
        for k in _dot_operands(node.op):
            t = ins[k]
            if t.node.op == "weight" and t.node.name in graph.weights:
                ins[k] = flush(t) or t
        if tuple(ins) == node.inputs:
            return None
        outs = intern_node(node.op, node.attrs, tuple(ins), node.types).outputs
        return (outs if len(outs) > 1 else outs[0]), "negligible_weight_zeroed"

    new, counts = rebuild(graph, replace, made)
    live = {n.name for n in new.nodes if n.op == "weight"}
    gone = [k for k, v in flushed.items() if v is not None and k not in live]
    if not gone:  # no weight was read by its dot products only
        return new, counts
    weights = {k: v for k, v in new.weights.items() if k not in gone}
    return Graph(new.inputs, new.outputs, new.output_names, weights, new.meta), counts


def _dot_operands(op: str) -> tuple[int, ...]:
    """``OpDef.dot_operands`` of ``op``; none for a name the registry does not declare."""
    try:
        return get_op(op).dot_operands
    except KeyError:  # opaque nodes and the like
        return ()
