"""Integer division keeps JAX's semantics through import, search and ONNX export (issue 47).

``//`` and ``%`` floor (the result takes the divisor's sign), ``lax.div``, ``lax.rem`` and
``jnp.fmod`` truncate toward zero (the dividend's sign), while ONNX ``Div`` on integers
truncates. Each function is compared, on negative and positive dividends and divisors, with
the imported graph run by JAX, with its ONNX export run by onnxruntime, and with the graph
a short search returns (the search's laws are ring laws of ``ewadd`` and ``ewmul``, which
hold in integers too; ``ewdiv`` has none).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import taso_jax
from taso_jax.frontends.jaxpr_io import from_jax
from taso_jax.frontends.onnx_io import export_onnx, load_onnx
from taso_jax.ir.executor import compile_graph

#: name -> f(x, d); ``d`` is a Python int or an array of ``x``'s dtype.
FUNCTIONS = {
    "floor_divide": lambda x, d: x // d,
    "lax_div": lambda x, d: lax.div(x, jnp.asarray(d, x.dtype)),
    "mod": lambda x, d: x % d,
    "remainder": jnp.remainder,
    "fmod": jnp.fmod,
    "lax_rem": lambda x, d: lax.rem(x, jnp.asarray(d, x.dtype)),
}
NAMES = sorted(FUNCTIONS)
X = np.arange(-7, 8)
#: a runtime divisor of X's shape: both signs, no zero
D = np.array([1, -1, 2, -2, 3, -3, 4, -4, 5, -5, 6, -6, 7, -7, 3])


def _divisions(x, d):
    """Every function of :data:`FUNCTIONS` by the constants 3 and -3 and by runtime ``d``."""
    return tuple(FUNCTIONS[n](x, v) for v in (3, -3, d) for n in NAMES)


def _labels() -> list[str]:
    return [f"{n} by {v}" for v in (3, -3, "d") for n in NAMES]


def _onnxruntime(graph, args) -> list:
    import onnxruntime as ort

    model = export_onnx(graph)
    session = ort.InferenceSession(model.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    feeds = {i.name: np.asarray(a) for i, a in zip(session.get_inputs(), args, strict=True)}
    return session.run(None, feeds)


def _check(got, want):
    for label, a, b in zip(_labels(), got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), b, err_msg=label)


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_integer_division_matches_jax(dtype):
    """The import, its ONNX export and the graph a search returns all compute as JAX does."""
    with jax.enable_x64(dtype == "int64"):
        args = (X.astype(dtype), D.astype(dtype))
        want = [np.asarray(w) for w in jax.jit(_divisions)(*args)]
        assert all(w.dtype == dtype for w in want)
        g = from_jax(_divisions, *args)
        # every primitive maps to a declared operator: no opaque node, and no multiply by
        # a reciprocal (1 / 3 is 0 in integers)
        assert not g.meta["opaque"], g.meta["opaque"]
        assert "ewmul" not in g.op_counts()
        _check(compile_graph(g)(*args), want)
        _check(_onnxruntime(g, args), want)
        best = taso_jax.search_graph(g, cost_model="analytic", budget=5, end_to_end=0).graph
        _check(compile_graph(best)(*args), want)
        _check(_onnxruntime(best, args), want)


def test_onnx_mod_imports_by_its_fmod_attribute():
    """ONNX ``Mod`` with fmod=1 is ``rem``; fmod=0 (a floored modulus) stays opaque."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    x = X.astype(np.int32)
    for fmod, want in ((1, np.fmod(x, -3)), (0, np.mod(x, -3))):
        node = helper.make_node("Mod", ["x", "d"], ["y"], fmod=fmod)
        d = helper.make_tensor("d", TensorProto.INT32, [], [-3])
        vi = [helper.make_tensor_value_info(n, TensorProto.INT32, [15]) for n in "xy"]
        model = helper.make_model(helper.make_graph([node], "mod", vi[:1], vi[1:], [d]),
                                  opset_imports=[helper.make_opsetid("", 17)])
        g = load_onnx(model)
        assert ("rem" in g.op_counts()) == bool(fmod)
        np.testing.assert_array_equal(np.asarray(compile_graph(g)(x)[0]), want)
        out = export_onnx(g)
        got = ort.InferenceSession(out.SerializeToString(),
                                   providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        np.testing.assert_array_equal(got, want)
