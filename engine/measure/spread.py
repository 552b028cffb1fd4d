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

import functools
import math
import random
import statistics
from dataclasses import dataclass
from typing import Any, Optional, Sequence

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
    mean = statistics.fmean(xs)
    cv = statistics.stdev(xs) / abs(mean) if len(xs) > 1 and mean else 0.0
    return Spread(*_median_interval(xs, confidence, resamples, seed), cv, len(xs))


def _median_interval(xs: list[float], confidence: float, resamples: int, seed: int) -> tuple[float, float, float]:
    """(median, lower, upper) of `spread`'s percentile-bootstrap interval (a single sample: its value thrice)."""
    med = statistics.median(xs)
    if len(xs) == 1:
        return med, med, med
    meds = _bootstrap_medians(xs, resamples, seed)
    alpha = (1 - confidence) / 2
    return med, meds[int(alpha * (resamples - 1))], meds[int(round((1 - alpha) * (resamples - 1)))]


@functools.lru_cache(maxsize=64)
def _resample_indices(n: int, resamples: int, seed: int):
    """The indices `random.Random(seed).choices(range(n), k=n)` draws, `resamples` times in a row, as a
    (resamples, n) array: the same Mersenne Twister stream (its state copied into numpy's MT19937) turned into
    floats as CPython's random() does, (a * 2**26 + b) / 2**53 of two 32-bit words shifted by 5 and 6, and into
    an index as choices() does, floor(random() * n). Bit for bit the draws of the loop it replaces
    (tests/test_spread.py), at a hundredth of its time: the optimize calibration runs the engine's rule
    thousands of times."""
    import numpy as np

    state = random.Random(seed).getstate()[1]
    bits = np.random.MT19937()
    bits.state = {"bit_generator": "MT19937", "state": {"key": np.array(state[:624], dtype=np.uint32), "pos": state[624]}}
    raw = bits.random_raw(2 * n * resamples).reshape(-1, 2)
    u = ((raw[:, 0] >> 5).astype(np.float64) * 67108864.0 + (raw[:, 1] >> 6).astype(np.float64)) * (1.0 / 9007199254740992.0)
    idx = np.floor(u * float(n)).astype(np.int32 if n < 2 ** 31 else np.int64).reshape(resamples, n)
    idx.flags.writeable = False
    return idx


