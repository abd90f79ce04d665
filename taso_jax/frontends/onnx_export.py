"""ONNX export: a :class:`~taso_jax.ir.graph.Graph` becomes an ``onnx.ModelProto``.

:func:`export_onnx` folds weight-only subgraphs into initializers where that does not make
the file grow, writes every other node by its operator declaration's ``to_onnx`` (an opaque
region writes its own nodes), and can hand large weights over beside the model instead of
serializing them into it. :func:`write_onnx` writes a model to a file, one over protobuf's
2 GB limit with its tensors in a data file beside it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Collection
from pathlib import Path

import numpy as np

from taso_jax.frontends.onnx_opaque import _outer_names
from taso_jax.ir.graph import Graph, Tensor
from taso_jax.ops import OPS, TensorType
from taso_jax.ops.dims import is_open, open_dims

__all__ = ["export_onnx", "EXTERNAL_MIN_BYTES", "PROTOBUF_LIMIT_BYTES", "serialize_onnx",
           "write_onnx"]


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
        # open size name -> (graph input, axis) where it can be read at run time
        self.symbols: dict[str, tuple[str, int]] = {}
        self._size_tensors: dict = {}
        self._arrays: dict[str, np.ndarray] = {}  # initializer name -> its array

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
        self._arrays[name] = array
        self.types[name] = TensorType(array.shape, str(array.dtype))
        return name

    def is_zero(self, name: str) -> bool:
        """Whether ``name`` is an initializer written so far whose elements are all zero."""
        array = self._arrays.get(name)
        return array is not None and not np.any(array)

    def scalar(self, value, dtype) -> str:
        return self.const(np.asarray(value, dtype))

    def shape(self, name: str) -> tuple[int, ...]:
        return self.types[name].shape

    def ints(self, values) -> str:
        """A 1-D int64 tensor of ``values``, sizes that may be open (:class:`Dim`).

        Where all are plain integers it is a constant; otherwise the open ones are computed
        at run time from the graph inputs' shapes (:meth:`size`), so the model runs at
        other bindings of its open sizes. An open size that cannot be computed that way is
        written at its bound value (the check at other sizes then finds it).
        """
        values = list(values)
        if not any(is_open(v) for v in values):
            return self.const(np.array([int(v) for v in values], np.int64))
        parts = [self.size(v) for v in values]
        if any(p is None for p in parts):
            return self.const(np.array([int(v) for v in values], np.int64))
        return parts[0] if len(parts) == 1 else self.tmp("Concat", parts, axis=0)

    def size(self, d) -> str | None:
        """A ``[1]`` int64 tensor computing size ``d`` at run time, or None if it cannot."""
        if not is_open(d):
            return self.const(np.array([int(d)], np.int64))
        return self._emit(d.expr)

    def _emit(self, e) -> str | None:
        import sympy as sp

        if e in self._size_tensors:
            return self._size_tensors[e]
        out = None
        if e.is_Integer:
            out = self.const(np.array([int(e)], np.int64))
        elif e.is_Symbol:
            where = self.symbols.get(e.name)
            if where is not None:
                shape = self._size_tensors.get(("Shape", where[0]))
                if shape is None:
                    shape = self._size_tensors[("Shape", where[0])] = self.tmp("Shape",
                                                                                [where[0]])
                out = self.tmp("Gather", [shape, self.const(np.array([where[1]], np.int64))],
                               axis=0)
        elif isinstance(e, sp.Add | sp.Mul | sp.Max | sp.Min):
            if isinstance(e, sp.Mul) and any(a.is_Rational and not a.is_Integer
                                             for a in e.args):
                return None  # a fraction outside floor(): not an integer expression
            args = [self._emit(a) for a in e.args]
            if all(a is not None for a in args):
                op = {sp.Add: "Add", sp.Mul: "Mul", sp.Max: "Max", sp.Min: "Min"}[e.func]
                out = args[0]
                for a in args[1:]:
                    out = self.tmp(op, [out, a])
        elif isinstance(e, sp.Pow) and e.exp.is_Integer and e.exp > 0:
            base = self._emit(e.base)
            if base is not None:
                out = base
                for _ in range(int(e.exp) - 1):
                    out = self.tmp("Mul", [out, base])
        elif isinstance(e, sp.floor):
            num, den = sp.fraction(sp.together(e.args[0]))
            if den.is_Integer and int(den) > 0:
                n = self._emit(sp.expand(num))
                if n is not None:  # sizes are non-negative: integer Div is floor here
                    out = self.tmp("Div", [n, self.const(np.array([int(den)], np.int64))])
        if out is not None:
            self._size_tensors[e] = out
        return out

    def dtype(self, name: str) -> str:
        return self.types[name].dtype


def _fold_no_larger(graph: Graph, keys: list, values: list) -> tuple[list, list, frozenset]:
    """The folded weight-only values worth storing, and the weight-only nodes to write.

    A folded value larger (in bytes) than the weights it is computed from would make the
    file grow: an int8-quantized MiniLM, its weights cast to float32 and scaled ahead of
    time, went from 21 MB of weights to 86 MB. Such a value's weight-only subgraph is
    written as operators on its weights instead; so is a value whose sizes follow the
    model's open ones (position embeddings sliced to the input's length: folded, they held
    the bound length only). Returns ``(keys, values, nodes)``: the
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
        if open_dims(t.shape) or t.type.nbytes > sum(graph.weights[n.name].nbytes
                                                      for n in leaves):
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
    from onnx import helper, numpy_helper

    opset = opset or max(int(graph.meta.get("opset", 17)), 13)
    ctx = _ExportContext(opset)
    const_keys, folded, skipped = _constants(graph, fold)
    names: dict[Tensor, str] = {}
    for n in graph.inputs:
        names[n.outputs[0]] = n.name
        ctx.types[n.name] = n.types[0]
        for axis, d in enumerate(n.types[0].shape):
            if is_open(d) and d.expr.is_Symbol:
                ctx.symbols.setdefault(d.expr.name, (n.name, axis))
    out_name = {}
    for t, nm in zip(graph.outputs, graph.output_names, strict=True):
        out_name.setdefault(t, nm)
    for t, value in zip(const_keys, folded, strict=True):
        nm = t.node.name if t.node.op == "weight" else ctx.fresh("folded")
        names[t] = ctx.const(np.asarray(value).astype(t.dtype, copy=False), nm)
    del folded
    _write_nodes(ctx, graph, names, out_name, skipped)
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
    read = {x for n in ctx.nodes for x in (*n.input, *_outer_names(n))} | set(out_name.values())
    _write_initializers(g, [(nm, a) for nm, a in ctx.initializers if nm in read], external)
    named = {n.name for n in graph.inputs}
    for name, value in (graph.meta.get("input_defaults") or {}).items():
        if name in named:  # an input with a default value (ONNX IR 4+) keeps it
            g.initializer.append(numpy_helper.from_array(np.asarray(value), name))
    opsets = dict(graph.meta.get("opsets", ()))
    opsets[""] = opset
    opsets.pop("ai.onnx", None)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid(d, v)
                                                for d, v in sorted(opsets.items())],
                              producer_name="taso_jax")
    model.ir_version = min(max(int(graph.meta.get("ir_version", 8)), 8), 10)
    return model


