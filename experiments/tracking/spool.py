"""When the tracking store is unreachable, results wait on local disk; `infersweep sync` uploads them.

Layout: `<spool_dir>/<sweep_id>/sweep.json` (the parent run: its record, the run id once it exists, the
final status once known) and one `trial-*.json` per result (spec + outcome). `<spool_dir>/running/<sweep_id>/`
notes each trial while it runs (a KILLED record, removed once the trial's result is logged): a driver killed
with SIGKILL cannot record its running trials, so the next sweep of the experiment, which finds its sweep
run orphaned, logs them as KILLED runs from these notes (experiments/tracking/notes.py). Every record has a unique
`record_id` that is also a tag of the run it becomes, so an interrupted sync that runs again neither
duplicates a run nor leaves a half-written one: runs with that record_id that are not complete are
deleted before the record is logged again.

`Recorder` is what the sweep driver writes through: the tracker while the store answers, the spool from
the first failure on (so a dead server costs one timeout, not one per trial).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Optional

from ..config.spec import TrialSpec
from ..run.trial import TrialOutcome
from .notes import RUNNING, log_killed_notes, spool_root
from .notes import record_outcome as _outcome
from .notes import record_spec as _spec
from .store import _stored_config

log = logging.getLogger(__name__)

SWEEP_FILE = "sweep.json"


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic: a crash leaves the old file or the new one, never half of one


class Spool:
    def __init__(self, root: Path):
        self.root = Path(root)

    def sweep_dir(self, sweep_id: str) -> Path:
        return self.root / sweep_id

    def write_sweep(self, rec: dict[str, Any]) -> None:
        _write_json(self.sweep_dir(rec["sweep_id"]) / SWEEP_FILE, rec)

    def read_sweep(self, sweep_id: str) -> Optional[dict[str, Any]]:
        p = self.sweep_dir(sweep_id) / SWEEP_FILE
        return json.loads(p.read_text()) if p.exists() else None

    def write_trial(self, sweep_id: str, rec: dict[str, Any]) -> Path:
        path = self.sweep_dir(sweep_id) / f"trial-{rec['spec']['index']:06d}-{rec['record_id']}.json"
        _write_json(path, rec)
        return path

    def sweeps(self) -> list[str]:
        if not self.root.exists():
            return []
        return sorted(p.name for p in self.root.iterdir()
                      if p.name != RUNNING and ((p / SWEEP_FILE).exists() or any(p.glob("trial-*.json"))))

    def running_dir(self, sweep_id: str) -> Path:
        return self.root / RUNNING / sweep_id

    def trials(self, sweep_id: str) -> list[Path]:
        return sorted(self.sweep_dir(sweep_id).glob("trial-*.json"))

    def pending(self) -> int:
        return sum(len(self.trials(s)) for s in self.sweeps())

    def finished_hashes(self, exp_name: str) -> set[str]:
        """FINISHED results of this experiment that wait here (a resumed sweep skips them too)."""
        out = set()
        for s in self.sweeps():
            for p in self.trials(s):
                rec = json.loads(p.read_text())
                if rec["exp_name"] == exp_name and rec["outcome"]["status"] == "FINISHED":
                    out.add(rec["outcome"]["config_hash"])
        return out


def trial_record(exp_name: str, spec: TrialSpec, outcome: TrialOutcome, parent_run_id: Optional[str],
                 sweep_id: Optional[str], extra_tags: Optional[dict[str, str]], record_id: str) -> dict[str, Any]:
    return {
        "kind": "trial",
        "record_id": record_id,
        "exp_name": exp_name,
        "sweep_id": sweep_id,
        "parent_run_id": parent_run_id,
        "extra_tags": extra_tags or {},
        "spec": {"config": _stored_config(spec.config), "swept": spec.swept, "index": spec.index},
        "outcome": dataclasses.asdict(outcome),
    }


class Recorder:
    """The driver's single path to the store: tracker while it answers, spool after it fails once."""

    def __init__(self, tracking: dict[str, Any], echo=print):
        from .store import is_http

        self.tracking = tracking
        self.spool = Spool(spool_root(tracking))
        self.echo = echo
        self.tracker = None
        self.offline_reason: Optional[str] = None
        self.spooled = 0
        self._lock = threading.Lock()
        self._pending: list[Future] = []
        self.dedupe_on_sync = False
        self._made_root = False
        # Several writer threads only talk to a server (which serializes what its store needs); a
        # direct SQLite store keeps one writer.
        writers = int(tracking.get("writers") or 1)
        self._pool = ThreadPoolExecutor(writers, thread_name_prefix="mlflow-writer") \
            if writers > 1 and is_http(str(tracking.get("uri", ""))) else None
        try:
            from .store import Tracker

            self.tracker = Tracker(tracking)
        except Exception as e:  # a bad/unreachable store at start: everything goes to the spool
            self._go_offline(e)

    @property
    def uri(self) -> str:
        return self.tracker.uri if self.tracker is not None else str(self.tracking.get("uri"))

    @property
    def online(self) -> bool:
        return self.tracker is not None and self.offline_reason is None

    def _go_offline(self, e: BaseException) -> None:
        with self._lock:
            if self.offline_reason is not None:
                return
            self.offline_reason = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        self.echo(f"warning: tracking store {self.tracking.get('uri')} unreachable ({self.offline_reason}); "
                  f"results go to the spool {self.spool.root} -- upload them later with `infersweep sync`")

    def _try(self, fn, *args, **kwargs):
        if not self.online:
            return None, False
        try:
            return fn(*args, **kwargs), True
        except KeyboardInterrupt:
            raise
        except Exception as e:
            log.warning("tracking write failed: %s", e)
            self._go_offline(e)
            return None, False

    # --- the driver's calls ----------------------------------------------------------------------------
    def finished_hashes(self, exp_name: str) -> set[str]:
        """FINISHED hashes in the store and the spool. If the store cannot be asked, the results of this
        sweep are marked so that `sync` drops those whose hash turns out FINISHED already (never two
        FINISHED runs of one hash without --force)."""
        found, ok = self._try(self.tracker.finished_hashes, exp_name) if self.tracker else (None, False)
        if not ok:
            self.dedupe_on_sync = True
            self.echo("warning: could not read which trials already FINISHED; running all of them -- "
                      "`infersweep sync` drops results whose hash is FINISHED in the store by then")
        return (found or set()) | self.spool.finished_hashes(exp_name)

    def reap_stale_sweeps(self, exp_name: str) -> int:
        """Close what drivers of `exp_name` killed with SIGKILL left RUNNING: their sweeps, the trials each was
        running (noted here), and the trial runs they were writing (store.Tracker.reap_stale_sweeps)."""
        n, _ = self._try(self.tracker.reap_stale_sweeps, exp_name,
                         lambda rid, sid: log_killed_notes(self.tracker, self.spool.root, rid, sid)) if self.tracker else (0, False)
        return n or 0

    def note_running(self, exp_name: str, spec: TrialSpec, parent_run_id: Optional[str], sweep_id: str,
                     extra_tags: Optional[dict[str, str]] = None) -> None:
        """Note that `spec` runs now: what the next sweep logs as its KILLED run if this driver dies with it
        (only a sweep with a parent run in the store can be found orphaned, so only its trials are noted)."""
        if parent_run_id is None:
            return
        if not self.spool.root.exists():
            self._made_root = True  # removed again when the sweep ends, as an online sweep leaves no spool
        now = int(time.time() * 1000)
        killed = TrialOutcome(config_hash=spec.config_hash, index=spec.index, status="KILLED", start_ms=now, end_ms=now,
                              error="the sweep driver was killed (SIGKILL) while this trial ran; no result")
        _write_json(self.spool.running_dir(sweep_id) / f"{spec.index:06d}.json",
                    trial_record(exp_name, spec, killed, parent_run_id, sweep_id, extra_tags, uuid.uuid4().hex))

    def done_running(self, sweep_id: str, index: Optional[int] = None) -> None:
        """The trial's result is logged (None: the whole sweep ended): its note goes."""
        d = self.spool.running_dir(sweep_id)
        for path in ([d / f"{index:06d}.json"] if index is not None else list(d.glob("*.json")) if d.is_dir() else []):
            path.unlink(missing_ok=True)
        if index is None:
            for empty in (d, d.parent, *((self.spool.root,) if self._made_root else ())):
                try:
                    empty.rmdir()  # only if empty
                except OSError:
                    break

    def start_sweep(self, rec: dict[str, Any]) -> Optional[str]:
        rid, ok = self._try(self.tracker.log_sweep, rec) if self.tracker else (None, False)
        if not ok:
            self.spool.write_sweep(dict(rec, run_id=None, status=None))
        return rid

    def log_trial(self, exp_name: str, spec: TrialSpec, outcome: TrialOutcome, parent_run_id: Optional[str],
                  sweep_id: str, extra_tags: Optional[dict[str, str]] = None):
        """The run id (or None when spooled); with `tracking.writers` > 1 a Future of it (see `flush`)."""
        args = (exp_name, spec, outcome, parent_run_id, sweep_id, extra_tags)
        if self._pool is not None and self.online:
            fut = self._pool.submit(self._log_trial, *args)
            self._pending.append(fut)
            return fut
        return self._log_trial(*args)

    def _log_trial(self, exp_name, spec, outcome, parent_run_id, sweep_id, extra_tags) -> Optional[str]:
        record_id = uuid.uuid4().hex
        if self.tracker is not None:
            rid, ok = self._try(self.tracker.log_trial, exp_name, spec, outcome, parent_run_id, sweep_id,
                                extra_tags, record_id)
            if ok:
                return rid
        rec = trial_record(exp_name, spec, outcome, parent_run_id, sweep_id, extra_tags, record_id)
        rec["skip_if_finished"] = self.dedupe_on_sync
        self.spool.write_trial(sweep_id, rec)
        with self._lock:
            self.spooled += 1
        return None

    def flush(self) -> None:
        """Wait for the writer threads (every result is in the store or the spool afterwards)."""
        for f in self._pending:
            f.exception()  # _log_trial spools instead of raising; never lose the wait to one error
        self._pending.clear()

    def close(self) -> None:
        self.flush()
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def end_sweep(self, sweep_rec: dict[str, Any], run_id: Optional[str], status: str, end_ms: int) -> None:
        self.flush()  # the parent ends after its children
        if run_id is not None:
            _, ok = self._try(self.tracker.client.set_terminated, run_id, status, end_ms)
            if ok:
                return
        existing = self.spool.read_sweep(sweep_rec["sweep_id"]) or dict(sweep_rec, run_id=run_id)
        self.spool.write_sweep(dict(existing, status=status, end_ms=end_ms))


