"""A sweep end to end: expand + validate -> place on Ray (or run in-process) -> record in MLflow -> table."""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

from .compose import expand
from .spec import TrialSpec
from .summary import table
from .trial import FAILED, FINISHED, TrialOutcome, execute_trial
from .tracking import Tracker

log = logging.getLogger(__name__)


@dataclass
class SweepResult:
    sweep_id: str
    sweep_name: str
    parent_run_id: Optional[str]
    tracking_uri: str
    rows: list[dict] = field(default_factory=list)

    @property
    def failed(self) -> list[dict]:
        return [r for r in self.rows if r["status"] != FINISHED]


def _outcome_from_failure(spec: TrialSpec, error: str) -> TrialOutcome:
    now = int(time.time() * 1000)
    return TrialOutcome(config_hash=spec.config_hash, index=spec.index, status=FAILED, error=error, start_ms=now, end_ms=now)


def run_specs(
    specs: list[TrialSpec],
    command: str,
    in_process: bool = False,
    extra_tags: Optional[dict[str, str]] = None,
    echo=print,
) -> SweepResult:
    first = specs[0].config
    tracker = Tracker(first["tracking"])
    sweep_name = first["sweep_name"]
    sweep_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
    parent = tracker.start_sweep(sweep_name, sweep_id, specs, command) if len(specs) > 1 else None
    result = SweepResult(sweep_id, sweep_name, parent, tracker.uri)
    rows: dict[int, dict] = {}

    def record(spec: TrialSpec, outcome) -> bool:
        from cluster import TaskFailure

        if isinstance(outcome, TaskFailure):
            outcome = _outcome_from_failure(spec, outcome.error)
        run_id = tracker.log_trial(sweep_name, spec, outcome, parent, sweep_id, extra_tags)
        rows[spec.index] = {
            "hash": spec.short_hash,
            "swept": spec.swept,
            "metrics": outcome.metrics,
            "status": outcome.status,
            "error": (outcome.error or "").splitlines()[0] if outcome.error else "",
            "run_id": run_id,
            "outcome": outcome,
        }
        return outcome.status == FINISHED

    status = "FINISHED"
    try:
        if in_process:
            from tqdm.auto import tqdm

            for spec in tqdm(specs, desc=sweep_name, unit="trial", disable=len(specs) == 1):
                record(spec, execute_trial(spec))
        else:
            from cluster import ensure_ray, run_on_ray
            from cluster.ray_runner import task_options

            cluster = first["cluster"]
            resources = ensure_ray(cluster)
            per = max(float(cluster["num_cpus_per_trial"]), 1e-9)
            slots = max(1, int(resources.get("CPU", 1) // per))
            if cluster["num_gpus_per_trial"] > 0:
                slots = min(slots, int(resources.get("GPU", 0) // cluster["num_gpus_per_trial"]) or 1)
            run_on_ray(
                execute_trial,
                specs,
                options_for=lambda s: task_options(s.config["cluster"]),
                on_result=record,
                desc=sweep_name,
                slots=slots,
            )
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        result.rows = [rows[i] for i in sorted(rows)]
        if parent:
            if status == "FINISHED" and any(r["status"] != FINISHED for r in result.rows):
                status = "FAILED"
            tracker.end_run(parent, status)
    return result


def run_sweep(overrides: list[str], in_process: bool = False, echo=print) -> SweepResult:
    specs = expand(overrides)
    command = "infersweep sweep " + " ".join(overrides)
    echo(f"{len(specs)} trial(s) validated; sweep '{specs[0].config['sweep_name']}'")
    res = run_specs(specs, command, in_process=in_process, echo=echo)
    echo("")
    echo(table(res.rows))
    for r in res.failed:
        echo(f"FAILED {r['hash']}: {r['error']}")
    return res
