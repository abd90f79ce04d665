"""The open sizes of an ONNX model, carried into the IR as expressions (:mod:`taso_jax.ops.dims`).

A model whose inputs leave sizes open (``dim_param``, or no size) is imported at one binding
of them (:func:`taso_jax.frontends.onnx_shapes._fix_input_shapes`). :func:`open_types` gives
every value of the model its type at that binding with each size that follows from an open
one as a :class:`~taso_jax.ops.dims.Dim`: the bound value, and the expression onnxruntime's
symbolic shape inference (``onnxruntime.tools.symbolic_shape_infer``, which follows the
``Shape``/``Gather``/``Concat`` arithmetic exporters write for reshape targets) finds for it.
The importers build nodes on those types, so reshape targets, slice ends and the sizes the
substitutions compute carry their expressions to the export, which writes them computed from
the inputs' shapes at run time.
"""

from __future__ import annotations

from collections.abc import Mapping

from taso_jax.frontends.onnx_tensor_types import symbolic_inference
from taso_jax.ops import TensorType
from taso_jax.ops.dims import Dim, from_expression, symbol

__all__ = ["open_types"]


def _safe_symbols(symbolic: Mapping[str, Mapping[int, str]]) -> dict[tuple[str, int], str]:
    """``(input, axis) -> name`` for each open size; inputs sharing a ``dim_param`` share one.

    The names (``s0``, ``s1``, ...) parse as SymPy symbols, which ``dim_param`` strings such
    as ``p2o.DynamicDimension.0`` or ``batch size`` do not.
    """
    by_param: dict[str, str] = {}
    out: dict[tuple[str, int], str] = {}
    for name in sorted(symbolic):
        for axis in sorted(symbolic[name]):
            param = symbolic[name][axis] or f"\0{name}[{axis}]"
            out[(name, axis)] = by_param.setdefault(param, f"s{len(by_param)}")
    return out


def open_types(model, symbolic: Mapping[str, Mapping[int, str]],
               types: Mapping[str, TensorType], deadline=None,
               static_axes: dict | None = None) -> dict[str, TensorType]:
    """``types`` with the sizes that follow from the model's open sizes as expressions.

    Args:
        model: the ``ModelProto`` as imported: opset-converted, its inputs bound to static
            sizes (not changed here; a light copy, without large weights, is inferred).
        symbolic: the open sizes of the original model,
            :func:`taso_jax.frontends.onnx_shapes.symbolic_dims` (input or output name ->
            ``{axis: dim_param}``).
        types: value name -> its type at the binding (``_value_types`` and the probe runs).
        deadline: a :class:`~taso_jax.search.limits.Deadline` past which the inference is
            given up, as where it fails; ``None``: no limit.
        static_axes: a dict filled with, per value name (inputs, initializers and what the
            inference reached), one flag per axis: whether its size is a number with the
            inputs opened again, the same at every binding. A size it leaves unknown, or a
            value it did not reach, may vary though ``types`` holds an integer for it.

    Returns:
        The same mapping, where each size that onnxruntime's symbolic shape inference
        expresses over the open input sizes is a :class:`~taso_jax.ops.dims.Dim` whose
        expression evaluates to the bound size. Sizes it does not express (fresh
        ``unk__`` names, a value that disagrees with the binding, a failed or late inference) stay
        plain integers: fixed at the binding, as before. Inputs' open sizes are always
        :class:`Dim` symbols.
    """
    from taso_jax.frontends.onnx_model import _light_model

    inits = {i.name for i in model.graph.initializer}
    graph_inputs = {i.name: i for i in model.graph.input if i.name not in inits}
    open_inputs = {n: axes for n, axes in symbolic.items() if n in graph_inputs and axes}
    if not open_inputs:
        return dict(types)
    names = _safe_symbols(open_inputs)
    binding: dict[str, int] = {}
    for (name, axis), sym in names.items():
        dims = graph_inputs[name].type.tensor_type.shape.dim
        if axis < len(dims) and dims[axis].HasField("dim_value"):
            binding.setdefault(sym, dims[axis].dim_value)
    out = dict(types)
    for name, axes in open_inputs.items():
        t = types.get(name)
        if t is None:
            continue
        shape = list(t.shape)
        for axis in axes:
            sym = names[(name, axis)]
            if axis < len(shape) and sym in binding and binding[sym] == shape[axis]:
                shape[axis] = Dim(shape[axis], symbol(sym))
        out[name] = TensorType(tuple(shape), t.dtype)
    inferred = _infer(_light_model(model), names, deadline)
    if static_axes is not None:
        for name, t in types.items():
            if name in inits:
                static_axes[name] = (True,) * len(t.shape)
            elif name in graph_inputs:
                static_axes[name] = tuple(k not in open_inputs.get(name, {})
                                          for k in range(len(t.shape)))
        for name, dims in inferred.items():
            if name not in graph_inputs and name not in inits:
                static_axes[name] = tuple(isinstance(d, int) and not isinstance(d, bool)
                                          for d in dims)
    if not inferred:
        return out
    known = frozenset(binding)
    for name, dims in inferred.items():
        t = out.get(name)
        if t is None or name in open_inputs or len(dims) != len(t.shape):
            continue
        shape, changed = list(t.shape), False
        for k, text in enumerate(dims):
            if not isinstance(text, str) or isinstance(shape[k], Dim):
                continue
            d = from_expression(shape[k], text, known)
            if isinstance(d, Dim) and d.evaluate(binding) == int(shape[k]):
                shape[k], changed = d, True
        if changed:
            out[name] = TensorType(tuple(shape), t.dtype)
    return out


