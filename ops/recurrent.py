"""Recurrent operators: ONNX LSTM and GRU, and their forms on hoisted input projections.

``lstm(x, w, r, b, h0, c0, p[, seq_lens])`` and ``gru(x, w, r, b, h0[, seq_lens])`` follow
the ONNX operators LSTM and GRU (opsets 7-22) with their default activations (Sigmoid for
the gates, Tanh for the cell and the output). Layouts, for ``D`` directions (2 when
``direction="bidirectional"``, else 1), sequence length ``T``, batch ``B``, input size
``I`` and hidden size ``H`` (``G`` gates: 4 for LSTM, in the order i, o, f, c; 3 for GRU,
in the order z, r, h):

* ``x``: ``[T, B, I]`` (``layout=0``) or ``[B, T, I]`` (``layout=1``);
* ``w``: ``[D, G*H, I]``; ``r``: ``[D, G*H, H]``; ``b``: ``[D, 2*G*H]`` (``Wb`` then ``Rb``);
* ``h0``, ``c0``: ``[D, B, H]`` (``layout=0``) or ``[B, D, H]`` (``layout=1``);
* ``p`` (LSTM peepholes): ``[D, 3*H]``, in the order i, o, f;
* ``seq_lens``: ``[B]`` int32, optional, the last input when given;
* outputs ``Y``: ``[T, D, B, H]`` or ``[B, T, D, H]``; ``Y_h`` (and LSTM's ``Y_c``) in
  ``h0``'s layout.

The ONNX importers fill absent optional inputs (``B``, ``initial_h``, ``initial_c``, ``P``)
with zeros, which is what the specification says they mean. Past a sequence's length
``Y`` is zero and the state is held, so ``Y_h`` is the state at the last valid step (zero
for a sequence of length 0); the reverse direction runs each sequence from its own last
valid step (as onnxruntime does).

Each step's input projection ``x_t @ W^T`` does not depend on the state, so it can be done
for all steps at once, as one matrix product, before the recurrence: ``rnn_project(x, w)``
(``[T, D, B, G*H]``) followed by ``lstm_scan`` / ``gru_scan``, the recurrence alone. The laws
``lstm(x, w, ...) = lstm_scan(rnn_project(x, w), ...)`` (and GRU's) are declared with
``derive="ltr"``, so the rules that hoist the projection are read off them and proved.

Sources: ONNX operator specification, LSTM (versions 7, 14, 22) and GRU (versions 7, 14,
22); Hochreiter and Schmidhuber (1997); Cho et al. (2014) for the GRU; the input
projection hoisted as in cuDNN's RNN (Appleyard et al., "Optimizing performance of
recurrent neural networks on GPUs", 2016, Section 3.1).
"""

from __future__ import annotations

import numpy as np
from taso_jax.ops import (
    OpDef,
    ShapeError,
    TensorType,
    axiom,
    declare,
    is_float_dtype,
    onnx_importer,
)
from taso_jax.ops._lazy import LazyModule

jax = LazyModule("jax")
jnp = LazyModule("jax.numpy")

__all__ = ["DIRECTIONS"]

#: The values of the ``direction`` attribute (ONNX LSTM and GRU).
DIRECTIONS = ("forward", "reverse", "bidirectional")
_GATES = {"lstm": 4, "gru": 3}
_DEFAULT_ACTS = {"lstm": ("Sigmoid", "Tanh", "Tanh"), "gru": ("Sigmoid", "Tanh")}
_F32 = "float32"


# ---- the recurrence, shared by all four operators -----------------------------------------

def _reversals(direction: str, d: int) -> tuple[bool, ...]:
    """Whether each of the ``d`` directions runs backwards in time."""
    return {"forward": (False,), "reverse": (True,),
            "bidirectional": (False, True)}[direction][:d]


def _time_index(t: int, batch: int, reversals, seq_lens):
    """``[T, D, B]`` time index each step reads, and ``[T, B]`` validity of each step.

    A reverse direction reads each sequence from its last valid step back to its first; the
    steps past a sequence's length keep their own index (their outputs are zero). The index
    is its own inverse, so it also puts the outputs back in time order.
    """
    steps = jnp.arange(t)[:, None]
    lens = seq_lens.astype(jnp.int32)[None, :]
    valid = steps < lens
    backward = jnp.where(valid, lens - 1 - steps, steps)
    forward = jnp.broadcast_to(steps, (t, batch))
    return jnp.stack([backward if rev else forward for rev in reversals], axis=1), valid


