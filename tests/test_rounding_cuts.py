"""Models that amplify rounding are checked where they do (issue 60, item 8).

A merged ``x @ a + x @ b`` (``factor-matmul-matmul-ewadd``) is right but rounds
differently; a ``TopK`` after it reorders near-equal values (an index off by thousands), a
``QuantizeLinear`` moves a value across one step, and a float16 model differs by a few
float16 units. Each was refused with exit 1 and nothing written; each is now written
(:mod:`taso_jax.rounding_cuts`, :data:`taso_jax.checks.TYPE_ULPS`). A wrong rule (``relu(a)
=> a``) is still caught, before or after the amplifier, and the input is written back.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from taso_jax.search.rules import PNode, Substitution, save_substitutions

from taso_jax.checks import compare_outputs, reference_runs
from taso_jax.cli import main
from taso_jax.frontends.onnx_io import load_onnx
from taso_jax.rounding_cuts import amplifier_counts, check_cuts

FAST = ["--cost-model", "analytic", "--budget", "5", "-q", "--no-time", "--end-to-end", "0"]


def _init(name, a):
    return numpy_helper.from_array(np.asarray(a), name)


def _merged_sum(x: str, out: str, n: int, dtype=np.float32, seed: int = 0):
    """Nodes and weights of ``out = x @ a + x @ b`` (x: [1, 32]), which the search merges."""
    rng = np.random.default_rng(seed)
    inits = [_init(f"{out}_a", rng.normal(0, 0.2, (32, n)).astype(dtype)),
             _init(f"{out}_b", rng.normal(0, 0.2, (32, n)).astype(dtype))]
    nodes = [helper.make_node("MatMul", [x, f"{out}_a"], [f"{out}_xa"]),
             helper.make_node("MatMul", [x, f"{out}_b"], [f"{out}_xb"]),
             helper.make_node("Add", [f"{out}_xa", f"{out}_xb"], [out])]
    return nodes, inits


def _model(nodes, inits, outputs, elem=TensorProto.FLOAT, batch=1):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", elem,
                                                                         [batch, 32])],
                              outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def _topk(n=16384, k=8000, relu=False, after=None, batch=1):
    """``TopK(x @ a + x @ b, k)``: near-equal values among k of n reorder under rounding.

    ``relu`` puts a ReLU before the TopK; ``after`` multiplies its values by that constant
    (the segment after the cut).
    """
    nodes, inits = _merged_sum("x", "y", n)
    src = "y"
    if relu:
        nodes.append(helper.make_node("Relu", ["y"], ["r"]))
        src = "r"
    inits.append(_init("k", np.array([k], np.int64)))
    nodes.append(helper.make_node("TopK", [src, "k"], ["values", "indices"]))
    values = "values"
    if after is not None:
        inits.append(_init("c", np.array(after, np.float32)))
        nodes.append(helper.make_node("Mul", ["values", "c"], ["scaled"]))
        values = "scaled"
    return _model(nodes, inits, [helper.make_tensor_value_info(values, TensorProto.FLOAT,
                                                               [batch, k]),
                                 helper.make_tensor_value_info("indices", TensorProto.INT64,
                                                               [batch, k])], batch=batch)


def _qdq(n=4096, step=0.02):
    """Q/DQ around a merged sum: the merge moves values of its sum across one step."""
    nodes, inits = _merged_sum("xd", "y", n)
    inits += [_init("s_in", np.array(0.05, np.float32)), _init("z_in", np.array(0, np.int8)),
              _init("s_out", np.array(step, np.float32)), _init("z_out", np.array(0, np.int8))]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s_in", "z_in"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "s_in", "z_in"], ["xd"]), *nodes,
             helper.make_node("QuantizeLinear", ["y", "s_out", "z_out"], ["yq"]),
             helper.make_node("DequantizeLinear", ["yq", "s_out", "z_out"], ["out"])]
    return _model(nodes, inits, [helper.make_tensor_value_info("out", TensorProto.FLOAT,
                                                               [1, n])])


def _float16(n=256):
    """A float16 merged sum: the summed weight is rounded to float16 once more."""
    nodes, inits = _merged_sum("x", "y", n, np.float16)
    return _model(nodes, inits, [helper.make_tensor_value_info("y", TensorProto.FLOAT16,
                                                               [1, n])], TensorProto.FLOAT16)


def _optimize(tmp_path, model, *extra):
    """``(exit code, report, input path, output path)`` of ``taso-jax optimize``."""
    src, out, js = tmp_path / "m.onnx", tmp_path / "m.opt.onnx", tmp_path / "m.json"
    onnx.save(model, src)
    code = main(["optimize", str(src), "-o", str(out), "--json", str(js), *FAST, *extra])
    return code, json.loads(js.read_text()), src, out


def _run(path, x):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})


@pytest.mark.parametrize("case", ["topk", "qdq", "float16"])
def test_rounding_amplified_by_the_model_is_not_a_fault(tmp_path, case):
    """Exit 1 at a5de9b5 (max abs error 1e4, 0.02, 0.00195); now the rewrite is written."""
    model = {"topk": _topk, "qdq": _qdq, "float16": _float16}[case]()
    code, report, src, out = _optimize(tmp_path, model)
    assert code == 0 and report["outcome"]["verdict"] == "rewritten", report["outcome"]
    assert "factor-matmul-matmul-ewadd" in report["applied"]
    check = report["check"]
    assert check["ok"]
    if case == "float16":
        assert check["type_rtol"] == pytest.approx(8 * 2.0 ** -10)
        assert "rounding_cuts" not in check
    else:  # the outputs differ beyond the tolerance; the amplifiers' inputs do not
        assert check["outputs_max_abs_err"] > 1e-2
        cuts = check["rounding_cuts"]
        assert cuts["ok"] and cuts["max_abs_err"] < 1e-3
        assert cuts["amplifiers"] == ({"TopK": 1} if case == "topk" else {"QuantizeLinear": 2})
    x = np.random.default_rng(5).standard_normal((1, 32)).astype(
        np.float16 if case == "float16" else np.float32)
    for want, got in zip(_run(src, x), _run(out, x), strict=True):
        if want.dtype.kind == "f":
            np.testing.assert_allclose(got, want, rtol=0.01, atol=0.021)


def _drop_relu_rule(path):
    """The deliberately wrong ``relu(a) => a`` on a rank-2 tensor."""
    bad = Substitution("wrong_drop_relu", (("a", ("N", "C")),), (PNode("relu", (), ("a",)),),
                       (), (("#0", "a"),), {"method": "hand-written, deliberately wrong"})
    save_substitutions([bad], path)
    return ["--substitutions", str(path), "--allow-unverified"]


def test_a_wrong_rule_before_the_topk_is_caught(tmp_path, monkeypatch, capsys):
    """A dropped ReLU shows at the TopK's input: the input is written back, exit 0."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the proof cache
    # k = 12000 of 16384: the top k hold negative values, which the ReLU makes 0
    code, report, src, out = _optimize(tmp_path, _topk(k=12000, relu=True),
                                       *_drop_relu_rule(tmp_path / "bad.json"))
    assert code == 0
    assert report["outcome"]["verdict"] == "fallback"
    found = report["found_not_delivered"]
    assert "wrong_drop_relu" in found["applied"]
    check = found["check"]
    assert not check["ok"] and not check["rounding_cuts"]["ok"]
    assert check["rounding_cuts"]["max_abs_err"] > 0.1
    assert out.read_bytes() == src.read_bytes()
    assert any("written back unchanged" in n for n in report["notes"])
    text, err = capsys.readouterr()
    assert "warning" in err and "wrong_drop_relu" in err
    assert "its output check" in text and "MISMATCH" in text


