"""`reproduce HASH`: re-run a recorded trial from its stored config and compare with the original."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import yaml

from engine.measure.metrics import DETERMINISTIC

from ..config.compose import SweepError, load_trial
from ..errors import UserError
from ..tracking.store import ANSWERS_ARTIFACT, CONFIG_ARTIFACT, TOKENS_ARTIFACT, Tracker
from .trial import FINISHED, execute_trial

class ReproduceError(UserError):
    heading = "cannot reproduce"


# max_rate_at_slo (a capacity search's found rate) is a timing too: its interval is the search's bracket
TIMING = ("output_tok_s", "decode_tok_s", "prefill_tok_s", "ttft_ms_p50", "tpot_ms_p50", "peak_mem_bytes",
          "max_rate_at_slo")


@dataclass
class Comparison:
    original_run_id: str
    new_run_id: str
    config_hash: str
    tokens_match: bool
    rows: list[tuple[str, str, str, str]]  # (metric, original, reproduced, verdict)
    why_original: str = ""  # which of several runs with this hash is the original, and why
    # --against-all: (which run, tokens verdict, ["metric xRATIO verdict", ...]) for every other run of the hash
    others: list = field(default_factory=list)

    @property
    def deterministic_match(self) -> bool:
        return self.tokens_match and all(v != "DIFFERS" for *_, v in self.rows)


def find_original(tracker: Tracker, prefix: str):
    runs = tracker.find_by_hash(prefix)
    if not runs:
        raise ReproduceError([f"no FINISHED run has a config_hash starting with {prefix!r} in {tracker.uri}"])
    hashes = sorted({r.data.tags["config_hash"] for r in runs})
    if len(hashes) > 1:
        shown = ", ".join(h[:16] for h in hashes[:5])
        raise ReproduceError([f"prefix {prefix!r} is ambiguous: {len(hashes)} hashes match ({shown}); give more characters"])
    originals = [r for r in runs if "reproduces" not in r.data.tags] or runs
    originals.sort(key=lambda r: r.info.start_time or 0)
    return originals[0], why_original(originals, len(runs)), [r for r in runs if r is not originals[0]]


def why_original(originals, total: int) -> str:
    """Which run is compared against, and why, when several FINISHED runs share the hash."""
    if total == 1:
        return ""
    others = ", ".join(r.info.run_id[:8] for r in originals[1:5]) + (" ..." if len(originals) > 5 else "")
    return (f"{total} FINISHED runs share this hash ({total - len(originals)} of them reproductions); the original "
            f"is the earliest that is not a reproduction: run {originals[0].info.run_id[:8]}, experiment id "
            f"{originals[0].info.experiment_id}" + (f" (the other originals: {others})" if others else ""))


def reproduce(prefix: str, tracking: dict, against_all: bool = False) -> Comparison:
    """Re-run the original run of `prefix` and compare; `against_all`: also judge the new run against every
    other FINISHED run with the hash (other experiments, earlier sweeps, earlier reproductions)."""
    tracker = Tracker(tracking)
    orig, why, others = find_original(tracker, prefix)
    config = yaml.safe_load(tracker.load_text(orig.info.run_id, CONFIG_ARTIFACT))
    config["tracking"] = tracking  # record where this invocation tracks, not where the original did
    try:
        spec = load_trial(config)
    except SweepError as e:  # the code moved on since the run: say which stored config no longer validates
        raise ReproduceError([f"the stored config of run {orig.info.run_id} no longer validates: {p}"
                              for p in e.problems]) from None
    stored = orig.data.tags["config_hash"]
    if spec.config_hash != stored:
        raise ReproduceError([f"stored config hashes to {spec.config_hash[:12]}, not {stored[:12]} (hash_version changed?)"])
    outcome = execute_trial(spec)
    exp_name = config.get("sweep_name", "default")
    new_id = tracker.log_trial(
        exp_name, spec, outcome, extra_tags={"reproduces": orig.info.run_id, "reproduces_hash": stored}
    )
    if outcome.status != FINISHED:
        raise ReproduceError([f"the re-run failed: {(outcome.error or '').splitlines()[0]}"])
    orig_tokens = json.loads(tracker.load_text(orig.info.run_id, TOKENS_ARTIFACT))
    tokens_match = orig_tokens == outcome.token_ids
    rows = [("generated token ids", f"{sum(map(len, orig_tokens))} ids", f"{sum(map(len, outcome.token_ids))} ids",
             "MATCH" if tokens_match else "DIFFERS")]
    om = orig.data.metrics
    for k in DETERMINISTIC:
        if k in om or k in outcome.metrics:
            a, b = om.get(k), outcome.metrics.get(k)
            rows.append((k, _num(a), _num(b), deterministic_verdict(a, b)))
    rows += task_rows(tracker, orig, om, outcome)
    for k in TIMING:
        if k in om and k in outcome.metrics and om[k]:
            rows.append((k, _num(om[k]), _num(outcome.metrics[k]), timing_verdict(k, om, outcome.metrics)))
    cmp = Comparison(orig.info.run_id, new_id, stored, tokens_match, rows, why)
    for other in (others if against_all else []):
        try:
            same = json.loads(tracker.load_text(other.info.run_id, TOKENS_ARTIFACT)) == outcome.token_ids
        except Exception:  # noqa: BLE001 -- a run whose artifacts are gone is still judged on its timings
            same = None
        om = other.data.metrics
        judged = [f"{k} {timing_verdict(k, om, outcome.metrics)}" for k in TIMING
                  if k in om and k in outcome.metrics and om[k]]
        tag = " (a reproduction)" if "reproduces" in other.data.tags else ""
        cmp.others.append((f"run {other.info.run_id[:8]}{tag}, experiment id {other.info.experiment_id}",
                           {True: "tokens MATCH", False: "tokens DIFFER", None: "tokens not recorded"}[same], judged))
    return cmp


NOT_RECORDED = "not recorded originally"


def deterministic_verdict(original, new) -> str:
    """MATCH / DIFFERS; a metric the original run lacks and the re-run logs was added to the code since
    (e.g. kl_div_p999): nothing to compare, not a difference."""
    if original is None and new is not None:
        return NOT_RECORDED
    return "MATCH" if original == new else "DIFFERS"


def task_rows(tracker: Tracker, orig, om: dict, outcome) -> list[tuple[str, str, str, str]]:
    """eval.tasks: each task's per-example answers (greedy, so deterministic) and its accuracy must match."""
    if not outcome.answers:
        return []
    try:
        orig_answers = json.loads(tracker.load_text(orig.info.run_id, ANSWERS_ARTIFACT))
    except Exception:
        orig_answers = {}
    rows = []
    for task, new in sorted(outcome.answers.items()):
        old = orig_answers.get(task)
        same = old == new
        rows.append((f"answers {task}", f"{len(old)} examples" if old is not None else "-", f"{len(new)} examples",
                     "MATCH" if same else "DIFFERS"))
        for k in (f"task_score.{task}", f"acc.{task}", f"acc_norm.{task}", f"exact_match.{task}"):
            if k in om or k in outcome.metrics:
                a, b = om.get(k), outcome.metrics.get(k)
                rows.append((k, _num(a), _num(b), "MATCH" if a == b else "DIFFERS"))
    return rows


