"""Open sizes in the IR (issue 46, item 1): sizes that follow from a model's ``dim_param``s are
carried as expressions (:mod:`taso_jax.ops.dims`) from ONNX import through substitutions to the
export, which computes them from the inputs' shapes at run time.

Equivalence is checked in onnxruntime (the independent executor) against the original model
at the bound sizes and at other bindings of the open sizes.
"""

from __future__ import annotations

import pickle

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto
from onnx import helper as h
from onnx import numpy_helper as nh
from taso_jax.ops.dims import Dim, is_open, same_size, same_value, symbol
from taso_jax.search.match import rewrites, unify_shape
from taso_jax.search.rules import load_substitutions

from taso_jax.frontends.onnx_export import export_onnx
from taso_jax.frontends.onnx_io import load_onnx, symbolic_dims, with_symbolic_dims

D = 16


def _const(name, arr):
    return nh.from_array(np.asarray(arr), name)


def _flatten_model() -> onnx.ModelProto:
    """x [N, T, D] -> reshape to [N*T, D] (target computed from Shape, as torch writes it) ->
    two MatMuls -> reshape back to [N, T, D] -> add -> slice [:, 1:] -> tanh."""
    rng = np.random.default_rng(0)
    inits = [_const("W1", rng.standard_normal((D, D)).astype(np.float32)),
             _const("W2", rng.standard_normal((D, D)).astype(np.float32)),
             _const("zero", np.array([0], np.int64)), _const("one", np.array([1], np.int64)),
             _const("Dc", np.array([D], np.int64)), _const("big", np.array([2**62], np.int64))]
    nodes = [
        h.make_node("Shape", ["x"], ["sh"]),
        h.make_node("Gather", ["sh", "zero"], ["n"], axis=0),
        h.make_node("Gather", ["sh", "one"], ["t"], axis=0),
        h.make_node("Mul", ["n", "t"], ["nt"]),
        h.make_node("Concat", ["nt", "Dc"], ["flat"], axis=0),
        h.make_node("Reshape", ["x", "flat"], ["xf"]),
        h.make_node("MatMul", ["xf", "W1"], ["a"]),
        h.make_node("MatMul", ["xf", "W2"], ["b"]),
        h.make_node("Concat", ["n", "t", "Dc"], ["back"], axis=0),
        h.make_node("Reshape", ["a", "back"], ["a3"]),
        h.make_node("Reshape", ["b", "back"], ["b3"]),
        h.make_node("Add", ["a3", "b3"], ["s"]),
        h.make_node("Slice", ["s", "one", "big", "one"], ["tail"]),
        h.make_node("Tanh", ["tail"], ["y"]),
    ]
    g = h.make_graph(nodes, "flatten", [h.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                   ["N", "T", D])],
                     [h.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "T1", D])], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def _shared_weight_model() -> onnx.ModelProto:
    """x [N, T, D] @ W and y [N, S, D] @ W, each through Relu: two outputs."""
    w = np.random.default_rng(1).standard_normal((D, D)).astype(np.float32)
    nodes = [h.make_node("MatMul", ["x", "W"], ["a"]), h.make_node("MatMul", ["y", "W"], ["b"]),
             h.make_node("Relu", ["a"], ["ra"]), h.make_node("Relu", ["b"], ["rb"])]
    g = h.make_graph(nodes, "shared",
                     [h.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "T", D]),
                      h.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "S", D])],
                     [h.make_tensor_value_info("ra", TensorProto.FLOAT, ["N", "T", D]),
                      h.make_tensor_value_info("rb", TensorProto.FLOAT, ["N", "S", D])],
                     [_const("W", w)])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def _same_in_onnxruntime(original: onnx.ModelProto, written: onnx.ModelProto,
                         bindings: list[dict[str, tuple[int, ...]]]) -> None:
    a = ort.InferenceSession(original.SerializeToString(), providers=["CPUExecutionProvider"])
    b = ort.InferenceSession(written.SerializeToString(), providers=["CPUExecutionProvider"])
    for k, shapes in enumerate(bindings):
        rng = np.random.default_rng(k)
        for scale in (1.0, 100.0):
            feeds = {n: (scale * rng.standard_normal(s)).astype(np.float32)
                     for n, s in shapes.items()}
            for ya, yb in zip(a.run(None, feeds), b.run(None, feeds), strict=True):
                assert ya.shape == yb.shape, shapes
                np.testing.assert_allclose(yb, ya, rtol=1e-4, atol=1e-4 * scale * D)


