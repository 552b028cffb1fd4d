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

import math
import random
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

CONFIDENCE = 0.95
RESAMPLES = 2000
SUFFIXES = ("_ci_lo", "_ci_hi", "_cv", "_n")
LOWER_IS_BETTER = ("ttft_ms_p50", "tpot_ms_p50", "itl_ms_p50", "e2e_s_p50")  # times; the other timings are rates


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


# --- comparisons: the ratio of two medians with its interval --------------------------------------------
FASTER, SLOWER, WITHIN_NOISE = "faster", "slower", "within noise"
# The smallest effect the report's verdicts judge: the seed claims' "partly" starts at x1.1, and a ratio
# closer to x1 than 10% is nothing a configuration is chosen for. A trial whose median is uncertain by more
# than this (interval half-width) cannot resolve it: engine.measure.metrics.instability flags it `spread`.
MIN_EFFECT = 0.10
_Z95 = 1.959963984540054


@dataclass(frozen=True)
class Ratio:
    """`value` = new / base of two medians, with a 95% interval [lo, hi] and the verdict it supports."""

    value: float
    lo: float
    hi: float
    verdict: str  # FASTER / SLOWER / WITHIN_NOISE, in the direction where > 1 is better

    def cell(self, fmt: str = "{:.2f}") -> str:
        """'x1.23 [1.10-1.35]' (+ ' ~' when the interval contains 1: within noise)."""
        mark = " ~" if self.verdict == WITHIN_NOISE else ""
        return f"x{fmt.format(self.value)} [{fmt.format(self.lo)}-{fmt.format(self.hi)}]{mark}"


def t95(df: int) -> float:
    """Two-sided 95% quantile of Student's t with `df` degrees of freedom (Cornish-Fisher expansion around
    the normal quantile: within 0.3% of the exact value from df = 3 up; exact enough to size an interval)."""
    if df <= 0:
        return float("inf")
    z = _Z95
    return (z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3))


def _log_se(s: Spread) -> Optional[float]:
    """Standard error of ln(median) read off a 95% interval (None: no interval, or not positive)."""
    if s.n < 2 or s.median <= 0 or s.ci_lo <= 0 or s.ci_hi <= 0:
        return None
    return (math.log(s.ci_hi) - math.log(s.ci_lo)) / (2 * _Z95)


def ratio(base: Spread, new: Spread, higher_is_better: bool = True) -> Optional[Ratio]:
    """How many times better `new` is than `base` (new/base for a rate, base/new for a time), with a 95%
    interval, from each trial's own interval of its median.

    Why on the log scale: a ratio's error is symmetric in ln(ratio), and ln(a/b) = ln a - ln b has the
    variance of the two logs added (the trials are independent runs). Each trial's 95% bootstrap interval
    gives its log-scale standard error (width / 2z), so only the logged metrics are needed: a report reads
    a ratio's interval from MLflow without the raw samples. The combined error is scaled by Student's t at
    n_base + n_new - 2 degrees of freedom instead of z: with the usual 3 repeats a bootstrap interval of the
    median is about the samples' range and covers too rarely (~80% for 95% nominal in simulation), the t
    factor brings that back to ~90%, and from 5 repeats on it is at or above nominal (tests/test_spread.py).
    None when either trial has no interval (one sample, or a run recorded before intervals were logged)."""
    se_b, se_n = _log_se(base), _log_se(new)
    if se_b is None or se_n is None or base.median <= 0 or new.median <= 0:
        return None
    r = new.median / base.median if higher_is_better else base.median / new.median
    half = t95(base.n + new.n - 2) * math.sqrt(se_b ** 2 + se_n ** 2)
    lo, hi = r * math.exp(-half), r * math.exp(half)
    verdict = FASTER if lo > 1 else (SLOWER if hi < 1 else WITHIN_NOISE)
    return Ratio(r, lo, hi, verdict)


def paired_ratio(base: Sequence[float], new: Sequence[float], higher_is_better: bool = True,
                 resamples: int = RESAMPLES, seed: int = 0) -> Optional[Ratio]:
    """The ratio of two variants measured round-robin (`engine.pipeline.run_interleaved`): sample i of each
    ran in the same round, so the per-round ratios new_i / base_i share that round's drift and the median of
    them, with its percentile-bootstrap interval, is free of it. None with fewer than two rounds, or where a
    sample is not a positive number (a TPOT of 0 when a run decoded no token after the first: no ratio exists)."""
    if len(base) != len(new):
        raise ValueError(f"paired samples need equal counts, got {len(base)} and {len(new)}")
    if len(base) < 2 or not all(v > 0 and math.isfinite(v) for v in (*base, *new)):
        return None
    rs = [(n / b if higher_is_better else b / n) for b, n in zip(base, new)]
    s = spread(rs, resamples=resamples, seed=seed)
    # With few rounds the percentile bootstrap of the median covers too rarely (simulated, 10% noise: 75%
    # at 3 rounds, 87% at 4, 92% at 5, for 95% nominal), so a chance 20% "gain" could pass for a real one.
    # Student's t interval of the log ratios beside it brings that to 93-96%; the wider of the two is kept.
    # Its scale is the stdev up to 4 rounds and the MAD (x1.4826) from 5 on: a round that met a stall is
    # one outlier ratio, which would inflate a stdev (x1.4 the width with 15% stalled rounds) but not a MAD.
    lo, hi = s.ci_lo, s.ci_hi
    logs = [math.log(x) for x in rs if x > 0]
    if len(logs) == len(rs) and s.median > 0:
        mid = statistics.median(logs)
        scale = (statistics.stdev(logs) if len(logs) <= 4
                 else 1.4826 * statistics.median([abs(x - mid) for x in logs]))
        half = t95(len(logs) - 1) * scale / math.sqrt(len(logs))
        lo, hi = min(lo, s.median * math.exp(-half)), max(hi, s.median * math.exp(half))
    verdict = FASTER if lo > 1 else (SLOWER if hi < 1 else WITHIN_NOISE)
    return Ratio(s.median, lo, hi, verdict)


