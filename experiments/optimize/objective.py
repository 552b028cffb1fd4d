"""What `optimize` improves: one named metric, or a weighted / lexicographic combination of them, and how two
measurements compare on it -- a ratio (> 1: the candidate is better) with its 95% interval.

`optimize.objective` spells it: `tpot` (default), `ttft`, `output_tok_s`, `max_rate` (capacity at the SLO),
`peak_memory`; `0.7*tpot+0.3*peak_memory` (weighted: the weighted geometric mean of the ratios);
`tpot>peak_memory` (lexicographic: the first term whose ratio is not within noise decides).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

from engine.measure.spread import FASTER, SLOWER, WITHIN_NOISE, Ratio, paired_ratio, ratio, spread_of

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
        # weighted geometric mean: ln r = sum w ln r_i / W; the log half-widths add in quadrature (weighted)
        total = sum(self.weights)
        ln_r = sum(w * math.log(r.value) for w, r in zip(self.weights, rs)) / total
        half = math.sqrt(sum((w / total * (math.log(r.hi) - math.log(r.lo)) / 2) ** 2 for w, r in zip(self.weights, rs)))
        lo, hi = math.exp(ln_r - half), math.exp(ln_r + half)
        return Ratio(math.exp(ln_r), lo, hi, FASTER if lo > 1 else (SLOWER if hi < 1 else WITHIN_NOISE))
