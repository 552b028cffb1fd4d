"""Task accuracy of a candidate against the incumbent on the same items, paired.

Two configurations answer the same `eval.limit` items; only the items where they disagree (discordant pairs)
carry information about a difference: b = the incumbent right and the candidate wrong, c = the reverse.
McNemar's test asks whether b and c differ more than a fair coin would make them (exact binomial, or its
mid-p version, which is less conservative at small counts); a paired bootstrap over the items gives the
interval of the accuracy difference. Unpaired, at n=50 a task's interval is about +-11%; paired, identical
answers give an interval of [0, 0].

A verdict: `worse` (the test finds a drop), `holds` (the interval excludes a drop larger than `max_drop`), or
`undecided` (neither: more items may decide). `detectable` is the smallest drop this many items could show:
the test needs at least `k_min` discordant items all one way (6 for the exact test at alpha 0.05), and with m
discordant items a shift of about z*sqrt(m).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Sequence

HOLDS, WORSE, UNDECIDED = "holds", "worse", "undecided"
EXACT, MID_P, BOOTSTRAP = "mcnemar", "mcnemar-midp", "bootstrap"
TESTS = (EXACT, MID_P, BOOTSTRAP)
_Z95 = 1.959963984540054


def _binom_half_cdf(k: int, n: int) -> tuple[float, float]:
    """(P(X <= k), P(X = k)) for X ~ Binomial(n, 1/2)."""
    pmf = [math.comb(n, i) / 2 ** n for i in range(k + 1)]
    return sum(pmf), pmf[k]


def mcnemar_p(b: int, c: int, mid_p: bool = False) -> float:
    """Two-sided p-value of McNemar's exact test on b and c discordant pairs (mid-p: the observed count's own
    probability counted half)."""
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    cdf, pk = _binom_half_cdf(k, n)
    p = 2 * (cdf - pk / 2) if mid_p else 2 * cdf
    return min(1.0, p)


def min_discordant(alpha: float = 0.05, mid_p: bool = False) -> int:
    """The fewest discordant items, all in one direction, that the test calls significant at `alpha`."""
    k = 1
    while mcnemar_p(k, 0, mid_p) >= alpha:
        k += 1
    return k


def paired_bootstrap(inc: Sequence[float], cand: Sequence[float], resamples: int = 2000, seed: int = 0,
                     confidence: float = 0.95) -> tuple[float, float]:
    """Percentile interval of mean(cand) - mean(inc) resampling items (pairs kept together); seeded."""
    d = [y - x for x, y in zip(inc, cand)]
    n = len(d)
    if n == 0 or not any(d):
        return 0.0, 0.0
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(d, k=n)) / n for _ in range(resamples))
    a = (1 - confidence) / 2
    return means[int(a * (resamples - 1))], means[int(round((1 - a) * (resamples - 1)))]


@dataclass(frozen=True)
class PairedAccuracy:
    task: str
    n: int
    b: int  # incumbent right, candidate wrong
    c: int  # candidate right, incumbent wrong
    delta: float  # candidate accuracy - incumbent accuracy (share of items)
    lo: float
    hi: float
    p: float
    detectable: float  # smallest drop (share of items) this comparison could detect
    verdict: str

    def cell(self) -> str:
        """'emoji_movie -6.4% [-9.5, -3.3]'"""
        return f"{self.task.removeprefix('bigbench_')} {100 * self.delta:+.1f}% [{100 * self.lo:+.1f}, {100 * self.hi:+.1f}]"


def paired_accuracy(task: str, inc: Sequence[float], cand: Sequence[float], max_drop: float = 0.03,
                    alpha: float = 0.05, test: str = MID_P) -> PairedAccuracy:
    """Judge `cand`'s per-item correctness against `inc`'s on the same items (the first min(len) of each)."""
    n = min(len(inc), len(cand))
    inc, cand = [float(x) for x in inc[:n]], [float(x) for x in cand[:n]]
    b = sum(1 for x, y in zip(inc, cand) if x > y)
    c = sum(1 for x, y in zip(inc, cand) if y > x)
    delta = (c - b) / n if n else 0.0
    lo, hi = paired_bootstrap(inc, cand)
    if test == BOOTSTRAP:
        worse = hi < 0
        p = float("nan")
        k_min = min_discordant(alpha, mid_p=True)
    else:
        p = mcnemar_p(b, c, mid_p=test == MID_P)
        worse = p < alpha and c < b
        k_min = min_discordant(alpha, mid_p=test == MID_P)
    detectable = max(k_min, math.ceil(_Z95 * math.sqrt(b + c))) / n if n else 1.0
    verdict = WORSE if worse else (HOLDS if lo >= -max_drop else UNDECIDED)
    return PairedAccuracy(task, n, b, c, delta, lo, hi, p, detectable, verdict)
