"""An ONNX model as read, and the helpers that the ONNX import, shapes and export share.

The errors that refuse a model; reading one from a path, bytes or a ``ModelProto``; small
protobuf helpers (its opset, an element type as a NumPy dtype, a node's attributes); and the
light copy of a model, its large weights without their data, that onnx's C++ passes (shape
inference, the opset converter) run on.
"""

from __future__ import annotations

import os

import numpy as np

__all__ = ["ModelError", "ValueSizedModel", "ImportTimeLimit", "model_refusal", "LIGHT_BYTES"]


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


class ImportTimeLimit(Exception):
    """The time limit passed while a model was imported; ``str()`` says at which step.

    Raised only after ONNX's checker has accepted the model, so a caller may still deliver
    the file as it was given.
    """


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


def _attrs(node) -> dict:
    from onnx import helper

    out = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        if isinstance(v, list):
            v = tuple(v)
        out[a.name] = v
    return out
