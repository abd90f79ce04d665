"""TASO's six benchmark models (examples/models/): each builds at full size with the shapes of
TASO's evaluation, and at a small size it runs, matches onnxruntime, and optimizes to a graph
that onnxruntime also agrees with."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import taso_jax
from taso_jax.report import compare_onnx

sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
from models import MODELS  # noqa: E402

FULL_SHAPES = {  # input and output shapes at TASO's configurations
    "resnet50": ((1, 64, 56, 56), (1, 2048, 7, 7)),
    "nasnet_a": ((1, 3, 224, 224), (1, 1056, 7, 7)),
    "resnext50": ((1, 3, 224, 224), (1, 2048, 7, 7)),
    "nasrnn": ((1, 512), (1, 512)),
    "bert_large": ((16, 64, 1024), (16, 64, 1024)),
    "inception_v3": ((1, 3, 299, 299), (1, 2048, 1, 1)),
}


def test_the_suite_is_tasos_six_models():
    assert set(MODELS) == set(FULL_SHAPES)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_full_size_model_has_tasos_shapes(name):
    g = MODELS[name].build()
    assert g.inputs[0].types[0].shape == FULL_SHAPES[name][0]
    assert g.outputs[0].shape == FULL_SHAPES[name][1]
    assert g.weights, "weights are marked as weights"


def _feeds(g):
    return {n.name: v for n, v in zip(g.inputs, taso_jax.random_inputs(g, seed=0), strict=True)}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_small_model_matches_onnxruntime_before_and_after_the_search(name):
    import onnxruntime as ort

    from taso_jax.ir.executor import evaluate

    g = MODELS[name].build(**MODELS[name].SMALL)
    feeds = _feeds(g)
    original = taso_jax.export_onnx(g).SerializeToString()
    ref = ort.InferenceSession(original, providers=["CPUExecutionProvider"]).run(None, feeds)
    ours = evaluate(g, [feeds[n.name] for n in g.inputs])
    np.testing.assert_allclose(np.asarray(ours[0]), ref[0], rtol=1e-4,
                               atol=1e-4 * float(np.abs(ref[0]).max()))

    r = taso_jax.search_graph(g, cost_model="analytic", budget=3, time_limit=60, end_to_end=0)
    assert r.cost_after <= r.cost_before
    check = compare_onnx(original, taso_jax.export_onnx(r.graph).SerializeToString(), feeds)
    assert check["ok"], (name, check["max_abs_err"], dict(r.applied))
