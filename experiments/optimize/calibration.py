"""What the chain's verdicts guarantee, measured: the chain's own pair loop (`Chain.measure_pair`, the judge and
rules it uses) driven over many seeds by a simulated machine, whose timings and per-item answers are known.

The simulated machine follows the engine's interleaved measurement: `rounds` rounds, then rounds added by the
engine's own extension rule (engine.pipeline.more_rounds: while the pair's paired interval holds x1 and is wider
than +-UNSTABLE_HALF_WIDTH, at most EXTENSIONS times), within `max_rounds`. Its noise: each variant's round is
lognormal (`sigma`), serially correlated within a measurement where `rho` > 0 (an AR(1) slow-load pattern: each
round's log-noise is rho times the last one's plus fresh noise, the marginal sd still `sigma`), and meets an x2
stall with probability `stall`; each measurement shifts the candidate's rounds by its own lognormal `offset` (a
process that happens to run one variant faster, which pooling the measurements' rounds alone cannot see); an
attempt is flagged for load with probability `load` (and then biased in the candidate's favour, so that using it
would show). Nothing here is a copy of a decision: every verdict counted is the chain's.

`python -m experiments.optimize.calibration` prints the calibration table (BENCHMARKS.md, docs/optimize.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import numpy as np

from .accuracy import HOLDS, UNDECIDED, WORSE
from .chain import Chain
from .measurement import EVAL_LIMIT, EVAL_OFF, FINISHED, Measurement, Request
from .objective import Objective
from .types import ACCEPTED, REJECTED, REMEASURE, UNDECIDED_PAIR, Budget, Rules

METRIC = "tpot_ms_p50"
SPACE = {"kv_cache": ["off", "contiguous"]}
BASE, CAND = {"kv_cache": "off"}, {"kv_cache": "contiguous"}


@dataclass(frozen=True)
class Noise:
    sigma: float = 0.10  # lognormal sd of each variant's round
    stall: float = 0.05  # P(a variant's round meets an x2 stall)
    load: float = 0.0  # P(an attempt is flagged for load)
    load_bias: float = 1.3  # a loaded attempt's candidate looks this much faster
    rho: float = 0.0  # lag-1 correlation of a variant's log-noise from round to round within a measurement (AR(1))
    offset: float = 0.0  # lognormal sd of a whole measurement's shift of the candidate's rounds

    def label(self) -> str:
        return (f"lognormal {self.sigma:.0%}, x2 stalls {self.stall:.0%}" + (f", AR(1) rho {self.rho:g}" if self.rho else "")
                + (f", offsets {self.offset:.0%}" if self.offset else "") + (f", load {self.load:.0%}" if self.load else ""))


def _engine_rule():
    from engine.pipeline import EXTENSIONS, more_rounds

    return EXTENSIONS, more_rounds


class SimulatedMachine:
    """A `Measure` of one pair: interleaved requests get rounds (and the engine's extensions); single requests
    (more items, memory) get per-item answers. `correct`: the seed's items, (incumbent, candidate) 0/1 arrays."""

    def __init__(self, true_ratio: float, noise: Noise, rng: np.random.Generator, rounds: int, max_rounds: int,
                 extend: bool = True, correct: Optional[tuple[np.ndarray, np.ndarray]] = None):
        self.true_ratio, self.noise, self.rng = true_ratio, noise, rng
        self.rounds, self.max_rounds, self.extend, self.correct = rounds, max_rounds, extend, correct
        self.total_rounds = 0
        self.stops = 0  # the most sizes one measurement's rounds could have stopped at (1 + the rule's looks)
        self.first_items = 0  # the items of a trial at the configured eval.limit (0: all of `correct`)

    def _times(self, n: int, ratio: float, state: list) -> tuple[np.ndarray, np.ndarray]:
        """n more rounds of (incumbent, candidate) times; `state`: each variant's last log-noise (AR(1)), updated."""
        nz = self.noise
        drift = np.exp(self.rng.normal(0, 0.05, n))  # shared by the round: cancels in the ratio

        def one(t, v):
            stall = np.where(self.rng.random(n) < nz.stall, 2.0, 1.0)
            e = self.rng.normal(0, nz.sigma, n)
            if nz.rho:  # stationary AR(1): x_t = rho x_{t-1} + sqrt(1 - rho^2) e_t, the first from the last state
                c = math.sqrt(1 - nz.rho ** 2)
                for i in range(n):
                    prev = e[i - 1] if i else state[v]
                    e[i] = e[i] if prev is None else nz.rho * prev + c * e[i]
                state[v] = float(e[-1])
            return t * drift * np.exp(e) * stall

        return one(100.0, 0), one(100.0 / ratio, 1)

    def _rounds(self, ratio: float) -> tuple[np.ndarray, np.ndarray]:
        extensions, more_rounds = _engine_rule()
        if self.noise.offset:  # this measurement's own shift of the candidate
            ratio *= math.exp(self.rng.normal(0, self.noise.offset))
        state: list = [None, None]
        a, b = self._times(self.rounds, ratio, state)
        stops = 1
        for _ in range(extensions if self.extend else 0):
            stops += len(a) < self.max_rounds  # the rule looks: the rounds may stop here or grow
            k, _ = more_rounds([{METRIC: a.tolist()}, {METRIC: b.tolist()}], len(a), self.max_rounds)
            if k <= 0:
                break
            a2, b2 = self._times(k, ratio, state)
            a, b = np.concatenate([a, a2]), np.concatenate([b, b2])
        self.stops = max(self.stops, stops)
        return a, b

    def _items(self, p: dict) -> list[float]:
        inc, cand = self.correct
        n = int(p.get(EVAL_LIMIT, 0)) or self.first_items or len(inc)  # no eval.limit: the configured count
        return [float(x) for x in (cand if p.get("kv_cache") == "contiguous" else inc)[:n]]

    def __call__(self, requests: Sequence[Request]) -> list[list[Measurement]]:
        out = []
        for req in requests:
            ms = []
            if req.interleaved:
                flagged = self.rng.random() < self.noise.load
                a, b = self._rounds(self.true_ratio * (self.noise.load_bias if flagged else 1.0))
                self.total_rounds += len(a)
                for p, xs in zip(req.points, (a, b)):
                    ms.append(self._measurement(p, list(map(float, xs)), "load: simulated" if flagged else ""))
            else:
                ms = [self._measurement(p, [], "") for p in req.points]
            out.append(ms)
        return out

    def _measurement(self, p: dict, rounds: list[float], unstable: str) -> Measurement:
        correct = {} if (self.correct is None or p.get(EVAL_OFF) == "false") else {"task": self._items(p)}
        metrics = {METRIC: float(np.median(rounds)) if rounds else 100.0, "peak_mem_bytes": 1e8}
        return Measurement(dict(p), FINISHED, metrics, {METRIC: rounds} if rounds else {}, correct,
                           {"unstable": unstable} if unstable else {}, config_hash="sim")


def _chain(rules: Rules, machine: SimulatedMachine, eval_limit: int = 0, max_items: int = 200) -> Chain:
    return Chain(SPACE, Objective.parse("tpot"), rules, Budget(max_trials=10 ** 6, max_s=0, max_items=max_items),
                 machine, eval_limit=eval_limit, trust_regime=False, total_pair=False)


@dataclass(frozen=True)
class TimingRates:
    accepted: float
    rejected: float
    undecided: float
    trials: float  # mean trials of a pair
    rounds: float  # mean rounds of a pair (all its measurements)
    measurements: int = 0  # the most measurements any pair took (the walk's and the end's retries)
    stops: int = 0  # the most sizes one measurement's rounds could have stopped at (the engine rule's looks + 1)
    seeds: int = 0

    @property
    def false_accepts(self) -> int:
        return round(self.accepted * self.seeds)


def timing_rates(true_ratio: float, rules: Rules, noise: Noise = Noise(), seeds: int = 2000, rounds: int = 9,
                 max_rounds: int = 30, extend: bool = True, seed: int = 0) -> TimingRates:
    """How often the chain's pair loop accepts / rejects / leaves undecided a candidate truly `true_ratio`
    times faster, over `seeds` simulated pairs (the accuracy gate off: timing alone), the end's retry of a pair
    still undecided included (every such pair retried: the worst case for false acceptance)."""
    rules = replace(rules, gate=False, max_memory_bytes=None, slo={})
    counts = {ACCEPTED: 0, REJECTED: 0}
    trials = rounds_ = most = stops = 0
    for s in range(seeds):
        m = SimulatedMachine(true_ratio, noise, np.random.default_rng([seed, s]), rounds, max_rounds, extend)
        chain = _chain(rules, m)
        v, _, tries = chain.measure_pair(BASE, CAND)
        if v.decision == UNDECIDED_PAIR and v.needs == REMEASURE and rules.retries:  # the chain's end, as run()
            v, _, more = chain.measure_pair(BASE, CAND, retry=True)
            tries += more
        counts[v.decision] = counts.get(v.decision, 0) + 1
        trials += 2 * tries
        rounds_ += m.total_rounds
        most, stops = max(most, tries), max(stops, m.stops)
    acc, rej = counts[ACCEPTED] / seeds, counts[REJECTED] / seeds
    return TimingRates(acc, rej, 1 - acc - rej, trials / seeds, rounds_ / seeds, most, stops, seeds)


@dataclass(frozen=True)
class GateRates:
    holds: float  # the pair accepted: the gate held
    worse: float
    undecided: float
    items: float  # mean items of the last look


def gate_rates(drop: float, rules: Rules, discordant: float = 0.0, seeds: int = 2000, limit: int = 50,
               max_items: int = 200, base_accuracy: float = 0.6, seed: int = 0) -> GateRates:
    """How often the chain's gate holds / finds worse / stays undecided for a candidate that truly loses `drop`
    of the items against the incumbent (with `discordant` more items flipping both ways: p10 = drop +
    discordant / 2, p01 = discordant / 2), over `seeds` simulated pairs whose timing clearly accepts."""
    rules = replace(rules, gate=True, max_memory_bytes=None, slo={})
    p10, p01 = drop + discordant / 2, discordant / 2
    out = {HOLDS: 0, WORSE: 0, UNDECIDED: 0}
    items = 0
    for s in range(seeds):
        rng = np.random.default_rng([seed, 1, s])
        inc = (rng.random(max_items) < base_accuracy).astype(float)
        u = rng.random(max_items)
        # P(flip to wrong | right) and P(flip to right | wrong) that give the joint rates p10 and p01
        cand = np.where(inc == 1, (u >= p10 / base_accuracy).astype(float), (u < p01 / (1 - base_accuracy)).astype(float))
        m = SimulatedMachine(3.0, Noise(sigma=0.01, stall=0.0), rng, 9, 9, False, (inc, cand))
        m.first_items = limit
        v, _, _ = _chain(rules, m, limit, max_items).measure_pair(BASE, CAND)
        verdict = HOLDS if v.decision == ACCEPTED else (WORSE if v.decision == REJECTED else UNDECIDED)
        out[verdict] += 1
        items += v.accuracy[0].n if v.accuracy else 0
    return GateRates(out[HOLDS] / seeds, out[WORSE] / seeds, out[UNDECIDED] / seeds, items / seeds)


# --- the guarantees, checked -------------------------------------------------------------------------------
TIMING, GATE = "timing", "gate"
# the timing rule's noises (docs/optimize.md): independent rounds, AR(1) rounds (a slow-load pattern), offsets
# of whole measurements, and measurements flagged for load (never used, however they lean)
TIMING_NOISES = (Noise(), Noise(rho=0.5), Noise(offset=0.03), Noise(load=0.2))


def binomial_cdf(k: int, n: int, p: float) -> float:
    """P(Binomial(n, p) <= k), exactly (summed in log space: n runs to thousands)."""
    if k < 0:
        return 0.0
    if k >= n or p <= 0:
        return 1.0
    lp, lq = math.log(p), math.log1p(-p)
    return min(1.0, sum(math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq)
                        for i in range(k + 1)))


