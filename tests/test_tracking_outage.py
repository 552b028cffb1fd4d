"""Tracking outages lose nothing: results spool locally and `infersweep sync` uploads them once; a
half-written run is replaced, never duplicated; the server binds loopback; PostgreSQL behind the server."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from experiments.cli import main
from experiments.tracking.spool import Spool, sync
from experiments.run.sweep import run_sweep
from experiments.tracking.server import free_port, server_command

from conftest import TINY


def _client(uri):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _trials(client, name):
    exp = client.get_experiment_by_name(name)
    runs = [] if exp is None else client.search_runs([exp.experiment_id], max_results=1000)
    return [r for r in runs if r.data.tags.get("kind") == "trial"], [r for r in runs if r.data.tags.get("kind") == "sweep"]


def test_unreachable_server_spools_and_sync_uploads_exactly_once(mlflow_server, tmp_path, capsys, monkeypatch):
    # the Tracker sets MLflow's HTTP retry/timeout variables for this process: restore them afterwards
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    spool = tmp_path / "spool"
    over = TINY + [f"tracking.uri={dead}", f"tracking.spool_dir={spool}", "tracking.request_retries=0",
                   "tracking.request_timeout_s=2", "sweep_name=t-outage", "kv_cache=off,contiguous", "seed=0,1"]
    res = run_sweep(over, in_process=True, echo=lambda *_: None)
    assert [r["status"] for r in res.rows] == ["FINISHED"] * 4 and res.spooled == 4
    assert len(Spool(spool).trials(res.sweep_id)) == 4

    # the server is "back" (here: the session's live server), sync with the same spool
    live = [f"tracking.uri={mlflow_server}", f"tracking.spool_dir={spool}"]
    assert main(["sync", *live]) == 0
    assert "uploaded 4 result(s)" in capsys.readouterr().out
    client = _client(mlflow_server)
    trials, parents = _trials(client, "t-outage")
    assert len(trials) == 4 and {r.info.status for r in trials} == {"FINISHED"}
    assert len({r.data.tags["config_hash"] for r in trials}) == 4
    assert [p.info.status for p in parents] == ["FINISHED"]
    assert {r.data.tags["mlflow.parentRunId"] for r in trials} == {parents[0].info.run_id}
    assert "token_ids.json" in {a.path for a in client.list_artifacts(trials[0].info.run_id)}
    assert not spool.exists() or not any(spool.iterdir())
    assert main(["sync", *live]) == 0 and "nothing to sync" in capsys.readouterr().out

    # resume against the live store: everything is there, nothing re-runs
    res2 = run_sweep(over[:-5] + live + ["sweep_name=t-outage", "kv_cache=off,contiguous", "seed=0,1"],
                     in_process=True, echo=lambda *_: None)
    assert res2.skipped == 4 and not res2.failed


def test_results_of_a_blind_resume_never_duplicate_a_finished_hash(mlflow_server, tmp_path, capsys, monkeypatch):
    """Store unreachable at start: the sweep cannot know what FINISHED, runs all, spools; sync keeps the
    first FINISHED run of each hash."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    base = TINY + [f"tracking.spool_dir={tmp_path}", "sweep_name=t-dedupe", "seed=0,1"]
    first = run_sweep(base + [f"tracking.uri={mlflow_server}"], in_process=True, echo=lambda *_: None)
    assert [r["status"] for r in first.rows] == ["FINISHED"] * 2
    lines = []
    blind = run_sweep(base + [f"tracking.uri=http://127.0.0.1:{free_port()}", "tracking.request_retries=0",
                              "tracking.request_timeout_s=2", "seed=0,1,2"], in_process=True, echo=lines.append)
    assert blind.spooled == 3 and any("could not read which trials already FINISHED" in ln for ln in lines)
    assert main(["sync", f"tracking.uri={mlflow_server}", f"tracking.spool_dir={tmp_path}"]) == 0
    assert "uploaded 1 result(s)" in capsys.readouterr().out
    trials, _ = _trials(_client(mlflow_server), "t-dedupe")
    fin = [r.data.tags["config_hash"] for r in trials if r.info.status == "FINISHED"]
    assert len(fin) == 3 and len(set(fin)) == 3


