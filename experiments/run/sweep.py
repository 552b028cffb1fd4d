"""A sweep end to end: expand + validate -> dispatch on a worker pool -> record in MLflow -> table.

The pool is Ray's actors, or one worker in this process (`--in-process`); either way the cluster layer's
dispatcher places the trials, so retries, KILLED on Ctrl-C and `on_start` mean the same (cluster/local_pool.py
says what one process cannot do: retry after a crash of itself). The driver (this module) is the only writer
to the tracking store: workers return plain `TrialOutcome`s, and each trial becomes exactly one terminal
MLflow run here (`SweepRecorder`), after its retries are settled. A sweep that runs again skips the hashes
that already have a FINISHED run in its experiment (resume; `force` re-runs).
"""
from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Optional

from ..config.compose import expand
from ..config.spec import TrialSpec, model_key
from ..analysis.summary import table
from .trial import FAILED, FINISHED, TrialOutcome, WarmModels, execute_trial

log = logging.getLogger(__name__)

SKIPPED, KILLED = "SKIPPED", "KILLED"


@dataclass
class SweepResult:
    sweep_id: str
    sweep_name: str
    parent_run_id: Optional[str]
    tracking_uri: str
    rows: list[dict] = field(default_factory=list)
    skipped: int = 0  # trials already FINISHED in the store (resume)
    spooled: int = 0  # results waiting in the spool (store unreachable)
    spool_dir: str = ""
    wall_s: float = 0.0
    store_uri: str = ""  # the store behind tracking_uri (differs when the sweep served it over HTTP)

    @property
    def failed(self) -> list[dict]:
        return [r for r in self.rows if r["status"] not in (FINISHED, SKIPPED)]


def _outcome_from_failure(spec: TrialSpec, error: str, status: str = FAILED) -> TrialOutcome:
    now = int(time.time() * 1000)
    return TrialOutcome(config_hash=spec.config_hash, index=spec.index, status=status, error=error, start_ms=now, end_ms=now)


def _row(spec: TrialSpec, outcome: Optional[TrialOutcome], status: str, run_id: Optional[str]) -> dict[str, Any]:
    err = (outcome.error or "") if outcome else ""
    return {
        "hash": spec.short_hash,
        "swept": spec.swept,
        "metrics": outcome.metrics if outcome else {},
        "status": status,
        "error": err.splitlines()[0] if err else "",
        "run_id": run_id,
        "outcome": outcome,
    }


# where a worker ran, from the dispatcher's meta: kept with the outcome (tags env.*)
WORKER_INFO = ("node_id", "worker_pid", "gpu_ids")


class SweepRecorder:
    """Turns each trial's final result (an outcome, or the cluster layer's `TaskFailure`) into its one
    terminal MLflow run (or spooled record) and its row of the results table."""

    def __init__(self, rec, sweep_name: str, sweep_id: str, extra_tags: Optional[dict[str, str]] = None):
        self._rec, self._sweep_name, self._sweep_id, self._extra_tags = rec, sweep_name, sweep_id, extra_tags
        self.parent_run_id: Optional[str] = None  # the sweep's parent run, once started (multi-trial sweeps)
        self._rows: dict[int, dict] = {}

    def skip(self, spec: TrialSpec) -> None:
        """A trial left out because its hash already FINISHED (resume): a row, no run."""
        self._rows[spec.index] = _row(spec, None, SKIPPED, None)

    def record(self, spec: TrialSpec, outcome: Any, meta: Optional[dict[str, Any]] = None) -> bool:
        """Log `spec`'s final result; `meta` = the dispatcher's {attempts, errors, node_id, ...}. True when
        the trial FINISHED."""
        from cluster import CANCELLED, TaskFailure

        meta = meta or {}
        if isinstance(outcome, TaskFailure):
            outcome = _outcome_from_failure(spec, outcome.error, KILLED if outcome.kind == CANCELLED else FAILED)
        outcome.attempts = max(1, int(meta.get("attempts", 1)))
        outcome.attempt_errors = [e for e in meta.get("errors", []) if e != "interrupted"]
        outcome.info.update({k: str(meta[k]) for k in WORKER_INFO if meta.get(k) not in (None, "")})
        run_id = self._rec.log_trial(self._sweep_name, spec, outcome, self.parent_run_id, self._sweep_id,
                                     self._extra_tags)
        self._rec.done_running(self._sweep_id, spec.index)
        self._rows[spec.index] = _row(spec, outcome, outcome.status, run_id)
        return outcome.status == FINISHED

    def rows(self) -> list[dict]:
        """The rows in trial order, run ids resolved (call after the recorder's writers are flushed)."""
        for r in self._rows.values():
            if isinstance(r["run_id"], Future):
                r["run_id"] = r["run_id"].result()
        return [self._rows[i] for i in sorted(self._rows)]


