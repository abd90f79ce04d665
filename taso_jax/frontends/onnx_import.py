"""ONNX import: a model becomes an immutable :class:`~taso_jax.ir.graph.Graph`.

:func:`load_onnx` reads and checks the model, binds its input shapes
(:mod:`~taso_jax.frontends.onnx_shapes`), converts an opset older than 13 to 17, reads every
tensor's type (:mod:`~taso_jax.frontends.onnx_tensor_types`), and imports each node through
its operator declaration's importer or keeps it opaque
(:mod:`~taso_jax.frontends.onnx_opaque`); :func:`importable_at` says which operators of an
opset newer than the importers were written against still mean what they read.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping

import numpy as np

from taso_jax._text import one_line
from taso_jax.frontends.context import ImportContext
from taso_jax.frontends.onnx_cleanup import clean_imported, file_leftovers
from taso_jax.frontends.onnx_layout import in_layout, runs_channels_last, topological_order
from taso_jax.frontends.onnx_model import (
    ImportTimeLimit,
    ModelError,
    _attrs,
    _fill_weights,
    _light_model,
    _opset,
    _read_model,
    model_refusal,
)
from taso_jax.frontends.onnx_opaque import OnnxNode, _outer_names, merge_opaque_regions
from taso_jax.frontends.onnx_shapes import _fix_input_shapes, symbolic_dims, value_sized_hint
from taso_jax.frontends.onnx_symbolic import open_types
from taso_jax.frontends.onnx_tensor_types import (
    _missing_types_by_running,
    _value_types,
    index_bounds,
)
from taso_jax.ir.graph import Graph, Node, Tensor, intern_node, leaf_node
from taso_jax.ops import ONNX_IMPORTERS, ONNX_SAME_MEANING, ShapeError, TensorType

__all__ = ["load_onnx", "converted_model", "max_opset", "importable_at", "MIN_OPSET",
           "CHECKED_OPSET"]


#: The oldest opset a model may declare. Models below :data:`_CONVERT_BELOW` are converted
#: with onnx's version converter; one it cannot convert is refused in one line.
MIN_OPSET = 1
#: The newest opset whose operator specifications the importers were written against.
CHECKED_OPSET = 20
_CONVERT_BELOW, _CONVERT_TO = 13, 17


def max_opset() -> int:
    """The newest opset a model may declare: the installed ``onnx``'s newest (``onnx.defs``)."""
    from onnx import defs

    return defs.onnx_opset_version()


@functools.cache
def importable_at(op_type: str, opset: int) -> bool:
    """Whether the importers' reading of ``op_type`` (ONNX domain) holds at ``opset``.

    True at :data:`CHECKED_OPSET` and below. Above it, true when each version of the
    operator's specification published since (``onnx.defs.get_schema``) kept its inputs,
    outputs and attributes and only added element types to its type constraints (most of
    opsets 21-25: int4, bfloat16, float8 and float4 types), or is one that its importer's
    declaration lists as meaning the same to it (``onnx_importer(same_meaning=...)``).
    Otherwise (GroupNormalization-21 changed what its scale means, for one) a node of that
    operator stays opaque and runs in onnxruntime.
    """
    if opset <= CHECKED_OPSET:
        return True
    from onnx import defs

    try:
        prev = defs.get_schema(op_type, CHECKED_OPSET)
    except Exception:  # noqa: BLE001 - an operator newer than the importers
        return False
    for version in range(CHECKED_OPSET + 1, opset + 1):
        schema = defs.get_schema(op_type, version)
        if schema.since_version == prev.since_version:
            continue
        if (op_type, schema.since_version) not in ONNX_SAME_MEANING and \
                not _types_added_only(prev, schema):
            return False
        prev = schema
    return True


def _types_added_only(old, new) -> bool:
    """Same inputs, outputs and attributes; each type constraint allows at least as much."""
    def form(s):
        return ([(a.name, a.type, a.default_value.SerializeToString())
                 for a in s.attributes.values()],
                [(i.name, i.option, i.type_str) for i in s.inputs],
                [(o.name, o.option, o.type_str) for o in s.outputs])

    allowed_old = {t.type_param_str: set(t.allowed_type_strs) for t in old.type_constraints}
    allowed_new = {t.type_param_str: set(t.allowed_type_strs) for t in new.type_constraints}
    return form(old) == form(new) and allowed_old.keys() == allowed_new.keys() and all(
        allowed_new[k] >= allowed_old[k] for k in allowed_old)


