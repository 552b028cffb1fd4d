"""Next optimization: for the best configuration so far, the first step of the seed's chain it does not yet
apply, and whether the measured regime says that step should pay off.

The seed's order and each step's config key and "off" value come from the axis registry (engine/axes.py):
KV cache -> continuous batching (with concurrent requests) -> flash/fused attention -> quantization ->
speculative decoding -> right-size the model. A step whose key no trial has is "not measured (feature
missing)", so the advice works on sweeps recorded before a feature existed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from engine import axes
from engine.axes import RIGHT_SIZE, Axis

from engine.measure.spread import WITHIN_NOISE

from .results import SPREAD, WHAT_TO_DO, TrialRow, causes, compare, counterpart, describe, loaded, rule_verdict, unstable_note

APPLIED, NEXT, LATER, NO_GAIN, WITHIN, UNLIKELY, NOT_APPLICABLE, MISSING = (
    "applied", "next", "later", "measured: no gain", "measured: within noise", "unlikely to pay off",
    "not applicable", "not measured (feature missing)")
SMALLER_SUFFICES, LARGER_NEEDED, SPEED_ONLY = (
    "measured: the smaller model suffices", "measured: the larger model is needed",
    "measured: speed only (no task accuracy)")
Z95 = 1.96  # a task score difference's 95% interval from the two scores' standard errors


CHAIN: tuple[Axis, ...] = axes.CHAIN


def step_value(row: TrialRow, step: Axis) -> Optional[str]:
    return step.value(row.params)


def applied(row: TrialRow, step: Axis) -> Optional[bool]:
    """True/False, or None when the trial has no such key (the feature did not exist)."""
    return step.applied(row.params)


def n_applied(row: TrialRow) -> int:
    return sum(bool(applied(row, s)) for s in CHAIN)


def chain_order(row: TrialRow) -> tuple:
    """Sort key along the chain: fewer steps first; at equal count, earlier steps of the seed's order first."""
    return (n_applied(row), tuple(not applied(row, s) for s in CHAIN))


def chain_label(row: TrialRow) -> str:
    on = [s.label for s in CHAIN if applied(row, s)]
    return " + ".join(on) if on else "baseline (nothing applied)"


def regime(row: TrialRow, phase: str) -> tuple[Optional[str], str]:
    """(regime, 'measured' | 'predicted') of a phase; measured where the trial recorded it."""
    if row.tags.get(f"regime.{phase}.measured"):
        return row.tags[f"regime.{phase}.measured"], "measured"
    if row.tags.get(f"regime.{phase}"):
        return row.tags[f"regime.{phase}"], "predicted"
    return None, ""


def _pct(x: Optional[float]) -> str:
    if x is None:
        return "?"
    p = 100 * x
    return f"{p:.0f}%" if p >= 10 else (f"{p:.1f}%" if p >= 1 else f"{p:.2f}%")


def _decode_evidence(row: TrialRow) -> str:
    reg, how = regime(row, "decode")
    if reg is None:
        return "decode regime unknown (no cost model metrics)"
    util = ""
    if row.num("decode_bw_util") is not None:
        util = f": {_pct(row.num('decode_bw_util'))} of peak bandwidth, {_pct(row.num('decode_compute_util'))} of peak FLOP/s"
    return f"decode is {reg}-bound ({how}{util})"


@dataclass
class StepAdvice:
    step: str
    value: Optional[str]  # the best trial's setting (None: feature missing)
    status: str
    verdict: str
    pays_off: Optional[bool] = None


