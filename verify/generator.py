"""Automatic substitution generator (TASO, Jia et al., SOSP 2019, Section 3).

1. **Enumerate** every expression of up to ``max_ops`` operators over a *domain*: a pool of
   variables with symbolic shapes and a list of operator choices (operator + attributes).
   Expressions are hash-consed graph nodes, so a DAG that reuses a subexpression counts each
   operator once. Only the first expression of each fingerprint class is extended further
   (an expression built on a non-canonical input is redundant with one built on the canonical
   input), which keeps the enumeration small.
2. **Fingerprint** each expression by evaluating the JAX reference functions in float64 on
   random inputs and projecting the result on two fixed random vectors. Equal functions give
   equal projections up to rounding; unequal multilinear/piecewise-linear functions agree on
   random Gaussian inputs with probability zero, and the two 9-digit projections make an
   accidental collision about 1e-18 likely per pair. Every candidate is then **re-checked**
   on a second, differently sized instance of the domain with fresh random values
   (``numpy.allclose`` at 1e-9), which rejects both collisions and laws that hold only for
   particular shapes.
3. **Pair** expressions of a class into candidate substitutions (both directions), and derive
   multi-output substitutions: when ``concat(a, b)`` equals ``t``, then ``(a, b)`` can be
   replaced by the two parts of ``split(t)`` (how two convolutions that share an input
   become one).
4. **Prune**: the target may use only the source's variables; a substitution whose two sides
   share an operator node (a common subgraph) is redundant with a smaller one; a rule that
   only swaps the operands of commutative operators is dropped (matching tries both
   orders); weight-only sources are dropped (weights are precomputed, rewriting them gains
   nothing); duplicates under renaming into interchangeable variables of the domain, or
   under swapping commutative operands, are removed.
5. **Generalise attributes**
   (:func:`~taso_jax.verify.generalize.generalize_attributes`) and record the values each
   attribute variable was checked at; ``taso-jax generate`` then proves every candidate
   (:mod:`taso_jax.verify`) and keeps the proved ones.

The stages live in one module each: the domains in :mod:`taso_jax.verify.domains`,
enumeration and fingerprints in :mod:`taso_jax.verify._enumeration`, pairing and pruning in
:mod:`taso_jax.verify._pairing`, the re-check and attribute generalisation in
:mod:`taso_jax.verify.generalize`; this module runs them per domain, here or on a Dask
cluster (:func:`generate`).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from taso_jax.search.rules import Substitution, name_rules
from taso_jax.verify._enumeration import _enable_x64, _enumerate
from taso_jax.verify._pairing import _candidates, _canonical_key, _slice_merges
from taso_jax.verify.domains import DEFAULT_DOMAINS, MAX_OPS_LIMIT, Domain
from taso_jax.verify.generalize import _generalize_all, check_substitution

__all__ = ["Domain", "DEFAULT_DOMAINS", "generate", "GeneratorStats", "check_substitution",
           "MAX_OPS_LIMIT"]


@dataclass
class GeneratorStats:
    """Counts per stage of one generator run (and seconds per stage)."""

    expressions: int = 0
    classes: int = 0
    candidates: int = 0
    pruned: Counter = field(default_factory=Counter)
    kept: int = 0
    seconds: dict = field(default_factory=dict)

    def summary(self) -> str:
        """One-paragraph human-readable summary."""
        pr = ", ".join(f"{k} {v}" for k, v in sorted(self.pruned.items()))
        return (f"enumerated expressions: {self.expressions}; fingerprint classes: "
                f"{self.classes}; candidate substitutions: {self.candidates}; pruned: {pr}; "
                f"kept: {self.kept}")


def _domain_run(domain: Domain, max_ops: int, seed: int, progress: Callable | None,
                monotone: bool, workers: int | None
                ) -> tuple[list[tuple[str, Substitution | None]], GeneratorStats]:
    """One domain's generation: enumerate, pair, prune, re-check, generalise attributes.

    Returns ``(records, stats)``: a record per candidate that is not a renaming of an
    earlier one of this domain, in order, as ``(canonical key, substitution)``; the
    substitution is ``None`` when it failed the re-check on the domain's instances, and
    has its attributes generalised otherwise. Renamings across domains are left to the
    caller (:func:`generate`), which sees the domains in order.
    """
    stats = GeneratorStats()
    t0 = time.perf_counter()
    with _enable_x64():
        leaves, exprs, classes, sym_values, fp = _enumerate(domain, max_ops, seed, progress)
    stats.expressions += len(exprs) - len(leaves)
    stats.classes += len(classes)
    t1 = time.perf_counter()
    stats.seconds[f"{domain.name}: enumerate"] = round(t1 - t0, 2)
    cands = (list(_candidates(domain, classes, sym_values, max_ops, seed, stats, monotone))
             if domain.class_pairs else [])
    if domain.slice_merges:
        cands += _slice_merges(domain, classes, sym_values, fp, max_ops, seed, stats)
    records: list[tuple[str, Substitution | None]] = []
    seen: set[str] = set()
    for sub in cands:
        key = _canonical_key(sub, domain)
        if key in seen:
            stats.pruned["renaming_duplicate"] += 1
            continue
        seen.add(key)
        if not all(check_substitution(sub, domain, inst, seed + i + 1)
                   for i, inst in enumerate(domain.instances)):  # None fails too
            records.append((key, None))
            continue
        sub.provenance["checked_instances"] = [
            {k: list(v) if isinstance(v, tuple) else v for k, v in inst.items()}
            for inst in domain.instances]
        records.append((key, sub))
    stats.seconds[f"{domain.name}: pair+prune+check"] = round(time.perf_counter() - t1, 2)
    t2 = time.perf_counter()
    passed = [i for i, (_, sub) in enumerate(records) if sub is not None]
    general = _generalize_all([records[i][1] for i in passed], domain, seed, workers)
    for i, sub in zip(passed, general, strict=True):
        records[i] = (records[i][0], sub)
    stats.seconds[f"{domain.name}: generalize attributes"] = round(time.perf_counter() - t2, 2)
    return records, stats


def _domain_task(domain: Domain, max_ops: int, seed: int, monotone: bool
                 ) -> tuple[list[tuple[str, dict | None]], GeneratorStats]:
    """A cluster task: :func:`_domain_run` in a worker, substitutions as JSON."""
    records, stats = _domain_run(domain, max_ops, seed, None, monotone, workers=1)
    return [(key, None if sub is None else sub.to_json()) for key, sub in records], stats


def _cluster_domains(domains, max_ops: int, seed: int, monotone: bool, cluster: str,
                     workers: int | None, progress: Callable | None):
    """Yield ``(domain index, records, stats)`` as each domain's task finishes on Dask."""
    from taso_jax.verify.runner import dask_client

    with dask_client(cluster, workers or os.cpu_count() or 1) as client:
        # the largest domains first, so that no worker starts one last
        order = sorted(range(len(domains)), key=lambda i: -len(domains[i].ops) * (
            1 + len(domains[i].variables)) * domains[i].max_ops)
        futures = {client.submit(_domain_task, domains[i], max_ops, seed, monotone,
                                 pure=False): i for i in order}
        from dask.distributed import as_completed

        for future in as_completed(list(futures)):
            i = futures[future]
            records, stats = future.result()
            if progress:
                progress(f"{domains[i].name}: done on the cluster")
            yield i, [(key, None if d is None else Substitution.from_json(d))
                      for key, d in records], stats


