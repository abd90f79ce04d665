"""Run ``taso-jax optimize`` on real ONNX files, as a user would, for each target.

For each model and each ``--target`` (xla, onnxruntime), the command line runs in a
subprocess with no shape flags (the point: real files load as they are, symbolic sizes
bound by the importer, named in the report's notes), with a timeout, and writes into
``--out-dir`` (a fresh temporary folder by default; never next to the inputs). From its JSON
report the table shows: whether the model loaded with no flags (exit code 0), operators
before -> after, the median time under ``jax.jit`` of the input graph vs the optimized one,
the median time in onnxruntime (CPU) of the original file vs the written file, the wall
time of the whole command, the peak memory (resident set, ``VmHWM``) of the command
against that of a process that only runs the original file once in an onnxruntime
session, and a note (the first stderr line on failure). When the graph did not change
the command writes the input back and times nothing in onnxruntime; this script
then times both files itself, interleaved (``time_onnx_models``), on random inputs at the
sizes the importer bound. With ``--target onnxruntime`` the command times nothing under
``jax.jit`` (it never imports JAX); this script times both files there itself.

    python benchmarks/real_onnx_models.py                          # ../shared/models, and
                                                                   # /tmp/realmodels/in if any
    python benchmarks/real_onnx_models.py a.onnx models/ --targets onnxruntime --time-limit 30

Prints a markdown table and writes the rows to ``OUT_DIR/results.json``.
"""

from __future__ import annotations

import argparse
import datetime
import filecmp
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import onnxruntime

from taso_jax.frontends.onnx_io import load_onnx
from taso_jax.frontends.onnxruntime_target import time_onnx_models
from taso_jax.ir.executor import random_inputs

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DIRS = [REPO.parent / "shared" / "models", Path("/tmp/realmodels/in")]


def model_paths(items: list[str]) -> list[Path]:
    """The .onnx files named, or inside the folders named (default: ``DEFAULT_DIRS``)."""
    found = []
    for item in items or [str(d) for d in DEFAULT_DIRS if d.is_dir()]:
        p = Path(item)
        found += sorted(p.glob("*.onnx")) if p.is_dir() else [p]
    return found


def ort_times(original: Path, written: Path, repeats: int) -> dict:
    """Median onnxruntime times of both files, interleaved, at the importer's bound sizes."""
    graph = load_onnx(str(original))
    inputs = dict(zip((n.name for n in graph.inputs), random_inputs(graph), strict=True))
    times = time_onnx_models([str(original), str(written)], inputs, repeats=repeats)
    a, b = float(np.median(times[0])), float(np.median(times[1]))
    return {"before_us": a, "after_us": b, "speedup": a / b if b else float("nan"),
            "repeats": repeats, "measured_by": "benchmark"}


def xla_times(original: Path, written: Path, repeats: int) -> dict:
    """Median ``jax.jit`` times of both files, interleaved (for ``--target onnxruntime``,
    whose report times onnxruntime only)."""
    from taso_jax.search.choose import time_graphs

    a, b = time_graphs([load_onnx(str(original)), load_onnx(str(written))], repeats=repeats)
    return {"before_us": a["median_us"], "after_us": b["median_us"],
            "speedup": a["median_us"] / b["median_us"], "repeats": repeats,
            "measured_by": "benchmark"}


def run_measured(cmd: list[str], timeout: float | None) -> tuple[int | None, str, float]:
    """``(exit code or None on timeout, stderr, peak resident memory in MB)`` of ``cmd``.

    The peak is the child's ``VmHWM`` (``/proc/PID/status``), read every 20 ms until it
    exits. Not ``ru_maxrss``: Linux carries a process's high-water mark across ``exec``,
    so a child forked from this (large) process would report at least this one's size.
    """
    with tempfile.TemporaryFile() as err:
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
        start, peak_kb, killed = time.perf_counter(), 0, False
        while True:
            try:
                with open(f"/proc/{p.pid}/status") as f:
                    for line in f:
                        if line.startswith("VmHWM:"):
                            peak_kb = max(peak_kb, int(line.split()[1]))
            except (OSError, ValueError):
                pass
            try:
                p.wait(timeout=0.02)
                break
            except subprocess.TimeoutExpired:
                if timeout and time.perf_counter() - start > timeout:
                    p.kill()
                    p.wait()
                    killed = True
                    break
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    return (None if killed else p.returncode), stderr, peak_kb / 1024.0


