"""taso-jax: a tensor algebra superoptimizer for JAX/XLA (TASO, reimplemented).

taso-jax optimize   optimize an ONNX model (or the built-in example) and write it
taso-jax generate   generate substitutions and prove them from the operator axioms
taso-jax verify     prove a substitution file (default: the shipped set) with Z3
taso-jax bench      time TASO's six benchmark models: jax.jit against optimized

Exit codes: 0 success (an optimized model that fails the output check is not written: the
input is, with a warning); 1 verify found rules it could not prove, or an internal error
(one line; --debug prints the traceback); 2 bad input, named in one line (a missing,
invalid or unsupported model, a bad option, an output path that would overwrite an input or
is not writable).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

from taso_jax._io import NamedFiles
from taso_jax._text import one_line
from taso_jax.cli_files import (
    MAX_RULE_FILE_BYTES,
    UsageError,
    check_checkpoint_text,
    check_input_file,
    check_output_folder,
    check_outputs,
)
from taso_jax.cli_optimize import run_optimize

__all__ = ["main"]

#: Built-in examples ``taso-jax optimize`` runs without a model (:mod:`taso_jax.examples`).
EXAMPLES = ("nasrnn", "resnet_module")
DEFAULT_EXAMPLE = "nasrnn"


def _check_proof_files(args) -> None:
    """``verify``'s and ``generate``'s files, before any work (exit 2).

    The input rule file (``verify FILE``) and an existing ``--checkpoint`` must be regular
    files of at most :data:`MAX_RULE_FILE_BYTES`; the checkpoint (appended to, never
    replaced), ``-o`` and ``--report`` get :func:`check_output_path`, none of them an input,
    the shipped rule set or another output; an existing checkpoint must be one
    (:func:`check_checkpoint_text`).
    """
    from importlib.resources import files

    protected = NamedFiles()
    protected.add(str(files("taso_jax").joinpath("data/substitutions.json")),
                  "the shipped rule set")
    rule_file = getattr(args, "file", None)
    if rule_file is not None:
        check_input_file(rule_file, "rule file", MAX_RULE_FILE_BYTES)
        protected.add(rule_file, "the input rule file")
    if args.checkpoint:
        check_input_file(args.checkpoint, "--checkpoint", MAX_RULE_FILE_BYTES,
                         must_exist=False)
    check_outputs([(args.checkpoint, "--checkpoint", "the checkpoint"),
                   (args.output, "-o", "the output file"),
                   (args.report, "--report", "the report file")], protected)
    if args.checkpoint:  # after: naming the input rule file is said as such
        check_checkpoint_text(args.checkpoint)


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


def _generate_domains(text: str | None, by_name: dict) -> list[str]:
    """``--domains``: every domain when absent; an empty or unknown name is refused (exit 2).

    An empty list is not read as "every domain": ``--domains ''`` (a variable left empty in
    a script) would otherwise start the longest generation there is.
    """
    if text is None:
        return list(by_name)
    names = [n.strip() for n in text.split(",")]
    choose = f"choose from {', '.join(by_name)}"
    if not any(names):
        raise UsageError(f"--domains {text!r} names no domain; {choose} (leave --domains out "
                         "for every domain)")
    unknown = [repr(n) for n in names if n not in by_name]
    if unknown:
        raise UsageError(f"--domains: unknown domain(s) {', '.join(unknown)}; {choose}")
    return list(dict.fromkeys(names))


def _check_workers(args) -> None:
    """``--workers``: from 1 to 4 per core (each is a process, with Z3 or JAX loaded)."""
    most = 4 * (os.cpu_count() or 1)
    if args.workers is not None and not 1 <= args.workers <= most:
        raise UsageError(f"--workers {args.workers}: must be from 1 to {most} (4 per core)")


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
    names = _generate_domains(args.domains, by_name)

    bar = tqdm(desc="generate", unit="stage", file=sys.stderr, disable=args.quiet)

    def progress(msg):
        bar.update(1)
        bar.set_postfix_str(msg)

    t0 = time.perf_counter()
    subs, stats = generate([by_name[n] for n in names], max_ops=args.max_ops,
                           seed=args.seed, progress=progress, workers=args.workers,
                           cluster=args.cluster, laws=args.domains is None)
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
                                               checkpoint=args.checkpoint,
                                               trust_proofs=args.trust_proofs)
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
        RuleFileError,
        default_substitutions,
        load_substitutions,
        save_substitutions,
    )
    from taso_jax.verify.runner import verify_substitutions

    try:
        subs = (load_substitutions(args.file) if args.file else default_substitutions())
    except RuleFileError as e:  # it names the file and what is wrong
        raise UsageError(str(e)) from e
    bar, progress = _verify_progress(len(subs), args.quiet)
    stamped, stats = verify_substitutions(subs, rlimit=args.rlimit, timeout_ms=args.timeout_ms,
                                          workers=args.workers, progress=progress,
                                          cluster=args.cluster, checkpoint=args.checkpoint,
                                          trust_proofs=args.trust_proofs)
    bar.close()
    c = stats["counts"]
    print(f"substitutions: {len(subs)} ({args.file or 'shipped set'}); axioms: "
          f"{stats['axioms']}; Z3 limit {_limits(args)} each")
    how = [stats["engine"]]
    if stats["resumed"]:
        how.append(f"{stats['resumed']} from the checkpoint")
    if stats["reproved"]:  # lines this process did not write (--trust-proofs takes them)
        how.append(f"{stats['reproved']} that the checkpoint says are proved, proved again")
    print(f"proved: {c['proved']}; not proved: {c['unproved']} (the axioms allow the sides "
          f"to differ); unknown: {c['unknown']} (no answer within the limit); {stats['seconds']} s"
          f" ({'; '.join(how)})")
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
    if args.cost_cache and args.cost_model == "analytic":
        raise UsageError("--cost-cache holds measured kernel costs: it needs --cost-model "
                         "measured or calibrated")
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
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
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
                        "same FILE and limits skips the proofs already there, but proves "
                        "again a rule that a line says is proved, unless --trust-proofs")
    p.add_argument("--trust-proofs", action="store_true",
                   help="take the 'proved' lines of --checkpoint as they are (a file anyone "
                        "could have written: only one you made or trust)")


class _UsageExit(Exception):
    """A command line argparse refuses: its one-line message, for :func:`main` (exit 2)."""


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, not argparse's usage and error.

    ``error`` raises :class:`_UsageExit` with ``PROG: MESSAGE (see PROG --help)``, which
    :func:`main` prints and returns exit code 2 for; subcommand parsers are of this class
    too (argparse makes them with the parent's class).
    """

    def error(self, message: str):
        """Raise :class:`_UsageExit` naming the problem and where help is."""
        raise _UsageExit(f"{self.prog}: error: {one_line(message)} "
                         f"(see {self.prog} --help)")