def generate(domains=None, max_ops: int = 3, seed: int = 0,
             progress: Callable[[str], None] | None = None, monotone: bool = True,
             workers: int | None = None, cluster: str | None = None,
             laws: bool | None = None
             ) -> tuple[list[Substitution], GeneratorStats]:
    """Generate substitutions over ``domains`` with expressions of up to ``max_ops`` operators.

    Args:
        domains: variable pools and operator choices (:class:`Domain`); default
            :data:`DEFAULT_DOMAINS`.
        max_ops: size bound on each side, in operators (TASO used 4).
        seed: seed for fingerprints and re-checks; the output is deterministic for a seed.
        progress: called with a status line per stage.
        monotone: keep only substitutions whose target runs no more operators than the
            source (weight-only operators are free); the search's alpha relaxation then
            explores sideways moves, and the rule set stays small enough to match quickly.
        workers: processes for attribute generalisation (default: one per core; 1 runs
            in this process); with ``cluster="local"``, the cluster's worker processes.
        cluster: ``None`` (domains one after another, here), ``"local"`` (a Dask
            ``LocalCluster``) or a scheduler address (``tcp://host:8786``): each domain
            is then generated as one task on a worker (enumeration, fingerprints,
            pruning, re-check and attribute generalisation in one process). The result
            is the same as without a cluster: renamings across domains are pruned here,
            in domain order.
        laws: add the rules derived from the operators' laws
            (:func:`taso_jax.verify.from_laws.derived_rules`), unproved like the rest;
            by default only with the default domains (a run over chosen domains makes
            those domains' rules).

    Returns:
        The kept substitutions and the per-stage counts.

    Raises:
        RuntimeError: a cluster was asked for and Dask is not installed.
    """
    laws = domains is None if laws is None else laws
    domains = DEFAULT_DOMAINS if domains is None else tuple(domains)
    stats = GeneratorStats()
    if cluster is None:
        runs = (_domain_run(d, max_ops, seed, progress, monotone, workers) for d in domains)
    else:
        done = {i: (records, st) for i, records, st in _cluster_domains(
            domains, max_ops, seed, monotone, cluster, workers, progress)}
        runs = (done[i] for i in range(len(domains)))
    kept: list[Substitution] = []
    seen: set[str] = set()
    for domain, (records, st) in zip(domains, runs, strict=True):
        stats.expressions += st.expressions
        stats.classes += st.classes
        stats.candidates += st.candidates
        stats.pruned.update(st.pruned)
        stats.seconds.update(st.seconds)
        for key, sub in records:
            if key in seen:
                stats.pruned["renaming_duplicate"] += 1
            elif sub is None:
                stats.pruned["failed_recheck"] += 1
            else:
                kept.append(sub)
            seen.add(key)
        if progress and cluster is None:
            progress(f"{domain.name}: {len(kept)} kept so far")
    # Generalising attributes can make two candidates one rule (found with activation=none
    # and with relu, both become ?activation): keep the first of each content id.
    first: dict[str, Substitution] = {}
    for s in kept:
        first.setdefault(s.id, s)
    unique = list(first.values())
    stats.pruned["duplicate after generalising attributes"] += len(kept) - len(unique)
    kept = name_rules([replace(s, provenance={**s.provenance, "generated_name": s.name})
                       for s in unique])
    if laws:  # first: the greedy descent takes the first rewrite that pays, and these
        # sources (attention, adapters) are longer than any generated one that they contain
        from taso_jax.verify.from_laws import derived_rules

        kept = [r for r in derived_rules() if r.id not in first] + kept
    stats.kept = len(kept)
    return kept, stats
