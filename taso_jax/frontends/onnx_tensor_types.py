"""The static type of every tensor of an ONNX model whose input shapes are bound.

ONNX shape inference first; for the tensors it leaves open, onnxruntime's symbolic shape
inference and probe runs on random inputs, whose integer inputs are drawn below the size of
the table they index (:func:`index_bounds`) and whose large weights are fed as inputs, so
that no session holds a copy of them.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import numpy as np

from taso_jax.frontends.onnx_model import _attrs, _copy_fields, _is_heavy, _light_model, _np_dtype
from taso_jax.ir.executor import random_array, release_memory
from taso_jax.ops import TensorType

__all__ = ["index_bounds", "probe_feeds", "static_types", "PROBE_OUTPUTS", "INFER_OVER"]


def _value_types(model, where: str = "model", notes: list | None = None
                 ) -> dict[str, TensorType]:
    """The static type of each value of ``model`` by ONNX shape inference, by name.

    The graph outputs' declared types are set aside while it runs, so that what it computes
    from the inputs is not merged with them: a declared type fills in an output it leaves
    open. Where a declared shape disagrees with the computed one, the computed one is used
    and a line is added to ``notes``, as onnxruntime warns and runs such a model (ddddocr's
    recognizer declares ``[1, seqlen]`` for an output that is ``[T, 1, 8210]``).

    Raises:
        ModelError: a graph output declared with another element type than shape inference
            computes (:func:`_check_declared_outputs`; onnxruntime refuses it too).
    """
    import onnx

    light = _light_model(model)
    for vi in light.graph.output:
        if vi.type.HasField("tensor_type"):
            vi.ClearField("type")
    inferred = onnx.shape_inference.infer_shapes(light, strict_mode=False, data_prop=True)
    types = static_types(inferred)
    found = _check_declared_outputs(model.graph.output, inferred.graph.output, where)
    if notes is not None:
        notes.extend(found)
    declared = static_types(onnx.ModelProto(graph=onnx.GraphProto(output=model.graph.output)))
    return {**declared, **types}


def _declared(vi) -> tuple[str, list[int | None]] | None:
    """``(element type, sizes)`` of a tensor value info (``None`` for an open size).

    ``None`` where it declares no element type or no shape.
    """
    tt = vi.type.tensor_type
    if not vi.type.HasField("tensor_type") or not tt.elem_type or not tt.HasField("shape"):
        return None
    return (_np_dtype(tt.elem_type),
            [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim])


def _check_declared_outputs(declared, inferred, where: str) -> list[str]:
    """Lines saying which graph outputs' declared shapes disagree with the inferred ones.

    Compared where both are known: the ranks, and each size that both give (an open size,
    ``dim_param``, agrees with any).

    Raises:
        ModelError: an output whose declared element type is not the inferred one, naming
            the output, its declared type and the inferred one.
    """
    from taso_jax.frontends.onnx_model import ModelError

    computed = {vi.name: _declared(vi) for vi in inferred}
    notes = []
    for vi in declared:
        want, got = _declared(vi), computed.get(vi.name)
        if want is None or got is None:
            continue
        if want[0] != got[0]:
            raise ModelError(f"{where}: output {vi.name!r} is declared {_typed(want)}, but "
                             f"ONNX shape inference computes {_typed(got)} from the inputs; "
                             "correct the output's declared type")
        if len(want[1]) != len(got[1]) or any(
                a is not None and b is not None and a != b
                for a, b in zip(want[1], got[1], strict=True)):
            notes.append(f"output {vi.name!r} is declared {_typed(want)}, but ONNX shape "
                         f"inference computes {_typed(got)} from the inputs: the computed "
                         "type is used (and written, where the graph is rewritten)")
    return notes


def _typed(t: tuple[str, list]) -> str:
    sizes = ", ".join("?" if d is None else str(d) for d in t[1])
    return f"{t[0]}[{sizes}]"


def static_types(inferred) -> dict[str, TensorType]:
    """The static types that an ONNX model (after shape inference) declares, by name.

    Inputs, ``value_info``, outputs whose every dimension has a size, and initializers.
    """
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


#: Operators through which an integer input still holds the same index values (from input
#: 0; ``Concat`` from every input: a graph network appends self-loops to its edge list).
_INDEX_PASSES = frozenset({"Cast", "Identity", "Unsqueeze", "Squeeze", "Reshape", "Flatten",
                           "Expand", "Transpose", "Slice", "Tile", "Split", "Concat"})

#: Recurrent operators whose input 4 holds each batch entry's sequence length (ONNX spec,
#: RNN/GRU/LSTM): values in 1..T, T the sequence axis of input 0 (axis 1 when ``layout``
#: is 1). onnxruntime refuses a length above T (and below 0); 0 leaves a sequence empty.
_SEQUENCE_LENS = frozenset({"RNN", "GRU", "LSTM"})


#: Operators whose input 1 holds indices into input 0 (ONNX spec); their input 0 passes
#: its values on too (a row of an edge list gathered is still node ids).
_INDEX_TABLES = frozenset({"Gather", "GatherElements", "ScatterElements", "GatherND",
                           "ScatterND"})


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


def _onehot_depth(node, constants: Mapping[str, np.ndarray]) -> int | None:
    """``OneHot``'s depth (input 1, a scalar or one-element tensor) when it is a constant.

    Its indices (input 0) must lie in ``[-depth, depth - 1]`` (ONNX spec, OneHot-11).
    """
    depth = constants.get(node.input[1]) if len(node.input) > 1 else None
    if depth is None or depth.size != 1:
        return None
    return int(np.asarray(depth).reshape(()))


def _sequence_length(node, types: Mapping[str, TensorType]) -> int | None:
    """T, the number of time steps of a recurrent node's input 0, when its shape is known."""
    x = types.get(node.input[0])
    axis = 1 if int(_attrs(node).get("layout", 0)) == 1 else 0
    if x is None or len(x.shape) != 3 or not isinstance(x.shape[axis], int):
        return None
    return x.shape[axis]


