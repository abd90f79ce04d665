"""How the measured cost model times one kernel: rounds of runs, and the inputs they run on.

:func:`robust_time` takes the fastest single run over :data:`ROUNDS` rounds (load only
ever adds time); :func:`stand_in_rounds` gives each round its own copy of seeded random
inputs. :class:`taso_jax.search.cost.MeasuredCostModel` and the onnxruntime target's cost
model (:mod:`taso_jax.frontends.onnxruntime_target`) price kernels with them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from taso_jax.ops import is_float_dtype

__all__ = ["robust_time", "stand_in_rounds", "ROUNDS", "WIDE_SPREAD", "KERNEL_BUDGET_US",
           "SHARED_INPUT_BYTES", "RANDOM_BLOCK"]

#: Timing rounds per kernel (see :func:`robust_time`), and the spread (largest round median
#: over smallest) above which a kernel is timed again.
ROUNDS = 3
WIDE_SPREAD = 1.25
#: Microseconds of timed runs per kernel above which a kernel gets fewer runs: an attention
#: over a 1024 x 1024 score matrix at 100 ms a call would otherwise take seconds to price.
KERNEL_BUDGET_US = 1_000_000
#: Bytes above which a kernel's input is one buffer shared by its timing rounds, and
#: samples in the random block its values repeat (:func:`stand_in_rounds`).
SHARED_INPUT_BYTES = 32 * 2**20
RANDOM_BLOCK = 2**20


def robust_time(run: Callable | list[Callable], repeats: int) -> tuple[float, float]:
    """``(microseconds, spread)`` of ``run()``, robust to a loaded machine.

    :data:`ROUNDS` rounds of ``repeats / ROUNDS`` runs each. Load only ever adds time, so
    the kernel's time is the fastest single run of all, in microseconds. The spread is the
    slowest round's median over the fastest's; above :data:`WIDE_SPREAD` the kernel is
    timed :data:`ROUNDS` rounds more. The first run after the warm-up (which compiles)
    sizes the rounds: a kernel whose runs would last more than :data:`KERNEL_BUDGET_US`
    gets fewer of them (at least one a round) and no more warm-up. Sized after a whole
    first round instead, an attention over a 2048 x 2048 score matrix took 11 runs to price
    where 7 do. ``run`` may be a list of calls, used in turn, one per round: the same kernel
    on inputs allocated apart (:func:`stand_in_rounds`).
    """
    from taso_jax.ir.executor import time_function

    runs = run if isinstance(run, list) else [run]
    per_round, warmup = max(3, repeats // ROUNDS), 2
    first = time_function(runs[0], repeats=1, warmup=1)
    call = float(first[0])
    if call * repeats > KERNEL_BUDGET_US:  # a long kernel: fewer runs, still fastest-of
        per_round, warmup = max(1, int(KERNEL_BUDGET_US / (call * ROUNDS))), 0
    if per_round > 1:
        first += time_function(runs[0], repeats=per_round - 1, warmup=max(warmup - 1, 0))
    rounds = [first]
    rounds += [time_function(runs[i % len(runs)], repeats=per_round,
                             warmup=warmup if i < len(runs) else 0) for i in range(1, ROUNDS)]
    medians = [float(np.median(r)) for r in rounds]
    if max(medians) > WIDE_SPREAD * min(medians):
        rounds += [time_function(runs[i % len(runs)], repeats=per_round, warmup=0)
                   for i in range(ROUNDS)]
        medians = [float(np.median(r)) for r in rounds]
    fastest = float(min(min(r) for r in rounds))
    return fastest, max(medians) / max(min(medians), 1e-9)


def stand_in_rounds(types: Sequence) -> list[list]:
    """:data:`ROUNDS` argument lists of seeded random device arrays of ``types``.

    ``types`` are :class:`~taso_jax.ops.TensorType`. Floats are standard normal, booleans
    random, other dtypes zero. The rounds hold the same values in buffers allocated apart:
    one buffer can time a kernel slow for a whole measurement, and a round per buffer lets
    the fastest run find a fast one. An input of more than :data:`SHARED_INPUT_BYTES` is one
    buffer shared by the rounds, and its values repeat a block of :data:`RANDOM_BLOCK`
    samples: drawing and copying the ``[1, 12, 2048, 2048]`` scores of an attention took
    2 s of a 2.5 s measurement.
    """
    import jax

    rng = np.random.default_rng(0)
    values = []
    for t in types:
        n = int(np.prod(t.shape, dtype=np.int64))
        if is_float_dtype(t.dtype):
            block = rng.standard_normal(min(n, RANDOM_BLOCK), dtype=np.float32)
            values.append(np.resize(block, t.shape).astype(t.dtype, copy=False))
        elif t.dtype == "bool":
            values.append(np.resize(rng.integers(0, 2, min(n, RANDOM_BLOCK)).astype(bool),
                                    t.shape))
        else:
            values.append(np.zeros(t.shape, t.dtype))
    shared = [jax.device_put(v) if v.nbytes > SHARED_INPUT_BYTES else None for v in values]
    return [[s if s is not None else jax.device_put(np.array(v, copy=True))
             for v, s in zip(values, shared, strict=True)] for _ in range(ROUNDS)]
