"""MLflow records: one experiment per sweep name, a parent run per sweep, a child run per trial.

The sweep driver is the only writer (workers return plain outcomes), so a local SQLite store works for any
number of workers and no node needs a shared filesystem. Every write path ends in a terminal status:
a half-written run is marked FAILED/KILLED, and results that cannot be written wait in the spool
(`experiments/spool.py`).
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import yaml

from ..config.compose import PROJECT_ROOT
from .dashboard import display_metrics, experiment_tags, ordered_display, short_name, tag_experiment
from .paths import sqlite_path, tracking_path
from ..config.hashing import HASH_VERSION
from ..config.spec import TrialSpec
from ..run.trial import TrialOutcome, identified_correct

PARENT_TAG = "mlflow.parentRunId"


@contextlib.contextmanager
def held_interrupts():
    """Ctrl-C / `kill` arriving inside the block are delivered when it ends (a second one at once), so a run the
    block creates always has its id in the caller's hands when the interrupt lands: the store inserts the run,
    then builds the returned entity, and an interrupt between the two left a run RUNNING that no one could end.
    Only signals with a Python handler are held (an ignored SIGINT stays ignored); off the main thread, a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    old = {s: h for s, h in old.items() if callable(h)}
    pending: list[int] = []

    def hold(signum, frame):
        if pending:  # pressed twice: the user means it now
            old[signum](signum, frame)
        pending.append(signum)

    for s in old:
        signal.signal(s, hold)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if pending:
            old[pending[0]](pending[0], None)
CONFIG_ARTIFACT = "config.yaml"
TOKENS_ARTIFACT = "token_ids.json"
REPEAT_PREFIX = "repeat."  # metric history of each timed repeat's value: repeat.output_tok_s at steps 0..n-1
ANSWERS_ARTIFACT = "task_answers.json"  # eval.tasks: task -> per-example answers (reproduce compares them)
CORRECT_ARTIFACT = "task_correct.json"  # eval.tasks: task -> per-example 0/1 (optimize's paired accuracy test)
PACKAGES = ("torch", "transformers", "ray", "mlflow", "hydra-core", "bitsandbytes", "infersweep")


