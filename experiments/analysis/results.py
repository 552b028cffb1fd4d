"""Recorded trials read back from MLflow as plain rows (what reports, advice and claims work on).

A reference names what to read:
- an experiment (= sweep) name: every trial run in it, the newest FINISHED run per config hash, so a
  resumed sweep (which only runs what is missing) reads as one;
- a sweep id (or a unique prefix of one) or a parent run id: exactly that sweep's trials.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from engine import axes as axis_registry
from engine.measure.noise import LOAD, SPREAD, UNSTABLE, unstable_causes
from engine.measure.spread import LOWER_IS_BETTER
from engine.measure.spread import Ratio, paired_ratio, ratio, spread_of

from ..tracking.store import PARENT_TAG

CONTEXT = "workload.context_len"
INTERLEAVE_TAG = "env.interleave_group"  # trials measured round-robin on one worker (cluster.interleave)
PAIRED_METRICS = ("output_tok_s", "decode_tok_s", "prefill_tok_s")  # the speedups' timings, read by round
# Params that differ between trials without being a measured axis.
IGNORED_PARAMS = ("sweep_name",)


@dataclass
class TrialRow:
    run_id: str
    name: str
    status: str
    params: dict[str, str]
    metrics: dict[str, float]
    tags: dict[str, str]
    start_ms: int = 0
    repeats: dict[str, list[float]] = field(default_factory=dict)  # interleaved trials: metric -> value by round

    @property
    def hash(self) -> str:
        return self.tags.get("config_hash", "")[:12]

    @property
    def finished(self) -> bool:
        return self.status == "FINISHED"

    def num(self, key: str) -> Optional[float]:
        v = self.metrics.get(key)
        return None if v is None else float(v)

    def int_param(self, key: str) -> Optional[int]:
        try:
            return int(self.params[key])
        except (KeyError, ValueError):
            return None

    @property
    def context_len(self) -> Optional[int]:
        return self.int_param(CONTEXT)

    @property
    def batch_size(self) -> int:
        return self.int_param("workload.batch_size") or 1

    @property
    def device(self) -> str:
        return self.tags.get("env.device", "cpu")

    def hardware(self) -> str:
        """What the trial ran on, in one line: device name, threads (CPU), and the roofline peaks."""
        name = self.tags.get("env.device_name") or self.tags.get("env.cpu") or "?"
        parts = [name]
        if self.device.startswith("cpu") and self.tags.get("env.torch_threads"):
            n = self.tags["env.torch_threads"]
            parts.append(f"{n} thread{'' if n == '1' else 's'}")
        bw, fl = self.num("hw_mem_bw"), self.num("hw_flops")
        if bw and fl:
            parts.append(f"{bw / 1e9:.0f} GB/s, {fl / 1e9:.0f} GFLOP/s")
        return ", ".join(parts)


@dataclass
class Selection:
    """The trials a reference names, and where the sweep's plots and tables go."""

    ref: str
    experiment: str
    experiment_id: str
    rows: list[TrialRow] = field(default_factory=list)
    sweep_ids: list[str] = field(default_factory=list)
    parent_run_id: Optional[str] = None  # the sweep run that report artifacts are logged to

    @property
    def finished(self) -> list[TrialRow]:
        return [r for r in self.rows if r.finished]


class NotFound(LookupError):
    pass


def _row(run) -> TrialRow:
    return TrialRow(
        run_id=run.info.run_id,
        name=run.data.tags.get("swept") or run.info.run_name or run.data.tags.get("mlflow.runName", ""),  # key=value
        status=run.info.status,
        params=dict(run.data.params),
        metrics=dict(run.data.metrics),
        tags=dict(run.data.tags),
        start_ms=int(run.info.start_time or 0),
    )


def _search(client, exp_ids: list[str], flt: str, order: Optional[list[str]] = None) -> list:
    out, token = [], None
    while True:
        page = client.search_runs(exp_ids, filter_string=flt, order_by=order, max_results=1000, page_token=token)
        out.extend(page)
        token = page.token
        if not token:
            return out


def _q(s: str) -> str:
    return str(s).replace("'", "")