def _reference(model, graph):
    data = model.SerializeToString()
    return data, reference_runs(data, graph)


def test_a_wrong_value_after_the_topk_is_caught(tmp_path):
    """The segment after the cut is compared too: values times -2 where the original has 2."""
    onnx.save(_topk(after=2.0), tmp_path / "a.onnx")
    graph = load_onnx(str(tmp_path / "a.onnx"))
    data, runs = _reference(_topk(after=2.0), graph)
    same = check_cuts(data, _topk(after=2.0).SerializeToString(), runs)
    assert same["ok"] and same["max_abs_err"] == 0.0
    wrong = check_cuts(data, _topk(after=-2.0).SerializeToString(), runs)
    assert not wrong["ok"] and wrong["max_abs_err"] > 1.0


def test_amplifiers_that_do_not_pair_are_not_cut(tmp_path):
    """Another k, or no TopK at all: no comparison at the cuts (the failed check stands)."""
    onnx.save(_topk(), tmp_path / "a.onnx")
    graph = load_onnx(str(tmp_path / "a.onnx"))
    data, runs = _reference(_topk(), graph)
    assert check_cuts(data, _topk(k=7999).SerializeToString(), runs) is None
    assert amplifier_counts(data) == {"TopK": 1}
    assert not amplifier_counts(_float16().SerializeToString())


def test_float16_outputs_are_compared_at_float16_rounding():
    """Two float16 units pass, a dropped ReLU does not; float32 is compared as before."""
    rng = np.random.default_rng(0)
    b = rng.standard_normal(1000).astype(np.float16)
    two_units = b + np.float16(2 * 2.0 ** -10) * np.sign(b)
    assert not compare_outputs([two_units.astype(np.float32)], [b.astype(np.float32)])["ok"]
    assert compare_outputs([two_units], [b])["ok"]
    assert not compare_outputs([np.maximum(b, 0)], [b])["ok"]
    assert compare_outputs([two_units.astype(np.float32)], [b.astype(np.float32)],
                           unit=2.0 ** -10)["ok"]
    f32 = b.astype(np.float32)
    assert "type_rtol" not in compare_outputs([f32], [f32])


def test_a_cut_that_does_not_run_decides_nothing(tmp_path):
    """An optimized model onnxruntime refuses: no verdict from the cuts (``None``)."""
    onnx.save(_topk(), tmp_path / "a.onnx")
    graph = load_onnx(str(tmp_path / "a.onnx"))
    data, runs = _reference(_topk(), graph)
    broken = _topk()
    broken.graph.node[0].op_type = "NoSuchOp"
    assert check_cuts(data, broken.SerializeToString(), runs) is None
    assert check_cuts(data, b"not a model", runs) is None


def test_a_topk_model_with_open_sizes_keeps_them(tmp_path):
    """The check at other sizes compares at the TopK too: the batch stays open."""
    code, report, src, out = _optimize(tmp_path, _topk(k=8000, batch="N"))
    assert code == 0 and report["outcome"]["verdict"] == "rewritten", report["outcome"]
    other = report["other_sizes"]
    assert other["ok"] and other["rounding_cuts"]["amplifiers"] == {"TopK": 1}
    dims = onnx.load(str(out)).graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == "N"
