"""The end-to-end choice: time a search's cheapest graphs and its input, keep the fastest.

The cost model ranks graphs; the device decides. :func:`choose_fastest` times the input and
the search's cheapest candidates under ``jax.jit`` on the current device, interleaved, and
keeps the fastest (ranked by its fastest round, :func:`floor_us`) only if a head-to-head
loop against the input confirms it faster (:func:`paired_speedup`), so the optimizer never
returns a graph that runs slower than its input by more than the noise of the measurement.
:func:`rank_correlation` says how well the cost model's order agreed with the measured one.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

import numpy as np
from taso_jax.ops import OPS
from taso_jax.search.head_to_head import HeadToHead
from taso_jax.search.paired_test import (  # re-exported: the choice's tests and callers
    LOOP_LEAST_ROUNDS,
    confirm_faster,
    halfway,
    loops_fit,
    paired_speedup,
    rank_correlation,
    rounds_for,
    signed_rank_greater,
)

from taso_jax.ir.executor import (
    compile_graph,
    discard_compiled,
    random_inputs,
    release_memory,
    time_function,
    time_interleaved,
)
from taso_jax.ir.graph import LEAF_OPS, Graph
from taso_jax.ir.layout import has_nchw_convolutions, to_nhwc

__all__ = ["device_name", "time_graphs", "rank_correlation", "choose_fastest",
           "measured_set", "keep_fastest", "paired_speedup", "confirm_faster", "with_layouts",
           "halfway", "compiled_runs", "compiled_run", "screen_in_pairs", "screen_fastest",
           "signed_rank_greater", "floor_us", "rounds_for", "loops_fit",
           "NHWC_LAYOUT"]

#: The name a graph's NHWC form carries in ``applied`` (see :func:`with_layouts`).
NHWC_LAYOUT = "layout:nhwc"

#: Seconds a screening or confirmation loop of :func:`choose_fastest` lasts at least (up
#: to five times its rounds): 10 rounds of a 5 ms call last 0.1 s, a few scheduler time
#: slices on a loaded machine.
SCREEN_SECONDS = 0.5
#: Candidates :func:`keep_fastest` confirms at most, in order of screened fastest round.
CONFIRM_TRIES = 2
#: Candidates whose estimates lie within this fraction of each other are one candidate to
#: the end-to-end choice (the cheapest is timed; see :func:`measured_set`).
ESTIMATE_TIE = 0.005
#: A confirmed candidate is timed head to head against the next candidate not yet tried
#: whose screened fastest round lies within this fraction of its own (:func:`keep_fastest`).
DUEL_WITHIN = 0.05
#: Seconds of calls, both functions together, that a screening loop and a confirmation
#: loop aim at, and the fewest rounds each keeps (:func:`rounds_for`): calls of a tenth of
#: a second and more get fewer rounds than ``repeats``.
SCREEN_LOOP_SECONDS, SCREEN_MIN_ROUNDS = 2.0, 5
CONFIRM_LOOP_SECONDS, CONFIRM_MIN_ROUNDS = 5.0, 10


#: A guess at the seconds ``jax.jit`` takes to trace and compile a graph, per node (weights
#: included), on the high side: 1.2 ms of CPU on this project's CPU for a 5,000-operator
#: chain of matmuls and elementwise operators (7,498 nodes), most of it tracing in Python.
COMPILE_SECONDS_PER_NODE = 2e-3

#: Why an end-to-end choice that began past its deadline kept the input.
PAST_DEADLINE = "the time limit had passed when the choice began (--time-limit)"
#: Calls one comparison of a candidate with the input makes at the least: two warm-up
#: rounds and the five rounds below which a loop is cut short, each calling both.
COMPARE_CALLS = 2 * (2 + LOOP_LEAST_ROUNDS)


def no_time_to_compare(make_seconds: float, call_seconds: float,
                       deadline: float | None) -> str | None:
    """Why no candidate can be timed against the input before ``deadline``, or ``None``.

    One comparison makes a candidate (taken to cost what making the input cost,
    ``make_seconds``: compiling it, or starting its onnxruntime session) and calls it and
    the input :data:`COMPARE_CALLS` times (``call_seconds`` a call, the input's). Where that
    cannot end before ``deadline`` (a ``time.perf_counter()`` value), the end-to-end
    choice keeps the input untimed: a loop cut short cannot confirm a candidate anyway, and
    timing one would overrun the time limit on models whose calls take a second. Returns
    the reason as one sentence for the report.
    """
    if deadline is None:
        return None
    if time.perf_counter() > deadline:
        return PAST_DEADLINE
    need = make_seconds + COMPARE_CALLS * call_seconds
    left = deadline - time.perf_counter()
    if need <= left:
        return None
    return (f"one comparison needs about {need:.1f} s (making a candidate, "
            f"then {COMPARE_CALLS} calls of {call_seconds * 1e3:.0f} ms), and "
            f"{max(left, 0.0):.1f} s of the time limit was left (--time-limit)")


def start_choice(result, graphs: list[tuple], deadline: float | None, make_base, call_us,
                 device: str, make_guess: float = 0.0, made_seconds: float = 0.0,
                 **extra) -> tuple[object, dict | None]:
    """Make what runs the input, unless no comparison can end before ``deadline``.

    ``make_base()`` returns what runs the input (a compiled graph, an onnxruntime session);
    ``call_us(base)`` times one call of it in microseconds. Returns ``(base, None)``, or
    ``(None, report)`` where :func:`no_time_to_compare` says no candidate can be timed:
    ``result`` then keeps its input (:func:`keep_fastest`), and the report carries the
    reason as ``"skipped"`` (and ``extra``). Past ``deadline`` already, or with less time
    left than making the input and one candidate takes by ``make_guess`` (seconds to make
    one, guessed from the input's size), not even the input is made: making it cannot be
    interrupted (one XLA compilation of a 5,000-operator chain took 9 s of CPU).
    ``made_seconds``: what making the input took where it was made before (seconds,
    :func:`~taso_jax.search.compile_ahead.compile_ahead`), taken for the making of a candidate
    when it is longer than finding it made.
    """
    if deadline is None or len(graphs) < 2:
        return make_base(), None
    if time.perf_counter() > deadline:
        return None, keep_fastest(result, graphs[:1], [[float("nan")]], 0, device,
                                  skipped=PAST_DEADLINE, **extra)
    left = deadline - time.perf_counter()
    if 2 * make_guess > left:
        return None, keep_fastest(
            result, graphs[:1], [[float("nan")]], 0, device, skipped=(
                f"making the input and one candidate needs about {2 * make_guess:.1f} s "
                f"(guessed from its size), and {left:.1f} s of the time limit was left "
                "(--time-limit)"), **extra)
    started = time.perf_counter()
    base = make_base()
    made = max(time.perf_counter() - started, made_seconds)
    once = call_us(base)
    skipped = no_time_to_compare(made, once * 1e-6, deadline)
    if skipped:
        return None, keep_fastest(result, graphs[:1], [[once]], 1, device, skipped=skipped,
                                  **extra)
    return base, None


def device_name() -> str:
    """The current JAX device: ``"gpu:NVIDIA H100 80GB HBM3"``, or ``"cpu:N cores"``.

    ``N`` counts the cores this process may run on (:func:`~taso_jax._machine.usable_cores`),
    not the machine's: a process pinned to one core is ``"cpu:1 core"``.
    """
    import jax

    from taso_jax._machine import usable_cores

    dev = jax.devices()[0]
    if dev.platform == "cpu":
        n = usable_cores()
        return f"cpu:{n} core{'s' if n != 1 else ''}"
    return f"{dev.platform}:{getattr(dev, 'device_kind', '') or dev.platform}"


def time_graphs(graphs: list[Graph], repeats: int = 50, warmup: int = 3,
                seed: int = 0, deadline: float | None = None) -> list[dict]:
    """Wall time of each graph under ``jax.jit`` on the same random inputs, in microseconds.

    The graphs must share their runtime inputs (equivalent graphs do). Each is compiled once
    (weight-only subgraphs folded ahead of time, :func:`taso_jax.compile_graph`), warmed up,
    then run round robin ``repeats`` times, so that machine noise hits all of them alike
    (fewer once ``deadline``, a ``time.perf_counter()`` value, has passed; at least 3).
    Returns ``{"median_us", "min_us", "max_us", "repeats", "times_us"}`` per graph, in
    order (``times_us``: each round's time, for :func:`paired_speedup`); past the
    deadline, graphs whose compilation would overrun it are left out of the list (the
    first two are always timed).

    Raises:
        ValueError: ``repeats < 1`` or graphs whose inputs differ.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    runs = compiled_runs(graphs, seed, deadline)
    return _summaries(time_interleaved(runs, repeats, warmup, deadline))


def _summaries(times: list[list[float]]) -> list[dict]:
    return [{"median_us": float(np.median(ts)), "min_us": float(np.min(ts)),
             "max_us": float(np.max(ts)), "repeats": len(ts), "times_us": list(ts)}
            for ts in times]


def compiled_runs(graphs: list[Graph], seed: int = 0,
                  deadline: float | None = None) -> list:
    """One call each of ``graphs``, compiled (:func:`taso_jax.compile_graph`) and run once.

    The calls take no arguments: all run on the same random inputs (``seed``). Past
    ``deadline``, graphs whose compilation would overrun it are left out (the first two
    always compile).

    Raises:
        ValueError: graphs whose runtime inputs differ.
    """
    sig = [(n.name, n.types[0]) for n in graphs[0].inputs]
    for g in graphs[1:]:
        if [(n.name, n.types[0]) for n in g.inputs] != sig:
            raise ValueError("time_graphs: the graphs do not have the same runtime inputs")
    xs = _inputs_for(graphs[0], seed)
    runs, slowest = [], 0.0
    for g in graphs:
        if (deadline is not None and len(runs) >= 2
                and time.perf_counter() + slowest > deadline):
            break  # compiling one more would run past the deadline
        t0 = time.perf_counter()
        runs.append(compiled_run(g, xs))
        slowest = max(slowest, time.perf_counter() - t0)
        release_memory()  # the compiler's scratch memory, before the next one compiles
    return runs


def _inputs_for(graph: Graph, seed: int = 0) -> list:
    import jax

    return [jax.device_put(x) for x in random_inputs(graph, seed)]


def compiled_run(graph: Graph, xs: Sequence):
    """A call with no arguments that runs ``graph``, compiled, on the arrays ``xs``.

    The graph is compiled (:func:`taso_jax.compile_graph`) and run once here, so that
    timing the call times no compilation.

    Raises:
        ValueError: ``xs`` do not fit the graph's runtime inputs.
    """
    import jax

    # shapes only: JAX stores an int64 input as int32 unless x64 is enabled
    if [tuple(x.shape) for x in xs] != [n.types[0].shape for n in graph.inputs]:
        raise ValueError("compiled_run: the inputs do not fit the graph's runtime inputs")
    fn = compile_graph(graph)
    jax.block_until_ready(fn(*xs))  # jax.jit compiles on the first call
    return lambda: fn(*xs)


def _measured_set(result, sample: int) -> list[tuple]:
    """The input, the candidates, and up to ``sample`` visited graphs spread evenly by cost.

    Each is ``(cost in us, graph, path)``, the input first. Candidates whose estimates are
    within :data:`ESTIMATE_TIE` of a cheaper candidate's are left out (the cost model sees
    them as one graph; timing several and keeping the fastest picks noise), but for those
    added to be ``judged``, which are always kept and, cheaper, do not leave out the
    candidate they tie with
    (:func:`taso_jax.search.second_opinions.add_near_tie_candidate`).
    """
    chosen: dict = {}
    first, *candidates = [*result.visited[:1], *result.candidates]
    chosen[first.graph.key] = tuple(first)
    kept: list[float] = []
    for cand in sorted(candidates, key=lambda v: v.cost):
        c, g, path = cand
        if g.key in chosen or (not cand.judged and any(
                abs(c - k) <= ESTIMATE_TIE * max(k, 1e-9) for k in kept)):
            continue
        chosen[g.key] = (c, g, path)
        if not cand.judged:  # timed beside its near tie, it does not displace that tie
            kept.append(c)
    pool = sorted(result.visited, key=lambda v: v.cost)
    if sample > 0 and pool:
        for i in np.linspace(0, len(pool) - 1, min(sample, len(pool))).round().astype(int):
            c, g, path = pool[int(i)]
            chosen.setdefault(g.key, (c, g, path))
    return list(chosen.values())


def with_layouts(graphs: list[tuple], judged: frozenset = frozenset()) -> list[tuple]:
    """``graphs`` (``(cost, graph, path)``, the input first) and NHWC forms of the first two.

    The input and the cheapest candidate, where they run convolutions in NCHW, are added in
    NHWC (:func:`taso_jax.ir.layout.to_nhwc`), with the estimate of the graph they came from
    and :data:`NHWC_LAYOUT` appended to their path, right after the cheapest candidate: a
    choice cut short by the time limit screens them before the other candidates (XLA:CPU
    ran a YOLOv8n detector's NCHW convolutions 1.4x slower, where the cheapest lowering
    gained 1.04x). So are the graphs whose keys are in ``judged`` (the near-tie candidate,
    which may win in NHWC only), at the end. Layout is then chosen like any rewrite: by
    timing. ``graphs`` is not changed.
    """
    seen = {g.key for _, g, _ in graphs}

    def nhwc(picked):
        out = []
        for cost, g, path in picked:
            if has_nchw_convolutions(g):
                g2 = to_nhwc(g)
                if g2.key not in seen:
                    seen.add(g2.key)
                    out.append((cost, g2, (*path, NHWC_LAYOUT)))
        return out
    first = nhwc(graphs[:2])
    return [*graphs[:2], *first, *graphs[2:],
            *nhwc([t for t in graphs[2:] if t[1].key in judged])]


def choose_fastest(result, repeats: int = 20, sample: int = 0,
                   deadline: float | None = None, layouts: bool = False,
                   confirm: bool = True, made_seconds: float = 0.0) -> dict:
    """Time a search's candidate graphs end to end and make ``result`` the fastest.

    ``result`` is a :class:`taso_jax.search.SearchResult`. Its input graph, its
    ``candidates`` (the cheapest by estimate) and ``sample`` more of its ``visited`` graphs,
    spread evenly over their estimated costs, are compiled and timed against the input
    one at a time, each in its own interleaved loop (screening, :func:`screen_in_pairs`:
    two compiled graphs are held at once, not all of them). The fastest candidate by its
    fastest round (:func:`floor_us`) is then timed against the input alone in
    a fresh loop of ``repeats`` rounds (confirmation; fewer for long calls, and the
    screening fewer still: :func:`rounds_for`), and it replaces ``result.graph``
    (``cost_after`` and ``applied`` follow it) only if :func:`paired_speedup` says it ran
    faster there; otherwise the input is kept, so the result is never slower than the input
    by more than the noise of this measurement. Testing only the one candidate picked, on
    rounds that did not pick it, keeps "the best of ten looked faster by chance" out.
    ``result`` is changed in place.
    Past ``deadline`` (a ``time.perf_counter()`` value) fewer rounds are timed (at least 3);
    where not even one comparison fits before it (:func:`no_time_to_compare`), the input is
    kept untimed and the returned dict says why (``"skipped"``). With ``layouts``,
    the NHWC forms of the input, of the cheapest candidate and of a ``judged`` one are timed
    too (:func:`with_layouts`), and after them the NHWC form of whichever graph screened
    fastest, where that is another.

    With ``confirm=False`` the choice screens only (:func:`screen_fastest`): the caller
    confirms the graph picked against its own baseline (the decorator against ``jax.jit`` of
    the user's function), so that one comparison, not two, decides.

    ``made_seconds``: seconds compiling the input took where it was compiled ahead
    (:mod:`~taso_jax.search.compile_ahead`), taken for a candidate's compile when the
    choice weighs whether one fits before ``deadline``.

    Returns ``{"measured", "original_kept", "chosen", "times_us", "estimates_us",
    "rank_correlation", "device", "repeats", "paired", "floors_us"}``: medians in
    microseconds (``floors_us``: the fastest rounds, which ranked the candidates), the rank
    correlation (Spearman) between the cost model's estimates and the measured medians over
    the graphs timed (``None`` when fewer than three graphs were timed, or all estimates are
    equal), and the confirmation's :func:`paired_speedup` (``None`` when no candidate's
    fastest round was below the input's).
    """
    # over 80 lines for its docstring (the contract); the body is 58 lines
    # screening only, past the deadline nothing is timed: every candidate is picked from
    graphs = measured_set(result, sample, deadline if confirm else None)
    if layouts:
        graphs = with_layouts(graphs, frozenset(c.graph.key for c in result.candidates
                                                if c.judged))
    if not confirm:
        return screen_fastest(result, graphs, repeats, deadline)
    xs = _inputs_for(graphs[0][1])
    base, skipped = start_choice(result, graphs, deadline, lambda: compiled_run(graphs[0][1], xs),
                                 lambda run: time_function(run, repeats=1, warmup=0)[0],
                                 device_name(),
                                 make_guess=COMPILE_SECONDS_PER_NODE * len(graphs[0][1].nodes),
                                 made_seconds=made_seconds)
    if skipped:
        return skipped
    call_seconds = time_function(base, repeats=1, warmup=0)[0] / 1e6
    screen = rounds_for(call_seconds, SCREEN_LOOP_SECONDS, SCREEN_MIN_ROUNDS, repeats)
    repeats = rounds_for(call_seconds, CONFIRM_LOOP_SECONDS, CONFIRM_MIN_ROUNDS, repeats)

    def loop(a, b):  # short calls: more rounds, the loop lasting SCREEN_SECONDS at least
        return time_interleaved([a, b], screen, 2, deadline, min_seconds=SCREEN_SECONDS)

    made = [made_seconds]  # seconds each making took: the input's, then the candidates'

    def make(g):
        t0 = time.perf_counter()
        run = compiled_run(g, xs)
        made.append(time.perf_counter() - t0)
        return run

    def nhwc_of_best(chosen):  # the layout of whichever graph screened fastest
        if not layouts or NHWC_LAYOUT in chosen[2] or not has_nchw_convolutions(chosen[1]):
            return []
        g2 = to_nhwc(chosen[1])
        timed = {g.key for _, g, _ in graphs}
        return [] if g2.key in timed else [(chosen[0], g2, (*chosen[2], NHWC_LAYOUT))]

    times, best, best_run = screen_in_pairs(graphs, base, make, loop, deadline,
                                            discard=discard_compiled, then=nhwc_of_best)

    loops = HeadToHead(graphs, times, base, best, best_run, make, made, repeats, deadline,
                       min_seconds=SCREEN_SECONDS)
    return keep_fastest(result, graphs[:len(times)], times, len(times[0]), device_name(),
                        confirm=loops.confirm, best=best, duel=loops.duel)


#: Why a screen-only choice picked its graph by estimate (:func:`screen_fastest`).
BY_ESTIMATE = "no time left to screen the candidates: the cheapest by estimate was picked"
#: How far below its price a graph's call is taken to run, at the least, where a screen-only
#: choice asks whether screening could fit before compiling anything: the calibrated price
#: of sliding-window attention at S=4096 was 3.3 s for a 1.15 s call (kernels' prices are a
#: median 1.5x off on held-out models), and compiling and calling the input to learn that
#: took 5.8 s of a 10 s first call.
PRICE_SLACK = 4.0
#: Candidates a screen-only choice screens: those priced within this factor of the cheapest
#: (the curves' uncertainty is a standard deviation of 0.3-0.7 in log time, a factor of
#: 1.3-2). With one alone, there is nothing to pick between: sliding-window attention at
#: S=4096 had its blocks priced 79 ms and the unblocked form 466 ms, and compiling the input
#: to screen them took 5.8 s of a 10 s first call.
SCREEN_WITHIN = 2.0


def screen_fastest(result, graphs: list[tuple], repeats: int = 20,
                   deadline: float | None = None) -> dict:
    """Pick the graph to confirm, by screening only; the caller confirms it.

    ``graphs`` are ``(cost in us, graph, path)``, the input first (:func:`measured_set`,
    :func:`with_layouts`). Where two or more candidates can be screened before ``deadline``
    (a ``time.perf_counter()`` value; the input is compiled only where twice the guess of
    :data:`COMPILE_SECONDS_PER_NODE` fits in what is left, and screening starts only if
    time is still left once it is compiled), each is timed against the input in one short
    interleaved loop (:func:`screen_in_pairs`, rounds from :func:`rounds_for`) and the one
    whose fastest round is lowest is picked, if that round is below the input's; else the
    input is kept. With a single candidate, or no time to screen, the graph cheapest by
    estimate is picked untimed (the report's ``"picked_by"`` is then ``"estimate"``, with
    :data:`BY_ESTIMATE` as ``"why_untimed"``; so too, with nothing compiled, where two
    screening loops of the input's calls priced :data:`PRICE_SLACK` times below its
    estimate would not fit, and where only one candidate is priced within
    :data:`SCREEN_WITHIN` of the cheapest); among graphs within :data:`ESTIMATE_TIE` of
    the cheapest, which the cost model cannot tell apart, the one with the fewest runtime
    operators (fewer kernels and intermediate buffers: a LoRA adapter merged into its weight
    rather than a concatenation of its first factor with that weight). No confirmation
    runs here: the caller must time the graph picked against its own baseline before using
    it (``"confirmed_by": "caller"``); that is what keeps the result never slower.

    ``result.graph``, ``cost_after`` and ``applied`` follow the pick (in place). Returns the
    dict :func:`choose_fastest` documents (``"paired"`` and ``"duel"`` ``None``), with
    ``"picked_by"`` (``"screening"`` or ``"estimate"``) and ``"confirmed_by"`` added.
    """
    device = device_name()
    n_timed = 0

    def by_estimate(why: str | None) -> dict:
        lowest = min(c for c, _, _ in graphs)
        tied = [i for i, (c, _, _) in enumerate(graphs) if c <= lowest * (1.0 + ESTIMATE_TIE)]
        chosen = min(tied, key=lambda i: (_runtime_nodes(graphs[i][1]), graphs[i][0], i))
        cost, graph, path = graphs[chosen]
        result.graph, result.cost_after, result.applied = graph, cost, Counter(path)
        return {"measured": n_timed, "original_kept": chosen == 0, "chosen": chosen,
                "times_us": [float("nan")] * len(graphs), "floors_us": [],
                "estimates_us": [c for c, _, _ in graphs], "rank_correlation": None,
                "device": device, "repeats": 0, "paired": None, "duel": None,
                "picked_by": "estimate", "confirmed_by": "caller",
                **({"why_untimed": why} if why else {})}

    if len(graphs) < 3:
        return by_estimate(None)  # one candidate: the caller's comparison decides alone
    lowest = min(c for c, _, _ in graphs[1:])
    if sum(c <= lowest * SCREEN_WITHIN for c, _, _ in graphs[1:]) < 2:
        return by_estimate(None)  # the others priced far dearer: nothing to screen between
    left = float("inf") if deadline is None else deadline - time.perf_counter()
    if 2 * COMPILE_SECONDS_PER_NODE * len(graphs[0][1].nodes) > left:
        return by_estimate(BY_ESTIMATE)
    # two screening loops of the input's calls, each a PRICE_SLACK below its price
    least = 2 * 2 * (SCREEN_MIN_ROUNDS + 2) * graphs[0][0] * 1e-6 / PRICE_SLACK
    if least > left:
        return by_estimate(f"{BY_ESTIMATE} (screening two needs at least {least:.1f} s)")
    xs = _inputs_for(graphs[0][1])
    t0 = time.perf_counter()
    base = compiled_run(graphs[0][1], xs)
    made = time.perf_counter() - t0
    call_seconds = time_function(base, repeats=1, warmup=0)[0] / 1e6
    screen = rounds_for(call_seconds, SCREEN_LOOP_SECONDS, SCREEN_MIN_ROUNDS, repeats)
    # Screening one candidate only picks what the caller's comparison would decide anyway:
    # it pays where two can be made (each taken to compile as the input did) and screened.
    need = 2 * (made + 2 * (screen + 2) * call_seconds)
    if deadline is not None and deadline - time.perf_counter() < need:
        discard_compiled(graphs[0][1])
        return by_estimate(f"{BY_ESTIMATE} (screening two needs about {need:.1f} s)")

    def loop(a, b):
        return time_interleaved([a, b], screen, 1, deadline, min_seconds=SCREEN_SECONDS)

    times, best, _ = screen_in_pairs(graphs, base, lambda g: compiled_run(g, xs), loop,
                                     deadline, discard=discard_compiled, hold_best=False)
    graphs = graphs[:len(times)]
    n_timed = len(times)
    floors = [floor_us(t) for t in times]
    chosen = best if best and floors[best] < floors[0] else 0
    cost, graph, path = graphs[chosen]
    result.graph, result.cost_after, result.applied = graph, cost, Counter(path)
    medians = [float(np.median(t)) for t in times]
    rho = rank_correlation([c for c, _, _ in graphs], medians)
    return {"measured": n_timed, "original_kept": chosen == 0, "chosen": chosen,
            "times_us": medians, "floors_us": floors,
            "estimates_us": [c for c, _, _ in graphs],
            "rank_correlation": None if rho != rho else rho, "device": device,
            "repeats": len(times[0]), "paired": None, "duel": None,
            "picked_by": "screening", "confirmed_by": "caller"}


def _runtime_nodes(graph: Graph) -> int:
    """Operators of ``graph`` that run on every call (not weight-only, not leaves).

    A fused operator that runs as its composition (``OpDef.composition``) counts as the
    operators of that composition: introducing it saves no kernel.
    """
    count = 0
    for n in graph.nodes:
        if n.weight_only or n.op in LEAF_OPS:
            continue
        composition = OPS[n.op].composition if n.op in OPS else None
        steps = composition(n) if composition is not None else None
        count += 1 if steps is None else len(steps)
    return count


def screen_in_pairs(graphs: list[tuple], base, make, loop, deadline: float | None = None,
                    discard=None, then=None, hold_best: bool = True
                    ) -> tuple[list[list[float]], int, object]:
    """Screen candidates against the input one at a time, holding two graphs at once.

    ``graphs`` are ``(cost, graph, path)``, the input first; ``base`` runs the input;
    ``make(graph)`` returns something that runs a candidate (a compiled graph, an
    onnxruntime session); ``loop(base, run)`` times both in one interleaved loop and
    returns ``(base times, candidate times)``. Each candidate is made, timed against the
    input, and dropped unless it is the best so far (``discard(graph)``, if given, is then
    called to free what ``make`` cached), so that at most two are held at once. Past
    ``deadline`` no more candidates are made
    once making and timing the slowest one so far would overrun it (at least one is).
    ``then(best)``, if given, is called once the list is screened, with the best
    ``(cost, graph, path)`` so far (the input when none was made); the candidates it returns
    are appended to ``graphs`` (in place) and screened the same way. With
    ``hold_best=False`` the best candidate's runner is dropped too, so that at most two are
    alive at once (the input's and one candidate's); ``run`` is then ``None`` and the
    caller makes it again to confirm (what an onnxruntime session takes: it is large
    and quick to make).

    Returns ``(times, best, run)``: ``times[0]`` are the input's times from the best
    candidate's loop and ``times[best]`` that candidate's; every other candidate's times
    are scaled by the ratio of the input's fastest rounds in the best loop and in its own,
    so that times compare across loops. Candidates rank by their fastest round over the
    input's fastest round in the same loop (:func:`floor_us`). ``best`` is 0 when there
    was no candidate (then ``times`` has the input's times from a loop of its own);
    ``run`` is what runs it.
    """
    loops: list[tuple[list[float], list[float]]] = []
    best, best_run, slowest = 0, None, 0.0
    i = 0
    while True:
        i += 1
        if i == len(graphs) and then is not None:
            graphs.extend(then(graphs[best]))
            then = None
        if i >= len(graphs):
            break
        g = graphs[i][1]
        if deadline is not None and loops and time.perf_counter() + slowest > deadline:
            break  # making one more would run past the deadline
        t0 = time.perf_counter()
        run = make(g)
        base_times, times = loop(base, run)
        slowest = max(slowest, time.perf_counter() - t0)  # making and timing one
        loops.append((list(base_times), list(times)))
        if not best or _relative(*loops[-1]) < _relative(*loops[best - 1]):
            if best and discard is not None:
                discard(graphs[best][1])
            best, best_run = i, (run if hold_best else None)
        elif discard is not None:
            discard(g)
        del run
        release_memory()
    if not best:
        return [loop(base, base)[0]], 0, None
    ref = loops[best - 1][0]
    scale = floor_us(ref)
    times = [ref] + [[t * scale / floor_us(b) for t in c] for b, c in loops]
    times[best] = loops[best - 1][1]
    return times, best, best_run


def floor_us(times: Sequence[float]) -> float:
    """The fastest of one graph's round times (any unit): what screening ranks by.

    Load only ever adds time to a call, so the fastest round is the estimate of a graph's
    own cost that the load disturbs least (measurements: docs/benchmarks.md, "Why the
    search and choice work as they do").
    """
    return float(np.min(times))


def _relative(base: Sequence[float], candidate: Sequence[float]) -> float:
    """A candidate's fastest round over the input's (:func:`floor_us`), both from one loop."""
    return floor_us(candidate) / floor_us(base)


def measured_set(result, sample: int = 0, deadline: float | None = None) -> list[tuple]:
    """What an end-to-end choice times: ``(cost, graph, path)``, the input first.

    The input, the candidates, and up to ``sample`` visited graphs spread evenly by
    estimated cost; past ``deadline`` (``time.perf_counter()``), the input and the
    cheapest candidate only.
    """
    graphs = _measured_set(result, sample)
    if deadline is not None and time.perf_counter() > deadline:
        graphs = graphs[:2]
    return graphs


def keep_fastest(result, graphs: list[tuple], times: list[Sequence[float]], repeats: int,
                 device: str, confirm=None, best: int | None = None, duel=None,
                 **extra) -> dict:
    """Make ``result`` the fastest of ``graphs`` (input first) if confirmed; the report.

    ``times[i]`` are graph ``i``'s round times from screening (as :func:`screen_in_pairs`
    gives them: ``times[0]`` and ``times[best]`` from one loop, the others scaled to it).
    Candidates rank by their fastest screened round (:func:`floor_us`). The candidate
    ``best`` (default: the fastest), if its fastest round is below the input's, is tested
    (and, if it fails and ``confirm`` is given, the next whose fastest round is below the
    input's, up to :data:`CONFIRM_TRIES` in all) with
    :func:`paired_speedup` on ``confirm(i) -> (input times, candidate times)``, a fresh
    head-to-head loop (on the screening rounds when ``confirm`` is ``None`` or its loop
    ran fewer than 5 rounds; otherwise :func:`confirm_faster`, which adds a loop when the
    candidate is ahead but the test undecided and checks a "faster" verdict in one more),
    and replaces the input only if it ran faster.
    With ``duel(i, j) -> (i's times, j's times)``, one head-to-head loop of two candidates,
    a confirmed candidate is then timed against the next candidate not yet tried whose
    screened fastest round is within :data:`DUEL_WITHIN` of its own, and gives way to it if
    :func:`confirm_faster` finds it faster (a candidate faster than one confirmed faster
    than the input). Where no candidate is that close, the rival is the untried candidate
    with the lowest screened median, if it is below the confirmed one's (one lucky round
    can rank a candidate first; two candidates a few percent apart can screen in either
    order on a loaded machine).
    ``result.graph``, ``cost_after`` and ``applied`` follow the choice. Returns the dict
    :func:`choose_fastest` documents, with ``extra`` entries added, and ``"duel"``: that
    head-to-head's :func:`paired_speedup` with ``"candidate"``, ``"against"`` and
    ``"reason"`` (``"within"``: its fastest round within :data:`DUEL_WITHIN`; ``"median"``:
    its median below the confirmed one's) added, or ``None``.
    """
    medians = [float(np.median(t)) for t in times]
    floors = [floor_us(t) for t in times]  # what candidates are ranked by
    if best is None:
        best = min(range(1, len(graphs)), key=lambda i: (floors[i], i), default=0)
    test, chosen = None, 0
    # The best by screened fastest round first; if it fails, the runner-up (up to
    # CONFIRM_TRIES): the best of several candidates that run alike is the luckiest.
    runners = sorted((i for i in range(1, len(graphs)) if i != best and floors[i] < floors[0]),
                     key=lambda i: (floors[i], i))
    order = ([best] if best and floors[best] < floors[0] else []) + runners
    for i in order[:CONFIRM_TRIES if confirm is not None else 1]:
        first = confirm(i) if confirm is not None else None
        if first is None or len(first[0]) < LOOP_LEAST_ROUNDS:  # none, or cut short
            test = paired_speedup(times[0], times[i])
        else:
            test = confirm_faster(lambda i=i: confirm(i), first)[0]
        test["candidate"] = i
        if test["faster"]:
            chosen = i
            break
    contest = None
    if duel is not None and chosen:
        untried = order[order.index(chosen) + 1:]
        rival = next((j for j in untried
                      if floors[j] <= floors[chosen] * (1.0 + DUEL_WITHIN)), None)
        reason = "within"
        if rival is None:  # the two statistics disagree: a lucky round, or a steady lead
            rival = min((j for j in untried if medians[j] < medians[chosen]),
                        key=lambda j: (medians[j], j), default=None)
            reason = "median"
        if rival is not None:
            first = duel(chosen, rival)
            if len(first[0]) >= LOOP_LEAST_ROUNDS:  # not cut short by the deadline
                contest = confirm_faster(lambda: duel(chosen, rival), first)[0]
                contest["candidate"], contest["against"] = rival, chosen
                contest["reason"] = reason
                if contest["faster"]:
                    chosen = rival
    cost, graph, path = graphs[chosen]
    result.graph, result.cost_after, result.applied = graph, cost, Counter(path)
    estimates = [c for c, _, _ in graphs]
    rho = rank_correlation(estimates, medians)
    return {"measured": len(graphs), "original_kept": chosen == 0, "chosen": chosen,
            "times_us": list(medians), "floors_us": floors, "estimates_us": estimates,
            "rank_correlation": None if rho != rho else rho, "device": device,
            "repeats": repeats, "paired": test, "duel": contest, **extra}
