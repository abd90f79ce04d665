"""Clean-up of an imported ONNX model: sizes read where fixed, and what the file ran for nothing.

:func:`clean_imported` runs at the end of :func:`~taso_jax.frontends.onnx_io.load_onnx`,
before any search, so the search sees the simple graph:

* :func:`merge_duplicate_regions`: opaque ONNX nodes computing the same thing under two
  names become one.
* :func:`fold_static_sizes`: an ONNX ``Shape`` (ONNX operator spec, Shape: the input's
  sizes as a 1-D int64 tensor, from ``start`` to ``end``) is kept opaque, since it reads
  sizes, not values; where every size it reads is fixed (not open,
  :func:`~taso_jax.ops.dims.is_open`) it becomes a constant, and a ``Gather`` or
  ``Slice`` of fixed entries of a ``Shape`` whose other entries are open becomes one too.
  What follows (``Cast``, ``Sqrt``, ``Div``: an attention scale) then reads weights only,
  and is computed once, ahead of time. Where a size read is open the chain is kept, so the
  written file still runs at every size.
* :func:`drop_zero_states`: an LSTM's or GRU's initial state (or bias, or peepholes) that
  is zero at every size, as PyTorch writes a default state (``ConstantOfShape`` of
  ``Shape(x)``, sliced per layer), becomes a zero weight, which the export omits (ONNX
  LSTM/GRU: an absent optional input is zero), so the file no longer computes it.
* :func:`~taso_jax.ir.cleanup.simplify`: identity reshapes, casts and transposes.
* :func:`~taso_jax.ir.cleanup.flush_negligible_weights`: kernel elements too small to
  change a sum (under ``2**-100`` in float32) but slow on a CPU, zeroed.

:func:`file_leftovers` counts what the file itself runs that the imported graph does not:
nodes whose outputs reach no graph output, ``Identity`` nodes, nodes computing what
another identical node computes. A model that has any is worth writing as exported even
where the search finds nothing (the pipeline then times it against the file:
:meth:`taso_jax.cli_optimize._OnnxFile.admit`).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from taso_jax.frontends.onnx_opaque import _outer_names
from taso_jax.ir.cleanup import flush_negligible_weights, rebuild, simplify
from taso_jax.ir.graph import Graph, Node, Tensor, intern_node, leaf_node
from taso_jax.ir.weight_folds import fold_affine_into_products
from taso_jax.ops import OPS, TensorType
from taso_jax.ops.dims import is_open
from taso_jax.ops.recurrent import ONNX_STATE_SLOTS, ZERO_WHEN_ABSENT

__all__ = ["clean_imported", "fold_static_sizes", "merge_duplicate_regions", "drop_zero_states",
           "file_leftovers", "is_zero", "fixed_sizes_read", "fold_fixed_sizes", "written_forms"]


def _shape_range(node: Node) -> tuple[int, int, str] | None:
    """``(start, end, input name)`` of an opaque node that is one ONNX ``Shape``, else None."""
    call = node.attr("call")
    if node.op != "opaque" or getattr(call, "label", None) != "Shape" or len(call.nodes) != 1:
        return None
    from onnx import helper

    (proto,) = call.protos()
    attrs = {a.name: helper.get_attribute_value(a) for a in proto.attribute}
    return (*_shape_span(attrs, len(node.inputs[0].shape)), proto.input[0])


def _shape_span(attrs: dict, rank: int) -> tuple[int, int]:
    """``(start, end)`` of the axes an ONNX ``Shape`` reads.

    ONNX spec, Shape-15: negative values count from the end, both are clamped to
    ``[0, rank]``.
    """
    start, end = int(attrs.get("start", 0)), int(attrs.get("end", rank))
    start = min(max(start + rank if start < 0 else start, 0), rank)
    end = min(max(end + rank if end < 0 else end, 0), rank)
    return start, end


class _Open:
    """A size held as a plain integer that may vary with the model's open sizes.

    The symbolic inference did not follow it (:func:`fold_static_sizes`): never folded.
    """

    def __init__(self, d):
        self.d = d

    def __int__(self):
        return int(self.d)


def fold_static_sizes(graph: Graph, static_axes: dict | None = None) -> tuple[Graph, Counter]:
    """``graph`` with each ``Shape`` that reads fixed sizes only made a constant.

    A ``gather`` of constant indices or a ``slice`` from a ``Shape`` with open sizes
    becomes a constant where every entry it reads is fixed (``Shape(x)[2]`` of an ``x`` of sizes
    ``[N, 16, 64]`` is 64 at every ``N``). ``static_axes`` (ONNX value name -> one flag per
    axis), where the model has open sizes, says which sizes the symbolic inference of the
    open model found to be numbers
    (:func:`~taso_jax.frontends.onnx_symbolic.open_types`): a size it left unknown may
    still vary with the open ones though the import holds it as an integer, so only the
    flagged ones fold (a name it did not infer folds nothing). ``None``: the model's sizes
    are all fixed. Returns ``(graph, counts)`` as :func:`~taso_jax.ir.cleanup.rebuild`.
    """
    made: dict[str, np.ndarray] = {}

    def constant(value: np.ndarray) -> Tensor:
        name = f"static_size_{len(made)}"
        while name in graph.weights:
            name += "_"
        made[name] = value
        return leaf_node("weight", name, TensorType(value.shape, str(value.dtype))).outputs[0]

    def sizes(t: Tensor) -> tuple | None:
        span = _shape_range(t.node)
        if span is None:
            return None
        read = t.node.inputs[0].shape[span[0]:span[1]]
        if static_axes is None:
            return read
        flags = static_axes.get(span[2], ())[span[0]:span[1]]
        return tuple(d if k < len(flags) and flags[k] else _Open(d)
                     for k, d in enumerate(read))

    def fixed(ds) -> bool:
        return not any(is_open(d) or isinstance(d, _Open) for d in ds)

    def replace(node: Node):
        if node.op == "opaque" and len(node.types) == 1:
            read = sizes(node.outputs[0])
            if read is not None and fixed(read):
                return constant(np.array([int(d) for d in read], np.int64)), "static_shape"
        elif node.op == "slice":  # a 1-D slice of a shape: its bounds are plain integers
            read = sizes(node.inputs[0])
            if read is None:
                return None
            (s,), (e,), (st,) = (node.attr(k) for k in ("starts", "ends", "steps"))
            picked = list(read)[slice(int(s), int(e) if int(e) >= 0 else None, int(st))]
            if fixed(picked):
                return (constant(np.array([int(d) for d in picked], np.int64)),
                        "static_size_slice")
        elif node.op == "gather" and node.inputs[1].node.op == "weight":
            read = sizes(node.inputs[0])
            if read is None:
                return None
            idx = np.asarray(graph.weights.get(node.inputs[1].node.name, made.get(
                node.inputs[1].node.name)))
            picked = [read[int(i)] for i in np.ravel(idx)] if idx.size else []
            if fixed(picked):
                value = np.array([int(d) for d in picked], np.int64).reshape(idx.shape)
                return constant(value), "static_size_gather"
        return None

    return rebuild(graph, replace, made)


def merge_duplicate_regions(graph: Graph) -> tuple[Graph, Counter]:
    """``graph`` with opaque ONNX nodes that compute the same thing made one.

    Hash-consing merges equal declared nodes, but an opaque node's identity holds its
    tensors' names (:class:`~taso_jax.frontends.onnx_opaque.OnnxNode`), so two ``Shape``
    nodes of one tensor stay two. Single nodes with the same domain, type and attributes
    reading the same tensors are one here (ONNX operators are functions of these;
    ``Random*``, ``Multinomial`` and nodes with subgraphs are left alone). Returns
    ``(graph, counts)`` as :func:`~taso_jax.ir.cleanup.rebuild`.
    """
    from onnx import AttributeProto

    seen: dict = {}

    def replace(node: Node):
        call = node.attr("call")
        if node.op != "opaque" or len(getattr(call, "nodes", ())) != 1:
            return None
        (proto,) = call.protos()
        if (proto.op_type.startswith("Random") or proto.op_type == "Multinomial"
                or any(a.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS)
                       for a in proto.attribute)):
            return None
        key = (proto.domain, proto.op_type, node.inputs, node.types,
               tuple(a.SerializeToString() for a in proto.attribute))
        first = seen.setdefault(key, node)
        return None if first is node else (first.outputs, "duplicate_opaque")

    return rebuild(graph, replace)


def is_zero(t: Tensor, weights: dict, depth: int = 16) -> bool:
    """Whether tensor ``t`` is zero in every element at every binding of the open sizes.

    True for a weight of zeros, an opaque ONNX ``ConstantOfShape`` whose ``value`` is zero
    (or absent: ONNX's default is a float32 zero), and the output of an operator that only
    copies elements (``OpDef.copies_values``, with no nonzero ``value`` to pad with) whose
    inputs of the output's element type are all such tensors; False otherwise (``depth``
    bounds the walk).
    """
    node = t.node
    if node.op == "weight":
        value = weights.get(node.name)
        return value is not None and not np.any(np.asarray(value))
    if depth <= 0:
        return False
    if node.op == "opaque":
        call = node.attr("call")
        if getattr(call, "label", None) != "ConstantOfShape" or len(call.nodes) != 1:
            return False
        from onnx import numpy_helper

        (proto,) = call.protos()
        value = [numpy_helper.to_array(a.t) for a in proto.attribute if a.name == "value"]
        return not value or not np.any(value[0])
    opdef = OPS.get(node.op)
    if opdef is None or not opdef.copies_values or node.attr("value", 0.0) != 0:
        return False
    data = [u for u in node.inputs if u.dtype == t.dtype]
    return bool(data) and all(is_zero(u, weights, depth - 1) for u in data)


def drop_zero_states(graph: Graph) -> tuple[Graph, Counter]:
    """``graph`` with each optional LSTM/GRU input that is zero (:func:`is_zero`) a zero weight.

    A recurrence's ``B``, ``initial_h``, ``initial_c`` and ``P`` inputs mean zero where
    absent (ONNX operator specification, LSTM and GRU, opsets 7-22). PyTorch writes a
    default ``h0`` as ``ConstantOfShape`` of sizes read from the input (the batch is open),
    then slices it per layer; such an input becomes a zero weight of its type (at the
    bound sizes), which the ONNX export writes as an absent input
    (:func:`ops.recurrent._emit`), so the file runs at every batch size and computes no
    state. Returns ``(graph, counts)`` as :func:`~taso_jax.ir.cleanup.rebuild`.
    """
    made: dict[str, np.ndarray] = {}
    weights = graph.weights

    def replace(node: Node):
        if node.op == "opaque":
            return _opaque_without_zero_states(node, weights)
        slots = ZERO_WHEN_ABSENT.get(node.op, ())
        swap = [k for k in slots if k < len(node.inputs)
                and node.inputs[k].node.op != "weight" and is_zero(node.inputs[k], weights)]
        if not swap:
            return None
        ins = list(node.inputs)
        for k in swap:
            t = ins[k]
            name = f"{node.op}_zero_state_{len(made)}"
            while name in weights or name in made:
                name += "_"
            made[name] = np.zeros(tuple(int(d) for d in t.shape), t.dtype)
            ins[k] = leaf_node("weight", name, TensorType(made[name].shape, t.dtype)).outputs[0]
        new = intern_node(node.op, node.attrs, tuple(ins), node.types)
        return new.outputs, "zero_recurrent_input"

    return rebuild(graph, replace, made)


def _opaque_without_zero_states(node: Node, weights: dict):
    """An opaque recurrence (``ops.recurrent.ONNX_STATE_SLOTS``) with zero states absent."""
    from taso_jax.frontends.onnx_opaque import OnnxNode

    call = node.attr("call")
    if not isinstance(call, OnnxNode) or len(call.nodes) != 1:
        return None
    (proto,) = call.protos()
    slots = ONNX_STATE_SLOTS.get((proto.domain or "", proto.op_type), ())
    where = dict(zip(call.in_names, node.inputs, strict=True))
    drop = [k for k in slots if k < len(proto.input) and proto.input[k] in where
            and is_zero(where[proto.input[k]], weights)]
    if not drop:
        return None
    for k in drop:
        proto.input[k] = ""
    read = {x for x in [*proto.input, *_outer_names(proto)] if x}
    keep = [k for k, name in enumerate(call.in_names) if name in read]
    new_call = OnnxNode((proto.SerializeToString(),), tuple(call.in_names[k] for k in keep),
                        call.out_names, call.opsets, call.ir_version, call.label)
    new = intern_node("opaque", (("call", new_call),), tuple(node.inputs[k] for k in keep),
                      node.types)
    return new.outputs, "zero_recurrent_input"


def clean_imported(graph: Graph, static_axes: dict | None = None) -> Graph:
    """``graph`` merged, folded and simplified: what the import delivers to the search.

    :func:`merge_duplicate_regions`, :func:`fold_static_sizes` (with ``static_axes``),
    :func:`drop_zero_states`,
    :func:`~taso_jax.ir.cleanup.simplify`,
    :func:`~taso_jax.ir.cleanup.flush_negligible_weights`, then
    :func:`~taso_jax.ir.weight_folds.fold_affine_into_products` (after the flush, which
    looks at weights the file stores, not at products of them). What was done is counted in
    ``meta["cleanup"]`` (law -> times), beside what the file ran for nothing
    (``meta["file_leftovers"]``, filled by the import).
    """
    graph, merged = merge_duplicate_regions(graph)
    graph, folded = fold_static_sizes(graph, static_axes)
    graph, zeros = drop_zero_states(graph)
    graph, simpler = simplify(graph)
    graph, flushed = flush_negligible_weights(graph)
    graph, affine = fold_affine_into_products(graph)
    counts = dict(merged + folded + zeros + simpler + affine + flushed)
    if not counts:
        return graph
    return Graph(graph.inputs, graph.outputs, graph.output_names, graph.weights,
                 {**graph.meta, "cleanup": counts})


def file_leftovers(model) -> dict[str, int]:
    """What ``model`` (an ``onnx.ModelProto``) runs that no output needs: counts by kind.

    ``dead``: nodes none of whose outputs reaches a graph output (through the nodes'
    inputs and the names their subgraphs read); ``identity``: live ``Identity`` nodes;
    ``duplicate``: live nodes equal to an earlier one (same domain, type, attributes and
    inputs; ONNX operators are functions of these, ``Random*`` and ``Multinomial`` aside).
    Kinds that do not occur are left out.
    """
    g = model.graph
    live = _live_nodes(g)
    seen, counts = set(), Counter()
    counts["dead"] = len(g.node) - len(live)
    for i in sorted(live):
        n = g.node[i]
        if n.op_type == "Identity" and not n.domain:
            counts["identity"] += 1
        if n.op_type.startswith("Random") or n.op_type == "Multinomial" or n.op_type == "Constant":
            continue
        key = (n.domain, n.op_type, tuple(n.input),
               tuple(a.SerializeToString() for a in n.attribute))
        if key in seen:
            counts["duplicate"] += 1
        seen.add(key)
    return {k: v for k, v in counts.items() if v}


def _live_nodes(g) -> set[int]:
    """Indices of the top-level nodes of ONNX graph ``g`` that a graph output needs.

    Through the nodes' inputs and the outer names their subgraphs read.
    """
    producer = {o: i for i, n in enumerate(g.node) for o in n.output if o}
    live, todo = set(), [producer[o.name] for o in g.output if o.name in producer]
    while todo:
        i = todo.pop()
        if i in live:
            continue
        live.add(i)
        n = g.node[i]
        todo.extend(producer[x] for x in [*n.input, *_outer_names(n)] if x in producer)
    return live


def fixed_sizes_read(model) -> int:
    """How many ``Shape`` and ``Size`` nodes of ``model`` read a tensor of fixed sizes only.

    Such a node computes, at every run, a constant (ONNX shape inference,
    ``onnx.shape_inference.infer_shapes``, gives every size of what it reads as a number,
    open sizes being names), which a written file should hold as one (issue 62). A
    tensor whose sizes inference cannot give counts as open.
    """
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - a model inference cannot follow: nothing known fixed
        return 0
    g = inferred.graph
    fixed = {}
    for vi in [*g.input, *g.value_info, *g.output]:
        t = vi.type.tensor_type
        if t.HasField("shape"):
            fixed[vi.name] = all(d.HasField("dim_value") for d in t.shape.dim)
    for init in g.initializer:
        fixed[init.name] = True
    return sum(1 for n in g.node if n.op_type in ("Shape", "Size") and not n.domain
               and fixed.get(n.input[0], False))


#: ONNX operators :func:`fold_fixed_sizes` evaluates once their inputs are constants and
#: one of them derives from a size: the arithmetic of shapes (ONNX operator spec).
SIZE_ARITHMETIC = frozenset({
    "Gather", "Slice", "Cast", "Concat", "Unsqueeze", "Squeeze", "Reshape", "Identity",
    "Add", "Sub", "Mul", "Div", "Mod", "Neg", "Abs", "Sqrt", "Pow", "Floor", "Ceil", "Max",
    "Min", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Not", "And", "Or",
    "Where", "ReduceProd", "ReduceSum", "ReduceMax", "ReduceMin", "Range", "Shape", "Size",
    "ConstantOfShape", "Expand", "Tile", "Flatten"})
#: The most elements a folded value may have: sizes and what is computed from them are
#: short vectors; a ``ConstantOfShape`` or ``Expand`` of a feature map is data, kept a node.
FOLDED_ELEMENTS = 4096


#: The largest exported model (bytes) copied to fold its bound form apart from its open
#: form; a larger one has only the sizes fixed at every size folded (a copy is the size of
#: its weights).
FOLD_COPY_BYTES = 2**28


def written_forms(proto, symbolic: dict | None, serialize) -> tuple[object, object, int]:
    """An exported model's written forms, sizes folded: ``(bound, open or None, folded)``.

    ``proto`` is the export at the bound sizes; ``serialize(model, file name)`` gives a
    form as written (:func:`~taso_jax.frontends.onnx_export.serialize_onnx`). The bound
    form is folded (:func:`fold_fixed_sizes`; ``folded`` counts its nodes folded). Where
    the input has open sizes (``symbolic``,
    :func:`~taso_jax.frontends.onnx_shapes.symbolic_dims`), the open form
    (:func:`~taso_jax.frontends.onnx_shapes.with_symbolic_dims`) is folded apart, only where
    sizes are fixed at every size. Over :data:`FOLD_COPY_BYTES`, where a copy would cost
    too much, the bound form is written before the open one is made in its place, unfolded.
    ``proto`` is changed.
    """
    from taso_jax.frontends.onnx_shapes import with_symbolic_dims

    if symbolic and proto.ByteSize() > FOLD_COPY_BYTES:
        bound = serialize(proto, "optimized.onnx")
        opened = with_symbolic_dims(proto, symbolic, copy=False)
        fold_fixed_sizes(opened)
        return bound, serialize(opened, "general.onnx"), 0
    general = None
    if symbolic:
        opened = with_symbolic_dims(proto, symbolic, copy=True)
        fold_fixed_sizes(opened)
        general = serialize(opened, "general.onnx")
        del opened
    folded = fold_fixed_sizes(proto)
    return serialize(proto, "optimized.onnx"), general, folded


def fold_fixed_sizes(model) -> int:
    """Fold, in place, what ``model`` computes from sizes that are fixed; how many nodes.

    ``model`` is an ``onnx.ModelProto`` as written. A top-level ``Shape`` or ``Size`` (ONNX
    operator spec: the input's sizes, from ``start`` to ``end``, as int64; their product)
    whose input ONNX shape inference (``onnx.shape_inference.infer_shapes``) gives with
    every size a number becomes an initializer holding them; then each node of
    :data:`SIZE_ARITHMETIC` whose inputs are all initializers or ``Constant`` outputs, one of
    them folded here, is evaluated by ONNX's reference evaluator
    (``onnx.reference.ReferenceEvaluator``, at the model's opsets) and becomes an
    initializer too, where its outputs hold at most :data:`FOLDED_ELEMENTS` elements. Only
    values derived from sizes fold: arithmetic on weights alone stays, since onnxruntime's
    own fusions may read it (a folded GELU constant cost 0.82-0.89x, issue 62). A graph
    output folded is given by a ``Constant`` node, and open sizes (names, or unknown) are
    never read as numbers, so the file still runs at every size it ran at. Nodes and
    initializers left with no reader are removed.
    """
    import onnx
    from onnx import helper, numpy_helper

    g = model.graph
    try:
        inferred = onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # noqa: BLE001 - a model inference cannot follow: nothing known fixed
        return 0
    dims = {}
    for vi in [*inferred.input, *inferred.value_info, *inferred.output]:
        t = vi.type.tensor_type
        if t.HasField("shape") and all(d.HasField("dim_value") for d in t.shape.dim):
            dims[vi.name] = [d.dim_value for d in t.shape.dim]
    values = {init.name: init for init in g.initializer}
    for n in g.node:
        if n.op_type == "Constant" and not n.domain and len(n.attribute) == 1:
            values[n.output[0]] = _constant(n, helper, numpy_helper)
    for name, t in values.items():  # a weight's sizes are fixed too
        if t is not None:
            dims.setdefault(name, list(t.dims))
    values = {k: v for k, v in values.items() if v is not None}
    outputs = {o.name for o in g.output}
    opsets = list(model.opset_import)
    folded: set[str] = set()
    keep = []
    for n in g.node:
        value = _folded_value(n, dims, values, folded, opsets, helper)
        if value is None:
            keep.append(n)
            continue
        for name, arr in zip(n.output, value, strict=True):
            values[name] = numpy_helper.from_array(np.asarray(arr), name)
            folded.add(name)
            if name in outputs:  # a graph output: a Constant node gives it
                keep.append(helper.make_node("Constant", [], [name], value=values[name]))
            else:
                g.initializer.append(values[name])
    if not folded:
        return 0
    count = len(g.node) - len(keep)
    del g.node[:]
    g.node.extend(keep)
    return count + _drop_unread(model)


def _constant(n, helper, numpy_helper):
    """The tensor a ``Constant`` node gives (ONNX operator spec, Constant), or ``None``."""
    a = n.attribute[0]
    if a.name == "value":
        return a.t
    kinds = {"value_int": np.int64, "value_ints": np.int64, "value_float": np.float32,
             "value_floats": np.float32}
    if a.name not in kinds:
        return None  # a sparse tensor or strings: not size arithmetic
    return numpy_helper.from_array(np.asarray(helper.get_attribute_value(a), kinds[a.name]),
                                   n.output[0])


def _folded_value(n, dims, values, folded, opsets, helper):
    """The arrays ``n`` computes where :func:`fold_fixed_sizes` folds it, else ``None``."""
    if n.domain or any(not o for o in n.output):
        return None
    if n.op_type in ("Shape", "Size") and n.input[0] in dims:
        shape = dims[n.input[0]]
        if n.op_type == "Size":
            return [np.array(int(np.prod(shape)), np.int64)]
        start, end = _shape_span({a.name: helper.get_attribute_value(a) for a in n.attribute},
                                 len(shape))
        return [np.array(shape[start:end], np.int64)]
    if n.op_type not in SIZE_ARITHMETIC or not any(i in folded for i in n.input) \
            or not all(i in values for i in n.input if i):
        return None
    from onnx import helper as h
    from onnx.reference import ReferenceEvaluator

    ins = [i for i in n.input if i]
    graph = h.make_graph([n], "fold", [], [h.make_value_info(o, h.TypeProto())
                                           for o in n.output], [values[i] for i in ins])
    try:
        out = ReferenceEvaluator(h.make_model(graph, opset_imports=opsets)).run(None, {})
    except Exception:  # noqa: BLE001 - what the evaluator cannot run stays a node
        return None
    if any(np.asarray(a).size > FOLDED_ELEMENTS for a in out):
        return None
    return out


def _drop_unread(model) -> int:
    """Remove, in place, the top-level nodes no graph output needs (:func:`_live_nodes`).

    Then the initializers nothing reads go too (a weight that only a folded chain read,
    such as the rows of a position table sliced by a size). Returns the nodes removed.
    """
    g = model.graph
    live = _live_nodes(g)
    keep = [n for i, n in enumerate(g.node) if i in live]
    removed = len(g.node) - len(keep)
    del g.node[:]
    g.node.extend(keep)
    read = {o.name for o in g.output} | {i.name for i in g.input}
    for n in g.node:
        read.update(n.input)
        read.update(_outer_names(n))
    for t in [t for t in g.initializer if t.name not in read]:
        g.initializer.remove(t)
    return removed