_ORT_PEAK = """
import sys, numpy as np, onnxruntime as ort
feeds = dict(np.load(sys.argv[2]))
opts = ort.SessionOptions()
opts.intra_op_num_threads = 2
sess = ort.InferenceSession(sys.argv[1], opts, providers=["CPUExecutionProvider"])
sess.run(None, feeds)
"""


def ort_session_peak_mb(path: Path, out_dir: Path) -> float | None:
    """Peak resident MB of a process that runs ``path`` once in onnxruntime (CPU), on
    random inputs at the importer's bound sizes; ``None`` if that fails."""
    try:
        graph = load_onnx(str(path))
        feeds = out_dir / (path.stem + ".inputs.npz")
        np.savez(feeds, **dict(zip((n.name for n in graph.inputs), random_inputs(graph),
                                   strict=True)))
        code, _, peak = run_measured([sys.executable, "-c", _ORT_PEAK, str(path), str(feeds)],
                                     600)
        return peak if code == 0 else None
    except Exception:  # noqa: BLE001 (a model that does not load here has no figure)
        return None


def run_one(path: Path, target: str, out: Path, args) -> dict:
    report_path = out.with_suffix(".json")
    cmd = [sys.executable, "-m", "taso_jax.cli", "optimize", str(path), "-o", str(out),
           "--target", target, "--json", str(report_path), "-q",
           "--time-limit", str(args.time_limit)]
    row = {"model": path.stem, "path": str(path), "target": target, "command": cmd}
    t0 = time.perf_counter()
    row["exit_code"], stderr, row["peak_mb"] = run_measured(cmd, args.timeout)
    if row["exit_code"] is None:
        stderr = f"timed out after {args.timeout:g} s: " + stderr
    row["wall_s"] = time.perf_counter() - t0
    row["loads_without_flags"] = row["exit_code"] == 0
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    row["error"] = None if row["exit_code"] == 0 else (lines[0] if lines else "no stderr")
    if not report_path.exists():
        return row
    r = json.loads(report_path.read_text())
    if r.get("imported") is False:  # written back unimported: its sizes follow input values
        row["copy_of_input"] = bool(r.get("written_copy_of_input"))
        row["notes"] = [f"passed through: {r['not_optimized_because']}"]
        return row
    row["operators_before"] = sum(r["operators_before"].values())
    row["operators_after"] = sum(r["operators_after"].values())
    row["jax_jit"] = r.get("time")
    row["onnxruntime"] = r.get("onnxruntime")
    row["search_s"] = r["search"]["seconds"]
    row["applied"] = r.get("applied", {})
    row["notes"] = r.get("notes", [])
    row["copy_of_input"] = bool(r.get("written_copy_of_input"))
    # a byte copy times like the input by definition: its ratio is the timing noise alone
    row["identical_file"] = out.exists() and filecmp.cmp(path, out, shallow=False)
    row["original_kept"] = bool((r.get("end_to_end") or {}).get("original_kept"))
    row["check"] = r.get("check")
    if row["jax_jit"] is None and row["exit_code"] == 0 and out.exists():
        try:
            row["jax_jit"] = xla_times(path, out, args.repeats)
        except Exception as e:  # noqa: BLE001 (a model XLA cannot time is data)
            row["xla_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if row["onnxruntime"] is None and row["exit_code"] == 0 and out.exists():
        try:
            row["onnxruntime"] = ort_times(path, out, args.repeats)
        except Exception as e:  # noqa: BLE001 (a model onnxruntime cannot time is data)
            row["ort_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return row


def _ms(t: dict | None, same_file: bool = False) -> str:
    if not t:
        return "-"
    if same_file:  # the written file is the input's bytes: no ratio to give
        return f"{t['before_us'] / 1e3:.2f} (same file)"
    return (f"{t['before_us'] / 1e3:.2f} -> {t['after_us'] / 1e3:.2f} "
            f"({t['speedup']:.2f}x)")


def _short(note: str) -> str:
    """A shape note as the binding it chose (``bound x=1,224``); others cut to 80 chars."""
    m = re.search(r"--input-shape (\S+)\)$", note)
    return f"bound {m.group(1)}" if m else note.replace("kept as opaque nodes", "opaque")[:80]


def _note(row: dict) -> str:
    if row["error"]:
        return row["error"][:160].replace("|", "/")
    parts = []
    if row.get("copy_of_input"):
        parts.append("unchanged, input copied")
    elif row.get("original_kept"):
        parts.append("input graph kept (end to end)")
    if row.get("applied"):
        parts.append(f"{sum(row['applied'].values())} rewrites")
    if (row.get("onnxruntime") or {}).get("measured_by") == "benchmark":
        parts.append("ort timed here")
    if (row.get("jax_jit") or {}).get("measured_by") == "benchmark":
        parts.append("xla timed here")
    if row.get("xla_error"):
        parts.append("xla: " + row["xla_error"])
    if row.get("ort_error"):
        parts.append("ort: " + row["ort_error"])
    parts += [_short(n) for n in row.get("notes", [])]
    return "; ".join(parts).replace("|", "/")


def format_row(row: dict) -> str:
    ops = (f"{row['operators_before']} -> {row['operators_after']}"
           if "operators_before" in row else "-")
    loads = "yes" if row["loads_without_flags"] else f"no (exit {row['exit_code']})"
    ort_mb = row.get("ort_session_peak_mb")
    same = bool(row.get("identical_file"))
    memory = f"{row['peak_mb']:.0f} / {ort_mb:.0f}" if ort_mb else f"{row['peak_mb']:.0f} / -"
    return (f"| {row['model']} | {row['target']} | {loads} | {ops} "
            f"| {_ms(row.get('jax_jit'), same)} | {_ms(row.get('onnxruntime'), same)} "
            f"| {row['wall_s']:.1f} | {memory} "
            f"| {_note(row)} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="*", help="ONNX files or folders of them")
    ap.add_argument("--targets", default="xla,onnxruntime",
                    help="comma-separated --target values to run (xla,onnxruntime)")
    ap.add_argument("--time-limit", type=float, default=60, help="search seconds (60)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds per command at most (default 4 x time limit + 300)")
    ap.add_argument("--repeats", type=int, default=20,
                    help="onnxruntime runs when this script times an unchanged model (20)")
    ap.add_argument("--out-dir", default=None, help="folder for outputs (a new temp folder)")
    args = ap.parse_args()
    args.timeout = args.timeout or 4 * args.time_limit + 300
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="taso_real_onnx_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = model_paths(args.models)
    inputs = {p.resolve() for p in paths}
    print(f"date: {datetime.datetime.now():%Y-%m-%d %H:%M}; machine: {platform.platform()}, "
          f"{os.cpu_count()} cores; jax {jax.__version__} ({jax.devices()[0].platform}); "
          f"onnxruntime {onnxruntime.__version__}; search time limit {args.time_limit:g} s; "
          f"outputs in {out_dir}", flush=True)
    _, _, ours = run_measured([sys.executable, "-c", "import jax, onnxruntime, taso_jax.cli; "
                               "jax.numpy.zeros(1).block_until_ready()"], 300)
    _, _, theirs = run_measured([sys.executable, "-c", "import numpy, onnxruntime"], 300)
    print(f"peak memory of the imports alone: taso_jax with jax and onnxruntime {ours:.0f} MB; "
          f"onnxruntime {theirs:.0f} MB", flush=True)
    print("\n| model | target | loads w/o flags | ops before -> after "
          "| jax.jit ms before -> after (x) | onnxruntime ms before -> after (x) | wall s "
          "| peak MB: command / onnxruntime session | note |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    rows, t0 = [], time.perf_counter()
    for i, path in enumerate(paths):
        ort_mb = ort_session_peak_mb(path, out_dir)
        for target in args.targets.split(","):
            out = out_dir / f"{i:02d}_{path.stem}.{target}.onnx"
            if out.resolve() in inputs:
                raise SystemExit(f"{out} is an input model; choose another --out-dir")
            rows.append(run_one(path, target, out, args))
            rows[-1]["ort_session_peak_mb"] = ort_mb
            print(format_row(rows[-1]), flush=True)
            (out_dir / "results.json").write_text(json.dumps(rows, indent=1, default=str))
    failed = [r for r in rows if not r["loads_without_flags"]]
    print(f"\n{len(rows)} runs, {len(failed)} failed, {time.perf_counter() - t0:.0f} s in all; "
          f"rows: {out_dir / 'results.json'}")


if __name__ == "__main__":
    main()