#: Operators imported between two looks at the deadline.
_DEADLINE_EVERY = 256


def _check_deadline(deadline, step: str) -> None:
    if deadline is not None and deadline.passed():
        raise ImportTimeLimit(f"the time limit passed during the import: {step}")


# Over 80 lines: the import's steps in order, each a call or two, with the deadline looked
# at between them; half of its length is the documented contract.
def load_onnx(source, input_shapes: Mapping[str, tuple[int, ...]] | None = None, *,
              deadline=None, layout: str = "file") -> Graph:
    """Import an ONNX model (path or ``ModelProto``) into a :class:`~taso_jax.ir.graph.Graph`.

    Args:
        source: file path, serialized model bytes, or a loaded ``onnx.ModelProto``. The
            file is only read.
        input_shapes: static shapes for inputs with symbolic dimensions, e.g.
            ``{"x": (1, 3, 224, 224)}``. A symbolic dimension not given here takes a
            default (1 for a batch dimension; see :func:`_fix_input_shapes`), named in
            ``meta["shape_notes"]``.
        deadline: a :class:`~taso_jax.search.limits.Deadline`, or ``None`` (no limit): the
            import looks at it once ONNX's checker has accepted the model, after each
            step, and every few hundred operators.
        layout: ``"file"``: convolutions in the layout the file runs them in, NHWC
            (``conv2d_nhwc``) where every one is fed through a transpose from NHWC
            (:func:`~taso_jax.frontends.onnx_layout.runs_channels_last`); ``"nchw"``: NCHW
            ``conv2d`` always, the form the rules are stated on (the search's import).

    Returns:
        The graph, with ``meta`` holding ``opset`` (after conversion), ``source_opset``,
        ``opaque`` (ONNX op types kept opaque), ``symbolic_dims`` (the input's open sizes,
        as :func:`symbolic_dims`) and the names needed for export.

    Calls of the model's own functions (``ModelProto.functions``) are inlined first, and
    sparse initializers become dense weights.

    Raises:
        ModelError: missing or unreadable file, an opset above :func:`max_opset` or one
            that onnx's version converter cannot bring to 17,
            an ``input_shapes`` entry that does not fit its input, a model that ONNX's
            checker rejects, local functions that onnx's inliner refuses, a sparse
            initializer too large once dense, or a graph output declared with another element
            type than shape inference computes (another shape: the computed one, noted).
        ImportTimeLimit: ``deadline`` passed (the model had passed ONNX's checker).
    """
    import onnx

    where = str(source) if not isinstance(source, onnx.ModelProto) else "model"
    model, src_opset, reordered = _checked_model(source, where)
    _check_deadline(deadline, "after ONNX's checker")
    symbolic = symbolic_dims(model)
    if model is source:  # the caller's: not to be changed
        model_copy = onnx.ModelProto()
        model_copy.CopyFrom(model)
        model = model_copy
    _densify_sparse_initializers(model, where)
    shape_notes = _fix_input_shapes(model, input_shapes or {}, where)
    if reordered:
        shape_notes.append("the graph's nodes were not in topological order (ONNX requires "
                           "it; onnxruntime does not): imported in that order")
    model, opset = _converted(model, src_opset, where)
    _check_deadline(deadline, "before shape inference")
    types = _value_types(model, where, shape_notes)
    _check_deadline(deadline, "after shape inference")
    g = model.graph
    weights = _read_weights(g)
    defaults = _overridable(model, weights)
    bounds = index_bounds(model, types)
    if missing := [o for n in g.node for o in n.output if o and o not in types]:
        _check_deadline(deadline, "before onnxruntime runs it for the sizes left open")
        try:
            _missing_types_by_running(model, missing, types, weights, bounds)
        except Exception as e:  # noqa: BLE001 - onnxruntime refuses the user's model
            hint = value_sized_hint(model)
            message = (f"{where}: onnxruntime does not run the model on random inputs, which "
                       f"the import needs for the sizes ONNX's shape inference left open "
                       f"({one_line(str(e), 300)})" + (f"; {hint}" if hint else ""))
            raise model_refusal(message, hint) from e

    static_axes = {} if symbolic else None  # None: every size is fixed
    if symbolic:  # the sizes that follow from the open ones, as expressions
        _check_deadline(deadline, "before the symbolic shape inference of the open sizes")
        types = open_types(model, symbolic, types, static_axes=static_axes,
                           deadline=None if deadline is None else deadline.share("open_sizes"))
    env: dict[str, Tensor] = {
        name: leaf_node("weight", name, TensorType(arr.shape, str(arr.dtype))).outputs[0]
        for name, arr in weights.items() if name not in defaults}
    inputs = _graph_inputs(g, env, types, where)
    opsets = tuple(sorted((o.domain, o.version) for o in model.opset_import))
    opaque: dict[str, int] = {}
    ctx = ImportContext(weights, opset)
    ctx.static_axes = static_axes
    _import_nodes(model, env, types, ctx, opsets, opaque, where, deadline)
    outputs, names = [], []
    for o in g.output:
        outputs.append(env[o.name])
        names.append(o.name)
    meta = {"opset": opset, "source_opset": src_opset, "opsets": opsets,
            "shape_notes": shape_notes, "symbolic_dims": symbolic,
            "ir_version": model.ir_version, "opaque": dict(opaque),
            "name": g.name or "graph", "integer_input_bounds": bounds,
            "value_sized_hint": value_sized_hint(model), "onnx_nodes": len(g.node),
            "file_leftovers": file_leftovers(model), **({"input_defaults": defaults}
                                                         if defaults else {})}
    weights = {k: v for k, v in weights.items() if k not in defaults}
    meta["channels_last"] = runs_channels_last(model)
    graph = merge_opaque_regions(clean_imported(Graph(tuple(inputs), tuple(outputs),
                                                      tuple(names), weights, meta), static_axes))
    return in_layout(graph, layout)


