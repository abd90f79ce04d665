"""JAX front door: trace a function with ``jax.make_jaxpr`` and import the jaxpr as a graph.

Each equation goes through the importer that its operator declaration registered for the
primitive (``taso_jax.ops.JAXPR_IMPORTERS``: ``conv_general_dilated``, ``dot_general``,
``add``, ``max(x, 0)`` as relu, ...). Call-like equations (``jit``, ``closed_call``,
``custom_jvp_call``, ``custom_vjp_call``, ``remat2``) are inlined: their inner jaxpr is
imported in place. An equation without an importer, or whose importer declines, becomes an
opaque node that evaluates the original equation (the primitive bound with its parameters),
so every traced function still runs; opaque nodes are never rewritten.

Arguments are pytrees. The array leaves of the arguments named by ``weight_argnums`` /
``weight_argnames`` become weights (their values are known ahead of time, so weight-only
subgraphs are precomputed); all other array leaves become runtime inputs, named by their
pytree path (``x``, ``params['dense']['kernel']``). Literals and closed-over constants
become weights too.

After import, :func:`taso_jax.ir.layout.sink_transposes` removes the layout transposes
that an NHWC program (flax, ``jax.lax.conv`` with ``("NHWC", "HWIO", "NHWC")``) puts around each
convolution, so the search sees NCHW convolutions followed by their elementwise consumers,
and :func:`taso_jax.frontends.canonical.normalize_affine` writes per-channel affine chains as
``x * s + t`` (flax's batchnorm is ``(x - mean) * s + b``), the form the substitutions fold.

Source: JAX's jaxpr language (jax.readthedocs.io, "Understanding Jaxprs") and the public
``jax.extend.core`` API.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

from taso_jax.frontends.context import ImportContext
from taso_jax.frontends.onnx_io import ImportTimeLimit, ModelError
from taso_jax.ir.graph import Graph, Node, intern_node, leaf_node
from taso_jax.ir.opaque import OpaqueOp
from taso_jax.ops import JAXPR_IMPORTERS, ShapeError, TensorType

__all__ = ["from_jax", "import_jaxpr", "trace_function", "TracedFunction", "normalize_argnums",
           "JaxEquation", "INLINED"]

#: Call-like primitives whose inner jaxpr is imported in place.
INLINED = ("jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
           "custom_vjp_call_jaxpr", "remat2", "checkpoint", "remat")


class JaxEquation(OpaqueOp):
    """One jaxpr equation kept as it is (an opaque node); calling it evaluates the equation.

    Hashes and compares by identity: two opaque nodes are the same only if they come from the
    same equation. ``inputs`` are the equation's distinct variables, in the order the node
    receives them; outputs are its non-dropped variables.
    """

    def __init__(self, eqn, invars: Sequence, outvars: Sequence):
        self.eqn = eqn
        self.primitive = self.label = eqn.primitive.name
        import warnings

        with warnings.catch_warnings():  # a one-equation jaxpr has no source to point at
            warnings.simplefilter("ignore", DeprecationWarning)
            jaxpr = jcore.Jaxpr([], list(invars), list(outvars), [eqn], eqn.effects)
        self._fn = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(jaxpr, []))

    def __call__(self, *args) -> tuple:
        """Evaluate the equation on JAX values (works under ``jit``, ``grad`` and ``vmap``)."""
        return tuple(self._fn(*args))

    def __repr__(self) -> str:
        return f"JaxEquation({self.primitive})"

    def evaluate(self, node, args) -> tuple:
        """The equation's outputs on JAX values."""
        return self(*args)

    def to_onnx(self, ctx, inputs: list[str], outputs: list[str]) -> None:
        """The equation as ONNX nodes.

        ``stop_gradient`` (its value is its input) is an ``Identity``. Any other primitive
        is converted by ``jax2onnx`` (the ``onnx-export`` extra) at the export's opset, and
        its nodes and initializers are spliced in, with its own tensors renamed apart.

        Raises:
            ValueError: ``jax2onnx`` is not installed, cannot convert the primitive, or gives
                other element types than the graph's.
        """
        if self.primitive in _FORWARD_IDENTITY:
            ctx.node("Identity", inputs, outputs)
            return
        try:
            from jax2onnx import to_onnx as jax_to_onnx
        except ImportError as e:
            raise ValueError(f"JAX primitive {self.primitive!r} has no ONNX mapping of its own; "
                             "install the extra that converts it with jax2onnx: pip install "
                             "'taso_jax[onnx-export]'") from e
        specs = [jax.ShapeDtypeStruct(ctx.shape(n), ctx.dtype(n)) for n in inputs]
        try:
            model = jax_to_onnx(lambda *a: self(*a), specs, opset=ctx.opset,
                                model_name=self.primitive)
        except Exception as e:  # jax2onnx has no plugin for it, or fails on it
            raise ValueError(f"JAX primitive {self.primitive!r}: jax2onnx cannot convert it "
                             f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from e
        _splice(model, ctx, inputs, outputs, self.primitive)


def _splice(model, ctx, inputs: list[str], outputs: list[str], what: str) -> None:
    """Append a converted one-equation ONNX ``model`` to an export, renamed to fit.

    Its graph inputs become ``inputs``, its outputs ``outputs``; every other tensor and
    initializer gets a fresh name. Models with subgraphs or local functions are refused
    (their inner references could not be renamed safely).
    """
    from onnx import AttributeProto, helper, numpy_helper

    g = model.graph
    if model.functions or any(a.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS)
                              for n in g.node for a in n.attribute) or any(
            n.domain not in ("", "ai.onnx") for n in g.node):
        raise ValueError(f"JAX primitive {what!r}: jax2onnx wrote subgraphs, functions or "
                         "custom-domain nodes, which cannot be spliced into the export")
    rename = dict(zip((i.name for i in g.input), inputs, strict=True))
    rename.update(zip((o.name for o in g.output), outputs, strict=True))
    for vi, name in [*zip(g.input, inputs, strict=True), *zip(g.output, outputs, strict=True)]:
        want = np.dtype(ctx.types[name].dtype) if name in ctx.types else None
        got = helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
        if want is not None and np.dtype(got) != want:
            raise ValueError(f"JAX primitive {what!r}: jax2onnx wrote {vi.name} as {got}, "
                             f"the graph has {want}")
    for init in g.initializer:
        value = numpy_helper.to_array(init)
        rename[init.name] = ctx.const(value, ctx.fresh("j2o"))
    for node in g.node:
        for x in [*node.input, *node.output]:
            if x and x not in rename:
                rename[x] = ctx.fresh("j2o")
        ctx.node(node.op_type, [rename[x] if x else "" for x in node.input],
                 [rename[x] if x else "" for x in node.output],
                 **{a.name: helper.get_attribute_value(a) for a in node.attribute})