def judge(step: Axis, best: TrialRow) -> tuple[bool, Optional[bool], str]:
    """(applicable, pays off?, why) of applying `step` on top of `best`, from its measured regime."""
    dreg, _ = regime(best, "decode")
    phase, overall = best.tags.get("regime.phase"), best.tags.get("regime")
    cpu = best.device.startswith("cpu")
    if step.group == "kv_cache":
        return True, True, (f"{_decode_evidence(best)}; without a cache every step recomputes the whole sequence "
                            "(O(n^2)); with it a step is one token against the cache")
    if step.group == "batching":
        if best.batch_size <= 1 and best.params.get("workload.name", "static") == "static":
            return False, None, "one request at a time (batch 1): continuous batching needs concurrent requests"
        return True, True, (f"concurrent load (batch {best.batch_size}): continuous batching first -- static batches "
                            "hold every slot until the slowest request finishes")
    if step.group == "attention":
        ctx = best.context_len or 0
        score, pre = best.num("cost_attn_score_bytes"), best.num("cost_prefill_bytes")
        share = score / pre if score is not None and pre else None
        traffic = f"eager moves {score / 1e6:.0f} MB of attention scores per prefill ({_pct(share)} of its traffic)" if share is not None else "eager materializes the T x T scores"
        if ctx >= 1024 or (share or 0) >= 0.2:
            return True, True, f"{traffic} at context {ctx}: a fused kernel never writes them"
        return True, False, f"short context ({ctx}): {traffic}; attention is already cheap -- expect little"
    if step.group == "quant":
        note = " On CPU the gain depends on int8 kernels (dequantize-per-matmul kernels such as bitsandbytes' are slower than fp32)." if cpu else ""
        if phase == "prefill" and overall == "compute":
            return True, False, f"time is dominated by a compute-bound prefill: quantization cuts bytes, not FLOPs.{note}"
        if dreg == "memory":
            return True, True, (f"{_decode_evidence(best)}: fewer weight bytes per step is fewer seconds per step; "
                                f"weight-only int8 first.{note}")
        if dreg == "compute":
            return True, False, f"{_decode_evidence(best)}: quantization cuts bytes, not FLOPs -- little to gain.{note}"
        return True, None, "regime unknown"
    if step.group == "speculative":
        if dreg == "compute":
            return True, False, f"{_decode_evidence(best)}: verifying k drafted tokens costs ~k times the FLOPs -- speculation won't help"
        if best.batch_size > 8:
            return True, False, f"batch {best.batch_size} already shares each weight read between many sequences: little left for speculation"
        if dreg == "memory":
            return True, True, (f"{_decode_evidence(best)}: verifying k drafted tokens costs about one weight pass, "
                                "so accepted tokens are nearly free (needs a well-aligned draft)")
        return True, None, "regime unknown"
    return True, None, ""


@dataclass
class Advice:
    workload: str
    best: Optional[TrialRow]  # None: no trial is fit to decide (every one was measured under machine load)
    steps: list[StepAdvice] = field(default_factory=list)
    tied: list[TrialRow] = field(default_factory=list)  # other trials whose throughput is within noise of best's
    unfit: list[TrialRow] = field(default_factory=list)  # measured under machine load: never compared
    separated: bool = False  # best's interval excludes every other fit trial's (none within noise or unknown)

    @property
    def next(self) -> Optional[StepAdvice]:
        return next((s for s in self.steps if s.status == NEXT), None)

    @property
    def skipped_missing(self) -> list[StepAdvice]:
        """Applicable steps before `next` in the seed's order that cannot be measured yet."""
        out = []
        for s in self.steps:
            if s.status == NEXT:
                break
            if s.status == MISSING and s.pays_off is not False:
                out.append(s)
        return out


