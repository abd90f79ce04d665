"""Front doors: ONNX import/export, jaxpr import, and the ``@taso_jax.optimize`` decorator."""