def newest_per_hash(rows: Iterable[TrialRow]) -> list[TrialRow]:
    """One row per config hash: the newest FINISHED run, else the newest run (a trial that only failed)."""
    best: dict[str, TrialRow] = {}
    for r in sorted(rows, key=lambda r: r.start_ms):
        h = r.tags.get("config_hash", r.run_id)
        cur = best.get(h)
        if cur is None or r.finished or not cur.finished:
            best[h] = r
    return sorted(best.values(), key=lambda r: (int(r.tags.get("trial_index", 0) or 0), r.start_ms))


def _planned_hashes(client, parent_run_id: str) -> Optional[set[str]]:
    """Short config hashes a sweep planned (its `trials.txt`: one `HASH label` line per trial)."""
    import tempfile

    try:
        with tempfile.TemporaryDirectory() as tmp:
            text = Path(client.download_artifacts(parent_run_id, "trials.txt", tmp)).read_text()
    except Exception:  # an older sweep run without the artifact
        return None
    hashes = {line.split()[0] for line in text.splitlines() if line.strip()}
    return hashes if hashes and len({len(h) for h in hashes}) == 1 else None


def load(client, ref: str, all_trials: bool = False) -> Selection:
    """`_load`, plus the per-round values of the trials measured round-robin (their comparisons pair rounds)."""
    from ..tracking.store import REPEAT_PREFIX

    sel = _load(client, ref, all_trials)
    for r in sel.rows:
        if r.finished and r.tags.get(INTERLEAVE_TAG):
            for m in PAIRED_METRICS:
                hist = sorted(client.get_metric_history(r.run_id, REPEAT_PREFIX + m), key=lambda x: x.step)
                if hist:
                    r.repeats[m] = [float(x.value) for x in hist]
    return sel


def _load(client, ref: str, all_trials: bool = False) -> Selection:
    """Resolve `ref` (experiment name, sweep id or its prefix, parent run id) into its trial rows.

    For an experiment name: the trials the latest sweep planned, newest FINISHED run per hash (a resumed
    sweep skips what already finished, so those come from earlier sweeps); `all_trials`: every config
    ever run in the experiment."""
    from mlflow.entities import ViewType

    exp = client.get_experiment_by_name(ref)
    if exp is not None:
        sweeps = _search(client, [exp.experiment_id], "tags.kind = 'sweep'", ["attributes.start_time DESC"])
        runs = list(map(_row, _search(client, [exp.experiment_id], "tags.kind = 'trial'")))
        planned = _planned_hashes(client, sweeps[0].info.run_id) if sweeps and not all_trials else None
        if planned:  # the latest sweep's plan; trials it skipped as already FINISHED come from earlier sweeps
            runs = [r for r in runs if r.tags.get("config_hash", "")[:len(next(iter(planned)))] in planned]
        sel = Selection(ref, exp.name, exp.experiment_id, newest_per_hash(runs))
        sel.parent_run_id = sweeps[0].info.run_id if sweeps else None
        sel.sweep_ids = sorted({r.tags["sweep_id"] for r in sel.rows if r.tags.get("sweep_id")})
        if not sel.rows:
            raise NotFound(f"experiment {ref!r} has no trial runs")
        return sel
    exps = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ACTIVE_ONLY)]
    names = {e.experiment_id: e.name for e in client.search_experiments(view_type=ViewType.ACTIVE_ONLY)}
    if not exps:
        raise NotFound("the tracking store has no experiments")
    parent = None
    if re.fullmatch(r"[0-9a-f]{32}", ref):
        try:
            run = client.get_run(ref)
            if run.data.tags.get("kind") == "sweep":
                parent, sweep_id = run, run.data.tags["sweep_id"]
        except Exception:
            run = None
    if parent is None:
        sweeps = _search(client, exps, f"tags.kind = 'sweep' and tags.sweep_id LIKE '{_q(ref)}%'")
        ids = sorted({s.data.tags["sweep_id"] for s in sweeps})
        if not ids:  # a single-trial sweep has no parent run
            trials = _search(client, exps, f"tags.kind = 'trial' and tags.sweep_id LIKE '{_q(ref)}%'")
            ids = sorted({t.data.tags["sweep_id"] for t in trials})
        if not ids:
            raise NotFound(f"no experiment, sweep id or sweep run matches {ref!r}")
        if len(ids) > 1:
            raise NotFound(f"{ref!r} matches {len(ids)} sweeps ({', '.join(ids[:5])}); give more of the id")
        sweep_id = ids[0]
        parent = sweeps[0] if sweeps else None
    exp_id = parent.info.experiment_id if parent else None
    runs = _search(client, [exp_id] if exp_id else exps, f"tags.kind = 'trial' and tags.sweep_id = '{_q(sweep_id)}'")
    if parent is not None:  # trials linked only by parent (e.g. logged by an older driver)
        seen = {r.info.run_id for r in runs}
        runs += [r for r in _search(client, [exp_id], f"tags.{PARENT_TAG} = '{parent.info.run_id}'")
                 if r.info.run_id not in seen and r.data.tags.get("kind") == "trial"]
    if not runs:
        raise NotFound(f"sweep {sweep_id} has no trial runs")
    exp_id = exp_id or runs[0].info.experiment_id
    sel = Selection(ref, names.get(exp_id, exp_id), exp_id, newest_per_hash(map(_row, runs)), [sweep_id])
    sel.parent_run_id = parent.info.run_id if parent else None
    return sel


