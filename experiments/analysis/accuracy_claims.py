"""The seed's accuracy claims judged from task accuracy (eval.tasks, docs/accuracy.md) rather than perplexity:
each quantized trial's `task_delta.<task>` against the fp32 reference, with its paired stderr.

A claim's relative drop pools the multiple-choice tasks a trial ran: drop = -mean(task_delta) / mean(task_ref),
its stderr = sqrt(sum of the tasks' delta stderr^2) / k / mean(task_ref). The verdict compares the 95%
interval (drop +- 2 stderr) with the claimed range: "yes" inside it, "no" outside it, "within noise" where
the interval straddles a bound.
"""
from __future__ import annotations

import math
from typing import Optional

from engine.axes import QUANT

from .results import TrialRow

# claims.py imports this module and wraps ACCURACY into its Claims (a measurement returns (measured, holds,
# trials used) or None, which claims.py turns into a Finding): this module imports nothing from claims.py
YES, NO, NOISE = "yes", "no", "within noise"
Z = 2.0  # ~95% interval


def _tasks(row: TrialRow, needle: bool) -> list[str]:
    from engine.tasks.data import NEEDLE_TASKS

    names = [k[len("task_delta."):] for k in row.metrics if k.startswith("task_delta.")]
    return [t for t in names if (t in NEEDLE_TASKS) == needle]


def pooled_drop(row: TrialRow, needle: bool = False) -> Optional[tuple[float, float, list[str]]]:
    """(drop %, its stderr %, tasks) of `row` against the reference over its tasks; None without any."""
    tasks = _tasks(row, needle)
    refs = [row.num(f"task_ref.{t}") for t in tasks]
    if not tasks or not all(r is not None for r in refs) or sum(refs) <= 0:
        return None
    mean_ref = sum(refs) / len(refs)
    delta = sum(row.num(f"task_delta.{t}") for t in tasks) / len(tasks)
    se = math.sqrt(sum((row.num(f"task_delta_stderr.{t}") or 0.0) ** 2 for t in tasks)) / len(tasks)
    return -100 * delta / mean_ref + 0.0, 100 * se / mean_ref, tasks  # + 0.0: no "-0.0%"


def verdict(value: float, se: float, lo: float, hi: float) -> str:
    a, b = value - Z * se, value + Z * se
    if lo <= a and b <= hi:
        return YES
    if b < lo or a > hi:
        return NO
    return NOISE


def _combined(verdicts: list[str]) -> str:
    """One verdict for a claim measured at several levels: theirs when they agree, else "within noise" when
    that is one of them (the data cannot tell), else "no" (they contradict each other, so not as a rule)."""
    if len(set(verdicts)) == 1:
        return verdicts[0]
    return NOISE if NOISE in verdicts else NO


def _drop_claim(levels: tuple[str, ...], lo: float, hi: float):
    """Every level of `levels` the sweep ran (the multiple-choice tasks, pooled), each judged on its own."""
    def measure(t):
        parts, verdicts, used = [], [], []
        for level in levels:
            for q in t.find(**{QUANT.key: level}):
                got = pooled_drop(q)
                if got is None:
                    continue
                drop, se, tasks = got
                v = verdict(drop, se, lo, hi)
                parts.append(f"{level}: task accuracy drop {drop:+.1f}% +- {Z * se:.1f}% (95%) vs fp32 over "
                             f"{len(tasks)} task(s), n={int(q.num(f'task_n.{tasks[0]}') or 0)} each ({v})")
                verdicts.append(v)
                used.append(q)
                break  # one trial per level
        if not parts:
            return None
        return "; ".join(parts), _combined(verdicts), used

    return measure


def long_context_drop(t):
    """Each quantization level's needle drop at its longest context against its shortest."""
    by_level: dict[str, dict[int, tuple[float, float, TrialRow]]] = {}
    for q in t.rows:
        lv = QUANT.value(q.params)
        got = pooled_drop(q, needle=True) if lv not in (None, QUANT.off) else None
        if got is not None:
            by_level.setdefault(lv, {})[q.context_len or 0] = (got[0], got[1], q)
    parts, verdicts, used = [], [], []
    for lv, drops in sorted(by_level.items()):
        if len(drops) < 2:
            continue
        lo, hi = min(drops), max(drops)
        diff = drops[hi][0] - drops[lo][0]
        se = math.hypot(drops[hi][1], drops[lo][1])
        v = verdict(diff, se, math.ulp(0.0), math.inf)  # exceeds: strictly more (an equal drop, 0 +- 0, is no)
        parts.append(f"{lv}: needle drop {drops[lo][0]:+.1f}% at context {lo}, {drops[hi][0]:+.1f}% at {hi} "
                     f"(difference {diff:+.1f}% +- {Z * se:.1f}%: {v})")
        verdicts.append(v)
        used += [drops[lo][2], drops[hi][2]]
    if not parts:
        return None
    return "; ".join(parts), _combined(verdicts), used


# (name, the seed's words, measurement, config groups it needs)
ACCURACY = (
    ("acc-int8-weight", "Weight-only INT8: less than 1% accuracy drop on standard benchmarks",
     _drop_claim(("int8-weight", "gguf-q8_0"), -math.inf, 1.0), ("quant",)),
    ("acc-w8a8", "W8A8 (LLM.int8): 1-3% accuracy drop", _drop_claim(("bnb-int8", "int8-dynamic"), 1.0, 3.0), ("quant",)),
    ("acc-int4", "INT4: 3-10% accuracy drop", _drop_claim(("bnb-nf4", "gguf-q4_k_m", "gguf-q4_0"), 3.0, 10.0), ("quant",)),
    ("acc-long-context", "The accuracy drop at long context exceeds the drop at short context (needle)",
     long_context_drop, ("quant",)),
)
