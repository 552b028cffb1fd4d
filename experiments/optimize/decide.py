"""One decision: is the candidate better than the incumbent, beyond noise, and within every limit?

Order of the checks (the first that fails decides, and names its reason): the candidate ran; both trials are
stable (else: re-measure the pair); the SLO and memory limits hold on the candidate; the objective improves
beyond noise -- its ratio's 95% interval excludes 1 and the gain clears `min_effect` (pyperf's --min-speed,
criterion's noise threshold); the accuracy gate holds on every task (paired, accuracy.py; undecided: more items).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from engine.measure.noise import LOAD, unstable_causes
from engine.measure.spread import SLOWER, WITHIN_NOISE, Ratio

from .accuracy import MID_P, UNDECIDED, WORSE, PairedAccuracy, paired_accuracy
from .measurement import Measurement
from .objective import Objective

ACCEPTED, REJECTED, UNDECIDED_ = "accepted", "rejected", "undecided"
FAILED, SKIPPED, BASELINE = "failed", "skipped", "baseline"
REMEASURE, MORE_ITEMS = "remeasure", "more_items"


@dataclass(frozen=True)
class Rules:
    min_effect: float = 0.03  # the smallest gain worth taking (0.03: 3%)
    alpha: float = 0.05  # the accuracy test's level
    max_drop: float = 0.03  # the accuracy drop (share of items) the gate tolerates
    test: str = MID_P  # accuracy test: mcnemar | mcnemar-midp | bootstrap
    gate: bool = True  # judge task accuracy (when the trials have per-item results)
    slo: dict[str, float] = field(default_factory=dict)  # metric -> upper limit (ttft_ms_p99: 500)
    max_memory_bytes: float = 0.0  # 0: no limit


@dataclass
class Verdict:
    decision: str
    reason: str
    ratio: Optional[Ratio] = None
    accuracy: list[PairedAccuracy] = field(default_factory=list)
    needs: str = ""  # REMEASURE / MORE_ITEMS: what could still decide it


def metric_label(metric: str) -> str:
    """`ttft_ms_p99` -> 'p99 TTFT', `peak_mem_bytes` -> 'peak memory'."""
    m = re.fullmatch(r"(ttft|tpot|itl|e2e)_(ms|s)_p(\d+)", metric)
    if m:
        return f"p{m.group(3)} {m.group(1).upper()}"
    return {"peak_mem_bytes": "peak memory"}.get(metric, metric)


def _value(metric: str, v: float) -> str:
    if metric.endswith("_bytes"):
        return f"{v / 1e9:.2f} GB"
    unit = " ms" if "_ms" in metric else (" s" if metric.endswith("_s") or "_s_" in metric else "")
    return f"{v:.0f}{unit}" if v >= 100 else f"{v:.3g}{unit}"


def limit_problems(m: Measurement, rules: Rules) -> list[str]:
    """The SLO / memory limits the measurement breaks ('SLO: p99 TTFT 910 ms > 500')."""
    out = []
    for metric, limit in rules.slo.items():
        v = m.metrics.get(metric)
        if v is None:
            out.append(f"SLO: {metric_label(metric)} not measured")
        elif v > limit:
            out.append(f"SLO: {metric_label(metric)} {_value(metric, v)} > {limit:g}")
    if rules.max_memory_bytes:
        v = m.metrics.get("peak_mem_bytes")
        if v is not None and v > rules.max_memory_bytes:
            out.append(f"memory: peak {v / 1e9:.2f} GB > {rules.max_memory_bytes / 1e9:.2f} GB")
    return out


def accuracy_of(inc: Measurement, cand: Measurement, rules: Rules) -> list[PairedAccuracy]:
    """The paired accuracy test of every task both trials answered."""
    tasks = [t for t in cand.correct if t in inc.correct]
    return [paired_accuracy(t, inc.correct[t], cand.correct[t], rules.max_drop, rules.alpha, rules.test) for t in tasks]


def judge(inc: Measurement, cand: Measurement, objective: Objective, rules: Rules) -> Verdict:
    if not cand.ok or not inc.ok:
        bad = cand if not cand.ok else inc
        return Verdict(FAILED, f"{bad.status.lower()}: {(bad.error or '').splitlines()[0] if bad.error else '?'}")
    # Machine load biases the medians in a way no interval carries: such a pair never decides (issue 26's rule,
    # engine/measure/noise.py). Spread alone is carried by the intervals: the pair decides where they separate.
    pair = (("incumbent", inc), ("candidate", cand))
    loaded = [f"{who} {m.unstable.split(';')[0]}" for who, m in pair if LOAD in unstable_causes(m.unstable)]
    if loaded:  # the first reason of each: the table cell stays readable (MLflow has the rest); the ratio is shown, not used
        return Verdict(UNDECIDED_, "unstable: " + "; ".join(loaded), objective.compare(inc, cand), needs=REMEASURE)
    spread = [who for who, m in pair if m.unstable]
    broken = limit_problems(cand, rules)
    if broken:
        return Verdict(REJECTED, "; ".join(broken))
    r = objective.compare(inc, cand)
    if r is None:
        return Verdict(UNDECIDED_, f"no interval for {objective.label}", needs=REMEASURE)
    note = f" (unstable: spread of {' and '.join(spread)}; intervals separate)" if spread else ""
    if r.verdict == SLOWER:
        return Verdict(REJECTED, f"slower {r.cell()}{note}", r)
    if r.verdict == WITHIN_NOISE:
        if spread:  # a wide interval that contains x1 is not evidence of no effect: measure again
            return Verdict(UNDECIDED_, f"unstable: spread of {' and '.join(spread)}; within noise {r.cell()}", r,
                           needs=REMEASURE)
        return Verdict(REJECTED, f"within noise {r.cell()}", r)
    if r.value < 1 + rules.min_effect:
        return Verdict(REJECTED, f"below min effect {r.cell()} < x{1 + rules.min_effect:.2f}", r)
    acc = accuracy_of(inc, cand, rules) if rules.gate else []
    worse = [a for a in acc if a.verdict == WORSE]
    if worse:
        return Verdict(REJECTED, "accuracy gate: " + "; ".join(a.cell() for a in worse), r, acc)
    open_ = [a for a in acc if a.verdict == UNDECIDED]
    if open_:
        return Verdict(UNDECIDED_, "accuracy undecided: " + "; ".join(
            f"{a.cell()} (detects drops >= {100 * a.detectable:.0f}% at n={a.n})" for a in open_), r, acc, MORE_ITEMS)
    return Verdict(ACCEPTED, f"faster {r.cell()}{note}" + ("; accuracy holds" if acc else ""), r, acc)


def accuracy_cell(acc: list[PairedAccuracy]) -> str:
    """The table's accuracy column: each task's delta with its interval and what it could detect."""
    if not acc:
        return ""
    return "; ".join(f"{a.cell()} (n={a.n}, detects {100 * a.detectable:.0f}%)" for a in acc)