#: JAX primitives kept opaque for their derivative rules, whose value is their input.
_FORWARD_IDENTITY = ("stop_gradient",)


def _ttype(aval) -> TensorType:
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key):
        # a typed PRNG key between random_wrap and random_bits: only opaque equations make
        # or read it, so its type is kept by name
        return TensorType(tuple(int(d) for d in aval.shape), str(aval.dtype))
    try:
        dtype = str(np.dtype(aval.dtype))
    except TypeError as e:
        raise ModelError(f"unsupported element type {aval.dtype} (only NumPy dtypes)") from e
    return TensorType(tuple(int(d) for d in aval.shape), dtype)


#: Equations imported between two looks at the deadline (inlined ones counted too).
_DEADLINE_EVERY = 256


class _Clock:
    """The import's deadline and how many equations it has imported (across inlining)."""

    def __init__(self, deadline, total: int):
        self.deadline, self.total, self.done = deadline, total, 0

    def tick(self) -> None:
        """Count one equation; every :data:`_DEADLINE_EVERY`, look at the deadline."""
        self.done += 1
        if self.done % _DEADLINE_EVERY == 0:
            self.check(f"{self.done:,} equations imported (of {self.total:,} at the top level)")

    def check(self, step: str) -> None:
        """Raise :class:`ImportTimeLimit` naming ``step`` where the deadline has passed."""
        if self.deadline is not None and self.deadline.passed():
            raise ImportTimeLimit(f"the time limit passed during the import: {step}")


