"""A persistent cache of optimized graphs, so that a second process skips the search.

``@taso_jax.optimize`` traces and imports a function on its first call (about a second);
the search and the end-to-end timing that follow take far longer. This cache stores, per
key, the optimized graph and the decision to run it or ``jax.jit`` of the original, so that
another process that traces the same function at the same signature starts from them.

The key (SHA-256) covers everything the result depends on: the imported graph's printed form
(operators, attributes, shapes, dtypes, and each opaque equation's text), the device kind,
the options of the search, the rule set (the ids of the rules used), and the versions of
``taso_jax`` and ``jax``. Weight values are not part of it (the rewrites do not depend on
them): the graph is stored by reference to the imported graph's inputs, weights and opaque
nodes, and rebuilt on them. Each file carries a SHA-256 digest of its graph records, so a
file damaged on disk is a miss rather than a different graph. The decorator stores a graph
only once its outputs matched ``jax.jit`` of the original, and records that check.

The digest is a checksum, not a trust boundary: whoever can write the folder (a shared or
restored CI cache) can edit a graph and compute its digest again. So an entry that another
process wrote is checked against the original on its first use in this process, and a hit
skips that check only where this process has checked (or stored) that very graph
(:func:`mark_checked`, :func:`checked`; ``check="always"`` checks every time). An entry that
fails it is removed (:func:`drop`).

Files are JSON, one per key, written atomically, in ``$TASO_JAX_GRAPH_CACHE`` or else
``<user cache dir>/taso_jax/graphs``; set the variable to ``off`` to disable the cache. A
file that cannot be read is ignored (and replaced on the next store).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from taso_jax._io import atomic_write
from taso_jax.ir.graph import Graph, Node, Tensor, intern_node, make_node
from taso_jax.ops import TensorType

__all__ = ["GRAPH_CACHE_ENV", "graph_cache_dir", "cache_key", "store", "load", "checked",
           "mark_checked", "drop"]

#: Environment variable naming the graph cache folder (``off`` disables the cache).
GRAPH_CACHE_ENV = "TASO_JAX_GRAPH_CACHE"
_FORMAT = 2  # 2: with the digest of the graph records

#: Key and digest of each optimized graph whose outputs this process compared with the
#: original's, for :func:`checked`.
_checked: set[str] = set()


def graph_cache_dir() -> str | None:
    """The cache folder, or ``None`` when ``$TASO_JAX_GRAPH_CACHE`` is ``off``."""
    path = os.environ.get(GRAPH_CACHE_ENV)
    if path and path.lower() in ("off", "0", "none"):
        return None
    if path:
        return path
    import platformdirs

    return os.path.join(platformdirs.user_cache_dir("taso_jax"), "graphs")


def _node_text(n: Node) -> str:
    if n.op == "opaque":
        call = n.attr("call")
        eqn = getattr(call, "eqn", None)
        detail = str(eqn) if eqn is not None else repr(getattr(call, "_key", call))
        return f"opaque {detail}"
    return repr((n.op, n.attrs))


def cache_key(graph: Graph, parts: Sequence[str]) -> str:
    """SHA-256 over ``graph`` (structure, types, opaque equations) and ``parts``.

    ``parts`` are the other things a result depends on (device, options, rule ids,
    versions), as strings.
    """
    h = hashlib.sha256()
    index = {n: i for i, n in enumerate(graph.nodes)}
    for n in graph.nodes:
        ins = ",".join(f"{index[t.node]}.{t.index}" for t in n.inputs)
        h.update(f"{_node_text(n)}|{ins}|{n.types}\n".encode())
    for n in graph.inputs:
        h.update(f"in {n.name} {n.types[0]}\n".encode())
    h.update(repr([(index[t.node], t.index) for t in graph.outputs]).encode())
    for p in parts:
        h.update(b"\x00" + str(p).encode())
    return h.hexdigest()


def _enc(v):
    if isinstance(v, TensorType):
        return {"T": [list(v.shape), v.dtype]}
    if isinstance(v, tuple):
        return {"t": [_enc(x) for x in v]}
    if isinstance(v, bool | int | float | str) or v is None:
        return v
    raise TypeError(f"cannot store attribute value {v!r}")


def _dec(v):
    if isinstance(v, dict):
        if "T" in v:
            return TensorType(tuple(v["T"][0]), v["T"][1])
        return tuple(_dec(x) for x in v["t"])
    return v


def _encode(optimized: Graph, source: Graph) -> dict:
    """``optimized`` as records that refer to ``source``'s leaves and opaque calls."""
    calls = {}
    for n in source.nodes:
        if n.op == "opaque":
            calls.setdefault(n.attr("call"), len(calls))
    index: dict[Node, int] = {}
    records = []
    for n in optimized.nodes:
        ins = [[index[t.node], t.index] for t in n.inputs]
        if n.op in ("input", "weight"):
            if n.op == "weight" and n.name not in source.weights:
                raise KeyError(n.name)  # made up by the search: not a reference
            rec = [n.op, n.name]
        elif n.op == "opaque":
            rec = ["opaque", calls[n.attr("call")], ins, [_enc(t) for t in n.types]]
        else:
            rec = ["op", n.op, [[k, _enc(v)] for k, v in n.attrs], ins]
        index[n] = len(records)
        records.append(rec)
    return {"nodes": records, "outputs": [[index[t.node], t.index] for t in optimized.outputs]}


