"""Run ``taso-jax optimize`` on real ONNX files as a user would, and measure what came back.

For each model (``--models GLOB`` picks some) and each ``--target`` (xla by default), the
command line runs in a subprocess with no shape flags (real files load as they are; their
open sizes bound by the importer, named in the report's notes), with ``--time-limit`` and a
per-model timeout, and writes into ``--out-dir`` (a fresh temporary folder by default, never
next to the inputs). This script then reads its JSON report and measures, itself:

* ``exit``: the command's exit code (0 loaded and optimized with no flags; 2 bad input);
* ``rewritten`` and ``verdict``: whether ``outcome.verdict`` of the report is
  ``rewritten``, and the verdict (``unchanged``, ``bound_sizes_only``, ``time_limit``, ...);
  a file that is not a byte copy of the input (an old opset converted, say) is measured
  below even when the verdict keeps the input graph;
* ``jax.jit``: the median time under ``jax.jit`` of the original graph against the written
  file's graph (``search.choose.time_graphs``, interleaved rounds), at the sizes the
  importer bound and at a second binding of the open sizes (the first of
  ``report.other_bindings`` at which both files load), with the ratio;
* ``onnxruntime``: the median time of both files in onnxruntime (CPU), interleaved
  (``time_onnx_models``), at the bound sizes, with the ratio;
* ``equal``: whether the written file gives the original's outputs in onnxruntime at both
  bindings (``report.compare_outputs`` on the same seeded inputs, integer inputs drawn
  inside the axes they index: ``index_bounds``), with the tool's tolerance and an
  absolute tolerance of at least ``report.OTHER_SIZES_ATOL`` (float32 rounding: a text
  detector's output is all but 0 on random inputs);
* ``opaque``: the ONNX operators left opaque (op type and count, from the report's notes);
* ``wall``: seconds of the command alone.

A file written back as the input's bytes is not timed (its ratio is the noise alone) and
is equal by construction. The markdown table is written to ``--out`` atomically (a
temporary file, then a rename) after every model, so an interrupted run leaves the rows
done so far; rows also go to ``OUT_DIR/results.json``.

    python benchmarks/real_onnx_models.py --out table.md                    # the corpus
    python benchmarks/real_onnx_models.py --models 'silero*' --time-limit 20 --out t.md
    python benchmarks/real_onnx_models.py a.onnx folder/ --targets xla,onnxruntime --out t.md

Default folders: ``../shared/models`` and ``/tmp/realmodels/in``
(``benchmarks/fetch_real_models.py`` fills it).
"""

from __future__ import annotations

import argparse
import datetime
import filecmp
import fnmatch
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DIRS = [REPO.parent / "shared" / "models", Path("/tmp/realmodels/in")]
HEADER = ("| model | target | exit | rewritten | verdict | jax.jit ms bound: before -> after (x) "
          "| jax.jit ms 2nd binding: before -> after (x) | onnxruntime ms: before -> after (x) "
          "| equal in ort (bound / 2nd) | opaque operators left | search: model, compiles, "
          "graphs expanded, stop | wall s | note |")


def model_paths(items: list[str], pattern: str | None = None) -> list[Path]:
    """The .onnx files named, or inside the folders named (default ``DEFAULT_DIRS``), whose
    file name matches ``pattern`` (``fnmatch``; all when None)."""
    found = []
    for item in items or [str(d) for d in DEFAULT_DIRS if d.is_dir()]:
        p = Path(item)
        found += sorted(p.glob("*.onnx")) if p.is_dir() else [p]
    return [p for p in found if pattern is None or fnmatch.fnmatch(p.name, pattern)]


def run_measured(cmd: list[str], timeout: float | None) -> tuple[int | None, str]:
    """``(exit code, or None when killed at ``timeout`` seconds, stderr)`` of ``cmd``."""
    with tempfile.TemporaryFile() as err:
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
        try:
            code = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            code = None
        err.seek(0)
        return code, err.read().decode(errors="replace")


def _opaque(notes: list[str]) -> dict[str, int]:
    """``{op type: count}`` from the report's ``kept as opaque nodes: A x2, B x1`` note."""
    for note in notes:
        if note.startswith("kept as opaque nodes: "):
            return {m.group(1): int(m.group(2))
                    for m in re.finditer(r"(\w+) x(\d+)", note.split(": ", 1)[1])}
    return {}


