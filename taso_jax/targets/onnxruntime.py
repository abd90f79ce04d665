"""onnxruntime as the target runtime (``target="onnxruntime"``): the user's ONNX file's own.

The cost model and the end-to-end choice that time in onnxruntime live with the runtime's
other helpers (:mod:`taso_jax.frontends.onnxruntime_target`); this module is the target
that the pipeline asks for them.
"""

from __future__ import annotations

from taso_jax.frontends.onnxruntime_target import (
    OnnxRuntimeCostModel,
    choose_fastest_onnxruntime,
)
from taso_jax.search.cost import MeasuredCostModel
from taso_jax.search.options import OptimizeOptions
from taso_jax.targets import TargetSpeed, register_target

__all__ = ["OnnxRuntimeTarget", "resolve_target"]


class OnnxRuntimeTarget(TargetSpeed):
    """onnxruntime as the runtime a result must be fast in (``target="onnxruntime"``).

    It owns the cost model (one-node ONNX models timed in onnxruntime:
    :class:`~taso_jax.frontends.onnxruntime_target.OnnxRuntimeCostModel`) and the
    end-to-end choice (the exported candidates timed against the user's own file:
    :func:`~taso_jax.frontends.onnxruntime_target.choose_fastest_onnxruntime`). The searches
    that second-guess a measured cost model are not run for it. The report times the
    written file against the input file in onnxruntime, and a written file's weight-only
    subgraphs are computed by onnxruntime (that process never imports JAX).

    Args:
        original: the user's ONNX model (bytes or path) that candidates are timed against;
            ``None``: the input graph's own export.
        inputs: the feeds to time on, by input name; ``None``: random ones.
        opset: the ONNX opset the one-node models are written at (13 at least).
        cache: whether kernel costs are cached on disk (the measured model's SQLite file).
        **context: what else a front door knows; not needed here.
    """

    name = "onnxruntime"
    runtime = "onnxruntime"
    timing_key = "onnxruntime"
    baseline = "the input file"
    second_opinions = False

    def __init__(self, original=None, inputs: dict | None = None, opset: int = 17,
                 cache: bool = True, **context):
        self.original, self.inputs, self.opset, self.cache = original, inputs, opset, cache

    def cost_model(self, options: OptimizeOptions):
        """The cost model for ``options.cost_model``: a measured model times in onnxruntime.

        ``"measured"`` (the name, or an XLA :class:`~taso_jax.search.cost.MeasuredCostModel`)
        and ``"calibrated"`` (no curves are fitted for onnxruntime's kernels yet) become
        :class:`OnnxRuntimeCostModel`; ``"analytic"`` and other instances stay.
        """
        cm = options.cost_model
        if cm in ("measured", "calibrated") or isinstance(cm, MeasuredCostModel) \
                and not isinstance(cm, OnnxRuntimeCostModel):
            return OnnxRuntimeCostModel(cache_path=None if self.cache else False,
                                        opset=self.opset)
        return options.make_cost_model(layouts=False)

    def chooser(self, options: OptimizeOptions):
        """The end-to-end choice: ``chooser(result, deadline=None) -> dict``."""

        def chooser(result, deadline: float | None = None):
            from taso_jax.frontends.onnx_io import export_onnx
            from taso_jax.ir.executor import random_inputs

            graph = result.visited[0].graph
            feeds = self.inputs if self.inputs is not None else dict(zip(
                (n.name for n in graph.inputs), random_inputs(graph), strict=True))
            model = (self.original if self.original is not None
                     else export_onnx(graph).SerializeToString())
            return choose_fastest_onnxruntime(result, model, feeds, deadline=deadline)

        return chooser

    def export_fold(self):
        """Weight-only subgraphs computed by onnxruntime, so that JAX is never imported."""
        from taso_jax.frontends.onnxruntime_target import onnxruntime_folded_values

        return onnxruntime_folded_values


register_target(OnnxRuntimeTarget.name, OnnxRuntimeTarget)


def resolve_target(options: OptimizeOptions, original=None, inputs: dict | None = None,
                   opset: int = 17, cache: bool = True):
    """The options and end-to-end chooser that ``options.target`` asks for.

    The options come back with the target's cost model where the target replaces the
    named one (:attr:`~taso_jax.targets.Target.replaces_cost_model`), with the target's
    chooser (``None``: the pipeline's default). Arguments as for
    :class:`OnnxRuntimeTarget`.

    Returns ``(options, chooser)``.
    """
    from taso_jax.targets import make_target

    target = make_target(options.target, original=original, inputs=inputs, opset=opset,
                         cache=cache)
    if target.replaces_cost_model:
        options = options.replace(cost_model=target.cost_model(options))
    return options, target.chooser(options)