def resolve_uri(uri: str) -> str:
    """A relative sqlite path is relative to the project root, not to wherever the CLI was started."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        path = (PROJECT_ROOT / uri[len(prefix):]).resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        return prefix + str(path)
    return uri


def missing_store(uri: str):
    """The SQLite file `uri` names where it does not exist yet, else None: a reader must not touch it, since
    MLflow would create an empty store there (and then report "not found")."""
    db = sqlite_path(uri)
    return db if db is not None and not db.exists() else None


def open_store(uri: str):
    """An `MlflowClient` on `uri` whose store exists. MLflow creates a missing schema in whichever process
    touches a SQLite store first, without a lock: two sweeps started together on a new store both run
    the migrations and one fails (`table _alembic_tmp_experiments already exists`, or another table),
    which would send its results to the spool. So the first touch happens under a lock file beside the
    database; the store object (schema checked) is then cached by MLflow for the rest of the process."""
    from mlflow.tracking import MlflowClient

    db = sqlite_path(uri)
    if db is None:
        return MlflowClient(tracking_uri=uri)
    import fcntl

    with open(db.with_name(db.name + "-schema.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        client = MlflowClient(tracking_uri=uri)  # may already build the store
        client.search_experiments(max_results=1)  # or this does
    return client


def resolve_artifact_root(tracking: dict[str, Any]) -> str:
    """The artifact root as a URI (tracking.artifact_root, or its default beside a local store: paths.py)."""
    root = tracking_path(tracking, "artifact_root")
    if "://" in root:
        return root
    path = Path(root) if Path(root).is_absolute() else PROJECT_ROOT / root
    path.mkdir(parents=True, exist_ok=True)
    return path.resolve().as_uri()


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = "null" if v is None else str(v)
    return out


@functools.lru_cache(maxsize=1)
def environment_tags() -> dict[str, str]:
    tags = {"python": platform.python_version(), "hash_version": str(HASH_VERSION)}
    for pkg in PACKAGES:
        try:
            tags[f"version.{pkg}"] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    try:
        commit = subprocess.run(
            ["git", "-C", str(PROJECT_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(PROJECT_ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=5,
        ).stdout.strip()
        if commit:
            tags["git_commit"] = commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return tags


def is_http(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def sweep_record(sweep_name: str, sweep_id: str, specs: list[TrialSpec], command: str) -> dict[str, Any]:
    """What a parent sweep run holds, as plain data (so it can wait in the spool)."""
    axes = sorted({k for s in specs for k in s.swept})
    return {
        "exp_name": sweep_name,
        "sweep_id": sweep_id,
        "tags": {"sweep_id": sweep_id, "kind": "sweep", "command": redact(command), "driver": driver_id(), **environment_tags()},
        "params": {"trials": str(len(specs)), "axes": ",".join(axes) or "-"},
        "trials_txt": "\n".join(f"{s.short_hash} {s.label}" for s in specs),
        "tasks": sorted({t for s in specs for t in config_tasks(s.config)}),  # the saved view's task columns
        "start_ms": int(time.time() * 1000),
    }


def config_tasks(config: dict[str, Any]) -> list[str]:
    """The eval.tasks of a resolved trial config ([] without tasks, or with accuracy off)."""
    ev = config.get("eval") or {}
    return list(ev.get("tasks") or []) if ev.get("enabled", True) else []


def driver_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


ORPHAN_ERROR = "the sweep driver was killed (SIGKILL) while this trial's result was being written; incomplete"


def _driver_gone(tags: dict[str, str]) -> bool:
    """Whether the run's `driver` tag names a process on this host that no longer exists."""
    host, _, pid = tags.get("driver", "").rpartition(":")
    return host == socket.gethostname() and pid.isdigit() and not _pid_alive(int(pid))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Tracker:
    def __init__(self, tracking: dict[str, Any]):
        self.tracking = tracking
        self.uri = resolve_uri(tracking["uri"])
        self.artifact_root = resolve_artifact_root(tracking)
        self.http_env: dict[str, str] = {}
        if is_http(self.uri):
            # fail fast to the spool instead of MLflow's default of minutes of retries per request
            self.http_env = {
                "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(int(tracking.get("request_retries", 2))),
                "MLFLOW_HTTP_REQUEST_TIMEOUT": str(int(max(1, tracking.get("request_timeout_s", 10)))),
                "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": os.environ.get("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1"),
                "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",  # no line per run on stdout
            }
        self.client = _ScopedClient(open_store(self.uri), self.http_env)
        self._exp_ids: dict[str, str] = {}
        self._exp_tasks: dict[str, set[str]] = {}  # eval.tasks whose columns the experiment's saved view has
        self._exp_lock = threading.Lock()

    # --- writing -------------------------------------------------------------------------------------
    def experiment_id(self, name: str, tasks: Iterable[str] = ()) -> str:
        """The experiment's id, created (with the dashboard's tags) if missing; `tasks` (eval.tasks of what is
        about to be logged) get their columns in the saved view."""
        with self._exp_lock:  # writer threads: create the experiment once
            return self._experiment_id(name, sorted(set(tasks)))

    def _experiment_id(self, name: str, tasks: list[str]) -> str:
        if name in self._exp_ids:
            if set(tasks) <= self._exp_tasks[name]:
                return self._exp_ids[name]
            exp = self.client.get_experiment(self._exp_ids[name])
            tag_experiment(self.client, exp, sorted(self._exp_tasks[name] | set(tasks)))
            self._exp_tasks[name] |= set(tasks)
            return self._exp_ids[name]
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            eid = exp.experiment_id
            tag_experiment(self.client, exp, tasks)  # made before these tags existed, or by plain MLflow
        else:
            # through a server, artifacts go where the server proxies them (no shared filesystem)
            location = None if is_http(self.uri) else f"{self.artifact_root}/{name}"
            try:
                eid = self.client.create_experiment(name, artifact_location=location, tags=experiment_tags(tasks))
            except Exception:
                exp = self.client.get_experiment_by_name(name)  # another sweep of that name created it meanwhile
                if exp is None:
                    raise
                eid = exp.experiment_id
                tag_experiment(self.client, exp, tasks)
        self._exp_ids[name] = eid
        self._exp_tasks[name] = set(tasks)
        return eid

    def start_sweep(self, sweep_name: str, sweep_id: str, specs: list[TrialSpec], command: str) -> str:
        return self.log_sweep(sweep_record(sweep_name, sweep_id, specs, command))

    def log_sweep(self, rec: dict[str, Any]) -> str:
        exp_id = self.experiment_id(rec["exp_name"], rec.get("tasks", ()))
        rid = None
        try:
            with held_interrupts():
                rid = self.client.create_run(
                    exp_id, run_name=f"sweep-{rec['sweep_id']}", start_time=rec.get("start_ms"), tags=rec["tags"]
                ).info.run_id
            self.client.log_batch(rid, params=_params(rec["params"]))
            self.client.log_text(rid, rec["trials_txt"], "trials.txt")
        except KeyboardInterrupt as e:
            if rid is not None:  # the caller never learns the id: end the run here
                with contextlib.suppress(Exception):
                    self.client.set_tag(rid, "incomplete", f"{type(e).__name__}: {str(e)[:200]}")
                    self.client.set_terminated(rid, status="KILLED")
            raise
        return rid

    def find_sweep_run(self, exp_name: str, sweep_id: str) -> Optional[str]:
        exp = self.client.get_experiment_by_name(exp_name)
        if exp is None:
            return None
        runs = self.client.search_runs(
            [exp.experiment_id], filter_string=f"tags.kind = 'sweep' and tags.sweep_id = '{_q(sweep_id)}'", max_results=1
        )
        return runs[0].info.run_id if runs else None

    def reap_stale_sweeps(self, exp_name: str, on_reaped: Optional[Callable[[str, str], None]] = None) -> int:
        """Close what drivers killed with SIGKILL (process gone, on this host) left RUNNING in this experiment:
        nothing stays RUNNING forever. Their sweep / optimize runs become KILLED (tag `reaped`); before that,
        `on_reaped(run_id, sweep_id)` is called for each (default: the trials each was running, noted in the
        spool, get their KILLED runs -- notes.log_killed_notes); then every other run those drivers left RUNNING
        -- a trial's own run half-written when the driver died, under the dead run, of its sweep, or tagged with
        the dead driver -- is closed KILLED too (tags `reaped`, `incomplete`, `error`). Returns how many sweep /
        optimize runs were reaped."""
        exp = self.client.get_experiment_by_name(exp_name)
        if exp is None:
            return 0
        running = self._search_all([exp.experiment_id], "attributes.status = 'RUNNING'")
        dead = [r for r in running if r.data.tags.get("kind") in ("sweep", "optimize") and _driver_gone(r.data.tags)]
        if on_reaped is None:
            from .notes import log_killed_notes, spool_root

            root = spool_root(self.tracking)
            on_reaped = lambda rid, sid: log_killed_notes(self, root, rid, sid)  # noqa: E731
        for r in dead:
            on_reaped(r.info.run_id, r.data.tags.get("sweep_id", ""))
        dead_ids = {r.info.run_id for r in dead}
        dead_sweeps = {r.data.tags["sweep_id"] for r in dead if r.data.tags.get("sweep_id")}
        for r in running:  # children first: a parent ends after its runs, as in a sweep that ends normally
            t = r.data.tags
            if r.info.run_id in dead_ids or t.get("kind") in ("sweep", "optimize") and not _driver_gone(t):
                continue
            if t.get(PARENT_TAG) in dead_ids or t.get("sweep_id") in dead_sweeps or _driver_gone(t):
                self.client.set_tag(r.info.run_id, "reaped", "driver process gone")
                self.client.set_tag(r.info.run_id, "incomplete", "the driver died before this run was complete")
                if "error" not in t:
                    self.client.set_tag(r.info.run_id, "error", ORPHAN_ERROR)
                self.client.set_terminated(r.info.run_id, status="KILLED")
        for r in dead:
            self.client.set_tag(r.info.run_id, "reaped", "driver process gone")
            self.client.set_terminated(r.info.run_id, status="KILLED")
        return len(dead)

    def _search_all(self, exp_ids: list[str], flt: str) -> list:
        out, token = [], None
        while True:
            page = self.client.search_runs(exp_ids, filter_string=flt, max_results=500, page_token=token)
            out += list(page)
            token = page.token
            if not token:
                return out

    def trial_runs(self, exp_name: str, sweep_id: str, index: int) -> list:
        """The runs (any status) of trial `index` of sweep `sweep_id`."""
        exp = self.client.get_experiment_by_name(exp_name)
        if exp is None or not sweep_id:
            return []
        return list(self.client.search_runs([exp.experiment_id], filter_string=(
            f"tags.kind = 'trial' and tags.sweep_id = '{_q(sweep_id)}' and tags.trial_index = '{int(index)}'")))

    def finished_hashes(self, exp_name: str) -> set[str]:
        """config_hash of every FINISHED trial run of the experiment (what a resumed sweep skips)."""
        exp = self.client.get_experiment_by_name(exp_name)
        if exp is None:
            return set()
        out: set[str] = set()
        token = None
        # Small pages: a server answers a 1,000-run page (params + metrics + tags of each) slower than
        # its request timeout; 200 at a time stays well inside it.
        with mlflow_http_env(dict(self.http_env, MLFLOW_HTTP_REQUEST_TIMEOUT="60") if self.http_env else {}):
            while True:
                page = self.client.search_runs(
                    [exp.experiment_id], filter_string="attributes.status = 'FINISHED' and tags.kind = 'trial'",
                    max_results=200, page_token=token,
                )
                out |= {r.data.tags["config_hash"] for r in page if "config_hash" in r.data.tags}
                token = page.token
                if not token:
                    return out

    def find_record(self, exp_name: str, record_id: str) -> list:
        exp = self.client.get_experiment_by_name(exp_name)
        if exp is None:
            return []
        return list(self.client.search_runs([exp.experiment_id], filter_string=f"tags.record_id = '{_q(record_id)}'"))

    def end_run(self, run_id: str, status: str) -> None:
        self.client.set_terminated(run_id, status=status)

    def log_trial(
        self,
        exp_name: str,
        spec: TrialSpec,
        outcome: TrialOutcome,
        parent_run_id: Optional[str] = None,
        sweep_id: Optional[str] = None,
        extra_tags: Optional[dict[str, str]] = None,
        record_id: Optional[str] = None,
        run_name: Optional[str] = None,
    ) -> str:
        """One trial run, terminal when this returns (named `run_name`, else by its swept axes). `record_id` (unique per result) makes a re-upload
        from the spool idempotent. If the write breaks off, the half-written run is marked FAILED (or
        KILLED on Ctrl-C) where the store still answers, and the caller spools the result."""
        from mlflow.entities import Metric

        exp_id = self.experiment_id(exp_name, config_tasks(spec.config))
        tags = {
            "config_hash": spec.config_hash,
            "trial_index": str(spec.index),
            "kind": "trial",
            "attempts": str(outcome.attempts),
            "driver": driver_id(),  # the process writing it: a run it leaves RUNNING is closed once it is gone
            **({"swept": spec.label[:5000]} if spec.swept else {}),  # the varying axes as key=value (the run name: short)
            **environment_tags(),
            **{f"env.{k}": v for k, v in outcome.info.items()},
            **outcome.labels,
            **(extra_tags or {}),
        }
        if record_id:
            tags["record_id"] = record_id
        if parent_run_id:
            tags[PARENT_TAG] = parent_run_id
        if sweep_id:
            tags["sweep_id"] = sweep_id
        if outcome.error:
            tags["error"] = outcome.error.splitlines()[0][:4000]
        rid = None
        try:
            with held_interrupts():  # an interrupt lands once `rid` is known, so the run is ended below
                rid = self.client.create_run(exp_id, start_time=outcome.start_ms or None, tags=tags,
                                             run_name=(run_name or short_name(spec.swept) or spec.label)[:250]).info.run_id
            params = flatten({k: v for k, v in spec.config.items() if k != "tracking"})
            # the runs table's rounded copies first (dashboard.py; a failed trial has none): a run's page lists its
            # metrics in the order they were logged, so the headline figures lead the 100-odd full-precision ones
            metrics = [Metric(k, float(v), outcome.end_ms, 0) for k, v in
                       ordered_display(display_metrics(outcome.metrics, outcome.labels) if outcome.metrics else {})]
            metrics += [Metric(k, float(v), outcome.end_ms, 0) for k, v in sorted(outcome.metrics.items())]
            # each timed repeat's value as a metric history (step = repeat, or round when interleaved)
            metrics += [Metric(REPEAT_PREFIX + k, float(v), outcome.end_ms, i)
                        for k, vs in sorted(getattr(outcome, "samples", {}).items()) for i, v in enumerate(vs)]
            metrics += [Metric(k, float(v), outcome.end_ms, step) for k, vs in sorted(outcome.series.items())
                        for step, v in enumerate(vs)]
            self.client.log_batch(rid, metrics=metrics, params=_params(params))
            self.client.log_text(rid, yaml.safe_dump(_stored_config(spec.config), sort_keys=True), CONFIG_ARTIFACT)
            if outcome.token_ids:
                self.client.log_text(rid, json.dumps(outcome.token_ids), TOKENS_ARTIFACT)
                self.client.log_text(rid, outcome.sample_text, "sample.txt")
            if outcome.series:
                _log_curve(self.client, rid, outcome.series)
            _log_needles(self.client, rid, outcome.metrics, spec.config.get("workload", {}).get("context_len", 0))
            if getattr(outcome, "answers", None):
                self.client.log_text(rid, json.dumps(outcome.answers), ANSWERS_ARTIFACT)
            if getattr(outcome, "correct", None):  # keyed by item identity: a resumed optimize pairs by it
                self.client.log_text(rid, json.dumps(identified_correct(outcome.correct, getattr(outcome, "items", {}))),
                                     CORRECT_ARTIFACT)
            for name, text in sorted(getattr(outcome, "artifacts", {}).items()):
                self.client.log_text(rid, text, name)
            if outcome.error:
                self.client.log_text(rid, outcome.error, "error.txt")
            if outcome.attempt_errors:
                self.client.log_text(rid, "\n\n".join(outcome.attempt_errors), "attempt_errors.txt")
            self.client.set_terminated(rid, status=outcome.status, end_time=outcome.end_ms or None)
        except BaseException as e:
            if rid is None:
                raise
            try:
                self.client.set_tag(rid, "incomplete", f"{type(e).__name__}: {str(e)[:200]}")
                self.client.set_terminated(rid, status="KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
            except Exception:
                pass  # the store is gone: `sync` deletes the half-written run by its record_id
            raise
        return rid

    # --- reading -------------------------------------------------------------------------------------
    def find_by_hash(self, prefix: str, statuses: Iterable[str] = ("FINISHED",)) -> list:
        from mlflow.entities import ViewType

        exps = [e.experiment_id for e in self.client.search_experiments(view_type=ViewType.ACTIVE_ONLY)]
        if not exps:
            return []
        safe = prefix.replace("'", "")
        runs = self.client.search_runs(
            exps, filter_string=f"tags.config_hash LIKE '{safe}%'", order_by=["attributes.start_time ASC"], max_results=1000
        )
        return [r for r in runs if r.info.status in set(statuses)]

    def load_text(self, run_id: str, path: str) -> str:
        import tempfile

        import mlflow.artifacts

        with tempfile.TemporaryDirectory() as tmp:
            with mlflow_http_env(self.http_env):
                local = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=path, dst_path=tmp,
                                                            tracking_uri=self.uri)
            return Path(local).read_text()


