"""Collect kernels from a corpus of models, time them, and fit the calibrated cost model.

    python benchmarks/calibrate.py collect --out K.jsonl [--cost-cache F] [--per-model N]
                                           [--only NAME ...] [--time-per-model S]
                                           [--unseen DIR]
    python benchmarks/calibrate.py retime K.jsonl --out K2.jsonl [--ops OP,OP]
    python benchmarks/calibrate.py fit K.jsonl [--write taso_jax/data/calibration_cpu.json]

``collect`` loads each model of the corpus (:func:`corpus`: the shared ONNX exports, the
deployed ONNX models fetched by ``benchmarks/fetch_real_models.py`` into
``/tmp/realmodels/in``, the ONNX wheel's light model-zoo graphs, TASO's six models at their
small and full sizes, and the transformer registry and JAX workloads of ``examples/``),
runs a short search under a cost model that records every kernel it prices (so the kernels
are those a search meets: the input's, and every rewrite's and lowering's), draws up to
``--per-model`` of them (seeded), times each one as
:class:`~taso_jax.search.cost.MeasuredCostModel` does, and appends one JSON line per kernel
(its features, price in microseconds and model) to ``--out``. It also writes, per model, up
to ``--rewrites`` single rewrites of the input graph (the kernels each adds and removes,
also timed) to ``<out>.rewrites.jsonl``, for the sign agreement that
``benchmarks/cost_model_accuracy.py`` reports. A run resumes where one left off: kernels
already in ``--out`` are not timed again.

``--unseen DIR`` collects the ONNX models of a folder instead (named ``unseen:<stem>``, with
their rewrites): the test set of ``benchmarks/cost_model_accuracy.py``, never fitted.

``retime`` times every kernel of a ``collect`` output again (or those of ``--ops``), on
the machine as it is now, and writes the rows with their new prices to ``--out`` (its
rewrites file copied beside it): a collection is taken as long as it runs, and the one of
2026-11-29 ran while two other agents ran test suites on the same 2 cores (load 6-8). Timed
again idle, its kernels took a median 1.7x less, with a spread from 0.6x to 8x: attention
and softmax kernels, multi-threaded, had suffered most, and the curves priced the blocked
causal attention at S=1024 above the naive form it runs 1.8x faster than. Collect or
retime on an idle machine.

``fit`` fits the curves to every sample but the unseen models' and writes them as the
package's calibration for this device class (its ``meta.host`` names the processor).

Every command reads gzip-compressed files too (``.gz``). The collection behind the shipped
CPU calibration (an AMD EPYC, 2 cores, 2026-11-30), its rewrites, the unseen models' and
the rewrites' three timings are kept in ``benchmarks/data/``, so that the fit and its
scores can be run again without collecting and timing again (20 minutes here)::

    python benchmarks/calibrate.py fit benchmarks/data/kernels_cpu_2026-11-30.jsonl.gz
    python benchmarks/cost_model_accuracy.py benchmarks/data/kernels_cpu_2026-11-30.jsonl.gz \
        benchmarks/data/kernels_cpu_unseen_2026-11-30.jsonl.gz --split dev \
        --retimed benchmarks/data/rewrites_retimed_cpu_dev_2026-11-30.json.gz
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import random
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO / "tests"))


def held_out(name: str) -> bool:
    """Whether a model is kept out of the fit while the model is tuned.

    A quarter of the corpus, by its name's hash (the development set), and every model of
    an ``--unseen`` folder (``unseen:`` names: the test set, never fitted nor tuned on).
    """
    return name.startswith("unseen:") or \
        int(hashlib.sha256(name.encode()).hexdigest(), 16) % 4 == 0


def corpus(only: list[str] | None = None, unseen: str | None = None):
    """Yield ``(name, make_graph)`` for every model of the corpus (graphs built lazily).

    With ``unseen`` (a folder of ONNX files), its models only, named ``unseen:<stem>``.
    """
    import onnx

    import taso_jax

    if unseen:
        for f in sorted(glob.glob(str(Path(unseen) / "*.onnx"))):
            yield f"unseen:{Path(f).stem}", (lambda f=f: taso_jax.load_onnx(f))
        return

    onnx_files = sorted(glob.glob(str(REPO.parent / "shared" / "models" / "*.onnx")))
    onnx_files += sorted(glob.glob("/tmp/realmodels/in/*.onnx"))
    light = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
    onnx_files += sorted(glob.glob(str(light / "light_*.onnx")))
    for f in onnx_files:
        yield f"onnx:{Path(f).stem}", (lambda f=f: taso_jax.load_onnx(f))
    from models import MODELS as TASO

    for name, mod in TASO.items():
        yield f"taso:{name}:small", (lambda mod=mod: mod.build(**mod.SMALL))
        if name in ("resnet50", "resnext50", "nasrnn", "bert_large", "inception_v3"):
            yield f"taso:{name}", (lambda mod=mod: mod.build())
    import transformer_models as tm

    for name, make in tm.MODELS.items():
        for seq in (256, 1024):
            yield f"jax:{name}:{seq}", (lambda make=make, seq=seq: _from_jax(make(seq=seq)))
    import jax_models as jm

    for name, make in jm.MODELS.items():
        yield f"jax:{name}", (lambda make=make: _from_jax(make()))


def _from_jax(made):
    import taso_jax

    fn, weights, inputs = made
    return taso_jax.from_jax(fn, weights, *inputs, weight_argnums=0)


def record_kernels(graph, seconds: float, n_rewrites: int, rng: random.Random):
    """The kernels a short search of ``graph`` prices, and some single rewrites of it.

    Returns ``(kernels: key -> node, rewrites: [(rule name, new keys, removed keys)])``.
    """
    import jax
    from taso_jax.search import backtracking_search
    from taso_jax.search.calibrated import CalibratedCostModel
    from taso_jax.search.cost import AnalyticCostModel, MeasuredCostModel
    from taso_jax.search.match import find_matches, prepare
    from taso_jax.search.options import usable_rules
    from taso_jax.search.rules import default_substitutions

    from taso_jax.ir.layout import nhwc_form

    kernels: dict = {}
    helper = CalibratedCostModel(cache_path=False, nhwc_convolutions=False)
    # a rewrite's sides as the search prices them: on XLA:CPU, convolutions in NHWC
    searched = CalibratedCostModel(cache_path=False,
                                   nhwc_convolutions=jax.default_backend() == "cpu")

    def note(node):
        for k in helper.kernels(node):
            kernels.setdefault(MeasuredCostModel.key(k), k)
            if k.op == "conv2d":
                nk = nhwc_form(k)
                kernels.setdefault(MeasuredCostModel.key(nk), nk)

    class Recording(AnalyticCostModel):
        def _price(self, node, measure_until):
            note(node)
            return super()._price(node, measure_until)

    model = Recording.for_backend()
    rules, _ = usable_rules(default_substitutions(), False)
    backtracking_search(graph, rules, model, budget=20, time_limit=seconds, keep=2)
    rewrites = []
    nodes = graph.node_set
    found = []
    t_end = time.perf_counter() + seconds
    for rule in rules:
        if time.perf_counter() > t_end:
            break
        if not all(p.op in graph.by_op for p in rule.source):
            continue
        for m in find_matches(rule, graph, deadline=t_end):
            found.append((rule, m))
    rng.shuffle(found)
    for rule, m in found:
        if len(rewrites) >= n_rewrites:
            break
        rw = prepare(rule, graph, m)
        if not rw:
            continue
        created = set(rw.created)
        new = [n for n in created if n not in nodes and not n.weight_only]
        gone = [n for n in set(rw.match.nodes) if n not in created and not n.weight_only]
        keys = ([], [])
        for side, out in ((new, keys[0]), (gone, keys[1])):
            for n in side:
                for k in searched.kernels(n):
                    key = MeasuredCostModel.key(k)
                    kernels.setdefault(key, k)
                    out.append(key)
        if keys[0] or keys[1]:
            rewrites.append((rule.name, keys[0], keys[1]))
    return kernels, rewrites


def collect(args) -> int:
    from taso_jax.search.calibrated import kernel_features
    from taso_jax.search.cost import MeasuredCostModel

    out = Path(args.out)
    done = set()
    if out.exists():
        for line in out.read_text().splitlines():
            row = json.loads(line)
            done.add((row["source"], row["key"]))
    rw_path = Path(str(out) + ".rewrites.jsonl")
    measurer = MeasuredCostModel(cache_path=args.cost_cache)
    rng = random.Random(0)
    for name, make in corpus(unseen=args.unseen):
        if args.only and not any(o in name for o in args.only):
            continue
        t0 = time.perf_counter()
        try:
            graph = make()
            kernels, rewrites = record_kernels(graph, args.time_per_model,
                                               args.rewrites if held_out(name) else 0,
                                               random.Random(name))
        except Exception as e:  # noqa: BLE001 - a model that does not load is skipped
            print(f"{name}: skipped ({type(e).__name__}: {str(e)[:120]})", flush=True)
            continue
        needed = {k for _, new, gone in rewrites for k in new + gone}
        keys = sorted(kernels)
        rng.shuffle(keys)
        chosen = list(dict.fromkeys([*needed, *keys[:args.per_model]]))
        timed = 0
        with out.open("a") as f:
            for key in chosen:
                if (name, key) in done:
                    continue
                node = kernels[key]
                refused = len(measurer.unmeasurable)
                try:
                    price = measurer._cost(node)
                except Exception:  # noqa: BLE001
                    traceback.print_exc(limit=1)
                    continue
                if len(measurer.unmeasurable) > refused:  # priced analytically: no sample
                    continue
                s = kernel_features(node, price, name)
                f.write(json.dumps({**s.to_json(), "key": key}) + "\n")
                f.flush()
                timed += 1
        if rewrites:
            with rw_path.open("a") as f:
                for rule, new, gone in rewrites:
                    f.write(json.dumps({"source": name, "rule": rule, "new": new,
                                        "gone": gone}) + "\n")
        print(f"{name}: {len(graph.nodes)} nodes, {len(kernels)} kernels priced, "
              f"{timed} timed, {len(rewrites)} rewrites, {time.perf_counter() - t0:.1f} s",
              flush=True)
    return 0


def read_lines(path) -> list[str]:
    """The non-empty lines of a text file, gzip-compressed where its name ends in ``.gz``
    (the collections kept in ``benchmarks/data/``)."""
    import gzip

    p = Path(path)
    text = gzip.decompress(p.read_bytes()).decode() if p.suffix == ".gz" else p.read_text()
    return [line for line in text.splitlines() if line.strip()]


def rewrites_path(path) -> Path:
    """The rewrites file beside a collection: ``K.jsonl.rewrites.jsonl``, or for a
    compressed ``K.jsonl.gz``, ``K.jsonl.rewrites.jsonl.gz``."""
    p = str(path)
    return Path(p[:-3] + ".rewrites.jsonl.gz") if p.endswith(".gz") else \
        Path(p + ".rewrites.jsonl")


def read_samples(path: str):
    """The samples of a ``collect`` output, as :class:`KernelSample` with their keys."""
    from taso_jax.ops import ShapeError
    from taso_jax.search.calibrated import KernelSample

    rows, refused = [], 0
    for line in read_lines(path):
        r = json.loads(line)
        if "rows" not in r:  # collected before outputs, groups, product sizes were recorded
            try:
                r.update(_features_of(r["key"]))
            except ShapeError:  # a form the operator no longer takes (im2col past MAX_TAPS)
                refused += 1
                continue
        rows.append(r)
    if refused:
        print(f"{path}: {refused} kernels skipped, of forms their operators now refuse",
              file=sys.stderr)
    return [(KernelSample(**{k: v for k, v in r.items() if k != "key"}), r["key"])
            for r in rows]


def _features_of(key: str) -> dict:
    """Output elements, ``groups`` and product sizes of the kernel a cost-cache key names."""
    from taso_jax.search.calibrated import kernel_features

    s = kernel_features(kernel_node(key))
    return {"outputs": s.outputs, "groups": s.groups, "rows": s.rows, "inner": s.inner,
            "cols": s.cols}


def _host() -> str:
    """The machine the kernels were timed on: its processor's model name and core count."""
    import os
    import platform

    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores"