# --- sync -------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class SyncReport:
    uploaded: int = 0
    skipped: int = 0  # already in the store (an earlier sync got that far)
    duplicates: int = 0  # dropped: their hash was FINISHED in the store already (see Recorder.finished_hashes)
    failed: int = 0
    sweeps: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)


def _complete(run) -> bool:
    return run.info.status in ("FINISHED", "FAILED") and "incomplete" not in run.data.tags


def sync(tracking: dict[str, Any], echo=print) -> SyncReport:
    """Upload everything in the spool to `tracking`; what uploads is removed from the spool."""
    from .store import Tracker

    spool = Spool(spool_root(tracking))
    tracker = Tracker(tracking)
    rep = SyncReport()
    finished_by_exp: dict[str, set[str]] = {}

    def finished(exp_name: str) -> set[str]:
        if exp_name not in finished_by_exp:
            finished_by_exp[exp_name] = tracker.finished_hashes(exp_name)
        return finished_by_exp[exp_name]

    for sweep_id in spool.sweeps():
        sdir = spool.sweep_dir(sweep_id)
        srec = spool.read_sweep(sweep_id)
        parent = None
        if srec is not None:
            parent = srec.get("run_id") or tracker.find_sweep_run(srec["exp_name"], sweep_id)
            if parent is None:
                parent = tracker.log_sweep(srec)
            if parent != srec.get("run_id"):
                srec["run_id"] = parent
                spool.write_sweep(srec)
        for path in spool.trials(sweep_id):
            rec = json.loads(path.read_text())
            try:
                existing = tracker.find_record(rec["exp_name"], rec["record_id"])
                if any(_complete(r) for r in existing):
                    rep.skipped += 1
                elif rec.get("skip_if_finished") and rec["outcome"]["config_hash"] in finished(rec["exp_name"]):
                    rep.duplicates += 1  # ran while the store could not say it was done: keep the first
                else:
                    for r in existing:  # half-written by a write that broke off: replace it
                        tracker.client.delete_run(r.info.run_id)
                    tracker.log_trial(rec["exp_name"], _spec(rec), _outcome(rec), rec.get("parent_run_id") or parent,
                                      rec.get("sweep_id"), rec.get("extra_tags"), rec["record_id"])
                    rep.uploaded += 1
                    if rec["outcome"]["status"] == "FINISHED" and rec["exp_name"] in finished_by_exp:
                        finished_by_exp[rec["exp_name"]].add(rec["outcome"]["config_hash"])
                path.unlink()
            except Exception as e:
                rep.failed += 1
                rep.errors.append(f"{path.name}: {type(e).__name__}: {e}")
        if srec is not None and srec.get("status") and parent is not None and not spool.trials(sweep_id):
            tracker.client.set_terminated(parent, status=srec["status"], end_time=srec.get("end_ms"))
            (sdir / SWEEP_FILE).unlink()
        if not any(sdir.iterdir()):
            sdir.rmdir()
            rep.sweeps += 1
    return rep


def pending_summary(tracking: dict[str, Any]) -> Iterable[str]:
    spool = Spool(spool_root(tracking))
    for s in spool.sweeps():
        yield f"{s}: {len(spool.trials(s))} result(s)"