def _inner_jaxpr(eqn):
    """``(jaxpr, consts)`` of a call-like equation, else ``None``."""
    if eqn.primitive.name not in INLINED:
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if isinstance(sub, jcore.ClosedJaxpr):
            return sub.jaxpr, list(sub.consts)
        if isinstance(sub, jcore.Jaxpr):
            return sub, []
    return None


def _import_eqns(jaxpr, env: dict, ctx: ImportContext, opaque: dict, inlined: dict,
                 clock: _Clock):
    def read(v):
        if isinstance(v, jcore.Literal):
            return ctx.weight(np.asarray(v.val, dtype=_ttype(v.aval).dtype), "literal")
        return env[v]

    for eqn in jaxpr.eqns:
        clock.tick()
        name = eqn.primitive.name
        sub = _inner_jaxpr(eqn)
        if sub is not None:
            inner, consts = sub
            inlined[name] = inlined.get(name, 0) + 1
            for v, c in zip(inner.constvars, consts, strict=True):
                env[v] = ctx.weight(np.asarray(c))
            for v, x in zip(inner.invars, eqn.invars, strict=True):
                env[v] = read(x)
            _import_eqns(inner, env, ctx, opaque, inlined, clock)
            for v, x in zip(eqn.outvars, inner.outvars, strict=True):
                if not isinstance(v, jcore.DropVar):
                    env[v] = read(x)
            continue
        ins = [read(v) for v in eqn.invars]
        out_types = [_ttype(v.aval) for v in eqn.outvars]
        res = None
        importer = JAXPR_IMPORTERS.get(name)
        if importer is not None and not eqn.effects:
            ctx.out_types, ctx.source_op = out_types, name
            try:
                res = importer(ctx, ins, **eqn.params)
            except (ShapeError, TypeError, ValueError, KeyError, IndexError):
                res = None
            if res is not None and (len(res) != len(out_types) or any(
                    t.type != want for t, want in zip(res, out_types, strict=True))):
                res = None
        if res is None:
            res = _opaque(eqn, env, read)
            opaque[name] = opaque.get(name, 0) + 1
        for v, t in zip(eqn.outvars, res, strict=True):
            if t is not None and not isinstance(v, jcore.DropVar):
                env[v] = t


def _opaque(eqn, env, read) -> list:
    invars = []
    for v in eqn.invars:
        if isinstance(v, jcore.Var) and not isinstance(v, jcore.Literal) and v not in invars:
            invars.append(v)
    outvars = [v for v in eqn.outvars if not isinstance(v, jcore.DropVar)]
    handle = JaxEquation(eqn, invars, outvars)
    node = intern_node("opaque", (("call", handle),), tuple(read(v) for v in invars),
                       tuple(_ttype(v.aval) for v in outvars))
    it = iter(node.outputs)
    return [None if isinstance(v, jcore.DropVar) else next(it) for v in eqn.outvars]


