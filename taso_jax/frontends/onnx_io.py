"""ONNX import and export (opsets 9 and newer, up to the installed ``onnx``'s newest).

Import: the model is loaded and checked, converted to opset 17 when older than 13 (so every
operator has its modern form), given static shapes (``input_shapes`` fills symbolic
dimensions; the others take defaults: 1 for a batch) and run through ONNX shape inference.
Initializers (sparse ones made dense), ``Constant`` and ``ConstantOfShape`` with a constant
shape become weights; calls of the model's own functions are inlined.
Each node goes through the importer that its operator declaration registered
(``taso_jax.ops.ONNX_IMPORTERS``); a node without one, or whose importer declines or
disagrees with ONNX shape inference, becomes an opaque node that is carried through
unchanged. The importers follow the operator specifications up to opset 20
(:data:`CHECKED_OPSET`); in a newer model, a node whose operator's specification changed
since then in more than its element types stays opaque (:func:`importable_at`).

Export: weight-only subgraphs are evaluated and written as initializers; every other node is
emitted by its declaration's ``to_onnx``. Input and output names are the original ones.

Source: ONNX IR and operator specifications (onnx.ai, opsets 9-28; ``onnx.defs``).

This module re-exports the public names of the modules that do the work, each named by
its role: :mod:`~taso_jax.frontends.onnx_import` (import),
:mod:`~taso_jax.frontends.onnx_shapes` (binding the input shapes),
:mod:`~taso_jax.frontends.onnx_tensor_types` (every tensor's type),
:mod:`~taso_jax.frontends.onnx_opaque` (opaque regions),
:mod:`~taso_jax.frontends.onnx_export` (export) and
:mod:`~taso_jax.frontends.onnx_model` (the model as read, its errors, shared helpers).
"""

from __future__ import annotations

from taso_jax.frontends.onnx_export import export_onnx
from taso_jax.frontends.onnx_import import (
    CHECKED_OPSET,
    MIN_OPSET,
    converted_model,
    importable_at,
    load_onnx,
    max_opset,
)
from taso_jax.frontends.onnx_model import (
    ImportTimeLimit,
    ModelError,
    ValueSizedModel,
    model_refusal,
)
from taso_jax.frontends.onnx_opaque import OnnxNode, merge_opaque_regions
from taso_jax.frontends.onnx_opaque import _session as _session
from taso_jax.frontends.onnx_shapes import (
    symbolic_dims,
    value_sized_hint,
    value_sized_inputs,
    with_symbolic_dims,
)
from taso_jax.frontends.onnx_tensor_types import INFER_OVER as INFER_OVER
from taso_jax.frontends.onnx_tensor_types import PROBE_OUTPUTS as PROBE_OUTPUTS
from taso_jax.frontends.onnx_tensor_types import index_bounds as index_bounds

__all__ = ["ModelError", "ImportTimeLimit", "OnnxNode", "merge_opaque_regions", "load_onnx",
           "export_onnx", "converted_model", "value_sized_inputs", "value_sized_hint",
           "ValueSizedModel", "model_refusal",
           "symbolic_dims", "with_symbolic_dims", "MIN_OPSET", "CHECKED_OPSET", "max_opset",
           "importable_at"]