CONSISTENT, DIFFERS_BEYOND_NOISE, NO_INTERVAL = "consistent", "differs beyond noise", "no interval recorded"


def timing_verdict(k: str, original: dict, new: dict) -> str:
    """`xRATIO verdict` for timing `k`: consistent when the two runs' 95% intervals of the median overlap
    (each run's own noise widens the other's interval), else differs beyond noise; a run recorded before
    intervals existed has none to judge by."""
    ratio = f"x{new[k] / original[k]:.2f}"
    bounds = [d.get(f"{k}_ci_{e}") for d in (original, new) for e in ("lo", "hi")]
    if any(b is None for b in bounds):
        return f"{ratio} {NO_INTERVAL}"
    lo, hi, nlo, nhi = bounds
    return f"{ratio} {CONSISTENT if lo <= nhi and nlo <= hi else DIFFERS_BEYOND_NOISE}"


def _num(v) -> str:
    if v is None:
        return "-"
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def format_comparison(c: Comparison) -> str:
    header = ("metric", "original", "reproduced", "verdict / ratio")
    rows = [header] + c.rows
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [f"config {c.config_hash[:12]}: original run {c.original_run_id}, new run {c.new_run_id}"]
    for i, r in enumerate(rows):
        lines.append("  ".join(x.ljust(w[j]) for j, x in enumerate(r)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * x for x in w))
    if c.why_original:
        lines.insert(1, c.why_original)
    verdict = "deterministic results MATCH" if c.deterministic_match else "deterministic results DIFFER"
    lines.append(verdict)
    timings = [v for *_, v in c.rows if v.startswith("x")]
    judged = {w: sum(t.endswith(w) for t in timings) for w in (CONSISTENT, DIFFERS_BEYOND_NOISE, NO_INTERVAL)}
    lines.append("timings (reproduced/original, judged by both runs' 95% intervals): "
                 + ", ".join(f"{n} {w}" for w, n in judged.items() if n))
    if c.others:
        lines.append(f"against the {len(c.others)} other run(s) with this hash:")
        for who, tokens, judged_timings in c.others:
            lines.append(f"  {who}: {tokens}; " + ("; ".join(judged_timings) or "no timings"))
    return "\n".join(lines)
