"""Verify a set of substitutions in parallel and stamp the results into their provenance.

Proving is embarrassingly parallel: each worker process builds its own
:class:`~taso_jax.verify.prover.Prover` (Z3 objects do not cross processes) and proves
chunks of substitutions. Two engines run the workers: a ``multiprocessing`` pool on this
machine (the default), or a Dask cluster (``cluster="local"`` for a ``LocalCluster`` of
worker processes, or the address of a running scheduler, ``tcp://host:8786``). Dask rather
than Ray: it installs as two pure-Python wheels, its local cluster starts in about two
seconds on a 2-core machine, and a real cluster is one ``dask scheduler`` plus ``dask
worker`` per machine. A ``checkpoint`` file (JSON lines, one finished proof per line, keyed
by rule id, limits and axioms, with a digest the loader recomputes) lets an interrupted run
resume where it stopped.

A file is not a trust boundary: anyone who can write a checkpoint or a proof cache can also
compute its digest. So what is read back from one resumes only the work that cannot make a
rule usable: a rule it says was not proved (or had no answer) is not tried again, but a
rule it says was proved is proved again, unless this process proved it (under the same
limits and axioms: :data:`_PROVED_HERE`) or the caller passes ``trust_proofs=True``.

The result of each proof is written into ``provenance["proof"]``: ``{"status", "axioms",
"seconds", "rlimit"}`` (and ``"timeout_ms"`` when a wall-clock limit was set). Proofs are
bounded by Z3's resource limit, so a rule's status does not depend on the machine's load.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

from taso_jax.search.rules import Substitution

__all__ = ["verify_substitutions", "load_proved_rules", "rules_for", "NOT_PROVED_IN_TIME"]

_PROVER = None
_PROVER_LIMITS: tuple | None = None

#: The proofs this process received, by ``(rule id, limits and axioms)``: the only "proved"
#: results a checkpoint or proof cache may stand for without ``trust_proofs``.
_PROVED_HERE: dict[tuple[str, str], dict] = {}

#: ``provenance["proof"]["why"]`` of a rule whose proof the deadline cut (its status is
#: ``"unverified"``: the search leaves it out unless unverified rules are allowed).
NOT_PROVED_IN_TIME = "the time limit passed before it was proved"


def _init(rlimit: int | None, timeout_ms: int | None) -> None:
    global _PROVER
    from taso_jax.verify.prover import Prover

    _PROVER = Prover(rlimit=rlimit, timeout_ms=timeout_ms)


def _prove_json(job: tuple[int, dict]) -> tuple[int, dict]:
    i, d = job
    return i, _PROVER.prove(Substitution.from_json(d))


def _prove_chunk(chunk: list[tuple[int, dict]], rlimit: int, timeout_ms: int | None
                 ) -> list[tuple[int, dict]]:
    """A cluster task: prove a chunk of substitutions (JSON) in the worker's process.

    Each worker process keeps one :class:`~taso_jax.verify.prover.Prover` per limits.
    """
    global _PROVER, _PROVER_LIMITS
    # Z3's Python objects free their solver state in __del__. A Dask worker's event-loop
    # thread can run the cyclic garbage collector while this task's thread is inside Z3,
    # and Z3 is not thread-safe: workers died of signal 11 or raised "Sort mismatch"
    # errors. Collect only here, in the task's thread.
    gc.disable()
    try:
        if _PROVER is None or _PROVER_LIMITS != (rlimit, timeout_ms):
            _init(rlimit, timeout_ms)
            _PROVER_LIMITS = (rlimit, timeout_ms)
        return [_prove_json(job) for job in chunk]
    finally:
        gc.collect()
        gc.enable()


def _cluster_results(jobs: list, cluster: str, workers: int, rlimit: int,
                     timeout_ms: int | None, chunk: int = 8) -> Iterator[tuple[int, dict]]:
    """Prove ``jobs`` as tasks on a Dask cluster; yield ``(index, result)`` as they finish.

    ``cluster`` is ``"local"`` (a ``LocalCluster`` of ``workers`` processes, one thread
    each, started and stopped here) or a scheduler address (``tcp://host:8786``) of a
    running cluster whose workers have taso_jax installed.
    """
    from dask.distributed import as_completed

    with dask_client(cluster, workers) as client:
        chunks = [jobs[i:i + chunk] for i in range(0, len(jobs), chunk)]
        futures = client.map(_prove_chunk, chunks, rlimit=rlimit, timeout_ms=timeout_ms,
                             pure=False)
        for future in as_completed(futures):
            yield from future.result()


@contextlib.contextmanager
def dask_client(cluster: str, workers: int):
    """A Dask ``Client`` for ``cluster``, closed (with the cluster it started) on exit.

    ``cluster`` is ``"local"`` (a ``LocalCluster`` of ``workers`` processes, one thread
    each) or the address of a running scheduler (``tcp://host:8786``).

    Raises:
        RuntimeError: Dask is not installed (``pip install 'taso_jax[cluster]'``).
    """
    try:
        from dask.distributed import Client, LocalCluster
    except ImportError as e:
        raise RuntimeError("a cluster needs Dask: pip install 'taso_jax[cluster]'") from e
    local = None
    if cluster == "local":
        local = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                             dashboard_address=None)
        client = Client(local)
    else:
        client = Client(cluster)
    try:
        yield client
    finally:
        client.close()
        if local is not None:
            local.close()


#: What a checkpoint line's digest covers, besides the proof: bump it when that changes.
_CHECKPOINT_FORMAT = "taso_jax.checkpoint/2"
_STATUSES = ("proved", "unproved", "unknown")


def _prover_settings() -> dict:
    """The prover's settings that a proof's status depends on, besides the limits."""
    import inspect

    from taso_jax.verify.prover import Prover

    params = inspect.signature(Prover.__init__).parameters
    return {k: params[k].default for k in ("max_instances", "max_quantifier_instances")}


def checkpoint_digest(rule_id: str, axioms: str, limits: dict, result: dict) -> str:
    """SHA-256 (hex) that ties a checkpoint line's ``result`` to what it was proved under.

    It covers the rule's content id, the full digest of the axiom set (``axioms``), the
    limits, the prover's settings (:func:`_prover_settings`) and the result itself. The
    loader recomputes it, so a line written for another rule, other axioms, other limits or
    settings, by an older version, or edited by hand (a ``"proved"`` typed in) does not
    count, and that proof is run again. It is a checksum, not a signature: it stops stale
    and hand-made lines, not a forger who reads this function, which is why a "proved" line
    that this process did not write is proved again (:func:`_resumable`).
    """
    import hashlib

    text = json.dumps({"format": _CHECKPOINT_FORMAT, "id": rule_id, "axioms": axioms,
                       "limits": limits, "prover": _prover_settings(), "result": result},
                      sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def checkpoint_record(line: str) -> dict | None:
    """The record a checkpoint line holds (``id``, ``result`` and more), or ``None``.

    Only its shape is read (a JSON object with a string ``id`` and a ``result`` whose
    ``status`` is one of :data:`_STATUSES`), not its digest: a line of another run, or of
    the earlier format without one, is still a checkpoint line.
    """
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    if (isinstance(rec, dict) and isinstance(rec.get("id"), str)
            and isinstance(rec.get("result"), dict)
            and rec["result"].get("status") in _STATUSES):
        return rec
    return None


def _read_checkpoint(path, limits: dict, axioms: str) -> dict[str, dict]:
    """Finished proofs in a checkpoint file whose digests check out: rule id -> result.

    A line counts only where its ``digest`` is :func:`checkpoint_digest` of its id and
    result under ``axioms`` and ``limits`` (those of this run); any other line (cut short
    by an interruption, of another run, forged) is skipped.
    """
    done: dict[str, dict] = {}
    try:
        with open(path) as f:
            for line in f:
                rec = checkpoint_record(line)
                if rec is None:
                    continue  # a line cut short by the interruption, or not one of ours
                if rec.get("digest") == checkpoint_digest(rec["id"], axioms, limits,
                                                          rec["result"]):
                    done[rec["id"]] = rec["result"]
    except FileNotFoundError:
        pass
    except UnicodeDecodeError:  # a binary file: appending proofs to it would damage it
        raise ValueError(f"{path}: not a checkpoint file (not UTF-8 text)") from None
    return done


def _open_checkpoint(path):
    """``path`` opened to append proof lines, each on a line of its own.

    A run stopped mid-line left a last line without its newline: one is added first, or
    the next record would be glued to the cut one and lost to the next resume too.
    """
    cut = False
    with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:
        if f.seek(0, os.SEEK_END):
            f.seek(-1, os.SEEK_END)
            cut = f.read(1) != b"\n"
    log = open(path, "a")  # noqa: SIM115 -- closed by the caller
    if cut:
        log.write("\n")
    return log


def _resumable(found: dict[str, dict], limits_key: str, trust_proofs: bool
               ) -> dict[str, dict]:
    """The results read from a file that may stand in for a proof now.

    A result that is not "proved" is kept: it can only leave a rule out. A "proved" one is
    kept where ``trust_proofs``, or as this process's own result where this process proved
    the rule under the same limits and axioms (:data:`_PROVED_HERE`); any other is a claim,
    and the rule is proved again.
    """
    kept = {}
    for rule_id, result in found.items():
        if result.get("status") != "proved" or trust_proofs:
            kept[rule_id] = result
        elif (rule_id, limits_key) in _PROVED_HERE:
            kept[rule_id] = _PROVED_HERE[rule_id, limits_key]
    return kept


def verify_substitutions(subs: Sequence[Substitution], rlimit: int | None = None,
                         timeout_ms: int | None = None, workers: int | None = None,
                         progress: Callable[[int, Counter], None] | None = None,
                         cluster: str | None = None, checkpoint=None, deadline=None,
                         trust_proofs: bool = False, earlier: dict[str, dict] | None = None
                         ) -> tuple[list[Substitution], dict]:
    """Prove every substitution from the operator axioms, or as many as ``deadline`` allows.

    Args:
        subs: the substitutions.
        rlimit: Z3 resource limit per proof attempt (default
            :data:`~taso_jax.verify.prover.DEFAULT_RLIMIT`).
        timeout_ms: optional wall-clock limit per attempt, in milliseconds (off by default).
        workers: processes (default: one per core; 1 proves in this process).
        progress: called as ``progress(done, counts)`` after each substitution.
        cluster: ``None`` (a process pool here), ``"local"`` (a Dask ``LocalCluster`` of
            ``workers`` processes) or a Dask scheduler address.
        checkpoint: a file that records each finished proof as it arrives; proofs already
            in it (same rule id, same limits, axioms and prover settings, with a digest
            that checks out: :func:`checkpoint_digest`) are not done again, except that a
            "proved" line that this process did not write is proved again unless
            ``trust_proofs`` (see the module's docstring).
        deadline: a :class:`~taso_jax.search.limits.Deadline`, or ``None`` (no limit; not
            with a cluster). Once it passes no result is waited for: the pool is stopped,
            and each rule whose proof had not come back is stamped ``"unverified"`` with
            ``"why":`` :data:`NOT_PROVED_IN_TIME` (one proof already running in this
            process, ``workers=1``, runs to its end: Z3's ``rlimit`` bounds it).
        trust_proofs: take "proved" results from ``checkpoint`` and ``earlier`` that this
            process did not prove (a committed store of proofs, a file the caller made).
        earlier: results read from a proof cache, rule id -> result, under the same policy
            as the checkpoint's lines (the caller checks that they were proved under these
            limits).

    Returns:
        ``(stamped, stats)``: the substitutions with ``provenance["proof"]`` set, and
        ``{"counts": {"proved", "unproved", "unknown"}, "seconds", "axioms", "resumed",
        "reproved", "engine", "not_proved_in_time"}`` (``resumed``: results read from the
        checkpoint or ``earlier``; ``reproved``: "proved" results read there that were
        proved again).

    Raises:
        RuntimeError: a cluster was asked for and Dask is not installed.
    """
    # over 80 lines for its docstring (the contract); the body is 52 lines
    from taso_jax.verify.laws import all_axioms
    from taso_jax.verify.prover import DEFAULT_RLIMIT

    rlimit = DEFAULT_RLIMIT if rlimit is None else rlimit
    t0 = time.perf_counter()
    workers = workers or os.cpu_count() or 1
    limits = {"rlimit": rlimit, **({"timeout_ms": timeout_ms} if timeout_ms else {})}
    # a checkpoint is reused only under the same limits and the same axioms
    axioms = hashlib.sha256("\n".join(f"{n}: {a.law}" for n, a in all_axioms()).encode())
    checkpoint_limits = {**limits, "axioms": axioms.hexdigest()[:16]}
    found = {**(earlier or {}),
             **(_read_checkpoint(checkpoint, checkpoint_limits, axioms.hexdigest())
                if checkpoint else {})}
    limits_key = json.dumps(checkpoint_limits, sort_keys=True)
    results, counts, reproved = _resumed(subs, found, limits_key, trust_proofs)
    jobs = [(i, s.to_json()) for i, s in enumerate(subs) if results[i] is None]
    it, engine, pool = _proof_engine(jobs, cluster, workers, rlimit, timeout_ms, deadline)
    log = _open_checkpoint(checkpoint) if checkpoint else None
    cut = False
    try:
        for done, (i, r) in enumerate(it, len(subs) - len(jobs) + 1):
            results[i] = r
            counts[r["status"]] += 1
            if r["status"] == "proved":
                _PROVED_HERE[subs[i].id, limits_key] = r
            if log is not None:
                log.write(json.dumps({
                    "id": subs[i].id, "limits": checkpoint_limits, "result": r,
                    "digest": checkpoint_digest(subs[i].id, axioms.hexdigest(),
                                                checkpoint_limits, r)}) + "\n")
                log.flush()
            if progress:
                progress(done, counts)
        cut = any(r is None for r in results)
    finally:
        if log is not None:
            log.close()
        if pool is not None:
            if cut or any(r is None for r in results):  # the limit, or an interruption:
                pool.terminate()  # the proofs still queued are not waited for
            else:
                pool.close()
            pool.join()
    late = {"status": "unverified", "why": NOT_PROVED_IN_TIME}
    stamped = [replace(s, provenance={**s.provenance, "proof": {**r, **limits}
                                      if r is not None else dict(late)})
               for s, r in zip(subs, results, strict=True)]
    stats = {"counts": {k: counts.get(k, 0) for k in ("proved", "unproved", "unknown")},
             "seconds": round(time.perf_counter() - t0, 1), "axioms": len(all_axioms()),
             "resumed": len(subs) - len(jobs), "reproved": reproved, "engine": engine,
             "not_proved_in_time": sum(r is None for r in results)}
    return stamped, stats


def _resumed(subs: Sequence[Substitution], found: dict, limits_key: str,
             trust_proofs: bool) -> tuple[list, Counter, int]:
    """``(results, counts, reproved)``: what the earlier results settle, per substitution.

    ``results[i]`` is the result kept for ``subs[i]`` (``None``: to prove), ``counts`` the
    kept results by status, ``reproved`` how many earlier "proved" results are not kept
    (:func:`_resumable`) and are proved again.
    """
    done_before = _resumable(found, limits_key, trust_proofs)
    results: list = [None] * len(subs)
    counts: Counter = Counter()
    reproved = 0
    for i, sub in enumerate(subs):
        if sub.id in done_before:
            results[i] = done_before[sub.id]
            counts[results[i]["status"]] += 1
        elif sub.id in found:
            reproved += 1
    return results, counts, reproved


def _proof_engine(jobs: list, cluster: str | None, workers: int, rlimit: int,
                  timeout_ms: int | None, deadline) -> tuple[Iterator, str, object]:
    """``(results, engine, pool)``: where the ``jobs`` are proved, and their results.

    ``results`` yields ``(index, result)`` as proofs come back (only those before
    ``deadline`` where one is given, without a cluster); ``engine`` names where they run;
    ``pool`` is the process pool to stop afterwards, or ``None``.
    """
    import multiprocessing

    pool = None
    if not jobs:
        return iter(()), "none (every result resumed)", None
    if deadline is not None and deadline.passed():  # reading the rules took the time
        return iter(()), "none (the time limit had passed)", None
    if cluster is not None:
        return (_cluster_results(jobs, cluster, workers, rlimit, timeout_ms),
                f"dask ({cluster})", None)
    if workers == 1 or len(jobs) < 8:
        _init(rlimit, timeout_ms)
        it, engine = map(_prove_json, jobs), "this process"
    else:
        ctx = multiprocessing.get_context("spawn")  # JAX is threaded: never fork it
        # Z3 keeps memory across proofs in a process (gigabytes over a few thousand rules):
        # each worker is replaced after a bounded number of chunks.
        pool = ctx.Pool(workers, initializer=_init, initargs=(rlimit, timeout_ms),
                        maxtasksperchild=16)
        # one rule a task under a deadline: only then is the iterator one whose results can
        # be waited for with a timeout (chunks come back through a plain generator)
        it = pool.imap_unordered(_prove_json, jobs, chunksize=4 if deadline is None else 1)
        engine = f"process pool ({workers})"
    if deadline is not None:
        it = _until(it, deadline, pool)
    return it, engine, pool


def _until(results, deadline, pool) -> Iterator[tuple[int, dict]]:
    """The proofs of ``results`` that arrive before ``deadline`` passes.

    A pool's results are waited for at most until the deadline (``pool`` given: ``results``
    is its ``imap_unordered`` iterator); proofs in this process are started only before it.
    """
    import multiprocessing

    while not deadline.passed():
        try:
            if pool is not None:
                yield results.next(timeout=max(deadline.left(), 1e-3))
            else:
                yield next(results)
        except (StopIteration, multiprocessing.TimeoutError):
            return


def load_proved_rules(path, trust_proofs: bool = False, rlimit: int | None = None,
                      cache_dir: str | None = None, deadline=None) -> list[Substitution]:
    """Read a rule file and prove its rules again, unless told to trust their stamps.

    A proof stamp in a file that did not ship with the package is a claim, not a proof (a
    hand-edited ``clip(x) => x`` can say "proved"): every rule is proved again from the
    axioms (:func:`verify_substitutions`) and carries the new stamp, so the search leaves
    out whatever is not proved. The result is cached by the file's content hash (SHA-256)
    under ``<user cache dir>/taso_jax/proofs/`` (or ``cache_dir``). The cache is a file as
    well: a later load takes from it the rules not proved (they are not tried again), but
    proves again each rule it says was proved, unless this process proved it
    (:func:`_resumable`); so a file is proved once per process. ``trust_proofs`` keeps the
    file's own stamps.

    Under a ``deadline`` (a :class:`~taso_jax.search.limits.Deadline`) the proofs stop when
    it passes: the rules proved by then carry their stamps, the others are stamped
    ``"unverified"`` (:data:`NOT_PROVED_IN_TIME`), and nothing is cached as the file's
    proof. Each finished proof is kept in a checkpoint beside the cache entry
    (``.partial.jsonl``), so the next load of the same file goes on from there.

    Raises:
        OSError: the file cannot be read.
        ValueError, KeyError, TypeError: the file is not a valid substitution file.
    """
    import hashlib
    from pathlib import Path

    from taso_jax.search.rules import load_substitutions, save_substitutions
    from taso_jax.verify.prover import DEFAULT_RLIMIT

    rlimit = DEFAULT_RLIMIT if rlimit is None else rlimit
    data = Path(path).read_bytes()
    subs = load_substitutions(path)
    if trust_proofs:
        return subs
    if cache_dir is None:
        import platformdirs

        cache_dir = os.path.join(platformdirs.user_cache_dir("taso_jax"), "proofs")
    cached = Path(cache_dir) / f"{hashlib.sha256(data).hexdigest()}-r{rlimit}.json"
    earlier = _cached_results(cached, subs, rlimit)
    partial = cached.with_name(cached.stem + ".partial.jsonl")
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial.touch()
    except OSError:
        partial = None  # no cache: the proofs are redone next time
    stamped, stats = verify_substitutions(subs, rlimit=rlimit, checkpoint=partial,
                                          deadline=deadline, earlier=earlier)
    if stats["not_proved_in_time"]:
        return stamped  # the checkpoint keeps what was proved; the file is not done
    try:
        save_substitutions(stamped, cached)
        if partial is not None:
            partial.unlink(missing_ok=True)
    except OSError:
        pass
    return stamped


def _cached_results(cached, subs: Sequence[Substitution], rlimit: int) -> dict[str, dict]:
    """The results in the proof cache ``cached`` of ``subs``, rule id -> result, or ``{}``.

    Only a cache of the same rules, stamped under the same ``rlimit`` and no wall-clock
    limit, counts; a damaged one is none (its rules are proved again).
    """
    from taso_jax.search.rules import load_substitutions

    try:
        stamped = load_substitutions(cached)
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    if [s.id for s in stamped] != [s.id for s in subs]:
        return {}
    found = {}
    for s in stamped:
        proof = s.provenance.get("proof")
        if (isinstance(proof, dict) and proof.get("rlimit") == rlimit
                and "timeout_ms" not in proof and proof.get("status") in _STATUSES):
            found[s.id] = {k: v for k, v in proof.items() if k != "rlimit"}
    return found


def rules_for(options, deadline=None) -> list[Substitution]:
    """The rules an :class:`~taso_jax.search.options.OptimizeOptions` names, proofs checked.

    A rule file path is read with :func:`load_proved_rules` (its proofs redone unless
    ``options.trust_proofs``, until ``deadline`` at most); the shipped set and lists of
    rules are taken as they are.
    """
    subs = options.substitutions
    if isinstance(subs, str) or hasattr(subs, "__fspath__"):
        return load_proved_rules(subs, trust_proofs=options.trust_proofs, deadline=deadline)
    return options.load_rules()
