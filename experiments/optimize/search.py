"""The search strategy: Optuna's multi-objective ask/tell over the space's axes.

Objectives (speed, accuracy, memory by default) are what each trial measures; the accuracy gate, the SLO and
the memory limit are *measured* constraints, set on each trial with `trial.set_constraint` (Optuna 5; its
`constraints_func` is deprecated) before `tell`, so the sampler learns where the feasible region is. A batch of
`batch` asks is measured at once (the dispatcher runs them in parallel, one per slot; constant-liar TPE keeps
the pending ones apart). A proposal the validation refuses is never measured: it is told FAIL with the reason,
and a proposal the cost model predicts to lose is told PRUNED with its reason; Optuna then steers away from
both, and the result counts them. The study lives in an RDB storage (a sqlite file beside the tracking store),
so a rerun loads it and continues: its COMPLETE trials are the results so far (the dispatcher reuses their
FINISHED runs by hash), and trials a killed driver left RUNNING are told FAIL.

The result: the Pareto front of the feasible trials (each value with its 95% interval) and the best feasible
configuration on the first objective.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

from .chain import Budget, baseline_of
from .decide import Rules, limit_problems
from .measurement import Measure, Measurement, Point, Request, describe, point_key
from .objective import TERMS

MINIMIZE, MAXIMIZE = "minimize", "maximize"
ACCURACY = "accuracy"
GOALS = tuple(TERMS) + (ACCURACY,)


def direction(goal: str) -> str:
    if goal == ACCURACY:
        return MAXIMIZE
    return MAXIMIZE if TERMS[goal].higher_is_better else MINIMIZE


def goal_metric(goal: str) -> str:
    return "task_score" if goal == ACCURACY else TERMS[goal].metric


def accuracy_value(m: Measurement) -> Optional[float]:
    """Mean task score over the trial's tasks (`task_score.<task>`), else over its per-item results."""
    scores = [v for k, v in m.metrics.items() if k.startswith("task_score.") and k.count(".") == 1]
    if scores:
        return sum(scores) / len(scores)
    items = [x for xs in m.correct.values() for x in xs]
    return sum(items) / len(items) if items else None


def goal_value(goal: str, m: Measurement) -> Optional[float]:
    return accuracy_value(m) if goal == ACCURACY else m.metrics.get(TERMS[goal].metric)


def goal_interval(goal: str, m: Measurement) -> tuple[float, float] | None:
    if goal == ACCURACY:
        return None
    metric = TERMS[goal].metric
    lo, hi = m.metrics.get(metric + "_ci_lo"), m.metrics.get(metric + "_ci_hi")
    return (lo, hi) if lo is not None and hi is not None else None


def constraints_of(m: Measurement, rules: Rules) -> dict[str, float]:
    """Optuna constraints (<= 0 feasible): the accuracy gate (the engine's `task_gate`: every task within
    `eval.gate` of the reference), each SLO metric over its limit, peak memory over its limit."""
    out: dict[str, float] = {}
    if rules.gate and "task_gate" in m.metrics:
        recov = [v for k, v in m.metrics.items() if k.startswith("task_recovery.")]
        out["accuracy_gate"] = 0.0 if m.metrics["task_gate"] >= 1 else max(1e-6, 1.0 - min(recov, default=0.0))
    for metric, limit in rules.slo.items():
        v = m.metrics.get(metric)
        out[f"slo:{metric}"] = (v - limit) if v is not None else 1.0
    if rules.max_memory_bytes is not None:  # a missing peak breaks the limit, as in decide.memory_problem
        out["memory"] = (m.metrics.get("peak_mem_bytes", math.inf) - rules.max_memory_bytes) / 1e9
    return out


@dataclass
class Evaluated:
    point: Point
    values: tuple[float, ...]
    constraints: dict[str, float]
    measurement: Optional[Measurement] = None
    intervals: tuple = ()
    config_hash: str = ""

    @property
    def feasible(self) -> bool:
        return all(v <= 0 for v in self.constraints.values())

    def why_infeasible(self, rules: Rules) -> str:
        if self.measurement is not None:
            bad = limit_problems(self.measurement, rules)
            if "accuracy_gate" in self.constraints and self.constraints["accuracy_gate"] > 0:
                bad.insert(0, "accuracy gate (task_gate 0)")
            return "; ".join(bad)
        return "; ".join(k for k, v in self.constraints.items() if v > 0)


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
class SearchResult:
    goals: tuple[str, ...]
    evaluated: list[Evaluated]
    front: list[Evaluated]
    best: Optional[Evaluated]
    invalid: list[tuple[Point, str]] = field(default_factory=list)  # refused by validation: never measured
    predicted: list[tuple[Point, str]] = field(default_factory=list)  # skipped: the cost model predicts a loss
    failed: list[tuple[Point, str]] = field(default_factory=list)
    duplicates: int = 0  # proposals of an already-decided point (answered from the first result)
    trials: int = 0
    reused: int = 0
    stop: str = ""