def _constants(graph: Graph, fold) -> tuple[list, list, frozenset]:
    """``(tensors, values, skipped)``: what an export stores as initializers.

    ``fold`` as in :func:`export_onnx`; ``skipped`` are the weight-only nodes not written
    (their values are stored). Weights that products read transposed are folded without
    the transpose, which is written as an operator (onnxruntime folds it when it loads
    the file).
    """
    from taso_jax.ir.executor import folded_values, read_transposed

    if fold is False:
        const_keys = [n.outputs[0] for n in graph.nodes if n.op == "weight"]
        return const_keys, [graph.weights[t.node.name] for t in const_keys], frozenset()
    const_keys, folded = (folded_values if fold is True else fold)(graph)
    const_keys, folded, computed = _fold_no_larger(graph, const_keys, folded)
    return const_keys, folded, graph.weight_only - computed - read_transposed(graph)


def _write_nodes(ctx, graph: Graph, names: dict, out_name: dict, skipped) -> None:
    """Each operator of ``graph`` not ``skipped``, through its ONNX mapping, into ``ctx``.

    ``names`` (tensor -> ONNX name) grows with their outputs; ``out_name`` holds the graph
    outputs' names.

    Raises:
        ValueError: an operator without an ONNX mapping.
    """
    gemms = _biased_products(graph, skipped)
    for n in graph.nodes:
        if n.op in ("input", "weight") or n in skipped or n in gemms.values():
            continue
        outs = []
        for t in n.outputs:
            names[t] = out_name.get(t) or ctx.fresh()
            ctx.types[names[t]] = t.type
            outs.append(names[t])
        if n in gemms:
            _write_gemm(ctx, gemms[n], n, names, outs[0])
            continue
        ins = [names[t] for t in n.inputs]
        if n.op == "opaque":
            n.attr("call").to_onnx(ctx, ins, outs)
            continue
        opdef = OPS[n.op]
        if opdef.to_onnx is None:
            raise ValueError(f"operator {n.op!r} has no ONNX mapping")
        opdef.to_onnx(ctx, ins, outs, **dict(n.attrs))