def _infer(light, names: Mapping[tuple[str, int], str], deadline=None) -> dict[str, list]:
    """Onnxruntime's symbolic shapes of ``light``'s values with its inputs opened again.

    Returns value name -> sizes, each an int or an expression string over the names in
    ``names``; empty where the inference fails or ``deadline`` passes (it is a help, never
    a requirement).
    """
    _weights_as_inputs(light)
    for inp in light.graph.input:
        dims = inp.type.tensor_type.shape.dim
        for axis, d in enumerate(dims):
            sym = names.get((inp.name, axis))
            if sym is not None:
                d.Clear()
                d.dim_param = sym
    del light.graph.value_info[:]
    inferred = symbolic_inference(light, auto_merge=True, deadline=deadline)
    if inferred is None:  # the sizes stay fixed at the binding
        return {}
    out: dict[str, list] = {}
    for vi in [*inferred.graph.value_info, *inferred.graph.output]:
        tt = vi.type.tensor_type
        if not tt.HasField("shape"):
            continue
        out[vi.name] = [d.dim_param if d.HasField("dim_param") else
                        d.dim_value if d.HasField("dim_value") else None
                        for d in tt.shape.dim]
    return out


def _weights_as_inputs(light) -> None:
    """The light model's weights without data made graph inputs of their type and sizes.

    The tool reads an initializer's values wherever an operator's rule may compute on them
    (a ``Cast`` of an int8 embedding table): one without data raised, and the whole
    inference of a quantized MiniLM was lost with it (2026-11-30). A graph input has sizes
    and no values, which every rule allows for.
    """
    from onnx import helper

    kept = []
    for init in light.graph.initializer:
        empty = not init.raw_data and not any(
            len(getattr(init, f)) for f in ("float_data", "int32_data", "int64_data",
                                            "double_data", "uint64_data", "string_data"))
        if empty and all(d > 0 for d in init.dims) and init.dims:
            light.graph.input.append(helper.make_tensor_value_info(
                init.name, init.data_type, list(init.dims)))
        else:
            kept.append(init)
    if len(kept) != len(light.graph.initializer):
        del light.graph.initializer[:]
        light.graph.initializer.extend(kept)