#: The most bytes a sparse initializer may take once dense (the IR holds weights dense);
#: protobuf's limit on a whole serialized model (2 GiB).
SPARSE_DENSE_MAX_BYTES = 2**31


def _checked_model(source, where: str):
    """``(model, source opset, reordered)``: ``source`` read and accepted by ONNX's checker.

    Its local functions are inlined and its nodes put in topological order first.

    Raises:
        ModelError: an unreadable file, an unsupported opset, a model the checker refuses,
            or a graph without outputs.
    """
    import onnx

    read = _read_model(source)
    model = _inline_local_functions(read, where)
    src_opset = _opset(model)
    if not MIN_OPSET <= src_opset <= max_opset():
        raise ModelError(f"{where}: unsupported opset {src_opset} (supported: "
                         f"{MIN_OPSET} to {max_opset()}, the newest this onnx "
                         "package knows)")
    order = topological_order(model.graph)
    reordered = order is not None and order != list(range(len(model.graph.node)))
    if reordered:  # onnxruntime runs such files; ONNX's checker refuses them
        if model is source:
            model_copy = onnx.ModelProto()
            model_copy.CopyFrom(model)
            model = model_copy
        nodes = [model.graph.node[i] for i in order]
        copies = [onnx.NodeProto() for _ in nodes]
        for c, n in zip(copies, nodes, strict=True):
            c.CopyFrom(n)
        del model.graph.node[:]
        model.graph.node.extend(copies)
    try:
        # from the path where there is one: the checker then reads the file itself, where
        # a ModelProto would be serialized for it (one more copy of the weights)
        onnx.checker.check_model(model if model is not read or reordered
                                 or isinstance(source, onnx.ModelProto | bytes | bytearray)
                                 else os.fspath(source))
    except Exception as e:
        raise ModelError(f"{where}: invalid ONNX model ({one_line(str(e))})") from e
    if not model.graph.output:
        raise ModelError(f"{where}: the graph has no outputs")
    return model, src_opset, reordered


def _converted(model, src_opset: int, where: str):
    """``(model, opset)``: the model at an opset that the importers read.

    A model below opset :data:`_CONVERT_BELOW` is converted to :data:`_CONVERT_TO` by
    onnx's version converter; others come back as they are.

    Raises:
        ModelError: the converter cannot convert it.
    """
    from onnx import version_converter

    if src_opset >= _CONVERT_BELOW:
        return model, src_opset
    _channel_prelu_slopes(model, src_opset)
    try:
        converted = version_converter.convert_version(_light_model(model), _CONVERT_TO)
        if not _fill_weights(converted, model):  # it changed a weight: convert it whole
            converted = version_converter.convert_version(model, _CONVERT_TO)
        return converted, _CONVERT_TO
    except Exception as e:
        raise ModelError(f"{where}: cannot convert opset {src_opset} to {_CONVERT_TO} "
                         f"({str(e).splitlines()[0]})") from e