def cost_model_names() -> tuple[str, ...]:
    """The cost models ``--cost-model`` accepts (``search.cost.COST_MODEL_NAMES``)."""
    from taso_jax.search.cost import COST_MODEL_NAMES

    return COST_MODEL_NAMES


def build_parser() -> argparse.ArgumentParser:
    """The ``taso-jax`` argument parser (errors are one line: :class:`_Parser`)."""
    from taso_jax.search.options import OptimizeOptions

    d = OptimizeOptions()  # the one set of defaults, shared with the API and the decorator
    p = _Parser(prog="taso-jax", description=__doc__.strip(),
                formatter_class=argparse.RawDescriptionHelpFormatter)
    common = _Parser(add_help=False)
    common.add_argument("--debug", action="store_true",
                        help="print the traceback of an internal error")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _optimize_parser(sub, common, d)
    _verify_parser(sub, common)
    _generate_parser(sub, common)
    _bench_parser(sub, common, d)
    return p

def _optimize_parser(sub, common, d) -> None:
    """The ``optimize`` command's arguments; defaults from options ``d``."""
    from taso_jax.checks import ATOL, MAX_ATOL, MAX_RTOL, RTOL
    from taso_jax.targets import target_names

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
    o.add_argument("--cost-model", choices=list(cost_model_names()), default=d.cost_model,
                   help=described("cost_model"))
    o.add_argument("--target", choices=list(target_names()), default=d.target,
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
                   help=f"output check: relative tolerance, from 0 to {MAX_RTOL} ({RTOL})")
    o.add_argument("--atol", type=float, default=None,
                   help=f"output check: absolute tolerance, from 0 to {MAX_ATOL} (default "
                        f"{ATOL} x the largest reference magnitude of each output)")
    o.add_argument("--json", help="also write the report as JSON to this file")
    o.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def _verify_parser(sub, common) -> None:
    """The ``verify`` command's arguments."""
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


def _generate_parser(sub, common) -> None:
    """The ``generate`` command's arguments."""
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


def _bench_parser(sub, common, d) -> None:
    """The ``bench`` command's arguments; defaults from options ``d``."""
    b = sub.add_parser("bench", parents=[common],
                       help="time TASO's benchmark models: jax.jit vs optimized",
                       epilog="On Linux with glibc 2.35+, the command starts itself again "
                              "with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 for steadier "
                              "timings (TASO_JAX_HUGEPAGES=off: not).")
    b.add_argument("models", nargs="*", help="model names (default: all six)")
    b.add_argument("--small", action="store_true", help="small shapes (a quick run on a CPU)")
    b.add_argument("--cost-model", choices=list(cost_model_names()), default=d.cost_model)
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


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``taso-jax`` command; returns the exit code."""
    from taso_jax.frontends.onnx_io import ModelError
    from taso_jax.ir.graph import GraphError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # JAX runs in 32 bits: an ONNX int64 value is computed as int32 by design (weights are
    # saturated, see taso_jax.ir.executor.as_jax_constant), so JAX's notice says nothing new
    warnings.filterwarnings("ignore", message="Explicitly requested dtype int64")
    try:
        args = build_parser().parse_args(argv)
    except _UsageExit as e:  # one line and exit 2, as every other bad option gets
        print(e, file=sys.stderr)
        return 2
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
            return run_optimize(args)
        if args.command == "verify":
            return _verify(args)
        if args.command == "bench":
            return _bench(args)
        return _generate(args)
    except (UsageError, ModelError, GraphError) as e:
        print(f"taso-jax: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the file is named: an output by the path given (taso_jax._io)
        where = f"{e.filename}: " if e.filename else ""
        print(f"taso-jax: error: {where}{e.strerror or one_line(str(e))}", file=sys.stderr)
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