def import_jaxpr(closed, in_leaves: Sequence[tuple[str, bool, object]], out_names: Sequence[str],
                 name: str = "jax_function", sink_layout: bool = True, *,
                 deadline=None) -> Graph:
    """Import a ``ClosedJaxpr`` into a :class:`~taso_jax.ir.graph.Graph`.

    Args:
        closed: the ``jax.extend.core.ClosedJaxpr`` (from ``jax.make_jaxpr``).
        in_leaves: one ``(name, is_weight, value)`` per jaxpr input variable; ``value`` is the
            weight's array (ignored for runtime inputs).
        out_names: one name per jaxpr output.
        name: graph name (``graph.meta["name"]``).
        sink_layout: run :func:`taso_jax.ir.layout.squeeze_unit_axes` and
            :func:`taso_jax.ir.layout.sink_transposes` after import.
        deadline: a :class:`~taso_jax.search.limits.Deadline`, or ``None`` (no limit): the
            import looks at it every 256 equations and before each normalization.

    Raises:
        ModelError: a jaxpr with side effects (``jax.debug.print``, ``io_callback``) or an
            element type that is not a NumPy dtype (PRNG keys).
        ImportTimeLimit: ``deadline`` passed; the message names the step.
    """
    from taso_jax.frontends.canonical import normalize_affine
    from taso_jax.ir.layout import sink_transposes, squeeze_unit_axes

    if closed.effects:
        effects = sorted(map(str, closed.effects))
        raise ModelError(f"{name}: the function has side effects ({effects}); they would be "
                         "lost")
    jaxpr = closed.jaxpr
    weights: dict[str, np.ndarray] = {}
    ctx = ImportContext(weights, constants=set(), dedupe_literals=True)
    env: dict = {}
    inputs: list[Node] = []
    for v, c in zip(jaxpr.constvars, closed.consts, strict=True):
        env[v] = ctx.weight(np.asarray(c))
    for v, (leaf_name, is_weight, value) in zip(jaxpr.invars, in_leaves, strict=True):
        tt = _ttype(v.aval)
        if is_weight:
            weights[leaf_name] = np.asarray(value)
            env[v] = leaf_node("weight", leaf_name, tt).outputs[0]
        else:
            node = leaf_node("input", leaf_name, tt)
            inputs.append(node)
            env[v] = node.outputs[0]
    opaque: dict[str, int] = {}
    inlined: dict[str, int] = {}
    clock = _Clock(deadline, len(jaxpr.eqns))
    clock.check("before the equations")
    _import_eqns(jaxpr, env, ctx, opaque, inlined, clock)
    outputs = []
    for v in jaxpr.outvars:
        if isinstance(v, jcore.Literal):
            outputs.append(ctx.weight(np.asarray(v.val, dtype=_ttype(v.aval).dtype), "literal"))
        else:
            outputs.append(env[v])
    meta = {"name": name, "opaque": opaque, "inlined": inlined, "source": "jaxpr",
            "constants": frozenset(ctx.constants)}
    g = Graph(tuple(inputs), tuple(outputs), tuple(out_names), weights, meta)
    # Count the opaque equations the graph kept: an importer that recognizes a pattern
    # (softmax written out) leaves the equations it replaced unused.
    live: dict[str, int] = {}
    for n in g.nodes:
        if n.op == "opaque":
            label = getattr(dict(n.attrs)["call"], "primitive", "opaque")
            live[label] = live.get(label, 0) + 1
    if live != opaque:
        g = Graph(g.inputs, g.outputs, g.output_names, weights, {**meta, "opaque": live})
    clock.check(f"after the {clock.done:,} equations")
    if sink_layout:
        g = sink_transposes(squeeze_unit_axes(g))
        clock.check("after the layout transposes were sunk")
    return normalize_affine(g)


def normalize_argnums(fn: Callable, nargs: int | None, argnums, argnames, what: str) -> set[int]:
    """Positions named by ``argnums`` (int or ints) and ``argnames`` (str or strs).

    Raises:
        ValueError: a position out of range for ``nargs`` or a name that is not a parameter
            of ``fn``; the message names the option (``what``) and the bad value.
    """
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums or ())
    names = (argnames,) if isinstance(argnames, str) else tuple(argnames or ())
    out = set()
    params = None
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        pass
    for i in nums:
        if not isinstance(i, int):
            raise ValueError(f"{what}_argnums: {i!r} is not an integer")
        if nargs is not None and not -nargs <= i < nargs:
            raise ValueError(f"{what}_argnums: position {i} is out of range; "
                             f"{_fn_name(fn)} was called with {nargs} positional argument(s)")
        out.add(i % nargs if nargs else i)
    for n in names:
        if params is None or n not in params:
            raise ValueError(f"{what}_argnames: {n!r} is not a parameter of {_fn_name(fn)}"
                             + (f" (parameters: {params})" if params else ""))
        out.add(params.index(n))
    return out


def _fn_name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _path_name(prefix: str, path) -> str:
    return prefix + jax.tree_util.keystr(path) if path else prefix


_ARRAY_LEAF_TYPES: dict[type, bool] = {}


def _is_array_leaf(x) -> bool:
    """Whether a pytree leaf is an array (JAX, NumPy, tracer) or a Python number.

    Cached per type: it runs per leaf on every call of an optimized function.
    """
    t = type(x)
    known = _ARRAY_LEAF_TYPES.get(t)
    if known is None:
        known = _ARRAY_LEAF_TYPES[t] = isinstance(
            x, jax.Array | np.ndarray | np.generic | int | float | complex | bool)
    return known


