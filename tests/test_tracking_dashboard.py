"""What the dashboard reads, without a browser (tests/test_dashboard.py drives the UI itself): short run names
from the sweep's varying axes, the headline metrics first on a run's page, an `optimize` run's description
(chain table, final hash) and its trials named and tagged by chain step, `ui` opening the latest experiment of
any kind. Real tiny model, real MLflow store of this module, in-process trials."""
from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from conftest import TINY
from experiments.cli import main
from experiments.run.sweep import run_sweep
from experiments.tracking.dashboard import (CANDIDATE_TAG, DECISION_TAG, METRIC_COLUMNS, NOTE_TAG, ROLE_TAG, STEP_TAG,
                                            latest_experiment, short_name)


def test_short_names_keep_only_what_tells_the_rows_apart():
    assert short_name({"kv_cache": "contiguous", "attention": "sdpa", "workload.context_len": "512",
                       "model.dtype": "bfloat16"}) == "kv=on sdpa ctx=512 bf16"
    assert short_name({"kv_cache": "paged", "model.dtype": "float32"}) == "kv=paged fp32"
    assert short_name({"quant": "int8-weight", "engine_variant": "llamacpp-q8_0", "speculative": "prompt-lookup",
                       "workload.batch_size": "8"}) == "int8-weight llamacpp-q8_0 spec=prompt-lookup bs=8"
    assert short_name({"model.path": "tiny://llama"}) == "model.path=tiny://llama"  # unknown keys stay whole
    assert short_name({}) == ""


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    d = tmp_path_factory.mktemp("dash-store")
    over = TINY + [f"tracking.uri=sqlite:///{d}/mlflow.db", f"tracking.artifact_root={d}/artifacts",
                   f"tracking.spool_dir={d}/spool"]
    return over, MlflowClient(f"sqlite:///{d}/mlflow.db")


@pytest.fixture(scope="module")
def names_sweep(store):
    over, _ = store
    return run_sweep(over + ["sweep_name=t-names", "kv_cache=off,contiguous", "attention=eager,sdpa"], in_process=True,
                     echo=lambda *_: None)


def test_trial_runs_are_named_short_and_list_the_headline_metrics_first(store, names_sweep):
    _, client = store
    res = names_sweep
    names = {client.get_run(r["run_id"]).info.run_name for r in res.rows}
    assert names == {"kv=off eager", "kv=off sdpa", "kv=on eager", "kv=on sdpa"}
    run = client.get_run(res.rows[0]["run_id"])
    assert run.data.tags["swept"] == "kv_cache=off attention=eager"  # the full key=value form, for the report
    shown = [m for m in METRIC_COLUMNS if m in run.data.metrics]
    # a run's page lists the metrics in the order they were logged: the rounded headline copies lead
    assert list(run.data.metrics)[:len(shown)] == shown and len(run.data.metrics) > 50


@pytest.fixture(scope="module")
def optimized(store):
    over, client = store
    rc = main(["optimize", *over, "sweep_name=t-opt-view", "kv_cache=off,contiguous", "eval=none",
               "optimize.gate.enabled=false", "optimize.max_trials=3", "optimize.remeasure=0", "optimize.rounds=3",
               "--in-process"])
    assert rc == 0
    exp = client.get_experiment_by_name("t-opt-view")
    (opt,) = client.search_runs([exp.experiment_id], "tags.kind = 'optimize'")
    return exp, opt


def test_the_optimize_run_describes_its_chain_and_names_its_trials_by_step(store, optimized):
    _, client = store
    exp, opt = optimized
    note = opt.data.tags[NOTE_TAG]
    final = opt.data.tags["final_config_hash"]
    assert f"`{final[:12]}`" in note and f"infersweep reproduce {final[:12]}" in note
    assert "| 0 baseline | kv_cache=off | baseline |" in note and "| 1 KV cache | kv_cache=contiguous |" in note
    trials = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{opt.info.run_id}'")
    by_name = {t.info.run_name: t.data.tags for t in trials}
    assert by_name["0 baseline: off"][ROLE_TAG] == "baseline" and by_name["0 baseline: off"][STEP_TAG] == "0"
    cand, inc = by_name["1 KV cache: contiguous"], by_name["1 KV cache: incumbent vs contiguous"]
    assert cand[ROLE_TAG] == "candidate" and inc[ROLE_TAG] == "incumbent"
    assert cand[STEP_TAG] == inc[STEP_TAG] == "1" and cand[CANDIDATE_TAG] == "kv_cache=contiguous"
    assert cand[DECISION_TAG] == inc[DECISION_TAG] and cand[DECISION_TAG] in note
    assert not [n for n in by_name if n.startswith("trial ")]  # every trial of the chain is named


def test_ui_opens_the_latest_experiment_of_any_kind(store, names_sweep, optimized):
    _, client = store
    exp, _ = optimized  # an optimize run, started after the sweep (fixture order)
    sweep_exp = client.get_run(names_sweep.parent_run_id).info.experiment_id
    assert sweep_exp != exp.experiment_id and latest_experiment(client).experiment_id == exp.experiment_id


def test_the_ui_front_forwards_everything_and_gives_the_shell_the_browser_defaults(mlflow_server):
    """`infersweep ui`'s front (tracking/ui_front.py): MLflow's API, reads and writes, answers through it as from the
    server itself; the UI's HTML shell gains the script that sets MLflow's own browser keys (Model training mode,
    the Assistant panel opened once and closed) where the browser has none."""
    import urllib.request

    from experiments.tracking.server import free_port
    from experiments.tracking.ui_front import DEFAULTS, UiFront, with_defaults

    assert with_defaults(b"<html><head><title>x</title></head></html>").startswith(b"<html><head><script>")
    assert with_defaults(b"no head") == b"no head"
    port = free_port()
    front = UiFront("127.0.0.1", port).start(mlflow_server)
    try:
        url = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(url + "/", timeout=60) as r:
            shell = r.read().decode()
        with urllib.request.urlopen(mlflow_server + "/", timeout=60) as r:
            plain = r.read().decode()
        assert "<script>" in shell and all(k in shell for k in DEFAULTS) and not any(k in plain for k in DEFAULTS)
        assert shell.replace(shell[shell.index("<script>(function"):shell.index("</script>") + 9], "") == plain
        client = MlflowClient(url)  # the tracking API through the front: a write, then reads
        exp = client.create_experiment("t-through-front")
        run = client.create_run(exp, run_name="through")
        client.log_metric(run.info.run_id, "m", 1.5)
        assert MlflowClient(mlflow_server).get_run(run.info.run_id).data.metrics == {"m": 1.5}
        with urllib.request.urlopen(url + "/health", timeout=60) as r:
            assert r.status == 200
    finally:
        front.stop()