def second_binding(path: Path, graph) -> dict[str, tuple[int, ...]] | None:
    """The first other binding of the model's open sizes (``report.other_bindings``) at
    which the original loads, or None when it has no open sizes or loads at none."""
    from taso_jax.frontends.onnx_io import load_onnx, symbolic_dims
    from taso_jax.report import other_bindings

    symbolic = symbolic_dims(str(path))
    for shapes in other_bindings(graph, symbolic):
        try:
            load_onnx(str(path), input_shapes=shapes)
        except Exception:  # noqa: BLE001 (a binding the model refuses is skipped)
            continue
        return shapes
    return None


def xla_ratio(original: Path, written: Path, shapes, repeats: int) -> dict:
    """Median ``jax.jit`` times (us) of both files' graphs at ``shapes`` (None: bound)."""
    from taso_jax.search.choose import time_graphs

    from taso_jax.frontends.onnx_io import load_onnx

    a, b = time_graphs([load_onnx(str(original), input_shapes=shapes),
                        load_onnx(str(written), input_shapes=shapes)], repeats=repeats)
    return {"before_us": a["median_us"], "after_us": b["median_us"],
            "speedup": a["median_us"] / b["median_us"]}


def _feeds(graph, seed: int) -> dict[str, np.ndarray]:
    from taso_jax.ir.executor import random_inputs

    return dict(zip((n.name for n in graph.inputs), random_inputs(graph, seed=seed),
                    strict=True))


def ort_ratio(original: Path, written: Path, graph, repeats: int) -> dict:
    """Median onnxruntime times (us) of both files, interleaved, at the graph's sizes."""
    from taso_jax.frontends.onnxruntime_target import time_onnx_models

    times = time_onnx_models([str(original), str(written)], _feeds(graph, 0), repeats=repeats)
    a, b = float(np.median(times[0])), float(np.median(times[1]))
    return {"before_us": a, "after_us": b, "speedup": a / b if b else float("nan")}


def ort_equal(original: Path, written: Path, graph) -> dict:
    """Whether ``written`` gives ``original``'s outputs in onnxruntime on the graph's
    inputs (``report.compare_outputs``): ``{"ok", ...}``."""
    from taso_jax.frontends.onnxruntime_target import ort_session, owned_run
    from taso_jax.report import OTHER_SIZES_ATOL, compare_outputs

    feeds = _feeds(graph, 1)
    ref = owned_run(ort_session(str(original), trim=True), feeds)
    got = owned_run(ort_session(str(written), trim=True), feeds)
    return compare_outputs(got, ref, floor=[OTHER_SIZES_ATOL] * len(ref))


def _try(row: dict, key: str, fn, *args):
    try:
        row[key] = fn(*args)
    except Exception as e:  # noqa: BLE001 (a measurement that fails is data)
        row[key] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                    if str(e) else type(e).__name__}


def run_one(path: Path, target: str, out: Path, args) -> dict:
    """One model under one target: the command, then this script's measurements."""
    from taso_jax.frontends.onnx_io import load_onnx

    report_path = out.with_suffix(".json")
    cmd = [sys.executable, "-m", "taso_jax.cli", "optimize", str(path), "-o", str(out),
           "--target", target, "--json", str(report_path), "-q",
           "--time-limit", str(args.time_limit)]
    if args.cost_model:
        cmd += ["--cost-model", args.cost_model]
    row = {"model": path.stem, "path": str(path), "target": target,
           "limit_s": args.time_limit}
    t0 = time.perf_counter()
    row["exit"], stderr = run_measured(cmd, args.timeout)
    row["wall_s"] = time.perf_counter() - t0
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    if row["exit"] is None:
        row["error"] = f"timed out after {args.timeout:g} s"
    elif row["exit"] != 0:
        row["error"] = lines[0] if lines else "no stderr"
    if not report_path.exists():
        return row
    r = json.loads(report_path.read_text())
    outcome = r.get("outcome") or {}
    row["verdict"] = outcome.get("verdict") or ("pass_through" if r.get("imported") is False
                                                else None)
    row["notes"] = r.get("notes", [])
    row["opaque"] = _opaque(row["notes"])
    row["bound"] = next((m.group(1) for n in row["notes"]
                         for m in [re.search(r"--input-shape (\S+)\)$", n)] if m), None)
    row["copy"] = out.exists() and filecmp.cmp(path, out, shallow=False)
    row["rewritten"] = row["verdict"] == "rewritten"
    row["search"] = _search_facts(r)
    if row["exit"] != 0 or row["copy"] or not out.exists():
        return row
    deadline = time.perf_counter() + args.measure_limit
    _try(row, "leftovers", written_leftovers, out)
    _try(row, "graph", load_onnx, str(path))
    if isinstance(row["graph"], dict):
        return row
    graph = row.pop("graph")
    _try(row, "xla_bound", xla_ratio, path, out, None, args.repeats)
    _try(row, "ort", ort_ratio, path, out, graph, args.repeats)
    _try(row, "equal_bound", ort_equal, path, out, graph)
    if time.perf_counter() > deadline:
        row["second"] = {"error": f"not measured: past --measure-limit {args.measure_limit:g} s"}
        return row
    _try(row, "second", second_binding, path, graph)
    if isinstance(row.get("second"), dict) and row["second"] and "error" not in row["second"]:
        shapes = row["second"]
        _try(row, "xla_second", xla_ratio, path, out, shapes, args.repeats)
        _try(row, "graph2", load_onnx, str(path), shapes)
        if not isinstance(row["graph2"], dict):
            _try(row, "equal_second", ort_equal, path, out, row.pop("graph2"))
        else:
            row["equal_second"] = row.pop("graph2")
    return row