def _in_time_order(seq, reversals, idx):
    """``seq`` (``[T, D, B, F]``) in each direction's order of steps; its own inverse.

    Without sequence lengths (``idx`` is ``None``) a reverse direction is flipped in time;
    with them, ``seq[idx[t, d, b], d, b]``.
    """
    if idx is not None:
        return jnp.take_along_axis(seq, idx[..., None], axis=0)
    if not any(reversals):
        return seq
    parts = [jnp.flip(seq[:, k:k + 1], axis=0) if rev else seq[:, k:k + 1]
             for k, rev in enumerate(reversals)]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def _recur(xs, states, cell, *, direction, seq_lens):
    """Run ``cell`` over ``xs`` (``[T, D, B, F]``, time order), directions side by side.

    ``states`` are ``[D, B, H]`` arrays; ``cell(x_t, states) -> (h, states)``. Returns ``Y``
    (``[T, D, B, H]``, zero past each sequence's length) and the final states.
    """
    t, d, batch = xs.shape[0], xs.shape[1], xs.shape[2]
    reversals = _reversals(direction, d)
    if seq_lens is None:
        idx = None
        xs = _in_time_order(xs, reversals, None)

        def step(carry, x_t):
            h, new = cell(x_t, carry)
            return new, h

        final, ys = jax.lax.scan(step, tuple(states), xs)
        return _in_time_order(ys, reversals, None), final
    idx, valid = _time_index(t, batch, reversals, seq_lens)
    xs = _in_time_order(xs, reversals, idx)

    def masked_step(carry, inp):
        x_t, ok = inp
        h, new = cell(x_t, carry)
        keep = ok[None, :, None]  # [1, B, 1]
        new = tuple(jnp.where(keep, n, c) for n, c in zip(new, carry, strict=True))
        return new, jnp.where(keep, h, jnp.zeros_like(h))

    final, ys = jax.lax.scan(masked_step, tuple(states), (xs, valid))
    # A sequence of length 0 has zero final states, not its initial ones (onnxruntime).
    ran = (seq_lens > 0)[None, :, None]
    final = tuple(jnp.where(ran, f, jnp.zeros_like(f)) for f in final)
    return _in_time_order(ys, reversals, idx), final


def _clip(v, clip):
    return v if clip is None else jnp.clip(v, -clip, clip)


def _lstm_cell(r, p, *, clip, input_forget, project=None, bias=None):
    """One LSTM step on ``[D, B, *]`` arrays (ONNX LSTM equations, default activations)."""
    hidden = r.shape[-1]
    pi, po, pf = (p[:, None, k * hidden:(k + 1) * hidden] for k in range(3))

    def cell(x_t, carry):
        h, c = carry
        g = jnp.einsum("dbh,dgh->dbg", h, r) + (x_t if project is None else project(x_t))
        if bias is not None:
            g = g + bias
        i, o, f, z = (g[..., k * hidden:(k + 1) * hidden] for k in range(4))
        i = jax.nn.sigmoid(_clip(i + pi * c, clip))
        f = 1.0 - i if input_forget else jax.nn.sigmoid(_clip(f + pf * c, clip))
        c_new = f * c + i * jnp.tanh(_clip(z, clip))
        o = jax.nn.sigmoid(_clip(o + po * c_new, clip))
        h_new = o * jnp.tanh(c_new)
        return h_new, (h_new, c_new)

    return cell


def _gru_cell(r, rb, *, clip, linear_before_reset, project=None, bias=None):
    """One GRU step on ``[D, B, *]`` arrays (ONNX GRU equations, default activations).

    ``bias`` (``Wb``, and ``Rb`` for z and r) is added to the input projection; ``rb`` is
    the recurrent bias of the h gate, which ``linear_before_reset`` puts inside the reset.
    """
    hidden = r.shape[-1]
    r_zr, r_h = r[:, :2 * hidden], r[:, 2 * hidden:]
    rb_h = rb[:, None, :]

    def cell(x_t, carry):
        (h,) = carry
        gx = x_t if project is None else project(x_t)
        if bias is not None:
            gx = gx + bias
        zr = gx[..., :2 * hidden] + jnp.einsum("dbh,dgh->dbg", h, r_zr)
        z = jax.nn.sigmoid(_clip(zr[..., :hidden], clip))
        rr = jax.nn.sigmoid(_clip(zr[..., hidden:], clip))
        if linear_before_reset:
            rec = rr * (jnp.einsum("dbh,dgh->dbg", h, r_h) + rb_h)
        else:
            rec = jnp.einsum("dbh,dgh->dbg", rr * h, r_h) + rb_h
        hh = jnp.tanh(_clip(gx[..., 2 * hidden:] + rec, clip))
        h_new = (1.0 - z) * hh + z * h
        return h_new, (h_new,)

    return cell