def argument_names(fn: Callable, nargs: int) -> list[str]:
    """Names of ``fn``'s first ``nargs`` positional parameters (``arg{i}`` when unknown)."""
    try:
        params = [p.name for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    return [params[i] if i < len(params) else f"arg{i}" for i in range(nargs)]


@dataclass(frozen=True)
class TracedFunction:
    """A function traced for one call signature: what ``from_jax`` and the decorator import.

    Attributes:
        closed: the ``ClosedJaxpr`` of :attr:`flat_fn`.
        flat_fn: the function of the array leaves alone, in order (static arguments and
            non-array leaves are closed over); ``jax.jit(flat_fn)`` is the original.
        leaves: the array leaves (arrays, tracers or Python numbers), in order.
        kinds: ``"weight"`` or ``"input"`` per leaf.
        paths: per leaf, its argument name and pytree path (``params['dense']['kernel']``).
        array_index: per leaf, its position among the flattened non-static arguments.
        n_flat: how many leaves the non-static arguments flatten to (arrays or not).
        out_names: per output leaf, ``out`` and its pytree path (``out[0]``).
        out_tree: the output's pytree structure.
        key_leaves: leaf index -> PRNG implementation, for typed PRNG key leaves: such a
            leaf is passed as its ``jax.random.key_data`` (a uint32 array) and wrapped back
            inside :attr:`flat_fn`, so the graph sees an ordinary array
            (:func:`leaves_for_call` converts a call's keys).
    """

    closed: Any
    flat_fn: Callable
    leaves: list
    kinds: list[str]
    paths: list[str]
    array_index: list[int]
    n_flat: int
    out_names: list[str]
    out_tree: Any
    key_leaves: dict = field(default_factory=dict)

    def weight_specs(self) -> list[tuple[str, bool, object]]:
        """``(path, is weight, value)`` per leaf, as :func:`import_jaxpr` takes them.

        Only weights carry a value (a tracer's value is unknown: zeros stand in, which only
        matters for checking; the search needs shapes alone).
        """
        specs = []
        for leaf, kind, path in zip(self.leaves, self.kinds, self.paths, strict=True):
            value = None
            if kind == "weight":
                value = (np.zeros(np.shape(leaf), jax.numpy.result_type(leaf))
                         if isinstance(leaf, jax.core.Tracer) else np.asarray(leaf))
            specs.append((path, kind == "weight", value))
        return specs

    def to_graph(self, name: str, sink_layout: bool = True, deadline=None) -> Graph:
        """The traced function as a graph (:func:`import_jaxpr`, under ``deadline``).

        Raises:
            ModelError: as :func:`import_jaxpr`.
            ImportTimeLimit: ``deadline`` (a :class:`~taso_jax.search.limits.Deadline`)
                passed during the import.
        """
        return import_jaxpr(self.closed, self.weight_specs(), self.out_names, name, sink_layout,
                            deadline=deadline)


def abstract_leaf(x):
    """A leaf as ``jax.ShapeDtypeStruct`` (Python numbers are weakly typed scalars)."""
    if isinstance(x, bool | int | float | complex):
        return jax.ShapeDtypeStruct((), jax.numpy.result_type(x), weak_type=True)
    return jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x))