def _decode(data: dict, source: Graph) -> Graph:
    leaves = {(n.op, n.name): n for n in source.nodes if n.op in ("input", "weight")}
    leaves.update((("input", n.name), n) for n in source.inputs)
    calls = []
    for n in source.nodes:
        if n.op == "opaque" and n.attr("call") not in calls:
            calls.append(n.attr("call"))
    built: list[Node] = []
    for rec in data["nodes"]:
        kind = rec[0]
        if kind in ("input", "weight"):
            node = leaves[(kind, rec[1])]
        elif kind == "opaque":
            ins = tuple(Tensor(built[i], k) for i, k in rec[2])
            node = intern_node("opaque", (("call", calls[rec[1]]),), ins,
                               tuple(_dec(t) for t in rec[3]))
        else:
            ins = [Tensor(built[i], k) for i, k in rec[3]]
            node = make_node(rec[1], ins, {k: _dec(v) for k, v in rec[2]})
        built.append(node)
    outputs = tuple(Tensor(built[i], k) for i, k in data["outputs"])
    return Graph(source.inputs, outputs, source.output_names, source.weights, source.meta)


def _digest(records: dict) -> str:
    return hashlib.sha256(json.dumps([records["nodes"], records["outputs"]]).encode()).hexdigest()


def store(key: str, optimized: Graph, source: Graph, info: dict) -> bool:
    """Write the optimized graph and ``info`` (JSON-able) under ``key``; ``True`` if stored.

    A graph that cannot be written as references to ``source`` (a weight the search made
    up, an attribute JSON cannot hold) is not stored; neither is anything when the cache
    is off or its folder cannot be written.
    """
    folder = graph_cache_dir()
    if folder is None:
        return False
    try:
        records = _encode(optimized, source)
        data = {"format": _FORMAT, "key": key, **records, "digest": _digest(records),
                "info": info}
        text = json.dumps(data)
        os.makedirs(folder, exist_ok=True)
        atomic_write(os.path.join(folder, key + ".json"),
                     lambda tmp: Path(tmp).write_text(text))
        return True
    except (KeyError, TypeError, ValueError, OSError):
        return False


def load(key: str, source: Graph) -> tuple[Graph, dict] | None:
    """The optimized graph rebuilt on ``source`` and its ``info``, or ``None`` on a miss.

    A file that is unreadable, of another format, or that does not rebuild on ``source``
    counts as a miss.
    """
    folder = graph_cache_dir()
    if folder is None:
        return None
    path = os.path.join(folder, key + ".json")
    try:
        with open(path) as f:
            data = json.load(f)
        if data.get("format") != _FORMAT or data.get("key") != key or data.get(
                "digest") != _digest({"nodes": data["nodes"], "outputs": data["outputs"]}):
            return None
        graph = _decode(data, source)
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None
    info = dict(data.get("info", {}))
    if "applied" in info:
        info["applied"] = Counter(info["applied"])
    return graph, info


def _identity(key: str, optimized: Graph, source: Graph) -> str | None:
    """``key`` and the digest of ``optimized``'s records, or ``None`` where it has none."""
    try:
        return key + _digest(_encode(optimized, source))
    except (KeyError, TypeError):
        return None


def mark_checked(key: str, optimized: Graph, source: Graph) -> None:
    """Note that this process compared ``optimized``'s outputs with the original's."""
    identity = _identity(key, optimized, source)
    if identity is not None:
        _checked.add(identity)


def checked(key: str, optimized: Graph, source: Graph) -> bool:
    """Whether this process compared this very graph, under ``key``, with the original.

    A hit that another process wrote is not: its outputs are compared on its first use here.
    """
    return _identity(key, optimized, source) in _checked


def drop(key: str) -> None:
    """Remove the entry under ``key`` (one whose outputs differ from the original's)."""
    folder = graph_cache_dir()
    if folder is not None:
        with contextlib.suppress(OSError):
            os.remove(os.path.join(folder, key + ".json"))
