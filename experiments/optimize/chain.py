"""The chain strategy: the seed's discipline, one step at a time.

Measure the baseline (nothing applied), read its regime, take the next step of the chain (engine/axes.py
CHAIN: KV cache -> continuous batching -> fused attention -> quantization -> speculative decoding, then the
space's other axes, then a different model: right-size) that the regime says should pay off (a regime read from
a load-flagged measurement, or after an undecided step, skips nothing); measure each of its variants against the
incumbent as an interleaved pair, in the seed's order (quantization: weight-only INT8 first); a variant the
decision rules accept (decide.py) becomes the incumbent that the step's remaining variants must beat (INT4 is
measured against an accepted INT8, not against fp32). Right-sizing is the last step: each other model of the
space's model axis is a candidate on top of the incumbent's optimizations, accepted only like any step; a model
with more weight bytes that the cost model predicts to be slower per token is skipped with that reason, never
spent as a trial.

One pair (`measure_pair`): measured up to `rules.attempts` times while its timing is undecided, the rounds of
every measurement not flagged for load pooled; once the timing accepts, its accuracy is gated against the
incumbent and against the baseline on the same items, the item count doubled while either gate is undecided (up
to `max_items`); with a memory limit, the candidate is measured alone for it. A pair that differs only in axes
that cannot change the task scores (`score_neutral`: the KV cache, batching and speculation, where the tasks are
log-likelihood ones scored teacher-forced without a cache) is measured without the task eval: its accuracy is
equal by construction. At the walk's end, while budget remains, each pair left undecided on timing is measured
again (`rules.retries`: pooled with its earlier measurements where the incumbent is unchanged, else a new pair on
the final incumbent). The chain stops at its end or when the budget (trials, seconds) is spent, and ends with
the final configuration against the baseline as one more pair (the total gain). Every decision becomes a row of
the chain table.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

from engine import axes as axis_registry

from engine.measure.spread import Ratio

from .accuracy import FLOOR, UNDECIDED, Plan, Prescreen, next_look, plan_look
from .decide import (ACCEPTED, BASELINE, MORE_ITEMS, REJECTED, REMEASURE, RUN_FAILED, SKIPPED, TOTAL, UNDECIDED_PAIR,
                     Rules, Verdict, accuracy_cell, judge_accuracy, judge_timing, loaded, memory_problem, pooled_of)
from .measurement import EVAL_LIMIT, EVAL_OFF, Measure, Measurement, Point, Request, describe, spent
from .objective import Objective
from .prescreen import Prescreener
from .types import RETRY, Budget, Row

MODEL_KEYS = ("model", "model.name")  # the model axis (right-size); `model.dtype` is the precision axis

# a point -> (predicted seconds per generated token, weight bytes), None where the cost model cannot say
Predict = Callable[[Point], Optional[tuple[float, float]]]


BASELINE_FAILED = "baseline failed"  # the stop when the baseline's own trial failed: nothing was decided


@dataclass(frozen=True)
class Step:
    key: str  # the space's axis key (`kv_cache`, `quant`, `model.dtype`)
    label: str
    variants: tuple[str, ...]  # values to try, in order


def _axis(key: str) -> Optional[axis_registry.Axis]:
    return axis_registry.of_key(key)


def off_value(key: str) -> Optional[str]:
    """The value of axis `key` that means "not applied" (None for axes that are not optimizations)."""
    a = _axis(key)
    return a.off if a is not None else None


def baseline_of(space: Mapping[str, list[str]]) -> Point:
    """Nothing applied: each optimization axis at its "off" value when the space has it, else its first value."""
    out = {}
    for k, values in space.items():
        off = off_value(k)
        out[k] = off if off in values else values[0]
    return out


def plan(space: Mapping[str, list[str]], baseline: Mapping[str, str]) -> list[Step]:
    """The chain's steps over `space`: the seed's order, then the other axes as listed, the model last."""
    def variants(k: str) -> tuple[str, ...]:
        vs = [v for v in space[k] if v != baseline[k]]
        first = _axis(k).first if _axis(k) else ()  # the seed's order: quantization's weight-only INT8 first
        return tuple([v for v in vs if v in first] + [v for v in vs if v not in first])

    chain_keys = sorted((k for k in space if _axis(k) is not None and _axis(k).chain is not None),
                        key=lambda k: _axis(k).chain)
    model = [k for k in space if k in MODEL_KEYS]
    others = [k for k in space if k not in chain_keys and k not in model]
    steps = [Step(k, _axis(k).label, variants(k)) for k in chain_keys]
    steps += [Step(k, _axis(k).label if _axis(k) else k, variants(k)) for k in others]
    steps += [Step(k, axis_registry.RIGHT_SIZE, variants(k)) for k in model]
    return [s for s in steps if s.variants]


def pays_off(key: str, labels: Mapping[str, str]) -> tuple[Optional[bool], str]:
    """Whether the incumbent's regime says step `key` should pay off (None: no opinion), and why. Only the steps
    whose gain the regime decides are judged (engine/axes.py `Axis.regime`: quantization and speculative decoding
    attack the bytes a memory-bound decode moves, and buy nothing when the time goes to compute)."""
    gate = _axis(key).regime if _axis(key) else None
    decode = labels.get("regime.decode.measured") or labels.get("regime.decode") or ""
    phase, overall = labels.get("regime.phase", ""), labels.get("regime", "")
    if gate is None:
        return None, ""
    if gate.prefill and phase == "prefill" and overall == "compute":
        return False, f"time goes to a compute-bound prefill: {gate.compute}"
    if decode == "compute":
        return False, f"decode is compute-bound: {gate.compute}"
    if decode == "memory":
        return True, f"decode is memory-bound: {gate.memory}"
    return None, ""


def _nums(r: Optional[Ratio]) -> Optional[tuple[float, float, float]]:
    return (r.value, r.lo, r.hi) if r is not None else None


def _pair_row(step: int, label: str, cand: Point, inc: Point, inc_m: Measurement, v: Verdict,
              ms: list[Measurement], tries: int) -> Row:
    """The chain table's row of one measured pair (a step's or its retry's)."""
    return Row(step, label, describe(cand, inc), v.decision, v.reason, _nums(v.ratio),
               accuracy_cell(v.accuracy, v.cumulative), inc_m.regime, ms[1].regime,
               tuple(m.config_hash for m in ms), tries)


