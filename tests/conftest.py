"""Shared test fixtures: where the models are, and small helpers."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).parent

try:  # keep onnxruntime's warnings about unused initializers out of the test log
    import onnxruntime

    onnxruntime.set_default_logger_severity(3)
except ImportError:  # pragma: no cover
    pass
DATA = HERE / "data"
# Tests never read or fill the user's cache of optimized graphs: a decision stored by one
# test (some force the original to be kept) must not reach another. The cache's own tests
# point it at a temporary folder.
os.environ["TASO_JAX_GRAPH_CACHE"] = "off"


def run_python(code: str, timeout: float = 600):
    """Run ``code`` in a fresh Python process (this one's interpreter); fail on its error.

    For what one process cannot show, such as which modules an import loads. Returns the
    ``subprocess.CompletedProcess`` (text output captured).
    """
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=timeout)
    assert run.returncode == 0, run.stderr[-2000:]
    return run


def shared_models_dir() -> Path | None:
    """``$TASO_JAX_MODELS`` or ``../shared/models`` next to the repository, if present."""
    env = os.environ.get("TASO_JAX_MODELS")
    for cand in ([Path(env)] if env else []) + [HERE.parent.parent / "shared" / "models"]:
        if cand.is_dir():
            return cand
    return None


SMALL_MODELS = ["hf_bert_tiny", "hf_gpt2_tiny", "tv_squeezenet1_1"]
LARGE_MODELS = ["timm_resnet18", "tv_mobilenet_v2"]


def model_path(name: str) -> Path:
    """A shared model: the committed copy for the small ones, ``../shared/models`` else."""
    p = DATA / f"{name}.onnx"
    if p.exists():
        return p
    d = shared_models_dir()
    if d is None or not (d / f"{name}.onnx").exists():
        pytest.skip(f"{name}.onnx is not committed (too large) and no shared models directory "
                    "was found (set TASO_JAX_MODELS)")
    return d / f"{name}.onnx"


#: The light models whose random weights are large (AlexNet, VGG-19, ZFNet-512: about 60-140
#: million float32 weights, 0.24-0.57 GB): a test of one took 16-63 s and up to 4.8 GB, and
#: every operator they use (Conv, LRN, MaxPool, Gemm, Dropout, ...) occurs in the six
#: others. ``benchmarks/shared_models.py`` runs all nine.
LARGE_LIGHT_MODELS = ("light_bvlc_alexnet.onnx", "light_vgg19.onnx", "light_zfnet512.onnx")


def light_models(large: bool = False) -> list[str]:
    """The ``light_*.onnx`` model-zoo graphs that ship inside the onnx wheel.

    Without ``large``, all but :data:`LARGE_LIGHT_MODELS`.
    """
    import onnx

    root = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
    return sorted(p for p in glob.glob(str(root / "light_*.onnx"))
                  if large or Path(p).name not in LARGE_LIGHT_MODELS)


def randomize_weights(model, seed: int = 0):
    """A copy of ``model`` whose float initializers and ConstantOfShape weights are random.

    The light models' weights are constants made by ConstantOfShape, which makes every
    channel alike and drives activations to ~1e9; random weights scaled by fan-in give a
    meaningful numeric comparison. The copy is ours; the original is not modified.
    """
    import onnx
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(seed)
    m = onnx.ModelProto()
    m.CopyFrom(model)

    variances = {n.input[4] for n in m.graph.node if n.op_type == "BatchNormalization"}

    def rand(shape, name):
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        if name in variances:
            return rng.uniform(0.5, 1.5, shape).astype(np.float32)
        return (rng.standard_normal(shape) / np.sqrt(max(fan_in, 1))).astype(np.float32)

    for init in m.graph.initializer:
        if init.data_type == onnx.TensorProto.FLOAT and len(init.dims) > 0:
            init.CopyFrom(numpy_helper.from_array(rand(tuple(init.dims), init.name), init.name))
    shapes = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    new_nodes = []
    for n in m.graph.node:
        if n.op_type == "ConstantOfShape" and n.input[0] in shapes:
            shape = tuple(int(d) for d in shapes[n.input[0]])
            val = rand(shape, n.output[0])
            new_nodes.append(helper.make_node("Constant", [], [n.output[0]],
                                              value=numpy_helper.from_array(val)))
        else:
            new_nodes.append(n)
    del m.graph.node[:]
    m.graph.node.extend(new_nodes)
    return m


#: Per-model optimization figures collected by the search tests, printed after the run.
MODEL_REPORTS: list[str] = []


def pytest_terminal_summary(terminalreporter):
    """Print each model's operators, estimated cost and search time before/after."""
    if MODEL_REPORTS:
        terminalreporter.section("model optimization (analytic cost model, CI budget)")
        for line in MODEL_REPORTS:
            terminalreporter.write_line(line)


def returns_soon(call, seconds: float = 20):
    """``call()``'s value; fails (rather than hang) when it blocks, e.g. opening a FIFO."""
    import threading

    box = []
    t = threading.Thread(target=lambda: box.append(call()), daemon=True)
    t.start()
    t.join(seconds)
    assert box, "blocked"
    return box[0]
