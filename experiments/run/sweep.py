"""A sweep end to end: expand + validate -> place on Ray (or run in-process) -> record in MLflow -> table.

The driver (this module) is the only writer to the tracking store: workers return plain `TrialOutcome`s,
and each trial becomes exactly one terminal MLflow run here, after its retries are settled. A sweep that
runs again skips the hashes that already have a FINISHED run in its experiment (resume; `force` re-runs).
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


def run_specs(
    specs: list[TrialSpec],
    command: str,
    in_process: bool = False,
    extra_tags: Optional[dict[str, str]] = None,
    echo=print,
    skip_finished: bool = False,
    on_start=None,
) -> SweepResult:
    """Run and record `specs`. `skip_finished`: leave out hashes already FINISHED in the experiment
    (resume). `on_start(spec, meta)` is called as each trial is handed to a worker (Ray only)."""
    from ..tracking.spool import Recorder
    from ..tracking.store import sweep_record
    from ..tracking.server import redact, serving

    first = specs[0].config
    sweep_name = first["sweep_name"]
    sweep_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
    t0 = time.perf_counter()
    with serving(first["tracking"], echo=echo) as tracking:
        rec = Recorder(tracking, echo=echo)
        result = SweepResult(sweep_id, sweep_name, None, rec.uri, spool_dir=str(rec.spool.root),
                             store_uri=redact(str(first["tracking"]["uri"]) if first["tracking"].get("serve") else rec.uri))
        rows: dict[int, dict] = {}
        todo = specs
        if skip_finished:
            rec.reap_stale_sweeps(sweep_name)
            done = rec.finished_hashes(sweep_name)
            todo = [s for s in specs if s.config_hash not in done]
            for s in specs:
                if s.config_hash in done:
                    rows[s.index] = _row(s, None, SKIPPED, None)
            result.skipped = len(specs) - len(todo)
            if result.skipped:
                echo(f"skipping {result.skipped} trial(s) already FINISHED in '{sweep_name}' (--force re-runs them)")
        sweep_rec = sweep_record(sweep_name, sweep_id, specs, command)
        parent = rec.start_sweep(sweep_rec) if len(specs) > 1 and todo else None
        result.parent_run_id = parent

        def record(spec: TrialSpec, outcome, meta: Optional[dict[str, Any]] = None) -> bool:
            from cluster import CANCELLED, TaskFailure

            meta = meta or {}
            status = FAILED
            if isinstance(outcome, TaskFailure):
                status = KILLED if outcome.kind == CANCELLED else FAILED
                outcome = _outcome_from_failure(spec, outcome.error, status)
            outcome.attempts = max(1, int(meta.get("attempts", 1)))
            outcome.attempt_errors = [e for e in meta.get("errors", []) if e != "interrupted"]
            outcome.info.update({k: str(meta[k]) for k in ("node_id", "worker_pid", "gpu_ids") if meta.get(k) not in (None, "")})
            run_id = rec.log_trial(sweep_name, spec, outcome, parent, sweep_id, extra_tags)
            rows[spec.index] = _row(spec, outcome, outcome.status, run_id)
            return outcome.status == FINISHED

        status = "FINISHED"
        try:
            if not todo:
                pass
            elif in_process:
                from tqdm.auto import tqdm

                warm = WarmModels()  # the driver is the only worker here
                try:
                    for spec in tqdm(todo, desc=sweep_name, unit="trial", disable=len(todo) == 1):
                        try:
                            outcome = execute_trial(spec, warm)
                        except KeyboardInterrupt:
                            record(spec, _outcome_from_failure(spec, "interrupted (KeyboardInterrupt)", KILLED))
                            raise
                        record(spec, outcome)
                finally:
                    warm.release()
            else:
                from cluster import ensure_ray, placement, run_on_ray

                ensure_ray(first["cluster"])
                run_on_ray(
                    execute_trial,
                    todo,
                    placement_for=lambda s: placement(s.config["cluster"]),
                    on_result=record,
                    key_for=lambda s: model_key(s.config) if s.config["cluster"].get("warm_workers", True) else None,
                    desc=sweep_name,
                    placement_timeout_s=float(first["cluster"].get("placement_timeout_s", 600)),
                    on_start=(lambda s, meta: on_start(s, meta)) if on_start else None,
                    worker_state=WarmModels,  # each worker keeps its own last model
                )
        except KeyboardInterrupt:
            status = KILLED
            raise
        finally:
            rec.flush()  # writer threads: every result is in the store or the spool from here on
            for r in rows.values():
                if isinstance(r["run_id"], Future):
                    r["run_id"] = r["run_id"].result()
            result.rows = [rows[i] for i in sorted(rows)]
            if parent is not None or (rec.spool.read_sweep(sweep_id) is not None):
                if status == "FINISHED" and any(r["status"] not in (FINISHED, SKIPPED) for r in result.rows):
                    status = "FAILED"
                rec.end_sweep(sweep_rec, parent, status, int(time.time() * 1000))
            rec.close()
            result.spooled = rec.spooled
            result.wall_s = time.perf_counter() - t0
    return result


def run_sweep(overrides: list[str], in_process: bool = False, echo=print, force: bool = False) -> SweepResult:
    specs = expand(overrides)
    command = "infersweep sweep " + " ".join(overrides)
    echo(f"{len(specs)} trial(s) validated; sweep '{specs[0].config['sweep_name']}'")
    res = run_specs(specs, command, in_process=in_process, echo=echo, skip_finished=not force)
    echo("")
    echo(table(res.rows))
    for r in res.failed:
        echo(f"FAILED {r['hash']}: {r['error']}" if r["status"] == FAILED else f"{r['status']} {r['hash']}: {r['error']}")
    if res.spooled:
        echo(f"\n{res.spooled} result(s) could not reach {res.tracking_uri} and wait in {res.spool_dir};"
             " upload them with `infersweep sync` (same tracking overrides)")
    return res
