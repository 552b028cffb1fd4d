"""The search strategy: Optuna's multi-objective ask/tell over the space's axes, then a race of the front's top.

Objectives (speed, accuracy, memory by default) are what each trial measures; the accuracy gate, the SLO and the
memory limit are *measured* constraints, set on each trial with `trial.set_constraint` (Optuna 5; its
`constraints_func` is deprecated) before `tell`, so the sampler learns where the feasible region is. The
accuracy constraint is the chain's paired gate (accuracy.py) against the baseline's per-item answers: worse
(the drop is shown beyond max_drop) is infeasible; undecided stays feasible for the sampler, and is decided on
more items before anything is called best. A batch of `batch` asks is measured at once (constant-liar TPE
keeps the pending ones apart).

What the sampler is told: a measured configuration, its values (COMPLETE); a proposal validation refuses, a
penalty and a violated `refused` constraint (COMPLETE: Optuna 5's TPE models COMPLETE, PRUNED and RUNNING
trials only, so a FAIL would teach it nothing and it would keep proposing the refused region); a proposal the
cost model predicts to be dominated on every objective, PRUNED with its reason; a duplicate proposal of a
decided point, FAIL (nothing new: told again as COMPLETE it would count twice toward the startup trials).
A measurement flagged for machine load decides nothing: it is measured once more, else dropped.

The study lives in an RDB storage (a sqlite file beside the tracking store), so a rerun loads it and continues.

The result: the Pareto front of the feasible trials (each value with its 95% interval) and the best: the front's
fastest by median raced against the next ones as interleaved pairs judged by the chain's own rule
(Chain.measure_pair), and its accuracy gate decided on more items.
"""
from __future__ import annotations

import itertools
import json
import math
import random
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Optional, Sequence

from .accuracy import HOLDS, UNDECIDED, WORSE, PairedAccuracy, items_of, paired_accuracy
from .chain import Chain, baseline_of
from .decide import limit_violations, loaded
from .measurement import EVAL_LIMIT, Measure, Measurement, Point, Request, describe, point_key, spent
from .objective import TERMS, Objective
from .types import ACCEPTED, Budget, Rules

MINIMIZE, MAXIMIZE = "minimize", "maximize"
ACCURACY = "accuracy"
GOALS = tuple(TERMS) + (ACCURACY,)
REFUSED = "refused"  # the constraint a configuration validation refuses carries
RACE_SIZE = 3  # front members raced for "best": the fastest by median and the next two


def direction(goal: str) -> str:
    if goal == ACCURACY:
        return MAXIMIZE
    return MAXIMIZE if TERMS[goal].higher_is_better else MINIMIZE


def accuracy_value(m: Measurement) -> Optional[float]:
    """Mean task score over the trial's tasks (`task_score.<task>`), else over its per-item results."""
    scores = [v for k, v in m.metrics.items() if k.startswith("task_score.") and k.count(".") == 1]
    if scores:
        return sum(scores) / len(scores)
    items = [x for xs in m.correct.values() for x in items_of(xs).values()]
    return sum(items) / len(items) if items else None


def goal_value(goal: str, m: Measurement) -> Optional[float]:
    return accuracy_value(m) if goal == ACCURACY else m.metrics.get(TERMS[goal].metric)


def goal_interval(goal: str, m: Measurement) -> tuple[float, float] | None:
    if goal == ACCURACY:
        return None
    metric = TERMS[goal].metric
    lo, hi = m.metrics.get(metric + "_ci_lo"), m.metrics.get(metric + "_ci_hi")
    return (lo, hi) if lo is not None and hi is not None else None


def penalty(directions: Sequence[str]) -> list[float]:
    """Values told for a refused configuration: the worst any goal can be (its constraint marks it infeasible)."""
    return [1e18 if d == MINIMIZE else -1e18 for d in directions]


def gate_of(reference: Optional[Measurement], m: Measurement, rules: Rules) -> list[PairedAccuracy]:
    """The chain's paired gate of `m` against the reference's answers, on every task both answered."""
    if not rules.gate or reference is None:
        return []
    return [paired_accuracy(t, reference.correct[t], m.correct[t], rules.max_drop, rules.gate_alpha)
            for t in m.correct if t in reference.correct]