def _written(graph, original) -> onnx.ModelProto:
    model = with_symbolic_dims(export_onnx(graph), symbolic_dims(original))
    onnx.checker.check_model(model, full_check=True)
    return model


def test_dim_arithmetic_keeps_value_and_expression():
    n, t = Dim(2, symbol("N")), Dim(3, symbol("T"))
    nt = n * t
    assert nt == 6 and isinstance(nt, Dim) and str(nt.expr) == "N*T"
    assert (nt // t) == 2 and same_size(nt // t, n)
    assert not isinstance(n - n, Dim) and n - n == 0  # a constant expression: a plain int
    assert (n + 1) * 2 == 6 and str(((n + 1) * 2).expr) in ("2*N + 2", "2*(N + 1)")
    assert repr(nt) == "6" and pickle.loads(pickle.dumps(nt)) == 6
    assert type(pickle.loads(pickle.dumps(nt))) is int
    assert np.zeros((n, t)).shape == (2, 3)
    q, r = divmod(Dim(4, 2 * symbol("N")), 2)
    assert q == 2 and not is_open(r) and r == 0
    q, r = divmod(Dim(4, symbol("N")), 2)  # exact at N = 4 only: the remainder stays open
    assert r == 0 and is_open(r)


def test_same_size_is_equality_at_every_binding():
    n1 = Dim(1, symbol("N"))
    h224, w224 = Dim(224, symbol("H")), Dim(224, symbol("W"))
    assert n1 == 1 and not same_size(n1, 1)
    assert h224 == w224 and not same_size(h224, w224)
    assert same_size(h224, Dim(224, symbol("H")))
    assert same_value((n1, 3), (Dim(1, symbol("N")), 3)) and not same_value((n1, 3), (1, 3))
    # the matcher binds shape symbols by it
    assert unify_shape(("M", "K"), (h224, 16), {}) is not None
    assert unify_shape(("M", "M"), (h224, w224), {}) is None
    assert unify_shape(("M", "M"), (224, 224), {}) is not None
    assert unify_shape((1, "K"), (n1, 16), {}) is None


def test_import_carries_expressions_and_export_runs_at_other_sizes():
    model = _flatten_model()
    graph = load_onnx(model, input_shapes=None)
    (x,) = graph.inputs
    assert all(is_open(d) for d in x.types[0].shape[:2])
    reshapes = [n for n in graph.nodes if n.op == "reshape"]
    assert reshapes and all(any(is_open(d) for d in n.attr("shape")) for n in reshapes)
    flat = next(n for n in reshapes if len(n.attr("shape")) == 2)
    assert str(flat.attr("shape")[0].expr) in ("s0*s1", "s1*s0")
    written = _written(graph, model)
    _same_in_onnxruntime(model, written, [{"x": (1, 1, D)}, {"x": (3, 5, D)},
                                         {"x": (2, 17, D)}])


def test_a_rewrite_with_open_split_sizes_runs_at_other_sizes():
    """merge-matmul-matmul-3 concatenates x [N, T, D] and y [N, S, D] along the rows and splits
    the product back at sizes T and S: the split's sizes are open, written computed."""
    model = _shared_weight_model()
    graph = load_onnx(model, input_shapes={"x": (2, 3, D), "y": (2, 5, D)})
    # --input-shape binds the sizes; the model's dim_params stay open in the IR
    assert all(is_open(d) for d in graph.inputs[0].types[0].shape[:2])
    rule = next(r for r in load_substitutions(
        "taso_jax/data/substitutions.json") if r.name == "merge-matmul-matmul-3")
    merged = next(rewrites(rule, graph))
    (split,) = [n for n in merged.nodes if n.op == "split"]
    assert all(is_open(s) for s in split.attr("sizes"))
    written = _written(merged, model)
    assert not any(n.op_type == "Split" and n.input[1] in {i.name for i in
                                                           written.graph.initializer}
                   for n in written.graph.node), "split sizes written as a constant"
    _same_in_onnxruntime(model, written, [{"x": (2, 3, D), "y": (2, 5, D)},
                                         {"x": (1, 7, D), "y": (1, 2, D)},
                                         {"x": (4, 1, D), "y": (4, 9, D)}])


def test_resize_by_an_integral_scale_keeps_open_image_sides():
    """Resize x [N, C, H, W] by 2 (nearest) then add a skip tensor upsampled the same way: the
    output sizes are 2H and 2W, written as scales, so the model runs at other image sizes."""
    scales = _const("scales", np.array([1.0, 1.0, 2.0, 2.0], np.float32))
    nodes = [h.make_node("Resize", ["x", "", "scales"], ["up"], mode="nearest"),
             h.make_node("Relu", ["up"], ["r"]),
             h.make_node("Resize", ["x", "", "scales"], ["up2"], mode="linear"),
             h.make_node("Add", ["r", "up2"], ["y"])]
    g = h.make_graph(nodes, "up", [h.make_tensor_value_info("x", TensorProto.FLOAT,
                                                              ["N", 3, "H", "W"])],
                     [h.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3, "H2", "W2"])],
                     [scales])
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    graph = load_onnx(model, input_shapes={"x": (1, 3, 8, 8)})
    resized = [n for n in graph.nodes if n.op == "resize"]
    assert resized and all(is_open(d) for n in resized for d in n.types[0].shape[2:])
    _same_in_onnxruntime(model, _written(graph, model), [{"x": (1, 3, 8, 8)},
                                                         {"x": (2, 3, 5, 12)}])