def most_errors(seeds: int, bound: float, slack: float = 1.5, miss: float = 0.01) -> int:
    """The most errors in `seeds` simulated pairs that still read as a rate within `bound`: a rate `slack`
    times the bound stays at or below it with probability < `miss`, so a rule whose error is off by x1.5 fails
    99 times in 100, while one at two thirds of its bound or less passes at the seed counts the tests use (a 2
    Monte Carlo SE margin above the bound, the old check, let a rate x1.12 the bound pass at 1,000 seeds and
    passed a level three times too loose). -1: no count is small enough (too few seeds for the bound)."""
    c = -1
    while binomial_cdf(c + 1, seeds, min(1.0, slack * bound)) < miss:
        c += 1
    return c


def timing_violations(rules: Rules, seeds: int = 1500, rounds: int = 9, max_rounds: int = 30,
                      noises: Sequence[Noise] = TIMING_NOISES, effects: Sequence[float] = ()) -> list[str]:
    """The timing rule's guarantees the simulation finds broken ([] when all hold), two ways:
    - its spending: the Bonferroni sum over every look one pair's procedure takes -- its measurements (counted
      by running the chain's pair loop where every measurement is left undecided, the end's retry included)
      times the sizes each measurement's rounds can stop at (counted from the engine's own extension rule) --
      of the per-look level the judge uses (Rules.timing_alpha), <= false_accept. That sum is what the stated
      error rests on; a false acceptance rate could not show a level off by x1.33 (it sits far below its bound
      where the looks overlap);
    - its false acceptance at a true gain of exactly min_effect (and at x1.00, in `effects`), over `noises`:
      at most `most_errors` of `seeds` pairs, so a rate x1.5 its bound fails."""
    out = []
    worst = timing_rates(1 + rules.min_effect, rules, Noise(load=1.0, load_bias=1.0), 30, rounds, max_rounds)
    looks = worst.measurements * worst.stops
    spent = looks * rules.timing_alpha
    if spent > rules.false_accept * (1 + 1e-9):
        out.append(f"timing level spent over {worst.measurements} measurements x {worst.stops} stopping sizes: "
                   f"{looks} x {rules.timing_alpha:.5f} = {spent:.2%} > false_accept {rules.false_accept:.1%}")
    for true in (1 + rules.min_effect, *effects):
        label = f"x{true:.2f}" + (" (= 1 + min_effect)" if true == 1 + rules.min_effect else "")
        bound = rules.false_accept if true == 1 + rules.min_effect else min(0.03, rules.false_accept)
        for noise in noises:
            r = timing_rates(true, rules, noise, seeds, rounds, max_rounds)
            if r.false_accepts > most_errors(seeds, bound):
                out.append(f"false acceptance at {label}, noise {noise.label()}: {r.false_accepts} of {seeds} = "
                           f"{r.accepted:.1%} > {bound:.1%} (at most {most_errors(seeds, bound)} read as within it)")
    return out