def _to_time_major(x, layout):
    """``[T, B, ...]`` from ``x`` in ``layout`` (0: time-major; 1: batch-major)."""
    return jnp.swapaxes(x, 0, 1) if layout else x


def _state_in(s, layout):
    """A state ``[D, B, H]`` from ``h0``/``c0`` in ``layout``."""
    return jnp.swapaxes(s, 0, 1) if layout else s


def _outputs(ys, finals, layout):
    """``Y`` and the final states in ``layout`` (``ys``: ``[T, D, B, H]``)."""
    if layout:
        return (jnp.transpose(ys, (2, 0, 1, 3)),
                *(jnp.swapaxes(s, 0, 1) for s in finals))
    return (ys, *finals)


def _split_bias(b):
    """``Wb`` and ``Rb`` of a ``[D, 2*G*H]`` bias."""
    n = b.shape[-1] // 2
    b = jnp.asarray(b)
    return b[:, :n], b[:, n:]


# ---- reference functions ------------------------------------------------------------------

def _lstm(x, w, r, b, h0, c0, p, *seq, direction, layout, clip, input_forget):
    seq_lens = seq[0] if seq else None
    d = w.shape[0]
    xt = _to_time_major(x, layout)
    xs = jnp.broadcast_to(xt[:, None], (xt.shape[0], d, *xt.shape[1:]))
    wb, rb = _split_bias(b)
    cell = _lstm_cell(r, p, clip=clip, input_forget=input_forget,
                      project=lambda x_t: jnp.einsum("dbi,dgi->dbg", x_t, w),
                      bias=(wb + rb)[:, None, :])
    ys, finals = _recur(xs, (_state_in(h0, layout), _state_in(c0, layout)), cell,
                        direction=direction, seq_lens=seq_lens)
    return _outputs(ys, finals, layout)


def _lstm_scan(xw, r, b, h0, c0, p, *seq, direction, layout, clip, input_forget):
    seq_lens = seq[0] if seq else None
    wb, rb = _split_bias(b)
    xs = xw + (wb + rb)[None, :, None, :]  # every step's bias, added once
    cell = _lstm_cell(r, p, clip=clip, input_forget=input_forget)
    ys, finals = _recur(xs, (_state_in(h0, layout), _state_in(c0, layout)), cell,
                        direction=direction, seq_lens=seq_lens)
    return _outputs(ys, finals, layout)


def _gru(x, w, r, b, h0, *seq, direction, layout, clip, linear_before_reset):
    seq_lens = seq[0] if seq else None
    d, hidden = w.shape[0], r.shape[-1]
    xt = _to_time_major(x, layout)
    xs = jnp.broadcast_to(xt[:, None], (xt.shape[0], d, *xt.shape[1:]))
    wb, rb = _split_bias(b)
    bias = wb.at[:, :2 * hidden].add(rb[:, :2 * hidden])[:, None, :]
    cell = _gru_cell(r, rb[:, 2 * hidden:], clip=clip, linear_before_reset=linear_before_reset,
                     project=lambda x_t: jnp.einsum("dbi,dgi->dbg", x_t, w), bias=bias)
    ys, finals = _recur(xs, (_state_in(h0, layout),), cell, direction=direction,
                        seq_lens=seq_lens)
    return _outputs(ys, finals, layout)


def _gru_scan(xw, r, b, h0, *seq, direction, layout, clip, linear_before_reset):
    seq_lens = seq[0] if seq else None
    hidden = r.shape[-1]
    wb, rb = _split_bias(b)
    bias = wb.at[:, :2 * hidden].add(rb[:, :2 * hidden])
    xs = xw + bias[None, :, None, :]
    cell = _gru_cell(r, rb[:, 2 * hidden:], clip=clip, linear_before_reset=linear_before_reset)
    ys, finals = _recur(xs, (_state_in(h0, layout),), cell, direction=direction,
                        seq_lens=seq_lens)
    return _outputs(ys, finals, layout)


def _rnn_project(x, w, *, layout):
    return jnp.einsum("tbi,dgi->tdbg", _to_time_major(x, layout), w)