def test_unequal_sizes_are_told_apart_without_simplify(monkeypatch):
    """``2*floor((H-1)/2) + 2`` (a stride-2 convolution, upsampled by 2) equals ``H`` at the
    even sides only: a binding where they differ settles it, and SymPy's ``simplify`` (half a
    second on a detector's nested floors) is not called."""
    import sympy
    from taso_jax.ops import dims

    h_ = symbol("H")
    up = 2 * sympy.floor((h_ - 1) / 2) + 2
    monkeypatch.setattr(sympy, "simplify", lambda e: pytest.fail("simplify was called"))
    dims._equal.cache_clear()
    assert not same_size(Dim(224, up), Dim(224, h_))
    dims._equal.cache_clear()


def test_resize_sizes_are_inferred_without_simplify():
    """Onnxruntime's symbolic inference writes a Resize's size as ``simplify(floor(d * 2.0))``;
    here the scale becomes the integer 2, so ``floor`` drops without ``simplify``."""
    import sympy
    from onnxruntime.tools import symbolic_shape_infer as tool

    from taso_jax.frontends.onnx_tensor_types import _CheapSimplify

    h_ = sympy.Symbol("H", integer=True, nonnegative=True)
    d = sympy.floor((h_ - 1) / 2) + 1
    cheap = _CheapSimplify(tool.sympy)
    assert cheap.simplify(sympy.floor(d * sympy.Float(2.0))) == 2 * d
    assert cheap.floor is sympy.floor