def _overridable(model, weights: dict) -> dict[str, np.ndarray]:
    """The graph inputs that carry an initializer, a default a caller may override.

    From IR version 4 on, an initializer named among the graph's inputs is that input's
    default (ONNX IR spec, "Graphs"; onnxruntime feeds what the caller gives): it stays an
    input, never a weight a rewrite may fold, and is exported back as an input with its
    default (``meta["input_defaults"]``). Before IR 4 every initializer was an input.
    """
    if model.ir_version < 4:
        return {}
    return {i.name: weights[i.name] for i in model.graph.input if i.name in weights}


def _read_weights(g) -> dict[str, np.ndarray]:
    """The graph's initializers as read-only arrays, by name.

    Read-only: a graph's weights never change, and compiled candidate graphs then share
    one device copy of each (:func:`taso_jax.ir.executor.device_constant`).
    """
    from onnx import numpy_helper

    weights: dict[str, np.ndarray] = {}
    for init in g.initializer:
        arr = numpy_helper.to_array(init)
        arr.flags.writeable = False
        weights[init.name] = arr
    return weights


def _graph_inputs(g, env: dict, types: dict, where: str) -> list[Node]:
    """The graph's inputs that are not initializers, as input nodes (added to ``env``).

    Raises:
        ModelError: an input that is not a tensor.
    """
    inputs: list[Node] = []
    for inp in g.input:
        if inp.name in env:
            continue
        if not inp.type.HasField("tensor_type") or inp.name not in types:
            kind = inp.type.WhichOneof("value") or "untyped"
            raise ModelError(f"{where}: input {inp.name!r} is a {kind.replace('_type', '')}, "
                             "not a tensor; only tensor inputs are supported")
        node = leaf_node("input", inp.name, types[inp.name])
        inputs.append(node)
        env[inp.name] = node.outputs[0]
    return inputs


def _import_nodes(model, env: dict, types: dict, ctx, opsets: tuple, opaque: dict,
                  where: str, deadline) -> None:
    """Import every node of ``model``'s graph into ``env`` (name -> tensor), in order.

    Groups of nodes that pass non-tensor values (sequences) are imported as one opaque
    region with their last member; ``opaque`` counts what was kept opaque. The deadline
    is looked at every :data:`_DEADLINE_EVERY` operators.
    """
    g = model.graph
    groups = _non_tensor_groups(g, types, where)
    for k, node in enumerate(g.node):
        if k % _DEADLINE_EVERY == 0:
            _check_deadline(deadline, f"{k:,} of {len(g.node):,} operators imported")
        if k in groups:
            if groups[k] is None:  # a member of a group, imported with its last member
                continue
            members = [g.node[i] for i in groups[k]]
            outs = _import_group(members, env, types, opsets, model.ir_version, opaque,
                                 {o.name for o in g.output}, g.node, groups[k])
            env.update(outs)
            continue
        outs = _import_node(node, env, types, ctx, opsets, model.ir_version, opaque)
        for name, t in zip(node.output, outs, strict=True):
            if name:
                env[name] = t


def _densify_sparse_initializers(model, where: str) -> None:
    """Replace each of ``model``'s sparse initializers by the dense one it stands for, in place.

    A ``SparseTensorProto`` (ONNX IR: ``values`` named as the initializer, ``indices`` either
    ``[NNZ]`` positions in the flattened tensor or ``[NNZ, rank]`` coordinates, ``dims``)
    holds zeros everywhere but at ``indices``. The IR's weights are dense arrays, and the
    checker has already checked the indices.

    Raises:
        ModelError: a dense form over :data:`SPARSE_DENSE_MAX_BYTES`, or indices that do
            not fit ``dims``.
    """
    from onnx import numpy_helper

    g = model.graph
    for sparse in g.sparse_initializer:
        name, dims = sparse.values.name, tuple(int(d) for d in sparse.dims)
        values = numpy_helper.to_array(sparse.values).reshape(-1)
        size = int(np.prod(dims, dtype=np.int64))
        if size * values.dtype.itemsize > SPARSE_DENSE_MAX_BYTES:
            raise ModelError(f"{where}: sparse initializer {name!r} of shape {list(dims)} is "
                             f"too large once dense (over {SPARSE_DENSE_MAX_BYTES} bytes)")
        indices = (numpy_helper.to_array(sparse.indices).astype(np.int64)
                   if sparse.HasField("indices") else np.arange(values.size, dtype=np.int64))
        try:
            if indices.ndim == 2:  # [NNZ, rank] coordinates
                indices = np.ravel_multi_index(tuple(indices.T), dims)
            dense = np.zeros(size, values.dtype)
            dense[indices.reshape(-1)] = values
        except (IndexError, ValueError) as e:
            raise ModelError(f"{where}: sparse initializer {name!r}: indices do not fit its "
                             f"shape {list(dims)} ({one_line(str(e))})") from e
        g.initializer.append(numpy_helper.from_array(dense.reshape(dims), name))
    del g.sparse_initializer[:]


