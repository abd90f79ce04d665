"""Shared test fixtures (where the models are, small helpers) and the test tiers.

The suite runs in tiers, as JAX's does:

* ``fast`` (the default): every test not marked ``slow``; property tests draw few examples.
  It touches every part of the project and takes a few minutes on two cores.
* ``slow``: only the tests marked ``slow`` (proofs, real models, subprocess runs, anything
  over about five seconds); property tests draw many examples. ``fast`` then ``slow`` runs
  each test once: that is what CI (``.ci/run``) does.
* ``full``: every test, property tests at full size.

The tier comes from ``--tier`` or, failing that, ``$TASO_JAX_TEST_TIER``. A test named on
the command line by its node id (``file.py::test_name``) runs whatever its tier.
"""

from __future__ import annotations

import contextlib
import glob
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings

HERE = Path(__file__).parent

try:  # keep onnxruntime's warnings about unused initializers out of the test log
    import onnxruntime

    onnxruntime.set_default_logger_severity(3)
except ImportError:  # pragma: no cover
    pass
DATA = HERE / "data"

#: The tiers ``--tier`` and ``$TASO_JAX_TEST_TIER`` choose from (the module docstring says
#: what each runs).
TIERS = ("fast", "slow", "full")
TIER_ENV = "TASO_JAX_TEST_TIER"

# The one knob for property-test sizes: tests give no max_examples of their own, so these
# profiles decide it. "full" is 50, not Hypothesis's 100: an example of
# test_property.py is a search and two compilations, about 2.5 s, and at 100 that test
# alone took 260 s of the slow tier. No deadline: on a loaded 2-core machine the time of
# an example is noise.
settings.register_profile("fast", max_examples=10, deadline=None)
settings.register_profile("full", max_examples=50, deadline=None)


def pytest_addoption(parser):
    parser.addoption(
        "--tier", choices=TIERS, default=None,
        help="which tests to run: fast (the default: those not marked slow), slow (only "
             f"those marked slow) or full (all); default ${TIER_ENV}, else fast")


def _tier(config) -> str:
    tier = config.getoption("--tier") or os.environ.get(TIER_ENV) or "fast"
    if tier not in TIERS:
        raise pytest.UsageError(f"${TIER_ENV}={tier!r}: not one of {', '.join(TIERS)}")
    return tier


def pytest_configure(config):
    # Before any test module is imported: a @settings(...) takes the values it does not
    # set from the profile loaded when it is created.
    if not config.getoption("hypothesis_profile", None):  # hypothesis's own flag wins
        settings.load_profile("fast" if _tier(config) == "fast" else "full")


def pytest_report_header(config):
    return (f"tier: {_tier(config)} (--tier or ${TIER_ENV}: fast, slow or full); "
            f"hypothesis profile: {settings.get_current_profile_name()}")


def pytest_collection_modifyitems(config, items):
    """Leave out the tests of the other tier (``slow`` tests in ``fast``, and the reverse)."""
    tier = _tier(config)
    if tier == "full" or any("::" in arg for arg in config.args):
        return  # all of them, or tests asked for by name
    want_slow = tier == "slow"
    keep, leave = [], []
    for item in items:
        (keep if (item.get_closest_marker("slow") is not None) == want_slow else leave
         ).append(item)
    if leave:
        config.hook.pytest_deselected(items=leave)
        items[:] = keep
        config._tier_left_out = True


def slow_cases(values, slow) -> list:
    """``values`` for ``pytest.mark.parametrize``, with those that are slow marked so.

    ``slow`` is a collection of values, or a predicate on a value. A value of several
    arguments (a tuple) becomes ``pytest.param(*value)``.
    """
    def is_slow(v):
        return slow(v) if callable(slow) else v in slow

    return [pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.slow)
            if is_slow(v) else v for v in values]


def pytest_sessionfinish(session, exitstatus):
    # Every test collected was of the other tier (``--tier=slow`` on a file of fast tests):
    # nothing was missed, so this is not pytest's "no tests collected" error (exit 5).
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and getattr(
            session.config, "_tier_left_out", False):
        session.exitstatus = pytest.ExitCode.OK


# Tests never read or fill the user's cache of optimized graphs: a decision stored by one
# test (some force the original to be kept) must not reach another. The cache's own tests
# point it at a temporary folder.
os.environ["TASO_JAX_GRAPH_CACHE"] = "off"
# The calibrated cost model fits the samples shipped with the package alone: kernels timed
# by earlier tests (or runs) on this machine would otherwise move its prices from one run
# of the suite to the next.
os.environ["TASO_JAX_LOCAL_SAMPLES"] = "off"


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


@contextlib.contextmanager
def unoptimized_xla_in_workers():
    """Within it, processes started (spawned) compile with XLA's backend optimizations off.

    For the numeric checks of laws (:func:`taso_jax.verify.laws.check_axioms`): each
    instance is a fresh compilation of a few tiny operators, run once, so nearly all their
    time is LLVM optimizing code that hardly runs. Unoptimized, the checks take a third to a
    half less time and compute the same float64 values, well inside their 1e-9 tolerance.
    This process is not affected (XLA reads its flags once, at start), nor is any test that
    times compiled code.
    """
    flag = "--xla_backend_optimization_level=0"
    before = os.environ.get("XLA_FLAGS")
    os.environ["XLA_FLAGS"] = f"{before} {flag}" if before else flag
    try:
        yield
    finally:
        if before is None:
            del os.environ["XLA_FLAGS"]
        else:
            os.environ["XLA_FLAGS"] = before


def returns_soon(call, seconds: float = 20):
    """``call()``'s value; fails (rather than hang) when it blocks, e.g. opening a FIFO."""
    import threading

    box = []
    t = threading.Thread(target=lambda: box.append(call()), daemon=True)
    t.start()
    t.join(seconds)
    assert box, "blocked"
    return box[0]


def search_jax(fn, args):
    """``fn`` traced at ``args``, searched under the analytic model (no end-to-end timing).

    Returns ``(imported graph, searched graph, run)``: ``run(*args)`` calls the searched
    graph compiled, unwrapping a single output.
    """
    import taso_jax

    g = taso_jax.from_jax(fn, *args)
    result = taso_jax.search_graph(g, cost_model="analytic", end_to_end=0, time_limit=60)
    compiled = taso_jax.compile_graph(result.graph)

    def run(*a):
        out = compiled(*a)
        return out[0] if isinstance(out, tuple | list) else out
    return g, result.graph, run
