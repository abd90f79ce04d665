"""Valid ONNX models that once failed (issue 47): each loads, optimizes and runs the same.

Every model is built with ``onnx.helper``; each CLI run is a short analytic search. A pair of
MatMuls that share their input is added where the optimized model must differ from the input
(``ewadd(matmul(x, a), matmul(x, b)) => matmul(x, ewadd(a, b))``), so that the export and the
onnxruntime check run rather than the input being copied back.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import taso_jax
from taso_jax.cli import main

FAST = ["--cost-model", "analytic", "--budget", "5", "-q", "--no-time", "--end-to-end", "0"]


def _info(name, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def _merging_pair(x: str, out: str, width: int = 4, seed: int = 0):
    """Nodes and initializers of ``out = x @ a + x @ b``, which the search merges."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(rng.standard_normal((width, width)).astype(np.float32), n)
             for n in (f"{out}_a", f"{out}_b")]
    nodes = [helper.make_node("MatMul", [x, f"{out}_a"], [f"{out}_xa"]),
             helper.make_node("MatMul", [x, f"{out}_b"], [f"{out}_xb"]),
             helper.make_node("Add", [f"{out}_xa", f"{out}_xb"], [out])]
    return nodes, inits


def _model(nodes, inputs, outputs, inits=(), **kwargs):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    kwargs.setdefault("opset_imports", [helper.make_opsetid("", 17)])
    return helper.make_model(graph, ir_version=8, **kwargs)


def _run(model_or_path, feeds):
    data = model_or_path.SerializeToString() if isinstance(model_or_path, onnx.ModelProto) \
        else str(model_or_path)
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feeds)


def _optimize(tmp_path, model, *extra):
    """Save ``model``, run ``taso-jax optimize`` on it; ``(exit code, input path, output)``."""
    src, out = tmp_path / "m.onnx", tmp_path / "m.opt.onnx"
    onnx.save(model, src)
    return main(["optimize", str(src), "-o", str(out), *FAST, *extra]), src, out


