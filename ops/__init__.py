"""Operator declarations: one frozen record per operator, in one registry.

Each operator is declared once with its attribute schema, its JAX reference function (the
executable specification), its shape rule, its ONNX mapping (import handlers keyed by ONNX
``op_type`` and an export function), an analytic cost (FLOPs), a place for its Z3 axioms, and
examples that the registry-driven tests use. Nothing outside this package branches on
operator names: the IR, executor, generator, search and ONNX front door all read
:data:`OPS`.

Layouts follow ONNX: activations are NCHW, convolution kernels OIHW, matmul operands are
``[..., M, K] @ [..., K, N]``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from taso_jax.ops.dims import Dim

__all__ = [
    "OPS",
    "ONNX_IMPORTERS",
    "ONNX_SAME_MEANING",
    "JAXPR_IMPORTERS",
    "OpDef",
    "Axiom",
    "ShapeError",
    "TensorType",
    "declare",
    "axiom",
    "onnx_importer",
    "jaxpr_importer",
    "get_op",
    "is_float_dtype",
]


class ShapeError(ValueError):
    """Raised by a shape rule when inputs or attributes are not valid for an operator."""


def is_float_dtype(dtype) -> bool:
    """Whether ``dtype`` (a name or NumPy dtype) is a floating type, ml_dtypes' included.

    NumPy does not count ``bfloat16`` (nor the float8 types) among ``np.floating``: their
    kind is ``V``. A shape rule that asked NumPy alone refused every bfloat16 attention,
    softmax and normalization, so no rule that introduces them ever applied in bfloat16.
    """
    import numpy as np

    dt = np.dtype(dtype)
    return bool(np.issubdtype(dt, np.floating) or (dt.kind == "V" and "float" in dt.name))


class TensorType(NamedTuple):
    """Static type of a tensor: ``shape`` (tuple of ints) and ``dtype`` (numpy dtype name)."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def size(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= int(d)  # the count at the bound sizes (an open size's expression is not kept)
        return n

    @property
    def nbytes(self) -> int:
        """Size in bytes (a JAX PRNG key element, ``key<fry>``, counts as 8)."""
        import numpy as np

        try:
            return self.size * np.dtype(self.dtype).itemsize
        except TypeError:
            return self.size * 8


