"""Cases of the third adversarial pass (issue 60; benchmarks/results/adversarial_2026-11-29.md).

Tried as a careless or hostile user would: odd ONNX files made with ``onnx.helper``, odd
paths and flags, folds that could overflow, misuses of the decorator. Each case states what
the user must get: bad input is one line and exit 2 with nothing written and no input
changed; a valid model is exit 0 with outputs that agree with the input's, non-finite
values included; the decorator answers as ``jax.jit`` of the function does.
"""

from __future__ import annotations

import hashlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import pytest
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper as nh

import taso_jax
from taso_jax.cli import main

QUICK = ["--cost-model", "analytic", "--budget", "5", "--time-limit", "10", "-q"]


def _model(nodes, inputs, outputs, inits=(), opset=17, ir_version=None):
    g = oh.make_graph(nodes, "g", inputs, outputs, list(inits))
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", opset)])
    if ir_version is not None:
        m.ir_version = ir_version
    return m


def _vi(name, elem, shape):
    return oh.make_tensor_value_info(name, elem, shape)


def _two_matmuls(n=16, dtype=np.float32, elem=TensorProto.FLOAT, scale=1.0):
    """``x @ w1 + x @ w2``: the shipped rules merge it into one matmul."""
    rng = np.random.default_rng(0)
    w1, w2 = ((rng.standard_normal((n, n)) * scale).astype(dtype) for _ in range(2))
    nodes = [oh.make_node("MatMul", ["x", "w1"], ["a"]),
             oh.make_node("MatMul", ["x", "w2"], ["b"]), oh.make_node("Add", ["a", "b"], ["y"])]
    return _model(nodes, [_vi("x", elem, [4, n])], [_vi("y", elem, [4, n])],
                  [nh.from_array(w1, "w1"), nh.from_array(w2, "w2")])


def _relu(x="x", y="y"):
    return oh.make_node("Relu", [x], [y])


def _digests(folder) -> dict:
    return {p: hashlib.sha256(open(p, "rb").read()).hexdigest()
            for p in map(str, folder.rglob("*")) if os.path.isfile(p)}


def _refused(capsys, argv, expected: str) -> None:
    """``argv`` exits 2 with one line, naming ``expected``; no traceback."""
    assert main(argv) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("taso-jax"), err
    assert expected in err[0], err[0]
    assert "deleted or moved during the run" not in err[0]


# -- paths that name no file: each was misreported or silently accepted before the fix --

def _broken_link(tmp_path):
    os.symlink("nowhere.onnx", tmp_path / "a.onnx")
    return str(tmp_path / "a.onnx")


@pytest.mark.parametrize("case", ["empty_model", "missing_model", "broken_link", "empty_o",
                                  "empty_json", "verify_empty_file", "verify_empty_o"])
def test_a_path_that_names_no_file_is_refused_as_such(tmp_path, capsys, monkeypatch, case):
    """A typo, an unset variable (``-o "$OUT"``) or a dangling link is named as what it is.

    Before: a missing model was blamed on the run ("the input model was deleted or moved
    during the run"), and ``-o ''`` ran the whole optimization, reported "rewritten" with
    exit 0, and wrote nothing.
    """
    monkeypatch.chdir(tmp_path)
    onnx.save(_two_matmuls(), tmp_path / "m.onnx")
    rules = tmp_path / "rules.json"
    rules.write_text("{}")
    argv, expected = {
        "empty_model": (["optimize", ""], "model '' does not exist"),
        "missing_model": (["optimize", "nope.onnx"], "model 'nope.onnx' does not exist"),
        "broken_link": (["optimize", _broken_link(tmp_path)], "which does not exist"),
        "empty_o": (["optimize", "m.onnx", "-o", ""], "-o '': the path is empty"),
        "empty_json": (["optimize", "m.onnx", "--json", ""], "--json '': the path is empty"),
        "verify_empty_file": (["verify", ""], "rule file '' does not exist"),
        "verify_empty_o": (["verify", str(rules), "-o", ""], "-o '': the path is empty"),
    }[case]
    before = _digests(tmp_path)
    _refused(capsys, [*argv, *QUICK] if argv[0] == "optimize" else argv, expected)
    assert _digests(tmp_path) == before  # nothing written, nothing changed


# -- odd ONNX files: refused in one line before any work (found nothing; kept as guards) --

def _external_missing(tmp_path):
    m = _two_matmuls(n=64)
    onnx.save(m, tmp_path / "m.onnx", save_as_external_data=True,
              all_tensors_to_one_file=True, location="m.onnx.data", size_threshold=0)
    os.remove(tmp_path / "m.onnx.data")


