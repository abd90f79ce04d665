"""The small models that ship inside the ``onnx`` wheel, through ``taso-jax optimize``.

``onnx/backend/test/data/{simple,pytorch-converted,pytorch-operator,light}`` holds about 140
models written by others: PyTorch exports of single layers and operators (``test_Conv2d``,
``test_GLU``, ``test_operator_chunk``), hand-built graphs (sequences, ``Expand``, string
normalizers) and the light model-zoo networks, each with inputs and expected outputs in
``test_data_set_0``. Each model runs as a user would run it (``taso-jax optimize MODEL -o
OUT``, no flags), in its own process, and the row says:

* the exit code, and whether a traceback reached the user (never acceptable);
* for exit 0, whether the written model, run in onnxruntime on the wheel's own inputs,
  gives the wheel's expected outputs (an independent reference: the outputs were recorded
  by the exporter, not by us), next to the same check of the original file.

Run: python benchmarks/onnx_backend_models.py [--out DIR] [--jobs 2] [--time-limit 20]
     [--only SUBSTRING ...] [--target xla|onnxruntime]
Prints a markdown table and a summary; writes ``DIR/results.md``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import glob
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

SETS = ("simple", "pytorch-converted", "pytorch-operator", "light")


def corpus() -> list[Path]:
    """Model folders of the installed ``onnx`` wheel that hold ``model.onnx`` and data."""
    root = Path(onnx.__file__).parent / "backend" / "test" / "data"
    return [d for s in SETS for d in sorted((root / s).iterdir())
            if (d / "model.onnx").exists() and (d / "test_data_set_0").is_dir()]


def _read(pb: str):
    """A TensorProto, SequenceProto or OptionalProto file as NumPy values."""
    data = Path(pb).read_bytes()
    for proto, conv in ((onnx.TensorProto(), numpy_helper.to_array),
                        (onnx.SequenceProto(), numpy_helper.to_list),
                        (onnx.OptionalProto(), numpy_helper.to_optional)):
        try:
            proto.ParseFromString(data)
            return conv(proto)
        except Exception:  # noqa: BLE001 - try the next kind of proto
            continue
    raise ValueError(f"{pb}: not a tensor, sequence or optional")


def _equal(got, want, rtol=1e-3, atol=1e-5) -> bool:
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(
            _equal(g, w, rtol, atol) for g, w in zip(got, want, strict=True))
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return False
    if want.dtype.kind in "OUS":
        return bool(np.all(got == want))
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    return bool(np.allclose(got, want, rtol=rtol, atol=atol * max(1.0, scale),
                            equal_nan=True))


def reference_check(model: Path, data: Path) -> str:
    """``match``, ``differs`` or the one-line error of running ``model`` on ``data``."""
    import onnxruntime as ort

    try:
        sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
        names = [i.name for i in sess.get_inputs()]
        ins = [_read(p) for p in sorted(glob.glob(str(data / "input_*.pb")),
                                        key=lambda p: int(Path(p).stem.split("_")[1]))]
        outs = [_read(p) for p in sorted(glob.glob(str(data / "output_*.pb")),
                                         key=lambda p: int(Path(p).stem.split("_")[1]))]
        got = sess.run(None, dict(zip(names, ins, strict=False)))
    except Exception as e:  # noqa: BLE001 - reported in the row
        return "error: " + str(e).strip().splitlines()[-1][:120]
    return "match" if all(_equal(g, w) for g, w in zip(got, outs, strict=False)) else "differs"


def run_one(folder: Path, out: Path, time_limit: float, target: str) -> dict:
    """One model through ``taso-jax optimize``, and both files checked against the data."""
    name = f"{folder.parent.name}/{folder.name}"
    written = out / f"{folder.parent.name}__{folder.name}.opt.onnx"
    cmd = [sys.executable, "-m", "taso_jax.cli", "optimize", str(folder / "model.onnx"),
           "-o", str(written), "--time-limit", str(time_limit), "-q", "--target", target]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=time_limit * 6 + 120)
    seconds = time.perf_counter() - t0
    text = p.stdout + p.stderr
    row = {"model": name, "rc": p.returncode, "seconds": seconds,
           "traceback": "Traceback (most recent call last)" in text,
           "message": "", "original": reference_check(folder / "model.onnx",
                                                       folder / "test_data_set_0"),
           "written": "-"}
    if p.returncode == 0 and written.exists():
        row["written"] = reference_check(written, folder / "test_data_set_0")
        summary = [ln for ln in p.stdout.splitlines() if ln.strip()]
        row["message"] = summary[-1][:140] if summary else ""
    else:
        err = [ln for ln in p.stderr.splitlines() if ln.strip()]
        row["message"] = (err[-1] if err else text.strip()[-140:])[:160]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/onnx_backend_models"))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--time-limit", type=float, default=20.0)
    ap.add_argument("--target", default="xla", choices=("xla", "onnxruntime"))
    ap.add_argument("--only", nargs="*", default=[])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    folders = [f for f in corpus() if not args.only or any(s in str(f) for s in args.only)]
    rows = []
    with cf.ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(run_one, f, args.out, args.time_limit, args.target): f
                   for f in folders}
        for fut in cf.as_completed(futures):
            r = fut.result()
            rows.append(r)
            print(f"{r['model']}: rc {r['rc']} {r['seconds']:.1f} s, original {r['original']}, "
                  f"written {r['written']}{', TRACEBACK' if r['traceback'] else ''}: "
                  f"{r['message']}", flush=True)
    rows.sort(key=lambda r: r["model"])
    lines = [f"`python benchmarks/onnx_backend_models.py --target {args.target} --time-limit "
             f"{args.time_limit:g}`, onnx {onnx.__version__}, {len(rows)} models.", "",
             "| model | exit | seconds | original vs data | written vs data | message |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        msg = r["message"].replace("|", "/")
        lines.append(f"| {r['model']} | {r['rc']}{' (traceback)' if r['traceback'] else ''} | "
                     f"{r['seconds']:.1f} | {r['original']} | {r['written']} | {msg} |")
    ok = sum(r["rc"] == 0 for r in rows)
    wrong = [r["model"] for r in rows if r["rc"] == 0 and r["original"] == "match"
             and r["written"] != "match"]
    tb = [r["model"] for r in rows if r["traceback"]]
    lines += ["", f"exit 0: {ok} of {len(rows)}; written model off the data where the original "
              f"matches: {len(wrong)} {wrong}; tracebacks: {len(tb)} {tb}"]
    text = "\n".join(lines) + "\n"
    (args.out / "results.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    raise SystemExit(main())