def test_strided_slice_sizes_are_inferred_without_simplify(monkeypatch):
    """A strided Slice of an open axis, as a depthwise convolution's kernel taps write it
    (``x[:, :, 1:H-1:2]``): onnxruntime's rule sizes it ``simplify((end - start + step - 1)
    // step)``, which took minutes over a detector's taps; it is inferred here without
    ``simplify``, to the size a run gives."""
    from onnxruntime.tools import symbolic_shape_infer as tool

    from taso_jax.frontends.onnx_tensor_types import symbolic_inference

    inits = [nh.from_array(np.array(v, np.int64), k) for k, v in
             {"s": [1], "e": [-1], "a": [2], "t": [2]}.items()]
    graph = h.make_graph(
        [h.make_node("Relu", ["x0"], ["x"]),
         h.make_node("Slice", ["x", "s", "e", "a", "t"], ["y"])], "g",
        [h.make_tensor_value_info("x0", TensorProto.FLOAT, [1, 3, "H", 5])],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    monkeypatch.setattr(tool.sympy, "simplify",
                        lambda *a, **k: pytest.fail("simplify was called"))
    inferred = symbolic_inference(model, auto_merge=True)
    size = inferred.graph.output[0].type.tensor_type.shape.dim[2].dim_param
    import sympy

    h_ = sympy.Symbol("H", integer=True)
    for n in (4, 7, 224, 225):
        assert int(sympy.sympify(size, locals={"H": h_}).subs(h_, n)) == \
            len(range(n)[1:-1:2])


def test_symbolic_inference_is_given_up_past_its_deadline():
    """A passed deadline: no inference (the sizes stay fixed at the binding); none: done."""
    from taso_jax.search.limits import Deadline

    from taso_jax.frontends.onnx_tensor_types import symbolic_inference

    model = _flatten_model()
    assert symbolic_inference(model, auto_merge=True) is not None
    assert symbolic_inference(model, auto_merge=True,
                              deadline=Deadline(at=0.0, seconds=1.0)) is None


@pytest.mark.parametrize("start,end,step", [
    (19, np.iinfo(np.int64).min, -1),  # x[::-1] as exporters write it
    (19, -1000, -1), (-1, -21, -2), (15, 2, -3), (0, np.iinfo(np.int64).max, 2)])
def test_symbolic_inference_sizes_a_reversing_slice_as_onnxruntime_runs_it(start, end, step):
    """onnxruntime's symbolic shape inference (1.32) sizes a whole axis reversed one entry
    short (19 of 20); its Slice rule is corrected here to the size a run gives, on a static
    and on an open batch axis."""
    from taso_jax.frontends.onnx_tensor_types import symbolic_inference

    for batch in (1, "B"):
        inits = [nh.from_array(np.array(v, np.int64), k) for k, v in
                 {"s": [start], "e": [end], "a": [0], "t": [step]}.items()]
        graph = h.make_graph(
            [h.make_node("Relu", ["x0"], ["x"]),
             h.make_node("Slice", ["x", "s", "e", "a", "t"], ["y"])], "g",
            [h.make_tensor_value_info("x0", TensorProto.FLOAT, [20, batch, 7])],
            [h.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
        model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
        inferred = symbolic_inference(model, auto_merge=True)
        dims = inferred.graph.output[0].type.tensor_type.shape.dim
        x = np.zeros((20, 1, 7), np.float32)
        run = ort.InferenceSession(model.SerializeToString(), providers=[
            "CPUExecutionProvider"]).run(None, {"x0": x})[0]
        assert dims[0].dim_value == run.shape[0] == len(range(20)[start:end:step])


def test_a_reversed_lstm_output_survives_export_and_import():
    """A bidirectional LSTM's backward half reversed in time (``Slice`` with step -1 to
    ``INT64_MIN``) behind an opaque region whose batch size ONNX's inference cannot follow:
    exported and imported again, the slice stays a declared operator (captcha_crnn's
    rewritten file fell back because it came back opaque)."""
    x = h.make_tensor_value_info("x", TensorProto.FLOAT, [20, 1, 6])
    nodes = [
        h.make_node("Shape", ["x"], ["shp"]),  # an opaque size computation, as exporters write
        h.make_node("ConstantOfShape", ["shp"], ["zeros"],
                    value=nh.from_array(np.array([0.0], np.float32))),
        h.make_node("Add", ["x", "zeros"], ["xz"]),
        h.make_node("Slice", ["xz", "s", "e", "a", "t"], ["rev"]),
        h.make_node("Concat", ["xz", "rev"], ["y"], axis=2)]
    inits = [nh.from_array(np.array(v, np.int64), k) for k, v in
             {"s": [19], "e": [np.iinfo(np.int64).min], "a": [0], "t": [-1]}.items()]
    model = h.make_model(h.make_graph(nodes, "g", [x], [h.make_tensor_value_info(
        "y", TensorProto.FLOAT, [20, 1, 12])], inits), opset_imports=[h.make_opsetid("", 17)])
    from taso_jax.frontends import onnx_tensor_types

    for graph in (load_onnx(model), load_onnx(export_onnx(load_onnx(model)))):
        assert graph.op_counts().get("slice") == 1, graph.op_counts()
    # the probe runs find the same sizes where the inference is asked first
    names = ["zeros", "xz", "rev", "y"]
    types: dict = {}
    onnx_tensor_types._missing_types_by_inference(model, names, types)
    assert types["rev"].shape == (20, 1, 6), types


def test_strided_convolutions_and_upsamplings_import_with_open_sides():
    """Four stride-2 convolutions, then four Resizes by 2, each added to the skip tensor of its
    level (a detector's shape): the sides stay open expressions, and the written model runs at
    another image size."""
    rng = np.random.default_rng(3)
    w = _const("w", (0.1 * rng.standard_normal((4, 4, 3, 3))).astype(np.float32))
    scales = _const("scales", np.array([1.0, 1.0, 2.0, 2.0], np.float32))
    nodes, skips, x = [], [], "x"
    for k in range(4):
        nodes.append(h.make_node("Conv", [x, "w"], [f"c{k}"], strides=[2, 2], pads=[1, 1, 1, 1]))
        skips.append(x)
        x = f"c{k}"
    for k in reversed(range(4)):
        nodes.append(h.make_node("Resize", [x, "", "scales"], [f"u{k}"], mode="nearest"))
        nodes.append(h.make_node("Add", [f"u{k}", skips[k]], [f"a{k}"]))
        x = f"a{k}"
    g = h.make_graph(nodes, "unet", [h.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                ["N", 4, "H", "W"])],
                     [h.make_tensor_value_info(x, TensorProto.FLOAT, ["N", 4, "H", "W"])],
                     [w, scales])
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    graph = load_onnx(model, input_shapes={"x": (1, 4, 32, 48)})
    resized = [n for n in graph.nodes if n.op == "resize"]
    assert len(resized) == 4 and all(is_open(d) for n in resized for d in n.types[0].shape[2:])
    _same_in_onnxruntime(model, _written(graph, model), [{"x": (1, 4, 32, 48)},
                                                         {"x": (2, 4, 64, 16)}])


def _reshapes_model() -> onnx.ModelProto:
    """x [N, C, 1, W] through the reshapes exporters write: Squeeze (axes an input),
    Unsqueeze, a Reshape by a constant [0, -1, W'] target, a Flatten at axis 1 and a Reshape
    whose target is computed through Shape/Slice/Cast/Concat; an OCR recogniser's tail."""
    c = 6
    rng = np.random.default_rng(2)
    inits = [_const("two", np.array([2], np.int64)), _const("zero", np.array([0], np.int64)),
             _const("t1", np.array([0, -1, c], np.int64)), _const("W", rng.standard_normal(
                 (c, c)).astype(np.float32)), _const("lo", np.array([0], np.int64)),
             _const("hi", np.array([2], np.int64)), _const("Cc", np.array([c], np.int64))]
    nodes = [
        h.make_node("Squeeze", ["x", "two"], ["sq"]),                  # [N, C, W]
        h.make_node("Transpose", ["sq"], ["tr"], perm=[0, 2, 1]),      # [N, W, C]
        h.make_node("Reshape", ["tr", "t1"], ["r1"]),                  # [N, W, C]
        h.make_node("Flatten", ["r1"], ["fl"], axis=2),                # [N*W, C]
        h.make_node("MatMul", ["fl", "W"], ["mm"]),                    # [N*W, C]
        h.make_node("Shape", ["tr"], ["sh"]),
        h.make_node("Slice", ["sh", "lo", "hi"], ["nw"]),
        h.make_node("Cast", ["nw"], ["nwf"], to=TensorProto.FLOAT),
        h.make_node("Cast", ["nwf"], ["nwi"], to=TensorProto.INT64),
        h.make_node("Concat", ["nwi", "Cc"], ["back"], axis=0),
        h.make_node("Reshape", ["mm", "back"], ["r2"]),                # [N, W, C]
        h.make_node("Unsqueeze", ["r2", "zero"], ["un"]),              # [1, N, W, C]
        h.make_node("Relu", ["un"], ["y"]),
    ]
    g = h.make_graph(nodes, "reshapes", [h.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                    ["N", c, 1, "W"])],
                     [h.make_tensor_value_info("y", TensorProto.FLOAT, [1, "N", "W", c])],
                     inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def test_reshapes_flattens_and_squeezes_carry_open_sizes_from_their_input():
    # Flatten's product, Squeeze/Unsqueeze's kept sizes, a constant target's 0 and -1 and a
    # run-time target are all followed from the input's open sizes: bound at N=1 (and W=4),
    # no reshape is left holding its sizes, and the written model runs at other sizes.
    model = _reshapes_model()
    graph = load_onnx(model, input_shapes={"x": (1, 6, 1, 4)})
    reshapes = [n for n in graph.nodes if n.op == "reshape"]
    assert len(reshapes) >= 3  # two in a row are one (ir/cleanup.py: reshape_chain)
    for n in reshapes:
        shape = n.attr("shape")
        assert sum(is_open(d) for d in shape) >= 1, (n.inputs[0].shape, shape)
    flat = next(n for n in reshapes if len(n.attr("shape")) == 2)
    assert str(flat.attr("shape")[0].expr) in ("s0*s1", "s1*s0")
    written = _written(graph, model)
    _same_in_onnxruntime(model, written, [{"x": (1, 6, 1, 4)}, {"x": (3, 6, 1, 5)},
                                         {"x": (2, 6, 1, 9)}])


def _tiny_output_model(shift: float) -> onnx.ModelProto:
    """x [N, D] -> Sigmoid(x @ W - 30) + shift: an output all but 0 on random inputs."""
    w = np.random.default_rng(3).standard_normal((D, D)).astype(np.float32)
    nodes = [h.make_node("MatMul", ["x", "W"], ["m"]), h.make_node("Sub", ["m", "c"], ["s"]),
             h.make_node("Sigmoid", ["s"], ["g"]), h.make_node("Add", ["g", "e"], ["y"])]
    g = h.make_graph(nodes, "tiny", [h.make_tensor_value_info("x", TensorProto.FLOAT, ["N", D])],
                     [h.make_tensor_value_info("y", TensorProto.FLOAT, ["N", D])],
                     [_const("W", w), _const("c", np.float32(30.0)),
                      _const("e", np.float32(shift))])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def test_the_check_at_other_sizes_allows_float32_rounding_on_outputs_near_zero():
    from taso_jax.report import check_other_sizes

    original = _tiny_output_model(0.0)
    graph = load_onnx(original, input_shapes={"x": (1, D)})
    symbolic = symbolic_dims(original)
    # rounding-sized differences on an output of ~1e-9 pass; a wrong value does not
    near = check_other_sizes(original.SerializeToString(),
                             _tiny_output_model(2e-7).SerializeToString(), graph, symbolic)
    assert near["ok"] and near["shapes"] == {"x": [2, D]}, near
    wrong = check_other_sizes(original.SerializeToString(),
                              _tiny_output_model(1e-3).SerializeToString(), graph, symbolic)
    assert wrong["ok"] is False


def _cache_trim_model() -> onnx.ModelProto:
    """A streaming model's cache: x [1, T, D] and cache [1, 4, D] concatenated on time, then
    the last 4 steps kept (Slice whose start, T, is read off x's shape at run time, as
    exporters write it, and whose end is the end), and the tail [T:] too: two outputs."""
    inits = [_const("one", np.array([1], np.int64)), _const("big", np.array([2**62], np.int64)),
             _const("axis", np.array([1], np.int64))]
    nodes = [h.make_node("Concat", ["cache", "x"], ["all"], axis=1),
             h.make_node("Shape", ["x"], ["sh"]),
             h.make_node("Gather", ["sh", "one"], ["t"], axis=0),
             h.make_node("Slice", ["all", "t", "big", "axis"], ["kept"]),
             h.make_node("Relu", ["kept"], ["new_cache"]),
             h.make_node("Slice", ["all", "one", "t", "axis"], ["head"]),
             h.make_node("Tanh", ["head"], ["y"])]
    g = h.make_graph(nodes, "cache",
                     [h.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", D]),
                      h.make_tensor_value_info("cache", TensorProto.FLOAT, [1, 4, D])],
                     [h.make_tensor_value_info("new_cache", TensorProto.FLOAT, [1, 4, D]),
                      h.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T2", D])], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def test_slices_with_bounds_computed_at_run_time_import_and_hold_at_other_sizes():
    """A Slice whose start or end is computed from an input's shape at run time (a
    streaming cache trimmed to its last steps) imports as a slice, not an opaque node that
    would run in onnxruntime inside jax.jit; its bounds follow the open size, so the written
    file equals the original at other bindings, and it imports back without opaque nodes."""
    model = _cache_trim_model()
    graph = load_onnx(model, input_shapes={"x": (1, 6, D)})
    assert not graph.meta.get("opaque") or "Slice" not in graph.meta["opaque"]
    slices = [n for n in graph.nodes if n.op == "slice"]
    assert len(slices) == 2 and all(any(is_open(v) for v in n.attr("starts") + n.attr("ends"))
                                    for n in slices)
    written = _written(graph, model)
    _same_in_onnxruntime(model, written, [{"x": (1, 6, D), "cache": (1, 4, D)},
                                         {"x": (1, 1, D), "cache": (1, 4, D)},
                                         {"x": (1, 9, D), "cache": (1, 4, D)}])
    back = load_onnx(written, input_shapes={"x": (1, 3, D)})
    assert "opaque" not in {n.op for n in back.nodes}


def test_a_one_dimensional_transposed_convolution_keeps_its_open_batch():
    """A 1-D ConvTranspose is imported as one row of a 2-D one between reshapes; those
    reshapes carry the open batch size, so the written file runs at another batch size
    (they were written at the bound batch, and an EEG model's file failed at batch 2)."""
    w = np.random.default_rng(3).standard_normal((4, 3, 5)).astype(np.float32)
    nodes = [h.make_node("ConvTranspose", ["x", "w"], ["c"], strides=[2], pads=[1, 1]),
             h.make_node("Relu", ["c"], ["y"])]
    g = h.make_graph(nodes, "ct1d", [h.make_tensor_value_info("x", TensorProto.FLOAT,
                                                               ["N", 4, 30])],
                     [h.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3, 61])],
                     [_const("w", w)])
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    graph = load_onnx(model, input_shapes={"x": (1, 4, 30)})
    reshapes = [n for n in graph.nodes if n.op == "reshape" and not n.weight_only]
    assert len(reshapes) == 2 and all(is_open(n.attr("shape")[0]) for n in reshapes)
    _same_in_onnxruntime(model, _written(graph, model), [{"x": (1, 4, 30)}, {"x": (3, 4, 30)}])