def constraints_of(m: Measurement, rules: Rules, gate: Sequence[PairedAccuracy] = ()) -> dict[str, float]:
    """Optuna constraints (<= 0 feasible): the paired gate (worse: the distance of its interval's top below
    -max_drop; otherwise 0), and the SLO / memory limits (decide.limit_violations: the same rule as the chain)."""
    out = dict(limit_violations(m, rules))
    if gate:
        out["accuracy_gate"] = max(0.0, max((-rules.max_drop - a.hi) if a.verdict == WORSE else 0.0 for a in gate))
    return out


@dataclass
class Evaluated:
    point: Point
    values: tuple[float, ...]
    constraints: dict[str, float]
    measurement: Optional[Measurement] = None
    intervals: tuple = ()
    config_hash: str = ""
    gate: list[PairedAccuracy] = field(default_factory=list)

    @property
    def feasible(self) -> bool:
        return all(v <= 0 for v in self.constraints.values())


def dominates(a: Sequence[float], b: Sequence[float], directions: Sequence[str]) -> bool:
    better = [(x < y) if d == MINIMIZE else (x > y) for x, y, d in zip(a, b, directions)]
    worse = [(x > y) if d == MINIMIZE else (x < y) for x, y, d in zip(a, b, directions)]
    return any(better) and not any(worse)


def pareto_front(items: Sequence[Evaluated], directions: Sequence[str]) -> list[Evaluated]:
    """The feasible items no other feasible item dominates (one per point)."""
    feas = {point_key(e.point): e for e in items if e.feasible}
    pool = list(feas.values())
    return [e for e in pool if not any(dominates(o.values, e.values, directions) for o in pool if o is not e)]


@dataclass
class Race:
    incumbent: Point
    challenger: Point
    decision: str
    reason: str


@dataclass
class SearchResult:
    goals: tuple[str, ...]
    evaluated: list[Evaluated]
    front: list[Evaluated]
    best: Optional[Evaluated]
    invalid: list[tuple[Point, str]] = field(default_factory=list)  # refused by validation: never measured
    predicted: list[tuple[Point, str]] = field(default_factory=list)  # pruned: predicted dominated on every goal
    failed: list[tuple[Point, str]] = field(default_factory=list)
    dropped: list[tuple[Point, str]] = field(default_factory=list)  # measured under load twice: decided nothing
    races: list[Race] = field(default_factory=list)  # the front's top raced for "best"
    best_note: str = ""  # how "best" was decided
    duplicates: int = 0  # proposals of an already-decided point (told FAIL, nothing measured)
    checks: int = 0  # trials spent deciding "best" (its accuracy on more items, the race), within `trials`
    trials: int = 0
    reused: int = 0
    stop: str = ""