def test_parallel_writer_threads_record_each_trial_once(mlflow_server, tmp_path):
    over = TINY + [f"tracking.uri={mlflow_server}", f"tracking.spool_dir={tmp_path}", "tracking.writers=4",
                   "sweep_name=t-writers", "seed=range(0,6)"]
    res = run_sweep(over, in_process=True, echo=lambda *_: None)
    assert [r["status"] for r in res.rows] == ["FINISHED"] * 6 and all(isinstance(r["run_id"], str) for r in res.rows)
    trials, parents = _trials(_client(mlflow_server), "t-writers")
    assert sorted(r.info.run_id for r in trials) == sorted(r["run_id"] for r in res.rows)
    assert {r.info.status for r in trials} == {"FINISHED"} and [p.info.status for p in parents] == ["FINISHED"]


def test_sync_replaces_a_half_written_run_and_is_idempotent(mlflow_server, tmp_path):
    """A write that broke off left a RUNNING run; the spooled record replaces it, and a sync that died
    after uploading (file still there) does not upload it twice."""
    from experiments.config.spec import TrialSpec
    from experiments.tracking.spool import trial_record
    from experiments.config.compose import expand
    from experiments.run.trial import TrialOutcome

    spec = expand(TINY + ["sweep_name=t-partial"])[0]
    client = _client(mlflow_server)
    exp = client.get_experiment_by_name("t-partial") or client.get_experiment(client.create_experiment("t-partial"))
    exp_id = exp if isinstance(exp, str) else exp.experiment_id
    half = client.create_run(exp_id, tags={"record_id": "rec-1", "kind": "trial", "config_hash": spec.config_hash})
    outcome = TrialOutcome(config_hash=spec.config_hash, index=0, status="FINISHED", metrics={"output_tok_s": 1.0},
                           start_ms=1, end_ms=2)
    sp = Spool(tmp_path)
    rec = trial_record("t-partial", spec, outcome, None, "sw-1", None, "rec-1")
    path = sp.write_trial("sw-1", rec)
    tracking = {"uri": mlflow_server, "artifact_root": str(tmp_path / "a"), "spool_dir": str(tmp_path)}
    rep = sync(tracking)
    assert rep.uploaded == 1 and rep.failed == 0
    trials, _ = _trials(client, "t-partial")
    assert [r.info.status for r in trials] == ["FINISHED"]
    assert client.get_run(half.info.run_id).info.lifecycle_stage == "deleted"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec))  # as if the last sync died before removing the file
    rep = sync(tracking)
    assert rep.uploaded == 0 and rep.skipped == 1
    assert len(_trials(client, "t-partial")[0]) == 1


def test_server_binds_loopback_unless_configured():
    cmd = server_command({"uri": "sqlite:///x.db", "artifact_root": "/tmp/a"}, 5001)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    cmd = server_command({"uri": "sqlite:///x.db", "artifact_root": "/tmp/a", "host": "0.0.0.0"}, 5001)
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"


def test_artifacts_and_spool_follow_a_local_store_unless_set(tmp_path):
    """tracking.uri alone moves the artifact root and the spool beside its database: two stores never share
    one artifact folder; a path set explicitly is kept; the default store and a remote one use the checkout's
    mlflow/. Read as every consumer reads them: the composed config, the Tracker, the server, the spool."""
    from experiments.cli import _tracking
    from experiments.config.compose import PROJECT_ROOT
    from experiments.tracking.notes import spool_root
    from experiments.tracking.paths import with_paths
    from experiments.tracking.store import Tracker

    def where(*over):
        t = _tracking(list(over))
        cmd = server_command(t, 5001)
        return cmd[cmd.index("--artifacts-destination") + 1], spool_root(t), t

    for kind in ("local", "server"):
        a_root, a_spool, a = where(f"tracking={kind}", f"tracking.uri=sqlite:///{tmp_path}/a/mlflow.db")
        assert (a_root, a_spool) == ((tmp_path / "a" / "artifacts").as_uri(), tmp_path / "a" / "spool"), kind
        # a server started in front of the store (tracking.serve) keeps the store's folders
        assert spool_root(dict(with_paths(a), uri="http://127.0.0.1:1")) == a_spool
    tracker = Tracker(_tracking([f"tracking.uri=sqlite:///{tmp_path}/b/mlflow.db"]))
    exp = tracker.client.get_experiment(tracker.experiment_id("t-beside"))
    assert exp.artifact_location == f"{(tmp_path / 'b' / 'artifacts').as_uri()}/t-beside"
    assert where(f"tracking.uri=sqlite:///{tmp_path}/a/mlflow.db", f"tracking.artifact_root={tmp_path}/art",
                 f"tracking.spool_dir={tmp_path}/sp")[:2] == ((tmp_path / "art").as_uri(), tmp_path / "sp")
    checkout = ((PROJECT_ROOT / "mlflow" / "artifacts").resolve().as_uri(), PROJECT_ROOT / "mlflow" / "spool")
    assert where()[:2] == checkout
    assert where("tracking=postgres")[:2] == checkout


