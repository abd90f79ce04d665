"""The greedy descent that precedes the backtracking search: strictly cheaper rewrites first.

:func:`greedy_descent` takes every rewrite that pays, first found first (the rules that
only change one node's attributes last, and the cheapest of them:
:func:`_cheapest_alternative`); where none does, a pair (a sideways rewrite that enables a
cheaper one: :func:`_pair_step`), or a chain (one rule applied several times in a row to
one node: :func:`_chain_step`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from taso_jax.search._incremental import _carry_table, _Change, _near, _reach
from taso_jax.search._rewrites import SearchState, _cheaper, _estimate, _prepared, _relevant
from taso_jax.search.cost import CostModel
from taso_jax.search.match import find_matches, prepare
from taso_jax.search.rules import Substitution

from taso_jax.ir.graph import LEAF_OPS, Graph, Tensor, intern_node, leaf_node

__all__ = ["greedy_descent", "CHAIN_DEPTH"]


def _pair_step(graph, cost, substitutions, cost_model, alpha, deadline, state: SearchState,
               max_tries: int = 64, table: dict | None = None,
               measure_until: float | None = None, alternatives: dict | None = None):
    """One sideways rewrite (cost within ``alpha``) that enables a strictly cheaper one.

    The second rewrite is looked for only near the nodes the first one created, so a try
    costs little. This is what folds a shift-then-scale (``(y + a) * b``, as flax writes
    batchnorm) into a convolution: distributing is cost-neutral, the fold that follows is
    not. At most ``max_tries`` sideways rewrites are tried (pairs that worked earlier in
    this search come first), of rules whose targets some rule's source can continue from;
    ``table`` holds each rule's matches in ``graph`` where known (by rule id, as
    :func:`greedy_descent` keeps them). Returns ``(graph, cost,
    [rule1, rule2], steps)`` or ``None``; ``steps`` are the two rewrites as
    ``(graph before, graph after, mapping, rebuilt)``, for carrying matches across them.
    Rules that only change a node's attributes (``alternatives``: rule id -> the others of
    its operator) are tried as the second rewrite after the others, and the cheapest of
    them is taken (:func:`_cheapest_alternative`).
    No rewrite is looked at past ``deadline``, no kernel measured past ``measure_until``
    (``time.perf_counter()`` values).
    """
    tries = 0
    old = graph.node_set
    target = cost * (1 - 1e-9)
    hits = state.pair_hits
    # A rule none of whose target operators starts any rule's source enables nothing (the
    # lowerings such as conv2d_taps, ties under the analytic model: on NasNet-A their
    # rewrites used up every try); it is not tried sideways.
    starts = {p.op for s in substitutions for p in s.source}
    first = [s for s in _relevant(substitutions, graph)
             if any(p.op in starts for p in s.target)]
    first.sort(key=lambda s: -hits[s.id])
    table = table or {}
    for sub in first:
        for rw, g1, c1, rebuilt1 in _cheaper(graph, cost, sub, cost_model,
                                             alpha * cost * (1 + 1e-9), state,
                                             matches=table.get(sub.id), deadline=deadline,
                                             measure_until=measure_until):
            tries += 1
            if time.perf_counter() > deadline or tries > max_tries:
                return None
            if c1 > alpha * cost:
                continue
            new = {n for n in rw.created if n not in old}
            if not new:
                continue
            near = _near(g1, new, radius=4)
            # Whether a second rewrite pays depends on these nodes alone: its match holds a
            # new node and lies within the radius (it spans at most 3 edges, and whether a
            # node it rewrites has other readers is seen one edge further), and its cost
            # change is local. The same nodes around the same rewrite fail again: on
            # NasNet-A, 69% of the sideways rewrites tried were such repeats.
            failed = (sub.id, frozenset(near))
            if failed in state.pair_failed:
                continue
            new_ops = {n.op for n in new}
            near_ops = {n.op for n in near}
            # matched near the new nodes: a rule's first source node is bound among them
            second = [s for s in _relevant(substitutions, g1)
                      if s.source[0].op in near_ops and any(p.op in new_ops for p in s.source)]
            # lowerings last: a rule that changes the structure matches the naive form
            second.sort(key=lambda s: (s.id in (alternatives or {}), -hits[s.id]))
            for sub2 in second:
                for rw2, g2, c2, rebuilt2 in _cheaper(g1, c1, sub2, cost_model, target, state,
                                                      near, deadline=deadline,
                                                      measure_until=measure_until):
                    if new & set(rw2.match.nodes) and c2 < target:
                        hits[sub.id] += 1
                        hits[sub2.id] += 1
                        mapping2 = rw2.mapping
                        if (alternatives or {}).get(sub2.id):
                            chosen = _cheapest_alternative(
                                g1, rw2.match.nodes[0], (sub2, g2, c2, mapping2, rebuilt2),
                                alternatives[sub2.id], cost_model, state, measure_until)
                            if chosen is None or chosen[2] >= target:
                                continue
                            sub2, g2, c2, mapping2, rebuilt2 = chosen
                        return g2, c2, [sub, sub2], [
                            (graph, g1, rw.mapping, rebuilt1), (g1, g2, mapping2, rebuilt2)]
            state.pair_failed.add(failed)
    return None


#: The most times :func:`_chain_step` applies one rule in a row to the node it rewrote: a
#: depthwise convolution over 176 channels halves its groups four times to reach 11.
CHAIN_DEPTH = 8


def _chainable(sub: Substitution) -> bool:
    """Whether ``sub`` rewrites one node into one of the same operator, which it may match.

    Halving a convolution's groups (``expand-conv2d-2``) is such a rule.
    """
    return len(sub.source) == 1 and any(t.op == sub.source[0].op for t in sub.target)


def _chain_step(graph: Graph, cost: float, sub: Substitution, matches: list,
                cost_model: CostModel, state: SearchState, memo: dict,
                rivals: Sequence[Substitution] = (), depth: int = CHAIN_DEPTH,
                measure_until: float | None = None):
    """``sub`` applied ``k`` times in a row to one node, where the ``k``-th form is cheapest.

    Each step rewrites the node the last one created (:func:`_chainable`), so one halving
    at a time reaches every group count of a convolution; the form kept is the cheapest
    of the chain (``k`` steps, ``k <= depth``), at whatever price the steps between. A
    chain is not taken where one rewrite of the node by a rule of ``rivals`` (other rules
    of one source node) is estimated as cheap (halving a 32-group convolution five times
    ends in the dense form that ``expand-conv2d`` makes in one step). Why chains:
    docs/benchmarks.md, "Why the search and choice work as they do".

    ``matches`` are ``sub``'s matches in ``graph``; ``cost`` is its cost in microseconds.
    The chain runs on a copy of the node alone, on leaves of its input types
    (:func:`_chain_on_copy`), and its last form is built into ``graph`` in one rewrite (a
    chain changes only its node's price). ``memo`` maps ``(rule id, kernel signature)`` to
    the length of the chain taken, 0 where none was: prices never change, so a kernel met
    again is not tried again. Returns ``(graph, cost, rules, steps)`` as :func:`_pair_step`
    does (one step), or ``None``. Kernels are measured until ``measure_until`` (a
    ``time.perf_counter()`` value).
    """
    for m in matches:
        node = m.nodes[0]
        key = (sub.id, cost_model.signature(node))
        if memo.get(key) == 0 or len(node.outputs) != 1:
            continue
        k, delta, form = _chain_on_copy(node, sub, cost_model, state,
                                        depth if key not in memo else memo[key], measure_until)
        if k and key not in memo and _rival_as_cheap(graph, cost, node, rivals, cost + delta,
                                                      cost_model, state, measure_until):
            k = 0
        memo[key] = k
        if k:  # only the node's price changes (an upper bound if its form reads less)
            mapping = {node.outputs[0]: form}
            rebuilt: dict = {}
            g2 = graph.replace(mapping, rebuilt)
            return g2, cost + delta, [sub] * k, [(graph, g2, mapping, rebuilt)]
    return None


def _chain_on_copy(node, sub: Substitution, cost_model: CostModel, state: SearchState,
                   depth: int, measure_until: float | None = None
                   ) -> tuple[int, float, Tensor | None]:
    """``(k, price change in us, output)``: the cheapest of ``sub``'s chain on ``node``.

    The chain runs on a copy of ``node`` built on leaves of its input types (weights
    where the input is weight-only), one step per rewrite of the node the last step made,
    up to ``depth`` steps. A form whose kernel is not measured yet and whose floor
    (:meth:`~taso_jax.search.cost.CostModel.node_floor`, its arithmetic at the device's peak)
    is no cheaper than the best form so far ends the chain unmeasured: each halving doubles
    the arithmetic, so no form past it can pay (a depthwise convolution over 256 channels is
    not timed in its dense form). The cheapest form, if cheaper than ``node``, is rebuilt on
    ``node``'s own inputs: ``output`` replaces ``node``'s output. ``k`` is 0, and
    ``output`` ``None``, where no form is cheaper.
    """
    leaves = [leaf_node("weight" if t.node.weight_only else "input", f"chain_{i}", t.type)
              for i, t in enumerate(node.inputs)]
    copy = intern_node(node.op, node.attrs, tuple(n.outputs[0] for n in leaves), node.types)
    g = Graph(tuple(n for n in leaves if n.op == "input"), (copy.outputs[0],), ("y",))
    base = cost_model.graph_cost(g, measure_until)
    best, forms = (base * (1 - 1e-9), 0), [g]
    match = next(iter(find_matches(sub, g, state.matching, near={copy})), None)
    for k in range(1, depth + 1):
        rw = prepare(sub, g, match, state.matching) if match is not None else None
        if not rw:
            break
        g2 = g.replace(rw.mapping)
        if g2.key == g.key:
            break
        forms.append(g2)
        new = [n for n in g2.nodes if not n.weight_only and n.op not in LEAF_OPS]
        if any(cost_model.would_measure(n, measure_until) for n in new) and \
                sum(cost_model.node_floor(n, measure_until) for n in new) >= best[0]:
            break  # not timed: no cheaper at its arithmetic's floor, nor the forms past it
        c2 = cost_model.graph_cost(g2, measure_until)
        if c2 < best[0]:
            best = (c2, k)
        made = {n for n in rw.created if n.op == node.op and n in g2.node_set}
        if {cost_model.signature(n) for n in made} == {cost_model.signature(match.nodes[0])}:
            break  # the same kernel again (a dense convolution "made dense")
        g, match = g2, (next(iter(find_matches(sub, g2, state.matching, near=made)), None)
                        if k < depth else None)
    c, k = best
    if not k:
        return 0, 0.0, None
    on_node = forms[k].replace({leaf.outputs[0]: t for leaf, t in zip(leaves, node.inputs,
                                                                       strict=True)})
    return k, c - base, on_node.outputs[0]


def _rival_as_cheap(graph: Graph, cost: float, node, rivals: Sequence[Substitution],
                    price: float, cost_model: CostModel, state: SearchState,
                    measure_until: float | None = None) -> bool:
    """Whether one rewrite of ``node`` by a rule of ``rivals`` is as cheap as a chain.

    As cheap: estimated (:func:`_estimate`) at ``price`` microseconds or less, the whole
    graph's cost.
    """
    for rival in rivals:
        for m in find_matches(rival, graph, state.matching, near={node}):
            rw = prepare(rival, graph, m, state.matching) if m.nodes[0] is node else None
            if rw and _estimate(graph, cost, rw, cost_model,
                                measure_until=measure_until) <= price * (1 + 1e-9):
                return True
    return False


def _alternative(sub: Substitution) -> bool:
    """Whether ``sub`` only picks another form of one node.

    That is: one source node, rewritten into one node on the same inputs, of the same
    operator (a lowering chosen by ``impl``: attention in query blocks) or of another (a
    convolution as columns and a product, or as its kernel taps). The forms of a node
    exclude each other.
    """
    return (len(sub.source) == 1 and len(sub.target) == 1
            and sub.target[0].inputs == sub.source[0].inputs)


def _settle(graph: Graph, alternatives: dict, cost_model: CostModel, state: SearchState,
            settled: set, deadline: float) -> bool:
    """Let a cost model that can time close calls (``refine``) settle each node's forms.

    For each runtime node not ``settled`` yet that rules of ``alternatives`` (rule id ->
    the other rules of its operator) rewrite into another form, dearest node first, the
    cost model is given the forms: the node, and what each rule's rewrite adds
    (:meth:`~taso_jax.search.calibrated.CalibratedCostModel.refine`). It times those whose
    prices lie within its uncertainty of each other, within its compile budget. Returns
    whether any price changed. A cost model without ``refine`` is left alone.
    """
    refine = getattr(cost_model, "refine", None)
    if refine is None or not alternatives:
        return False
    rules: dict[str, list] = {}
    for others in alternatives.values():
        for r in others:
            rules.setdefault(r.source[0].op, [])
            if r not in rules[r.source[0].op]:
                rules[r.source[0].op].append(r)
    nodes = [n for n in graph.nodes if n.op in rules and n not in settled
             and not n.weight_only]
    nodes.sort(key=lambda n: -cost_model.node_cost(n))
    changed = False
    old = graph.node_set
    for node in nodes:
        if time.perf_counter() > deadline:
            break
        settled.add(node)
        forms = [[node]]
        for rule in rules[node.op]:
            for m in find_matches(rule, graph, state.matching, near={node}):
                rw = prepare(rule, graph, m, state.matching) if m.nodes[0] is node else None
                if rw:
                    forms.append([n for n in rw.created if n not in old
                                  and not n.weight_only])
        if len(forms) > 1 and refine(forms, until=deadline):
            changed = True
    return changed


def _cheapest_alternative(graph: Graph, node, found: tuple, others: Sequence[Substitution],
                          cost_model: CostModel, state: SearchState,
                          measure_until: float | None = None) -> tuple:
    """The cheapest of ``found`` and the rewrites of ``node`` by ``others``.

    ``found`` is ``(rule, graph after, cost after, mapping, rebuilt)`` for a rewrite of
    ``node`` that pays (what :meth:`Graph.replace` took and filled), and so is the result.
    ``others`` are the rules that change the same operator's attributes alone
    (:func:`_alternative`): mutually exclusive forms of one node (attention lowered in
    query blocks of 128, 256 or 512 rows). Taken first found first, the descent kept
    blocks of 64, 1.16x, where blocks of 128 ran 1.55x (causal attention, S=1024, XLA:CPU). Each
    alternative's kernel is measured until ``measure_until``; past it, an alternative whose
    kernel is not measured yet is passed over, as its analytic price does not compare with
    measured ones.

    A cost model that can settle close calls by measurement (``refine``:
    :meth:`~taso_jax.search.calibrated.CalibratedCostModel.refine`) is given the forms
    (the node as it is, and what each alternative adds); where it revised their prices,
    they are compared again, and ``None`` is returned when no alternative is now cheaper
    than ``graph`` (the caller prices ``graph`` again).
    """
    forms = [(found, _added(graph, found[1], cost_model))]
    for other in others:
        for m in find_matches(other, graph, state.matching, near={node}):
            rw = prepare(other, graph, m, state.matching) if m.nodes[0] is node else None
            if not rw or (measure_until is not None and time.perf_counter() > measure_until
                          and any(cost_model.would_measure(n) for n in rw.created)):
                continue
            rebuilt: dict = {}
            g2 = graph.replace(rw.mapping, rebuilt)
            c2 = cost_model.graph_cost(g2, measure_until)
            forms.append(((other, g2, c2, rw.mapping, rebuilt),
                          _added(graph, g2, cost_model)))
    refine = getattr(cost_model, "refine", None)
    if refine is not None and refine([[node], *(added for _, added in forms)],
                                     until=measure_until):
        base = cost_model.graph_cost(graph, measure_until)
        forms = [((r, g2, cost_model.graph_cost(g2, measure_until), mp, rb), added)
                 for (r, g2, _, mp, rb), added in forms]
        best = min((f for f, _ in forms), key=lambda f: f[2])
        return best if best[2] < base * (1 - 1e-9) else None
    best = found
    for f, _ in forms[1:]:
        if f[2] < best[2] * (1 - 1e-9):
            best = f
    return best


def _added(graph: Graph, after: Graph, cost_model: CostModel) -> list:
    """The runtime nodes of ``after`` whose kernels ``graph`` lacks.

    Nodes rebuilt downstream of a rewrite keep their signature and are left out: they cost
    the same in every form of the node rewritten.
    """
    old = graph.node_set
    sigs = {cost_model.signature(n) for n in graph.nodes}
    return [n for n in after.nodes if n not in old and not n.weight_only
            and n.op not in LEAF_OPS and cost_model.signature(n) not in sigs]


def greedy_descent(graph: Graph, substitutions: Sequence[Substitution], cost_model: CostModel,
                   time_limit: float, state: SearchState | None = None, alpha: float = 1.05,
                   on_step: Callable[[float, Graph, tuple], None] | None = None,
                   measure_until: float | None = None) -> tuple[Graph, float, list[str]]:
    """Apply strictly cost-reducing rewrites, first found first, until none is left.

    Large models contain the same pattern many times (one batchnorm per convolution); the
    backtracking search would spend one expansion on each. This descent takes them all in
    one pass, and the search then explores from its result. When no single rewrite is
    cheaper, it looks for a pair: a sideways rewrite (within ``alpha``) followed, near the
    nodes it created, by a cheaper one (see ``_pair_step``). A rule that rewrites one node
    into its own operator (halving a convolution's groups) is also run several times in a
    row on one node where the last form is cheaper, whatever the forms between cost
    (``_chain_step``). Returns the graph, its cost and the names of the substitutions
    applied, in order; ``on_step(cost, graph, names)`` is called after each step. ``state``
    is the search's (a fresh one when ``None``). Kernels not yet priced are measured until
    ``measure_until`` (a ``time.perf_counter()`` value; the search's own deadline, which
    outlasts the descent's ``time_limit``), and priced analytically after it.
    """
    report = None if on_step is None else (
        lambda c, g, rules: on_step(c, g, tuple(r.name for r in rules)))
    graph, cost, rules = _descend(graph, substitutions, cost_model, time_limit, state, alpha,
                                  report, measure_until)
    return graph, cost, [r.name for r in rules]


def _descend(graph: Graph, substitutions: Sequence[Substitution], cost_model: CostModel,
             time_limit: float, state: SearchState | None = None, alpha: float = 1.05,
             on_step: Callable[[float, Graph, tuple], None] | None = None,
             measure_until: float | None = None, stop: Callable[[], bool] | None = None
             ) -> tuple[Graph, float, list[Substitution]]:
    """:func:`greedy_descent`, the rules applied given as records (for their ids), not names.

    ``on_step(cost, graph, rules)`` is called after each step with the rules applied so far;
    ``stop()`` (optional) ends the descent before its next pass when it says so.
    """
    descent = _Descent(graph, substitutions, cost_model, time.perf_counter() + time_limit,
                       state if state is not None else SearchState(), alpha, on_step,
                       measure_until)
    while descent.improved and time.perf_counter() < descent.deadline and not (
            stop is not None and stop()):
        descent.one_pass()
    return descent.graph, descent.cost, descent.applied


class _Descent:
    """The state of one greedy descent (:func:`_descend`) and its steps.

    ``table`` holds the matches per rule id in the current graph, carried across each
    rewrite (:func:`_incremental_matches`) instead of found again over the whole graph.
    """

    def __init__(self, graph: Graph, substitutions: Sequence[Substitution],
                 cost_model: CostModel, deadline: float, state: SearchState, alpha: float,
                 on_step, measure_until: float | None):
        self.graph, self.substitutions, self.cost_model = graph, substitutions, cost_model
        self.deadline, self.state, self.alpha = deadline, state, alpha
        self.on_step, self.measure_until = on_step, measure_until
        self.cost = cost_model.graph_cost(graph, measure_until)
        self.applied: list[Substitution] = []
        self.reach = {sub.id: _reach(sub) for sub in substitutions}
        self.by_id = {sub.id: sub for sub in substitutions}
        self.table: dict[str, list] = {}
        self.refused: set = set()  # matches that did not pay (see _prepared)
        self.memo: dict = {}  # (rule id, kernel signature) -> its chain's length (_chain_step)
        # chainable rule's id -> the other rules of one source node of its operator
        self.rivals = {sub.id: [r for r in substitutions if r.id != sub.id
                                and len(r.source) == 1 and r.source[0].op == sub.source[0].op]
                       for sub in substitutions if _chainable(sub)}
        # attribute-only rule's id -> the others of its operator (_cheapest_alternative)
        self.alternatives = {sub.id: [r for r in substitutions if r.id != sub.id
                                      and _alternative(r)
                                      and r.source[0].op == sub.source[0].op]
                             for sub in substitutions if _alternative(sub)}
        self.settled: set = set()  # nodes whose forms the cost model has settled (_settle)
        self.improved = True

    def one_pass(self) -> None:
        """Settle forms, apply every paying rewrite of every rule, else try a pair of them."""
        self.improved = False
        if _settle(self.graph, {k: v + [self.by_id[k]] for k, v in self.alternatives.items()},
                   self.cost_model, self.state, self.settled, self.deadline):
            self.cost = self.cost_model.graph_cost(self.graph, self.measure_until)
            self.refused.clear()  # a match refused at its old prices may pay now
        # Rules that only pick a node's form (lowerings) come after those that change the
        # structure, which match the naive form: a causal GQA lowered to query blocks first
        # kept its repeated K/V heads (1.97x, where the grouped form ran 2.5x).
        for sub in sorted(_relevant(self.substitutions, self.graph),
                          key=lambda r: r.id in self.alternatives):
            self.apply_rule(sub)
        if not self.improved:
            self.pair_step()

    def apply_rule(self, sub: Substitution) -> None:
        """Apply ``sub`` where it pays, again and again, until it pays nowhere.

        A rule's rewrites come in runs (NasNet-A at 4x depth: 314 rewrites, 3 runs); during
        a run only its own matches are read, and the other rules' are carried across the
        whole run at once (``run``: the change its rewrites made so far, composed).
        """
        run = None
        while time.perf_counter() < self.deadline:
            matches = self.table.get(sub.id)
            if matches is None:
                matches = self.table[sub.id] = list(find_matches(
                    sub, self.graph, self.state.matching, deadline=self.deadline))
            found = self._paying_step(sub, matches)
            if found is None:
                break
            step, g2, c2, taken, before = found
            self.applied += before
            run = step if run is None else run.then(step, g2.node_set)
            self.table[sub.id] = _carry_table({sub.id: matches}, step, g2, self.reach,
                                              self.by_id, self.state).get(sub.id)
            self.graph.forget_caches()  # a step behind: kept for the choice only
            self._moved(g2, c2, [taken])
        if run is not None:
            own = self.table.pop(sub.id)
            self.table = _carry_table(self.table, run, self.graph, self.reach, self.by_id,
                                      self.state)
            if own is not None:
                self.table[sub.id] = own

    def _paying_step(self, sub: Substitution, matches: list):
        """``(step, graph, cost, rule taken, rules applied before it)`` or ``None``.

        The first rewrite of ``sub`` that lowers the cost (for a rule that picks a node's
        form, the cheapest of that node's forms); where no single rewrite pays, a run of
        them on one node (:func:`_chain_step`).
        """
        graph, cm, mu = self.graph, self.cost_model, self.measure_until
        for rw, _ in _prepared(graph, self.cost, sub, cm, self.cost * (1 - 1e-9), self.state,
                               matches=matches, refused=self.refused, deadline=self.deadline,
                               measure_until=mu):
            rebuilt: dict = {}
            g2 = graph.replace(rw.mapping, rebuilt)
            c2 = cm.graph_cost(g2, mu)
            if c2 >= self.cost * (1 - 1e-9):
                continue
            taken, mapping = sub, rw.mapping
            if self.alternatives.get(sub.id):
                chosen = _cheapest_alternative(
                    graph, rw.match.nodes[0], (sub, g2, c2, mapping, rebuilt),
                    self.alternatives[sub.id], cm, self.state, mu)
                if chosen is None:  # measured: the node's own form is cheapest
                    self.cost = cm.graph_cost(graph, mu)
                    continue
                taken, g2, c2, mapping, rebuilt = chosen
            return _Change(graph, g2, mapping, rebuilt), g2, c2, taken, []
        if sub.id not in self.rivals:
            return None
        chain = _chain_step(graph, self.cost, sub, matches, cm, self.state, self.memo,
                            self.rivals[sub.id], measure_until=mu)
        if chain is None:
            return None
        g2, c2, rules, ((before, after, mapping, rebuilt),) = chain
        return _Change(before, after, mapping, rebuilt), g2, c2, sub, list(rules[:-1])

    def _moved(self, graph: Graph, cost: float, rules: list[Substitution]) -> None:
        """The descent is at ``graph`` now, having applied ``rules`` last."""
        self.graph, self.cost = graph, cost
        self.applied += rules
        self.improved = True
        if self.on_step:
            self.on_step(cost, graph, tuple(self.applied))

    def pair_step(self) -> None:
        """Two rewrites that pay together where none pays alone (:func:`_pair_step`)."""
        step = _pair_step(self.graph, self.cost, self.substitutions, self.cost_model,
                          self.alpha, self.deadline, self.state, table=self.table,
                          measure_until=self.measure_until, alternatives=self.alternatives)
        if step is None:
            return
        (g0, g1, m1, r1), (_, g2, m2, r2) = step[3]  # matches, two rewrites on
        both = _Change(g0, g1, m1, r1).then(_Change(g1, g2, m2, r2), g2.node_set)
        self.table = _carry_table(self.table, both, step[0], self.reach, self.by_id,
                                  self.state)
        g0.forget_caches()
        g1.forget_caches()
        self._moved(step[0], step[1], list(step[2]))
