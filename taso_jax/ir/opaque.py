"""Opaque operations: what a front door could not map to a declared operator.

An opaque node (``node.op == "opaque"``) has a single attribute, ``call``, holding an
:class:`OpaqueOp`. The IR and the executor know only this interface; each front door
supplies its own kind (an ONNX node run by onnxruntime, a jaxpr equation run by JAX), so no
module tells opaque nodes apart by sniffing their attributes. Opaque nodes are never
rewritten: the search only matches declared operators.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["OpaqueOp"]


class OpaqueOp:
    """The computation of an opaque node. Subclasses must be hashable (nodes are hash-consed).

    Attributes:
        label: what a report calls it: the ONNX op type or the JAX primitive (``"LSTM"``).
    """

    label: str = "opaque"

    def evaluate(self, node, args: Sequence) -> tuple:
        """The node's outputs on JAX values (under ``jax.jit`` too), as a tuple.

        ``node`` is the opaque node (its input and output types); ``args`` one value per
        input tensor.
        """
        raise NotImplementedError

    def to_onnx(self, ctx, inputs: list[str], outputs: list[str]) -> None:
        """Emit the node into an ONNX graph being exported through ``ctx``.

        Raises:
            ValueError: the operation has no ONNX form.
        """
        raise ValueError(f"{self.label!r} has no ONNX mapping (it was kept as an opaque node "
                         "on import)")