def fit(args) -> int:
    import jax
    from taso_jax.search.calibrated import Calibration, write_samples
    from taso_jax.search.cost import AnalyticCostModel

    samples = [s for s, _ in read_samples(args.samples)]
    # the shipped curves fit the development set too; the unseen models never
    train = [s for s in samples if not s.source.startswith("unseen:")]
    cal = Calibration.fit(train, AnalyticCostModel.for_backend())
    for k, v in cal.summary().items():
        print(f"{k:40s} n={v['n']:7.1f} sigma={v['sigma']:.3f}")
    if args.write:
        dev = jax.devices()[0]
        write_samples(args.write, train, {
            "device": f"{dev.platform}:{getattr(dev, 'device_kind', dev.platform)}",
            "measured": time.strftime("%Y-%m-%d"),
            "host": _host(),
            "models": sorted({s.source for s in train}),
            "unseen": sorted({s.source for s in samples if s.source.startswith("unseen:")}),
            "how": "benchmarks/calibrate.py collect, then fit"})
        print(f"wrote {len(train)} samples to {args.write}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--out", required=True)
    c.add_argument("--cost-cache", default=None)
    c.add_argument("--per-model", type=int, default=40)
    c.add_argument("--rewrites", type=int, default=12)
    c.add_argument("--time-per-model", type=float, default=10.0)
    c.add_argument("--only", nargs="*")
    c.add_argument("--unseen", help="a folder of ONNX models to collect instead of the corpus "
                                    "(the test set: named unseen:<stem>, never fitted)")
    r = sub.add_parser("retime")
    r.add_argument("samples")
    r.add_argument("--out", required=True)
    r.add_argument("--ops", help="comma-separated operators to time again (default: all)")
    f = sub.add_parser("fit")
    f.add_argument("samples")
    f.add_argument("--write")
    args = ap.parse_args(argv)
    return {"collect": collect, "retime": retime, "fit": fit}[args.cmd](args)