def written_leftovers(out: Path) -> dict:
    """What the written file runs for nothing (issue 62's done-when for the XLA target):
    nodes that reach no output, and sizes it reads at run time that are fixed."""
    import onnx

    from taso_jax.frontends.onnx_cleanup import file_leftovers, fixed_sizes_read

    model = onnx.load(str(out))
    found = {"dead": file_leftovers(model).get("dead", 0),
             "fixed sizes read": fixed_sizes_read(model)}
    return {k: v for k, v in found.items() if v}


def _search_facts(r: dict) -> dict:
    """The report's cost model, kernels it compiled, graphs expanded and why the search
    stopped (what the calibrated cost model changed: issue 58)."""
    s = r.get("search") or {}
    cm = r.get("cost_model") or {}
    return {"model": cm.get("name") or (r.get("cost") or {}).get("model"),
            "compiles": cm.get("compiles"), "expanded": s.get("iterations"),
            "stopped": s.get("stopped"), "out_of_time_in": s.get("out_of_time_in") or ""}


def _search_cell(row: dict) -> str:
    f = row.get("search") or {}
    if not f:
        return "-"
    cell = f"{f['model']}, {f['compiles']}, {f['expanded']}, {f['stopped']}"
    return cell + (f" (limit in {f['out_of_time_in']})" if f["out_of_time_in"] else "")


def _ratio(t) -> str:
    if not t:
        return "-"
    if "error" in t:
        return "error: " + t["error"][:60]
    return f"{t['before_us'] / 1e3:.2f} -> {t['after_us'] / 1e3:.2f} ({t['speedup']:.2f}x)"


def _equal(t) -> str:
    if not t:
        return "-"
    if "error" in t:
        return "error"
    return "yes" if t.get("ok") else "NO"


def format_row(row: dict) -> str:
    """One markdown row of the table (:data:`HEADER`)."""
    copy = row.get("copy")
    same = "same file" if copy else None
    second = row.get("second")
    if not copy and row["exit"] == 0:
        eq = f"{_equal(row.get('equal_bound'))} / " + (
            _equal(row.get("equal_second")) if second and "error" not in second
            else "no open sizes" if second is None else "-")
    else:
        eq = "same file" if copy else "-"
    opaque = ", ".join(f"{k} x{v}" for k, v in sorted(row.get("opaque", {}).items())) or "-"
    note = row.get("error") or (f"bound {row['bound']}" if row.get("bound") else "")
    left = row.get("leftovers")
    if left:
        note += ("; " if note else "") + "runs for nothing: " + (
            left["error"][:60] if "error" in left else
            ", ".join(f"{k} {v}" for k, v in left.items()))
    if second and "error" not in second:
        note += ("; " if note else "") + "2nd: " + " ".join(
            f"{k}={','.join(map(str, v))}" for k, v in second.items())
    cells = [row["model"], row["target"], str(row["exit"] if row["exit"] is not None
                                              else "timeout"),
             "yes" if row.get("rewritten") else "no", row.get("verdict") or "-",
             same or _ratio(row.get("xla_bound")), same or _ratio(row.get("xla_second")),
             same or _ratio(row.get("ort")), eq, opaque, _search_cell(row),
             f"{row['wall_s']:.1f}", note]
    return "| " + " | ".join(c.replace("|", "/") for c in cells) + " |"