# MLflow reads its HTTP timeouts and retries from the environment at each request and takes no per-client
# setting. A Tracker sets them only while one of its own calls runs (the outermost call sets, the last one
# out restores), so the process -- and any other MLflow client in it -- keeps its environment otherwise.
_ENV_LOCK = threading.Lock()
_ENV_DEPTH = 0
_ENV_SAVED: dict[str, Optional[str]] = {}


@contextlib.contextmanager
def mlflow_http_env(values: dict[str, str]):
    global _ENV_DEPTH, _ENV_SAVED
    if not values:
        yield
        return
    with _ENV_LOCK:
        if _ENV_DEPTH == 0:
            _ENV_SAVED = {k: os.environ.get(k) for k in values}
            os.environ.update(values)
        _ENV_DEPTH += 1
    try:
        yield
    finally:
        with _ENV_LOCK:
            _ENV_DEPTH -= 1
            if _ENV_DEPTH == 0:
                for k, old in _ENV_SAVED.items():
                    if old is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = old


class _ScopedClient:
    """An MlflowClient whose every call runs inside `mlflow_http_env(env)`."""

    def __init__(self, client, env: dict[str, str]):
        self._client, self._env = client, env

    def __getattr__(self, name: str):
        attr = getattr(self._client, name)
        if not callable(attr) or not self._env:
            return attr

        def call(*args, **kwargs):
            with mlflow_http_env(self._env):
                return attr(*args, **kwargs)

        return call