# ---- shape rules --------------------------------------------------------------------------

def _want(name: str, t: TensorType, shape: tuple, op: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ShapeError(f"{op}: {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")


def _check_attrs(op: str, direction, layout, clip) -> int:
    if direction not in DIRECTIONS:
        raise ShapeError(f"{op}: direction {direction!r} is not one of {DIRECTIONS}")
    if layout not in (0, 1):
        raise ShapeError(f"{op}: layout must be 0 or 1, not {layout!r}")
    if clip is not None and not float(clip) > 0:
        raise ShapeError(f"{op}: clip must be positive, not {clip!r}")
    return 2 if direction == "bidirectional" else 1


def _recurrent_shape(op: str, gates: int, ts, *, direction, layout, clip, hoisted: bool,
                     n_states: int, extra: int, input_forget=0, linear_before_reset=0):
    """Shared shape rule; ``extra`` is the number of inputs after the states (LSTM's ``p``)."""
    d = _check_attrs(op, direction, layout, clip)
    if input_forget not in (0, 1) or linear_before_reset not in (0, 1):
        raise ShapeError(f"{op}: input_forget and linear_before_reset are 0 or 1")
    base = 3 + n_states + extra  # x, r, b, states, extras (+ w when not hoisted)
    base += 0 if hoisted else 1
    if len(ts) not in (base, base + 1):
        raise ShapeError(f"{op}: expects {base} inputs (and sequence lengths), got {len(ts)}")
    x = ts[0]
    dtype = x.dtype
    if not is_float_dtype(dtype):
        raise ShapeError(f"{op}: needs a float input, got {dtype}")
    k = 1 if hoisted else 2
    r = ts[k]
    if len(r.shape) != 3 or r.shape[0] != d or r.shape[1] != gates * r.shape[2]:
        raise ShapeError(f"{op}: R has shape {tuple(r.shape)}, expected [{d}, {gates}*H, H]")
    hidden = r.shape[2]
    if hoisted:
        if len(x.shape) != 4 or x.shape[1] != d or x.shape[3] != gates * hidden:
            raise ShapeError(f"{op}: projected input has shape {tuple(x.shape)}, expected "
                             f"[T, {d}, B, {gates * hidden}]")
        steps, batch = x.shape[0], x.shape[2]
    else:
        if len(x.shape) != 3:
            raise ShapeError(f"{op}: X needs rank 3, got {tuple(x.shape)}")
        steps, batch = (x.shape[1], x.shape[0]) if layout else (x.shape[0], x.shape[1])
        _want("W", ts[1], (d, gates * hidden, x.shape[2]), op)
    _want("B", ts[k + 1], (d, 2 * gates * hidden), op)
    state = (batch, d, hidden) if layout else (d, batch, hidden)
    for j in range(n_states):
        _want("an initial state", ts[k + 2 + j], state, op)
    if extra:
        _want("P", ts[k + 2 + n_states], (d, 3 * hidden), op)
    if any(t.dtype != dtype for t in ts[:base]):
        raise ShapeError(f"{op}: inputs of mixed dtypes {[t.dtype for t in ts[:base]]}")
    if len(ts) == base + 1:
        _want("sequence_lens", ts[base], (batch,), op)
        if ts[base].dtype != "int32":
            raise ShapeError(f"{op}: sequence_lens must be int32, got {ts[base].dtype}")
    y = (batch, steps, d, hidden) if layout else (steps, d, batch, hidden)
    return [TensorType(y, dtype)] + [TensorType(state, dtype)] * n_states


def _lstm_shape(ts, **attrs):
    return _recurrent_shape("lstm", 4, ts, hoisted=False, n_states=2, extra=1, **attrs)


def _lstm_scan_shape(ts, **attrs):
    return _recurrent_shape("lstm_scan", 4, ts, hoisted=True, n_states=2, extra=1, **attrs)


def _gru_shape(ts, **attrs):
    return _recurrent_shape("gru", 3, ts, hoisted=False, n_states=1, extra=0, **attrs)


def _gru_scan_shape(ts, **attrs):
    return _recurrent_shape("gru_scan", 3, ts, hoisted=True, n_states=1, extra=0, **attrs)


def _rnn_project_shape(ts, *, layout):
    x, w = ts
    if layout not in (0, 1):
        raise ShapeError(f"rnn_project: layout must be 0 or 1, not {layout!r}")
    if len(x.shape) != 3 or len(w.shape) != 3 or x.shape[2] != w.shape[2]:
        raise ShapeError(f"rnn_project: needs X [T, B, I] (or [B, T, I]) and W [D, G, I], "
                         f"got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype != w.dtype or not is_float_dtype(x.dtype):
        raise ShapeError(f"rnn_project: needs one float dtype, got {x.dtype}, {w.dtype}")
    steps, batch = (x.shape[1], x.shape[0]) if layout else (x.shape[0], x.shape[1])
    return [TensorType((steps, w.shape[0], batch, w.shape[1]), x.dtype)]


# ---- FLOPs --------------------------------------------------------------------------------

def _recurrent_flops(gates: int, hoisted: bool):
    """Multiply-adds of the recurrent (and, unhoisted, the input) products, plus the gates."""

    def flops(ins, outs, **_):
        y = outs[0]
        hidden = y.shape[-1]
        steps_rows = y.size // hidden  # T * D * B
        per_row = 2.0 * gates * hidden * hidden + 12.0 * gates * hidden
        if not hoisted:
            per_row += 2.0 * gates * hidden * ins[0].shape[-1]
        return steps_rows * per_row

    return flops


# ---- ONNX export --------------------------------------------------------------------------

def _emit(ctx, op_type: str, x, w, r, b, seq, states, extra, outs, *, direction, layout,
          clip, hidden, **more):
    """One ONNX LSTM or GRU node, in ``layout=0``.

    A ``layout=1`` node is written with transposes around it, since onnxruntime (1.32, CPU)
    refuses batch-major recurrences.

    ONNX orders the inputs X, W, R, B, sequence_lens, initial_h, initial_c, P.
    """
    attrs = {"direction": direction, "hidden_size": int(hidden), **more}
    # An optional input of zeros is written absent, which means zero (ONNX LSTM/GRU): a zero
    # state filled in on import, or read off a ConstantOfShape
    # (:func:`taso_jax.frontends.onnx_cleanup.drop_zero_states`), is computed by nothing
    # and fits every batch size.
    b = "" if ctx.is_zero(b) else b
    states = ["" if ctx.is_zero(s) else s for s in states]
    extra = ["" if ctx.is_zero(e) else e for e in extra]
    if clip is not None:
        attrs["clip"] = float(clip)
    if layout:  # onnxruntime's CPU kernels refuse layout=1 ("batchwise ... not supported")
        x = ctx.tmp("Transpose", [x], perm=[1, 0, 2])
        states = [s and ctx.tmp("Transpose", [s], perm=[1, 0, 2]) for s in states]
        inner = [ctx.fresh() for _ in outs]
        ctx.node(op_type, _trimmed([x, w, r, b, seq or "", *states, *extra]), inner, **attrs)
        ctx.node("Transpose", [inner[0]], [outs[0]], perm=[2, 0, 1, 3])
        for i, o in zip(inner[1:], outs[1:], strict=True):
            ctx.node("Transpose", [i], [o], perm=[1, 0, 2])
        return
    ctx.node(op_type, _trimmed([x, w, r, b, seq or "", *states, *extra]), outs, **attrs)


def _trimmed(names: list[str]) -> list[str]:
    """``names`` without trailing absent (empty) inputs, as ONNX writers leave them."""
    while names and not names[-1]:
        names = names[:-1]
    return names


def _lstm_onnx(ctx, ins, outs, *, direction, layout, clip, input_forget):
    x, w, r, b, h0, c0, p, *seq = ins
    more = {"input_forget": 1} if input_forget else {}
    _emit(ctx, "LSTM", x, w, r, b, seq[0] if seq else None, [h0, c0], [p], outs,
          direction=direction, layout=layout, clip=clip, hidden=ctx.shape(r)[-1], **more)


def _gru_onnx(ctx, ins, outs, *, direction, layout, clip, linear_before_reset):
    x, w, r, b, h0, *seq = ins
    more = {"linear_before_reset": 1} if linear_before_reset else {}
    _emit(ctx, "GRU", x, w, r, b, seq[0] if seq else None, [h0], [], outs,
          direction=direction, layout=layout, clip=clip, hidden=ctx.shape(r)[-1], **more)


def _hoisted_input(ctx, xw, layout):
    """An ONNX LSTM/GRU input and kernel that reproduce the projection ``xw`` exactly.

    ``xw`` (``[T, D, B, G]``) becomes ``X' = [T, B, D*G]`` (``[B, T, D*G]`` for
    ``layout=1``) and ``W'[d]`` the ``[G, D*G]`` matrix that selects direction ``d``'s
    block, so that ``X' @ W'[d]^T = xw[:, d]``: a product by ones and zeros, exact in
    floating point. onnxruntime computes it as one more input product.
    """
    t, d, batch, g = ctx.shape(xw)
    perm = [2, 0, 1, 3] if layout else [0, 2, 1, 3]
    lead = (batch, t) if layout else (t, batch)
    x = ctx.tmp("Reshape", [ctx.tmp("Transpose", [xw], perm=perm),
                            ctx.ints((*lead, d * g))])  # open sizes computed at run time
    sel = np.zeros((d, g, d * g), ctx.dtype(xw))
    for k in range(d):
        sel[k, :, k * g:(k + 1) * g] = np.eye(g, dtype=sel.dtype)
    return x, ctx.const(sel)


def _lstm_scan_onnx(ctx, ins, outs, *, direction, layout, clip, input_forget):
    xw, r, b, h0, c0, p, *seq = ins
    x, w = _hoisted_input(ctx, xw, layout)
    more = {"input_forget": 1} if input_forget else {}
    _emit(ctx, "LSTM", x, w, r, b, seq[0] if seq else None, [h0, c0], [p], outs,
          direction=direction, layout=layout, clip=clip, hidden=ctx.shape(r)[-1], **more)


def _gru_scan_onnx(ctx, ins, outs, *, direction, layout, clip, linear_before_reset):
    xw, r, b, h0, *seq = ins
    x, w = _hoisted_input(ctx, xw, layout)
    more = {"linear_before_reset": 1} if linear_before_reset else {}
    _emit(ctx, "GRU", x, w, r, b, seq[0] if seq else None, [h0], [], outs,
          direction=direction, layout=layout, clip=clip, hidden=ctx.shape(r)[-1], **more)


def _rnn_project_onnx(ctx, ins, outs, *, layout):
    """MatMul with the kernel ``[I, D*G]``, then back to ``[T, D, B, G]``."""
    x, w = ins
    d, g, i = ctx.shape(w)
    lead = ctx.shape(x)[:2]
    kernel = ctx.tmp("Reshape", [ctx.tmp("Transpose", [w], perm=[2, 0, 1]),
                                 ctx.const(np.asarray((i, d * g), np.int64))])
    y = ctx.tmp("Reshape", [ctx.tmp("MatMul", [x, kernel]),
                            ctx.ints((*lead, d, g))])  # open sizes computed at run time
    ctx.node("Transpose", [y], outs, perm=[1, 2, 0, 3] if layout else [0, 2, 1, 3])


# ---- laws ---------------------------------------------------------------------------------
# The input projection of every step, hoisted out of the recurrence, one law per layout (the
# shapes differ): lstm(x, w, ...) = lstm_scan(rnn_project(x, w), ...). ``n`` is the number of
# directions, drawn beside the direction (mismatched draws do not type and are skipped).
# Each checked instance compiles two scans, so the laws vary only the attributes that real
# models vary: direction and GRU's linear_before_reset (PyTorch exports 1); a node with a
# clip or LSTM's input_forget keeps its projection inside.
_T0 = {"x": ("T", "B", "I"), "h0": ("n", "B", "H"), "c0": ("n", "B", "H")}
_T1 = {"x": ("B", "T", "I"), "h0": ("B", "n", "H"), "c0": ("B", "n", "H")}
_LSTM_W = {"w": ("n", "4*H", "I"), "r": ("n", "4*H", "H"), "b": ("n", "8*H"), "p": ("n", "3*H")}
_GRU_W = {"w": ("n", "3*H", "I"), "r": ("n", "3*H", "H"), "b": ("n", "6*H")}
_LSTM_LAWS = (
    axiom("lstm(x, w, r, b, h0, c0, p, direction=d, layout=0) = lstm_scan(rnn_project(x, w, layout=0), r, b, h0, c0, p, direction=d, layout=0)",
          {**_T0, **_LSTM_W}, derive="ltr", d=DIRECTIONS, n=(1, 2)),
    axiom("lstm(x, w, r, b, h0, c0, p, direction=d, layout=1) = lstm_scan(rnn_project(x, w, layout=1), r, b, h0, c0, p, direction=d, layout=1)",
          {**_T1, **_LSTM_W}, derive="ltr", d=DIRECTIONS, n=(1, 2)),
)
_GRU_LAWS = (
    axiom("gru(x, w, r, b, h0, direction=d, layout=0, linear_before_reset=f) = gru_scan(rnn_project(x, w, layout=0), r, b, h0, direction=d, layout=0, linear_before_reset=f)",
          {k: _T0[k] for k in ("x", "h0")} | _GRU_W, derive="ltr", d=DIRECTIONS, n=(1, 2),
          f=(0, 1)),
    axiom("gru(x, w, r, b, h0, direction=d, layout=1, linear_before_reset=f) = gru_scan(rnn_project(x, w, layout=1), r, b, h0, direction=d, layout=1, linear_before_reset=f)",
          {k: _T1[k] for k in ("x", "h0")} | _GRU_W, derive="ltr", d=DIRECTIONS, n=(1, 2),
          f=(0, 1)),
)


# ---- declarations -------------------------------------------------------------------------

def _types(*shapes, dtype=_F32):
    return [TensorType(s, dtype) for s in shapes]


_RNN_ATTRS = {"direction": "forward", "layout": 0, "clip": None}

declare(OpDef(
    name="lstm", ref=_lstm, shape=_lstm_shape, arity=None,
    attrs={**_RNN_ATTRS, "input_forget": 0}, to_onnx=_lstm_onnx,
    flops=_recurrent_flops(4, hoisted=False), num_outputs=lambda attrs: 3,
    examples=((_types((5, 2, 3), (1, 16, 3), (1, 16, 4), (1, 32), (1, 2, 4), (1, 2, 4),
                      (1, 12)), {}),
              (_types((2, 5, 3), (2, 8, 3), (2, 8, 2), (2, 16), (2, 2, 2), (2, 2, 2), (2, 6))
               + _types((2,), dtype="int32"),
               {"direction": "bidirectional", "layout": 1, "clip": 0.5, "input_forget": 1})),
    axioms=_LSTM_LAWS,
    doc="LSTM over a sequence, default activations (ONNX LSTM); outputs Y, Y_h, Y_c"))

declare(OpDef(
    name="lstm_scan", ref=_lstm_scan, shape=_lstm_scan_shape, arity=None,
    attrs={**_RNN_ATTRS, "input_forget": 0}, to_onnx=_lstm_scan_onnx,
    flops=_recurrent_flops(4, hoisted=True), num_outputs=lambda attrs: 3,
    examples=((_types((5, 1, 2, 16), (1, 16, 4), (1, 32), (1, 2, 4), (1, 2, 4), (1, 12)),
               {"direction": "reverse"}),
              (_types((5, 2, 2, 8), (2, 8, 2), (2, 16), (2, 2, 2), (2, 2, 2), (2, 6))
               + _types((2,), dtype="int32"),
               {"direction": "bidirectional", "layout": 1})),
    doc="the LSTM recurrence on precomputed input projections [T, D, B, 4H] "
        "(ONNX LSTM with the input product done beforehand); outputs Y, Y_h, Y_c"))

declare(OpDef(
    name="gru", ref=_gru, shape=_gru_shape, arity=None,
    attrs={**_RNN_ATTRS, "linear_before_reset": 0}, to_onnx=_gru_onnx,
    flops=_recurrent_flops(3, hoisted=False), num_outputs=lambda attrs: 2,
    examples=((_types((5, 2, 3), (1, 12, 3), (1, 12, 4), (1, 24), (1, 2, 4)), {}),
              (_types((2, 5, 3), (2, 6, 3), (2, 6, 2), (2, 12), (2, 2, 2))
               + _types((2,), dtype="int32"),
               {"direction": "bidirectional", "layout": 1, "linear_before_reset": 1})),
    axioms=_GRU_LAWS,
    doc="GRU over a sequence, default activations (ONNX GRU); outputs Y, Y_h"))

declare(OpDef(
    name="gru_scan", ref=_gru_scan, shape=_gru_scan_shape, arity=None,
    attrs={**_RNN_ATTRS, "linear_before_reset": 0}, to_onnx=_gru_scan_onnx,
    flops=_recurrent_flops(3, hoisted=True), num_outputs=lambda attrs: 2,
    examples=((_types((5, 1, 2, 12), (1, 12, 4), (1, 24), (1, 2, 4)),
               {"linear_before_reset": 1}),
              (_types((5, 2, 2, 6), (2, 6, 2), (2, 12), (2, 2, 2))
               + _types((2,), dtype="int32"),
               {"direction": "bidirectional", "layout": 1, "clip": 2.0})),
    doc="the GRU recurrence on precomputed input projections [T, D, B, 3H] "
        "(ONNX GRU with the input product done beforehand); outputs Y, Y_h"))

declare(OpDef(
    name="rnn_project", ref=_rnn_project, shape=_rnn_project_shape, arity=2,
    attrs={"layout": 0}, to_onnx=_rnn_project_onnx,
    flops=lambda ins, outs, **_: 2.0 * outs[0].size * ins[0].shape[-1],
    examples=((_types((5, 2, 3), (2, 8, 3)), {}), (_types((2, 5, 3), (1, 6, 3)),
                                                    {"layout": 1})),
    doc="every step's input projection of an RNN at once, x @ W[d]^T: [T, B, I] (or "
        "[B, T, I]) and [D, G, I] -> [T, D, B, G] (ONNX LSTM/GRU's X*(W^T))"))


#: The inputs of each declared recurrence that ONNX makes optional and zero when absent
#: (``B``, ``initial_h``, ``initial_c``, ``P``), by position: ``lstm(x, w, r, b, h0, c0, p)``,
#: ``gru(x, w, r, b, h0)``, and their ``_scan`` forms on ``xw`` for ``x, w``. The export
#: writes an all-zero one absent (:func:`_emit`); the cleanup makes a provably zero one a
#: zero weight (:func:`taso_jax.frontends.onnx_cleanup.drop_zero_states`).
ZERO_WHEN_ABSENT = {"lstm": (3, 4, 5, 6), "gru": (3, 4), "lstm_scan": (2, 3, 4, 5),
                    "gru_scan": (2, 3)}
#: The initial-state slots of ONNX recurrences the import may keep opaque (other
#: activations; onnxruntime's com.microsoft DynamicQuantizeLSTM, which takes LSTM's first
#: eight inputs): ``(domain, op type) -> positions``, zero when absent (ONNX LSTM, GRU, RNN).
ONNX_STATE_SLOTS = {("", "LSTM"): (5, 6), ("", "GRU"): (5,), ("", "RNN"): (5,),
                    ("com.microsoft", "DynamicQuantizeLSTM"): (5, 6)}


# ---- ONNX importers -----------------------------------------------------------------------

def _import_recurrent(ctx, ins, kind: str, *, activations=None, activation_alpha=None,
                      activation_beta=None, clip=None, direction="forward", hidden_size=None,
                      layout=0, **more):
    """Shared LSTM/GRU importer; declines a node with other activations than the defaults."""
    if isinstance(direction, bytes):
        direction = direction.decode()
    d = 2 if direction == "bidirectional" else 1
    acts = [a.decode() if isinstance(a, bytes) else a for a in (activations or ())]
    if acts and acts != list(_DEFAULT_ACTS[kind]) * d:
        return None
    if activation_alpha or activation_beta:
        return None
    ins = list(ins) + [None] * (8 - len(ins))
    x, w, r = ins[:3]
    xt, rt = ctx.type(x), ctx.type(r)
    hidden = rt.shape[-1]
    if hidden_size is not None and int(hidden_size) != hidden:
        return None
    batch = xt.shape[0] if layout else xt.shape[1]
    state = (batch, d, hidden) if layout else (d, batch, hidden)
    gates = _GATES[kind]

    def given(t, shape):
        return t if t is not None else ctx.weight(np.zeros(shape, xt.dtype), f"{kind}_zero")

    b = given(ins[3], (d, 2 * gates * hidden))
    states = [given(ins[5], state)] + ([given(ins[6], state)] if kind == "lstm" else [])
    extra = [given(ins[7], (d, 3 * hidden))] if kind == "lstm" else []
    seq = [ins[4]] if ins[4] is not None else []
    if seq and ctx.type(seq[0]).dtype != "int32":
        return None
    outs = ctx.op(kind, [x, w, r, b, *states, *extra, *seq], direction=direction,
                  layout=int(layout), clip=None if clip is None else float(clip), **more)
    return outs[:len(ctx.out_types)]


@onnx_importer("LSTM")
def _import_lstm(ctx, ins, *, input_forget=0, **attrs):
    return _import_recurrent(ctx, ins, "lstm", input_forget=int(input_forget), **attrs)


@onnx_importer("GRU")
def _import_gru(ctx, ins, *, linear_before_reset=0, **attrs):
    return _import_recurrent(ctx, ins, "gru", linear_before_reset=int(linear_before_reset),
                             **attrs)