def axes(rows: list[TrialRow]) -> list[str]:
    """Param keys whose value differs between the rows (the sweep's measured axes), in a stable order."""
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r.params if k not in keys]
    out = [k for k in keys if k not in IGNORED_PARAMS and len({r.params.get(k) for r in rows}) > 1]
    return sorted(out, key=lambda k: (not is_opt_axis(k), k))


def is_opt_axis(key: str) -> bool:
    """An optimization's key (the rest of a trial -- model, workload, eval -- is "the workload")."""
    return axis_registry.is_optimization_key(key)


def speedup(base: Optional[float], new: Optional[float]) -> Optional[float]:
    """new / base: how many times faster `new` is (None when either is missing or base is 0)."""
    return new / base if base and new is not None else None


def compare(base: Optional[TrialRow], new: Optional[TrialRow], metric: str) -> Optional[Ratio]:
    """How many times better `new` is than `base` on timing `metric` (a rate: new/base; a time: base/new),
    with the 95% interval from both trials' logged intervals and the verdict faster / slower / within noise
    (engine/measure/spread.py). None where either trial has no interval for it."""
    if base is None or new is None:
        return None
    group = base.tags.get(INTERLEAVE_TAG)
    if group and group == new.tags.get(INTERLEAVE_TAG):  # measured round-robin: pair the rounds
        a_rounds, b_rounds = base.repeats.get(metric), new.repeats.get(metric)
        if a_rounds and b_rounds and len(a_rounds) == len(b_rounds):
            return paired_ratio(a_rounds, b_rounds, higher_is_better=metric not in LOWER_IS_BETTER)
    a, b = spread_of(base.metrics, metric), spread_of(new.metrics, metric)
    if a is None or b is None:
        return None
    return ratio(a, b, higher_is_better=metric not in LOWER_IS_BETTER)


# --- which trials may decide a comparison -----------------------------------------------------------------
# A trial labelled `unstable` for machine LOAD never decides: other processes biased its medians, and its
# interval does not carry that bias. One labelled for SPREAD only decides where the intervals separate
# (its wide interval is in the comparison's). engine/measure/noise.py names the causes.
NOT_DECIDABLE = "not decidable"
WHAT_TO_DO = ("rerun on a quieter machine, with more repeats (`timing.max_repeats`, `timing.target_ci`), or with "
              "`cluster.interleave=N` (the variants take turns, so drift hits each alike)")


def causes(row: TrialRow) -> set[str]:
    """{LOAD, SPREAD} that the row's `unstable` label names (empty for a stable trial)."""
    return unstable_causes(row.tags.get(UNSTABLE, ""))


def loaded(row: TrialRow) -> bool:
    """Measured under machine load: the row never decides a comparison."""
    return LOAD in causes(row)


