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

The study lives in an RDB storage (a sqlite file beside the tracking store), so a rerun loads it and continues
with its verdicts (`Kept`): each trial's gate, each gate decided on more items, each race, each refusal under its
heading, and the trials every run spent -- the budget is the study's, so the same command run again reaches the
same best and measures nothing.

The result: the best -- the feasible configurations by median, the first whose accuracy gate holds (decided on
more items) raced against the next ones as interleaved pairs judged by the chain's own rule (Chain.measure_pair)
-- then the Pareto front of the feasible trials (each value with its 95% interval), built after the gate, so a
configuration found worse on more items is on neither. The budget (optimize.max_trials, max_minutes) holds while
choosing the best: the exploration leaves what the best's checks may need (`_keep`, at most half), each check is
taken only where it fits, and where the budget ends first the best is "undecided: budget", saying what was left.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Mapping, Optional, Sequence

from .accuracy import HOLDS, UNDECIDED, WORSE, PairedAccuracy, items_of, plan_look
from .chain import Chain, baseline_of
from .decide import limit_violations, loaded, pooled_of
from .measurement import EVAL_LIMIT, Measure, Measurement, Point, Request, describe, point_key, spent
from .objective import TERMS, Objective
from .types import ACCEPTED, REMEASURE, RUN_FAILED, Budget, Rules

MINIMIZE, MAXIMIZE = "minimize", "maximize"
ACCURACY = "accuracy"
GOALS = tuple(TERMS) + (ACCURACY,)
REFUSED = "refused"  # the constraint a configuration validation refuses carries
RACE_SIZE = 3  # front members raced for "best": the fastest by median and the next two
UNDECIDED_BUDGET = "undecided: budget"  # "best" where the budget ended before it was decided


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
    """The chain's paired gate of `m` against the reference's answers: one judgement over the items of every task
    both answered, pooled (decide.pooled_of)."""
    if not rules.gate or reference is None:
        return []
    return pooled_of(reference, m, rules)


def gate_violation(gate: Sequence[PairedAccuracy], rules: Rules) -> float:
    """The accuracy constraint (<= 0 feasible): a gate found worse, the distance of its interval's top below
    -max_drop; otherwise 0."""
    return max([0.0] + [(-rules.max_drop - a.hi) for a in gate if a.verdict == WORSE])


def constraints_of(m: Measurement, rules: Rules, gate: Sequence[PairedAccuracy] = ()) -> dict[str, float]:
    """Optuna constraints (<= 0 feasible): the paired gate (gate_violation), and the SLO / memory limits
    (decide.limit_violations: the same rule as the chain)."""
    out = dict(limit_violations(m, rules))
    if gate:
        out["accuracy_gate"] = gate_violation(gate, rules)
    return out


def gate_json(gate: Sequence[PairedAccuracy]) -> list[dict]:
    return [asdict(a) for a in gate]


def gate_from(rows: Optional[Sequence[dict]]) -> list[PairedAccuracy]:
    return [PairedAccuracy(**r) for r in rows or []]


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
    dropped: list[tuple[Point, str]] = field(default_factory=list)  # measured under load: decided nothing
    races: list[Race] = field(default_factory=list)  # the front's top raced for "best"
    best_note: str = ""  # how "best" was decided ("undecided: budget -- ..." when the budget ended first)
    duplicates: int = 0  # proposals of an already-decided point (told FAIL, nothing measured)
    checks: int = 0  # trials spent deciding "best" (its accuracy on more items, the race), within `trials`
    trials: int = 0  # trials run by this run
    reused: int = 0
    earlier: int = 0  # trials run by earlier runs of the same study (they count toward the budget)
    stop: str = ""


class OutOfBudget(Exception):
    """The budget ended before "best" was decided (the message says what was left undecided)."""


def _digest(*points: Point) -> str:
    return hashlib.sha256(json.dumps([point_key(p) for p in points]).encode()).hexdigest()[:16]