def _constants(model) -> dict[str, np.ndarray]:
    """Small constants by name (a OneHot depth): initializers and ``Constant`` outputs.

    Only those of at most 16 elements are read.
    """
    from onnx import numpy_helper

    out = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer
           if int(np.prod(i.dims)) <= 16}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            t = node.attribute[0].t
            if int(np.prod(t.dims)) <= 16:
                out[node.output[0]] = numpy_helper.to_array(t)
    return out


def index_bounds(model, types: Mapping[str, TensorType]) -> dict[str, int | range]:
    """The values the integer inputs that index a table or set lengths may take, by name.

    Random integer inputs (token ids, masks) are drawn in ``[0, 8)``. An input that reaches,
    directly or through operators that keep its values (:data:`_INDEX_PASSES`, ``Cast``
    among them, and the data side of a gather), the indices of a gather or scatter
    (:data:`_INDEX_TABLES`, ONNX spec) must stay below the size of the indexed axis
    (:func:`_indexed_size`; ``axis`` may be negative): BERT's ``token_type_ids`` index a
    table of 2 rows, and a graph network's edge list indexes its nodes. The indices of a
    ``OneHot`` stay below its depth where that is a constant (:func:`_onehot_depth`).
    Negative indices, which these operators also accept (counting from the end), are never
    drawn: ``[0, size)`` lies inside ``[-size, size)``. For such inputs only bounds below 8
    are listed, as an ``int`` (the exclusive upper bound). A float input that is cast to
    integers (Keras feeds embedding ids as floats) is always listed, at most 8: it holds
    ids, not values to draw from N(0, 1) or scale.

    An input that reaches the ``sequence_lens`` of an RNN, GRU or LSTM (input 4) is listed
    as ``range(1, T + 1)``, T the node's time steps at the bound sizes
    (:func:`_sequence_length`): onnxruntime refuses lengths above T, and a length of 0
    leaves that batch entry's sequence empty.

    ``types``: static types by tensor name at the bound sizes (:func:`static_types`).
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
    constants = _constants(model) if any(n.op_type == "OneHot" for n in g.node) else {}
    bounds: dict[str, int | range] = {}

    def limit(name: str, size: int | None):
        if size is None or size <= 0 or isinstance(bounds.get(name), range):
            return
        if size < bounds.get(name, 8):
            bounds[name] = size
        elif name in floats:
            bounds.setdefault(name, 8)

    for name in integer | floats:
        todo, seen = [name], {name}
        while todo:
            for node, k in readers.get(todo.pop(), ()):
                op = node.op_type
                if (name in floats and op == "Cast" and k == 0 and np.issubdtype(
                        _np_dtype(int(_attrs(node).get("to", 1))), np.integer)):
                    bounds.setdefault(name, 8)  # cast to integers: ids, not values
                if (op in _INDEX_PASSES or op in _INDEX_TABLES) and (k == 0 or op == "Concat"):
                    for o in node.output:
                        if o and o not in seen:
                            seen.add(o)
                            todo.append(o)
                elif op in _INDEX_TABLES and k == 1:
                    limit(name, _indexed_size(node, types))
                elif op == "OneHot" and k == 0:
                    limit(name, _onehot_depth(node, constants))
                elif op in _SEQUENCE_LENS and k == 4 and name in integer:
                    steps = _sequence_length(node, types)
                    if steps:
                        bounds[name] = range(1, steps + 1)
    return bounds


def probe_feeds(model, inferred) -> dict[str, np.ndarray]:
    """Inputs for a probe run of ``model`` at its bound sizes.

    Zeros, except where zero is not a valid value (a sequence length, :func:`index_bounds`),
    which gets its largest.

    ``inferred``: ``model`` after ONNX shape inference (its inputs' shapes static).
    """
    inits = {i.name for i in model.graph.initializer}
    types = static_types(inferred)
    bounds = index_bounds(model, types)
    feeds = {}
    for x in inferred.graph.input:
        if x.name in inits:
            continue
        tt = x.type.tensor_type
        a = np.zeros([d.dim_value for d in tt.shape.dim], _np_dtype(tt.elem_type))
        if isinstance(bounds.get(x.name), range):
            a += bounds[x.name].stop - 1
        feeds[x.name] = a
    return feeds


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


def symbolic_inference(model, auto_merge: bool = False, deadline=None):
    """``model`` with onnxruntime's symbolic shape inference's value_info, or None.

    Runs the tool's steps rather than its ``infer_shapes``: where inference stays
    incomplete, that one saves the model into the current folder (a user's!) and raises;
    the shapes it did find are returned here. ``auto_merge`` merges sizes that an operator
    needs equal (a broadcast of two open sizes) instead of failing. ``deadline`` (a
    :class:`~taso_jax.search.limits.Deadline`, or ``None``: no limit) is looked at before
    each operator the tool infers; once it has passed, the inference is given up. Its
    ``Resize`` and ``Slice`` rules run without SymPy's ``simplify`` (:func:`_cheap_rule`).
    None where the tool fails or the deadline passed; it is a help, never a requirement.
    """
    try:
        from onnxruntime.tools import symbolic_shape_infer as tool

        ssi = tool.SymbolicShapeInference(2**31 - 1, auto_merge, False, 0)
        if "Resize" in ssi.dispatcher_:
            ssi.dispatcher_["Resize"] = _cheap_rule(tool, ssi.dispatcher_["Resize"])
        if "Slice" in ssi.dispatcher_:
            ssi.dispatcher_["Slice"] = _slice_rule(ssi, _cheap_rule(tool, ssi.dispatcher_["Slice"]))
        if deadline is not None:
            ssi.dispatcher_ = {op: _until(rule, deadline)
                               for op, rule in ssi.dispatcher_.items()}
        ssi._preprocess(model)
        while ssi.run_:
            ssi._infer_impl()
        ssi._update_output_from_vi()
        return ssi.out_mp_
    except Exception:  # noqa: BLE001 - any failure of the tool, or the deadline passed
        return None


class _InferenceTimeLimit(Exception):
    """The deadline of a symbolic shape inference passed."""


def _until(rule, deadline):
    """The tool's ``rule`` for one operator, refused once ``deadline`` has passed.

    Raises:
        _InferenceTimeLimit: (from the rule returned) the deadline has passed.
    """
    def checked(node):
        if deadline.passed():
            raise _InferenceTimeLimit
        return rule(node)
    return checked


class _CheapSimplify:
    """The ``sympy`` module as the tool's ``Resize`` and ``Slice`` rules see it.

    Its ``simplify`` is made cheap. The ``Resize`` rule writes each size as
    ``simplify(floor(d * scale))``, ``d`` the input's size expression. Past a few strided
    convolutions and upsamplings ``d`` nests floors, and ``simplify`` of it took 76 of the
    84 s a PP-OCRv4 detector's import took (18 Resize nodes). The ``Slice`` rule writes
    ``simplify((end - start + step - 1) // step)``: on the same detector with its depthwise
    convolutions written as kernel taps (strided Slices of padded inputs,
    ``lower-conv2d_taps``), importing the written file ran for minutes (now 3 s). Here
    ``simplify`` only makes each float an exact rational, which lets SymPy's own evaluation
    drop the floor where the product is an integer (``floor(2*d) = 2*d`` for an integer
    ``d``): the same value, a form that may be longer.
    """

    def __init__(self, sympy):
        self._sympy = sympy

    def __getattr__(self, name):
        return getattr(self._sympy, name)

    def simplify(self, expr):
        sympy = self._sympy
        expr = sympy.sympify(expr)
        return expr.xreplace({f: sympy.Rational(float(f)) for f in expr.atoms(sympy.Float)})


_TOOL_LOCK = threading.Lock()


def _cheap_rule(tool, rule):
    """The tool's ``rule`` for one operator run with :class:`_CheapSimplify` as its ``sympy``."""
    def cheap(node):
        with _TOOL_LOCK:
            real = tool.sympy
            tool.sympy = _CheapSimplify(real)
            try:
                return rule(node)
            finally:
                tool.sympy = real
    return cheap


def _slice_rule(ssi, rule):
    """The tool's ``Slice`` rule, with the sizes of axes sliced by a negative step redone.

    The tool (onnxruntime 1.32) takes an end at or below ``-INT64_MAX`` as 0 where the
    start is positive, so a whole axis reversed (start ``d - 1``, end ``INT64_MIN``, step
    -1, as exporters write ``x[::-1]``) comes out one entry short: 19 of 20 time steps of a
    bidirectional LSTM's reversed output (captcha_crnn). ONNX Slice clamps such an end to
    -1 (ONNX spec, Slice), as Python's ``slice.indices`` does; a negative-step axis is
    recomputed that way where its size, start and end are known, and left open otherwise
    (the probe runs then read it).
    """
    def sliced(node):
        rule(node)
        if len(node.input) < 5 or not node.input[4]:
            return  # opset < 10 or no steps: every step is 1
        try:
            steps = [int(v) for v in np.asarray(ssi._try_get_value(node, 4)).reshape(-1)]
        except (TypeError, ValueError):
            return
        if not any(st < 0 for st in steps):
            return
        values = [ssi._try_get_value(node, k) if k < len(node.input) and node.input[k]
                  else None for k in (1, 2, 3)]
        dims = ssi.known_vi_[node.output[0]].type.tensor_type.shape.dim
        in_shape = ssi._get_shape(node, 0)
        axes = (list(range(len(steps))) if values[2] is None else
                [int(a) for a in np.asarray(values[2]).reshape(-1)])
        for k, (axis, st) in enumerate(zip(axes, steps, strict=True)):
            axis = axis + len(in_shape) if axis < 0 else axis
            if st > 0 or axis >= len(dims):
                continue
            d = in_shape[axis] if axis < len(in_shape) else None
            if isinstance(d, (int, np.integer)) and values[0] is not None \
                    and values[1] is not None:
                s, e = (int(np.asarray(v).reshape(-1)[k]) for v in values[:2])
                dims[axis].Clear()
                dims[axis].dim_value = len(range(*slice(s, e, st).indices(int(d))))
            else:
                dims[axis].Clear()  # open: left to the probe runs
    return sliced


def _missing_types_by_inference(model, names: list[str], types: dict[str, TensorType]):
    """Static shapes of ``names`` from onnxruntime's symbolic shape inference.

    ``types`` is filled in place where it has them; a model it cannot infer is left to the
    probe runs. ONNX's own inference stops at operators it cannot follow with the values
    it sees (tf2onnx's ResNet-50 left 740 of 845 outputs open); onnxruntime's tool, which
    propagates the small constants that compute shapes, found all 740 in 0.06 s, where
    probe runs of 32 tensors each took 3 s. It reads the whole model (a copy of the
    weights while it runs).
    """
    inferred = symbolic_inference(model)
    if inferred is None:  # the names are left to the probe runs
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
