"""``benchmarks/onnx_peers.py``: its table and its measurement of one tool on a tiny model.

New with issue 62 (the script does not exist on main at ec707cb).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "onnx_peers.py"


def _script():
    spec = importlib.util.spec_from_file_location("onnx_peers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_table_marks_unequal_and_failed_files_and_counts_them_as_1x_in_the_geomean():
    peers = _script()
    rows = {"a": {"onnxsim": {"speedup": 2.0, "equal": True, "same": False},
                  "taso-jax": {"speedup": 4.0, "equal": False}},
            "b": {"onnxsim": {"speedup": 0.5, "equal": True, "same": True},
                  "taso-jax": {"error": "RuntimeError: exit 1"}},
            "c": {"error": "ModelError: not loaded"}}
    rows["a"]["noise"] = {"speedup": 1.05, "equal": True, "same": True}
    text = peers.table(rows, ["onnxsim", "taso-jax"])
    lines = text.splitlines()
    assert lines[0] == "| model | noise | onnxsim | taso-jax |"
    assert lines[2] == "| a | 1.05x (input) | 2.00x | 4.00x ≠ |"
    assert lines[3] == "| b | - | 0.50x (input) | fails |"
    assert lines[4] == "| c | - | - | - |"
    # onnxsim: sqrt(2 * 1), its file for b being the input's bytes (0.5x is the noise)
    assert lines[5] == "| **geomean** | 1.050x | 1.414x | 1.000x |"
    assert "- b, taso-jax: RuntimeError: exit 1" in text and "- c: not measured" in text
    # a's unequal file is kept as 1.00x: behind onnxsim's 2.00x by more than its 5% noise
    assert "taso-jax behind the best peer beyond the noise: 1: a (1.00x, best peer 2.00x)" \
        in text
    assert "taso-jax below 0.97x beyond the noise: 0" in text


def test_a_shortfall_within_the_noise_is_not_one():
    peers = _script()

    def row(noise, peer, ours):
        return {"noise": {"speedup": noise, "equal": True, "same": True},
                "onnxsim": {"speedup": peer, "equal": True, "same": False},
                "taso-jax": {"speedup": ours, "equal": True, "same": False}}

    lines = peers.shortfalls({"quiet": row(1.0, 1.02, 1.0), "noisy": row(0.9, 1.08, 1.0),
                              "slow": row(1.02, 1.0, 0.9), "behind": row(1.0, 1.2, 1.1)})
    assert lines[0] == ("taso-jax behind the best peer beyond the noise: 2: "
                        "slow (0.90x, best peer 1.00x), behind (1.10x, best peer 1.20x)")
    assert lines[1] == "taso-jax below 0.97x beyond the noise: 1: slow (0.90x)"
    unchanged = row(1.0, 1.2, 1.0)
    unchanged["onnxsim"]["same"] = True  # the peer wrote the input back: 1.2x was noise
    assert peers.shortfalls({"unchanged": unchanged})[0] == (
        "taso-jax behind the best peer beyond the noise: 0")


def test_the_two_files_timed_against_each_other_decide_where_they_were():
    """The best of three peers, each paired with the original apart, is biased upwards; a
    direct pairing of taso-jax's file with the best peer's replaces the comparison."""
    peers = _script()

    def row(ours: float, direct: float) -> dict:
        return {"noise": {"speedup": 1.01, "equal": True, "same": True},
                "onnxsim": {"speedup": 1.10, "equal": True, "same": False},
                "taso-jax": {"speedup": ours, "equal": True, "same": False,
                             "vs_best_peer": {"peer": "onnxsim", "speedup": direct}}}

    assert peers.shortfalls({"tied": row(1.0, 0.99)})[0] == (
        "taso-jax behind the best peer beyond the noise: 0")
    assert "tied against onnxsim 0.99x" in peers.table({"tied": row(1.0, 0.99)},
                                                       ["onnxsim", "taso-jax"])
    assert peers.shortfalls({"behind": row(1.0, 0.92)})[0] == (
        "taso-jax behind the best peer beyond the noise: 1: behind (1.00x, best peer 1.10x; "
        "against onnxsim's file directly 0.92x)")


def test_one_tool_is_measured_on_a_tiny_model(tmp_path):
    import onnx
    from onnx import TensorProto as T
    from onnx import helper as h

    peers = _script()
    x = h.make_tensor_value_info("x", T.FLOAT, [4, 8])
    y = h.make_tensor_value_info("y", T.FLOAT, [4, 8])
    g = h.make_graph([h.make_node("Identity", ["x"], ["i"]), h.make_node("Relu", ["i"], ["y"])],
                     "g", [x], [y])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    src = tmp_path / "tiny.onnx"
    onnx.save(m, src)
    row = peers.measure_model(str(src), ["ort-offline"], str(tmp_path), 5.0, rounds=3)
    entry = row["ort-offline"]
    assert row["noise"]["same"] is True and np.isfinite(row["noise"]["speedup"])
    assert entry["equal"] is True and np.isfinite(entry["speedup"]) and entry["speedup"] > 0
    assert entry["same"] is False  # onnxruntime's file drops the Identity
    assert peers.main([str(tmp_path / "missing.onnx")]) == 2


@pytest.mark.parametrize("tool", ["onnxsim", "onnxoptimizer"])
def test_a_peer_not_installed_is_left_out(tool, monkeypatch):
    import importlib.util as util

    peers = _script()
    monkeypatch.setattr(util, "find_spec", lambda name: None)
    assert not peers.available(tool) and peers.available("taso-jax")
