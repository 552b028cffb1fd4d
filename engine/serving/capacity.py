"""Capacity search: the highest request rate a configuration serves within its SLO.

The question a serving engineer asks is "how much traffic does this configuration carry while p99 TTFT <=
X and p99 TPOT <= Y" (vLLM's `bench sweep serve_sla`, GuideLLM's `sweep`, MLPerf's Server scenario). The
search runs the same requests several times at different arrival rates ("probes") and reports the highest
rate whose probe met the SLO. Pure Python over a `probe` callable, so it is tested on a synthetic latency
model with a known answer (tests/test_capacity.py) and runs on every engine that serves.

The protocol (a bracket, then bisection):
  1. a *synchronous* probe: one request at a time (no queueing, no batching): the best latency this
     configuration can give. If even that misses the SLO, no rate meets it: the search stops there.
  2. a *saturating* probe: every request at once: the most requests/s the configuration completes
     (`request_s`, the top of the bracket; a Poisson rate above it cannot be sustained). If every
     request meets the SLO even then, the capacity is that throughput.
  3. a Poisson probe at the saturating throughput; if it meets the SLO that is the capacity.
     Otherwise bisect between the highest passing rate (0 at first: the synchronous probe stands for the
     zero-load limit) and the lowest failing one, until the bracket is within `tolerance` of its top, or
     `max_probes` probes or `max_s` seconds are spent.
The found rate is the highest *measured* passing rate (`lo`), never an interpolation; `hi` is the lowest
measured failing one, so the true knee lies in [lo, hi) when latency grows with rate.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

# probe kinds
SYNC, SATURATE, RATE = "synchronous", "saturating", "poisson"


@dataclass(frozen=True)
class ProbeStats:
    """What one probe observed (request-level percentiles in ms, throughputs per second)."""

    ttft_ms: float  # TTFT at the SLO's percentile
    tpot_ms: float  # TPOT at the SLO's percentile
    request_s: float  # completed requests / s over the probe
    metrics: dict[str, float] = field(default_factory=dict)  # everything else measured (for the curve)


@dataclass(frozen=True)
class Probe:
    kind: str  # SYNC | SATURATE | RATE
    rate: float  # offered Poisson rate (RATE); for SYNC / SATURATE the achieved request_s
    stats: ProbeStats
    passed: bool
    elapsed_s: float


@dataclass
class SearchResult:
    max_rate: float  # highest measured passing Poisson rate (req/s); 0.0 when none passed
    lo: float  # = max_rate
    hi: Optional[float]  # lowest measured failing rate; None when nothing above max_rate failed
    probes: list[Probe]
    best: Optional[Probe]  # the probe at max_rate (a Poisson probe, or the synchronous one when max_rate = 0)
    verdict: str  # one line for humans: why the search stopped

    @property
    def meets_slo(self) -> bool:
        """Whether any load meets the SLO (the synchronous probe passed)."""
        return bool(self.probes) and self.probes[0].passed


@dataclass(frozen=True)
class SearchBudget:
    max_probes: int = 8  # all probes, the synchronous and saturating ones included
    tolerance: float = 0.1  # stop when (hi - lo) <= tolerance * hi
    max_s: float = 1800.0  # stop starting probes once this many seconds have passed


def meets(stats: ProbeStats, ttft_ms: float, tpot_ms: float) -> bool:
    return stats.ttft_ms <= ttft_ms and stats.tpot_ms <= tpot_ms


def search_capacity(probe: Callable[[str, float], ProbeStats], ok: Callable[[ProbeStats], bool],
                    budget: SearchBudget, clock: Callable[[], float] = time.monotonic,
                    say: Callable[[str], None] = lambda _msg: None) -> SearchResult:
    """Find the highest Poisson rate whose probe is `ok`. `probe(kind, rate)` runs one probe (`rate` is
    the offered rate for kind RATE, ignored otherwise)."""
    if budget.max_probes < 3:
        raise ValueError("a capacity search needs at least 3 probes (synchronous, saturating, one rate)")
    t0 = clock()
    probes: list[Probe] = []

    def run(kind: str, rate: float) -> Probe:
        s = clock()
        stats = probe(kind, rate)
        p = Probe(kind, rate if kind == RATE else stats.request_s, stats, ok(stats), clock() - s)
        probes.append(p)
        say(f"probe {len(probes)} ({kind}{f' {rate:.3g} req/s' if kind == RATE else ''}): "
            f"TTFT {stats.ttft_ms:.0f} ms, TPOT {stats.tpot_ms:.0f} ms, {stats.request_s:.3g} req/s done -> "
            f"{'meets' if p.passed else 'misses'} the SLO")
        return p

    sync = run(SYNC, 0.0)
    if not sync.passed:
        return SearchResult(0.0, 0.0, 0.0, probes, sync, "no rate meets the SLO: even one request at a time misses it")
    sat = run(SATURATE, 0.0)
    top = sat.stats.request_s
    if sat.passed:
        return SearchResult(top, top, None, probes, sat,
                            "every request met the SLO even all at once: capacity = the saturating throughput")
    lo, hi, best = 0.0, None, sync
    rate = top
    while True:
        p = run(RATE, rate)
        if p.passed:
            lo, best = rate, p
        else:
            hi = rate
        if hi is None:
            verdict = "the Poisson probe at the saturating throughput met the SLO: capacity = that throughput"
            break
        if hi - lo <= budget.tolerance * hi:
            verdict = f"bracket [{lo:.3g}, {hi:.3g}) req/s within {budget.tolerance:.0%}"
            break
        if len(probes) >= budget.max_probes:
            verdict = f"probe budget ({budget.max_probes}) spent: bracket [{lo:.3g}, {hi:.3g}) req/s"
            break
        if clock() - t0 >= budget.max_s:
            verdict = f"time budget ({budget.max_s:.0f} s) spent: bracket [{lo:.3g}, {hi:.3g}) req/s"
            break
        rate = (lo + hi) / 2
    return SearchResult(lo, lo, hi, probes, best, verdict)