def _affinity_key(spec: TrialSpec) -> Optional[str]:
    """Trials with one key can share a worker's loaded model (None: never shared)."""
    return model_key(spec.config) if spec.cluster.warm_workers else None


def _left_to_run(rec, specs: list[TrialSpec], sweep_name: str, recorder: SweepRecorder, echo) -> list[TrialSpec]:
    """Resume: the specs whose hash has no FINISHED run in the sweep's experiment yet (the others get a
    SKIPPED row)."""
    done = rec.finished_hashes(sweep_name)
    for s in specs:
        if s.config_hash in done:
            recorder.skip(s)
    todo = [s for s in specs if s.config_hash not in done]
    if len(todo) < len(specs):
        echo(f"skipping {len(specs) - len(todo)} trial(s) already FINISHED in '{sweep_name}' (--force re-runs them)")
    return todo


def _dispatch(todo: list[TrialSpec], cluster, in_process: bool, recorder: SweepRecorder, desc: str,
              on_start=None) -> None:
    """Every trial of `todo` on a worker pool, each recorded once: Ray actors (connecting as `cluster`, the
    sweep's `ClusterConfig`, says), or (`in_process`) one worker in this process; both through the cluster
    layer's dispatcher (affinity, retries, KILLED on Ctrl-C, ...)."""
    from cluster import Job, ensure_ray, run_in_process, run_on_ray

    if in_process:
        run = run_in_process
    else:
        ensure_ray(cluster)
        run = run_on_ray
    if cluster.interleave:
        _dispatch_interleaved(run, todo, cluster, recorder, desc, on_start)
        return
    job = Job(todo, placement_for=lambda s: s.cluster.placement(), on_result=recorder.record, key_for=_affinity_key,
              desc=desc, placement_timeout_s=float(cluster.placement_timeout_s), on_start=on_start)
    run(execute_trial, job, worker_state=WarmModels)  # each worker keeps its own last model


def interleave_groups(specs: list[TrialSpec]) -> list[tuple[TrialSpec, ...]]:
    """The variants to measure round-robin: specs equal on everything but the optimization axes (the
    workload, model, seed, ...), in sweep order."""
    from engine.axes import is_optimization_key

    from ..tracking.store import flatten

    groups: dict[str, list[TrialSpec]] = {}
    for s in specs:
        flat = flatten({k: v for k, v in s.config.items() if k not in ("cluster", "tracking", "sweep_name")})
        key = "|".join(f"{k}={v}" for k, v in sorted(flat.items()) if not is_optimization_key(k))
        groups.setdefault(key, []).append(s)
    return [tuple(g) for g in groups.values()]


def _dispatch_interleaved(run, todo: list[TrialSpec], cluster, recorder: SweepRecorder, desc: str, on_start) -> None:
    """`cluster.interleave`: each group of variants is one task on one worker, measured round-robin; its
    outcomes are recorded one per trial, as any other trial's."""
    from cluster import Job, TaskFailure

    from .trial import execute_interleaved

    def record_group(group, result, meta) -> bool:
        outcomes = result if not isinstance(result, TaskFailure) else [result] * len(group)
        return all([recorder.record(s, o, meta) for s, o in zip(group, outcomes)])

    job = Job(interleave_groups(todo), placement_for=lambda g: g[0].cluster.placement(), on_result=record_group,
              desc=f"{desc} (interleaved groups)", placement_timeout_s=float(cluster.placement_timeout_s),
              on_start=(lambda g, meta: [on_start(s, meta) for s in g]) if on_start else None)
    run(execute_interleaved, job, worker_state=WarmModels)