def _inline_local_functions(model, where: str):
    """``model`` with each call of a model-local function replaced by the function's body.

    A node whose ``(domain, op_type)`` names one of ``ModelProto.functions`` is an operator
    that only the model defines: kept opaque, its region would run in a session of its own
    that lacks the definition, and exported it would reference a function the written
    model no longer holds. Inlined (``onnx.inliner``, subgraphs included), its body's
    operators import like any other. A model without local functions is returned as it is;
    otherwise a new one (``model`` is not changed).

    Raises:
        ModelError: onnx's inliner refuses the model.
    """
    if not model.functions:
        return model
    from onnx import inliner

    try:
        return inliner.inline_local_functions(model)
    except Exception as e:  # noqa: BLE001 - the inliner's C++ errors have no common type
        raise ModelError(f"{where}: cannot inline the model's local functions "
                         f"({one_line(str(e))})") from e


def converted_model(source, opset: int):
    """``source`` (a path) converted to ``opset`` by onnx's version converter, as bytes.

    The reference for a model whose own opset onnxruntime no longer runs (Add-6 with its
    ``broadcast`` attribute, Gemm-6, PRelu-6: onnxruntime implements opset 7 and newer for
    them): :func:`load_onnx` imports the same conversion.

    Raises:
        ModelError: the converter fails on it.
    """
    import onnx
    from onnx import version_converter

    model = onnx.load(source)
    try:
        _channel_prelu_slopes(model, _opset(model))
        return version_converter.convert_version(model, opset).SerializeToString()
    except Exception as e:
        raise ModelError(f"{source}: cannot convert to opset {opset} ({one_line(str(e))})") from e


