"""One decision: is the candidate better than the incumbent, beyond noise, and within every limit?

Order of the checks (the first that fails decides, and names its reason): the candidate ran; the latest
measurement is not flagged for machine load (else it is discarded and the pair measured again); the SLO limits
hold on the candidate; the objective improves by at least `min_effect` -- the **lower bound** of its ratio, not
the point estimate, clears 1 + min_effect (criterion's noise threshold: an improvement only when the whole
interval lies beyond it); the accuracy gate holds (accuracy.py: non-inferiority on the same items).

The timing rule is sequential and keeps its stated error over the whole procedure. A pair is measured up to
`attempts` times (the rounds of every attempt not flagged for load are pooled), and within one attempt the
engine adds rounds while its own 95% interval holds x1 -- at most `ENGINE_LOOKS` looks at the data per
attempt. Each decision is taken at the one-sided level `false_accept / (ENGINE_LOOKS * attempts)` (Bonferroni
over every look the procedure can make), so P(accepting a candidate whose true gain is below min_effect) <=
`false_accept` whatever the looks saw, where the rounds are exchangeable. The bound is the exact Wilcoxon
signed-rank bound of the pooled per-round log ratios (engine.measure.spread.signed_rank_bounds), moved away from
its centre by the variance factor of the serial correlation the rounds cannot rule out (spread.pooled_bounds: a
shared machine's slow load makes successive rounds alike, and the exact bound then errs ten times as often); the
verdict's reason says how much it widened. tests/test_optimize_timing_calibration.py drives the chain's own pair
loop, with the engine's own extension rule, over thousands of seeds of independent, serially correlated (AR(1))
and per-measurement-offset noise and measures it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import numpy as np

from engine.measure.noise import LOAD, unstable_causes
from engine.measure.spread import Ratio

from .accuracy import UNDECIDED, UNPAIRED, WORSE, PairedAccuracy, paired_accuracy, pooled_accuracy
from .measurement import INVALID, Measurement
from .objective import Objective
from .types import (ACCEPTED, BASELINE, ENGINE_LOOKS, MORE_ITEMS, REFUSED, REJECTED, REMEASURE, RUN_FAILED,  # noqa: F401
                    SKIPPED, TOTAL, UNDECIDED_PAIR, Rules)  # (the decisions' names, re-exported beside the judge)


# timing codes of `timing_codes` (vectorized: the simulation tests judge thousands of pairs in one call)
T_ACCEPT, T_SLOWER, T_BELOW, T_OPEN = 0, 1, 2, 3


@dataclass
class Verdict:
    decision: str
    reason: str
    ratio: Optional[Ratio] = None
    accuracy: list[PairedAccuracy] = field(default_factory=list)  # vs the incumbent
    cumulative: list[PairedAccuracy] = field(default_factory=list)  # vs the chain's baseline (its reference)
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


def grouped(m: Measurement) -> bool:
    """Measured in a process shared with other variants (an interleaved pair): its peak_mem_bytes is its own
    footprint (weights + what its calls allocated), not a process peak that a limit could be judged on."""
    return "group_peak_mem_bytes" in m.metrics


def limit_violations(m: Measurement, rules: Rules) -> dict[str, float]:
    """Each SLO / memory limit of `rules` -> by how much `m` breaks it (> 0: broken; <= 0: holds). A metric not
    measured breaks its limit (1.0): a limit that cannot be checked does not hold. Memory only where the
    measurement's peak is the process's (not `grouped`). The one rule, read by the chain (limit_problems) and by
    the search's constraints."""
    out: dict[str, float] = {}
    for metric, limit in rules.slo.items():
        v = m.metrics.get(metric)
        out[f"slo:{metric}"] = (v - limit) if v is not None else 1.0
    if rules.max_memory_bytes is not None and not grouped(m):
        v = m.metrics.get("peak_mem_bytes")
        out["memory"] = (v - rules.max_memory_bytes) / 1e9 if v is not None else 1.0
    return out


