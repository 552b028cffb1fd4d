"""`infersweep ui`: a taken port fails at once, a server that cannot bind is caught from its log, the URL
opens the latest sweep's experiment, and every experiment the tracker writes to carries the tags that make
MLflow 3.x open it on its runs table. (The browser check of that URL is tests/test_dashboard.py.)"""
from __future__ import annotations

import json
import socket

import pytest

from experiments.tracking import dashboard
from experiments.cli import main
from experiments.tracking.store import Tracker
from experiments.tracking.server import MlflowServer, port_in_use


@pytest.fixture
def taken_port():
    """A real listening socket on a free port, as another server would hold it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_ui_on_a_port_in_use_fails_at_once_without_starting_a_server(taken_port, tracking_overrides, tracking_dir, capsys):
    assert main(["ui", *tracking_overrides, "--port", str(taken_port)]) == 1
    out, err = capsys.readouterr()
    assert f"error: port {taken_port} on 127.0.0.1 is not free (Address already in use)" in err
    assert "--port" in err and "http://" not in out  # no URL printed for a server that never runs
    assert not (tracking_dir / f"server-{taken_port}.log").exists()  # no server was started


def test_port_check_sees_a_wildcard_listener_and_frees_a_closed_port(taken_port):
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        assert port_in_use("127.0.0.1", s.getsockname()[1]) is not None
    assert port_in_use("127.0.0.1", taken_port) is not None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert port_in_use("127.0.0.1", port) is None


def test_a_server_that_cannot_bind_is_reported_from_its_log_not_after_it_exits(taken_port, tmp_path):
    """Past the port check (a race: someone binds in between), the real `mlflow server` logs "address
    already in use" and then lingers about a minute before exiting 0; launch() fails on the log line and
    ends the process group."""
    tracking = {"uri": f"sqlite:///{tmp_path}/mlflow.db", "artifact_root": str(tmp_path / "artifacts")}
    server = MlflowServer(tracking, port=taken_port, log_path=tmp_path / "server.log")
    with pytest.raises(RuntimeError) as e:
        server.launch(timeout_s=300)
    msg = str(e.value)
    assert msg.startswith(f"mlflow server failed to start on port {taken_port}: ") and "address already in use" in msg
    assert server.proc.poll() is not None


def test_tracker_tags_new_and_existing_experiments_and_keeps_an_edited_view(tracking, mlflow_client):
    tracker = Tracker(tracking)
    view_key = dashboard.VIEW_TAG_PREFIX + dashboard.VIEW_KEY
    new = mlflow_client.get_experiment(tracker.experiment_id("t-ui-new"))
    plain_id = mlflow_client.create_experiment("t-ui-plain")  # made by plain MLflow (or before the tags)
    edited_id = mlflow_client.create_experiment("t-ui-edited", tags={view_key: "{\"edited\": true}"})
    tracker.experiment_id("t-ui-plain")
    tracker.experiment_id("t-ui-edited")
    for exp in (new, mlflow_client.get_experiment(plain_id)):
        assert exp.tags[dashboard.KIND_TAG] == "custom_model_development"
        envelope = json.loads(exp.tags[view_key])  # the shape the UI's saved-view reader accepts
        assert envelope["name"] == "infersweep" and isinstance(envelope["createdAt"], int)
        state = json.loads(envelope["state"])
        assert state["selectedColumns"] == state["columnOrder"] == [
            "metrics.`tok per s`", "metrics.`TPOT ms`", "metrics.`TTFT ms`", "metrics.`unstable`", "metrics.`task_gate`",
            "metrics.`PPL`", "metrics.`KL`", "metrics.`mem MB`", "metrics.`own MB`", "tags.`unstable`"]
        assert set(state["columnWidths"]) == set(state["selectedColumns"])
        assert state["searchFilter"] == "tags.kind = 'trial'" and state["orderByAsc"] is False
        assert state["orderByKey"] == "metrics.`tok per s`"
    edited = mlflow_client.get_experiment(edited_id)
    assert edited.tags[view_key] == "{\"edited\": true}" and edited.tags[dashboard.KIND_TAG] == "custom_model_development"


def test_display_metrics_are_rounded_copies_in_readable_units():
    """The runs table's copies: 4 significant digits (integer digits kept), memory in MB, the 0/1 flag."""
    m = {"output_tok_s": 1039.90138, "tpot_ms_p50": 0.908339, "ttft_ms_p50": 130.681909, "ppl": 25.3002709,
         "peak_mem_bytes": 2778669056, "task_score.mmlu_x": 1 / 3, "task_score.niah_single.d20": 1.0, "itl_ms_p50": 1.0}
    assert dashboard.display_metrics(m, {}) == {"tok per s": 1040, "TPOT ms": 0.9083, "TTFT ms": 130.7, "PPL": 25.3,
                                                "mem MB": 2779, "acc mmlu_x": 0.3333, "unstable": 0}
    assert dashboard.display_metrics(m, {"unstable": "output_tok_s CV 14.2% > 10%"})["unstable"] == 1
    # a variant of an interleaved group logs its own footprint, not a process's peak: its own column
    paired = dashboard.display_metrics(dict(m, group_peak_mem_bytes=3e9), {})
    assert paired["own MB"] == 2779 and "mem MB" not in paired
    # no "/" in a display name: MLflow's charts read it as a group separator
    assert not any("/" in name for name, _, _ in dashboard.DISPLAY_METRICS)
    assert dashboard.readable(123456.7) == 123457 and dashboard.readable(0.000123456) == 0.0001235
    assert dashboard.readable(0.0) == 0.0


