"""Ray at scale, for real, on one machine: a two-node cluster (ray.cluster_utils.Cluster, each node its own
raylet with its own resources), fake GPUs, warm workers, Ctrl-C + resume and (slow tier) a killed node, all
recorded through a real `mlflow server`. The scheduling decisions themselves (affinity, retries and their
bound, placement limits and timeouts) are checked deterministically, without Ray, in test_dispatcher.py."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cluster import Job, Placement, TaskFailure, capacity, placement, run_on_ray
from cluster.ray_pool import classify
from experiments.config.compose import PROJECT_ROOT
from experiments.run.sweep import run_sweep, run_specs
from experiments.config.compose import expand

from conftest import FAKE_GPUS, TINY

# ~1 s per trial on the tiny model, so a kill lands mid-trial
SLOW = ["workload.max_new_tokens=300", "workload.repeats=2", "eval.enabled=false"]


# --- placement arithmetic (no Ray needed) -------------------------------------------------------------
def _node(cpu, gpu=0, **res):
    return {"NodeID": f"n{cpu}{gpu}{sorted(res)}", "Alive": True, "Resources": {"CPU": cpu, "GPU": gpu, "memory": 64e9, **res}}


def test_placement_from_config_and_capacity():
    p = placement({"num_cpus_per_trial": 1, "num_gpus_per_trial": 1, "memory_per_trial_gb": 2,
                   "resources": {"accel": 1}, "isolation": "shared", "max_retries": 3})
    assert p.actor_options() == {"num_cpus": 1.0, "num_gpus": 1.0, "max_restarts": 0, "memory": 2 * 1024**3,
                                 "resources": {"accel": 1.0}}
    nodes = [_node(8, 4, accel=4), _node(8, 2, accel=1), _node(16)]
    assert capacity(p, nodes) == 4 + 1 + 0  # GPUs, then the custom resource, bound per node
    assert capacity(Placement(num_cpus=2), nodes) == 4 + 4 + 8
    assert capacity(Placement(num_cpus=2, isolation="exclusive-node"), nodes) == 3
    assert capacity(Placement(num_cpus=1, num_gpus=1, isolation="exclusive-node"), nodes) == 2


def test_deterministic_errors_are_not_retried():
    import ray.exceptions as rex

    assert classify(rex.OutOfMemoryError("Task was killed due to the node running low on memory."))[1] is False
    assert classify(rex.TaskCancelledError())[1] is False
    assert classify(rex.ActorDiedError())[1] is True
    assert classify(rex.WorkerCrashedError())[1] is True


def test_invalid_placement_config_is_rejected(tiny_overrides):
    from experiments.config.compose import SweepError

    with pytest.raises(SweepError) as e:
        expand(tiny_overrides + ["cluster.isolation=whole-rack", "+cluster.resources.accel=0"])
    msg = str(e.value)
    assert "cluster.isolation" in msg and "cluster.resources.accel" in msg
    with pytest.raises(SweepError) as e:  # config is data: no key can name code to import
        expand(tiny_overrides + ["+model._target_=os.system"])
    assert "model._target_: unknown key" in str(e.value)


# --- a real two-node cluster --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_node():
    """head: 2 CPUs; node B: 2 CPUs + 2 fake GPUs. Custom resource `pool` (1 per node) pins one worker per
    node when asked for; `killpool` lives on the head and on node C, which the node-kill test adds."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=2, include_dashboard=False, resources={"pool": 1, "killpool": 1}))
    gpu_node = c.add_node(num_cpus=2, num_gpus=2, resources={"pool": 1})
    ray.init(address=c.address, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    c.wait_for_nodes()
    yield c, gpu_node
    ray.shutdown()
    c.shutdown()


def _runs(client, sweep_name):
    exp = client.get_experiment_by_name(sweep_name)
    return [] if exp is None else client.search_runs([exp.experiment_id], max_results=1000)


def _trial_runs(client, sweep_name, sweep_id=None):
    runs = [r for r in _runs(client, sweep_name) if r.data.tags.get("kind") == "trial"]
    return [r for r in runs if sweep_id is None or r.data.tags.get("sweep_id") == sweep_id]


def _overlaps(intervals):
    """Largest number of [start, end) intervals open at once."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    cur = best = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


@pytest.fixture(scope="module")
def server_client(mlflow_server):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=mlflow_server)


@pytest.fixture(scope="module")
def server_overrides(mlflow_server, tmp_path_factory):
    spool = tmp_path_factory.mktemp("spool-cluster")
    return TINY + [f"tracking.uri={mlflow_server}", f"tracking.spool_dir={spool}"]


@pytest.mark.slow  # a real multi-process cluster/server or a full re-probe: the slow tier (CI runs it)
def test_two_node_sweep_exclusive_nodes_warm_workers_through_server(two_node, server_overrides, server_client):
    c, gpu_node = two_node
    res = run_sweep(server_overrides + ["sweep_name=t-two-node", "cluster.isolation=exclusive-node",
                                        "kv_cache=off,contiguous", "workload.context_len=16,24,32"], echo=lambda *_: None)
    assert [r["status"] for r in res.rows] == ["FINISHED"] * 6
    assert res.spooled == 0
    runs = _trial_runs(server_client, "t-two-node", res.sweep_id)
    assert len(runs) == 6 and all(r.info.status == "FINISHED" for r in runs)
    nodes = {r.data.tags["env.node_id"] for r in runs}
    assert nodes == {n["NodeID"] for n in __import__("ray").nodes() if n["Alive"]}  # both nodes ran trials
    for node in nodes:  # exclusive-node: never two trials at once on one node
        spans = [(r.info.start_time, r.info.end_time) for r in runs if r.data.tags["env.node_id"] == node]
        assert _overlaps(spans) == 1
    # warm workers: one load per worker (same model + attention), the other trials reuse it
    loads = [r.data.metrics["model_load_s"] for r in runs]
    assert sum(1 for x in loads if x > 0) == len(nodes)
    assert sorted(r.data.tags["env.model_cache"] for r in runs).count("hit") == 6 - len(nodes)
    # artifacts went through the server's proxy: nothing but the server touched the store's disk
    arts = {a.path for a in server_client.list_artifacts(runs[0].info.run_id)}
    assert {"config.yaml", "token_ids.json"} <= arts
    assert server_client.get_run(res.parent_run_id).info.status == "FINISHED"


def _assert_gpus_shared_out(runs, n_gpus):
    devices = [r.data.tags["env.cuda_visible_devices"] for r in runs]
    assert set(devices) == {str(i) for i in range(n_gpus)}  # every GPU got work
    spans = [(r.info.start_time, r.info.end_time) for r in runs]
    assert _overlaps(spans) <= n_gpus  # never more trials than GPUs
    for i, a in enumerate(runs):  # trials running at the same time hold different GPUs
        for b in runs[i + 1:]:
            if a.info.start_time < b.info.end_time and b.info.start_time < a.info.end_time:
                assert a.data.tags["env.cuda_visible_devices"] != b.data.tags["env.cuda_visible_devices"]


def test_fake_gpus_distinct_devices_never_more_trials_than_gpus(ray_local, tiny_overrides, mlflow_client):
    """One node with 2 fake GPUs (the session's Ray) and CPU to spare: a GPU each, at most two at once."""
    res = run_sweep(tiny_overrides + ["sweep_name=t-gpu-local", "cluster.num_gpus_per_trial=1",
                                      "cluster.num_cpus_per_trial=0.5", "workload.max_new_tokens=30",
                                      "eval.enabled=false", "seed=0,1,2,3"], echo=lambda *_: None)
    assert [r["status"] for r in res.rows] == ["FINISHED"] * 4
    runs = _trial_runs(mlflow_client, "t-gpu-local", res.sweep_id)
    assert len(runs) == 4
    _assert_gpus_shared_out(runs, FAKE_GPUS)


@pytest.mark.slow  # a real multi-process cluster/server or a full re-probe: the slow tier (CI runs it)
def test_fake_gpus_only_on_the_node_that_has_them(two_node, server_overrides, server_client):
    c, gpu_node = two_node
    res = run_sweep(server_overrides + ["sweep_name=t-gpu", "cluster.num_gpus_per_trial=1", "cluster.num_cpus_per_trial=0.5",
                                        "workload.max_new_tokens=60", "seed=0,1,2,3,4,5"], echo=lambda *_: None)
    assert [r["status"] for r in res.rows] == ["FINISHED"] * 6
    runs = _trial_runs(server_client, "t-gpu", res.sweep_id)
    assert {r.data.tags["env.node_id"] for r in runs} == {gpu_node.node_id}  # only node B has GPUs
    _assert_gpus_shared_out(runs, 2)


def _kill_later(delay, fn):
    t = threading.Timer(delay, fn)
    t.daemon = True
    t.start()
    return t


@pytest.mark.slow
def test_killed_node_trials_move_to_another_node(two_node, server_overrides, server_client):
    """The one real crash: a node dies mid-trial, Ray reports the actor lost, the trial reruns elsewhere and
    is recorded once."""
    c, _ = two_node
    victim = c.add_node(num_cpus=2, resources={"killpool": 1})
    c.wait_for_nodes()
    specs = expand(server_overrides + SLOW + ["sweep_name=t-kill-node", "+cluster.resources.killpool=1",
                                              "cluster.max_retries=2", "seed=0,1,2,3"])
    hit = {}

    def on_start(spec, meta):
        if meta["node_id"] == victim.node_id and not hit:
            hit["index"] = spec.index
            _kill_later(1.0, lambda: c.remove_node(victim, allow_graceful=False))

    res = run_specs(specs, "test", echo=lambda *_: None, on_start=on_start)
    assert hit, "no trial was placed on the node to kill"
    assert [r["status"] for r in res.rows] == ["FINISHED"] * 4
    runs = _trial_runs(server_client, "t-kill-node", res.sweep_id)
    assert len(runs) == 4 and len({r.data.tags["config_hash"] for r in runs}) == 4
    assert all(r.info.status == "FINISHED" for r in runs)
    moved = next(r for r in runs if r.data.tags["config_hash"] == specs[hit["index"]].config_hash)
    assert moved.data.tags["attempts"] == "2" and moved.data.tags["env.node_id"] != victim.node_id
    assert "attempt_errors.txt" in {a.path for a in server_client.list_artifacts(moved.info.run_id)}
    assert all(r.data.tags["attempts"] == "1" for r in runs if r is not moved)


def _signal_sweep_after(args: list[str], done: int, sig: int) -> tuple[int, str]:
    """Run the sweep command `args` and send it `sig` once its own progress line counts `done` trials done (its
    MLflow records can lag behind on a loaded machine: polling the store let a whole sweep finish before the
    signal). (exit code, output)."""
    # SIGINT at its default in the child, as in a terminal: a shell's background job (`.ci/run &`, nohup) starts
    # with SIGINT ignored, which Python and every child inherit -- Ctrl-C would then be a no-op and the sweep finish
    proc = subprocess.Popen(args, cwd=PROJECT_ROOT, env=dict(os.environ, PYTHONPATH=str(PROJECT_ROOT)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen: list[str] = []
    reader = threading.Thread(target=lambda: seen.extend(iter(lambda: proc.stdout.read(1), "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and f"done={done}" not in "".join(seen):
        assert proc.poll() is None, "".join(seen)
        time.sleep(0.05)
    proc.send_signal(sig)
    proc.wait(timeout=120)
    reader.join(timeout=10)
    return proc.returncode, "".join(seen)


@pytest.mark.slow  # a real multi-process cluster/server or a full re-probe: the slow tier (CI runs it)
def test_ctrl_c_then_resume_skips_finished_and_force_reruns(two_node, mlflow_server, server_client, tmp_path, capsys):
    c, _ = two_node
    args = [sys.executable, "-m", "experiments.cli", "sweep", *TINY, *SLOW, f"tracking.uri={mlflow_server}",
            f"tracking.spool_dir={tmp_path}", f"cluster.address={c.address}", "+cluster.resources.pool=1",
            "sweep_name=t-resume", "seed=range(0,6)",
            "workload.repeats=8"]  # ~8x longer trials: on a quiet machine the sweep must still be mid-way at SIGINT
    rc, out = _signal_sweep_after(args, 2, signal.SIGINT)
    assert rc == 130, out
    runs = _runs(server_client, "t-resume")
    assert runs and not [r for r in runs if r.info.status == "RUNNING"], "a run was left RUNNING"
    finished = {r.data.tags["config_hash"] for r in _trial_runs(server_client, "t-resume") if r.info.status == "FINISHED"}
    assert 2 <= len(finished) < 6
    parent = [r for r in runs if r.data.tags.get("kind") == "sweep"]
    assert [p.info.status for p in parent] == ["KILLED"]

    # the same command again (in this process: it is already connected to the same cluster)
    from experiments.cli import main

    assert main(args[3:]) == 0
    assert f"skipping {len(finished)} trial(s) already FINISHED" in capsys.readouterr().out
    trials = _trial_runs(server_client, "t-resume")
    fin = [r.data.tags["config_hash"] for r in trials if r.info.status == "FINISHED"]
    assert len(fin) == 6 and len(set(fin)) == 6  # exactly one FINISHED run per hash
    assert all(r.info.status in ("FINISHED", "KILLED") for r in trials)

    assert main(args[3:] + ["--force"]) == 0
    assert "skipping" not in capsys.readouterr().out
    fin = [r.data.tags["config_hash"] for r in _trial_runs(server_client, "t-resume") if r.info.status == "FINISHED"]
    assert len(fin) == 12 and len(set(fin)) == 6


@pytest.mark.slow  # a real multi-process cluster: the slow tier (CI runs it)
def test_sigterm_ends_a_sweep_like_ctrl_c(two_node, tmp_path):
    """`kill PID` of a sweep: exit 130, the sweep run KILLED, no run left RUNNING, finished trials kept (Ray's
    own SIGTERM handler, installed when the driver connects, used to abort the process and leave runs RUNNING)."""
    from mlflow.tracking import MlflowClient

    c, _ = two_node
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    args = [sys.executable, "-m", "experiments.cli", "sweep", *TINY, *SLOW, f"tracking.uri={uri}",
            f"tracking.spool_dir={tmp_path}/spool", f"cluster.address={c.address}", "+cluster.resources.pool=1",
            "sweep_name=t-sigterm", "seed=range(0,6)", "workload.repeats=8"]
    rc, out = _signal_sweep_after(args, 1, signal.SIGTERM)
    assert rc == 130, out
    assert "interrupted: the trials that finished are recorded" in out and "the same command again resumes" in out
    # the table of what was recorded, as a finished sweep prints it (not a bare "interrupted")
    assert re.search(r"^hash\s.*status\s*$", out, re.M) and re.search(r"^[0-9a-f]{12}\s.*FINISHED\s*$", out, re.M), out
    runs = _runs(MlflowClient(uri), "t-sigterm")
    assert runs and not [r for r in runs if r.info.status == "RUNNING"], "a run was left RUNNING"
    assert [r.info.status for r in runs if r.data.tags.get("kind") == "sweep"] == ["KILLED"]
    assert 1 <= sum(r.info.status == "FINISHED" for r in runs if r.data.tags.get("kind") == "trial") < 6


def test_run_on_ray_generic_function_and_unplaceable(ray_local):
    """The placement layer alone (no engine): results in, and a demand no node has fails fast."""
    results = {}

    def on_result(item, res, meta):
        results[item] = (res, meta)
        return not isinstance(res, TaskFailure)

    run_on_ray(abs, Job([-1, -2, -3], lambda i: Placement(num_cpus=0.5), on_result, desc="abs"))
    assert {k: v[0] for k, v in results.items()} == {-1: 1, -2: 2, -3: 3}
    results.clear()
    run_on_ray(abs, Job([-4], lambda i: Placement(num_cpus=0.5, resources=(("nowhere", 1.0),)), on_result,
                        placement_timeout_s=2))
    res, _ = results[-4]
    assert isinstance(res, TaskFailure) and res.kind == "unplaceable"


# --- what a SIGKILLed driver's embedded Ray leaves (cluster/leftovers.py) -----------------------------
# A process that, like Ray's agents, ignores SIGTERM and keeps a log file open inside its session dir
STUBBORN = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "f = open(sys.argv[1], 'a'); print('up', flush=True); time.sleep(600)")


def _stubborn(log: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", STUBBORN, log], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "up"
    return p


def test_leftovers_of_a_dead_driver_are_ended_by_session_never_by_name(tmp_path):
    """Only the processes of the dead driver's recorded session end: not a live driver's, not one merely
    running the same program."""
    import json

    from cluster.leftovers import RECORDS, _start_time, end_dead_sessions, session_pids

    ray_tmp = tmp_path / "ray"
    dead_session, live_session = ray_tmp / "session_a_1", ray_tmp / "session_a_12"  # one a prefix of the other
    for s in (dead_session, live_session):
        (s / "logs").mkdir(parents=True)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a driver that is no more
    (ray_tmp / RECORDS).mkdir()
    (ray_tmp / RECORDS / f"{gone.pid}.json").write_text(json.dumps(
        {"driver_pid": gone.pid, "driver_start": "1", "session_dir": str(dead_session)}))
    (ray_tmp / RECORDS / f"{os.getpid()}.json").write_text(json.dumps(  # this process: a driver still running
        {"driver_pid": os.getpid(), "driver_start": _start_time(os.getpid()), "session_dir": str(live_session)}))
    left = [_stubborn(str(dead_session / "logs" / f"agent{i}.log")) for i in range(2)]
    live = _stubborn(str(live_session / "logs" / "agent.log"))
    bystander = _stubborn(str(tmp_path / "elsewhere.log"))  # the same program, another session
    try:
        assert sorted(session_pids(str(dead_session))) == sorted(p.pid for p in left)
        said: list[str] = []
        assert end_dead_sessions(str(ray_tmp), said.append) == 2
        assert [p.wait(timeout=30) for p in left] == [-signal.SIGKILL] * 2
        assert live.poll() is None and bystander.poll() is None
        (line,) = said
        assert line.startswith(f"ended 2 process(es) that the killed sweep driver {gone.pid} left of its Ray session "
                               "session_a_1")
        assert sorted(p.name for p in (ray_tmp / RECORDS).iterdir()) == [f"{os.getpid()}.json"]  # the dead one's done
    finally:
        for p in (*left, live, bystander):
            p.kill()
            p.wait()


@pytest.mark.slow  # two real sweeps, each starting its own embedded Ray: the slow tier (CI runs it)
def test_next_sweep_ends_what_a_sigkilled_driver_left(tmp_path):
    """A sweep driver killed with SIGKILL mid-sweep leaves Ray's agents running (they ignore SIGTERM); the next
    sweep ends every process of that Ray session, says so, marks the killed sweep and the trials it was running
    KILLED, and runs the rest.
    Neither prints Ray's token-authentication notice, and the embedded cluster keeps authentication on."""
    from mlflow.tracking import MlflowClient

    from cluster.leftovers import RECORDS, session_pids

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    args = [sys.executable, "-m", "experiments.cli", "sweep", *TINY, *SLOW, f"tracking.uri={uri}",
            f"tracking.spool_dir={tmp_path}/spool", "cluster.local_num_cpus=1", "sweep_name=t-sigkill",
            "seed=range(0,4)", "workload.repeats=8"]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}  # as a user runs it
    env["PYTHONPATH"] = str(PROJECT_ROOT)
    proc = subprocess.Popen(args, cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []
    reader = threading.Thread(target=lambda: seen.extend(iter(lambda: proc.stdout.read(1), "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 300
    running = tmp_path / "spool" / "running"  # the driver's notes of the trials it runs now
    while time.monotonic() < deadline and not ("done=1" in "".join(seen) and list(running.glob("*/*.json"))):
        assert proc.poll() is None, "".join(seen)
        time.sleep(0.05)
    interrupted = sorted(p.name for p in running.glob("*/*.json"))
    record = Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray" / RECORDS / f"{proc.pid}.json"
    session = json.loads(record.read_text())["session_dir"]
    ours = session_pids(session)
    assert ours, "no process of the driver's Ray session found"
    modes = {_environ(p).get("RAY_AUTH_MODE") for p in ours} - {None}
    assert modes == {"token"}, modes  # authentication on, though the user set nothing
    proc.kill()
    proc.wait(timeout=60)
    reader.join(timeout=10)
    first = "".join(seen)
    left = session_pids(session)
    assert left, "the premise: a SIGKILLed driver leaves processes of its Ray session running"

    nxt = subprocess.run(args, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert nxt.returncode == 0, nxt.stdout + nxt.stderr
    assert session_pids(session) == [], "a process of the killed driver's Ray session survived the next sweep"
    survivors = [p for p in ours if Path(f"/proc/{p}").exists()]
    assert not survivors
    # Ray 2.60 leaves its DashboardAgent and RuntimeEnvAgent (here they give up by themselves after a minute or
    # so); the next sweep ends them before it starts its own Ray, and says so in one line
    lines = [x for x in nxt.stdout.splitlines() if f"the killed sweep driver {proc.pid} left" in x]
    assert len(lines) == 1 and lines[0].startswith("ended ") and Path(session).name in lines[0], (left, nxt.stdout)
    assert not record.exists()
    for out in (first, nxt.stdout + nxt.stderr):
        assert "Token authentication is enabled" not in out and "RAY_AUTH_MODE" not in out, out

    runs = _runs(MlflowClient(uri), "t-sigkill")
    assert not [r for r in runs if r.info.status == "RUNNING"], "a run was left RUNNING"
    sweeps = sorted((r for r in runs if r.data.tags.get("kind") == "sweep"), key=lambda r: r.info.start_time)
    assert [r.info.status for r in sweeps] == ["KILLED", "FINISHED"]
    assert sweeps[0].data.tags.get("reaped") == "driver process gone"
    trials = [r for r in runs if r.data.tags.get("kind") == "trial"]
    killed = [r for r in trials if r.data.tags.get("sweep_id") == sweeps[0].data.tags["sweep_id"] and r.info.status == "KILLED"]
    assert interrupted and len(killed) == len(interrupted)  # the trials it was running: KILLED, by the next sweep
    assert all(r.data.tags.get("mlflow.parentRunId") == sweeps[0].info.run_id for r in killed)
    assert all("killed (SIGKILL)" in r.data.tags.get("error", "") for r in killed), [r.data.tags for r in killed]
    fin = [r.data.tags["config_hash"] for r in trials if r.info.status == "FINISHED"]
    assert len(fin) == 4 and len(set(fin)) == 4  # the interrupted trials ran again, the finished ones did not
    assert not running.exists() or not any(running.iterdir())


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


AUTH_PROBE = """
from cluster import ClusterConfig, ensure_ray
ensure_ray(ClusterConfig(local_num_cpus=1))
from ray._raylet import AuthenticationMode, get_authentication_mode
print("token auth:", get_authentication_mode() == AuthenticationMode.TOKEN)
"""


def test_embedded_ray_keeps_token_auth_on_without_its_notice():
    """Started as a user starts it (no RAY_AUTH_MODE): authentication on, Ray's notice about it not shown. The
    slow tier checks a whole sweep's output (test_next_sweep_ends_what_a_sigkilled_driver_left)."""
    from cluster.ray_pool import TOKEN_AUTH_NOTICE

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    r = subprocess.run([sys.executable, "-c", AUTH_PROBE], cwd=PROJECT_ROOT, capture_output=True, text=True,
                       env=dict(env, PYTHONPATH=str(PROJECT_ROOT)), timeout=600)
    assert r.returncode == 0, r.stderr
    assert "token auth: True" in r.stdout
    assert TOKEN_AUTH_NOTICE not in r.stdout + r.stderr, r.stderr  # it shows without the filter (Ray 2.60)