def limit_problems(m: Measurement, rules: Rules) -> list[str]:
    """The SLO / memory limits the measurement breaks, in words ('SLO: p99 TTFT 910 ms > 500')."""
    out = []
    for key, over in limit_violations(m, rules).items():
        if over <= 0:
            continue
        metric = key.removeprefix("slo:") if key.startswith("slo:") else "peak_mem_bytes"
        v = m.metrics.get(metric)
        if key == "memory":
            out.append("memory: peak not measured" if v is None else
                       f"memory: peak {v / 1e9:.2f} GB > {rules.max_memory_bytes / 1e9:.2f} GB")
        else:
            out.append(f"SLO: {metric_label(metric)} not measured" if v is None else
                       f"SLO: {metric_label(metric)} {_value(metric, v)} > {rules.slo[metric]:g}")
    return out


def memory_problem(m: Measurement, rules: Rules) -> str:
    """The memory limit on a solo measurement ('' when it holds or no limit is set)."""
    return next((p for p in limit_problems(m, replace(rules, slo={})) if p.startswith("memory")), "")


def min_rounds(rules: Rules) -> int:
    """The fewest rounds from which one measurement can give a bound at the look's level (2^-n <= level):
    fewer, and a first measurement could never decide (optimize.rounds is raised to it)."""
    from engine.measure.spread import signed_rank_k

    n = 2
    while signed_rank_k(n, rules.timing_alpha) < 1:
        n += 1
    return n


def timing_codes(lo, hi, min_effect: float) -> np.ndarray:
    """The timing verdict of ratio intervals [lo, hi] (arrays): T_ACCEPT when lo >= 1 + min_effect, T_SLOWER
    when hi < 1, T_BELOW when hi < 1 + min_effect, else T_OPEN (more data may decide)."""
    lo, hi = np.asarray(lo, dtype=float), np.asarray(hi, dtype=float)
    bar = 1 + min_effect
    return np.where(lo >= bar, T_ACCEPT, np.where(hi < 1, T_SLOWER, np.where(hi < bar, T_BELOW, T_OPEN)))


def accuracy_of(ref: Measurement, cand: Measurement, rules: Rules) -> list[PairedAccuracy]:
    """The paired accuracy gate of every task both trials answered, items paired by identity."""
    tasks = [t for t in cand.correct if t in ref.correct]
    models_differ = any(ref.point.get(k) != cand.point.get(k) for k in ("model", "model.name"))
    return [paired_accuracy(t, ref.correct[t], cand.correct[t], rules.max_drop, rules.gate_alpha,
                            positional_ok=not (models_differ and t in rules.model_documents)) for t in tasks]


def pooled_of(ref: Measurement, cand: Measurement, rules: Rules) -> list[PairedAccuracy]:
    """The gate's one judgement: the items of every task both trials answered, pooled (accuracy.pooled_accuracy);
    [] where neither answered any task."""
    if not any(t in ref.correct for t in cand.correct):
        return []
    models_differ = any(ref.point.get(k) != cand.point.get(k) for k in ("model", "model.name"))
    unpaired = [t for t in cand.correct if models_differ and t in rules.model_documents]
    return [pooled_accuracy(ref.correct, cand.correct, rules.max_drop, rules.gate_alpha, unpaired)]


def loaded(m: Measurement) -> bool:
    return LOAD in unstable_causes(m.unstable)