def _channel_prelu_slopes(model, src_opset: int) -> None:
    """Give PRelu-6 slopes their channel axis, in place, before the version converter.

    Before opset 7 a ``[C]`` slope applies along the channel axis (axis 1: PyTorch's
    ``PReLU(num_parameters=C)`` exports it so); from opset 7 it broadcasts NumPy-style from
    the last axis. onnx's converter keeps the ``[C]`` shape, so the converted PRelu of a
    ``[N, C, L]`` input reads it along ``L`` (onnxruntime refuses it where ``C != L``).
    A ``[C]`` slope initializer of a PRelu whose input has rank r > 2 and C channels
    becomes ``[C, 1, ..., 1]`` (r - 2 ones): the same values, the channel axis explicit.
    """
    import onnx

    if src_opset >= 7:
        return
    prelus = [n for n in model.graph.node if n.op_type == "PRelu" and len(n.input) == 2]
    if not prelus:
        return
    inits = {i.name: i for i in model.graph.initializer}
    inferred = onnx.shape_inference.infer_shapes(model)
    shapes = {v.name: [d.dim_value if d.HasField("dim_value") else None
                       for d in v.type.tensor_type.shape.dim]
              for v in (*inferred.graph.input, *inferred.graph.value_info)
              if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape")}
    for n in prelus:
        slope, x = inits.get(n.input[1]), shapes.get(n.input[0])
        if (slope is None or x is None or len(x) <= 2 or len(slope.dims) != 1
                or slope.dims[0] in (1, x[-1]) or x[1] not in (None, slope.dims[0])):
            continue  # a shared slope, one that already broadcasts, or not per channel
        slope.dims.extend([1] * (len(x) - 2))
        for v in model.graph.input:  # before IR 4 initializers are graph inputs too
            if v.name == slope.name and v.type.HasField("tensor_type"):
                for _ in range(len(x) - 2):
                    v.type.tensor_type.shape.dim.add().dim_value = 1


def _constant_value(node, ctx: ImportContext, ins: list):
    """Value of a ``Constant`` node, or of a ``ConstantOfShape`` with a constant shape."""
    from onnx import numpy_helper

    if node.op_type == "Constant":
        for k, v in _attrs(node).items():
            if k == "value":
                return numpy_helper.to_array(node.attribute[0].t)
            if k in ("value_float", "value_floats"):
                return np.asarray(v, np.float32)
            if k in ("value_int", "value_ints"):
                return np.asarray(v, np.int64)
        return None  # sparse or string constants stay opaque
    if node.op_type == "ConstantOfShape" and ins and ctx.const(ins[0]) is not None:
        shape = tuple(int(d) for d in np.asarray(ctx.const(ins[0])).reshape(-1))
        fill = (numpy_helper.to_array(node.attribute[0].t).reshape(-1)[0]
                if node.attribute else np.float32(0))
        return np.full(shape, fill, dtype=np.asarray(fill).dtype)
    return None


def _import_node(node, env, types, ctx, opsets, ir_version, opaque) -> list[Tensor]:

    out_types = [types.get(o) for o in node.output]
    ins = [env[i] if i else None for i in node.input]
    if node.domain in ("", "ai.onnx") and importable_at(node.op_type, ctx.opset):
        value = _constant_value(node, ctx, ins)
        if value is not None:
            value.flags.writeable = False  # a fresh array; shared when folded, as above
            return [ctx.weight(value, node.output[0] or "const")]
        importer = ONNX_IMPORTERS.get(node.op_type)
        # An output left unnamed ("") is absent: its type is None, and the importer's
        # tensor for it is not checked (an LSTM whose Y alone is unused).
        if importer is not None and all(t is not None for t, o in zip(
                out_types, node.output, strict=True) if o):
            ctx.out_types = out_types
            ctx.out_fixed = [(ctx.static_axes or {}).get(o) for o in node.output]
            ctx.source_op = node.op_type
            try:
                res = importer(ctx, ins, **_attrs(node))
            except (ShapeError, TypeError, ValueError, KeyError, AttributeError):
                res = None
            if res is not None and len(res) == len(node.output) and all(
                    t.type == want for t, want, o in zip(res, out_types, node.output,
                                                         strict=True) if o):
                return [t if o else None for t, o in zip(res, node.output, strict=True)]
    # Opaque: keep the ONNX node as it is; it runs in onnxruntime and is exported verbatim.
    if any(t is None for t, o in zip(out_types, node.output, strict=True) if o):
        raise ModelError(f"node {node.name or node.op_type!r} ({node.op_type}): output shapes "
                         "unknown after shape inference")
    opaque[node.op_type] = opaque.get(node.op_type, 0) + 1
    node = _absent_if_empty(node, env, ctx.opset)
    in_names = list(dict.fromkeys([x for x in node.input if x] + _outer_names(node)))
    missing = [x for x in in_names if x not in env]
    if missing:
        raise ModelError(f"node {node.name or node.op_type!r} ({node.op_type}): its subgraph "
                         f"reads {missing[0]!r}, which no enclosing graph defines")
    out_names = [o for o in node.output if o]
    call = OnnxNode((node.SerializeToString(),), tuple(in_names), tuple(out_names), opsets,
                    ir_version, node.op_type)
    n = intern_node("opaque", (("call", call),), tuple(env[x] for x in in_names),
                    tuple(types[o] for o in out_names))
    it = iter(n.outputs)
    return [next(it) if o else None for o in node.output]


def _non_tensor_groups(g, types: Mapping[str, TensorType], where: str) -> dict:
    """Nodes joined by values that are not tensors (sequences, maps, optionals).

    The IR's edges are tensors, so the nodes that make and read such a value
    (``SequenceConstruct`` -> ``SequenceAt``, ``SplitToSequence`` ->
    ``ConcatFromSequence``) are imported as one opaque region, with the nodes between them
    that depend on a member and feed a later one, so that the region reads only tensors
    from the rest of the graph. A value is not a tensor where no tensor type was found for
    it. Returns ``{node index: member indices}`` for the last member of each group (in the
    graph's order) and ``{node index: None}`` for its other members.

    Raises:
        ModelError: the graph returns such a value (only tensor outputs are supported).
    """
    producer = {o: k for k, n in enumerate(g.node) for o in n.output if o}
    untyped = [o for o in producer if o not in types]
    if not untyped:
        return {}
    for o in g.output:
        if o.name in untyped:
            kind = o.type.WhichOneof("value") or "value"
            raise ModelError(f"{where}: output {o.name!r} is a {kind.replace('_type', '')}, "
                             "not a tensor; only tensor outputs are supported")
    parent = list(range(len(g.node)))

    def find(k):
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    readers: dict[str, list[int]] = {}
    for k, n in enumerate(g.node):
        for x in list(n.input) + _outer_names(n):
            readers.setdefault(x, []).append(k)
    for o in untyped:
        for r in readers.get(o, ()):
            parent[find(r)] = find(producer[o])
    members: dict[int, set] = {}
    for k in {producer[o] for o in untyped} | {r for o in untyped for r in readers.get(o, ())}:
        members.setdefault(find(k), set()).add(k)
    groups: dict = {}
    for ks in members.values():
        first, last = min(ks), max(ks)
        # convex: nodes between that read a member's output (or such a node's) join it
        tainted = set(ks)
        made = {o for k in ks for o in g.node[k].output if o}
        for k in range(first, last + 1):
            n = g.node[k]
            if k not in tainted and made.intersection(list(n.input) + _outer_names(n)):
                tainted.add(k)
                made.update(o for o in n.output if o)
        order = sorted(tainted)
        last = order[-1]
        groups.update((k, None) for k in order[:-1])
        groups[last] = order
    return groups


def _import_group(members: list, env, types, opsets, ir_version, opaque, graph_outputs,
                  nodes, indices) -> dict[str, Tensor]:
    """One opaque region of ``members`` (:func:`_non_tensor_groups`); its tensors by name."""
    inside = {o for n in members for o in n.output if o}
    in_names: dict[str, None] = {}
    for n in members:
        for x in list(n.input) + _outer_names(n):
            if x and x not in inside:
                in_names.setdefault(x)
    grouped = set(indices)
    read_after = {x for k, n in enumerate(nodes) if k not in grouped
                  for x in list(n.input) + _outer_names(n)}
    out_names = [o for n in members for o in n.output
                 if o and (o in read_after or o in graph_outputs)]
    untyped = [o for o in out_names if o not in types]
    if untyped:  # read outside its group: cannot be (the groups are closed under reads)
        raise ModelError(f"value {untyped[0]!r} is not a tensor; only opaque regions read it")
    missing = [x for x in in_names if x not in env]
    if missing:
        raise ModelError(f"node {members[0].name or members[0].op_type!r}: reads "
                         f"{missing[0]!r}, which no enclosing graph defines")
    for n in members:
        opaque[n.op_type] = opaque.get(n.op_type, 0) + 1
    call = OnnxNode(tuple(n.SerializeToString() for n in members), tuple(in_names),
                    tuple(out_names), opsets, ir_version)
    node = intern_node("opaque", (("call", call),), tuple(env[x] for x in in_names),
                       tuple(types[o] for o in out_names))
    return dict(zip(out_names, node.outputs, strict=True))


def _absent_if_empty(node, env, opset: int):
    """``node`` with each optional input fed by an empty constant written as absent ("").

    Before opset 13 an absent optional input was often an empty initializer (Resize's
    ``scales`` beside its ``sizes``), and opset conversion keeps it. The whole model still
    runs, but a region run as a model of its own gets that constant as an input, whose
    emptiness is unknown when the session starts: onnxruntime then refused U^2-Net-p's
    ``Resize`` ("either sizes or scales, not both"). Absent is what the empty constant
    meant.
    """
    import onnx

    empty = [i for i, x in enumerate(node.input)
             if x and x in env and env[x].node.op == "weight" and env[x].type.size == 0]
    if not empty:
        return node
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, node.domain or "")
    except onnx.defs.SchemaError:
        return node
    optional = onnx.defs.OpSchema.FormalParameterOption.Optional
    params = schema.inputs
    drop = [i for i in empty if i < len(params) and params[i].option == optional]
    if not drop:
        return node
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    for i in drop:
        copy.input[i] = ""
    return copy