def _bootstrap_medians(xs: list[float], resamples: int, seed: int) -> list[float]:
    """The sorted medians of `resamples` seeded resamples of `xs` (with replacement): a resample's median is an
    order statistic of the resampled ranks, so one sort of `xs` serves every resample."""
    import numpy as np

    n = len(xs)
    if n * resamples > 4_000_000:  # (no timing has this many samples) the index table would not be worth its memory
        rng = random.Random(seed)
        return sorted(statistics.median(rng.choices(xs, k=n)) for _ in range(resamples))
    idx = _resample_indices(n, resamples, seed)
    a = np.asarray(xs, dtype=float)
    order = np.argsort(a, kind="stable")
    srt = a[order]
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    r = np.sort(rank[idx], axis=1)
    meds = srt[r[:, n // 2]] if n % 2 else (srt[r[:, n // 2 - 1]] + srt[r[:, n // 2]]) / 2
    return np.sort(meds).tolist()


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
    s = Spread(*_median_interval(rs, CONFIDENCE, resamples, seed), 0.0, len(rs))  # (its cv is not read)
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


# --- rounds that may not be independent ----------------------------------------------------------------------
# The bound above is exact when a pair's rounds are exchangeable. A shared machine's slow load is not: it can
# favour one variant for several rounds in a row (serially correlated ratios, an AR(1) pattern), and then n
# rounds carry less than n rounds' information -- the variance of their centre is (1 + rho) / (1 - rho) times
# what the ranks assume (x3 at rho = 0.5), and simulated, the exact bound at 0.2% erred in 1.8-2.7% of looks.
# Nine to thirty rounds cannot tell rho = 0.5 from 0 reliably (the lag-1 estimate's sd is 1/sqrt(n): 0.33 at
# nine), so the bounds are widened for the correlation the rounds cannot rule out -- the bias-corrected lag-1
# estimate plus SERIAL_MARGIN of its standard errors -- which lets that margin shrink as rounds accumulate.
# Per-measurement offsets (a process that happens to favour one variant throughout) are not estimated apart:
# two to four measurements give a between-measurement variance 1-3 degrees of freedom, which simulated
# changed little at a large cost in power (experiments/optimize/calibration.py, docs/optimize.md).
SERIAL_MARGIN = 1.0  # standard errors of the lag-1 estimate above it that the widening allows for
SERIAL_CAP = 0.9  # the most correlation allowed for (a variance factor of 19)
SERIAL_Z = 2.326  # a one-sided 1% test: past it, the rounds are called "not independent" in words


@dataclass(frozen=True)
class Serial:
    """How the rounds of one or more measurements depend on each other, as the bounds used it (arrays, a row
    per simulated pair, or floats for one pair)."""

    lag1: Any  # bias-corrected lag-1 rank autocorrelation of the rounds within each measurement, pooled
    z: Any  # lag1's z under independence (> SERIAL_Z: the rounds are not independent)
    rho: Any  # the correlation the widening allowed for: lag1 + SERIAL_MARGIN standard errors, within [0, CAP]
    widened: Any  # the factor the bounds' distances from the centre were multiplied by: sqrt((1+rho)/(1-rho))
    rounds: int
    measurements: int

    def note(self) -> str:
        """The widening in words, for a verdict ('' where it did not widen)."""
        if float(self.widened) <= 1.0:
            return ""
        if float(self.z) > SERIAL_Z:
            return (f"noise not independent (lag-1 r={float(self.lag1):.2f}, z={float(self.z):.1f}): interval "
                    f"widened x{float(self.widened):.2f}")
        return (f"interval widened x{float(self.widened):.2f} for serial correlation up to {float(self.rho):.2f} "
                f"(lag-1 r={float(self.lag1):+.2f})")


def _ranks(a):
    """Average ranks (1..n) of each row of `a`: ties share theirs, so a constant row has none to order."""
    import numpy as np

    less = (a[:, None, :] < a[:, :, None]).sum(axis=2)
    same = (a[:, None, :] == a[:, :, None]).sum(axis=2)
    return less + (same + 1) / 2


def serial(measurements, margin: float = SERIAL_MARGIN) -> Serial:
    """The serial correlation of the rounds of each measurement (arrays of shape (sims, n_j) or (n_j,)): the
    lag-1 autocorrelation of each measurement's ranks (robust to a round that met a stall; 0 for a constant
    one), pooled weighted by rounds. Under independence its mean is exactly -J/N (J measurements, N rounds)
    and its sd about 1/sqrt(N); with correlation rho it is about rho - (1 + 3 rho) J/N (the bias of a
    short series about its own centre), which the estimate corrects for. Measurements of fewer than three
    rounds carry no lag-1 information and are left out."""
    import numpy as np

    rows = [np.atleast_2d(np.asarray(m, dtype=float)) for m in measurements]
    rows = [m for m in rows if m.shape[1] >= 3]
    if not rows:
        return Serial(0.0, 0.0, 0.0, 1.0, 0, 0)
    total = n = j = 0.0  # per row: sum of n_j r_j, rounds and measurements that have an order (not constant)
    for m in rows:
        d = _ranks(m) - (m.shape[1] + 1) / 2
        den = (d * d).sum(axis=1)
        ordered = den > 0
        r = np.where(ordered, (d[:, 1:] * d[:, :-1]).sum(axis=1) / np.where(ordered, den, 1.0), 0.0)
        total, n, j = total + m.shape[1] * r, n + m.shape[1] * ordered, j + ordered
    some = n > 0
    n_ = np.where(some, n, 1.0)
    bias = j / n_
    z = np.where(some, (total / n_ + bias) * np.sqrt(n_), 0.0)
    lag1 = np.where(some, (total / n_ + bias) / np.maximum(1 - 3 * bias, 0.25), 0.0)
    rho = np.where(some, np.clip(lag1 + margin / np.sqrt(n_), 0.0, SERIAL_CAP), 0.0)
    widened = np.sqrt((1 + rho) / (1 - rho))
    if len(lag1) == 1:
        lag1, z, rho, widened = (float(v[0]) for v in (lag1, z, rho, widened))
    return Serial(lag1, z, rho, widened, int(np.max(n)), int(np.max(j)))


def pooled_bounds(measurements, alpha: float, guard: bool = True):
    """The sequential decision's reading of a pair measured one or more times: the Hodges-Lehmann centre of
    every measurement's per-round log ratios pooled, with the exact one-sided signed-rank bounds at `alpha`
    (signed_rank_bounds), each moved away from the centre by `serial(...).widened` (guard: for the serial
    correlation the rounds cannot rule out). Vectorized like signed_rank_bounds: each measurement (sims, n_j).
    Returns (centre, lower, upper, Serial)."""
    import numpy as np

    rows = [np.atleast_2d(np.asarray(m, dtype=float)) for m in measurements]
    c, lo, hi = signed_rank_bounds(np.concatenate(rows, axis=1), alpha)
    dep = serial(rows) if guard else Serial(0.0, 0.0, 0.0, 1.0, sum(m.shape[1] for m in rows), len(rows))
    f = np.asarray(dep.widened, dtype=float)
    with np.errstate(invalid="ignore"):  # an infinite bound stays infinite
        lo, hi = np.where(np.isfinite(lo), c - f * (c - lo), lo), np.where(np.isfinite(hi), c + f * (hi - c), hi)
    return c, lo, hi, dep


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