def advise(rows: list[TrialRow], ax: list[str], workload: str = "",
           sweep_rows: Optional[list[TrialRow]] = None) -> Optional[Advice]:
    """Advice for the best (highest output_tok_s) finished trial among `rows` (one workload) that is fit to
    decide: a trial measured under machine load (results.loaded) is never named best nor compared; when
    none is fit, the advice names no winner (`best` None) and says what to do. `sweep_rows`: every trial of
    the sweep, where the right-size step looks for the other model (the model is not an optimization axis,
    so each model's trials are a workload of their own); default `rows`."""
    done = [r for r in rows if r.finished and r.num("output_tok_s")]
    if not done:
        return None
    unfit = [r for r in done if loaded(r)]
    fit = [r for r in done if not loaded(r)]
    if not fit:
        adv = Advice(workload, None, unfit=unfit)
        # task accuracy is untimed, so load does not bias it: the right-size comparison is still reported,
        # its speed ratio marked unstable: load by right_size itself
        rs = right_size(sweep_rows or rows, max(unfit, key=lambda r: r.num("output_tok_s")), ax)
        if rs is not None:
            adv.steps.append(rs)
        return adv
    best = max(fit, key=lambda r: r.num("output_tok_s"))
    adv = Advice(workload, best, unfit=unfit)
    cmps = [compare(r, best, "output_tok_s") for r in fit if r is not best]
    adv.tied = [r for r, c in zip([r for r in fit if r is not best], cmps) if c is not None and c.verdict == WITHIN_NOISE]
    adv.separated = all(c is not None and c.verdict != WITHIN_NOISE for c in cmps)
    have_next = False
    for step in CHAIN:
        value = step_value(best, step)
        ok, pays, why = judge(step, best)
        if step.applied(best.params):
            adv.steps.append(StepAdvice(step.label, value, APPLIED, "applied", True))
            continue
        if value is None:
            adv.steps.append(StepAdvice(step.label, None, MISSING if ok else NOT_APPLICABLE, why, pays))
            continue
        # measured in this sweep on top of the same settings, and slower (or it would be the best)
        tried = counterpart(rows, best, {step.key: lambda v, off=step.off: v is not None and v != off}, ax)
        if tried is not None and loaded(tried):  # measured, but under load: it decides nothing; judge by regime
            why = (f"measured here only under machine load ({step_value(tried, step)}, {tried.hash[:8]}: "
                   f"unstable: load -- not decidable); by the regime: {why}")
            tried = None
        if tried is not None:
            cmp = compare(best, tried, "output_tok_s")
            if cmp is not None:
                within = cmp.verdict == WITHIN_NOISE
                adv.steps.append(StepAdvice(
                    step.label, value, WITHIN if within else NO_GAIN,
                    f"measured here: {step_value(tried, step)} runs at {cmp.cell()} of this trial's throughput -- "
                    + rule_verdict("within noise: no measurable gain on this workload and hardware" if within
                                   else "on this workload and hardware it does not pay off", [best, tried],
                                   decided=not within), False))
                continue
            r = tried.num("output_tok_s") / best.num("output_tok_s")
            adv.steps.append(StepAdvice(step.label, value, NO_GAIN,
                                        f"measured here: {step_value(tried, step)} runs at x{r:.2f} of this trial's "
                                        "throughput -- on this workload and hardware it does not pay off", False))
            continue
        if not ok:
            adv.steps.append(StepAdvice(step.label, value, NOT_APPLICABLE, why, pays))
            continue
        if pays is False:  # the regime argues against it: never the recommended next step
            adv.steps.append(StepAdvice(step.label, value, UNLIKELY, why, pays))
            continue
        adv.steps.append(StepAdvice(step.label, value, LATER if have_next else NEXT, why, pays))
        have_next = True
    adv.steps.append(right_size(sweep_rows or rows, best, ax)
                     or StepAdvice(RIGHT_SIZE, best.params.get("model.name"), LATER if have_next else NEXT,
                                   "often worth more than all of the above: sweep a smaller model (model=...) and "
                                   "compare accuracy", None))
    return adv


def _best_line(a: Advice, ax: list[str]) -> str:
    """'Best so far: ...' naming why the choice stands when its trial is spread-flagged."""
    from .results import opt_label

    b = a.best
    dreg, dhow = regime(b, "decode")
    preg, phow = regime(b, "prefill")
    note = unstable_note([b])
    if SPREAD in causes(b) and a.separated:  # every other fit trial's interval separates from it
        note = " (unstable: spread; decided: its interval separates from every other trial's)"
    return (f"Best so far: **{opt_label(b, ax)}** ({b.hash}) -- {b.num('output_tok_s'):.2f} output tok/s; "
            f"prefill {preg or '?'}-bound ({phow or 'unknown'}), decode {dreg or '?'}-bound ({dhow or 'unknown'})"
            + note + ".\n")


def task_difference(a: TrialRow, b: TrialRow, task: str) -> Optional[tuple[float, float, float]]:
    """(a - b, lo, hi) of one task's score with its 95% interval (the two standard errors combined)."""
    sa, sb = a.num(f"task_score.{task}"), b.num(f"task_score.{task}")
    if sa is None or sb is None:
        return None
    se = ((a.num(f"task_score_stderr.{task}") or 0.0) ** 2 + (b.num(f"task_score_stderr.{task}") or 0.0) ** 2) ** 0.5
    d = sa - sb
    return d, d - Z95 * se, d + Z95 * se


def task_differences(small: TrialRow, large: TrialRow, tasks: list[str]) -> tuple[list[str], list[str]]:
    """(a cell 'task d [lo, hi]' per task, the tasks where the smaller model is worse beyond its interval)."""
    cells, needed = [], []
    for t in tasks:
        d, lo, hi = task_difference(small, large, t)
        cells.append(f"{t} {d:+.3f} [{lo:+.3f}, {hi:+.3f}]")
        if hi < 0:
            needed.append(t)
    return cells, needed


def _tasks(row: TrialRow) -> list[str]:
    return sorted(k[len("task_score."):] for k in row.metrics
                  if k.startswith("task_score.") and "." not in k[len("task_score."):])