def judge_timing(attempts: Sequence[tuple[Measurement, Measurement]], objective: Objective, rules: Rules) -> Verdict:
    """The timing verdict of a pair from all its measurements so far (latest last): failed, load (this
    measurement is not used: measure again), SLO, then the sequential ratio over the pooled clean rounds."""
    inc, cand = attempts[-1]
    refused = [m.error for m in (inc, cand) if m.status == INVALID]
    if refused:  # validation refused the combination (engine=native-cpp on kv_cache=off): nothing ran, nothing spent
        return Verdict(SKIPPED, REFUSED + refused[0].splitlines()[0])
    if not cand.ok or not inc.ok:
        bad = cand if not cand.ok else inc
        return Verdict(RUN_FAILED, f"{bad.status.lower()}: {(bad.error or '').splitlines()[0] if bad.error else '?'}")
    # Machine load biases the medians in a way no interval carries: a loaded measurement never decides and
    # its rounds are not pooled (issue 26's rule, engine/measure/noise.py); the pair is measured again.
    flagged = [f"{who} {m.unstable.split(';')[0]}" for who, m in (("incumbent", inc), ("candidate", cand)) if loaded(m)]
    if flagged:
        return Verdict(UNDECIDED_PAIR, "unstable: " + "; ".join(flagged), objective.compare(inc, cand), needs=REMEASURE)
    broken = limit_problems(cand, rules)
    if broken:
        return Verdict(REJECTED, "; ".join(broken))
    clean = [(i, c) for i, c in attempts if i.ok and c.ok and not loaded(i) and not loaded(c)]
    reading = objective.reading(clean, rules.timing_alpha)
    if reading is None:
        return Verdict(UNDECIDED_PAIR, f"no interval for {objective.label}", needs=REMEASURE)
    r = reading.ratio
    code = int(timing_codes(r.lo, r.hi, rules.min_effect))
    bar = f"x{1 + rules.min_effect:.2f}"
    n = sum(len(next(iter(c.rounds.values()), [])) for _, c in clean)
    # the rounds the bounds rest on, and how their serial correlation widened them (spread.Serial.note)
    basis = (f"({n} rounds" + (f" in {len(clean)} measurements" if len(clean) > 1 else "") + ")"
             + (f"; {reading.note}" if reading.note else ""))
    if code == T_SLOWER:
        return Verdict(REJECTED, f"slower {r.cell()} {basis}", r)
    if code == T_BELOW:
        return Verdict(REJECTED, f"below min effect {r.cell()}: shown < {bar} {basis}", r)
    if code == T_OPEN:
        return Verdict(UNDECIDED_PAIR, f"not shown >= {bar} nor below it: {r.cell()} {basis}", r, needs=REMEASURE)
    return Verdict(ACCEPTED, f"faster {r.cell()} >= {bar} {basis}", r)


def judge_accuracy(ref_pair: list[PairedAccuracy], ref_base: list[PairedAccuracy]) -> tuple[str, str, str]:
    """(decision, reason, needs) of the accuracy gates: vs the incumbent and vs the baseline (cumulative)."""
    both = [("vs incumbent", a) for a in ref_pair] + [("vs baseline", a) for a in ref_base]
    worse = [f"{who}: {a.cell()}" for who, a in both if a.verdict == WORSE]
    if worse:
        return REJECTED, "accuracy gate: " + "; ".join(worse), ""
    unpaired = [f"{who}: {a.cell()}" for who, a in both if a.verdict == UNPAIRED]
    if unpaired:
        return UNDECIDED_PAIR, "accuracy cannot be judged: " + "; ".join(unpaired), ""
    open_ = [f"{who}: {a.cell()}" for who, a in both if a.verdict == UNDECIDED]
    if open_:
        return UNDECIDED_PAIR, "accuracy undecided: " + "; ".join(open_), MORE_ITEMS
    return ACCEPTED, "accuracy holds" if both else "", ""


def accuracy_cell(acc: list[PairedAccuracy], cumulative: Sequence[PairedAccuracy] = ()) -> str:
    """The table's accuracy column: each task's delta with its interval, n and verdict, vs the incumbent and
    vs the baseline."""
    parts = []
    if acc:
        parts.append("; ".join(a.cell() for a in acc))
    if cumulative:
        parts.append("vs baseline: " + "; ".join(a.cell() for a in cumulative))
    return " / ".join(parts)  # no `|`: the cell reads the same in the terminal as in the rendered table