def violations(rules: Rules, seeds: int = 1500, rounds: int = 9, max_rounds: int = 30, limit: int = 50,
               max_items: int = 200, checks: tuple[str, ...] = (TIMING, GATE),
               noises: Sequence[Noise] = (Noise(), Noise(load=0.2))) -> list[str]:
    """The stated guarantees the simulation finds broken ([] when all hold): the timing rule's
    (timing_violations: its spending, and false acceptance at x1.00 and at a true gain of exactly min_effect),
    false holds <= false_holds at a true drop of exactly max_drop."""
    out = timing_violations(rules, seeds, rounds, max_rounds, noises, (1.0,)) if TIMING in checks else []

    def over(rate: float, bound: float) -> bool:
        return rate > bound + 2 * math.sqrt(bound * (1 - bound) / seeds)

    for discordant in (0.0, 0.06) if GATE in checks else ():
        g = gate_rates(rules.max_drop, rules, discordant, seeds, limit, max_items)
        if over(g.holds, rules.false_holds):
            out.append(f"false holds at a true drop of max_drop ({rules.max_drop:.0%}, {discordant:.0%} two-way "
                       f"discordant): {g.holds:.1%} > {rules.false_holds:.0%}")
    return out


def timing_cells(rules: Rules) -> list[tuple[Noise, tuple[float, ...]]]:
    """The timing rows of the calibration table: (noise, true effects) -- independent rounds at 2/5/10% over the
    effects, then correlated noise (AR(1) rho 0.5, whole-measurement offsets) and load at the boundary and x1.10."""
    bar = 1 + rules.min_effect
    cells = [(Noise(sigma=sg), (1.0, bar, 1.05, 1.10, 1.25)) for sg in (0.02, 0.05, 0.10)]
    cells += [(Noise(sigma=sg, rho=0.5), (1.0, bar, 1.10)) for sg in (0.02, 0.05, 0.10)]
    cells += [(Noise(sigma=sg, offset=off), (bar, 1.10)) for sg, off in ((0.02, 0.01), (0.05, 0.02), (0.10, 0.03), (0.10, 0.05))]
    return cells + [(Noise(load=0.2), (1.0, 1.10))]


