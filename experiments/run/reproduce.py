"""`reproduce HASH`: re-run a recorded trial from its stored config and compare with the original, like with like.

A trial measured alone is re-run alone. A trial measured in an interleaved group (`cluster.interleave`, or one
of `optimize`'s pairs) is re-run in the same arrangement: its partners' stored configs are re-run with it,
round-robin on one worker, and the paired ratio of each timing (trial vs partner, round by round) is judged
against the one recorded -- the number the original decision read. Its absolute timings are judged too, and
peak memory only between measurements of one kind (a variant's own footprint in a group, or a solo process's
peak). Where the partners are gone from the store the trial is re-run alone and its timings are shown, not
judged. The output says which was done. A run flagged `unstable: load` (other processes took the machine: its
medians are biased in a way no interval carries) decides no timing comparison: where the original, the re-run
or a partner carries that flag, its timings read "load: cannot judge" (memory and deterministic results are
still judged).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

import yaml

from engine.measure.metrics import DETERMINISTIC, TIMINGS
from engine.measure.noise import LOAD, UNSTABLE, unstable_causes
from engine.measure.spread import LOWER_IS_BETTER, Ratio, paired_ratio

from ..config.compose import SweepError, load_trial
from ..config.spec import TrialSpec
from ..errors import UserError
from ..tracking.store import ANSWERS_ARTIFACT, CONFIG_ARTIFACT, REPEAT_PREFIX, TOKENS_ARTIFACT, Tracker
from .trial import FINISHED, execute_interleaved, execute_trial

GROUP_TAG = "env.interleave_group"  # the trial ran round-robin with the others of this group (trial.py)
SOLO, INTERLEAVED = "solo", "interleaved"

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
    arrangement: str = ""  # what was done: solo, or interleaved with which partners (one line, printed)
    partner_run_ids: list[str] = field(default_factory=list)  # the partners' new runs (interleaved)
    loaded: list[str] = field(default_factory=list)  # "the original: load: ..." for each run flagged for load

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
    """Re-run the original run of `prefix` in its own arrangement (alone, or with its interleaved group) and
    compare; `against_all`: also judge the new run against every other FINISHED run with the hash (other
    experiments, earlier sweeps, earlier reproductions), each where it was measured the same way."""
    tracker = Tracker(tracking)
    orig, why, others = find_original(tracker, prefix)
    spec = _stored_spec(tracker, orig, tracking)
    stored = orig.data.tags["config_hash"]
    partners, missing = interleave_partners(tracker, orig)
    if partners:
        group = sorted([(orig, spec)] + [(p, _stored_spec(tracker, p, tracking)) for p in partners],
                       key=lambda rs: int(rs[0].data.tags.get("trial_index", 0)))
        specs = [TrialSpec(config=s.config, swept=s.swept, index=i) for i, (_, s) in enumerate(group)]
        outcomes = execute_interleaved(specs)
        new_ids = {r.info.run_id: _log(tracker, r, s, o, INTERLEAVED) for (r, _), s, o in zip(group, specs, outcomes)}
        outcome = outcomes[[r.info.run_id for r, _ in group].index(orig.info.run_id)]
        pairs = [(p, o) for (p, _), o in zip(group, outcomes) if p.info.run_id != orig.info.run_id]
        arrangement = (f"{INTERLEAVED}, as the original: re-ran its group of {len(group)} round-robin on one worker "
                       f"(group {orig.data.tags[GROUP_TAG]}, >= {specs[0].cluster.interleave} rounds) with "
                       + ", ".join(f"{_name(p)} (run {p.info.run_id[:8]})" for p, _ in pairs)
                       + "; paired ratios judged against the recorded ones, peak memory as each variant's own footprint")
    else:
        outcome = execute_trial(spec)
        new_ids = {orig.info.run_id: _log(tracker, orig, spec, outcome, SOLO)}
        pairs = []
        arrangement = (f"{SOLO}, as the original" if not missing else
                       f"{SOLO}, NOT as the original: {missing}; its timings are shown, not judged (an interleaved "
                       "measurement and a solo one differ by design), peak memory not compared")
    new_id = new_ids[orig.info.run_id]
    failed = [o for o in ([outcome] + [o for _, o in pairs]) if o.status != FINISHED]
    if failed:
        raise ReproduceError([f"the re-run failed: {(failed[0].error or '').splitlines()[0]}"])
    orig_tokens = json.loads(tracker.load_text(orig.info.run_id, TOKENS_ARTIFACT))
    tokens_match = orig_tokens == outcome.token_ids
    rows = [("generated token ids", f"{sum(map(len, orig_tokens))} ids", f"{sum(map(len, outcome.token_ids))} ids",
             "MATCH" if tokens_match else "DIFFERS")]
    for p, o in pairs:  # the partners' greedy tokens are as deterministic as the trial's
        same = json.loads(tracker.load_text(p.info.run_id, TOKENS_ARTIFACT)) == o.token_ids
        tokens_match = tokens_match and same
        rows.append((f"token ids of partner {_name(p)}", "", "", "MATCH" if same else "DIFFERS"))
    om = orig.data.metrics
    for k in DETERMINISTIC:
        if k in om or k in outcome.metrics:
            a, b = om.get(k), outcome.metrics.get(k)
            rows.append((k, _num(a), _num(b), deterministic_verdict(a, b)))
    rows += task_rows(tracker, orig, om, outcome)
    loaded = load_flags([("the original", orig.data.tags), ("the reproduction", outcome.labels)])
    partners_loaded = load_flags([(f"partner {_name(p)}{when}", tags) for p, o in pairs
                                  for when, tags in (("", p.data.tags), (" (re-run)", o.labels))])
    for p, o in pairs:  # a group shares one machine: a partner's load is the trial's too
        rows += paired_rows(tracker, orig, p, outcome, o, loaded=bool(loaded or partners_loaded))
    rows += timing_rows(om, outcome.metrics, judged=not missing, loaded=bool(loaded or partners_loaded))
    cmp = Comparison(orig.info.run_id, new_id, stored, tokens_match, rows, why, arrangement=arrangement,
                     partner_run_ids=[new_ids[p.info.run_id] for p, _ in pairs], loaded=loaded + partners_loaded)
    for other in (others if against_all else []):
        try:
            same = json.loads(tracker.load_text(other.info.run_id, TOKENS_ARTIFACT)) == outcome.token_ids
        except Exception:  # noqa: BLE001 -- a run whose artifacts are gone is still judged on its timings
            same = None
        om = other.data.metrics
        like = _kind(om) == _kind(outcome.metrics)
        flags = load_flags([("it", other.data.tags), ("the reproduction", outcome.labels)])
        judged = [f"{k} {v}" for k, _, _, v in timing_rows(om, outcome.metrics, judged=like, loaded=bool(flags))]
        tag = " (a reproduction)" if "reproduces" in other.data.tags else ""
        cmp.others.append((f"run {other.info.run_id[:8]}{tag}, experiment id {other.info.experiment_id}, "
                           f"measured {_kind(om)}",
                           {True: "tokens MATCH", False: "tokens DIFFER", None: "tokens not recorded"}[same], judged))
    return cmp


def _stored_spec(tracker: Tracker, run, tracking: dict) -> TrialSpec:
    """The run's stored config as a spec (tracked where this invocation tracks), its hash checked."""
    config = yaml.safe_load(tracker.load_text(run.info.run_id, CONFIG_ARTIFACT))
    config["tracking"] = tracking  # record where this invocation tracks, not where the original did
    try:
        spec = load_trial(config)
    except SweepError as e:  # the code moved on since the run: say which stored config no longer validates
        raise ReproduceError([f"the stored config of run {run.info.run_id} no longer validates: {p}"
                              for p in e.problems]) from None
    stored = run.data.tags["config_hash"]
    if spec.config_hash != stored:
        raise ReproduceError([f"stored config of run {run.info.run_id[:8]} hashes to {spec.config_hash[:12]}, not "
                              f"{stored[:12]} (hash_version changed?)"])
    return spec