class Kept:
    """What the search decided beyond each trial's own values, kept in the study's user attributes (JSON, in its
    storage) so that a resumed run reaches the same best without measuring it again: the trials and seconds
    every run of the study spent (the budget is the study's: the same command run again spends nothing more),
    how its exploration ended, each gate decided on more items, each race."""
    SPENT, WALK, GATE, RACE = "spent", "walk", "gate:", "race:"

    def __init__(self, study):
        self.study = study
        attrs = study.user_attrs
        spent = attrs.get(self.SPENT) or {}
        self.earlier, self.earlier_s = int(spent.get("trials", 0)), float(spent.get("seconds", 0.0))
        self.gates = {k: (gate_from(v["gate"]), v.get("why", "")) for k, v in attrs.items() if k.startswith(self.GATE)}
        self.races = {k: Race(**v) for k, v in attrs.items() if k.startswith(self.RACE)}

    def spent(self, trials: int, seconds: float) -> None:
        """This run has spent `trials` and `seconds`: the study's totals, written as they grow (a killed run's
        count stays)."""
        self.study.set_user_attr(self.SPENT, {"trials": self.earlier + trials, "seconds": self.earlier_s + seconds})

    def walk_ended(self, max_trials: int) -> str:
        """Why an earlier run's exploration ended ('' when none did, or a larger trial budget may go on)."""
        walk = self.study.user_attrs.get(self.WALK)
        return walk["stop"] if walk and max_trials <= walk["max_trials"] else ""

    def keep_walk(self, stop: str, max_trials: int) -> None:
        self.study.set_user_attr(self.WALK, {"stop": stop, "max_trials": max_trials})

    def gate(self, p: Point) -> Optional[tuple[list[PairedAccuracy], str]]:
        """The gate of `p` as decided on more items, and why it stayed undecided ('' where it did not)."""
        return self.gates.get(self.GATE + _digest(p))

    def keep_gate(self, p: Point, gate: list[PairedAccuracy], why: str) -> None:
        key = self.GATE + _digest(p)
        self.gates[key] = (gate, why)
        self.study.set_user_attr(key, {"point": p, "gate": gate_json(gate), "why": why})

    def race(self, incumbent: Point, challenger: Point) -> Optional[Race]:
        return self.races.get(self.RACE + _digest(incumbent, challenger))

    def keep_race(self, r: Race) -> None:
        key = self.RACE + _digest(r.incumbent, r.challenger)
        self.races[key] = r
        self.study.set_user_attr(key, asdict(r))


