"""The running notes: `<spool_dir>/running/<sweep_id>/<index>.json`, one per trial a sweep driver runs now
(`spool.Recorder.note_running`), removed once its result is logged. A driver killed with SIGKILL cannot record
its running trials; whoever reaps its orphaned run (`store.Tracker.reap_stale_sweeps`) logs them as KILLED runs
from these notes (`log_killed_notes`).

Both the spool (which writes the notes) and the store (which reaps) use this module; it imports neither.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..config.compose import PROJECT_ROOT
from .paths import tracking_path
from ..config.spec import TrialSpec
from ..run.trial import TrialOutcome

RUNNING = "running"  # <spool_dir>/running/<sweep_id>/<index>.json: trials running now (never a sweep id)


def spool_root(tracking: dict[str, Any]) -> Path:
    p = Path(tracking_path(tracking, "spool_dir"))
    return p if p.is_absolute() else PROJECT_ROOT / p


def record_spec(rec: dict[str, Any]) -> TrialSpec:
    """The trial spec of a spooled record (a result or a running note)."""
    s = rec["spec"]
    return TrialSpec(config=s["config"], swept=s["swept"], index=s["index"])


def record_outcome(rec: dict[str, Any]) -> TrialOutcome:
    """The outcome of a spooled record (a result or a running note)."""
    return TrialOutcome(**rec["outcome"])


def log_killed_notes(tracker, root: Path, parent_run_id: str, sweep_id: str) -> None:
    """The trials a dead driver noted as running (`Recorder.note_running`, under the spool at `root`) under its
    run `parent_run_id` (a sweep, or an `optimize` run whose batches each had a sweep id of their own) become
    KILLED runs -- except where the trial already has its own run (the driver died while writing it, or just
    after): that run is the trial's one record (`Tracker.reap_stale_sweeps` closes it if it is still RUNNING), no
    second one is made."""
    base = Path(root) / RUNNING
    dirs = [d for d in sorted(base.iterdir()) if d.is_dir()] if base.is_dir() else []
    for d in dirs:
        for path in sorted(d.glob("*.json")):
            rec = json.loads(path.read_text())
            if not (sweep_id and d.name == sweep_id or rec.get("parent_run_id") == parent_run_id):
                continue
            if not tracker.trial_runs(rec["exp_name"], rec.get("sweep_id") or d.name, rec["spec"]["index"]):
                tracker.log_trial(rec["exp_name"], record_spec(rec), record_outcome(rec),
                                  rec.get("parent_run_id") or parent_run_id, rec.get("sweep_id") or d.name,
                                  rec.get("extra_tags"), rec["record_id"])
            path.unlink()
        if not any(d.iterdir()):
            d.rmdir()