def interleave_partners(tracker: Tracker, orig) -> tuple[list, str]:
    """The runs measured round-robin with `orig` in its interleaved group -- same group id, same sweep (an
    `optimize` pair measured twice is two sweeps) -- and, where the group cannot be had whole, why not
    (`[]`, "" for a trial measured alone)."""
    t = orig.data.tags
    group, size = t.get(GROUP_TAG), int(t.get("env.interleave_size", "1") or 1)
    if not group or size < 2:
        return [], ""
    flt = f"tags.`{GROUP_TAG}` = '{group}' and attributes.status = 'FINISHED'"
    if t.get("sweep_id"):
        flt += f" and tags.sweep_id = '{t['sweep_id']}'"
    runs = tracker.client.search_runs([orig.info.experiment_id], flt, max_results=100)
    partners = [r for r in runs if r.info.run_id != orig.info.run_id and "reproduces" not in r.data.tags]
    if len(partners) != size - 1:
        return [], (f"it ran in interleaved group {group} of {size}, but {len(partners)} of its {size - 1} partner "
                    "run(s) are in the store")
    return partners, ""


def _log(tracker: Tracker, original, spec: TrialSpec, outcome, arrangement: str) -> str:
    """The new run, nested under (and tagged with) the run it reproduces."""
    return tracker.log_trial(
        _exp_name(tracker, original), spec, outcome,
        parent_run_id=original.info.run_id, run_name=f"reproduce: {_name(original)}"[:250],
        extra_tags={"reproduces": original.info.run_id, "reproduces_hash": original.data.tags["config_hash"],
                    "reproduce.arrangement": arrangement})