@pytest.mark.slow  # a real multi-process cluster/server or a full re-probe: the slow tier (CI runs it)
def test_cli_started_server_for_the_sweep_lifetime(tmp_path):
    """tracking=server: the CLI starts `mlflow server` on the store, logs through it, stops it; the artifacts
    and the spool stay beside the store although the sweep logs over HTTP."""
    store = tmp_path / "store"
    over = TINY + ["tracking=server", f"tracking.uri=sqlite:///{store}/mlflow.db", "sweep_name=t-served"]
    lines = []
    res = run_sweep(over, in_process=True, echo=lines.append)
    assert [r["status"] for r in res.rows] == ["FINISHED"]
    # the server proxies artifacts into its destination by experiment id
    assert res.spool_dir == str(store / "spool") and any(p.is_file() for p in (store / "artifacts").rglob("*"))
    assert res.tracking_uri.startswith("http://127.0.0.1:")
    assert any("starting mlflow server" in ln for ln in lines)
    with socket.socket() as s:  # gone with the sweep
        assert s.connect_ex(("127.0.0.1", int(res.tracking_uri.rsplit(":", 1)[1]))) != 0
    trials, _ = _trials(_client(f"sqlite:///{store}/mlflow.db"), "t-served")
    assert [r.info.status for r in trials] == ["FINISHED"]


# --- PostgreSQL behind mlflow server ----------------------------------------------------------------
def _pg_bin(name):
    for d in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (d / name).exists():
            return str(d / name)
    return shutil.which(name)


def _pg_missing():
    if not _pg_bin("initdb") or not _pg_bin("pg_ctl"):
        return "PostgreSQL server binaries not installed (Debian: apt-get install postgresql; .ci/run does)"
    try:
        import psycopg2  # noqa: F401
    except ImportError:
        return "psycopg2 not installed (pip install psycopg2-binary)"
    return None