def run_specs(
    specs: list[TrialSpec],
    command: str,
    in_process: bool = False,
    extra_tags: Optional[dict[str, str]] = None,
    echo=print,
    skip_finished: bool = False,
    on_start=None,
    parent_run_id: Optional[str] = None,
    on_interrupt=None,
) -> SweepResult:
    """Run and record `specs`. `skip_finished`: leave out hashes already FINISHED in the experiment
    (resume). `on_start(spec, meta)` is called as each trial is handed to a worker. `parent_run_id`: nest the
    trials under that run (an `optimize` run, which owns its lifetime) instead of a sweep run of their own.
    `on_interrupt(result)`: called with what was recorded when Ctrl-C / `kill` ends the run (then it re-raises)."""
    from engine.served.process import reap_orphans

    from ..tracking.spool import Recorder
    from ..tracking.store import sweep_record
    from ..tracking.server import redact, serving

    reap_orphans(echo)  # servers a SIGKILLed sweep's trials left running (engine/served/process.py)
    first = specs[0].config
    sweep_name = first["sweep_name"]
    sweep_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
    t0 = time.perf_counter()
    with serving(first["tracking"], echo=echo) as tracking:
        rec = Recorder(tracking, echo=echo)
        result = SweepResult(sweep_id, sweep_name, None, rec.uri, spool_dir=str(rec.spool.root),
                             store_uri=redact(str(first["tracking"]["uri"]) if first["tracking"].get("serve") else rec.uri))
        recorder = SweepRecorder(rec, sweep_name, sweep_id, extra_tags)
        own = parent_run_id is None
        if own:  # an `optimize` run reaped its experiment when it started
            rec.reap_stale_sweeps(sweep_name)
        todo = _left_to_run(rec, specs, sweep_name, recorder, echo) if skip_finished else specs
        result.skipped = len(specs) - len(todo)
        sweep_rec = sweep_record(sweep_name, sweep_id, specs, command)
        parent = None if own else parent_run_id
        status = FINISHED

        def started(spec: TrialSpec, meta: dict[str, Any]) -> None:  # noted, for a SIGKILLed driver's successor
            rec.note_running(sweep_name, spec, parent, sweep_id, extra_tags)
            if on_start is not None:
                on_start(spec, meta)

        try:  # the parent run is made inside: an interrupt while it is written still ends it KILLED below
            if own and len(specs) > 1 and todo:
                parent = rec.start_sweep(sweep_rec)
            result.parent_run_id = recorder.parent_run_id = parent
            if todo:
                _dispatch(todo, specs[0].cluster, in_process, recorder, sweep_name, started)
        except KeyboardInterrupt:
            status = KILLED
            from engine.served.process import reap_after_interrupt

            reap_after_interrupt(echo)  # servers of trials whose workers were killed mid-trial (served engines)
            raise
        finally:
            rec.flush()  # writer threads: every result is in the store or the spool from here on
            result.rows = recorder.rows()
            if own and (parent is not None or rec.spool.read_sweep(sweep_id) is not None):
                if status == FINISHED and any(r["status"] not in (FINISHED, SKIPPED) for r in result.rows):
                    status = FAILED
                rec.end_sweep(sweep_rec, parent, status, int(time.time() * 1000))
            rec.done_running(sweep_id)
            rec.close()
            result.spooled = rec.spooled
            result.wall_s = time.perf_counter() - t0
            if status == KILLED and on_interrupt is not None:
                on_interrupt(result)
    return result


def run_sweep(overrides: list[str], in_process: bool = False, echo=print, force: bool = False) -> SweepResult:
    specs = expand(overrides)
    command = "infersweep sweep " + " ".join(overrides)
    echo(f"{len(specs)} trial(s) validated; sweep '{specs[0].config['sweep_name']}'")
    def interrupted(res: SweepResult) -> None:  # what finished before Ctrl-C, as the table a finished sweep prints
        if res.rows:
            echo("\n" + table(res.rows))

    res = run_specs(specs, command, in_process=in_process, echo=echo, skip_finished=not force,
                    on_interrupt=interrupted)
    echo("")
    echo(table(res.rows))
    for r in res.failed:
        echo(f"FAILED {r['hash']}: {r['error']}" if r["status"] == FAILED else f"{r['status']} {r['hash']}: {r['error']}")
    if res.spooled:
        echo(f"\n{res.spooled} result(s) could not reach {res.tracking_uri} and wait in {res.spool_dir};"
             " upload them with `infersweep sync` (same tracking overrides)")
    return res