def _assert_same_outputs(src, out, feeds):
    for want, got in zip(_run(src, feeds), _run(out, feeds), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


# ---- 1. a deep chain of constant operators ------------------------------------------------

def _constant_chain(depth: int):
    """``y = clip(x + c, min=c) @ a + ... @ b`` where ``c`` is 0.5 added to 0 ``depth`` times."""
    nodes = [helper.make_node("Constant", [], ["c0"],
                              value=numpy_helper.from_array(np.zeros((), np.float32), "v"))]
    nodes += [helper.make_node("Add", [f"c{i}", "k"], [f"c{i + 1}"]) for i in range(depth)]
    nodes += [helper.make_node("Add", ["x", f"c{depth}"], ["s"]),
              helper.make_node("Clip", ["s", f"c{depth}"], ["h"])]
    pair, inits = _merging_pair("h", "y")
    inits.append(numpy_helper.from_array(np.full((), 0.5 / depth, np.float32), "k"))
    return _model(nodes + pair, [_info("x", [2, 4])], [_info("y", [2, 4])], inits)


def test_a_chain_of_3000_constant_operators_imports_exports_and_runs():
    """Clip's bound is read at import as a value: the 3,000 constant Adds it is computed from
    were folded by recursion, one Python frame per operator, and the import died of a
    RecursionError. (The API, not the CLI: a search over 3,000 weight-only nodes is slow.)"""
    model = _constant_chain(3000)
    graph = taso_jax.load_onnx(model)
    assert graph.op_counts()["clip"] == 1  # imported, its bound read as a constant
    exported = taso_jax.export_onnx(graph)
    assert len(exported.graph.node) < 10  # the chain folded into one initializer
    x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    for want, got in zip(_run(model, {"x": x}), _run(exported, {"x": x}), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ---- 2. a model-local function ----------------------------------------------------------

def _local_function_model():
    """``y = add_relu(x @ a + x @ b, x)``, ``add_relu`` a function of the model's own."""
    body = [helper.make_node("Add", ["p", "q"], ["s"]), helper.make_node("Relu", ["s"], ["r"])]
    add_relu = helper.make_function("custom", "AddRelu", ["p", "q"], ["r"], body,
                                    [helper.make_opsetid("", 17)])
    pair, inits = _merging_pair("x", "h")
    nodes = [*pair, helper.make_node("AddRelu", ["h", "x"], ["y"], domain="custom")]
    return _model(nodes, [_info("x", [2, 4])], [_info("y", [2, 4])], inits,
                  opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("custom", 1)],
                  functions=[add_relu])


def test_a_call_of_a_model_local_function_is_inlined_and_optimizes(tmp_path, capsys):
    """The call was kept opaque: its region's session lacked the function's definition
    (JaxRuntimeError where it ran under jax.jit; the check found the written model did not
    run). Inlined, its Add and Relu import like any other node."""
    model = _local_function_model()
    graph = taso_jax.load_onnx(model)
    assert not graph.meta["opaque"] and graph.op_counts()["relu"] == 1
    assert len(model.functions) == 1 and model.graph.node[-1].op_type == "AddRelu"  # unchanged
    code, src, out = _optimize(tmp_path, model)
    text = capsys.readouterr().out
    assert code == 0 and "written: " in text and "factor-matmul-matmul-ewadd" in text, text
    x = np.random.default_rng(2).standard_normal((2, 4)).astype(np.float32)
    _assert_same_outputs(src, out, {"x": x})


# ---- 3. sparse initializers ----------------------------------------------------------------

def _sparse(name: str, dense: np.ndarray, coordinates: bool):
    """``dense`` as a ``SparseTensorProto``: its nonzeros at flat positions or coordinates."""
    where = np.argwhere(dense) if coordinates else np.flatnonzero(dense)
    values = numpy_helper.from_array(dense[dense != 0], name)
    return helper.make_sparse_tensor(values, numpy_helper.from_array(where.astype(np.int64)),
                                     list(dense.shape))


def test_sparse_initializers_import_as_the_dense_weights_they_stand_for(tmp_path, capsys):
    """A sparse initializer was missing from the weights (KeyError). Both index forms of the
    spec (flat positions, [NNZ, rank] coordinates) become dense weights, here the two
    matrices that the search merges."""
    pair, inits = _merging_pair("x", "y")
    model = _model(pair, [_info("x", [2, 4])], [_info("y", [2, 4])])
    for init, coordinates in zip(inits, (False, True), strict=True):
        dense = numpy_helper.to_array(init) * np.tri(4, dtype=np.float32)  # zeros above
        model.graph.sparse_initializer.append(_sparse(init.name, dense, coordinates))
    onnx.checker.check_model(model)
    graph = taso_jax.load_onnx(model)
    assert np.count_nonzero(graph.weights["y_a"]) == 10 and graph.weights["y_b"][0, 3] == 0
    np.testing.assert_array_equal(np.triu(graph.weights["y_b"], 1), 0)
    assert len(model.graph.sparse_initializer) == 2 and not model.graph.initializer  # unchanged
    code, src, out = _optimize(tmp_path, model)
    text = capsys.readouterr().out
    assert code == 0 and "written: " in text and "factor-matmul-matmul-ewadd" in text, text
    x = np.random.default_rng(3).standard_normal((2, 4)).astype(np.float32)
    _assert_same_outputs(src, out, {"x": x})


# ---- 4. static sizes of 0 ----------------------------------------------------------------

def test_a_static_size_of_0_is_a_size_not_a_symbol(tmp_path, capsys):
    """``dim_value: 0`` was read as open (like -1) and bound to 1, where the model (and
    onnxruntime) takes 0 only: the model was refused. Here x is [0, 4], joined to an empty
    constant, and the matmuls that read it merge."""
    empty = numpy_helper.from_array(np.zeros((0, 4), np.float32), "e")
    pair, inits = _merging_pair("h", "y")
    nodes = [helper.make_node("Constant", [], ["e"], value=empty),
             helper.make_node("Concat", ["x", "e"], ["h"], axis=0), *pair]
    model = _model(nodes, [_info("x", [0, 4])], [_info("y", [0, 4])], inits)
    assert model.graph.input[0].type.tensor_type.shape.dim[0].HasField("dim_value")
    graph = taso_jax.load_onnx(model)
    assert graph.inputs[0].types[0].shape == (0, 4) and graph.outputs[0].shape == (0, 4)
    assert not graph.meta["symbolic_dims"] and not graph.meta["shape_notes"]
    code, src, out = _optimize(tmp_path, model)  # no --input-shape
    text = capsys.readouterr().out
    assert code == 0 and "written: " in text and "factor-matmul-matmul-ewadd" in text, text
    (got,) = _run(out, {"x": np.zeros((0, 4), np.float32)})
    assert got.shape == (0, 4)
    _assert_same_outputs(src, out, {"x": np.zeros((0, 4), np.float32)})
    written = onnx.load(out).graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_value for d in written] == [0, 4] and written[0].HasField("dim_value")


# ---- 5. models over protobuf's 2 GB limit -------------------------------------------------
# The limit is lowered to 10 kB: the 16 kB weights below stand for gigabytes.

def _with_limit(monkeypatch, limit: int = 10_000):
    from taso_jax.frontends import onnx_export

    monkeypatch.setattr(onnx_export, "PROTOBUF_LIMIT_BYTES", limit)