def summary(rows: list[dict]) -> list[str]:
    """Counts over the rows: exits, rewritten, faster under jax.jit at 1.1x or more."""
    ran = [r for r in rows if r["exit"] == 0]
    rewritten = [r for r in ran if r.get("rewritten")]
    faster = [r for r in rewritten if (r.get("xla_bound") or {}).get("speedup", 0) >= 1.1]
    unequal = [r["model"] for r in ran if not r.get("copy")
               and not (r.get("equal_bound") or {}).get("ok")]
    exits = {}
    for r in rows:
        exits[r["exit"]] = exits.get(r["exit"], 0) + 1
    facts = [r.get("search") or {} for r in ran]
    compiles = sorted(f["compiles"] for f in facts if f.get("compiles") is not None)
    idle = [r["model"] for r, f in zip(ran, facts, strict=True)
            if (f.get("out_of_time_in") or f.get("stopped") == "time limit")
            and not f.get("expanded")]
    over = [r["model"] for r in rows if r["wall_s"] > 1.1 * r.get("limit_s", 60.0)]
    idle_work = [r["model"] for r in ran if r.get("leftovers")]
    return [f"{len(rows)} runs; exit codes {dict(sorted(exits.items(), key=str))}; "
            f"{len(rewritten)} of {len(ran)} that ran rewritten; {len(faster)} of them "
            f">= 1.1x under jax.jit at the bound size; written files not equal at the bound "
            f"size: {unequal or 'none'}",
            f"kernels compiled by the search's cost model: median "
            f"{compiles[len(compiles) // 2] if compiles else '-'}, most "
            f"{compiles[-1] if compiles else '-'}; ended at the time limit having expanded "
            f"no graph: {idle or 'none'}; runs over 1.1x the time limit: {over or 'none'}",
            f"written files that run nodes reaching no output or read fixed sizes at run "
            f"time: {idle_work or 'none'}"]


def write_table(path: Path, preamble: list[str], rows: list[dict], done: bool) -> None:
    """The markdown table, written atomically (``taso_jax._io.atomic_write``)."""
    from taso_jax._io import atomic_write

    lines = [*preamble, "", HEADER, "|" + "---|" * HEADER.count(" | ") + "---|",
             *(format_row(r) for r in rows), ""]
    lines += summary(rows) if done else [f"partial: {len(rows)} rows so far"]
    text = "\n".join(lines) + "\n"
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def main(argv: list[str] | None = None) -> int:
    """Run the corpus; 0 when every run finished (any exit code), 1 on no models."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="*", help="ONNX files or folders of them")
    ap.add_argument("--models", dest="pattern", default=None,
                    help="only files whose name matches this glob (e.g. 'silero*')")
    ap.add_argument("--targets", default="xla",
                    help="comma-separated --target values to run (xla; xla,onnxruntime)")
    ap.add_argument("--time-limit", type=float, default=60,
                    help="--time-limit of each command, seconds (60)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds per command at most (default 2 x time limit + 120)")
    ap.add_argument("--measure-limit", type=float, default=120,
                    help="seconds of this script's measurements per model before the second "
                         "binding is skipped (120)")
    ap.add_argument("--repeats", type=int, default=20, help="timed rounds per ratio (20)")
    ap.add_argument("--cost-model", default=None,
                    help="passed to taso-jax optimize (default: its own default)")
    ap.add_argument("--out", required=True, help="markdown table to write")
    ap.add_argument("--out-dir", default=None, help="folder for outputs (a new temp folder)")
    args = ap.parse_args(argv)
    args.timeout = args.timeout or 2 * args.time_limit + 120
    paths = model_paths(args.models, args.pattern)
    if not paths:
        print("no models", file=sys.stderr)
        return 1
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="taso_real_onnx_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    inputs = {p.resolve() for p in paths}
    import jax
    import onnxruntime
    from _bytecode import byte_compile_package

    byte_compile_package()  # each command then imports as from an installed wheel

    preamble = [
        f"date: {datetime.datetime.now():%Y-%m-%d %H:%M}; machine: {platform.platform()}, "
        f"{os.cpu_count()} cores; jax {jax.__version__} ({jax.devices()[0].platform}); "
        f"onnxruntime {onnxruntime.__version__}; --time-limit {args.time_limit:g} s, "
        f"timeout {args.timeout:g} s per command; {args.repeats} interleaved rounds per ratio;"
        f" {len(paths)} models; command: `{' '.join(sys.argv)}`"]
    rows: list[dict] = []
    t0 = time.perf_counter()
    for i, path in enumerate(paths):
        for target in args.targets.split(","):
            out = out_dir / f"{i:02d}_{path.stem}.{target}.onnx"
            if out.resolve() in inputs:
                raise SystemExit(f"{out} is an input model; choose another --out-dir")
            rows.append(run_one(path, target, out, args))
            print(format_row(rows[-1]), flush=True)
            (out_dir / "results.json").write_text(json.dumps(rows, indent=1, default=str))
            write_table(Path(args.out), preamble, rows, done=False)
    preamble.append(f"total {time.perf_counter() - t0:.0f} s")
    write_table(Path(args.out), preamble, rows, done=True)
    print("\n".join(summary(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