def retime(args) -> int:
    """Time the kernels of a ``collect`` output again; write the rows with their new prices."""
    from taso_jax.search.cost import MeasuredCostModel

    out = Path(args.out)
    if out.resolve() == Path(args.samples).resolve():
        raise SystemExit("calibrate.py retime: --out must not be the input file")
    ops = set(args.ops.split(",")) if args.ops else None
    measurer = MeasuredCostModel(cache_path=False)
    prices: dict[str, float] = {}
    rows = [json.loads(line) for line in read_lines(args.samples)]
    t0 = time.perf_counter()
    tmp = out.with_name(out.name + ".part")
    with tmp.open("w") as f:
        for row in rows:
            key = row["key"]
            if (ops is None or row["op"] in ops) and key not in prices:
                try:
                    prices[key] = measurer._cost(kernel_node(key))
                except Exception as e:  # noqa: BLE001 - a form its operator now refuses
                    print(f"not timed again: {key[:80]} ({str(e)[:80]})", file=sys.stderr)
                    prices[key] = row["micros"]
            f.write(json.dumps({**row, "micros": prices.get(key, row["micros"])}) + "\n")
    tmp.replace(out)
    rewrites = rewrites_path(args.samples)
    if rewrites.exists():
        Path(str(out) + ".rewrites.jsonl").write_text("\n".join(read_lines(rewrites)) + "\n")
    print(f"{len(prices)} kernels timed again in {time.perf_counter() - t0:.0f} s; wrote {out}")
    return 0


def parse_key(key: str) -> tuple:
    """``(operator, attributes as pairs, input TensorTypes)`` of a cost-cache key."""
    from taso_jax.ops import TensorType

    return eval(key, {"TensorType": TensorType, "inf": math.inf, "nan": math.nan})  # noqa: S307 - our own keys


def kernel_node(key: str):
    """The kernel a cost-cache key names, on placeholder inputs (for timing it again)."""
    from taso_jax.ir.graph import leaf_node, make_node

    op, attrs, ins = parse_key(key)
    leaves = [leaf_node("input", f"x{i}", t) for i, t in enumerate(ins)]
    return make_node(op, [n.outputs[0] for n in leaves], dict(attrs))


if __name__ == "__main__":
    sys.exit(main())