def spread_of(metrics: dict[str, float], name: str) -> Optional[Spread]:
    """The logged spread of timing `name` (its median and NAME_ci_lo/_ci_hi/_cv/_n), or None."""
    keys = [name] + [name + s for s in SUFFIXES]
    if any(metrics.get(k) is None for k in keys):
        return None
    return Spread(*(float(metrics[k]) for k in keys[:4]), int(metrics[name + "_n"]))


# --- sequential decisions: exact one-sided bounds that stay valid over several looks -----------------------
# `paired_ratio` above describes one comparison at 95%. A decision taken at several looks (rounds added while a
# pair is undecided, a pair measured again) needs each look's bound at a stricter level, so that the whole
# procedure keeps its error (Bonferroni over the looks: P(any look errs) <= sum of the looks' levels). The
# bound below is the Wilcoxon signed-rank bound (Hodges-Lehmann) on the per-round log ratios: exact for any
# continuous noise symmetric about the true ratio (two variants of one interleaved round are exchangeable
# under "no difference"), robust to a round that met a stall (it counts by rank, not by size), vectorized so
# a simulation over thousands of seeds runs the same code as one decision.
_SIGNED_RANK_CDF: dict[int, list[float]] = {}


def signed_rank_cdf(n: int) -> list[float]:
    """P(W+ <= w) for w = 0..n(n+1)/2 under the null (the signed-rank statistic of n untied values)."""
    if n not in _SIGNED_RANK_CDF:
        counts = [1]  # subsets of {1..k} by their sum
        for k in range(1, n + 1):
            nxt = counts + [0] * k
            for s, c in enumerate(counts):
                nxt[s + k] += c
            counts = nxt
        total, acc, cdf = 2 ** n, 0, []
        for c in counts:
            acc += c
            cdf.append(acc / total)
        _SIGNED_RANK_CDF[n] = cdf
    return _SIGNED_RANK_CDF[n]


def signed_rank_k(n: int, alpha: float) -> int:
    """How many of the n(n+1)/2 Walsh averages lie below the one-sided lower bound at level `alpha` (the
    bound is the k-th smallest): the largest k with P(W+ <= k-1) <= alpha. 0: no bound exists at this n
    (P(W+ = 0) = 2^-n is already above alpha: 5 rounds cannot give a bound at 1%)."""
    if n > 60:  # normal approximation of W+ (mean n(n+1)/4, variance n(n+1)(2n+1)/24), accurate at this size
        from statistics import NormalDist

        mu, sd = n * (n + 1) / 4, math.sqrt(n * (n + 1) * (2 * n + 1) / 24)
        return max(0, int(math.floor(mu + NormalDist().inv_cdf(alpha) * sd + 0.5)))
    cdf = signed_rank_cdf(n)
    k = 0
    while k < len(cdf) and cdf[k] <= alpha:
        k += 1
    return k


def signed_rank_bounds(x, alpha: float):
    """Hodges-Lehmann centre and exact one-sided bounds (each at level `alpha`) of the centre of symmetry of
    each row of `x` (shape (sims, n), or (n,)): (centre, lower, upper) as numpy arrays; -inf / +inf where n
    rounds cannot give a bound at `alpha`. Rows with a NaN (a missing round) are dropped from nothing: give
    equal-length rows."""
    import numpy as np

    a = np.atleast_2d(np.asarray(x, dtype=float))
    sims, n = a.shape
    if n == 0:
        nan = np.full(sims, np.nan)
        return nan, np.full(sims, -np.inf), np.full(sims, np.inf)
    i, j = np.triu_indices(n)
    walsh = np.sort((a[:, i] + a[:, j]) / 2, axis=1)  # n(n+1)/2 Walsh averages per row
    m = walsh.shape[1]
    centre = np.median(walsh, axis=1)
    k = signed_rank_k(n, alpha)
    if k <= 0:
        return centre, np.full(sims, -np.inf), np.full(sims, np.inf)
    return centre, walsh[:, k - 1], walsh[:, m - k]


def sequential_ratio(base: Sequence[float], new: Sequence[float], alpha: float,
                     higher_is_better: bool = True) -> Optional[Ratio]:
    """The ratio of two variants measured round-robin, as the Hodges-Lehmann centre of the per-round log
    ratios with exact one-sided bounds at `alpha` each (a two-sided 1 - 2*alpha interval): the interval a
    sequential decision rests on. None with fewer than two rounds or a sample that is not a positive number."""
    if len(base) != len(new):
        raise ValueError(f"paired samples need equal counts, got {len(base)} and {len(new)}")
    if len(base) < 2 or not all(v > 0 and math.isfinite(v) for v in (*base, *new)):
        return None
    logs = [math.log(n / b) if higher_is_better else math.log(b / n) for b, n in zip(base, new)]
    c, lo, hi = (float(v[0]) for v in signed_rank_bounds(logs, alpha))
    lo_r, hi_r = math.exp(lo) if math.isfinite(lo) else 0.0, math.exp(hi) if math.isfinite(hi) else math.inf
    verdict = FASTER if lo_r > 1 else (SLOWER if hi_r < 1 else WITHIN_NOISE)
    return Ratio(math.exp(c), lo_r, hi_r, verdict)