class Search:
    def __init__(self, space: Mapping[str, list[str]], goals: Sequence[str], rules: Rules, budget: Budget,
                 measure: Measure, *, batch: int = 1, validate: Callable[[Point], list[str]] = lambda p: [],
                 predict: Callable[[Point, list[Evaluated]], str] = lambda p, done: "",
                 storage: Optional[str] = None, study_name: str = "optimize", seed: int = 0,
                 baseline: Optional[Point] = None, max_asks: int = 0, echo=lambda s: None):
        self.space = {k: [str(v) for v in vs] for k, vs in space.items()}
        self.goals = tuple(goals)
        self.directions = [direction(g) for g in self.goals]
        self.rules, self.budget, self._measure = rules, budget, measure
        self.batch, self.validate, self.predict = max(1, batch), validate, predict
        self.storage, self.study_name, self.seed = storage, study_name, seed
        self.baseline = dict(baseline or baseline_of(space))
        self.max_asks = max_asks or 10 * budget.max_trials + 50
        self.echo = echo

    def _study(self):
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        sampler = optuna.samplers.TPESampler(seed=self.seed, constant_liar=True, multivariate=True,
                                             n_startup_trials=min(10, max(2, self.budget.max_trials // 3)))
        return optuna.create_study(study_name=self.study_name, storage=self.storage, directions=self.directions,
                                   sampler=sampler, load_if_exists=True)

    def run(self) -> SearchResult:
        import optuna
        from optuna.distributions import CategoricalDistribution
        from optuna.trial import TrialState

        study = self._study()
        dists = {k: CategoricalDistribution(vs) for k, vs in self.space.items()}
        res = SearchResult(self.goals, [], [], None)
        decided: dict[tuple, tuple] = {}  # point -> ("done", Evaluated) | ("fail"|"pruned", reason)
        for t in study.get_trials(deepcopy=False):  # resume
            p = {k: str(v) for k, v in t.params.items()}
            if t.state == TrialState.RUNNING:
                study.tell(t.number, state=TrialState.FAIL)  # a killed driver's: nothing RUNNING stays
            elif t.state == TrialState.COMPLETE and point_key(p) not in decided:
                e = Evaluated(p, tuple(t.values), dict(t.constraints), None,
                              tuple(json.loads(t.user_attrs.get("intervals", "[]"))), t.user_attrs.get("config_hash", ""))
                decided[point_key(p)] = ("done", e)
                res.evaluated.append(e)
            elif t.state in (TrialState.FAIL, TrialState.PRUNED) and "reason" in t.user_attrs:
                decided.setdefault(point_key(p), ("fail" if t.state == TrialState.FAIL else "pruned", t.user_attrs["reason"]))
        if res.evaluated:
            self.echo(f"resuming study '{self.study_name}': {len(res.evaluated)} configuration(s) already measured")
        if point_key(self.baseline) not in decided:
            study.enqueue_trial(self.baseline, skip_if_exists=True)
        asks = 0
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
                    self._tell_again(study, t, decided.get(key), TrialState)
                    continue
                problems = self.validate(p)
                if problems:
                    reason = "; ".join(problems)
                    res.invalid.append((p, reason))
                    t.set_user_attr("reason", reason[:2000])
                    study.tell(t, state=TrialState.FAIL)
                    decided[key] = ("fail", reason)
                    continue
                why = self.predict(p, [e for e in res.evaluated])
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
                results = self._measure([Request((p,)) for _, p in pending])
            except BaseException:
                for t, _ in pending:  # Ctrl-C: nothing RUNNING stays in the study
                    study.tell(t, state=TrialState.FAIL, skip_if_finished=True)
                raise
            for (t, p), (m,) in zip(pending, results):
                if m.reused:
                    res.reused += 1
                else:
                    res.trials += 1
                self._tell(study, t, p, m, res, decided, TrialState)
        res.front = sorted(pareto_front(res.evaluated, self.directions), key=lambda e: e.values)
        feasible = [e for e in res.evaluated if e.feasible]
        if feasible:
            sign = 1 if self.directions[0] == MINIMIZE else -1
            res.best = min(feasible, key=lambda e: sign * e.values[0])
        return res

    def _tell(self, study, t, p: Point, m: Measurement, res: SearchResult, decided: dict, TrialState) -> None:
        values = [goal_value(g, m) for g in self.goals] if m.ok else []
        if not m.ok or any(v is None for v in values):
            reason = (m.error or "").splitlines()[0] if m.error else f"missing {', '.join(g for g, v in zip(self.goals, values) if v is None)}"
            res.failed.append((p, reason))
            t.set_user_attr("reason", reason[:2000])
            study.tell(t, state=TrialState.FAIL)
            decided[point_key(p)] = ("fail", reason)
            return
        cons = constraints_of(m, self.rules)
        for k, v in cons.items():
            t.set_constraint(k, v)
        intervals = [goal_interval(g, m) for g in self.goals]
        t.set_user_attr("config_hash", m.config_hash)
        t.set_user_attr("intervals", json.dumps(intervals))
        study.tell(t, values)
        e = Evaluated(p, tuple(values), cons, m, tuple(intervals), m.config_hash)
        res.evaluated.append(e)
        decided[point_key(p)] = ("done", e)

    @staticmethod
    def _tell_again(study, t, prior, TrialState) -> None:
        """A duplicate proposal: answered from the first result, so the sampler sees it, and nothing runs."""
        if prior is None:  # proposed twice within one batch: the first copy is being measured
            study.tell(t, state=TrialState.FAIL)
            return
        kind, what = prior
        if kind == "done":
            for k, v in what.constraints.items():
                t.set_constraint(k, v)
            study.tell(t, list(what.values))
        else:
            study.tell(t, state=TrialState.FAIL if kind == "fail" else TrialState.PRUNED)


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
        out.append(f"{describe(e.point)}  " + ", ".join(cell(g, v, iv) for g, v, iv in zip(res.goals, e.values, ivs))
                   + (f"  ({e.config_hash[:12]})" if e.config_hash else ""))
    return out
