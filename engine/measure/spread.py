"""The spread of a timing: median, 95% confidence interval of the median, coefficient of variation.

Why a bootstrap of the median and not a t-interval of the mean: timings on a shared machine are skewed
(a repeat that meets a 100-250 ms stall of another process lands far above the rest), so the mean and a
normal-theory interval describe the stalls more than the typical run. The percentile bootstrap of the
median assumes no distribution. It is seeded, so the same samples always give the same interval. With
very few samples (2-3 repeats) its interval is close to the samples' range: honest about how little is known.

Metric names: a timing `NAME` logged as its median keeps its name; its spread is `NAME_ci_lo`, `NAME_ci_hi`
(bounds of the 95% interval), `NAME_cv` (stdev / mean of the samples) and `NAME_n` (how many samples).
"""
from __future__ import annotations

import random
import statistics
from dataclasses import dataclass
from typing import Sequence

CONFIDENCE = 0.95
RESAMPLES = 2000
SUFFIXES = ("_ci_lo", "_ci_hi", "_cv", "_n")


@dataclass(frozen=True)
class Spread:
    median: float
    ci_lo: float
    ci_hi: float
    cv: float  # stdev / mean; 0 for a single sample
    n: int

    @property
    def half_width(self) -> float:
        """Half the interval's width relative to the median (0.05 = +-5%)."""
        return (self.ci_hi - self.ci_lo) / 2 / abs(self.median) if self.median else 0.0


def spread(samples: Sequence[float], confidence: float = CONFIDENCE, resamples: int = RESAMPLES,
           seed: int = 0) -> Spread:
    """Median of `samples` with the percentile-bootstrap interval of the median at `confidence`."""
    xs = [float(x) for x in samples]
    if not xs:
        raise ValueError("spread of no samples")
    med = statistics.median(xs)
    mean = statistics.fmean(xs)
    cv = statistics.stdev(xs) / abs(mean) if len(xs) > 1 and mean else 0.0
    if len(xs) == 1:
        return Spread(med, med, med, 0.0, 1)
    rng = random.Random(seed)
    n = len(xs)
    meds = sorted(statistics.median(rng.choices(xs, k=n)) for _ in range(resamples))
    alpha = (1 - confidence) / 2
    lo = meds[int(alpha * (resamples - 1))]
    hi = meds[int(round((1 - alpha) * (resamples - 1)))]
    return Spread(med, lo, hi, cv, n)


def spread_metrics(name: str, samples: Sequence[float]) -> dict[str, float]:
    """{NAME_ci_lo, NAME_ci_hi, NAME_cv, NAME_n} of `samples` (the median itself is logged as NAME)."""
    s = spread(samples)
    return {f"{name}_ci_lo": s.ci_lo, f"{name}_ci_hi": s.ci_hi, f"{name}_cv": s.cv, f"{name}_n": float(s.n)}
