"""Where substitutions are born and proved.

* :mod:`taso_jax.verify.generator`: enumeration of expressions over a domain
  (:mod:`~taso_jax.verify.domains`), fingerprints on random inputs, pairing into candidate
  substitutions, pruning, attribute generalisation and numeric re-checks
  (:func:`~taso_jax.verify.generalize.check_substitution`).
* :mod:`taso_jax.verify.laws`: the axiom language. Each operator declaration carries
  :class:`~taso_jax.ops.Axiom` laws; :func:`~taso_jax.verify.laws.check_axiom` validates a law
  numerically against the JAX reference functions, and
  :class:`~taso_jax.verify.laws.Z3Encoding` turns it into a quantified Z3 formula.
* :mod:`taso_jax.verify.prover`: :class:`~taso_jax.verify.prover.Prover` proves a
  substitution's source equal to its target from the axioms and names the axioms used.
* :mod:`taso_jax.verify.runner`: proves many substitutions in worker processes and stamps
  each with its proof.
"""
