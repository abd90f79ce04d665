"""Verification of substitutions.

Numeric re-checks of generated substitutions live in ``taso_jax.generator``
(:func:`~taso_jax.generator.check_substitution`); Z3 proofs from operator axioms are the
next issue and will live here.
"""
