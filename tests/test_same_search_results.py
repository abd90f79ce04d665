"""The analytic-cost search gives the same optimized graphs as recorded before the layered
redesign (issue 16): TASO's six models (small and full size) and the shared ONNX models.

A graph is recorded by a digest of its printed form (every node's operator, attributes, input
positions and shapes, in topological order) and by the laws of the substitutions applied.
The search is bounded by its budget, never by time, so the result is deterministic.
Re-record, only after a change that is meant to change results:
``python tests/test_same_search_results.py --record``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections import Counter
from pathlib import Path

import pytest

HERE = Path(__file__).parent
RECORD = HERE / "data" / "search_results.json"
BUDGET = 30

sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE))
from conftest import LARGE_MODELS, model_path, slow_cases  # noqa: E402
from models import MODELS  # noqa: E402

import taso_jax  # noqa: E402

SHARED = ["hf_bert_tiny", "hf_gpt2_tiny", "tv_squeezenet1_1", "timm_resnet18",
          "tv_mobilenet_v2"]
CASES = [f"{m}/{s}" for m in sorted(MODELS) for s in ("small", "full")] + SHARED


def _digest(graph) -> str:
    return hashlib.sha256(str(graph).encode()).hexdigest()[:16]


def _graph(case: str):
    if "/" in case:
        name, size = case.split("/")
        return MODELS[name].build(**(MODELS[name].SMALL if size == "small" else {}))
    return taso_jax.load_onnx(model_path(case))


_RULES: list = []


def _result(case: str) -> dict:
    if not _RULES:
        _RULES.extend(taso_jax.default_substitutions())
    by_name = {s.name: s for s in _RULES}
    g = _graph(case)
    r = taso_jax.search_graph(g, cost_model="analytic", budget=BUDGET, time_limit=1e9,
                              substitutions=_RULES, end_to_end=0, check=False)
    laws = Counter()
    for name, n in r.applied.items():
        laws[by_name[name].law] += n
    return {"before": _digest(g), "after": _digest(r.graph),
            "cost_after_us": round(r.cost_after, 3), "laws": dict(sorted(laws.items()))}


@pytest.mark.parametrize("case", slow_cases(CASES, ["nasnet_a/small", "nasnet_a/full",
                                                    "bert_large/full", *LARGE_MODELS]))
def test_search_result_is_unchanged(case):
    recorded = json.loads(RECORD.read_text())[case]
    got = _result(case)
    assert got["before"] == recorded["before"], "the input graph itself changed"
    assert got["laws"] == recorded["laws"]
    assert got["cost_after_us"] == pytest.approx(recorded["cost_after_us"], rel=1e-9)
    assert got["after"] == recorded["after"]


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    out = {}
    for case in CASES:
        try:
            out[case] = _result(case)
        except pytest.skip.Exception:
            print(f"{case}: skipped (model not found)")
            continue
        print(case, out[case]["after"], sum(out[case]["laws"].values()), flush=True)
    RECORD.write_text(json.dumps(out, indent=1) + "\n")
