"""What `optimize` improves: one named metric, or a weighted / lexicographic combination of them, and how two
measurements compare on it -- a ratio (> 1: the candidate is better) with its 95% interval.

`optimize.objective` spells it: `tpot` (default), `ttft`, `output_tok_s`, `max_rate` (capacity at the SLO),
`goodput` (requests/s meeting the SLO at the workload's arrival rate, `vllm bench serve --goodput`), `peak_memory`; `0.7*tpot+0.3*peak_memory` (weighted: the weighted geometric mean of the ratios);
`tpot>peak_memory` (lexicographic: the first term whose ratio is not within noise decides).

Two readings of a comparison: `compare` (one look, 95%: what a report shows) and `sequential` / `reading` (the
chain's decision: the per-round log ratios of every attempt of a pair pooled, each round's terms combined in that
round -- the terms of a weighted objective come from the same runs, so their errors are not independent and must
not be added in quadrature -- with exact signed-rank bounds at the look's level, widened for the serial
correlation the rounds cannot rule out: engine.measure.spread.pooled_bounds).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional, Sequence

from engine.measure.spread import (FASTER, SLOWER, WITHIN_NOISE, Ratio, Serial, paired_ratio, pooled_bounds, ratio,
                                  spread_of)

from .measurement import Measurement


@dataclass(frozen=True)
class Term:
    name: str  # what the user writes
    metric: str  # the logged metric (engine/measure/metrics.py)
    higher_is_better: bool
    label: str


TERMS: dict[str, Term] = {t.name: t for t in (
    Term("tpot", "tpot_ms_p50", False, "TPOT"),
    Term("ttft", "ttft_ms_p50", False, "TTFT"),
    Term("output_tok_s", "output_tok_s", True, "output tok/s"),
    Term("max_rate", "max_rate_at_slo", True, "max rate at SLO"),
    # requests/s meeting every SLO at the workload's rate, half a request added to each round's count (goodput_cc):
    # a round where none met it (a candidate that breaks the SLO) still gives a ratio, pulled toward 1 (conservative)
    Term("goodput", "goodput_cc", True, "goodput at the SLO"),
    Term("peak_memory", "peak_mem_bytes", False, "peak memory"),
)}
WEIGHTED, LEXICOGRAPHIC, SINGLE = "weighted", "lexicographic", "single"


class ObjectiveError(ValueError):
    pass


def _term(name: str) -> Term:
    t = TERMS.get(name.strip())
    if t is None:
        raise ObjectiveError(f"unknown objective {name.strip()!r}; use one of {', '.join(TERMS)}, a weighted sum "
                             f"(0.7*tpot+0.3*peak_memory) or a lexicographic order (tpot>peak_memory)")
    return t


def metric_ratio(inc: Measurement, cand: Measurement, metric: str, higher_is_better: bool) -> Optional[Ratio]:
    """How many times better `cand` is than `inc` on `metric`: paired by round when both were measured in the
    same interleaved group, else from each trial's own interval; a metric logged without an interval (peak
    memory) compares as an exact ratio. None where either lacks the metric."""
    a, b = inc.rounds.get(metric), cand.rounds.get(metric)
    if a and b and len(a) == len(b) and len(a) >= 2:
        return paired_ratio(a, b, higher_is_better=higher_is_better)
    sa, sb = spread_of(inc.metrics, metric), spread_of(cand.metrics, metric)
    if sa is not None and sb is not None:
        return ratio(sa, sb, higher_is_better=higher_is_better)
    x, y = inc.metrics.get(metric), cand.metrics.get(metric)
    if not x or not y or x <= 0 or y <= 0:
        return None
    r = y / x if higher_is_better else x / y
    return Ratio(r, r, r, FASTER if r > 1 else (SLOWER if r < 1 else WITHIN_NOISE))


@dataclass(frozen=True)
class Objective:
    terms: tuple[Term, ...]
    weights: tuple[float, ...] = (1.0,)
    mode: str = SINGLE

    @classmethod
    def parse(cls, spec: str) -> "Objective":
        spec = str(spec).strip()
        if ">" in spec:
            terms = tuple(_term(s) for s in spec.split(">"))
            return cls(terms, tuple(1.0 for _ in terms), LEXICOGRAPHIC)
        if "+" in spec or "*" in spec:
            terms, weights = [], []
            for part in spec.split("+"):
                m = re.fullmatch(r"\s*(?:([0-9.]+)\s*\*\s*)?([a-z_]+)\s*", part)
                if m is None:
                    raise ObjectiveError(f"cannot read {part.strip()!r} of {spec!r}; write WEIGHT*NAME+WEIGHT*NAME")
                terms.append(_term(m.group(2)))
                weights.append(float(m.group(1) or 1.0))
            if sum(weights) <= 0:
                raise ObjectiveError(f"weights of {spec!r} must add up to more than 0")
            return cls(tuple(terms), tuple(weights), WEIGHTED)
        return cls((_term(spec),), (1.0,), SINGLE)

    @property
    def label(self) -> str:
        if self.mode == LEXICOGRAPHIC:
            return " > ".join(t.label for t in self.terms)
        if self.mode == WEIGHTED:
            return " + ".join(f"{w:g}*{t.label}" for t, w in zip(self.terms, self.weights))
        return self.terms[0].label

    @property
    def metrics(self) -> tuple[str, ...]:
        return tuple(t.metric for t in self.terms)

    def compare(self, inc: Measurement, cand: Measurement) -> Optional[Ratio]:
        """The candidate's ratio to the incumbent on this objective (> 1: better), with its 95% interval."""
        rs = [metric_ratio(inc, cand, t.metric, t.higher_is_better) for t in self.terms]
        if any(r is None for r in rs):
            return None
        if self.mode == LEXICOGRAPHIC:
            return next((r for r in rs if r.verdict != WITHIN_NOISE), rs[0])
        if self.mode == SINGLE:
            return rs[0]
        # weighted geometric mean: ln r = sum w ln r_i / W. Its terms come from the same runs, so their errors
        # are not independent: with rounds, the terms are combined round by round and the interval is that of
        # the combined ratios; without, the log half-widths add linearly (the worst case of a correlation)
        if self.round_logs([(inc, cand)]) is not None:
            return self.sequential([(inc, cand)], 0.025)
        total = sum(self.weights)
        ln_r = sum(w * math.log(r.value) for w, r in zip(self.weights, rs)) / total
        half = sum(w / total * (math.log(r.hi) - math.log(r.lo)) / 2 for w, r in zip(self.weights, rs))
        lo, hi = math.exp(ln_r - half), math.exp(ln_r + half)
        return Ratio(math.exp(ln_r), lo, hi, FASTER if lo > 1 else (SLOWER if hi < 1 else WITHIN_NOISE))

    # --- the sequential decision's reading ---------------------------------------------------------------
    def attempt_logs(self, pairs: Sequence[tuple[Measurement, Measurement]]) -> Optional[list[list[list[float]]]]:
        """Per term, per (incumbent, candidate) pair in order, the log ratios (> 0: the candidate better) of its
        rounds; a term logged without rounds (peak memory) contributes its exact ratio to each round. None where
        a term is missing, or no term has rounds (then `compare` is exact)."""
        out: list[list[list[float]]] = [[] for _ in self.terms]
        any_rounds = False
        for inc, cand in pairs:
            per_term: list[Optional[list[float]]] = []
            for t in self.terms:
                a, b = inc.rounds.get(t.metric), cand.rounds.get(t.metric)
                if a and b and len(a) == len(b) and all(x > 0 and math.isfinite(x) for x in (*a, *b)):
                    per_term.append([math.log(y / x) if t.higher_is_better else math.log(x / y) for x, y in zip(a, b)])
                    any_rounds = True
                else:
                    per_term.append(None)
            n = max((len(x) for x in per_term if x is not None), default=0)
            for i, (t, logs) in enumerate(zip(self.terms, per_term)):
                if logs is None:
                    r = metric_ratio(inc, cand, t.metric, t.higher_is_better)
                    if r is None or r.value <= 0:
                        return None
                    logs = [math.log(r.value)] * max(n, 1)
                if n and len(logs) != n:
                    return None
                out[i].append(logs)
        return out if any_rounds else None

    def round_logs(self, pairs: Sequence[tuple[Measurement, Measurement]]) -> Optional[list[list[float]]]:
        """Per term, the log ratios of every round of every pair, pooled in order (attempt_logs, concatenated)."""
        logs = self.attempt_logs(pairs)
        return None if logs is None else [[x for attempt in term for x in attempt] for term in logs]

    def sequential(self, pairs: Sequence[tuple[Measurement, Measurement]], alpha: float) -> Optional[Ratio]:
        """The candidate's ratio over the pooled rounds of `pairs`, with one-sided bounds at `alpha` each."""
        r = self.reading(pairs, alpha)
        return r.ratio if r is not None else None

    def reading(self, pairs: Sequence[tuple[Measurement, Measurement]], alpha: float) -> Optional["Reading"]:
        """`sequential`'s ratio with how the rounds' serial correlation widened it (Reading.serial: None where
        no term has rounds and the metrics' exact ratios are all there is)."""
        if not pairs:
            return None
        logs = self.attempt_logs(pairs)
        if logs is None:
            r = self.compare(*pairs[-1])
            return Reading(r) if r is not None else None

        def of(attempts: list[list[float]]) -> Reading:
            c, lo, hi, dep = pooled_bounds(attempts, alpha)
            c, lo, hi = float(c[0]), float(lo[0]), float(hi[0])
            lo_r = math.exp(lo) if math.isfinite(lo) else 0.0
            hi_r = math.exp(hi) if math.isfinite(hi) else math.inf
            return Reading(Ratio(math.exp(c), lo_r, hi_r, FASTER if lo_r > 1 else (SLOWER if hi_r < 1 else WITHIN_NOISE)), dep)

        if self.mode == WEIGHTED:
            total = sum(self.weights)
            return of([[sum(w * x[a][i] for w, x in zip(self.weights, logs)) / total for i in range(len(logs[0][a]))]
                       for a in range(len(logs[0]))])
        rs = [of(x) for x in logs]
        if self.mode == LEXICOGRAPHIC:
            return next((r for r in rs if r.ratio.verdict != WITHIN_NOISE), rs[0])
        return rs[0]


@dataclass(frozen=True)
class Reading:
    """A sequential reading: the ratio, and how the rounds' dependence widened its bounds."""
    ratio: Ratio
    serial: Optional[Serial] = None

    @property
    def note(self) -> str:
        return self.serial.note() if self.serial is not None else ""