def _exp_name(tracker: Tracker, run) -> str:
    return tracker.client.get_experiment(run.info.experiment_id).name


def _name(run) -> str:
    return run.info.run_name or run.data.tags.get("config_hash", "")[:12]


def _kind(metrics: dict) -> str:
    """How a run's timings and peak memory were measured: in an interleaved group (its peak_mem_bytes is its
    own footprint, group_peak_mem_bytes the shared process's) or alone (peak_mem_bytes is the process's)."""
    return INTERLEAVED if "group_peak_mem_bytes" in metrics else SOLO


def _rounds(tracker: Tracker, run, k: str) -> list[float]:
    hist = tracker.client.get_metric_history(run.info.run_id, REPEAT_PREFIX + k)
    return [float(x.value) for x in sorted(hist, key=lambda x: x.step)]


def load_flags(runs: list[tuple[str, dict]]) -> list[str]:
    """`"WHO: its unstable label"` for each (who, tags or labels) whose `unstable` label names load."""
    return [f"{who}: {tags[UNSTABLE]}" for who, tags in runs if LOAD in unstable_causes(tags.get(UNSTABLE, ""))]


def paired_rows(tracker: Tracker, orig, partner, outcome, partner_outcome,
                loaded: bool = False) -> list[tuple[str, str, str, str]]:
    """Each timing's paired ratio of the trial over `partner` (> 1: the trial is better), round by round, as
    recorded and as re-measured: consistent when the two 95% intervals overlap; `loaded` (a run of either
    group flagged for load): shown, not judged."""
    rows = []
    for k in TIMINGS:
        rec = paired(_rounds(tracker, partner, k), _rounds(tracker, orig, k), k)
        new = paired(partner_outcome.samples.get(k, []), outcome.samples.get(k, []), k)
        if rec is None and new is None:
            continue
        rows.append((f"{k} paired vs {_name(partner)}", rec.cell() if rec else "-", new.cell() if new else "-",
                     f"{PAIRED} {LOAD_CANNOT_JUDGE if loaded else paired_verdict(rec, new)}"))
    return rows


def paired_verdict(recorded: Optional[Ratio], reproduced: Optional[Ratio]) -> str:
    """A paired ratio re-measured is consistent with the recorded one when their 95% intervals overlap (each
    measurement's own noise widens the other's interval), else it differs beyond noise."""
    if recorded is None or reproduced is None:
        return NO_INTERVAL
    return CONSISTENT if recorded.lo <= reproduced.hi and reproduced.lo <= recorded.hi else DIFFERS_BEYOND_NOISE