class Search:
    def __init__(self, space: Mapping[str, list[str]], goals: Sequence[str], rules: Rules, budget: Budget,
                 measure: Measure, *, batch: int = 1, validate: Callable[[Point], list[str]] = lambda p: [],
                 predict: Callable[[Point, list[Evaluated]], str] = lambda p, done: "",
                 storage: Optional[str] = None, study_name: str = "optimize", seed: int = 0,
                 baseline: Optional[Point] = None, max_asks: int = 0, eval_limit: int = 0, echo=lambda s: None):
        self.space = {k: [str(v) for v in vs] for k, vs in space.items()}
        self.goals = tuple(goals)
        self.directions = [direction(g) for g in self.goals]
        self.rules, self.budget, self._measure = rules, budget, measure
        self.batch, self.validate, self.predict = max(1, batch), validate, predict
        self.storage, self.study_name, self.seed = storage, study_name, seed
        self.baseline = dict(baseline or baseline_of(space))
        self.max_asks = max_asks or 10 * budget.max_trials + 50
        self.eval_limit, self.echo = eval_limit, echo
        self.reference: Optional[Measurement] = None

    def _study(self):
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        sampler = optuna.samplers.TPESampler(seed=self.seed, constant_liar=True, multivariate=True,
                                             n_startup_trials=min(10, max(2, self.budget.max_trials // 3)))
        return optuna.create_study(study_name=self.study_name, storage=self.storage, directions=self.directions,
                                   sampler=sampler, load_if_exists=True)

    def _explore(self, decided: dict, pending: list[Point], res: SearchResult, rng: random.Random) -> Optional[Point]:
        """An undecided point next to the current front (one axis changed), else any undecided point."""
        taken = set(decided) | {point_key(p) for p in pending}
        fresh = [dict(zip(self.space, vs)) for vs in itertools.product(*self.space.values())]
        fresh = [q for q in fresh if point_key(q) not in taken]
        if not fresh:
            return None
        front = pareto_front(res.evaluated, self.directions)
        near = [q for q in fresh if any(sum(q[k] != e.point.get(k) for k in q) == 1 for e in front)]
        pool = near or fresh
        return pool[rng.randrange(len(pool))]

    def _run(self, requests: list[Request], res: SearchResult) -> list[list[Measurement]]:
        out = self._measure(requests)
        for ms in out:
            reused, ran = spent(ms)
            res.reused, res.trials = res.reused + reused, res.trials + ran
        return out

    def run(self) -> SearchResult:
        from optuna.distributions import CategoricalDistribution
        from optuna.trial import TrialState

        study = self._study()
        dists = {k: CategoricalDistribution(vs) for k, vs in self.space.items()}
        res = SearchResult(self.goals, [], [], None)
        decided: dict[tuple, tuple] = {}  # point -> ("done", Evaluated) | ("fail"|"pruned"|"refused", reason)
        for t in study.get_trials(deepcopy=False):  # resume
            p = {k: str(v) for k, v in t.params.items()}
            if t.state == TrialState.RUNNING:
                study.tell(t.number, state=TrialState.FAIL)  # a killed driver's: nothing RUNNING stays
            elif t.state == TrialState.COMPLETE and REFUSED in (t.constraints or {}):
                decided.setdefault(point_key(p), ("refused", t.user_attrs.get("reason", "")))
            elif t.state == TrialState.COMPLETE and point_key(p) not in decided:
                e = Evaluated(p, tuple(t.values), dict(t.constraints), None,
                              tuple(json.loads(t.user_attrs.get("intervals", "[]"))), t.user_attrs.get("config_hash", ""))
                decided[point_key(p)] = ("done", e)
                res.evaluated.append(e)
            elif t.state in (TrialState.FAIL, TrialState.PRUNED) and "reason" in t.user_attrs:
                decided.setdefault(point_key(p), ("fail" if t.state == TrialState.FAIL else "pruned", t.user_attrs["reason"]))
        if res.evaluated:
            self.echo(f"resuming study '{self.study_name}': {len(res.evaluated)} configuration(s) already measured")
        if self.rules.gate:  # the reference of the accuracy gate: the baseline's per-item answers (reused by hash)
            ((ref,),) = self._run([Request((self.baseline,))], res)
            self.reference = ref if ref.ok and ref.correct else None
        if point_key(self.baseline) not in decided:
            study.enqueue_trial(self.baseline, skip_if_exists=True)
        asks = 0
        rng = random.Random(self.seed)
        while True:
            if res.trials >= self.budget.max_trials:
                res.stop = f"budget: {res.trials} trials"
                break
            if asks >= self.max_asks or len(decided) >= math.prod(len(v) for v in self.space.values()):
                res.stop = "space exhausted" if asks < self.max_asks else f"no new proposals in {asks} asks"
                break
            pending: list[tuple] = []
            room = min(self.batch, self.budget.max_trials - res.trials)
            while len(pending) < room and asks < self.max_asks:
                t = study.ask(dists)
                asks += 1
                p = {k: str(v) for k, v in t.params.items()}
                key = point_key(p)
                if key in decided or any(point_key(q) == key for _, q in pending):
                    res.duplicates += 1
                    t.set_user_attr("duplicate", True)
                    study.tell(t, state=TrialState.FAIL)  # nothing new to learn; COMPLETE again would count twice
                    # a sampler that repeats itself has converged on what it knows: the next ask explores an
                    # undecided neighbour of the front instead (one axis changed; else any undecided point,
                    # drawn with the study's seed), so the budget buys new measurements where the front may move
                    nxt = self._explore(decided, [x for _, x in pending], res, rng)
                    if nxt is not None:
                        study.enqueue_trial(nxt)
                    continue
                problems = self.validate(p)
                if problems:
                    reason = "; ".join(problems)
                    res.invalid.append((p, reason))
                    t.set_user_attr("reason", reason[:2000])
                    t.set_constraint(REFUSED, 1.0)
                    study.tell(t, penalty(self.directions))
                    decided[key] = ("refused", reason)
                    continue
                why = self.predict(p, list(res.evaluated))
                if why:
                    res.predicted.append((p, why))
                    t.set_user_attr("reason", why[:2000])
                    study.tell(t, state=TrialState.PRUNED)
                    decided[key] = ("pruned", why)
                    continue
                pending.append((t, p))
            if not pending:
                continue
            self.echo(f"measuring {len(pending)} configuration(s): " + "; ".join(describe(p, self.baseline) for _, p in pending))
            try:
                results = self._run([Request((p,)) for _, p in pending], res)
                # a load-flagged measurement decides nothing: once more, alone (a batch's trials load each other on a
                # small machine), else it is dropped
                for i in [i for i, (m,) in enumerate(results) if m.ok and loaded(m)]:
                    self.echo(f"measuring again alone (load): {describe(pending[i][1], self.baseline)}")
                    ((m,),) = self._run([Request((pending[i][1],), attempt=1)], res)
                    results[i] = [m]
            except BaseException:
                for t, _ in pending:  # Ctrl-C: nothing RUNNING stays in the study
                    study.tell(t, state=TrialState.FAIL, skip_if_finished=True)
                raise
            for (t, p), (m,) in zip(pending, results):
                self._tell(study, t, p, m, res, decided, TrialState)
        res.front = sorted(pareto_front(res.evaluated, self.directions), key=lambda e: e.values)
        before = res.trials
        self._pick_best(res)
        res.checks = res.trials - before
        return res

    def _tell(self, study, t, p: Point, m: Measurement, res: SearchResult, decided: dict, TrialState) -> None:
        values = [goal_value(g, m) for g in self.goals] if m.ok else []
        if m.ok and loaded(m):
            reason = f"measured under load twice ({m.unstable.split(';')[0]}): decides nothing"
            res.dropped.append((p, reason))
            t.set_user_attr("reason", reason[:2000])
            study.tell(t, state=TrialState.FAIL)
            decided[point_key(p)] = ("fail", reason)
            return
        if not m.ok or any(v is None for v in values):
            reason = (m.error or "").splitlines()[0] if m.error else f"missing {', '.join(g for g, v in zip(self.goals, values) if v is None)}"
            res.failed.append((p, reason))
            t.set_user_attr("reason", reason[:2000])
            study.tell(t, state=TrialState.FAIL)
            decided[point_key(p)] = ("fail", reason)
            return
        gate = gate_of(self.reference, m, self.rules)
        cons = constraints_of(m, self.rules, gate)
        for k, v in cons.items():
            t.set_constraint(k, v)
        intervals = [goal_interval(g, m) for g in self.goals]
        t.set_user_attr("config_hash", m.config_hash)
        t.set_user_attr("intervals", json.dumps(intervals))
        study.tell(t, values)
        e = Evaluated(p, tuple(values), cons, m, tuple(intervals), m.config_hash, gate)
        res.evaluated.append(e)
        decided[point_key(p)] = ("done", e)

    # --- "best": raced, and its accuracy decided ---------------------------------------------------------
    def _gate_holds(self, e: Evaluated, res: SearchResult) -> str:
        """'' when `e`'s paired gate holds (decided on more items as the chain does), else why not."""
        if not self.rules.gate or self.reference is None or not e.gate:
            return ""
        gate, limit = e.gate, self.eval_limit
        while any(a.verdict == UNDECIDED for a in gate) and limit and limit < self.budget.max_items:
            limit = min(2 * limit, self.budget.max_items)
            self.echo(f"accuracy of {describe(e.point, self.baseline)} undecided: eval.limit={limit}")
            ((ref, m),) = self._run([Request(({**self.baseline, EVAL_LIMIT: str(limit)}, {**e.point, EVAL_LIMIT: str(limit)}))], res)
            if not (ref.ok and m.ok):
                return f"accuracy at eval.limit={limit}: a trial failed"
            gate = gate_of(ref, m, self.rules)
        e.gate = gate
        bad = [a for a in gate if a.verdict != HOLDS]
        return "; ".join(a.cell() for a in bad)

    def _pick_best(self, res: SearchResult) -> None:
        """The best on the first objective: the feasible configurations by median, the first RACE_SIZE whose gate
        holds raced (a single median decides nothing: two checks of one pair under load gave x0.35 and x1.00)."""
        feasible = [e for e in res.evaluated if e.feasible]
        if not feasible:
            return
        sign = 1 if self.directions[0] == MINIMIZE else -1
        ranked = sorted(feasible, key=lambda e: sign * e.values[0])
        ok = []
        for e in ranked:
            if len(ok) >= RACE_SIZE:
                break
            why = self._gate_holds(e, res)
            if why:
                res.failed.append((e.point, f"not best: accuracy gate vs the baseline does not hold ({why})"))
            else:
                ok.append(e)
        if not ok:
            res.best_note = "no front member's accuracy gate holds against the baseline: no best"
            return
        best = ok[0]
        goal = self.goals[0]
        if goal == ACCURACY or len(ok) == 1:
            res.best, res.best_note = best, "best by median (nothing to race)" if len(ok) == 1 else "best by accuracy"
            return
        # F-race: the fastest by median against the next ones, as interleaved pairs judged by the chain's rule
        racer = Chain(self.space, Objective.parse(goal), replace(self.rules, gate=False, max_memory_bytes=None, slo={}),
                      self.budget, self._measure, baseline=self.baseline, trust_regime=False, total_pair=False)
        for e in ok[1:]:
            v, _, _ = racer.measure_pair(best.point, e.point)
            res.races.append(Race(best.point, e.point, v.decision, v.reason))
            self.echo(f"race: {describe(e.point, self.baseline)} vs {describe(best.point, self.baseline)}: {v.decision}: {v.reason}")
            if v.decision == ACCEPTED:
                best = e
        res.trials += racer.trials
        res.reused += racer.reused
        res.best = best
        res.best_note = (f"raced against {len(ok) - 1} other front member(s) as interleaved pairs (the chain's rule: "
                         f"a challenger replaces it only when shown >= x{1 + self.rules.min_effect:.2f} faster)")


def format_front(res: SearchResult) -> list[str]:
    """Lines of the Pareto front: each configuration's objective values with their intervals."""
    def cell(g: str, v: float, iv) -> str:
        unit = TERMS[g].label if g in TERMS else "accuracy"
        s = f"{v / 1e9:.3f} GB" if g == "peak_memory" else (f"{100 * v:.1f}%" if g == ACCURACY else f"{v:.3g}")
        if iv:
            lo, hi = iv
            s += f" [{lo / 1e9:.3f}-{hi / 1e9:.3f}]" if g == "peak_memory" else f" [{lo:.3g}-{hi:.3g}]"
        return f"{unit} {s}"

    out = []
    for e in res.front:
        ivs = e.intervals or (None,) * len(res.goals)
        gate = "; ".join(a.cell() for a in e.gate)
        out.append(f"{describe(e.point)}  " + ", ".join(cell(g, v, iv) for g, v, iv in zip(res.goals, e.values, ivs))
                   + (f"  gate: {gate}" if gate else "") + (f"  ({e.config_hash[:12]})" if e.config_hash else ""))
    return out


def summary(res: SearchResult) -> list[str]:
    """The search's summary, each kind of configuration under its own heading."""
    out = ["Pareto front (feasible, measured):" if res.front else "Pareto front: no feasible configuration measured"]
    out += ["  " + line for line in format_front(res)]
    if res.best is not None:
        out.append(f"best: {describe(res.best.point)} -- {res.best_note}")
    elif res.best_note:
        out.append(f"best: none -- {res.best_note}")
    sections = (("raced for best (interleaved pairs, the chain's rule):",
                 [f"{describe(r.challenger)} vs {describe(r.incumbent)}: {r.decision}: {r.reason}" for r in res.races]),
                ("pruned, never measured (the cost model predicts them dominated on every objective):",
                 [f"{describe(p)} -- {why}" for p, why in res.predicted]),
                ("refused by validation, never measured:", [f"{describe(p)} -- {why}" for p, why in res.invalid]),
                ("dropped (measured under load):", [f"{describe(p)} -- {why}" for p, why in res.dropped]),
                ("failed:", [f"{describe(p)} -- {why}" for p, why in res.failed]))
    for head, lines in sections:
        if lines:
            out.append(head)
            out += ["  " + line for line in lines]
    return out