ODD_FILES = {
    "empty_graph": (lambda p: onnx.save(_model([], [], []), p), "no graph"),
    "no_outputs": (lambda p: onnx.save(_model([_relu()], [_vi("x", 1, [4])], []), p),
                   "no outputs"),
    "one_name_two_writers": (lambda p: onnx.save(_model(
        [_relu(), oh.make_node("Sigmoid", ["x"], ["y"])], [_vi("x", 1, [4])],
        [_vi("y", 1, [4])]), p), "single static assignment"),
    "input_declared_twice": (lambda p: onnx.save(_model(
        [oh.make_node("Add", ["x", "x"], ["y"])], [_vi("x", 1, [4]), _vi("x", 1, [4])],
        [_vi("y", 1, [4])]), p), "single static assignment"),
    "initializer_named_as_output": (lambda p: onnx.save(_model(
        [_relu()], [_vi("x", 1, [4])], [_vi("y", 1, [4])],
        [nh.from_array(np.ones(4, np.float32), "y")]), p), "single static assignment"),
    "ir_version_99": (lambda p: onnx.save(_model(
        [_relu()], [_vi("x", 1, [4])], [_vi("y", 1, [4])], ir_version=99), p), "ir_version 99"),
    "untyped_input": (lambda p: onnx.save(_model(
        [_relu()], [oh.make_tensor_value_info("x", 1, None)],
        [oh.make_tensor_value_info("y", 1, None)]), p), "invalid ONNX model"),
    "custom_domain_operator": (lambda p: onnx.save(oh.make_model(oh.make_graph(
        [oh.make_node("Foo", ["x"], ["y"], domain="com.example")], "g", [_vi("x", 1, [4])],
        [_vi("y", 1, [4])]), opset_imports=[oh.make_opsetid("", 17),
                                           oh.make_opsetid("com.example", 1)]), p),
        "does not run in onnxruntime"),
}


@pytest.mark.parametrize("case", sorted(ODD_FILES))
def test_odd_onnx_files_are_refused_in_one_line(tmp_path, capsys, case):
    make, expected = ODD_FILES[case]
    make(tmp_path / "m.onnx")
    before = _digests(tmp_path)
    _refused(capsys, ["optimize", str(tmp_path / "m.onnx"), *QUICK], expected)
    assert _digests(tmp_path) == before


def test_a_missing_external_data_file_is_named(tmp_path, capsys):
    _external_missing(tmp_path)
    _refused(capsys, ["optimize", str(tmp_path / "m.onnx"), *QUICK], "m.onnx.data")


@pytest.mark.parametrize("flags, expected", [
    (["--input-shape", "x="], "expected NAME=D1,D2"),
    (["--input-shape", "x=4,,16"], "expected NAME=D1,D2"),
    (["--input-shape", "=4,16"], "expected NAME=D1,D2"),
    (["--input-shape", "x=5,16"], "static size 4"),
    (["--alpha", "nan"], "--alpha must be a finite number"),
    (["--alpha", "inf"], "--alpha must be a finite number"),
    (["--end-to-end", "-1"], "--end-to-end must be >= 0"),
    (["--atol", "1.0000001"], "at most 1.0"),
    (["--json", "/dev/null"], "is not a regular file"),
])
def test_odd_flags_are_refused_in_one_line(tmp_path, capsys, flags, expected):
    onnx.save(_two_matmuls(), tmp_path / "m.onnx")
    before = _digests(tmp_path)
    _refused(capsys, ["optimize", str(tmp_path / "m.onnx"), *QUICK, *flags], expected)
    assert _digests(tmp_path) == before


def test_a_symbolic_link_loop_is_refused(tmp_path, capsys):
    os.symlink("b.onnx", tmp_path / "a.onnx")
    os.symlink("a.onnx", tmp_path / "b.onnx")
    _refused(capsys, ["optimize", str(tmp_path / "a.onnx"), *QUICK], "symbolic links")


# -- folds that could overflow or wrap: the written model agrees with the input --

def _chain(elem, dtype, c):
    """``relu((x * c) * c)``: folding ``c * c`` ahead of time may overflow the type."""
    nodes = [oh.make_node("Mul", ["x", "c1"], ["a"]), oh.make_node("Mul", ["a", "c2"], ["b"]),
             _relu("b", "y")]
    return _model(nodes, [_vi("x", elem, [4, 16])], [_vi("y", elem, [4, 16])],
                  [nh.from_array(np.array(c, dtype), "c1"),
                   nh.from_array(np.array(c, dtype), "c2")])


def _matmul_chain():
    """``(x @ A) @ B`` with ``A @ B`` = 1.6e41, past float32 (the original is finite at
    inputs below 1e-3)."""
    a = np.full((16, 16), 1e20, np.float32)
    nodes = [oh.make_node("MatMul", ["x", "A"], ["t"]), oh.make_node("MatMul", ["t", "B"], ["y"])]
    return _model(nodes, [_vi("x", 1, [4, 16])], [_vi("y", 1, [4, 16])],
                  [nh.from_array(a, "A"), nh.from_array(a.copy(), "B")])


FOLDS = {
    "float32_scalar_chain_1e30": lambda: _chain(TensorProto.FLOAT, np.float32, 1e30),
    "float16_scalar_chain_300": lambda: _chain(TensorProto.FLOAT16, np.float16, 300),
    "int8_scalar_chain_wraps": lambda: _chain(TensorProto.INT8, np.int8, 16),
    "float32_matmul_chain_1e20": _matmul_chain,
    "int32_merged_weights_wrap": lambda: _two_matmuls(dtype=np.int32, elem=TensorProto.INT32,
                                                      scale=2 ** 29),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(FOLDS))