def _columns(exp) -> list[str]:
    state = json.loads(json.loads(exp.tags[dashboard.VIEW_TAG_PREFIX + dashboard.VIEW_KEY])["state"])
    assert state["columnOrder"] == state["selectedColumns"]
    return state["selectedColumns"]


def test_saved_view_shows_the_gate_and_each_task_score_and_grows_with_new_tasks(tracking, mlflow_client):
    """A sweep with eval.tasks: the view has task_gate followed by `acc <task>` per task; a later sweep
    with another task adds its column to a view infersweep wrote, never to one the user rearranged."""
    tracker = Tracker(tracking)
    eid = tracker.experiment_id("t-ui-tasks", ["mmlu_x", "niah_single"])
    cols = _columns(mlflow_client.get_experiment(eid))
    gate = cols.index("metrics.`task_gate`")
    assert cols[gate:gate + 4] == ["metrics.`task_gate`", "metrics.`acc mmlu_x`",
                                   "metrics.`acc niah_single`", "metrics.`PPL`"]
    assert tracker.experiment_id("t-ui-tasks", ["niah_single"]) == eid  # nothing new: no write
    Tracker(tracking).experiment_id("t-ui-tasks", ["bigbench_emoji_movie"])  # a later sweep, another process
    cols = _columns(mlflow_client.get_experiment(eid))
    assert cols[gate:gate + 4] == ["metrics.`task_gate`", "metrics.`acc bigbench_emoji_movie`",
                                   "metrics.`acc mmlu_x`", "metrics.`acc niah_single`"]
    # a view from before task columns existed gains them; a rearranged one is the user's and stays
    legacy = json.dumps({"name": "infersweep", "createdAt": 1, "updatedAt": 1, "state": json.dumps(
        dict(dashboard.view_state(), selectedColumns=["metrics.`tok per s`", "metrics.`PPL`"],
             columnOrder=["metrics.`tok per s`", "metrics.`PPL`"]))})
    grown = json.loads(json.loads(dashboard.with_task_columns(legacy, ["t1"]))["state"])
    assert grown["selectedColumns"] == ["metrics.`tok per s`", "metrics.`task_gate`", "metrics.`acc t1`", "metrics.`PPL`"]
    assert grown["columnWidths"]["metrics.`acc t1`"] == dashboard.METRIC_WIDTH
    moved = json.dumps({"name": "infersweep", "state": json.dumps(
        dict(dashboard.view_state(), selectedColumns=["metrics.`PPL`", "metrics.`tok per s`"],
             columnOrder=["metrics.`PPL`", "metrics.`tok per s`"]))})
    # a view of the full-precision columns (infersweep's before the display metrics) is left as it was:
    # its experiment's runs have no display copies
    old = json.dumps({"name": "infersweep", "state": json.dumps(
        dict(dashboard.view_state(), selectedColumns=["metrics.`output_tok_s`", "metrics.`ppl`"],
             columnOrder=["metrics.`output_tok_s`", "metrics.`ppl`"]))})
    assert dashboard.with_task_columns(old, ["t1"]) is None
    assert dashboard.with_task_columns(moved, ["t1"]) is None
    assert dashboard.with_task_columns(json.dumps({"edited": True}), ["t1"]) is None
    assert dashboard.with_task_columns(legacy, []) is None


def test_latest_experiment_is_the_one_of_the_newest_sweep(tmp_path):
    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    assert dashboard.latest_experiment(c) is None  # only MLflow's empty Default experiment
    a, b, late = (c.create_experiment(n, artifact_location=(tmp_path / n).as_uri()) for n in ("a", "b", "late"))
    c.create_run(a, start_time=1_000, tags={"kind": "sweep"})
    c.create_run(b, start_time=2_000, tags={"kind": "sweep"})
    c.create_run(late, start_time=3_000, tags={"kind": "trial"})  # a lone `infersweep run`, no sweep
    assert dashboard.latest_experiment(c).experiment_id == b
    assert dashboard.runs_url("http://127.0.0.1:5000/", b) == (
        f"http://127.0.0.1:5000/#/experiments/{b}/runs?workflowType=machine_learning&viewStateShareKey=infersweep")


def test_ui_against_a_running_tracking_server_prints_its_runs_url(mlflow_server, capsys):
    """tracking.uri=http://...: that server already serves the UI; `ui` tags and prints, starts nothing."""
    from mlflow.tracking import MlflowClient

    c = MlflowClient(mlflow_server)
    eid = c.create_experiment("t-ui-remote")
    c.set_terminated(c.create_run(eid, tags={"kind": "sweep"}).info.run_id)
    capsys.readouterr()  # MLflow's own "View run at" lines
    assert main(["ui", f"tracking.uri={mlflow_server}"]) == 0
    assert capsys.readouterr().out.strip() == dashboard.runs_url(mlflow_server, eid)
    assert c.get_experiment(eid).tags[dashboard.KIND_TAG] == "custom_model_development"
    # an optimize run is not in the saved view (trial runs only): its own page is printed by its URL
    opt = c.create_run(eid, tags={"kind": "optimize"}).info.run_id
    c.set_terminated(opt)
    capsys.readouterr()
    assert main(["ui", f"tracking.uri={mlflow_server}"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == dashboard.runs_url(mlflow_server, eid)
    assert lines[1].endswith(dashboard.run_url(mlflow_server, eid, opt)) and "optimize run" in lines[1]
