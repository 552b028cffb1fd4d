"""End to end through real Ray and a real MLflow store: sweep, failure isolation, reproduce, CLI."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from experiments.cli import main
from experiments.run.reproduce import reproduce
from experiments.run.sweep import run_sweep
from experiments.tracking.store import TOKENS_ARTIFACT

REQUIRED = ["ttft_ms_mean", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "output_tok_s", "prefill_tok_s",
            "peak_mem_bytes", "weights_bytes", "kv_cache_bytes", "ppl"]


def _children(client, parent_run_id):
    exp_id = client.get_run(parent_run_id).info.experiment_id
    return client.search_runs([exp_id], filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'")


@pytest.fixture(scope="module")
def grid_sweep(ray_local, tiny_overrides):
    """engine x KV cache x attention: 8 trials through Ray. A seed no other test uses: the hash ignores
    sweep_name, and reproduce must find exactly these runs."""
    return run_sweep(tiny_overrides + ["sweep_name=t-grid", "seed=4242", "engine=native,hf", "kv_cache=off,contiguous",
                                       "attention=eager,sdpa"], echo=lambda *_: None)


def test_sweep_writes_one_finished_child_run_per_trial_with_comparable_records(grid_sweep, mlflow_client):
    res = grid_sweep
    assert [r["status"] for r in res.rows] == ["FINISHED"] * 8
    runs = _children(mlflow_client, res.parent_run_id)
    assert len(runs) == 8
    assert mlflow_client.get_run(res.parent_run_id).info.status == "FINISHED"
    tokens_by_engine: dict[str, set[str]] = {}
    for run in runs:
        assert run.info.status == "FINISHED"
        assert set(REQUIRED) <= set(run.data.metrics), sorted(run.data.metrics)
        tags = run.data.tags
        assert len(tags["config_hash"]) == 64 and tags["sweep_id"] == res.sweep_id
        assert "version.torch" in tags and "env.cpu" in tags and "env.ram_bytes" in tags and "git_commit" in tags
        assert run.data.params["workload.context_len"] == "24"
        assert run.data.params["kv_cache.mode"] in ("off", "contiguous")
        arts = {a.path for a in mlflow_client.list_artifacts(run.info.run_id)}
        assert {"config.yaml", TOKENS_ARTIFACT} <= arts
        with open(mlflow_client.download_artifacts(run.info.run_id, TOKENS_ARTIFACT)) as f:
            ids = json.load(f)
        assert len(ids) == 1 and len(ids[0]) == 6
        tokens_by_engine.setdefault(run.data.params["engine.backend"], set()).add(json.dumps(ids))
    assert set(tokens_by_engine) == {"native", "hf"}
    # neither the engine nor the KV cache nor the attention kernel changes greedy tokens
    assert len(set().union(*tokens_by_engine.values())) == 1
    assert len({r.data.tags["config_hash"] for r in runs}) == 8


def test_failing_trial_is_recorded_failed_the_rest_finish_and_the_cli_exits_1(ray_local, tiny_overrides, tmp_path,
                                                                               mlflow_client, capsys):
    # two checkpoints whose config.json is sound and whose safetensors header matches the file's size (so
    # validation passes: a broken config.json or a truncated file is refused before launch, tests/test_model_facts.py
    # and tests/test_new_user_input.py) but that fail when loaded: no weights, and a tensor of no known dtype
    from engine.config import TinyModelConfig
    from engine.models import tiny_checkpoint

    config = (tiny_checkpoint(TinyModelConfig()) / "config.json").read_text()
    header = json.dumps({"w": {"dtype": "BOGUS", "shape": [1], "data_offsets": [0, 4]}}).encode()
    broken = {}
    for name, weights in (("no-weights", None), ("corrupt-weights", len(header).to_bytes(8, "little") + header + b"\0" * 4)):
        broken[name] = tmp_path / name
        broken[name].mkdir()
        (broken[name] / "config.json").write_text(config)
        if weights is not None:
            (broken[name] / "model.safetensors").write_bytes(weights)
    rc = main(["sweep", *tiny_overrides, "sweep_name=t-fail", f"model.path=tiny://llama,{','.join(map(str, broken.values()))}"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAILED" in out and "2 of 3 trial(s) FAILED" in out
    exp = mlflow_client.get_experiment_by_name("t-fail")
    everything = mlflow_client.search_runs([exp.experiment_id])
    (parent,) = [r for r in everything if r.data.tags.get("kind") == "sweep"]
    runs = {r.data.params["model.path"]: r for r in _children(mlflow_client, parent.info.run_id)}
    assert len(runs) == 3
    for path in broken.values():
        failed = runs[str(path)]
        assert failed.info.status == "FAILED"
        assert failed.data.tags["error"]
        assert "error.txt" in {a.path for a in mlflow_client.list_artifacts(failed.info.run_id)}
    assert runs["tiny://llama"].info.status == "FINISHED"
    assert parent.info.status == "FAILED"


def test_rejected_sweep_logs_nothing(tiny_overrides, mlflow_client, capsys):
    before = len(mlflow_client.search_experiments())
    rc = main(["sweep", *tiny_overrides, "sweep_name=t-rejected", "workload.batch_size=0", "kv_cache=bogus"])
    err = capsys.readouterr().err
    assert rc == 2 and "workload.batch_size" in err and "kv_cache: unknown option" in err
    assert mlflow_client.get_experiment_by_name("t-rejected") is None
    assert len(mlflow_client.search_experiments()) == before


def test_reproduce_matches_token_ids_exactly(grid_sweep, tracking, mlflow_client):
    row = grid_sweep.rows[3]
    cmp = reproduce(row["hash"][:8], tracking)
    assert cmp.tokens_match and cmp.deterministic_match
    verdicts = {m: v for m, _, _, v in cmp.rows}
    assert verdicts["generated token ids"] == "MATCH" and verdicts["ppl"] == "MATCH"
    assert any(v.startswith("x") for v in verdicts.values())  # timings shown as ratios
    new = mlflow_client.get_run(cmp.new_run_id)
    assert new.data.tags["reproduces"] == row["run_id"]
    assert new.data.tags["config_hash"] == cmp.config_hash


def test_reproduce_against_all_judges_every_run_with_the_hash(grid_sweep, tracking, tracking_overrides, capsys):
    """A second reproduction of one hash: the original stays the earliest non-reproduction (and says why),
    and --against-all judges the new run against the other runs too (here the first reproduction)."""
    row = grid_sweep.rows[2]
    first = reproduce(row["hash"][:8], tracking)
    assert main(["reproduce", row["hash"][:10], *tracking_overrides, "--against-all"]) == 0
    out = capsys.readouterr().out
    assert f"original run {row['run_id']}" in out and "the original is the earliest that is not a reproduction" in out
    assert "against the 1 other run(s) with this hash:" in out
    other = next(ln for ln in out.splitlines() if ln.startswith(f"  run {first.new_run_id[:8]} (a reproduction)"))
    assert "tokens MATCH" in other and "ttft_ms_p50 x" in other
    # judged -- or, where a run was flagged `unstable: load` (a busy machine), shown and said so
    assert ("consistent" in other) or ("differs beyond noise" in other) or ("load: cannot judge" in other)


def test_reproduce_unknown_hash_is_a_clear_error(tracking_overrides, capsys):
    rc = main(["reproduce", "ffffffffffff", *tracking_overrides])
    assert rc == 2 and "no FINISHED run" in capsys.readouterr().err


def test_run_command_runs_one_trial_in_process(tiny_overrides, capsys):
    assert main(["run", *tiny_overrides, "sweep_name=t-run"]) == 0
    out = capsys.readouterr().out
    assert "FINISHED" in out and "config_hash" in out
    assert main(["run", *tiny_overrides, "attention=eager,sdpa"]) == 2


def test_in_process_sweep_keeps_one_warm_model_between_trials(tiny_overrides):
    res = run_sweep(tiny_overrides + ["sweep_name=t-warm-in-process", "seed=1,2", "kv_cache=off,contiguous"],
                    in_process=True, echo=lambda *_: None)
    outcomes = [r["outcome"] for r in res.rows]
    assert [o.status for o in outcomes] == ["FINISHED"] * 4
    assert [o.info["model_cache"] for o in outcomes] == ["miss", "hit", "hit", "hit"]
    assert [o.metrics["model_load_s"] > 0 for o in outcomes] == [True, False, False, False]


def test_in_process_sweep_goes_through_the_dispatcher_ctrl_c_records_killed_and_resume_skips(tmp_path):
    """--in-process takes the same path as Ray: the dispatcher hands each trial to the one worker (on_start with
    its meta), Ctrl-C records the running trial KILLED and the parent KILLED, a rerun skips what FINISHED."""
    from mlflow.tracking import MlflowClient

    from conftest import TINY
    from cluster import LOCAL_NODE
    from experiments.config.compose import expand
    from experiments.run.sweep import run_specs

    store = [f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"tracking.artifact_root={tmp_path}/artifacts",
             f"tracking.spool_dir={tmp_path}/spool"]
    specs = expand(TINY + store + ["sweep_name=t-in-process-kill", "seed=0,1,2"])
    started = []

    def on_start(spec, meta):
        started.append((spec.index, meta["node_id"], meta["attempts"]))
        if spec.index == 1:  # Ctrl-C as the second trial is handed out
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_specs(specs, "test", in_process=True, echo=lambda *_: None, on_start=on_start)
    assert started == [(0, LOCAL_NODE, 1), (1, LOCAL_NODE, 1)]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("t-in-process-kill")
    runs = client.search_runs([exp.experiment_id])
    trials = {r.data.tags["config_hash"]: r for r in runs if r.data.tags.get("kind") == "trial"}
    assert {h: r.info.status for h, r in trials.items()} == {specs[0].config_hash: "FINISHED",
                                                            specs[1].config_hash: "KILLED"}
    assert trials[specs[0].config_hash].data.tags["env.node_id"] == LOCAL_NODE
    assert [r.info.status for r in runs if r.data.tags.get("kind") == "sweep"] == ["KILLED"]

    res = run_specs(specs, "test", in_process=True, echo=lambda *_: None, skip_finished=True)
    assert res.skipped == 1 and [r["status"] for r in res.rows] == ["SKIPPED", "FINISHED", "FINISHED"]
    finished = [r.data.tags["config_hash"] for r in client.search_runs([exp.experiment_id])
                if r.data.tags.get("kind") == "trial" and r.info.status == "FINISHED"]
    assert sorted(finished) == sorted(s.config_hash for s in specs)  # one FINISHED run per trial


def test_garbage_made_after_the_freeze_is_still_collected():
    """A reused worker freezes what survives before it loads a model (libraries: a full gc.collect() scans
    ~500k objects, 0.25 s); the garbage cycles a trial leaves after that are still collected."""
    import gc
    import weakref

    from experiments.run.trial import collect_garbage

    class Node:
        pass

    collect_garbage(freeze=True)
    assert gc.get_freeze_count() > 0
    made = Node()
    made.me = made  # a cycle: only the collector frees it
    ref = weakref.ref(made)
    del made
    assert ref() is not None
    collect_garbage()
    assert ref() is None


def test_the_cli_starts_without_importing_torch():
    """--help, report, sync and ui need the config model, not the runtime: torch and transformers (~3-5 s
    to import here) load on first use."""
    code = ("import sys, experiments.cli, experiments.tracking.spool, engine.config, engine.axes; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr


def test_help_explains_commands():
    out = subprocess.run([sys.executable, "-m", "experiments.cli", "--help"], capture_output=True, text=True).stdout
    for word in ("sweep", "run", "reproduce", "ui", "prepare", "experiment=quickstart"):
        assert word in out


# --- a driver killed with SIGKILL: nothing stays RUNNING ---------------------------------------------------
# The driver below runs a 2-trial in-process sweep and kills itself (SIGKILL: no handler, no `finally`) at one
# point of the second trial it runs: while the trial runs (only the spool's note of it exists), right after its run is
# created, after its metrics are written but before it is ended (the case seen in a real run: 98 metrics,
# no end time), or after it is ended but before the note is removed.
KILL_DRIVER = r'''
import os, signal, sys
from mlflow.tracking import MlflowClient
from experiments.run.sweep import run_sweep
from experiments.tracking.spool import Recorder

point, overrides = sys.argv[1], sys.argv[2:]
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
seen = {"batches": 0, "ended": 0}
if point == "running":
    note = Recorder.note_running
    def note_running(self, exp, spec, *a, **k):
        note(self, exp, spec, *a, **k)
        seen["batches"] += 1
        if seen["batches"] == 2:
            die()
    Recorder.note_running = note_running
elif point in ("created", "metrics"):
    batch = MlflowClient.log_batch
    def log_batch(self, run_id, metrics=(), *a, **k):
        if metrics:  # a trial run's (a sweep run logs params only)
            seen["batches"] += 1
        if metrics and seen["batches"] == 2 and point == "created":
            die()
        out = batch(self, run_id, metrics, *a, **k)
        if metrics and seen["batches"] == 2:
            die()
        return out
    MlflowClient.log_batch = log_batch
elif point == "ended":
    end = MlflowClient.set_terminated
    def set_terminated(self, run_id, *a, **k):
        out = end(self, run_id, *a, **k)
        if self.get_run(run_id).data.tags.get("kind") == "trial":
            seen["ended"] += 1
            if seen["ended"] == 2:
                die()
        return out
    MlflowClient.set_terminated = set_terminated
run_sweep(overrides, in_process=True, echo=lambda *_: None)
print("NOT KILLED")
'''


@pytest.mark.parametrize("point", ["running", "created", "metrics", "ended"])
def test_rerun_after_a_sigkilled_driver_leaves_no_run_running(point, tmp_path):
    """After a driver killed with SIGKILL at any point of a trial, the next run of the sweep closes every run of
    the dead sweep still RUNNING -- the trial's own half-written run included, as KILLED, without a second
    KILLED record beside it -- and then runs what did not finish: one FINISHED run per hash."""
    import os
    import signal

    from mlflow.tracking import MlflowClient

    from conftest import TINY
    from experiments.config.compose import PROJECT_ROOT

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    over = TINY + [f"tracking.uri={uri}", f"tracking.artifact_root={tmp_path}/art", f"tracking.spool_dir={tmp_path}/spool",
                   "sweep_name=t-kill", "seed=0,1"]
    script = tmp_path / "driver.py"
    script.write_text(KILL_DRIVER)
    env = dict(os.environ, PYTHONPATH=str(PROJECT_ROOT))
    p = subprocess.run([sys.executable, str(script), point, *over], cwd=PROJECT_ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == -signal.SIGKILL, p.stdout + p.stderr
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("t-kill").experiment_id
    (dead,) = client.search_runs([exp], "tags.kind = 'sweep'")
    # the trials it had started and not recorded (the in-process pool hands out the next one early: both here)
    noted = {str(int(p.stem)) for p in (tmp_path / "spool" / "running").glob("*/*.json")}
    before = {r.data.tags["trial_index"]: r for r in client.search_runs([exp], "tags.kind = 'trial'")}
    assert noted and before.keys() <= noted | {"0", "1"}
    # the premise: what each point leaves of the trial it died in (no run yet; a RUNNING run, without / with
    # its metrics; a FINISHED one)
    cut = [before[i] for i in sorted(noted) if i in before]
    assert [r.info.status for r in cut] == {"running": [], "ended": ["FINISHED"]}.get(point, ["RUNNING"])
    if point in ("created", "metrics"):
        assert bool(cut[0].data.metrics) == (point == "metrics")

    res = run_sweep(over, in_process=True, echo=lambda *_: None)
    assert not res.failed
    runs = client.search_runs([exp], "")
    assert [r.info.run_name for r in runs if r.info.status == "RUNNING"] == []
    assert client.get_run(dead.info.run_id).info.status == "KILLED"
    assert client.get_run(dead.info.run_id).data.tags["reaped"] == "driver process gone"
    trials = [r for r in runs if r.data.tags.get("kind") == "trial"]
    fin = [r.data.tags["config_hash"] for r in trials if r.info.status == "FINISHED"]
    assert len(fin) == 2 == len(set(fin))  # the interrupted trials ran again, the finished ones did not
    assert res.skipped == sum(r.info.status == "FINISHED" for r in before.values())
    for i in noted:
        mine = [r for r in trials if r.data.tags["sweep_id"] == dead.data.tags["sweep_id"] and r.data.tags["trial_index"] == i]
        assert len(mine) == 1, "one record of an interrupted trial, not its own run and a KILLED note beside it"
        if i in before:
            assert mine[0].info.run_id == before[i].info.run_id  # the trial's own run, closed
        if i in before and before[i].info.status == "FINISHED":
            continue  # its result was complete before the kill: it stays, and is not run again
        assert mine[0].info.status == "KILLED" and "killed (SIGKILL)" in mine[0].data.tags["error"]
    assert not any((tmp_path / "spool" / "running").glob("*/*.json"))