def trace_function(fn: Callable, args: Sequence, weight_pos: set[int],
                   static_pos: set[int] = frozenset(), non_arrays: str = "error"
                   ) -> TracedFunction:
    """Flatten ``args`` and trace ``fn`` once, by the same rules for every front door.

    Args:
        fn: the function, called positionally.
        args: one value per positional parameter.
        weight_pos: positions of the arguments whose array leaves are weights.
        static_pos: positions of arguments passed through untraced (hashable values).
        non_arrays: what a non-array leaf of a traced argument is: ``"error"`` (a
            ``ValueError`` naming the argument and path) or ``"static"`` (closed over; the
            decorator keys them by value, so it refuses unhashable ones before tracing).

    Raises:
        ValueError: a non-array leaf when ``non_arrays="error"``.
        Errors from tracing ``fn`` itself propagate unchanged, as with ``jax.jit``.
    """
    names = argument_names(fn, len(args))
    leaves, kinds, paths, array_index = [], [], [], []
    key_leaves: dict = {}
    flat_positions = []  # per argument: its static value, or how to rebuild its pytree
    offset = 0
    for a_i, a in enumerate(args):
        if a_i in static_pos:
            flat_positions.append(("static", a))
            continue
        with_path, tree = jax.tree_util.tree_flatten_with_path(a)
        flat = [x for _, x in with_path]
        mask = [_is_array_leaf(x) for x in flat]
        for j, ((p, x), m) in enumerate(zip(with_path, mask, strict=True)):
            where = _path_name(names[a_i], p)
            if not m and non_arrays == "error":
                raise ValueError(f"argument {where!r} of {_fn_name(fn)} is a "
                                 f"{type(x).__name__}, not an array; pass only arrays "
                                 "(partition equinox modules with eqx.partition)")
            if m:
                if _is_key(x):
                    key_leaves[len(leaves)] = jax.random.key_impl(x)
                    x = jax.random.key_data(x)
                leaves.append(x)
                kinds.append("weight" if a_i in weight_pos else "input")
                paths.append(where)
                array_index.append(offset + j)
        offset += len(flat)
        flat_positions.append(("tree", tree, flat, mask, len(leaves) - sum(mask)))

    def flat_fn(*dyn):
        if key_leaves:
            dyn = [jax.random.wrap_key_data(v, impl=key_leaves[i]) if i in key_leaves else v
                   for i, v in enumerate(dyn)]
        rebuilt = []
        for spec in flat_positions:
            if spec[0] == "static":
                rebuilt.append(spec[1])
                continue
            _, tree, flat, mask, start = spec
            it = iter(dyn[start:start + sum(mask)])
            vals = [next(it) if m else x for x, m in zip(flat, mask, strict=True)]
            rebuilt.append(jax.tree_util.tree_unflatten(tree, vals))
        return fn(*rebuilt)

    flat_fn.__name__ = _fn_name(fn)
    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(
        *[abstract_leaf(x) for x in leaves])
    out_paths, out_tree = jax.tree_util.tree_flatten_with_path(out_shape)
    return TracedFunction(closed, flat_fn, leaves, kinds, paths, array_index, offset,
                          [_path_name("out", p) for p, _ in out_paths], out_tree, key_leaves)


def _is_key(x) -> bool:
    """A typed PRNG key array (``jax.random.key``), not a raw uint32 one."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def leaves_for_call(leaves: list, key_leaves: dict) -> list:
    """A call's array leaves as :attr:`TracedFunction.flat_fn` takes them (keys as data)."""
    if not key_leaves:
        return leaves
    return [jax.random.key_data(x) if i in key_leaves else x for i, x in enumerate(leaves)]


def from_jax(fn: Callable, *args, weight_argnums=(), weight_argnames=(),
             sink_layout: bool = True) -> Graph:
    """Trace ``fn(*args)`` and import it as a graph (JAX to graph IR; export with ONNX).

    Args:
        fn: a JAX-traceable function of positional arguments (pytrees of arrays).
        args: example arguments; only their shapes and dtypes matter, except for weight
            arguments, whose values become the graph's weights.
        weight_argnums: positions of the arguments that hold weights (parameters).
        weight_argnames: names of the arguments that hold weights.
        sink_layout: cancel NHWC/NCHW transposes around convolutions (see module doc).

    Returns:
        A graph whose inputs are the array leaves of the non-weight arguments (named by
        their pytree path, e.g. ``x`` or ``batch['tokens']``) and whose outputs are the
        leaves of the result (``out``, ``out[0]``, ...).

    Raises:
        ValueError: bad ``weight_argnums``/``weight_argnames``, or a non-array leaf (the
            message names the argument and path).
        ModelError: side effects or unsupported element types (see :func:`import_jaxpr`).
        Errors from tracing ``fn`` itself (e.g. ``jax.errors.TracerBoolConversionError`` for
        Python control flow on traced values) propagate unchanged, as with ``jax.jit``.
    """
    weight_pos = normalize_argnums(fn, len(args), weight_argnums, weight_argnames, "weight")
    traced = trace_function(fn, args, weight_pos, non_arrays="error")
    return traced.to_graph(_fn_name(fn), sink_layout)
