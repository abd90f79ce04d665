"""A committed store of proofs, for tests that need proved rules but do not test the prover.

Proving a rule set again in every run costs minutes; these tests only need the stamps. The
store (``tests/data/proofs.jsonl``) is a checkpoint file of
:func:`taso_jax.verify.runner.verify_substitutions`: one line per proof, keyed by the
rule's content id, a digest of the whole axiom set, the Z3 limits and the prover's
settings, and checked by a digest over all of them and the result. A line counts only when
all of that still matches, so when a rule, an axiom, a limit or the prover changes, the rule
is simply proved again: the store can be out of date, and then slow, but never wrong.

The prover's own tests (``test_axioms.py``, ``test_verification.py``, ``test_verify_cli.py``
and the "proved again from the axioms" tests) do not read it: they prove.

To rebuild the store after such a change (the tests warn when it is out of date)::

    .venv/bin/python tests/proof_store.py

which proves every set in :data:`RULE_SETS` and writes the file anew.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

STORE = Path(__file__).parent / "data" / "proofs.jsonl"


def _lstm_hoisting():
    from taso_jax.verify.from_laws import derived_rules

    return [r for r in derived_rules() if r.name.startswith("lower-lstm_scan")]


#: The rule sets tests take from the store, by name: what :func:`main` proves.
RULE_SETS: dict[str, Callable[[], list]] = {
    "lstm_scan hoisting": _lstm_hoisting,  # test_recurrent.py
}


def proved_set(name: str) -> list:
    """The rules of ``RULE_SETS[name]``, each stamped with its proof.

    The proofs come from the store where it has them; the rest are proved now (in this
    process), with a warning that says how to bring the store up to date.
    """
    from taso_jax.verify.runner import verify_substitutions

    rules = RULE_SETS[name]()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / STORE.name
        if STORE.exists():  # a copy: new proofs are appended to the checkpoint
            shutil.copyfile(STORE, checkpoint)
        # the store is committed with the tests: its "proved" lines are taken as they are
        stamped, stats = verify_substitutions(rules, workers=1, checkpoint=checkpoint,
                                              trust_proofs=True)
    missing = len(rules) - stats["resumed"]
    if missing:
        warnings.warn(f"{missing} of {len(rules)} proofs of {name!r} were not in "
                      f"{STORE.name} (a rule or axiom changed) and were proved again; run "
                      "`python tests/proof_store.py` to store them", stacklevel=2)
    return stamped


def main() -> int:
    """Prove every set in :data:`RULE_SETS` and write the store anew."""
    from taso_jax.verify.runner import verify_substitutions

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / STORE.name
        for name, rules in RULE_SETS.items():
            stamped, stats = verify_substitutions(rules(), checkpoint=checkpoint)
            print(f"{name}: {stats['counts']} in {stats['seconds']} s")
            if stats["counts"]["proved"] != len(stamped):
                print(f"{name}: not every rule is proved; the store is not written",
                      file=sys.stderr)
                return 1
        STORE.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(checkpoint, STORE)
    print(f"wrote {STORE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