def _count(n: float) -> str:
    return "inf" if not math.isfinite(n) else f"{int(math.ceil(n)):,}"


def _duration(s: float) -> str:
    return f"{s:.0f} s" if s < 90 else f"{s / 60:.1f} min"


@dataclass
class ChainResult:
    rows: list[Row]
    incumbent: Point
    incumbent_measurement: Optional[Measurement]
    stop: str
    trials: int  # trials run now
    reused: int  # trials reused from the store
    path: list[Point] = field(default_factory=list)  # baseline, then each accepted point
    total: Optional[Ratio] = None  # the final configuration vs the baseline, one more interleaved pair


class Chain:
    def __init__(self, space: Mapping[str, list[str]], objective: Objective, rules: Rules, budget: Budget,
                 measure: Measure, *, baseline: Optional[Point] = None, eval_limit: int = 0,
                 trust_regime: bool = True, clock: Callable[[], float] = time.monotonic, echo=lambda s: None,
                 predict: Optional[Predict] = None, score_neutral: tuple[str, ...] = (), eval_baseline: bool = True,
                 total_pair: bool = True, item_pool: int = 0,
                 weights: Optional[Callable[[Point], Optional[float]]] = None, prescreen: int = 0):
        self.space = {k: list(v) for k, v in space.items()}
        self.baseline = dict(baseline or baseline_of(space))
        self.objective, self.rules, self.budget, self._measure = objective, rules, budget, measure
        self.eval_limit, self.trust_regime, self.clock, self.echo = eval_limit, trust_regime, clock, echo
        self.predict, self.score_neutral, self.eval_baseline = predict, tuple(score_neutral), eval_baseline
        self.total_pair = total_pair
        self.weights = weights  # a point -> its weight bytes (predict.WeightBytes), None where unknown
        self.item_pool = item_pool  # items the gate's tasks hold in all (eval.order=pooled); 0: not known
        self.trials = self.reused = 0
        self._used: set[str] = set()  # run ids this chain measured or reused (a fresh pair skips them)
        self._pairs: dict[tuple, list] = {}  # (incumbent, candidate) -> the timing measurements taken of the pair
        self._t0 = 0.0
        self._reference: dict[int, Measurement] = {}  # eval.limit -> the baseline's per-item answers at it
        # the gate's fidelity pre-screen (prescreen.py): `prescreen` windows of fixed text per configuration; 0: off
        self.screen = Prescreener(prescreen, self._run) if prescreen and rules.gate else None

    def _same_scores(self, inc: Point, cand: Point) -> str:
        """The keys the pair differs in when none of them can change the task scores ('' otherwise)."""
        diff = [k for k in cand if cand[k] != inc.get(k)]
        if diff and all(axis_registry.resolve_key(k) in self.score_neutral for k in diff):
            return ", ".join(diff)
        return ""

    def _predicted_loss(self, inc: Point, cand: Point) -> str:
        """Why right-sizing to `cand`'s model cannot pay off ('' when it may): more weight bytes and a longer
        predicted time per token than the incumbent (engine/measure/costmodel.py's roofline, same workload and
        optimizations). A model the roofline cannot predict is measured, and so is any model while speculative
        decoding is on: the roofline prices one target pass per token, but the tokens a pass yields depend on how
        well the draft matches *that* model (measured here: prompt lookup gave Gemma 3 270M 3.5 tokens per step
        and SmolLM2 1.75 on the same text, which made the larger model the faster one)."""
        if self.predict is None:
            return ""
        on = {axis_registry.resolve_key(k): v for k, v in inc.items()}
        if any(a.applied(on) and not a.one_pass_per_token for a in axis_registry.AXES):
            return ""
        mine, theirs = self.predict(cand), self.predict(inc)
        if mine is None or theirs is None or theirs[0] <= 0 or theirs[1] <= 0:
            return ""
        t, b = mine[0] / theirs[0], mine[1] / theirs[1]
        if t > 1 and b > 1:
            return (f"cost model: predicted x{t:.2f} slower per token with x{b:.1f} the weight bytes "
                    f"(roofline): not spent as a trial")
        return ""

    def _over_memory(self, cand: Point) -> str:
        """Why `cand` cannot meet the memory limit whatever it measures ('' when it may): its weights alone exceed
        it, and the limit is judged on the candidate's peak, which holds them."""
        limit = self.rules.max_memory_bytes
        b = self.weights(cand) if self.weights is not None and limit is not None else None
        if b is None or b <= limit:
            return ""
        return (f"memory: its weights alone ({b / 1e9:.2f} GB) exceed optimize.max_memory_gb ({limit / 1e9:.2f} GB): "
                f"not spent as a trial")

    # --- budget ----------------------------------------------------------------------------------------
    def _spent(self) -> str:
        if self.trials >= self.budget.max_trials:
            return f"budget: {self.trials} trials"
        if self.budget.max_s and self.clock() - self._t0 >= self.budget.max_s:
            return f"budget: {self.budget.max_s:.0f} s"
        return ""

    def _run(self, req: Request) -> list[Measurement]:
        (ms,) = self._measure([req])
        self._used.update(m.run_id for m in ms if m.run_id)
        reused, ran = spent(ms)
        self.reused, self.trials = self.reused + reused, self.trials + ran
        return ms

    def _at(self, p: Point, limit: int) -> Point:
        """`p` with the task eval at `limit` items (the configured limit: `p` itself, so its hash is the sweep's)."""
        return dict(p) if not limit or limit == self.eval_limit else {**p, EVAL_LIMIT: str(limit)}

    def _reference_at(self, limit: int) -> Measurement:
        """The baseline's per-item answers at `limit` items: measured once (alone) and kept."""
        if limit not in self._reference:
            (m,) = self._run(Request((self._at(self.baseline, limit),)))
            self._reference[limit] = m
        return self._reference[limit]

    # --- one pair --------------------------------------------------------------------------------------
    def measure_pair(self, inc: Point, cand: Point, retry: bool = False) -> tuple[Verdict, list[Measurement], int]:
        """Measure `cand` against `inc` until a verdict needs nothing more, the pair's attempts are used up or the
        budget ends: (verdict, the last measurements of the pair, measurements taken). `retry`: the chain's end
        measures a pair still undecided again -- its earlier measurements pooled with up to `rules.retries` more
        (the per-look level counts them: Rules.looks) -- where the pair was measured before; else as new.

        Timing: interleaved attempts, the clean rounds of all of them pooled, each judged at the rule's per-look
        level (decide.py). Accuracy, once the timing accepts: the candidate's items against the incumbent's and
        the baseline's, the item count doubled while either gate is undecided (looks at the gate's level)."""
        same = self._same_scores(inc, cand)
        # timing never scores items where the gate will: the gate's looks are trials of their own, at sizes shared by
        # every pair (the incumbent's answers scored once, reused by hash), and a pair its timing rejects costs none
        eval_off = {EVAL_OFF: "false"} if same or self.rules.gate else {}
        key = (tuple(sorted(inc.items())), tuple(sorted(cand.items())))
        prior = self._pairs.get(key, []) if retry else []
        attempts: list[tuple[Measurement, Measurement]] = list(prior)
        most = len(prior) + self.rules.retries if prior else self.rules.attempts
        tries = 0
        while True:  # --- timing
            pts = ({**inc, **eval_off}, {**cand, **eval_off})
            # a fresh measurement: never one this chain already used (a rerun finds each again, in order)
            ms = self._run(Request(pts, interleaved=True, skip=frozenset(self._used)))
            tries += 1
            attempts.append((ms[0], ms[1]))
            self._pairs[key] = attempts
            v = judge_timing(attempts, self.objective, self.rules)
            if v.needs != REMEASURE:
                break
            spent = self._spent()
            if len(attempts) >= most or spent:
                why = spent or f"{len(attempts)} measurement(s)"
                return Verdict(UNDECIDED_PAIR, f"{v.reason}; stopped after {why}", v.ratio, needs=REMEASURE), ms, tries
            self.echo(f"  measuring again ({len(attempts) + 1}/{most}): {v.reason}")
        if v.decision != ACCEPTED:
            return v, ms, tries
        if same:
            v.reason += f"; accuracy equal by construction ({same}: task scores do not depend on it)"
        elif self.rules.gate:  # --- accuracy
            v, more = self._gate(inc, cand, v)
            tries += more
            if v.decision != ACCEPTED:
                return v, ms, tries
        if self.rules.max_memory_bytes is not None:  # --- memory, on a measurement whose peak is the process's
            (solo,) = self._run(Request(({**cand, EVAL_OFF: "false"},)))
            tries += 1
            if mem := (memory_problem(solo, self.rules) if solo.ok else f"memory: solo run {solo.status.lower()}"):
                return Verdict(REJECTED, f"{mem} (measured alone; {v.reason})", v.ratio, v.accuracy, v.cumulative), ms, tries
        return v, ms, tries

    # --- the accuracy gate -------------------------------------------------------------------------------
    def _look(self, inc: Point, cand: Point, n: int) -> tuple[Optional[tuple[Measurement, Measurement, Measurement]], str, float]:
        """One look of the gate at `n` items: (incumbent, candidate, baseline) answers, or None and why it failed;
        and the seconds the look took per trial it ran (not reused)."""
        t0, before = self.clock(), self.trials
        inc_m, cand_m = self._run(Request((self._at(inc, n), self._at(cand, n))))
        if not (inc_m.ok and cand_m.ok):
            bad = cand_m if not cand_m.ok else inc_m
            return None, f"at eval.limit={n}: {bad.error or bad.status}", 0.0
        # the baseline's answers: the incumbent's own where it differs from the baseline only in axes that cannot
        # change a score (their answers are the same by construction), else measured at this count (kept)
        same_as_base = inc == self.baseline or self._same_scores(self.baseline, inc)
        ref = inc_m if same_as_base else self._reference_at(n)
        ran = self.trials - before
        return (inc_m, cand_m, ref), "", (self.clock() - t0) / ran if ran else 0.0

    def _judge_items(self, v: Verdict, inc_m: Measurement, cand_m: Measurement, ref: Measurement) -> tuple[str, str, str]:
        v.accuracy = pooled_of(inc_m, cand_m, self.rules)
        v.cumulative = pooled_of(ref, cand_m, self.rules) if ref is not inc_m else []
        return judge_accuracy(v.accuracy, v.cumulative)

    def _gate(self, inc: Point, cand: Point, v: Verdict) -> tuple[Verdict, int]:
        """The paired accuracy gate of `cand` (timing accepted) against the incumbent and the baseline, on the items of
        every task pooled (eval.order=pooled draws them), in at most `rules.gate_looks` looks at the one-sided level
        `rules.gate_alpha` each: the first at eval.limit items; after it, the plan -- the items that decide the pair
        with PLAN_POWER from the discordance seen (accuracy.items_needed), rounded up the ladder of shared look
        sizes -- printed with its cost, and refused without a trial where it exceeds the pool or
        optimize.gate.max_items. (verdict, trials asked for)."""
        first = self.eval_limit or 50
        cap = self._cap()
        n, tries, looks, per_item = self._first_look(inc, cand, first, cap), 0, 0, 0.0
        while True:
            got, err, secs = self._look(inc, cand, n)
            tries, looks = tries + 1, looks + 1
            if got is None:
                return Verdict(RUN_FAILED, err, v.ratio), tries
            inc_m, cand_m, ref = got
            decision, why, needs = self._judge_items(v, inc_m, cand_m, ref)
            seen = min((a.n for a in v.accuracy + v.cumulative), default=n)
            per_item = secs / max(1, seen) if secs else per_item  # a trial's seconds per item (the cost's estimate)
            per = max(seen, 1) / n  # items a unit of eval.limit gives: 1 pooled; the tasks' count under order=first
            if self.item_pool and seen < n:  # the pool ran out below the size asked for: it is the cap
                cap = seen
            if needs != MORE_ITEMS:
                break
            if looks >= self.rules.gate_looks:
                why += f" after {looks} looks"
                break
            open_ = [a for a in v.accuracy + v.cumulative if a.verdict == UNDECIDED]
            plan = plan_look(open_, seen, max(1, round(first * per)), cap, self.rules.max_drop, self.rules.gate_alpha)
            if plan.items is None:
                why += "; " + plan.undecided(self._cap_name(cap))
                break
            if stop := self._spent():
                why += f"; stopped: {stop}"
                break
            cost = f", ~{_duration(per_item * plan.items * 2)}" if per_item * plan.items * 2 >= 1 else ""
            n = max(n + 1, math.ceil(plan.items / per - 1e-9))
            self.echo(f"  {describe(cand, inc)}: {plan.differ}; ~{_count(plan.need)} items decide it{cost} "
                      f"(look {looks + 1} of at most {self.rules.gate_looks}: {plan.items} items, eval.limit={n})")
        if decision != ACCEPTED:
            return Verdict(decision, f"{why} ({v.reason})", v.ratio, v.accuracy, v.cumulative), tries
        v.reason += f"; {why}" if why else ""
        return v, tries

    # --- the fidelity pre-screen ------------------------------------------------------------------------
    def _cap(self) -> int:
        """The most items a look may take: optimize.gate.max_items, or the pool where it holds fewer."""
        return min(self.budget.max_items, self.item_pool) if self.item_pool else self.budget.max_items

    def _cap_name(self, cap: int) -> str:
        """What limits a look at `cap` items, as a plan's reason names it."""
        return "the pool's" if self.item_pool and cap == self.item_pool else "optimize.gate.max_items"

    def _refs(self, inc: Point) -> list[tuple[str, Point]]:
        """The gate's references of a candidate on top of `inc`: the incumbent, and the baseline where its scores
        can differ from the incumbent's."""
        out = [("the incumbent", inc)]
        if inc != self.baseline and not self._same_scores(self.baseline, inc):
            out.append(("the baseline", self.baseline))
        return out

    def _screens(self, inc: Point, cand: Point) -> list[tuple[str, Prescreen]]:
        """The pre-screen's comparisons of `cand` with the gate's references: the incumbent, and the baseline
        where its scores can differ from the incumbent's ([] where the pre-screen has none)."""
        if self.screen is None or self._same_scores(inc, cand):
            return []
        return [(who, c) for who, p in self._refs(inc) if (c := self.screen.compare(p, cand)) is not None]

    def _screened(self, step: Step, inc: Point) -> tuple[str, ...]:
        """A step's variants ordered by the pre-screen, most faithful to the incumbent first (the seed's order
        where it has nothing, or on ties), each configuration's ids measured once."""
        cands = [{**inc, step.key: v} for v in step.variants]
        if self.screen is None or step.key in MODEL_KEYS or all(self._same_scores(inc, c) for c in cands):
            return step.variants
        self.screen.measure([p for _, p in self._refs(inc)] + cands)
        share = {}
        for v, c in zip(step.variants, cands):
            screens = self._screens(inc, c)
            share[v] = screens[0][1].share if screens else 1.0
            for who, ps in screens:
                self.echo(f"  pre-screen: {describe(c, inc)} vs {who}: {ps.cell()}, ~{100 * ps.discordance:.1f}% of "
                          f"items predicted to differ, ~{_count(ps.need(self.rules.max_drop, self.rules.gate_alpha))} "
                          f"items decide it")
        return tuple(sorted(step.variants, key=lambda v: share[v]))

    def _hopeless(self, inc: Point, cand: Point) -> str:
        """Why the gate cannot decide `cand` within its cap even on the pre-screen's low prediction of its
        discordance ('' when it may): the plan's own rule (accuracy.plan_look) applied before any item."""
        cap = self._cap()
        for who, ps in self._screens(inc, cand):
            need = ps.need(self.rules.max_drop, self.rules.gate_alpha)
            if need > cap and ps.power_at(cap, self.rules.max_drop, self.rules.gate_alpha) < FLOOR:
                differ = f"pre-screen vs {who}: {ps.cell()}, ~{100 * ps.discordance:.1f}% of items predicted to differ"
                return "accuracy undecided: " + Plan(need, None, differ, cap).undecided(self._cap_name(cap))
        return ""

    def _first_look(self, inc: Point, cand: Point, first: int, cap: int) -> int:
        """The gate's first item count: eval.limit, or on pooled items the ladder's size the pre-screen's
        predicted discordance needs (never past the cap)."""
        needs = [ps.need(self.rules.max_drop, self.rules.gate_alpha) for _, ps in self._screens(inc, cand)]
        if not (self.item_pool and needs and max(needs) > first):
            return first
        n = next_look(max(needs), 0, first, cap) or cap
        self.echo(f"  {describe(cand, inc)}: first look at {n:,} items (the pre-screen's plan)")
        return n

    def _trusted_regime(self, inc_m: Measurement, rows: list[Row]) -> str:
        """Why the incumbent's regime cannot decide a skip ('' when it can): an undecided earlier pair (the
        incumbent may not be what the chain would have kept) or a measurement flagged for load."""
        if any(r.decision == UNDECIDED_PAIR for r in rows):
            return "an earlier step is undecided"
        if loaded(inc_m):
            return "the incumbent's measurement was flagged for load"
        return ""

    # --- the walk --------------------------------------------------------------------------------------
    def run(self) -> ChainResult:
        self._t0 = self.clock()
        inc = dict(self.baseline)
        # the baseline's own task accuracy: the chain's reference (cumulative gate), kept at its eval.limit
        (m0,) = self._run(Request((inc if self.eval_baseline else {**inc, EVAL_OFF: "false"},)))
        rows = [Row(0, "baseline", describe(inc), BASELINE if m0.ok else RUN_FAILED,
                    "" if m0.ok else (m0.error.splitlines()[0] if m0.error else m0.status),
                    regime_before=m0.regime, regime_after=m0.regime, hashes=(m0.config_hash,))]
        path = [dict(inc)]
        if not m0.ok:
            return ChainResult(rows, inc, None, BASELINE_FAILED, self.trials, self.reused, path)
        if self.eval_baseline and m0.correct:
            self._reference[self.eval_limit] = m0
        inc_m = m0
        stop = "end of chain"
        pending: list[tuple[int, Step, str, Point]] = []  # pairs left undecided on timing: retried at the end
        for i, step in enumerate(plan(self.space, self.baseline), start=1):
            ok, why = pays_off(step.key, inc_m.labels)
            distrust = self._trusted_regime(inc_m, rows) if ok is False else ""
            if ok is False and self.trust_regime and not distrust:
                rows.append(Row(i, step.label, f"{step.key}={','.join(step.variants)}", SKIPPED,
                                f"regime: {why}", regime_before=inc_m.regime))
                continue
            if ok is False and self.trust_regime:
                self.echo(f"step {i} ({step.label}): measured although the regime says '{why}': {distrust}")
            variants = self._screened(step, inc) if not self._spent() else step.variants
            for variant in variants:
                stop = self._spent()
                if stop:
                    break
                cand = {**inc, step.key: variant}
                if (step.key in MODEL_KEYS and (why := self._predicted_loss(inc, cand))) or (why := self._over_memory(cand)):
                    rows.append(Row(i, step.label, describe(cand, inc), SKIPPED, why, regime_before=inc_m.regime))
                    self.echo(f"step {i} ({step.label}): {describe(cand, inc)} skipped: {why}")
                    continue
                if why := self._hopeless(inc, cand):
                    rows.append(Row(i, step.label, describe(cand, inc), UNDECIDED_PAIR, why, regime_before=inc_m.regime))
                    self.echo(f"step {i} ({step.label}): {describe(cand, inc)} {why}")
                    continue
                self.echo(f"step {i} ({step.label}): {describe(cand, inc)} vs incumbent")
                v, ms, tries = self.measure_pair(inc, cand)
                rows.append(_pair_row(i, step.label, cand, inc, inc_m, v, ms, tries))
                self.echo(f"  -> {v.decision}: {v.reason}")
                if v.decision == ACCEPTED:  # the rest of the step's variants must beat this one
                    inc, inc_m = cand, ms[1]
                    path.append(dict(inc))
                elif v.decision == UNDECIDED_PAIR and v.needs == REMEASURE:
                    pending.append((i, step, variant, dict(inc)))
            if stop:
                break
        else:
            stop = "end of chain"
        if pending and self.rules.retries:  # an undecided pair left for want of budget: the stop says so
            if not self._spent():
                inc, inc_m = self._retry(pending, inc, inc_m, rows, path)
            stop = self._spent() or stop
        total = self._total(inc, rows) if self.total_pair and inc != self.baseline else None
        return ChainResult(rows, inc, inc_m, stop or "end of chain", self.trials, self.reused, path, total)

    def _retry(self, pending: list[tuple[int, Step, str, Point]], inc: Point, inc_m: Measurement, rows: list[Row],
               path: list[Point]) -> tuple[Point, Measurement]:
        """The chain's end, while budget remains: each pair whose timing was left undecided measured again, in the
        chain's order. Where the incumbent is still the one it was measured against, the pair's earlier
        measurements are pooled with up to `rules.retries` more (the per-look level was set for them all:
        Rules.looks); where a later step changed the incumbent, the variant on top of the final incumbent is a new
        pair, judged like any step. An accepted retry becomes the incumbent."""
        n = max(r.step for r in rows)
        for i, step, variant, then in pending:
            if self._spent():
                break
            cand = {**inc, step.key: variant}
            if cand == inc:
                continue
            n += 1
            how = "its measurements pooled" if then == inc else "the incumbent changed since: a new pair"
            self.echo(f"retry of step {i} ({step.label}): {describe(cand, inc)} vs incumbent ({how})")
            v, ms, tries = self.measure_pair(inc, cand, retry=True)
            rows.append(_pair_row(n, step.label + RETRY, cand, inc, inc_m, v, ms, tries))
            self.echo(f"  -> {v.decision}: {v.reason}")
            if v.decision == ACCEPTED:
                inc, inc_m = cand, ms[1]
                path.append(dict(inc))
        return inc, inc_m

    def _total(self, final: Point, rows: list[Row]) -> Optional[Ratio]:
        """The chain's total gain: the final configuration against the baseline as one more interleaved pair,
        never selected on significance, so its 95% interval is an honest estimate of what the chain bought."""
        off = {EVAL_OFF: "false"}
        self.echo(f"total: {describe(final, self.baseline)} vs the baseline")
        # a fresh pair, never a step's own: where the final configuration is one step from the baseline, the step's
        # pair has the same two hashes and group, and reusing it would report the selected measurement again.
        # Every run this chain used is skipped: the total is the group's first run no step took.
        ms = self._run(Request(({**self.baseline, **off}, {**final, **off}), interleaved=True,
                               skip=frozenset(self._used)))
        r = self.objective.sequential([(ms[0], ms[1])], 0.025) if all(m.ok for m in ms) else None
        note = "; ".join(f"{who} {m.unstable.split(';')[0]}" for who, m in zip(("baseline", "final"), ms) if loaded(m))
        reason = (f"the final configuration vs the baseline, one interleaved pair (95%)" if r is not None else
                  "the final pair failed: " + "; ".join(m.error.splitlines()[0] for m in ms if m.error))
        rows.append(Row(max(r.step for r in rows) + 1, "total", describe(final, self.baseline), TOTAL,
                        reason + (f"; unstable: {note}" if note else ""), _nums(r),
                        hashes=tuple(m.config_hash for m in ms)))
        return r