def paired(base: list[float], new: list[float], k: str) -> Optional[Ratio]:
    if not base or len(base) != len(new):
        return None
    return paired_ratio(base, new, higher_is_better=k not in LOWER_IS_BETTER)


def timing_rows(om: dict, nm: dict, judged: bool = True, loaded: bool = False) -> list[tuple[str, str, str, str]]:
    """The absolute timings (and peak memory, between measurements of one kind only); `loaded` (either run
    flagged for load): the timings shown, not judged -- memory, which other processes' load does not move, still is."""
    rows = []
    same_kind = _kind(om) == _kind(nm)
    for k in TIMING:
        if not (k in om and k in nm and om[k]):
            continue
        if k == "peak_mem_bytes" and not same_kind:
            rows.append((k, _num(om[k]), _num(nm[k]), f"not compared: the original's is {MEM_KIND[_kind(om)]}, "
                                                       f"the reproduction's {MEM_KIND[_kind(nm)]}"))
        elif not judged or not same_kind:
            rows.append((k, _num(om[k]), _num(nm[k]), f"x{nm[k] / om[k]:.2f} {NOT_JUDGED}"))
        elif loaded and k != "peak_mem_bytes":
            rows.append((k, _num(om[k]), _num(nm[k]), f"x{nm[k] / om[k]:.2f} {LOAD_CANNOT_JUDGE}"))
        else:
            rows.append((k, _num(om[k]), _num(nm[k]), timing_verdict(k, om, nm)))
    if same_kind and _kind(om) == INTERLEAVED and om.get("group_peak_mem_bytes") and "group_peak_mem_bytes" in nm:
        k = "group_peak_mem_bytes"
        rows.append((k, _num(om[k]), _num(nm[k]), timing_verdict(k, om, nm)))
    return rows


MEM_KIND = {INTERLEAVED: "a variant's own footprint in an interleaved group", SOLO: "a solo process's peak"}


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
NOT_JUDGED = "not judged (measured differently)"
LOAD_CANNOT_JUDGE = "load: cannot judge"  # a run flagged `unstable: load` never decides a comparison (docs/metrics.md)
PAIRED = "paired:"


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
    if c.why_original:
        lines.append(c.why_original)
    if c.arrangement:
        lines.append(f"arrangement: {c.arrangement}")
    for i, r in enumerate(rows):
        lines.append("  ".join(x.ljust(w[j]) for j, x in enumerate(r)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * x for x in w))
    verdict = "deterministic results MATCH" if c.deterministic_match else "deterministic results DIFFER"
    lines.append(verdict)
    paired_v = [v for *_, v in c.rows if v.startswith(PAIRED)]
    if paired_v:
        judged = {w: sum(t.endswith(w) for t in paired_v)
                  for w in (CONSISTENT, DIFFERS_BEYOND_NOISE, NO_INTERVAL, LOAD_CANNOT_JUDGE)}
        lines.append("paired ratios (trial vs partner, round by round; reproduced vs recorded, judged by their 95% "
                     "intervals): " + ", ".join(f"{n} {w}" for w, n in judged.items() if n))
    timings = [v for *_, v in c.rows if v.startswith("x")]
    judged = {w: sum(t.endswith(w) for t in timings)
              for w in (CONSISTENT, DIFFERS_BEYOND_NOISE, NO_INTERVAL, NOT_JUDGED, LOAD_CANNOT_JUDGE)}
    lines.append("timings (reproduced/original, judged by both runs' 95% intervals): "
                 + ", ".join(f"{n} {w}" for w, n in judged.items() if n))
    for flag in c.loaded:
        lines.append(f"flagged for load, so its timings decide no comparison: {flag}")
    if c.others:
        lines.append(f"against the {len(c.others)} other run(s) with this hash:")
        for who, tokens, judged_timings in c.others:
            lines.append(f"  {who}: {tokens}; " + ("; ".join(judged_timings) or "no timings"))
    return "\n".join(lines)
