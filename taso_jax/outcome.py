"""What one optimization delivered, as one record that every report renders.

:class:`Outcome` is what :meth:`taso_jax.optimizer.Optimizer.run` returns and what the front
doors print: the text report (:meth:`Outcome.to_text`) and the ``--json`` report
(:meth:`Outcome.to_json`) are two renderings of the same record, so they cannot disagree on
what was kept, the speed-up delivered, or whether the input was copied.

The verdict says which graph the user gets and why (:class:`Verdict`). Where a faster graph
was found but the input is delivered (it holds at the bound sizes only, the time limit
passed, the output check failed), the faster graph's figures are reported under
``found_not_delivered``, never as the result's.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from taso_jax.ir.graph import Graph
from taso_jax.records import Check, Choice, PhaseTimes
from taso_jax.report import (
    _check_line,
    end_to_end_line,
    format_not_searched,
    format_pass_through,
    format_report,
)

__all__ = ["Outcome", "Verdict", "kept_input_verdict", "first_call_verdict", "make_outcome"]


class Verdict(enum.StrEnum):
    """Which graph an optimization delivers, and why; equal to its string value."""

    REWRITTEN = "rewritten"  # the optimized graph, checked and (where timed) faster
    UNCHANGED = "unchanged"  # nothing faster was found: the input
    BOUND_SIZES_ONLY = "bound_sizes_only"  # a faster graph holds at the bound sizes only
    TIME_LIMIT = "time_limit"  # the limit passed before a faster graph was confirmed
    FALLBACK = "fallback"  # the pipeline failed, or the output check: the input runs
    PASS_THROUGH = "pass_through"  # not imported (sizes follow input values): the input

    @property
    def delivers_input(self) -> bool:
        """Whether the user gets the input (or the original function) back."""
        return self is not Verdict.REWRITTEN

    def sentence(self, delivered_input: str = "the input") -> str:
        """The verdict in words, for the text report; ``delivered_input`` names the input."""
        return _SENTENCES[self].format(input=delivered_input)


_SENTENCES = {
    Verdict.REWRITTEN: "rewritten",
    Verdict.UNCHANGED: "{input}, unchanged: no faster equivalent graph was found",
    Verdict.BOUND_SIZES_ONLY: "{input}: the faster graph found holds at the sizes it was "
                              "optimized at only",
    Verdict.TIME_LIMIT: "{input}: the time limit passed before a faster graph was confirmed",
    Verdict.FALLBACK: "not optimized, {input}: the optimizing pipeline failed",
    Verdict.PASS_THROUGH: "{input}, not imported",
}

#: Report entries that describe the rewritten graph: under a verdict that delivers the input
#: they move to ``found_not_delivered``.
_FOUND_KEYS = ("time", "onnxruntime", "applied", "end_to_end", "check", "laws", "proof",
               "folded")


def _frozen(value):
    if isinstance(value, Mapping):
        return MappingProxyType({k: _frozen(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


def _thawed(value):
    if isinstance(value, Mapping):
        return {k: _thawed(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thawed(v) for v in value]
    return value


def _target(report: Mapping):
    """The registered target a report was made for (the default's where it names none)."""
    from taso_jax.search.options import OptimizeOptions
    from taso_jax.targets import describe

    return describe(report.get("target") or OptimizeOptions().target)


def _measured(report: Mapping) -> tuple[float | None, str | None]:
    """``(speed-up, which measurement)`` of a rewritten graph over the input, from ``report``.

    The report's own timing in the target's runtime comes first; where it was left out
    (``--no-time``, or the time limit had passed), the comparison that decided to deliver
    the rewrite: the end-to-end choice's paired test of the kept candidate against the
    input (its median per-round ratio; for a candidate that then won a duel, a lower
    bound), or the decorator's test against ``jax.jit`` of the function.
    """
    timing = report.get(_target(report).timing_key)
    if timing and timing.get("speedup") is not None:
        return float(timing["speedup"]), "report timing"
    choice = Choice.from_dict(report.get("end_to_end") or {})
    if choice is not None and choice.speedup is not None:
        return choice.speedup, "end-to-end choice"
    b = (report.get("baseline") or {}).get("paired")
    if b and b.get("faster"):
        return float(b["speedup"]), "timing against jax.jit"
    return None, None


@dataclass(frozen=True)
class Outcome:
    """The result of one optimization: the verdict, the graph delivered, and the details.

    Attributes:
        verdict: which graph is delivered and why (:class:`Verdict`).
        report: the details, read-only: ``model``, ``notes``, ``target``,
            ``operators_before/after`` (operator counts), ``cost`` (``model``,
            ``before_us``, ``after_us``: estimated microseconds), ``search`` (``seconds``,
            ``iterations``, ``explored``, ``stopped``: a
            :class:`~taso_jax.search.limits.StopReason` value), ``rules``, ``applied``
            (substitution name -> count), ``end_to_end`` (the end-to-end choice), and where
            made ``check`` (the output check), ``time`` (``jax.jit`` microseconds before and
            after, ``speedup``), ``onnxruntime``, ``written`` (the output path),
            ``written_copy_of_input``, ``wall_seconds`` and ``time_limit`` (seconds). Entries
            describing a graph that was not delivered are as measured for it.
        graph: the graph delivered, where there is one (the input graph when the verdict
            delivers the input; ``None`` for a model that was not imported).
        why: why the input is delivered, in words (``None`` for :attr:`Verdict.REWRITTEN`).
        result: the :class:`~taso_jax.search.backtracking.SearchResult` of the search, where
            one ran (its ``graph`` is the best graph found, delivered or not).
        phases: where the time went, and which cost model priced the delivered graph
            (:class:`~taso_jax.records.PhaseTimes`), where the pipeline timed it.
    """

    verdict: Verdict
    report: Mapping[str, Any] = field(default_factory=dict)
    graph: Graph | None = field(default=None, compare=False)
    why: str | None = None
    result: Any = field(default=None, compare=False, repr=False)
    phases: PhaseTimes | None = None

    def __post_init__(self):
        object.__setattr__(self, "report", _frozen(dict(self.report)))
        # what the JSON and the text show, settled once: rendering computes nothing
        object.__setattr__(self, "_view", _frozen(_delivered_view(self.verdict, self.report,
                                                                  self.graph)))

    @property
    def choice(self) -> Choice | None:
        """The end-to-end choice (:class:`~taso_jax.records.Choice`), where one was made."""
        return Choice.from_dict(self.report.get("end_to_end") or {})

    @property
    def check(self) -> Check | None:
        """The output check of the graph found (:class:`~taso_jax.records.Check`), where made."""
        return Check.from_dict(self.report.get("check") or {})

    @property
    def speedup(self) -> float | None:
        """The measured speed-up of what is delivered over the input, or ``None``.

        1.0 wherever the input is delivered; for a rewritten graph, the report's own timing
        in the target's runtime (``jax.jit``; ``--target onnxruntime``: onnxruntime), else
        the comparison that decided the rewrite (the end-to-end choice's paired test, the
        decorator's test against ``jax.jit`` of the function), ``None`` where nothing was
        timed (:attr:`speedup_measured_by` says which).
        """
        return 1.0 if self.verdict.delivers_input else _measured(self.report)[0]

    @property
    def speedup_measured_by(self) -> str | None:
        """Which measurement :attr:`speedup` is, or ``None``.

        ``"report timing"``, ``"end-to-end choice"`` or ``"timing against jax.jit"``;
        ``None`` where the input is delivered or nothing was timed.
        """
        return None if self.verdict.delivers_input else _measured(self.report)[1]

    def with_report(self, **entries) -> Outcome:
        """The same outcome with ``entries`` added to its report (measured after it was made).

        The verdict, graph, ``why`` and phases stay; the delivered view is settled again.
        """
        return replace(self, report={**_thawed(self.report), **entries})

    def to_json(self) -> dict:
        """The ``--json`` report: a plain dump of the record as it was decided.

        The delivered view was settled when the outcome was made (:func:`_delivered_view`:
        under a verdict that delivers the input, the figures of the graph not delivered are
        under ``found_not_delivered``); ``outcome`` holds ``verdict``, ``delivered``
        (``"input"`` or ``"optimized"``), ``speedup``, ``speedup_measured_by`` and ``why``,
        and ``phases`` the :class:`~taso_jax.records.PhaseTimes`.
        """
        d = _thawed(self._view)
        d["outcome"] = {"verdict": self.verdict.value,
                        "delivered": "input" if self.verdict.delivers_input else "optimized",
                        "speedup": self.speedup,
                        "speedup_measured_by": self.speedup_measured_by, "why": self.why}
        if self.phases is not None:
            d["phases"] = self.phases.to_json()
        return d

    def to_text(self, delivered_input: str = "the input") -> str:
        """The text report: :meth:`to_json` rendered for a person, verdict line first.

        ``delivered_input`` is what the user gets where the input is delivered, in words
        (the decorator: ``"running jax.jit of the original function"``).
        """
        d = self.to_json()
        speedup = self.speedup
        head = f"result: {self.verdict.sentence(delivered_input)}"
        if self.verdict is Verdict.REWRITTEN and speedup is not None:
            head += f", {speedup:.2f}x faster under {_target(d).runtime}"
            if self.speedup_measured_by != "report timing":
                head += f" (measured by the {self.speedup_measured_by})"
        if self.why and self.verdict.delivers_input:
            head += f" ({self.why})"
        if self.verdict is Verdict.PASS_THROUGH:
            return head + "\n" + format_pass_through(d)
        if "search" not in d:  # failed or stopped before the search reported
            return "\n".join([head, *format_not_searched(d)])
        lines = [head, format_report(d)]
        found = d.get("found_not_delivered")
        if found:
            t = found.get(_target(d).timing_key)
            applied = ", ".join(f"{k} x{v}" for k, v in sorted(found.get("applied", {}).items()))
            lines.append("found, not delivered: "
                         + (f"a graph timed at {t['speedup']:.2f}x ({t['before_us']:.1f} us -> "
                            f"{t['after_us']:.1f} us)" if t and "speedup" in t else "a graph")
                         + (f" with {applied}" if applied else ""))
            if found.get("end_to_end"):
                lines.append("  how it was chosen among the graphs: "
                             + end_to_end_line(found["end_to_end"]))
            if found.get("check", {}).get("ok") is False:  # why it was not delivered
                lines.append("  its " + _check_line(found["check"]))
        return "\n".join(lines)



def _delivered_view(verdict: Verdict, report: Mapping, graph: Graph | None) -> dict:
    """The report as delivered, settled when an :class:`Outcome` is made.

    Under a verdict that delivers the input, the entries measured for the graph not
    delivered move to ``found_not_delivered``, ``applied`` is empty, and the figures are
    the input's.
    """
    d = _thawed(report)
    if verdict.delivers_input and verdict is not Verdict.PASS_THROUGH:
        found = {k: d.pop(k) for k in _FOUND_KEYS if d.get(k)}
        if not found.get("applied") or verdict is Verdict.UNCHANGED:
            # no other graph was found (or it lost the final timing): how the input came
            # to be kept stays, and a timing of the input against itself is 1.0
            if "end_to_end" in found and not found.get("applied"):
                d["end_to_end"] = found.pop("end_to_end")
            if "time" in found:
                t = found.pop("time")
                d["time"] = {**t, "after_us": t["before_us"], "speedup": 1.0}
        if found.get("applied"):
            d["found_not_delivered"] = found
        d["applied"] = {}
        if "operators_before" in d:
            d["operators_after"] = dict(d["operators_before"])
        if "cost" in d:
            d["cost"] = {**d["cost"], "after_us": d["cost"]["before_us"]}
        if d.get("written"):  # the input, byte for byte
            d["check"] = {"ok": True, "identical": True, "max_abs_err": 0.0,
                          "outputs": len(graph.outputs) if graph else None}
        elif verdict is Verdict.FALLBACK and "check" in found:
            d["check"] = found["check"]  # the check that failed is the story
    return d


def kept_input_verdict(graph: Graph, result, report: Mapping) -> tuple[Verdict, str | None] | None:
    """``(verdict, why)`` for a search that delivered its input graph, or ``None``.

    :attr:`Verdict.TIME_LIMIT` where the time limit cut a phase (a candidate may have been
    ahead when it cut the choice's confirmation) or left a rule file's rules unproved, else
    :attr:`Verdict.UNCHANGED`; ``why`` names the phase. The one place this verdict is
    decided, for every front door.
    """
    if result.graph.key != graph.key:
        return None
    e2e = report.get("end_to_end") or {}
    cut = e2e.get("skipped") or result.out_of_time_in  # any phase the limit cut
    proofs = (result.rules or {}).get("not_proved_in_time")  # the search lacked those rules
    why = e2e.get("skipped") or (
        f"the time limit passed during the {result.out_of_time_in}" if cut else None) or (
        f"the time limit passed while the rule file was proved ({proofs} rules not proved "
        "in time)" if proofs else None)
    return (Verdict.TIME_LIMIT if cut or proofs else Verdict.UNCHANGED), why


def first_call_verdict(fallback: str | None, original_kept: str | None, *,
                       past_limit: bool = False) -> tuple[Verdict, str | None]:
    """``(verdict, why)`` of a decorated function's first call, from what it found.

    ``fallback``: why the pipeline failed, if it did (:attr:`Verdict.FALLBACK`);
    ``original_kept``: why ``jax.jit`` of the original runs, if it does
    (:attr:`Verdict.TIME_LIMIT` where ``past_limit``: the limit passed before the optimized
    function could be compiled, checked and timed; else :attr:`Verdict.UNCHANGED`);
    neither: :attr:`Verdict.REWRITTEN`.
    """
    if fallback is not None:
        return Verdict.FALLBACK, fallback
    if original_kept:
        return (Verdict.TIME_LIMIT if past_limit else Verdict.UNCHANGED), original_kept
    return Verdict.REWRITTEN, None


def make_outcome(verdict: Verdict, report: Mapping, graph: Graph | None = None, *,
                 why: str | None = None, result=None,
                 phases: PhaseTimes | None = None) -> Outcome:
    """The :class:`Outcome` of a decided verdict: the one place outcomes are made.

    Where the input is delivered and ``why`` is given, the report records it as
    ``kept_input_because``.
    """
    if verdict.delivers_input and why and verdict is not Verdict.PASS_THROUGH:
        report = {**report, "kept_input_because": why}
    return Outcome(verdict, report, graph, why=why, result=result, phases=phases)
