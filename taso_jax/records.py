"""Typed records of one optimization: where the time went, the end-to-end choice, the check.

The pipeline fills them once; :class:`~taso_jax.outcome.Outcome` holds them, its JSON is
their plain dump (:func:`dataclasses.asdict`), and the text report renders the same
values. The search's own results stay dictionaries where the search makes them
(:func:`~taso_jax.search.choose.keep_fastest`, the output checks' comparisons); each
record here reads one (``from_dict``) and keeps the whole of it as ``details``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from taso_jax.ir.graph import Graph
from taso_jax.search.options import OptimizeOptions

__all__ = ["PhaseTimes", "Choice", "Check", "cost_model_stats", "search_report",
           "proofs_cut_note"]


@dataclass(frozen=True)
class PhaseTimes:
    """Where one optimization's time went, in seconds, and which cost model priced it.

    Attributes:
        import_s: importing or tracing the model into a graph (``None``: not timed here).
        search_s: the backtracking search.
        second_opinions_s: the searches that second-guess a measured cost model.
        choice_s: the end-to-end choice among the candidates.
        check_s: the output check of the delivered graph.
        pricing_s: pricing operators (measuring kernels included), where the cost model
            reports it.
        compiles: kernels compiled or sessions made to price them, where reported.
        compile_s: seconds those took, where reported.
        total_s: the whole run, front door included.
        cost_model: the name of the cost model that priced the delivered graph.
    """

    import_s: float | None = None
    search_s: float | None = None
    second_opinions_s: float | None = None
    choice_s: float | None = None
    check_s: float | None = None
    pricing_s: float | None = None
    compiles: int | None = None
    compile_s: float | None = None
    total_s: float | None = None
    cost_model: str | None = None

    def to_json(self) -> dict:
        """The record as a dict (``None`` where not measured)."""
        return asdict(self)

    def line(self) -> str:
        """The record in one line for the text report: the phases that were timed."""
        parts = [f"{label} {value:.2f} s" for label, value in (
            ("import", self.import_s), ("search", self.search_s),
            ("second opinions", self.second_opinions_s), ("end-to-end choice", self.choice_s),
            ("output check", self.check_s), ("pricing", self.pricing_s))
            if value is not None]
        if self.compiles is not None:
            parts.append(f"{self.compiles} compiles"
                         + (f" ({self.compile_s:.2f} s)" if self.compile_s is not None else ""))
        head = "phases" + (f" (cost model {self.cost_model})" if self.cost_model else "")
        return f"{head}: " + (", ".join(parts) if parts else "none timed")


def cost_model_stats(cost_model) -> dict:
    """What a cost model says of its own work, each entry where it says it.

    ``compiles`` (int), ``compile_seconds``, ``pricing_seconds`` (float) and ``name``, read
    through an optional ``stats()`` method, so that a cost model without one gives
    an empty dict; a ``name`` attribute stands in for the name.
    """
    stats = getattr(cost_model, "stats", None)
    out = dict(stats()) if callable(stats) else {}
    if "name" not in out and getattr(cost_model, "name", None):
        out["name"] = cost_model.name
    return out


def _finite(x) -> float | None:
    return float(x) if x is not None and math.isfinite(float(x)) else None


@dataclass(frozen=True)
class Choice:
    """The end-to-end choice: which graph was kept among those timed, and on what evidence.

    Attributes:
        kept_input: whether the input was kept.
        chosen: index of the graph kept among those timed (0: the input).
        measured: how many graphs were timed, the input included.
        runtime: where they were timed (``"jax.jit"``, ``"onnxruntime"``).
        speedup: the median per-round ratio, input time over kept graph's time, of the
            paired test that confirmed the kept candidate (``None`` where the input was
            kept or no test decided).
        skipped: why nothing was timed, where nothing was.
        dropped: why candidates were left out (not exportable), one entry each.
        details: the choice's dictionary as the search returned it.
    """

    kept_input: bool
    chosen: int = 0
    measured: int = 0
    runtime: str = "jax.jit"
    speedup: float | None = None
    skipped: str | None = None
    dropped: tuple[str, ...] = ()
    details: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, e: Mapping) -> Choice | None:
        """The record of choice dictionary ``e`` (``None`` for an empty one)."""
        if not e:
            return None
        p = e.get("paired") or {}
        decided = (not e.get("original_kept") and not e.get("skipped")
                   and not e.get("confirmed_by") and p.get("faster"))
        return cls(kept_input=bool(e.get("original_kept", True)), chosen=int(e.get("chosen", 0)),
                   measured=int(e.get("measured", 0)), runtime=e.get("runtime", "jax.jit"),
                   speedup=_finite(p.get("speedup")) if decided else None,
                   skipped=e.get("skipped"), dropped=tuple(e.get("dropped") or ()),
                   details=dict(e))


@dataclass(frozen=True)
class Check:
    """The output check of the delivered graph against the input's reference outputs.

    Attributes:
        ok: whether every output agreed within the tolerances at every input scale.
        max_abs_err: the largest absolute difference (``inf`` where the graph did not run).
        reference: what ran the reference outputs (``"onnxruntime"``, ``"jax.jit of the
            input graph"``, ``"jax.jit of the original function"``).
        scales: the input scales run.
        identical: whether the delivered file is the input itself (nothing to check).
        error: why the checked graph did not run, where it did not.
        details: the comparison's dictionary as the check returned it.
    """

    ok: bool
    max_abs_err: float = 0.0
    reference: str = "onnxruntime"
    scales: tuple[float, ...] = ()
    identical: bool = False
    error: str | None = None
    details: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, k: Mapping) -> Check | None:
        """The record of check dictionary ``k`` (``None`` for an empty one)."""
        if not k:
            return None
        return cls(ok=bool(k.get("ok")), max_abs_err=float(k.get("max_abs_err", 0.0)),
                   reference=k.get("reference", "onnxruntime"),
                   scales=tuple(k.get("scales") or ()), identical=bool(k.get("identical")),
                   error=k.get("error"), details=dict(k))


def proofs_cut_note(late: int) -> str:
    """The report's note where a rule file's proofs stopped at the time limit.

    ``late``: how many of its rules had not been proved by then.
    """
    return (f"the time limit's share for proving the rule file passed with {late} of its "
            "rules not yet proved: they were left out of the search (unless "
            "--allow-unverified); the proofs done are kept, so a next run goes on from them "
            "(--trust-proofs takes the file's own stamps)")


def search_report(name: str, graph: Graph, result, options: OptimizeOptions, substitutions,
                  notes=()) -> dict:
    """The report dictionary (printed by :func:`format_report`) for one search.

    ``result`` is a :class:`taso_jax.search.SearchResult` found with ``options``; costs are
    in microseconds.
    """
    unmeasurable = result.unmeasurable
    if unmeasurable:
        notes = [*notes, f"{len(unmeasurable)} kernel(s) would not run alone on stand-in "
                 f"values and were priced by the analytic model (first: {unmeasurable[0]})"]
    late = (result.rules or {}).get("not_proved_in_time")
    if late:
        notes = [*notes, proofs_cut_note(late)]
    return {
        "model": name, "notes": list(notes), "target": options.target,
        "operators_before": dict(graph.op_counts()),
        "operators_after": dict(result.graph.op_counts()),
        "cost": {"model": options.cost_model_name, "before_us": result.cost_before,
                 "after_us": result.cost_after},
        "search": {"seconds": result.seconds, "iterations": result.iterations,
                   "explored": result.explored, "stopped": result.stopped,
                   "out_of_time_in": result.out_of_time_in,
                   "alpha": options.alpha, "budget": options.budget,
                   "substitutions": len(substitutions),
                   # rule name -> [matches, rewrites queued], rules that matched only
                   "rule_counters": {name: [c.matches, c.queued] for name, c
                                     in sorted((result.rule_stats or {}).items())
                                     if c.matches}},
        "rules": dict(result.rules),
        "cost_model": dict(getattr(result, "cost_model", None) or {}),
        "applied": dict(result.applied),
        "laws": {s.name: s.law for s in substitutions if s.name in result.applied},
        "proof": {s.name: s.proof_status for s in substitutions if s.name in result.applied},
        "end_to_end": dict(result.end_to_end or {}),
        **({"fold_refusals": [r.to_json() for r in result.fold_refusals]}
           if getattr(result, "fold_refusals", None) else {}),
    }