def right_size(rows: list[TrialRow], best: TrialRow, ax: list[str]) -> Optional[StepAdvice]:
    """The seed's last step, measured: the same configuration on another model in this sweep (model is an
    axis). Per task, the smaller model's score minus the larger's with its 95% interval; the smaller model
    suffices where no interval lies wholly below zero. None where the sweep has no other model."""
    name = best.params.get("model.name")
    changes: dict = {k: (lambda v: True) for k in ax if k.startswith("model.") and k != "model.dtype"}
    changes["model.name"] = lambda v: v is not None and v != name
    other = counterpart(rows, best, changes, ax)
    if other is None:
        return None
    wb, wo = best.num("weights_bytes"), other.num("weights_bytes")
    small, large = (best, other) if (wb or 0) <= (wo or 0) else (other, best)
    sname, lname = small.params.get("model.name"), large.params.get("model.name")
    cmp = compare(large, small, "output_tok_s")
    speed = cmp.cell() if cmp is not None else (
        f"x{small.num('output_tok_s') / large.num('output_tok_s'):.2f}" if small.num("output_tok_s") and large.num("output_tok_s") else "?")
    cost = (f"{sname} runs at {speed} the throughput of {lname}"
            + "".join(f", {m} {small.num(m):.1f} vs {large.num(m):.1f}" for m in ("tpot_ms", "ttft_ms")
                      if small.num(m) is not None and large.num(m) is not None))
    tasks = [t for t in _tasks(small) if t in _tasks(large)]
    if not tasks:
        return StepAdvice(RIGHT_SIZE, name, SPEED_ONLY, f"measured here: {cost}{unstable_note([small, large])}; "
                          "add eval=tasks to judge whether the smaller model is accurate enough", None)
    cells, needed = task_differences(small, large, tasks)
    diffs = "; ".join(cells)
    if needed:
        return StepAdvice(RIGHT_SIZE, name, LARGER_NEEDED,
                          f"the larger model {lname} is needed for {', '.join(needed)} ({sname} - {lname}: {diffs}); "
                          f"{cost}{unstable_note([small, large])}", False)
    return StepAdvice(RIGHT_SIZE, name, SMALLER_SUFFICES,
                      f"the smaller model {sname} is within noise of {lname} or better on every task ({sname} - "
                      f"{lname}: {diffs}) and {cost}{unstable_note([small, large])}", True)


def to_markdown(advices: list[Advice], ax: list[str]) -> str:
    from .results import opt_label

    out = []
    for a in advices:
        out.append(f"### {a.workload}\n")
        unfit = ", ".join(f"{opt_label(r, ax)} ({r.hash[:8]})" for r in a.unfit)
        if a.best is None:
            out.append(f"No trial here is fit to decide: all {len(a.unfit)} were measured under machine load "
                       f"(unstable: load: {unfit}), which biases their medians beyond their intervals -- no best "
                       f"configuration and no next step are named. To decide: {WHAT_TO_DO}.\n")
            for s in a.steps:  # right-size: its accuracy part is untimed
                out.append(f"**{s.step}** ({s.status}; task accuracy is untimed, the speed ratio was measured "
                           f"under load): {s.verdict}\n")
            continue
        out.append(_best_line(a, ax))
        if a.unfit:
            out.append(f"Not compared (measured under machine load, unstable: load): {unfit} -- any of them may be "
                       f"faster; to place them: {WHAT_TO_DO}.\n")
        if a.tied:
            out.append("Within noise of it: " + ", ".join(f"{opt_label(r, ax)} ({r.hash[:8]})" for r in a.tied)
                       + " -- the intervals cannot tell these apart.\n")
        n = a.next
        if n is not None:
            pay = {True: "should pay off", False: "unlikely to pay off", None: "unknown"}[n.pays_off]
            out.append(f"**Next: {n.step}** ({pay}): {n.verdict}\n")
        for s in a.skipped_missing:
            out.append(f"_Before that in the seed's order: {s.step} -- not measured (feature missing); {s.verdict}._\n")
        out.append("| step (seed's order) | this trial | status | why |")
        out.append("|---|---|---|---|")
        for s in a.steps:
            out.append(f"| {s.step} | {s.value if s.value is not None else '-'} | {s.status} | {s.verdict} |")
        out.append("")
    return "\n".join(out)


__all__ = ["Advice", "CHAIN", "StepAdvice", "advise", "applied", "chain_label", "chain_order", "describe",
           "n_applied", "regime", "right_size", "step_value", "task_difference", "task_differences", "to_markdown"]