def _biased_products(graph: Graph, skipped) -> dict:
    """``{add node: matmul node}`` for each product of a weight that a bias is added to.

    The matmul (no activation) reads a 2-D weight-only ``B`` ``[K, N]``; its output is
    read by that one ``ewadd`` alone, and is no graph output; the add's other input is a
    weight-only float bias of ``N`` elements (``[N]`` or ``[1, N]``). Such a pair is
    written as one ONNX ``Gemm`` (:func:`_write_gemm`).
    """
    readers, outputs = graph.consumers, graph.output_set
    pairs = {}
    for a in graph.nodes:
        if a.op != "ewadd" or a in skipped or a.weight_only:
            continue
        for k in (0, 1):
            m, bias = a.inputs[k].node, a.inputs[1 - k]
            if (m.op != "matmul" or m.attr("activation") != "none" or m in skipped
                    or len(m.inputs[1].shape) != 2 or not m.inputs[1].node.weight_only
                    or m.outputs[0] in outputs or len(readers.get(m.outputs[0], ())) != 1
                    or not bias.node.weight_only or bias.dtype not in ("float32", "float64")
                    or tuple(bias.shape) not in ((m.inputs[1].shape[1],),
                                                 (1, m.inputs[1].shape[1]))
                    or a.types[0].shape != m.types[0].shape):
                continue
            pairs[a] = m
            break
    return pairs


def _write_gemm(ctx, m, a, names: dict, out: str) -> None:
    """``matmul(x, B) + bias`` (:func:`_biased_products`) as ONNX ``Gemm``.

    onnxruntime runs a ``Gemm`` as one kernel with the bias added as it writes, where a
    ``MatMul`` on a 3-D input and an ``Add`` are two (its ``MatMul``/``Add`` fusion is for
    2-D inputs only; onnxsim's 1.12x on a voice activity detector, 2026-11-30). ``x`` of
    more than two dimensions is flattened to ``[-1, K]`` and the result reshaped back,
    with one open leading size written as ``-1`` (ONNX Gemm-13, Reshape-14).
    """
    x = names[m.inputs[0]]
    shape = m.types[0].shape
    if len(shape) > 2:
        k = m.inputs[0].shape[-1]
        x = ctx.tmp("Reshape", [x, ctx.const(np.array([-1, int(k)], np.int64))])
    bias = names[a.inputs[1] if a.inputs[0].node is m else a.inputs[0]]
    if len(shape) <= 2:
        ctx.node("Gemm", [x, names[m.inputs[1]], bias], [out])
        return
    y = ctx.tmp("Gemm", [x, names[m.inputs[1]], bias])
    open_ = [d for d in shape if is_open(d)]
    target = (ctx.const(np.array([-1 if is_open(d) else int(d) for d in shape], np.int64))
              if len(open_) <= 1 else ctx.ints(shape))
    ctx.node("Reshape", [y, target], [out])


def _write_initializers(g, initializers: list, external: dict | None) -> None:
    """Move ``initializers`` (``(name, array)``, emptied here) into graph ``g``.

    Each weight is written into the graph's own field, one at a time: a list of
    TensorProtos handed to ``make_graph`` was copied in whole, holding the weights twice.
    With ``external``, arrays of at least :data:`EXTERNAL_MIN_BYTES` are written as
    references and put in ``external`` by name (see :func:`export_onnx`).
    """
    import onnx
    from onnx import helper, numpy_helper

    initializers.reverse()
    while initializers:
        name, array = initializers.pop()
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


#: The largest model serialized as one protobuf message: protobuf refuses messages of 2 GiB
#: and more (``EncodeError: Failed to serialize proto``). A larger model is written with its
#: tensors in an external data file (ONNX's ``data_location: EXTERNAL``).
PROTOBUF_LIMIT_BYTES = 2**31 - 1
#: Tensors of at least this many bytes go to the external data file of a large model.
_EXTERNAL_DATA_MIN_BYTES = 1024


def _tensors(model):
    """Every ``TensorProto`` of ``model``: initializers and attribute values, subgraphs too."""
    from onnx import AttributeProto

    graphs = [model.graph]
    while graphs:
        g = graphs.pop()
        yield from g.initializer
        for node in g.node:
            for a in node.attribute:
                if a.type == AttributeProto.TENSOR:
                    yield a.t
                yield from a.tensors
                graphs.extend([a.g] if a.type == AttributeProto.GRAPH else a.graphs)