@pytest.fixture(scope="module")
def postgres(tmp_path_factory):
    reason = _pg_missing()
    if reason:
        pytest.skip(reason)
    root = Path(f"/tmp/infersweep-pg-{os.getpid()}")
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir()
    as_user = []
    if os.geteuid() == 0:  # initdb refuses root: run the cluster as the `postgres` system user
        shutil.chown(root, "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    port = free_port()
    data = root / "data"
    run = lambda *a: subprocess.run([*as_user, *a], check=True, capture_output=True, text=True, timeout=120)  # noqa: E731
    run(_pg_bin("initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8")
    run(_pg_bin("pg_ctl"), "-D", str(data), "-l", str(root / "pg.log"), "-w", "-o",
        f"-p {port} -k {root} -c listen_addresses=127.0.0.1", "start")
    try:
        psql = shutil.which("psql") or _pg_bin("psql")
        for sql in ("CREATE ROLE infersweep LOGIN PASSWORD 'infersweep'", "CREATE DATABASE infersweep OWNER infersweep"):
            run(psql, "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "-c", sql)
        yield f"postgresql+psycopg2://infersweep:infersweep@127.0.0.1:{port}/infersweep"
    finally:
        subprocess.run([*as_user, _pg_bin("pg_ctl"), "-D", str(data), "-m", "fast", "stop"], capture_output=True, timeout=60)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow  # a real multi-process cluster/server or a full re-probe: the slow tier (CI runs it)
def test_tracking_postgres_config_behind_mlflow_server(postgres, tmp_path):
    over = TINY + ["tracking=postgres", f"tracking.uri={postgres}", "tracking.workers=1",
                   f"tracking.artifact_root={tmp_path}/art", f"tracking.spool_dir={tmp_path}/spool",
                   "sweep_name=t-postgres", "kv_cache=off,contiguous"]
    res = run_sweep(over, in_process=True, echo=lambda *_: None)
    assert [r["status"] for r in res.rows] == ["FINISHED"] * 2 and res.spooled == 0
    trials, parents = _trials(_client(postgres), "t-postgres")  # read the database directly
    assert sorted(r.info.status for r in trials) == ["FINISHED", "FINISHED"]
    assert [p.info.status for p in parents] == ["FINISHED"]


def test_sweep_run_of_a_dead_driver_is_marked_killed(mlflow_server):
    """A driver killed with SIGKILL cannot end its parent run; the next sweep of the experiment does."""
    from experiments.tracking.store import Tracker

    proc = subprocess.Popen(["true"])
    proc.wait()  # a pid that is gone
    tracker = Tracker({"uri": mlflow_server, "artifact_root": "/tmp/unused"})
    exp = tracker.experiment_id("t-reap")
    live = tracker.client.create_run(exp, tags={"kind": "sweep", "driver": f"{socket.gethostname()}:{os.getpid()}"})
    dead = tracker.client.create_run(exp, tags={"kind": "sweep", "driver": f"{socket.gethostname()}:{proc.pid}"})
    assert tracker.reap_stale_sweeps("t-reap") == 1
    assert tracker.client.get_run(dead.info.run_id).info.status == "KILLED"
    assert tracker.client.get_run(live.info.run_id).info.status == "RUNNING"
    tracker.client.set_terminated(live.info.run_id)


def test_trials_a_dead_driver_was_running_are_logged_killed(tmp_path):
    """A driver killed with SIGKILL cannot log the trials it was running: the note it kept of each becomes a
    KILLED run under its sweep run when the next sweep reaps that sweep; a note of a live driver's stays."""
    from experiments.config.compose import expand
    from experiments.tracking.spool import Recorder
    from experiments.tracking.store import sweep_record

    tracking = {"uri": f"sqlite:///{tmp_path}/mlflow.db", "artifact_root": f"{tmp_path}/artifacts",
                "spool_dir": f"{tmp_path}/spool"}
    specs = expand(TINY + ["seed=0,1"])
    gone = subprocess.Popen(["true"])
    gone.wait()  # the killed driver's pid
    rec = Recorder(tracking)
    parents = {}
    for sweep_id, pid in (("dead", gone.pid), ("live", os.getpid())):
        srec = sweep_record("t-noted", sweep_id, specs, "infersweep sweep ...")
        srec["tags"]["driver"] = f"{socket.gethostname()}:{pid}"
        parents[sweep_id] = rec.start_sweep(srec)
        rec.note_running("t-noted", specs[0], parents[sweep_id], sweep_id)
    rec.note_running("t-noted", specs[1], parents["dead"], "dead")
    rec.done_running("dead", specs[1].index)  # that one's result was logged before the kill
    rec.close()

    nxt = Recorder(tracking)
    assert nxt.reap_stale_sweeps("t-noted") == 1
    nxt.close()
    trials, sweeps = _trials(_client(tracking["uri"]), "t-noted")
    assert {s.data.tags["sweep_id"]: s.info.status for s in sweeps} == {"dead": "KILLED", "live": "RUNNING"}
    (killed,) = trials
    assert killed.info.status == "KILLED" and killed.data.tags["config_hash"] == specs[0].config_hash
    assert killed.data.tags["mlflow.parentRunId"] == parents["dead"] and "SIGKILL" in killed.data.tags["error"]
    assert not Path(tracking["spool_dir"], "running", "dead").exists()
    assert [p.name for p in Path(tracking["spool_dir"], "running", "live").iterdir()] == [f"{specs[0].index:06d}.json"]
    assert Spool(Path(tracking["spool_dir"])).sweeps() == []  # notes are no results waiting for `sync`
    _client(tracking["uri"]).set_terminated(parents["live"])


def test_an_optimize_run_of_a_dead_driver_is_closed_with_its_trials(tmp_path):
    """`optimize` reaps through the Tracker (no Recorder): its dead parent run, the trial it was writing (RUNNING
    under it) and the trial it had only noted (in the spool, under a batch's own sweep id) all end KILLED; a live
    driver's trial run stays RUNNING."""
    from experiments.config.compose import expand
    from experiments.tracking.spool import Recorder
    from experiments.tracking.store import Tracker

    tracking = {"uri": f"sqlite:///{tmp_path}/mlflow.db", "artifact_root": f"{tmp_path}/artifacts",
                "spool_dir": f"{tmp_path}/spool"}
    specs = expand(TINY + ["seed=0,1"])
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead_driver, live_driver = f"{socket.gethostname()}:{gone.pid}", f"{socket.gethostname()}:{os.getpid()}"
    tracker = Tracker(tracking)
    exp = tracker.experiment_id("t-opt-reap")
    opt = tracker.client.create_run(exp, tags={"kind": "optimize", "driver": dead_driver}).info.run_id
    half = tracker.client.create_run(exp, tags={"kind": "trial", "driver": dead_driver, "sweep_id": "batch-1",
                                                "trial_index": "0", "mlflow.parentRunId": opt}).info.run_id
    live = tracker.client.create_run(exp, tags={"kind": "trial", "driver": live_driver}).info.run_id
    rec = Recorder(tracking)
    rec.note_running("t-opt-reap", specs[0], opt, "batch-1")  # its own run exists (half): no second record
    rec.note_running("t-opt-reap", specs[1], opt, "batch-1")  # never written: a KILLED record
    rec.close()
    assert Tracker(tracking).reap_stale_sweeps("t-opt-reap") == 1
    c = _client(tracking["uri"])
    assert c.get_run(opt).info.status == "KILLED"
    assert c.get_run(half).info.status == "KILLED" and "killed (SIGKILL)" in c.get_run(half).data.tags["error"]
    assert c.get_run(live).info.status == "RUNNING"
    noted = c.search_runs([exp], f"tags.trial_index = '{specs[1].index}' and tags.sweep_id = 'batch-1'")
    assert [(r.info.status, r.data.tags["mlflow.parentRunId"]) for r in noted] == [("KILLED", opt)]
    assert len(c.search_runs([exp], "tags.sweep_id = 'batch-1'")) == 2
    assert not list(Path(tracking["spool_dir"], "running").glob("*/*.json"))
    c.set_terminated(live)


def test_cluster_definitions_parse():
    import yaml

    root = Path(__file__).resolve().parents[1] / "cluster"
    up = yaml.safe_load((root / "ray-gpu.yaml").read_text())
    assert up["head_node_type"] in up["available_node_types"] and up["setup_commands"]
    rc = yaml.safe_load((root / "kuberay" / "raycluster.yaml").read_text())
    assert rc["kind"] == "RayCluster" and rc["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"]
    job = yaml.safe_load((root / "kuberay" / "rayjob.yaml").read_text())
    assert job["kind"] == "RayJob" and job["spec"]["entrypoint"].startswith("infersweep sweep")
    assert "cluster=existing" in job["spec"]["entrypoint"]


def test_tracker_sets_mlflow_http_settings_only_during_its_own_calls(tmp_path):
    """The HTTP timeout/retry settings a Tracker needs are in the environment while its request runs, and the
    process environment is what it was before and after."""
    import os
    import socket

    from experiments.tracking.store import Tracker

    keys = ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")
    before = {k: os.environ.get(k) for k in keys}
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t = Tracker({"uri": f"http://127.0.0.1:{port}", "artifact_root": str(tmp_path), "request_retries": 0,
                 "request_timeout_s": 3})
    assert {k: os.environ.get(k) for k in keys} == before
    seen = {}

    def probe(*_a, **_k):
        seen.update({k: os.environ.get(k) for k in keys})
        raise ConnectionError("probe")

    t.client._client.search_experiments = probe
    with pytest.raises(ConnectionError):
        t.client.search_experiments()
    assert seen == {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "3"}
    assert {k: os.environ.get(k) for k in keys} == before


@pytest.mark.parametrize("nth", [1, 2], ids=["sweep-run", "trial-run"])
def test_an_interrupt_as_the_store_creates_a_run_leaves_nothing_running(tmp_path, monkeypatch, nth):
    """Ctrl-C landing just after the store inserted a run, before its id came back (CI once saw a trial run left
    RUNNING by `kill` at that instant): the sweep still ends KILLED and no run stays RUNNING."""
    import signal

    from mlflow.tracking import MlflowClient

    real, calls = MlflowClient.create_run, []

    def create_then_interrupt(self, *a, **kw):
        run = real(self, *a, **kw)
        calls.append(run.info.run_id)
        if len(calls) == nth:  # the signal arrives inside the call, after the insert: where the race was
            os.kill(os.getpid(), signal.SIGINT)
        return run

    monkeypatch.setattr(MlflowClient, "create_run", create_then_interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    with pytest.raises(KeyboardInterrupt):
        run_sweep(TINY + [f"tracking.uri={uri}", f"tracking.spool_dir={tmp_path}/spool", "sweep_name=t-int",
                          "seed=0,1"], in_process=True, echo=lambda *_: None)
    monkeypatch.undo()
    assert len(calls) >= nth  # (a trial running at the interrupt gets its own KILLED run as well)
    runs = {r.info.run_id: r for r in _trials(_client(uri), "t-int")[0] + _trials(_client(uri), "t-int")[1]}
    assert set(runs) == set(calls)  # every run made is found, and none is left RUNNING
    assert {r.info.status for r in runs.values()} == {"KILLED"}
    assert "incomplete" in runs[calls[nth - 1]].data.tags  # the interrupted write is marked as such