def _assert_written_with_external_data(out, src, x):
    data = out.parent / (out.name + ".data")
    assert data.stat().st_size >= 16 * 1024 and out.stat().st_size < 10_000
    assert data.stat().st_mode & 0o777 == out.stat().st_mode & 0o777  # as readable as it
    locations = {e.value for t in onnx.load(out, load_external_data=False).graph.initializer
                 for e in t.external_data if e.key == "location"}
    assert locations == {data.name}  # relative: the two files move together
    onnx.checker.check_model(str(out), full_check=True)
    _assert_same_outputs(src, out, {"x": x})
    assert not list(out.parent.glob(".taso_jax.*"))  # no temporary file or folder left


def test_a_rewritten_model_over_the_protobuf_limit_is_written_with_external_data(
        tmp_path, monkeypatch, capsys):
    """Serializing the optimized model raised EncodeError ("Failed to serialize proto") and
    nothing was written. Its tensors now go to ``<output>.data``, and the check runs on it."""
    _with_limit(monkeypatch)
    pair, inits = _merging_pair("x", "y", width=64)
    code, src, out = _optimize(tmp_path, _model(pair, [_info("x", [2, 64])],
                                                [_info("y", [2, 64])], inits))
    text = capsys.readouterr().out
    assert code == 0 and "factor-matmul-matmul-ewadd" in text, text
    assert f"its tensors in {out}.data (over protobuf's 2 GB limit)" in text
    x = np.random.default_rng(5).standard_normal((2, 64)).astype(np.float32)
    _assert_written_with_external_data(out, src, x)


def _external_input(tmp_path, data_name: str = "weights.bin"):
    """A model with nothing to merge, its 16 kB weight in an external data file."""
    rng = np.random.default_rng(6)
    w = numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "w")
    model = _model([helper.make_node("MatMul", ["x", "w"], ["y"])], [_info("x", [2, 64])],
                   [_info("y", [2, 64])], [w])
    src = tmp_path / "in" / "m.onnx"
    src.parent.mkdir()
    onnx.save(model, src, save_as_external_data=True, location=data_name, size_threshold=0)
    return src


def test_an_input_over_the_protobuf_limit_kept_as_it_is_is_written_with_external_data(
        tmp_path, monkeypatch, capsys):
    """Nothing to merge: the input, its external data inlined, was written with onnx.save
    (EncodeError over 2 GB). It is written with its tensors gathered into one file beside
    it, and the input's own data file is left as it was."""
    _with_limit(monkeypatch)
    src = _external_input(tmp_path)
    before = (src.parent / "weights.bin").read_bytes()
    out = tmp_path / "m.opt.onnx"
    assert main(["optimize", str(src), "-o", str(out), *FAST]) == 0
    text = capsys.readouterr().out
    assert "the input, its external data gathered into one file" in text, text
    x = np.random.default_rng(7).standard_normal((2, 64)).astype(np.float32)
    _assert_written_with_external_data(out, src, x)
    assert (src.parent / "weights.bin").read_bytes() == before


def test_a_data_file_that_would_replace_the_inputs_own_is_refused(tmp_path, monkeypatch,
                                                                 capsys):
    _with_limit(monkeypatch)
    src = _external_input(tmp_path, data_name="o.onnx.data")
    before = (src.parent / "o.onnx.data").read_bytes()
    out = src.parent / "o.onnx"
    assert main(["optimize", str(src), "-o", str(out), *FAST]) == 2
    err = capsys.readouterr().err
    assert "would replace a file of the input model" in err and len(err.splitlines()) == 1
    assert not out.exists() and (src.parent / "o.onnx.data").read_bytes() == before


def test_a_data_file_that_is_a_hard_link_to_the_inputs_own_is_refused(tmp_path):
    # a hard link is the input's data file under another path: compared by resolved path
    # alone, the write went ahead (onnx itself refuses to load a model whose data file
    # has several links, so the command line stops earlier; write_onnx must not rely on it)
    from taso_jax.frontends.onnx_export import write_onnx
    from taso_jax.frontends.onnx_io import ModelError

    src = _external_input(tmp_path)
    weights = src.parent / "weights.bin"
    out = tmp_path / "out" / "o.onnx"
    out.parent.mkdir()
    os.link(weights, out.parent / "o.onnx.data")
    before = weights.read_bytes()
    with pytest.raises(ModelError, match="would replace a file of the input model"):
        write_onnx(str(out), str(src), keep={str(src), str(weights)})
    assert not out.exists() and weights.read_bytes() == before
    assert os.path.samefile(weights, out.parent / "o.onnx.data")