@dataclass(frozen=True, kw_only=True)
class OpDef:
    """Declaration of one operator, built with keywords only.

    Attributes:
        name: lower_snake operator name, used in code and in serialized substitutions.
        ref: JAX reference function ``ref(*inputs, **attrs)`` returning one array, or a tuple
            of arrays when ``num_outputs`` is not 1. This is the operator's specification.
        shape: shape rule ``shape(in_types, **attrs) -> list[TensorType]``; raises
            :class:`ShapeError` for invalid inputs.
        arity: number of inputs, or ``None`` for variadic operators.
        attrs: attribute names with their defaults; every node stores all of them.
        to_onnx: export function ``to_onnx(ctx, in_names, out_names, **attrs)`` emitting ONNX
            nodes (opset 13 or newer forms) through ``ctx``.
        flops: analytic cost ``flops(in_types, out_types, **attrs) -> float``; defaults to
            one operation per output element.
        examples: ``(in_types, attrs)`` pairs used by registry-driven tests.
        axioms: :class:`Axiom` laws about this operator, each a one-line equation that
            ``taso_jax.verify`` turns into a quantified Z3 formula and checks numerically
            against the reference functions.
        canon: optional ``canon(in_types, attrs) -> attrs`` that puts attributes in canonical
            form (for example negative axes), so structurally equal nodes compare equal.
        commutative: a binary operator whose inputs can be swapped; the matcher tries both
            orders, so substitutions need not be written twice.
        fusible: XLA fuses the operator into a neighbouring kernel (elementwise and layout
            operators), so it costs no kernel launch of its own.
        layout: how a transpose of the inputs passes through the operator, used to sink the
            layout transposes that NHWC front ends (flax, tf2onnx) put around convolutions:
            ``"elementwise"`` (NumPy broadcasting, output rank = input rank),
            ``"reduce"`` (attributes ``axes`` and ``keepdims``), ``"axis"`` (one ``axis``
            attribute; every input has the output's rank), or ``None`` (inputs are
            materialized in their own layout).
        channels_last: the operator that computes the same on the NHWC form of this
            operator's single NCHW input (same attributes, NHWC output), for the layout
            candidate (:func:`taso_jax.ir.layout.to_nhwc`): pools declare it.
        doc: one-line description, with the source of its semantics.
        numpy_ref: optional NumPy function with ``ref``'s signature and the same values,
            for operators whose result NumPy computes exactly (data movement, integer and
            IEEE float arithmetic). Constants are folded with it at import, so that an ONNX
            file's shape arithmetic loads no JAX (silero_vad_16k_op15: 263 -> 104 MB); the
            registry tests check it against ``ref``.
        grouped_kernel_axis: for an operator whose ``groups`` attribute splits its channels,
            the axis of its kernel (input 1) that holds one group's input channels (OIHW: 1,
            HWIO: 2); ``None`` otherwise. Forms of one such operator that differ only in
            ``groups`` are priced side by side by the measured cost model
            (:func:`taso_jax.search.cost.sibling_key`).
        num_outputs: for an operator with more than one output, ``num_outputs(attrs)``
            gives their number from its attributes (``None`` where an attribute variable
            leaves it open); ``None`` for an operator of one output. Rule files are checked
            against it.
        trailing: for a one-input operator that acts on its last ``trailing`` axes and
            independently over the leading ones (``causal_mask``: 2), so that a reshape that
            only inserts or removes unit leading axes passes through it
            (:func:`taso_jax.ir.layout.squeeze_unit_axes`); ``None`` otherwise. Elementwise
            operators and one-input ``layout="axis"`` operators need not declare it.
        lowering: the operator is another operator's implementation, with the same
            arithmetic and memory traffic, that runs faster on some devices
            (``conv2d_taps``, ``pointwise_matmul``): only measurement can choose it, and the
            analytic cost model prices it out of the search's reach
            (:data:`taso_jax.search.cost.LOWERING_PENALTY`) instead of at a tie.
        composition: for a fused operator, ``composition(node)`` gives the steps of the
            composition that ``node`` runs as (its definition), where ``node``'s attributes
            select no other implementation (``impl="blocked"``), else ``None``. A step is ``(operator,
            inputs, attributes)``; an input is one of ``node``'s input tensors or the index
            of an earlier step, whose first output it reads. The measured cost model
            prices such a node as the sum of those nodes: timed as one kernel it would look
            cheaper than the same arithmetic timed piece by piece, though XLA compiles the
            two alike (``masked_attention``, ``attention`` in its naive lowering).
        priced_as: for an operator whose node runs as a kernel of its own (no
            ``composition`` for its attributes) that the calibrated cost model has no curve
            for, ``priced_as(node)`` gives steps (as ``composition``'s) whose kernels
            estimate it instead (``block_masked_attention`` in query blocks: the matmuls and
            softmax of its key spans); the measured cost model times the node itself.
        family: the operator family whose cost curve a kernel of this operator falls back
            on when the calibrated cost model has few samples of its own
            (:mod:`taso_jax.search.calibrated`); by default the name of the ``ops``
            module that declares it (``conv``, ``im2col``, ``attention``, ``tensor``).
        dot_operands: the input positions whose elements reach each output element only as
            one factor of a product summed with others (a dot product's operands: both
            inputs of ``matmul`` and of a convolution). An element of such an input too small
            to change a sum in floating point is zeroed in a weight
            (:func:`taso_jax.ir.cleanup.flush_negligible_weights`).
        channel_scale: for a product linear in its weight (input 1) channel by channel,
            ``(output axis, weight axis)``, both negative: scaling the weight's slices along
            the weight axis by ``s[c]`` scales the output's slices along the output axis by
            ``s[c]`` (``conv2d``: NCHW output axis -3, OIHW kernel axis -4, any ``groups``;
            ``matmul``: the last axis of both). With no fused activation, a constant scale
            or shift after such a product folds into its weights
            (:mod:`taso_jax.ir.weight_folds`). ``None`` for other operators.
        runs_here: for an operator some of whose forms run only on some devices (a vendor
            library's fused kernel: ``attention(impl="cudnn")``), ``runs_here(node)`` says
            why the search may not build ``node`` on JAX's default device, or ``None``: the
            form cannot run here, or another form of the same node that runs here is known
            to be faster (measured, and named in the operator's docstring). Its reference
            function computes the same values everywhere (so its laws are checked on any
            machine); the search applies no rule whose target holds such a node
            (:func:`taso_jax.search.match.instantiate`).
        copies_values: every output element is an input element or a constant of the
            attributes (zero padding): a layout or selection operator, which neither rounds
            nor overflows nor underflows. A weight it folds ahead of time needs no check
            (:func:`taso_jax.ir.fold_check.fold_overflow` skips it, and the search's
            :class:`~taso_jax.search.fold_refusals.FoldGate` does not evaluate a rewrite
            that folds only such operators).
        product_dims: for an operator whose arithmetic is a matrix product (each output
            element a dot product: ``matmul``, a convolution and its lowerings),
            ``product_dims(in_types, out_types, **attrs)`` gives ``(rows, inner, columns)``
            of the product one group computes: a convolution's output pixels (N*OH*OW), its
            window times a group's input channels, and a group's output channels. The
            calibrated cost model prices a kernel by these beside its FLOPs and bytes
            (:mod:`taso_jax.search.calibrated`): on XLA:CPU a depthwise 3x3 convolution
            runs at 1 GFLOP/s and one of 16 channels a group at 40, for similar bytes.
            ``None`` for other operators.
    """

    name: str
    ref: Callable[..., Any]
    shape: Callable[..., list[TensorType]]
    arity: int | None
    attrs: dict[str, Any] = field(default_factory=dict)
    to_onnx: Callable[..., None] | None = None
    flops: Callable[..., float] | None = None
    examples: tuple = ()
    axioms: tuple = ()
    canon: Callable[..., dict[str, Any]] | None = None
    commutative: bool = False
    fusible: bool = False
    layout: str | None = None
    channels_last: str | None = None
    doc: str = ""
    numpy_ref: Callable[..., Any] | None = None
    grouped_kernel_axis: int | None = None
    num_outputs: Callable[[dict[str, Any]], int | None] | None = None
    trailing: int | None = None
    lowering: bool = False
    composition: Callable[[Any], list | None] | None = None
    priced_as: Callable[[Any], list | None] | None = None
    family: str = ""
    dot_operands: tuple[int, ...] = ()
    channel_scale: tuple[int, int] | None = None
    copies_values: bool = False
    runs_here: Callable[[Any], str | None] | None = None
    product_dims: Callable[..., tuple[float, float, float]] | None = None

    def normalize_attrs(self, attrs: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
        """Fill defaults, reject unknown names, and freeze values into a sorted tuple.

        Raises:
            ShapeError: an attribute name that the operator does not declare.
        """
        attrs = dict(attrs)
        unknown = set(attrs) - set(self.attrs)
        if unknown:
            raise ShapeError(f"{self.name}: unknown attribute(s) {sorted(unknown)}")
        full = {**self.attrs, **attrs}
        return tuple(sorted((k, _freeze(v)) for k, v in full.items()))

    def infer(self, in_types: Sequence[TensorType], attrs: dict[str, Any]) -> list[TensorType]:
        """Apply the shape rule, checking arity first.

        Raises:
            ShapeError: wrong number of inputs or invalid shapes/attributes.
        """
        if self.arity is not None and len(in_types) != self.arity:
            raise ShapeError(f"{self.name}: expects {self.arity} inputs, got {len(in_types)}")
        # plain ints (a NumPy integer from a rule becomes one); an open size stays a Dim
        return [TensorType(tuple(d if isinstance(d, Dim) else int(d) for d in t.shape),
                           str(t.dtype))
                for t in self.shape(list(in_types), **attrs)]

    def cost_flops(self, in_types, out_types, attrs) -> float:
        """Analytic operation count (FLOPs) of one execution."""
        if self.flops is not None:
            return float(self.flops(in_types, out_types, **attrs))
        return float(sum(t.size for t in out_types))


def matrix_product_dims(out: TensorType, columns: int, inner: int,
                        groups: int = 1) -> tuple[float, float, float]:
    """``(rows, inner, columns per group)`` of a matrix product: an ``OpDef.product_dims``.

    ``out`` is the product's output, with ``columns`` columns in all (a convolution's output
    channels, a product's last axis) in ``groups`` groups; its dot products have length
    ``inner``.
    """
    return (out.size / max(columns, 1), float(inner), columns / max(groups, 1))


@dataclass(frozen=True)
class Axiom:
    """One law about operators, written as an equation between two expressions.

    ``law`` is ``"lhs = rhs"`` in Python call syntax over declared operators, e.g.
    ``"relu(concat(a, b, axis=k)) = concat(relu(a), relu(b), axis=k)"``. Names are tensor
    variables (with a symbolic shape in ``shapes``) or attribute variables (with candidate
    values in ``params``); ``expr[i]`` takes output ``i`` of a multi-output operator, and
    ``dim(x, k)`` is the size of axis ``k`` of ``x``; a shape may start with ``"..."``, any
    leading dimensions (one of size 2 in the numeric check). The law holds for every shape that
    instantiates ``shapes`` and every attribute value in ``params`` for which both sides are
    well typed (source: TASO, Jia et al., SOSP 2019, Section 4 and Table 2).

    ``where`` defines further integer variables (``"s = dim(a, k)"``); the law is stated for
    them, so Z3 reads it as an implication and the numeric check computes them. Defining a
    name twice requires both definitions to agree (``"k = dim(u, -1)", "k = dim(w, -1)"``),
    and ``"i != j"``, ``"i < 0"`` are side conditions (``==``, ``!=``, ``<``, ``<=``); the
    numeric check skips instances that fail them. Axes in the IR are negative, so a law over axis
    variables should require ``i < 0``.

    Attributes:
        law: the equation.
        shapes: tensor variable -> symbolic shape. Ints are fixed sizes; strings are size
            symbols drawn at random, or expressions over them and the attribute variables
            (``"g*E"``: channels that ``groups=g`` divides).
        params: attribute variable -> values to validate with.
        where: ``"name = expression"`` definitions of size variables.
        derive: ``"rtl"`` or ``"ltr"`` to derive a rewrite rule from the law, right side to
            left or left to right (``taso_jax.verify.from_laws``), for rules whose source is
            longer than the generator enumerates; ``""`` for none.
        theorem: the law follows from the axioms and is not one of them: it is checked
            numerically like an axiom, but the prover does not assume it, so the rule it
            derives is proved from the others.
    """

    law: str
    shapes: tuple = ()
    params: tuple = ()
    where: tuple = ()
    derive: str = ""
    theorem: bool = False

    @property
    def sides(self) -> tuple[str, str]:
        """``(lhs, rhs)`` source text."""
        lhs, rhs = self.law.split(" = ")
        return lhs.strip(), rhs.strip()


def axiom(law: str, shapes: dict | None = None, where: tuple = (), derive: str = "",
          theorem: bool = False, **params) -> Axiom:
    """Build an :class:`Axiom`.

    ``params`` map attribute variables to candidate values; ``where`` lists size definitions
    and ``derive`` the direction of a rule derived from the law; ``theorem`` marks a law
    that is proved, not assumed (see :class:`Axiom`).
    """
    if derive not in ("", "rtl", "ltr"):
        raise ValueError(f"axiom {law!r}: derive must be 'rtl', 'ltr' or '', not {derive!r}")
    return Axiom(law, tuple(sorted((shapes or {}).items())),
                 tuple(sorted((k, tuple(v)) for k, v in params.items())), tuple(where), derive,
                 theorem)


def _freeze(v: Any) -> Any:
    if isinstance(v, list | tuple):
        return tuple(_freeze(x) for x in v)
    return v


OPS: dict[str, OpDef] = {}
ONNX_IMPORTERS: dict[str, Callable[..., Any]] = {}
#: (ONNX op type, schema version after opset 20) -> why its importer still holds there.
ONNX_SAME_MEANING: dict[tuple[str, int], str] = {}
JAXPR_IMPORTERS: dict[str, Callable[..., Any]] = {}


def declare(op: OpDef) -> OpDef:
    """Add an operator to the registry. Raises ``ValueError`` on a duplicate name.

    An operator without a ``family`` gets the name of the module that declares it.
    """
    if op.name in OPS:
        raise ValueError(f"operator {op.name!r} declared twice")
    if not op.family:
        import dataclasses
        import sys

        module = sys._getframe(1).f_globals.get("__name__", "")
        op = dataclasses.replace(op, family=module.rsplit(".", 1)[-1] or "other")
    OPS[op.name] = op
    return op


def onnx_importer(*op_types: str, same_meaning: Mapping[int, str] | None = None):
    """Register ``fn(ctx, node_inputs, **onnx_attrs) -> list of outputs`` for ONNX op types.

    ``ctx`` is a ``taso_jax.frontends.context.ImportContext``, the same for every front door:
    ``ctx.op(name, inputs, **attrs)`` creates a node, ``ctx.const(tensor)`` returns a
    constant's value or ``None``, ``ctx.weight(array)`` makes a new weight,
    ``ctx.type(tensor)`` gives its TensorType, ``ctx.out_types`` the ONNX-inferred output
    types, ``ctx.opset`` the model's opset and ``ctx.source_op`` the op type being imported.

    Importers follow the ONNX specification up to opset 20; a later version of an operator
    that changed more than its element types makes its nodes opaque
    (``taso_jax.frontends.onnx_io.importable_at``) unless ``same_meaning`` lists that
    version (the ``since_version`` of its schema) with the reason the importer still holds.
    """

    def register(fn):
        for t in op_types:
            ONNX_IMPORTERS[t] = fn
            for version, reason in (same_meaning or {}).items():
                ONNX_SAME_MEANING[(t, version)] = reason
        return fn

    return register


def jaxpr_importer(*primitives: str):
    """Register ``fn(ctx, inputs, **params) -> list of outputs`` for JAX primitives.

    ``primitives`` are ``jax.extend.core.Primitive`` names as they appear in a jaxpr (``add``,
    ``conv_general_dilated``, ...); ``params`` are the equation's parameters. ``ctx`` is the
    same ``ImportContext`` as for :func:`onnx_importer` (``ctx.source_op`` is the primitive's
    name; ``ctx.scalar(value, dtype)``, ``ctx.transpose`` and ``ctx.reshape`` help). Returning
    ``None`` keeps the equation as an opaque node that binds the original primitive
    (``taso_jax.frontends.jaxpr_io``).
    """

    def register(fn):
        for p in primitives:
            JAXPR_IMPORTERS[p] = fn
        return fn

    return register


def get_op(name: str) -> OpDef:
    """Look up an operator. Raises ``KeyError`` naming the unknown operator."""
    try:
        return OPS[name]
    except KeyError:
        raise KeyError(f"unknown operator {name!r}") from None


# Operator families register themselves on import.
from taso_jax.ops import (  # noqa: E402,F401
    attention,
    attention_masks,
    conv,
    elementwise,
    elementwise_jaxpr,
    experts,
    im2col,
    matmul,
    nn,
    norm,
    pointwise,
    pool,
    quantize,
    recurrent,
    resize,
    taps,
    tensor,
)
