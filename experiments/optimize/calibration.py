"""What the chain's verdicts guarantee, measured: the chain's own pair loop (`Chain.measure_pair`, the judge and
rules it uses) driven over many seeds by a simulated machine, whose timings and per-item answers are known.

The simulated machine follows the engine's interleaved measurement: `rounds` rounds, then -- while the pair's
95% interval holds x1 and is wider than +-UNSTABLE_HALF_WIDTH -- at most two extensions sized by the engine's
own `_more` (1/sqrt(n) narrowing), within `max_rounds`. Its noise: each variant's round is lognormal
(`sigma`), and meets an x2 stall with probability `stall`; an attempt is flagged for load with probability
`load` (and then biased in the candidate's favour, so that using it would show). Nothing here is a copy of a
decision: every verdict counted is the chain's.

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


def _engine_rule():
    from engine.measure.metrics import UNSTABLE_HALF_WIDTH
    from engine.measure.spread import t95
    from engine.pipeline import _more

    return UNSTABLE_HALF_WIDTH, t95, _more


class SimulatedMachine:
    """A `Measure` of one pair: interleaved requests get rounds (and the engine's extensions); single requests
    (more items, memory) get per-item answers. `correct`: the seed's items, (incumbent, candidate) 0/1 arrays."""

    def __init__(self, true_ratio: float, noise: Noise, rng: np.random.Generator, rounds: int, max_rounds: int,
                 extend: bool = True, correct: Optional[tuple[np.ndarray, np.ndarray]] = None):
        self.true_ratio, self.noise, self.rng = true_ratio, noise, rng
        self.rounds, self.max_rounds, self.extend, self.correct = rounds, max_rounds, extend, correct
        self.total_rounds = 0

    def _times(self, n: int, ratio: float) -> tuple[np.ndarray, np.ndarray]:
        nz = self.noise
        drift = np.exp(self.rng.normal(0, 0.05, n))  # shared by the round: cancels in the ratio

        def one(t):
            stall = np.where(self.rng.random(n) < nz.stall, 2.0, 1.0)
            return t * drift * np.exp(self.rng.normal(0, nz.sigma, n)) * stall

        return one(100.0), one(100.0 / ratio)

    def _rounds(self, ratio: float) -> tuple[np.ndarray, np.ndarray]:
        hw_target, t95, more = _engine_rule()
        a, b = self._times(self.rounds, ratio)
        for _ in range(2 if self.extend else 0):
            logs = np.log(a / b)
            n = len(logs)
            if n >= self.max_rounds:
                break
            half = t95(n - 1) * float(np.std(logs, ddof=1)) / math.sqrt(n)
            hw = math.exp(half) - 1
            if abs(float(np.mean(logs))) > half or hw <= hw_target:  # decided, or narrow: the engine stops
                break
            k = more(n, hw, hw_target, self.max_rounds, 1e9, 1.0)  # the round budget binds, not seconds
            if k <= 0:
                break
            a2, b2 = self._times(k, ratio)
            a, b = np.concatenate([a, a2]), np.concatenate([b, b2])
        return a, b

    def _items(self, p: dict) -> list[float]:
        inc, cand = self.correct
        n = int(p.get(EVAL_LIMIT, 0)) or len(inc)
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


def timing_rates(true_ratio: float, rules: Rules, noise: Noise = Noise(), seeds: int = 2000, rounds: int = 9,
                 max_rounds: int = 30, extend: bool = True, seed: int = 0) -> TimingRates:
    """How often the chain's pair loop accepts / rejects / leaves undecided a candidate truly `true_ratio`
    times faster, over `seeds` simulated pairs (the accuracy gate off: timing alone), the end's retry of a pair
    still undecided included (every such pair retried: the worst case for false acceptance)."""
    rules = replace(rules, gate=False, max_memory_bytes=None, slo={})
    counts = {ACCEPTED: 0, REJECTED: 0}
    trials = rounds_ = 0
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
    acc, rej = counts[ACCEPTED] / seeds, counts[REJECTED] / seeds
    return TimingRates(acc, rej, 1 - acc - rej, trials / seeds, rounds_ / seeds)


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
        v, _, _ = _chain(rules, m, limit, max_items).measure_pair(BASE, CAND)
        verdict = HOLDS if v.decision == ACCEPTED else (WORSE if v.decision == REJECTED else UNDECIDED)
        out[verdict] += 1
        items += v.accuracy[0].n if v.accuracy else 0
    return GateRates(out[HOLDS] / seeds, out[WORSE] / seeds, out[UNDECIDED] / seeds, items / seeds)


# --- the guarantees, checked -------------------------------------------------------------------------------
TIMING, GATE = "timing", "gate"


def violations(rules: Rules, seeds: int = 1500, rounds: int = 9, max_rounds: int = 30, limit: int = 50,
               max_items: int = 200, checks: tuple[str, ...] = (TIMING, GATE),
               noises: Sequence[Noise] = (Noise(), Noise(load=0.2))) -> list[str]:
    """The stated guarantees the simulation finds broken ([] when all hold), with a margin of two Monte Carlo
    standard errors above each stated rate: false acceptance <= false_accept at a true gain of exactly
    min_effect (and <= 3% at x1.00), false holds <= false_holds at a true drop of exactly max_drop."""
    out = []

    def over(rate: float, bound: float) -> bool:
        return rate > bound + 2 * math.sqrt(bound * (1 - bound) / seeds)

    for label, true in (("x1.00", 1.0), (f"x{1 + rules.min_effect:.2f} (= 1 + min_effect)", 1 + rules.min_effect)):
        for noise in noises if TIMING in checks else ():
            r = timing_rates(true, rules, noise, seeds, rounds, max_rounds)
            bound = min(0.03, rules.false_accept) if true == 1.0 else rules.false_accept
            if over(r.accepted, bound):
                out.append(f"false acceptance at {label}, noise {noise}: {r.accepted:.1%} > {bound:.1%}")
    for discordant in (0.0, 0.06) if GATE in checks else ():
        g = gate_rates(rules.max_drop, rules, discordant, seeds, limit, max_items)
        if over(g.holds, rules.false_holds):
            out.append(f"false holds at a true drop of max_drop ({rules.max_drop:.0%}, {discordant:.0%} two-way "
                       f"discordant): {g.holds:.1%} > {rules.false_holds:.0%}")
    return out


def table(rules: Rules, seeds: int = 2000, rounds: int = 9, max_rounds: int = 30, limit: int = 50,
          max_items: int = 200) -> list[str]:
    """The calibration table's markdown lines."""
    lines = ["| setting | true effect | noise | accepted (timing) / holds (gate) | rejected / worse | undecided | "
             "mean trials or items |", "|---|---|---|---|---|---|---|"]
    for sigma in (0.02, 0.05, 0.10):
        for true in (1.0, 1 + rules.min_effect, 1.05, 1.10, 1.25):
            for noise in ((Noise(sigma=sigma),) + ((Noise(sigma=sigma, load=0.2),) if sigma == 0.10 and true in (1.0, 1.10) else ())):
                r = timing_rates(true, rules, noise, seeds, rounds, max_rounds)
                lines.append(f"| timing, {rounds}-{max_rounds} rounds x {rules.attempts}+{rules.retries} attempts | x{true:.2f} | "
                             f"lognormal {noise.sigma:.0%}, x2 stalls {noise.stall:.0%}"
                             + (f", load {noise.load:.0%}" if noise.load else "")
                             + f" | {r.accepted:.1%} | {r.rejected:.1%} | {r.undecided:.1%} | {r.trials:.1f} trials, "
                             f"{r.rounds:.0f} rounds |")
    for drop, disc in ((rules.max_drop, 0.0), (rules.max_drop, 0.06), (0.0, 0.0), (0.0, 0.06), (0.01, 0.0),
                       (0.06, 0.0)):
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
    args = ap.parse_args()
    o = OptimizeConf()
    rules = rules_of(o, True, 50)
    from .decide import min_rounds

    rounds = args.rounds or max(o.rounds, min_rounds(rules))
    t0 = time.perf_counter()
    print(f"rules: min_effect {rules.min_effect}, false_accept {rules.false_accept} over {rules.attempts} attempts "
          f"+ {rules.retries} retry "
          f"(look level {rules.timing_alpha:.4f}), max_drop {rules.max_drop}, false_holds {rules.false_holds} over "
          f"{rules.gate_looks} looks (look level {rules.gate_alpha:.4f}); {args.seeds} seeds\n")
    print("\n".join(table(rules, args.seeds, rounds)))
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