def redact(text: str) -> str:
    """No password of a database URI in what is logged or printed."""
    return re.sub(r"//([^:/@\s]+):[^@/\s]*@", r"//\1:***@", text)


CURVE_ARTIFACT = "capacity_curve.png"


def _log_curve(client, rid: str, series: dict[str, list[float]]) -> None:
    """A capacity search's probe curve as a plot artifact."""
    from .curves import plot_capacity_curve

    with tempfile.TemporaryDirectory() as d:
        path = plot_capacity_curve(series, Path(d) / CURVE_ARTIFACT)
        if path is not None:
            client.log_artifact(rid, str(path))


def _log_needles(client, rid: str, metrics: dict[str, float], context_len: int) -> None:
    """Each needle task's score by depth as a plot artifact (`needle_<task>.png`); none without needle tasks."""
    from .curves import needle_artifact, needle_depths, plot_needle_depths

    tasks = sorted(needle_depths(metrics))
    if not tasks:
        return
    with tempfile.TemporaryDirectory() as d:
        for task in tasks:
            path = plot_needle_depths(task, metrics, int(context_len), Path(d) / needle_artifact(task))
            if path is not None:
                client.log_artifact(rid, str(path))


def _stored_config(config: dict[str, Any]) -> dict[str, Any]:
    """The resolved config as logged (config.yaml): the tracking URI without its password."""
    if "tracking" not in config:
        return config
    return dict(config, tracking=dict(config["tracking"], uri=redact(str(config["tracking"].get("uri", "")))))


def _q(s: str) -> str:
    return str(s).replace("'", "")


def _params(d: dict[str, str]):
    from mlflow.entities import Param

    return [Param(k, v[:6000]) for k, v in sorted(d.items())]