def _fits_one_message(model) -> bool:
    """Whether ``model`` serializes within :data:`PROTOBUF_LIMIT_BYTES`.

    protobuf's upb runtime raises ``EncodeError`` from ``ByteSize`` itself past 2 GiB.
    """
    from google.protobuf.message import EncodeError

    try:
        return model.ByteSize() <= PROTOBUF_LIMIT_BYTES
    except EncodeError:
        return False


def _has_external_tensors(model) -> bool:
    from onnx.external_data_helper import uses_external_data

    return any(uses_external_data(t) for t in _tensors(model))


def serialize_onnx(model, spill_path: str) -> bytes | str:
    """``model`` serialized, or, where one message cannot hold it, saved at ``spill_path``.

    A model up to :data:`PROTOBUF_LIMIT_BYTES` whose tensors are all inline comes back as
    bytes. A larger one is saved at ``spill_path`` with its tensors in one file beside it
    (``<spill_path>.data``; ``model`` itself then refers to that file, its data dropped),
    and a model whose tensors already refer to such a file in ``spill_path``'s folder is
    saved there as it is: the path is returned. onnxruntime and ``onnx.checker`` take
    either; :func:`write_onnx` writes either.
    """
    import onnx

    if not _has_external_tensors(model):
        if _fits_one_message(model):
            return model.SerializeToString()
        onnx.save_model(model, spill_path, save_as_external_data=True,
                        all_tensors_to_one_file=True,
                        location=os.path.basename(spill_path) + ".data",
                        size_threshold=_EXTERNAL_DATA_MIN_BYTES)
        return spill_path
    onnx.save_model(model, spill_path)
    return spill_path


def write_onnx(path: str, model, keep: Collection[str] = ()) -> str | None:
    """Write ``model`` to ``path`` atomically; a large one with its tensors beside it.

    ``model`` is serialized bytes (written as they are), a ``ModelProto`` whose tensors are
    inline (``onnx.load`` reads external data into it), or a path that
    :func:`serialize_onnx` returned. A model over :data:`PROTOBUF_LIMIT_BYTES` (or one
    already split) is written as ``path`` plus its tensors in ``<path>.data`` (the
    location the model names, relative, so the two move together). Each file is written
    to a temporary name and renamed; the data file is renamed first, so the model never
    names a data file that is not complete. A ``ModelProto`` may be left referring to the
    data file. Returns the data file's path, or ``None`` when there is none.

    Raises:
        ModelError: the data file would be one of the files ``keep`` names (the input
            model and its own data files: :func:`~taso_jax._io.same_file`, so a hard link
            is that file too); nothing is written.
        OSError: a write failed; one that named no file or a temporary one names ``path``
            (:func:`taso_jax._io.naming_output`).
    """
    import onnx

    from taso_jax._io import TEMP_PREFIX, atomic_write, naming_output, same_file
    from taso_jax.frontends.onnx_model import ModelError

    if isinstance(model, bytes | bytearray):
        atomic_write(path, lambda tmp: Path(tmp).write_bytes(model))
        return None
    if isinstance(model, onnx.ModelProto) and _fits_one_message(model):
        atomic_write(path, lambda tmp: onnx.save_model(model, tmp))
        return None
    data_path = os.fspath(path) + ".data"
    if any(same_file(data_path, k) for k in keep):
        raise ModelError(f"{path}: the model is over protobuf's 2 GB limit and is written with "
                         f"its tensors in {data_path}, which would replace a file of the "
                         "input model; choose another -o")
    folder = os.path.dirname(os.path.abspath(path))
    with naming_output(path), tempfile.TemporaryDirectory(dir=folder, prefix=TEMP_PREFIX) as tmp:
        if isinstance(model, onnx.ModelProto):
            spilled = serialize_onnx(model, os.path.join(tmp, os.path.basename(data_path)[:-5]))
            proto = onnx.load(spilled, load_external_data=False)
            source_folder = tmp
        else:
            proto = onnx.load(model, load_external_data=False)
            source_folder = os.path.dirname(os.path.abspath(model))
        sources = set()
        for t in _tensors(proto):
            for entry in t.external_data:
                if entry.key == "location":
                    sources.add(entry.value)
                    entry.value = os.path.basename(data_path)
        if len(sources) > 1:
            raise ValueError(f"{model}: tensors in several data files {sorted(sources)}")
        if sources:
            source = os.path.join(source_folder, sources.pop())
            if source_folder == tmp:  # ours, in the same folder: renamed, not copied
                umask = os.umask(0)
                os.umask(umask)
                os.chmod(source, 0o666 & ~umask)  # as atomic_write leaves the model
                os.replace(source, data_path)
            else:
                atomic_write(data_path, lambda tmp_data: shutil.copyfile(source, tmp_data))
        atomic_write(path, lambda tmp_model: onnx.save_model(proto, tmp_model))
    return data_path
