"""XLA as the target runtime (``target="xla"``): ``jax.jit`` on this device."""

from __future__ import annotations

from taso_jax.search.options import OptimizeOptions
from taso_jax.targets import TargetSpeed, register_target

__all__ = ["XlaTarget"]


class XlaTarget(TargetSpeed):
    """XLA as the runtime a result must be fast in (``target="xla"``: ``jax.jit`` here).

    Its cost model is the options' own (:meth:`OptimizeOptions.make_cost_model`: kernels
    timed under ``jax.jit`` on this device, convolutions priced in NHWC on a CPU), and its
    end-to-end choice :func:`~taso_jax.search.choose.choose_fastest` (the default of
    :func:`~taso_jax.search.options.run_search`, NHWC forms included where
    ``layout_candidates``). The searches that second-guess a measured cost model run. A
    written ONNX file is run under ``jax.jit`` by importing it back, and the file may also
    be run in onnxruntime, which the choice did not time: the report warns where it runs
    slower there.

    Args:
        cache: whether measured kernel costs are read from and kept in the on-disk cache.
        **context: what else a front door knows (:func:`~taso_jax.targets.register_target`);
            not needed here.
    """

    name = "xla"
    runtime = "jax.jit"
    timing_key = "time"
    times_graphs = True
    serves_functions = True
    runs_imported_file = True
    warns_in_onnxruntime = True
    replaces_cost_model = False  # the options keep the name: the graph cache keys on it

    def __init__(self, cache: bool = True, **context):
        self.cache = cache

    def cost_model(self, options: OptimizeOptions):
        """The cost model ``options`` name; a measured one without the disk cache if asked."""
        if options.cost_model in ("measured", "calibrated") and not self.cache:
            return options.make_cost_model(cache_path=False)
        return options.make_cost_model()

    def chooser(self, options: OptimizeOptions):
        """``None``: the pipeline's default end-to-end choice."""
        return None

    def time_graphs(self, before, after, repeats: int, deadline: float | None) -> dict:
        """Both graphs timed under ``jax.jit``, interleaved (:func:`measure_speed`)."""
        from taso_jax.checks import measure_speed

        return measure_speed(before, after, repeats=repeats, deadline=deadline)


register_target(XlaTarget.name, XlaTarget)