def test_folds_that_could_overflow_give_the_inputs_outputs(tmp_path, capsys, case):
    import onnxruntime as ort

    src, out = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(FOLDS[case](), src)
    before = _digests(tmp_path)
    assert main(["optimize", str(src), "-o", str(out), "--time-limit", "15", "-q"]) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert {k: v for k, v in _digests(tmp_path).items() if k != str(out)} == before
    a, b = (ort.InferenceSession(str(p), providers=["CPUExecutionProvider"])
            for p in (src, out))
    inp = a.get_inputs()[0]
    dtype = {"tensor(float)": np.float32, "tensor(float16)": np.float16,
             "tensor(int8)": np.int8, "tensor(int32)": np.int32}[inp.type]
    rng = np.random.default_rng(0)
    for scale in (1.0, 1e-3, 1e-20):
        x = (rng.standard_normal((4, 16)) * scale).astype(dtype) \
            if dtype in (np.float32, np.float16) else rng.integers(0, 8, (4, 16)).astype(dtype)
        (ra,), (rb,) = a.run(None, {inp.name: x}), b.run(None, {inp.name: x})
        np.testing.assert_array_equal(np.isfinite(ra), np.isfinite(rb))
        np.testing.assert_allclose(np.where(np.isfinite(ra), rb, 0).astype(np.float64),
                                   np.where(np.isfinite(ra), ra, 0).astype(np.float64),
                                   rtol=1e-2, atol=1e-30)


# -- the decorator misused: it answers as jax.jit of the function does --

OPTS = {"cost_model": "analytic", "budget": 5, "end_to_end": 0, "time_limit": 10.0}


@pytest.mark.parametrize("returned", [None, 3, "s"])
def test_a_function_returning_a_non_array_behaves_as_under_jax_jit(returned):
    def f(x):
        return returned

    try:
        expected = repr(jax.jit(f)(jnp.ones(3)))
    except TypeError:
        expected = TypeError
    g = taso_jax.optimize(f, **OPTS)
    if expected is TypeError:
        with pytest.raises(TypeError):
            g(jnp.ones(3))
    else:
        assert repr(g(jnp.ones(3))) == expected


def test_an_error_raised_for_one_static_value_is_raised_each_time():
    w = jnp.ones((8, 8))

    def f(x, mode):
        if mode == "bad":
            raise ValueError("bad mode")
        return x @ w + x @ (2 * w)

    g = taso_jax.optimize(f, static_argnums=1, **OPTS)
    x = jnp.ones((2, 8))
    for _ in range(2):  # not cached as a signature that runs
        with pytest.raises(ValueError, match="bad mode"):
            g(x, "bad")
    np.testing.assert_allclose(g(x, "good"), f(x, "good"), rtol=1e-5)


def test_weak_typed_and_strong_typed_scalars_are_separate_signatures():
    w = jnp.asarray(np.random.default_rng(0).standard_normal((8, 8)), jnp.float32)

    def f(x, s):
        return jnp.tanh(x @ w + x @ w.T) * s

    g = taso_jax.optimize(f, **OPTS)
    x = jnp.ones((2, 8))
    for s in (2.0, jnp.float32(3.0), 4):
        got, want = g(x, s), jax.jit(f)(x, s)
        assert got.dtype == want.dtype and got.weak_type == want.weak_type
        np.testing.assert_allclose(got, want, rtol=1e-5)
    assert len(g._cache) == 3


def test_an_output_repeated_and_a_donated_input_returned_as_is():
    w = jnp.asarray(np.random.default_rng(1).standard_normal((8, 8)), jnp.float32)

    def f(x, v):
        y = x @ v + x @ w
        return {"a": y, "b": y, "x": x}

    g = taso_jax.optimize(f, donate_argnums=0, **OPTS)
    want = f(jnp.ones((2, 8)), w)
    for _ in range(2):
        got = g(jnp.ones((2, 8)), w)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5)


def _one_rule_file(path) -> None:
    """A rule file of the shipped set's first rule."""
    import json
    from importlib.resources import files

    data = json.loads(files("taso_jax").joinpath("data/substitutions.json").read_text())
    key = next(k for k, v in data.items() if isinstance(v, list))
    data[key] = data[key][:1]
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("what", ["random_bytes", "an_onnx_model"])
def test_a_binary_checkpoint_is_refused_before_it_is_appended_to(tmp_path, capsys, what):
    """``verify --checkpoint`` appends to its file: a binary file named by mistake would be
    damaged. Before: "internal error: UnicodeDecodeError", exit 1."""
    rules, cp = tmp_path / "rules.json", tmp_path / "cp.jsonl"
    _one_rule_file(rules)
    if what == "random_bytes":
        cp.write_bytes(bytes(range(128, 256)) * 20)
    else:
        onnx.save(_two_matmuls(), cp)
    before = _digests(tmp_path)
    _refused(capsys, ["verify", str(rules), "--checkpoint", str(cp)], "not a checkpoint file")
    assert _digests(tmp_path) == before