def table(rules: Rules, seeds: int = 2000, rounds: int = 9, max_rounds: int = 30, limit: int = 50,
          max_items: int = 200, checks: tuple[str, ...] = (TIMING, GATE)) -> list[str]:
    """The calibration table's markdown lines."""
    lines = ["| setting | true effect | noise | accepted (timing) / holds (gate) | rejected / worse | undecided | "
             "mean trials or items |", "|---|---|---|---|---|---|---|"]
    for noise, effects in timing_cells(rules) if TIMING in checks else ():
        for true in effects:
            r = timing_rates(true, rules, noise, seeds, rounds, max_rounds)
            lines.append(f"| timing, {rounds}-{max_rounds} rounds x {rules.attempts}+{rules.retries} attempts | x{true:.2f} | "
                         f"{noise.label()} | {r.accepted:.1%} | {r.rejected:.1%} | {r.undecided:.1%} | {r.trials:.1f} trials, "
                         f"{r.rounds:.0f} rounds |")
    for drop, disc in ((rules.max_drop, 0.0), (rules.max_drop, 0.06), (0.0, 0.0), (0.0, 0.06), (0.01, 0.0),
                       (0.06, 0.0)) if GATE in checks else ():
        g = gate_rates(drop, rules, disc, seeds, limit, max_items)
        lines.append(f"| gate, {limit}->{max_items} items | drop {drop:.0%} | {disc:.0%} two-way discordant | "
                     f"{g.holds:.1%} | {g.worse:.1%} | {g.undecided:.1%} | {g.items:.0f} items |")
    return lines


def main() -> None:
    import argparse
    import time

    from .settings import OptimizeConf, rules_of

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=0, help="interleaved rounds of a measurement (0: the shipped minimum)")
    ap.add_argument("--only", choices=(TIMING, GATE), help="one rule's rows (default: both)")
    ap.add_argument("--limit", type=int, default=150, help="the gate's first look (optimize-cpu's eval.limit: 150)")
    args = ap.parse_args()
    o = OptimizeConf()
    rules = rules_of(o, True, args.limit)
    from .decide import min_rounds

    rounds = args.rounds or max(o.rounds, min_rounds(rules))
    t0 = time.perf_counter()
    print(f"rules: min_effect {rules.min_effect}, false_accept {rules.false_accept} over {rules.attempts} attempts "
          f"+ {rules.retries} retry "
          f"(look level {rules.timing_alpha:.4f}), max_drop {rules.max_drop}, false_holds {rules.false_holds} over "
          f"{rules.gate_looks} looks (look level {rules.gate_alpha:.4f}); {args.seeds} seeds\n")
    print("\n".join(table(rules, args.seeds, rounds, limit=args.limit, max_items=o.gate.max_items,
                           checks=(args.only,) if args.only else (TIMING, GATE))))
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