class Search:
    def __init__(self, space: Mapping[str, list[str]], goals: Sequence[str], rules: Rules, budget: Budget,
                 measure: Measure, *, batch: int = 1, validate: Callable[[Point], list[str]] = lambda p: [],
                 predict: Callable[[Point, list[Evaluated]], str] = lambda p, done: "",
                 storage: Optional[str] = None, study_name: str = "optimize", seed: int = 0,
                 baseline: Optional[Point] = None, max_asks: int = 0, eval_limit: int = 0, echo=lambda s: None,
                 clock: Callable[[], float] = time.monotonic):
        self.space = {k: [str(v) for v in vs] for k, vs in space.items()}
        self.goals = tuple(goals)
        self.directions = [direction(g) for g in self.goals]
        self.rules, self.budget, self._measure = rules, budget, measure
        self.batch, self.validate, self.predict = max(1, batch), validate, predict
        self.storage, self.study_name, self.seed = storage, study_name, seed
        self.baseline = dict(baseline or baseline_of(space))
        self.max_asks = max_asks or 10 * budget.max_trials + 50
        self.eval_limit, self.echo, self.clock = eval_limit, echo, clock
        self.reference: Optional[Measurement] = None
        self._refs: dict[int, Measurement] = {}  # eval.limit -> the baseline's per-item answers at it
        self._kept: Optional[Kept] = None
        self._t0, self._asks = 0.0, 0

    def _study(self):
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        sampler = optuna.samplers.TPESampler(seed=self.seed, constant_liar=True, multivariate=True,
                                             n_startup_trials=min(10, max(2, self.budget.max_trials // 3)))
        return optuna.create_study(study_name=self.study_name, storage=self.storage, directions=self.directions,
                                   sampler=sampler, load_if_exists=True)

    # --- the budget: optimize.max_trials and max_minutes over every run of the study ----------------------
    def _left(self, res: SearchResult) -> int:
        return self.budget.max_trials - self._kept.earlier - res.trials

    def _elapsed(self) -> float:
        return self._kept.earlier_s + self.clock() - self._t0

    def _spent(self, res: SearchResult, need: int = 1, keep: int = 0) -> str:
        """Why `need` more trials would break the budget ('' when they fit), `keep` trials (and that share of the
        minutes) left for later."""
        if self._left(res) - keep < need:
            used = self.budget.max_trials - self._left(res)
            return (f"budget: {used} of {self.budget.max_trials} trials"
                    + (f" ({self._kept.earlier} by earlier runs of this study)" if self._kept.earlier else "")
                    + (f", {keep} kept for deciding the best" if keep else ""))
        share = 1 - keep / self.budget.max_trials
        if self.budget.max_s and self._elapsed() >= share * self.budget.max_s:
            return f"budget: {share * self.budget.max_s / 60:.3g} of {self.budget.max_s / 60:.3g} min"
        return ""

    def _keep(self, res: SearchResult) -> int:
        """Trials the exploration leaves for deciding "best" (at most half the budget): what the configurations
        that would be checked now may need -- each undecided gate's looks after its first (and the baseline's
        answers at each size, shared), one interleaved pair for each race not yet decided."""
        sign = 1 if self.directions[0] == MINIMIZE else -1
        top = sorted((e for e in res.evaluated if e.feasible), key=lambda e: sign * e.values[0])[:RACE_SIZE]
        # each undecided gate: its looks after the first, and the baseline's answers at each size (shared: once)
        open_ = [e for e in top if self._kept.gate(e.point) is None and any(a.verdict == UNDECIDED for a in e.gate)]
        looks = max(0, self.rules.gate_looks - 1) if self.eval_limit else 0
        need = looks * len(open_) + (looks if open_ else 0)
        if self.goals[0] != ACCURACY:
            need += 2 * sum(1 for e in top[1:] if self._kept.race(top[0].point, e.point) is None)
        return min(need, self.budget.max_trials // 2)

    def _run(self, requests: list[Request], res: SearchResult) -> list[list[Measurement]]:
        out = self._measure(requests)
        for ms in out:
            reused, ran = spent(ms)
            res.reused, res.trials = res.reused + reused, res.trials + ran
        self._kept.spent(res.trials, self.clock() - self._t0)
        return out

    # --- the walk: ask, measure, tell -------------------------------------------------------------------
    def run(self) -> SearchResult:
        study = self._study()
        self._t0, self._asks, self._refs = self.clock(), 0, {}
        self._kept = Kept(study)
        res = SearchResult(self.goals, [], [], None, earlier=self._kept.earlier)
        decided = self._resume(study, res)
        if point_key(self.baseline) not in decided:
            study.enqueue_trial(self.baseline, skip_if_exists=True)
        ended = self._kept.walk_ended(self.budget.max_trials)
        if ended:  # an earlier run's exploration ended (it was not killed): the same command explores no further
            res.stop = ended
            self.echo(f"the exploration ended in an earlier run ({ended})")
        else:
            self._walk(study, decided, res)
            self._kept.keep_walk(res.stop, self.budget.max_trials)
        before = res.trials
        self._pick_best(res)
        res.checks = res.trials - before
        for e in res.evaluated:  # every gate decided on more items, by this run or an earlier one
            if (kept := self._kept.gate(e.point)) is not None:
                self._checked(e, kept[0])
        # the front after the gate: a configuration found worse on more items is infeasible
        res.front = sorted(pareto_front(res.evaluated, self.directions), key=lambda e: e.values)
        return res

    def _resume(self, study, res: SearchResult) -> dict:
        """The study's earlier trials as decided: each measured configuration with its values and gate, each
        refused, pruned, failed or dropped one with its reason under its heading again. A killed driver's RUNNING
        trial is told FAIL (nothing RUNNING stays)."""
        from optuna.trial import TrialState

        decided: dict[tuple, tuple] = {}  # point -> ("done", Evaluated) | (kind, reason)
        lists = {"refused": res.invalid, "pruned": res.predicted, "fail": res.failed, "dropped": res.dropped}
        for t in study.get_trials(deepcopy=False):
            p = {k: str(v) for k, v in t.params.items()}
            key, attrs = point_key(p), t.user_attrs
            if t.state == TrialState.RUNNING:
                study.tell(t.number, state=TrialState.FAIL)
            elif key in decided:
                continue
            elif t.state == TrialState.COMPLETE and REFUSED not in (t.constraints or {}):
                e = Evaluated(p, tuple(t.values), dict(t.constraints), None,
                              tuple(json.loads(attrs.get("intervals", "[]"))), attrs.get("config_hash", ""),
                              gate_from(attrs.get("gate")))
                decided[key] = ("done", e)
                res.evaluated.append(e)
            elif t.state == TrialState.COMPLETE or (
                    t.state in (TrialState.FAIL, TrialState.PRUNED) and "reason" in attrs):
                kind = ("refused" if t.state == TrialState.COMPLETE else
                        attrs.get("kind") or ("fail" if t.state == TrialState.FAIL else "pruned"))
                decided[key] = (kind, attrs.get("reason", ""))
                lists[kind].append((p, attrs.get("reason", "")))
        if res.evaluated:
            self.echo(f"resuming study '{self.study_name}': {len(res.evaluated)} configuration(s) already measured, "
                      f"{self._kept.earlier} trial(s) spent, {len(self._kept.gates) + len(self._kept.races)} "
                      f"verdict(s) on the best kept")
        return decided

    def _walk(self, study, decided: dict, res: SearchResult) -> None:
        """Batches of asks measured and told, until the space is exhausted, the sampler proposes nothing new, or
        the exploration's budget (all but what deciding "best" needs: `_keep`) is spent."""
        from optuna.distributions import CategoricalDistribution

        dists = {k: CategoricalDistribution(vs) for k, vs in self.space.items()}
        rng = random.Random(self.seed)
        while True:
            if self._asks >= self.max_asks or len(decided) >= math.prod(len(v) for v in self.space.values()):
                res.stop = "space exhausted" if self._asks < self.max_asks else f"no new proposals in {self._asks} asks"
                return
            res.stop = self._spent(res, keep=self._keep(res))
            if res.stop:
                return
            if self.rules.gate and self.eval_limit not in self._refs:
                # the reference of the accuracy gate: the baseline's per-item answers (reused by hash), measured
                # before the first batch that needs it
                ((ref,),) = self._run([Request((self.baseline,))], res)
                self._refs[self.eval_limit] = ref
                self.reference = ref if ref.ok and ref.correct else None
            room = min(self.batch, self._left(res) - self._keep(res))
            pending = self._propose(study, dists, decided, res, rng, room) if room > 0 else []
            if pending:
                self._measure_batch(study, pending, decided, res)

    def _propose(self, study, dists: dict, decided: dict, res: SearchResult, rng: random.Random,
                 room: int) -> list[tuple]:
        """Up to `room` new configurations to measure, asked of the sampler: a refused, pruned or repeated
        proposal is told at once (module docstring) and decided without a trial."""
        from optuna.trial import TrialState

        pending: list[tuple] = []
        while len(pending) < room and self._asks < self.max_asks:
            t = study.ask(dists)
            self._asks += 1
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
        return pending

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

    def _measure_batch(self, study, pending: list[tuple], decided: dict, res: SearchResult) -> None:
        """Measure the batch and tell each result. A load-flagged measurement decides nothing: measured once more,
        alone (a batch's trials load each other on a small machine) while the budget allows, else dropped."""
        from optuna.trial import TrialState

        self.echo(f"measuring {len(pending)} configuration(s): " + "; ".join(describe(p, self.baseline) for _, p in pending))
        again: set[int] = set()
        try:
            results = self._run([Request((p,)) for _, p in pending], res)
            for i in [i for i, (m,) in enumerate(results) if m.ok and loaded(m)]:
                if self._spent(res, keep=self._keep(res)):
                    continue
                self.echo(f"measuring again alone (load): {describe(pending[i][1], self.baseline)}")
                ((m,),) = self._run([Request((pending[i][1],), attempt=1)], res)
                results[i] = [m]
                again.add(i)
        except BaseException:
            for t, _ in pending:  # Ctrl-C: nothing RUNNING stays in the study
                study.tell(t, state=TrialState.FAIL, skip_if_finished=True)
            raise
        for i, ((t, p), (m,)) in enumerate(zip(pending, results)):
            self._tell(study, t, p, m, res, decided, twice=i in again)

    def _tell(self, study, t, p: Point, m: Measurement, res: SearchResult, decided: dict, twice: bool = True) -> None:
        values = [goal_value(g, m) for g in self.goals] if m.ok else []
        if m.ok and loaded(m):
            how = "twice" if twice else "with no budget left to measure it again"
            self._fail(study, t, p, f"measured under load {how} ({m.unstable.split(';')[0]}): decides nothing",
                       "dropped", res.dropped, decided)
            return
        if not m.ok or any(v is None for v in values):
            reason = (m.error or "").splitlines()[0] if m.error else f"missing {', '.join(g for g, v in zip(self.goals, values) if v is None)}"
            self._fail(study, t, p, reason, "fail", res.failed, decided)
            return
        # the baseline is the gate's reference (its answers are the reference's own): no gate to decide
        gate = gate_of(self.reference, m, self.rules) if point_key(p) != point_key(self.baseline) else []
        cons = constraints_of(m, self.rules, gate)
        for k, v in cons.items():
            t.set_constraint(k, v)
        intervals = [goal_interval(g, m) for g in self.goals]
        t.set_user_attr("config_hash", m.config_hash)
        t.set_user_attr("intervals", json.dumps(intervals))
        t.set_user_attr("gate", gate_json(gate))  # its first look, shown again on resume
        study.tell(t, values)
        e = Evaluated(p, tuple(values), cons, m, tuple(intervals), m.config_hash, gate)
        res.evaluated.append(e)
        decided[point_key(p)] = ("done", e)

    @staticmethod
    def _fail(study, t, p: Point, reason: str, kind: str, into: list, decided: dict) -> None:
        from optuna.trial import TrialState

        into.append((p, reason))
        t.set_user_attr("reason", reason[:2000])
        t.set_user_attr("kind", kind)  # its heading again on resume
        study.tell(t, state=TrialState.FAIL)
        decided[point_key(p)] = (kind, reason)

    # --- "best": its accuracy decided, then raced; within the budget, kept with the study ------------------
    def _checked(self, e: Evaluated, gate: list[PairedAccuracy]) -> None:
        """`e` with its gate as decided on more items: found worse, it is infeasible."""
        e.gate = gate
        e.constraints = {**e.constraints, "accuracy_gate": gate_violation(gate, self.rules)}

    def _gate_holds(self, e: Evaluated, res: SearchResult) -> str:
        """'' when `e`'s paired gate holds, else why not: as a run of this study decided it, else decided on more
        items as the chain decides it (`_more_items`). OutOfBudget when a look does not fit the budget."""
        if not e.gate:  # no gate (off, the baseline itself, or the baseline has no per-item answers)
            return ""
        kept = self._kept.gate(e.point)
        if kept is None:
            gate, why = self._more_items(e, res)
            if gate is None:  # a trial failed: nothing decided, nothing kept (a later run measures it again)
                return why
            if gate is not e.gate:
                self._kept.keep_gate(e.point, gate, why)
            kept = gate, why
        gate, why = kept
        self._checked(e, gate)
        return "; ".join([a.cell() for a in gate if a.verdict != HOLDS] + ([why] if why else []))

    def _more_items(self, e: Evaluated, res: SearchResult) -> tuple[Optional[list[PairedAccuracy]], str]:
        """`e`'s gate as the chain decides it (Chain._gate): at most `rules.gate_looks` looks at `rules.gate_alpha`
        each -- the first is its trial's own (eval.limit); after it the plan, the items that decide it with
        PLAN_POWER from the discordance seen (accuracy.items_needed), up the shared ladder of look sizes, within
        optimize.gate.max_items (else it stays undecided, not spent). (the gate, why it stayed undecided), or
        (None, why) where a trial failed."""
        first, cap, rules = self.eval_limit, self.budget.max_items, self.rules
        gate, looks = e.gate, 1
        if not first:  # no eval.limit: the trial answered every item there is
            return gate, ""
        per = max(1, min(a.n for a in gate)) / first  # items a unit of eval.limit gives (the tasks' count, unpooled)
        limit = first
        while any(a.verdict == UNDECIDED for a in gate):
            if looks >= rules.gate_looks:
                return gate, f"after {looks} looks"
            seen, open_ = min(a.n for a in gate), [a for a in gate if a.verdict == UNDECIDED]
            plan = plan_look(open_, seen, max(1, round(first * per)), cap, rules.max_drop, rules.gate_alpha)
            if plan.items is None:
                return gate, plan.undecided()
            limit = max(limit + 1, math.ceil(plan.items / per - 1e-9))
            self.echo(f"accuracy of {describe(e.point, self.baseline)}: {plan.differ}; look {looks + 1} of at most "
                      f"{rules.gate_looks}: {plan.items} items, eval.limit={limit}")
            ref, m = self._look(e.point, limit, res)
            looks += 1
            if not (ref.ok and m.ok):
                return None, f"accuracy at eval.limit={limit}: a trial failed"
            gate = gate_of(ref, m, rules)
            if not gate:
                return None, f"accuracy at eval.limit={limit}: no per-item answers"
        return gate, ""

    def _look(self, p: Point, limit: int, res: SearchResult) -> tuple[Measurement, Measurement]:
        """`p`'s answers at `limit` items and the baseline's (measured once per size), within the budget."""
        points = [] if limit in self._refs else [{**self.baseline, EVAL_LIMIT: str(limit)}]
        points.append({**p, EVAL_LIMIT: str(limit)})
        if why := self._spent(res, need=len(points)):
            raise OutOfBudget(f"{why} before the accuracy of {describe(p, self.baseline)} was decided on more items "
                              f"(eval.limit={limit})")
        ms = [m for (m,) in self._run([Request((q,)) for q in points], res)]
        if len(ms) == 2 and ms[0].ok:
            self._refs[limit] = ms[0]
        return (ms[0] if len(ms) == 2 else self._refs[limit]), ms[-1]

    def _pick_best(self, res: SearchResult) -> None:
        """The best on the first objective: the feasible configurations by median, the first RACE_SIZE whose gate
        holds raced (a single median decides nothing: two checks of one pair under load gave x0.35 and x1.00).
        Where the budget ends first, the best is undecided and the note says what was left."""
        sign = 1 if self.directions[0] == MINIMIZE else -1
        ranked = sorted((e for e in res.evaluated if e.feasible), key=lambda e: sign * e.values[0])
        if not ranked:
            return
        ok: list[Evaluated] = []
        try:
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
            elif self.goals[0] == ACCURACY or len(ok) == 1:
                res.best, res.best_note = ok[0], "best by median (nothing to race)" if len(ok) == 1 else "best by accuracy"
            else:
                self._race(ok, res)
        except OutOfBudget as e:
            res.best, res.best_note = None, f"{UNDECIDED_BUDGET} -- {e}"

    def _race(self, ok: list[Evaluated], res: SearchResult) -> None:
        """F-race: the fastest by median against the next ones, as interleaved pairs judged by the chain's rule;
        a race a run of this study decided is not run again."""
        best = ok[0]
        for e in ok[1:]:
            kept = self._kept.race(best.point, e.point)
            r = kept or self._race_pair(best.point, e.point, res)
            res.races.append(r)
            self.echo(f"race: {describe(e.point, self.baseline)} vs {describe(best.point, self.baseline)}: "
                      f"{r.decision}: {r.reason}" + (" (decided by an earlier run)" if kept else ""))
            if r.decision == ACCEPTED:
                best = e
        res.best = best
        res.best_note = (f"raced against {len(ok) - 1} other front member(s) as interleaved pairs (the chain's rule: "
                         f"a challenger replaces it only when shown >= x{1 + self.rules.min_effect:.2f} faster)")

    def _race_pair(self, inc: Point, cand: Point, res: SearchResult) -> Race:
        """One race, within the budget: a pair is two trials, and the chain measures it again (while its rule
        allows) only where two more fit. A race the budget cut short decided nothing: OutOfBudget."""
        what = f"the race of {describe(cand, self.baseline)} against {describe(inc, self.baseline)}"
        if why := self._spent(res, need=2):
            raise OutOfBudget(f"{why} before {what}")
        # the racer's cap: one below what is left, so it measures again only where two more trials fit; none where
        # every allowed measurement fits (a cap reached on the last one would name the budget as its reason)
        left, most = self._left(res), 2 * self.rules.attempts
        racer = Chain(self.space, Objective.parse(self.goals[0]),
                      replace(self.rules, gate=False, max_memory_bytes=None, slo={}),
                      replace(self.budget, max_trials=left - 1 if left < most else most + 1),
                      lambda reqs: self._run(reqs, res), baseline=self.baseline, trust_regime=False, total_pair=False,
                      clock=self._elapsed)
        v, _, tries = racer.measure_pair(inc, cand)
        if v.needs == REMEASURE and tries < self.rules.attempts:
            raise OutOfBudget(f"{self._spent(res, need=2) or 'budget'} during {what} ({v.reason})")
        r = Race(inc, cand, v.decision, v.reason)
        if v.decision != RUN_FAILED:  # a failed trial is measured again by a later run
            self._kept.keep_race(r)
        return r


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
        gate = "; ".join(a.cell() for a in res.best.gate)
        out.append(f"best: {describe(res.best.point)} -- {res.best_note}" + (f"; gate: {gate}" if gate else ""))
    elif res.best_note:
        undecided = res.best_note.startswith(UNDECIDED_BUDGET)
        out.append(f"best: {res.best_note}" if undecided else f"best: none -- {res.best_note}")
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
