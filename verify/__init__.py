"""Verification of substitutions from operator axioms.

* :mod:`taso_jax.verify.laws`: the axiom language. Each operator declaration carries
  :class:`~taso_jax.ops.Axiom` laws; :func:`~taso_jax.verify.laws.check_axiom` validates a law
  numerically against the JAX reference functions, and
  :class:`~taso_jax.verify.laws.Z3Encoding` turns it into a quantified Z3 formula.
* :mod:`taso_jax.verify.prover`: :class:`~taso_jax.verify.prover.Prover` proves a
  substitution's source equal to its target from the axioms and names the axioms used.

Numeric re-checks of generated substitutions live in ``taso_jax.verify.generator``
(:func:`~taso_jax.verify.generator.check_substitution`).
"""