def fit_to_decide(rows: Iterable[TrialRow]) -> list[TrialRow]:
    return [r for r in rows if not loaded(r)]


def _hashes(rows: Iterable[TrialRow]) -> str:
    return ", ".join(r.hash[:8] for r in rows)


def rule_verdict(verdict: str, rows: Iterable[TrialRow], decided: bool = True) -> str:
    """`verdict`, drawn from `rows`, under the stability rule: NOT_DECIDABLE with the load-flagged trials
    when any is; with the spread-flagged trials named -- and, where `decided` (its interval excludes x1),
    that the intervals separate -- when any is; else unchanged."""
    rows = list(rows)
    bad = [r for r in rows if loaded(r)]
    if bad:
        return f"{NOT_DECIDABLE} (unstable: load: {_hashes(bad)})"
    wide = [r for r in rows if SPREAD in causes(r)]
    if not wide:
        return verdict
    return verdict + f" (unstable: spread: {_hashes(wide)}" + ("; decided: the intervals separate)" if decided else ")")


def unstable_note(rows: Iterable[TrialRow]) -> str:
    """'' or ' (unstable: spread: HASH, ...)' / ' (unstable: load: HASH, ...)' for the rows so labelled."""
    rows = list(rows)
    parts = [f"unstable: {c}: {_hashes(r for r in rows if c in causes(r))}" for c in (LOAD, SPREAD)
             if any(c in causes(r) for r in rows)]
    return f" ({'; '.join(parts)})" if parts else ""


def workload_key(row: TrialRow, ax: list[str]) -> tuple[tuple[str, str], ...]:
    """The row's values of the non-optimization axes: trials with equal keys ran the same workload."""
    return tuple((k, row.params.get(k, "")) for k in ax if not is_opt_axis(k))


def describe(key: tuple[tuple[str, str], ...]) -> str:
    return " ".join(f"{k}={v}" for k, v in key) or "all trials"


# workload axes a label keeps longest (the ones a reader thinks in)
LABEL_PREFERENCE = ("workload.context_len", "workload.name", "workload.prompt_style", "workload.batch_size",
                    "workload.rate", "workload.num_requests", "workload.max_new_tokens")


def workload_labeler(keys: Iterable[tuple[tuple[str, str], ...]]) -> Callable[[tuple[tuple[str, str], ...]], str]:
    """key -> a short label naming only the axes needed to tell this sweep's workloads apart.

    Claim-point sweeps vary many workload keys together (a serving workload changes kind, arrival, lengths
    and eval at once); every axis whose value follows from the others is dropped, least familiar first."""
    keys = sorted(set(keys))
    cols = list(dict.fromkeys(k for key in keys for k, _ in key))
    rank = {c: (LABEL_PREFERENCE.index(c) if c in LABEL_PREFERENCE else len(LABEL_PREFERENCE)) for c in cols}
    keep = list(cols)

    def project(key, cs):
        d = dict(key)
        return tuple((c, d.get(c, "")) for c in cs)

    for c in sorted(cols, key=lambda c: (-rank[c], -cols.index(c))):
        rest = [k for k in keep if k != c]
        if len({project(k, rest) for k in keys}) == len(keys):
            keep = rest
    return lambda key: describe(project(key, [c for c in cols if c in keep]))


def opt_label(row: TrialRow, ax: list[str]) -> str:
    """The row's optimization settings on the swept optimization axes (short keys)."""
    parts = [f"{axis_registry.short_key(k)}={row.params.get(k, '')}" for k in ax if is_opt_axis(k)]
    return " ".join(parts) or row.name


def counterpart(rows: list[TrialRow], row: TrialRow, changes: dict[str, Any], ax: Optional[list[str]] = None) -> Optional[TrialRow]:
    """The finished row equal to `row` on every axis except `changes` (key -> value, or a predicate)."""
    ax = ax if ax is not None else axes(rows)
    for r in rows:
        if not r.finished:
            continue
        if any(r.params.get(k) != row.params.get(k) for k in ax if k not in changes):
            continue
        if all((v(r.params.get(k)) if callable(v) else r.params.get(k) == str(v)) for k, v in changes.items()):
            return r
    return None
