"""`infersweep optimize` through the real CLI: bad input refused before any trial (exit 2, naming the key and
the fix), the optimize run's lifecycle, and one small real chain on the tiny model (slow tier)."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from experiments.cli import main

GATE_OFF = "optimize.gate.enabled=false"


@pytest.mark.parametrize("args, key, fix", [
    (["kv_cache=off,contiguous", GATE_OFF, "optimize.objective=speed"], "optimize.objective: unknown objective 'speed'",
     "use one of tpot"),
    ([GATE_OFF], "the space is empty", "kv_cache=off,contiguous"),
    (["kv_cache=off,contiguous", GATE_OFF, "optimize.max_trials=0"], "optimize.max_trials", "optimize.max_trials=24"),
    (["kv_cache=off,contiguous"], "optimize.gate.enabled: the accuracy gate needs task accuracy", "eval=tasks"),
    (["kv_cache=off,contiguous", GATE_OFF, "optimize.slo.ttft_ms_p99=500"], "optimize.slo: an SLO (ttft_ms_p99) needs a serving workload",
     "workload=serving-mixed"),
    (["kv_cache=choice(off)", "attention=eager,sdpa", GATE_OFF, "optimize=search",
      "optimize.search.objectives=[tpot]"], "kv_cache: an optimize axis needs at least two values", "pin it as kv_cache=off"),
    # a one-element list is refused like choice(sdpa), not silently pinned
    (["kv_cache=off,contiguous", "attention=[sdpa]", GATE_OFF], "attention: a list ([sdpa]) is no axis",
     "pin it as attention=sdpa"),
    # limits that could never bind (or would refuse everything) are refused
    (["kv_cache=off,contiguous", GATE_OFF, "optimize.max_memory_gb=-1"], "optimize.max_memory_gb: a memory limit must be > 0",
     "leave it unset"),
    (["kv_cache=off,contiguous", GATE_OFF, "optimize.max_memory_gb=0"], "optimize.max_memory_gb: a memory limit must be > 0",
     "leave it unset"),
    # every value of the space is validated before the first trial: an unknown model at the right-size step too
    (["kv_cache=off,contiguous", "model=tiny-llama,no-such-model", GATE_OFF], "model=no-such-model", "tiny-llama"),
    # the overrides' own problems (found while reading the space) are the optimize's too
    (["kv_cache=off,contiguous", GATE_OFF, "no_such_key=1"], "overrides: unknown key", "keys at top level: attention"),
])
def test_bad_input_is_refused_before_any_trial(args, key, fix, tiny_overrides, mlflow_client, capsys):
    rc = main(["optimize", *tiny_overrides, "sweep_name=t-opt-bad", *args])
    err = capsys.readouterr().err
    assert rc == 2 and key in err and fix in err
    # headed by what was asked, one line per problem
    head, *lines = err.rstrip("\n").split("\n")
    assert head == "error: invalid optimize:" and lines and all(ln.startswith("  - ") for ln in lines), err
    assert mlflow_client.get_experiment_by_name("t-opt-bad") is None  # nothing ran, nothing was recorded


def test_a_task_file_with_an_unknown_key_is_refused_before_any_trial(tiny_overrides, mlflow_client, capsys, tmp_path):
    """A task YAML lm-eval would refuse at load (`TaskConfig.__init__() got an unexpected keyword argument`, 136 s
    into the first trial) is refused up front: one line naming the file, the key and the keys allowed, and no
    second line calling the task it defines unknown."""
    (tmp_path / "rows.jsonl").write_text('{"q": "2+2=", "opts": ["3", "4"], "y": 1}\n')
    typo = tmp_path / "typo.yaml"
    typo.write_text("task: typo\ndataset_path: json\ndataset_kwargs:\n  data_files: {test: rows.jsonl}\n"
                    "test_split: test\noutput_type: multiple_choice\ndoc_to_text: q\ndoc_to_choice: opts\n"
                    "doc_to_target: y\nnum_fewshots: 0\n")
    rc = main(["optimize", *tiny_overrides, "sweep_name=t-opt-bad", "kv_cache=off,contiguous", GATE_OFF, "eval=tasks",
               "eval.tasks=[typo]", f"eval.task_files=[{typo}]"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: invalid optimize:\n")
    (line,) = [ln for ln in err.splitlines() if ln.startswith("  - ")]
    assert f"{typo}: unknown key 'num_fewshots'; an lm-eval task takes " in line and "num_fewshot," in line
    assert mlflow_client.get_experiment_by_name("t-opt-bad") is None


def test_a_memory_limit_below_every_configurations_weights_is_refused_before_any_trial():
    """SmolLM2-135M's baseline measures 582 MB; its fp32 weights alone are 0.54 GB (the model's facts, the cost
    model's widths). A limit below them is refused, with the other problems; with a quantization axis the limit is
    judged against the smallest configuration of the space, and one that configuration meets is accepted."""
    from conftest import need_prepared
    from experiments.optimize.run import OptimizeError, prepare

    need_prepared("smollm2-135m-instruct")
    # fp32 pinned: model.dtype=auto is bfloat16 on a CPU with bf16 units (half the bytes)
    base = ["model=smollm2-135m", "model.dtype=float32", "kv_cache=off,contiguous", GATE_OFF]
    with pytest.raises(OptimizeError) as ei:
        prepare([*base, "optimize.max_memory_gb=0.01", "optimize.max_trials=0"])
    assert "optimize.max_memory_gb: 0.01 GB is below the baseline's weights alone (0.54 GB, smollm2-135m-instruct " \
           "float32): no configuration of this space can meet it" in ei.value.problems
    assert any(p.startswith("optimize.max_trials") for p in ei.value.problems)  # every problem at once
    quant = [*base, "quant=none,int8-weight,int4-weight"]
    with pytest.raises(OptimizeError) as ei:
        prepare([*quant, "optimize.max_memory_gb=0.1"])
    assert ei.value.problems == [
        "optimize.max_memory_gb: 0.1 GB is below the smallest configuration's (quant=int4-weight) weights alone "
        "(0.18 GB, smollm2-135m-instruct float32 int4-weight): no configuration of this space can meet it"]
    space, o, _ = prepare([*quant, "optimize.max_memory_gb=0.3"])  # below the baseline's, met by int4-weight
    assert o.max_memory_gb == 0.3


def test_every_problem_at_once_through_the_installed_command(tiny_overrides):
    p = subprocess.run([sys.executable, "-m", "experiments.cli", "optimize", *tiny_overrides, "sweep_name=t-opt-bad",
                        "optimize.objective=fastest", "optimize.max_trials=0"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    assert "optimize.objective" in p.stderr and "optimize.max_trials" in p.stderr and "the space is empty" in p.stderr


def test_help_explains_the_strategies(capsys):
    with pytest.raises(SystemExit):
        main(["optimize", "--help"])
    out = capsys.readouterr().out
    assert "optimize=search" in out and "optimize.min_effect" in out and "interleaved pair" in out


def test_interrupt_leaves_the_optimize_run_killed(tiny_overrides, mlflow_client, monkeypatch):
    from experiments.optimize import run as optimize_run

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(optimize_run, "_chain", interrupted)  # Ctrl-C while the strategy runs
    assert main(["optimize", *tiny_overrides, "sweep_name=t-opt-int", "kv_cache=off,contiguous", GATE_OFF]) == 130
    exp = mlflow_client.get_experiment_by_name("t-opt-int")
    (run,) = mlflow_client.search_runs([exp.experiment_id], "tags.kind = 'optimize'")
    assert run.info.status == "KILLED"


@pytest.mark.slow
def test_real_chain_on_the_tiny_model_resumes_by_hash(tiny_overrides, mlflow_client, ray_local, capsys):
    # a budget that never binds: a chain stopped by its budget resumes on the same command (the budget counts trials
    # run now, conf/optimize/chain.yaml), and this test is about the other case -- a chain that ended is replayed
    # from the store (a loaded machine can leave the pair undecided after its first measurement: seen in CI)
    args = ["optimize", *tiny_overrides, "sweep_name=t-opt-real", "kv_cache=off,contiguous", GATE_OFF,
            "optimize.max_trials=20", "optimize.remeasure=0", "optimize.rounds=3"]
    main(args)
    out = capsys.readouterr().out
    assert "stopped: end of chain;" in out
    assert "| 0 baseline | kv_cache=off | baseline |" in out and "| 1 KV cache | kv_cache=contiguous |" in out
    exp = mlflow_client.get_experiment_by_name("t-opt-real")
    (opt,) = mlflow_client.search_runs([exp.experiment_id], "tags.kind = 'optimize'")
    trials = mlflow_client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{opt.info.run_id}'")
    # the baseline, the pair (measured again while undecided), and (when the KV cache was kept) the total pair
    assert opt.info.status == "FINISHED" and opt.data.tags["optimize.trials"] == str(len(trials)) and len(trials) >= 3
    assert all(t.data.tags.get("config_hash") for t in trials)
    arts = {a.path for a in mlflow_client.list_artifacts(opt.info.run_id, "optimize")}
    assert {"optimize/chain.md", "optimize/chain.json", "optimize/final_config.yaml", "optimize/deploy.sh"} <= arts
    assert "# deploy the final configuration (engine " in out  # the deliverable, printed at the end
    # an in-process final's served counterpart: the tiny random model is one no server runs, and the result says why
    assert "no served counterpart of the in-process final configuration: " in out
    final = opt.data.tags["final_config_hash"]
    assert final in {t.data.tags["config_hash"] for t in trials}
    assert f"(infersweep reproduce {final[:12]})" in out  # the hash a user copies
    # ... and it reproduces: the final configuration re-run from its stored config, same tokens
    assert main(["reproduce", final[:12], *tiny_overrides[-2:]]) == 0
    assert "MATCH" in capsys.readouterr().out
    # the same command again: every trial FINISHED by hash is reused, nothing runs
    main(args)
    again = capsys.readouterr().out
    assert f"0 trial(s) run, {len(trials)} reused from the store" in again
    assert main(["report", "t-opt-real", *tiny_overrides[-2:], "--no-log"]) == 0
    assert "| 1 KV cache | kv_cache=contiguous |" in capsys.readouterr().out


@pytest.mark.slow
def test_real_search_on_the_tiny_model_resumes_its_study(tiny_overrides, tracking_dir, mlflow_client, ray_local, capsys):
    args = ["optimize", *tiny_overrides, "sweep_name=t-opt-search", "kv_cache=off,contiguous", "attention=eager,sdpa",
            GATE_OFF, "optimize=search", "optimize.search.objectives=[tpot,peak_memory]", "optimize.max_trials=8",
            "optimize.remeasure=0",  # a race is one interleaved pair: 4 configurations and 2 races fit 8 trials
            "optimize.search.batch=1", "optimize.search.skip_predicted=false"]  # batches: test_optimize_search.py
    rc = main(args)
    out = capsys.readouterr().out
    assert (tracking_dir / "optuna.db").exists()  # the study beside the tracking store
    exp = mlflow_client.get_experiment_by_name("t-opt-search")
    (opt,) = mlflow_client.search_runs([exp.experiment_id], "tags.kind = 'optimize'")
    assert opt.info.status == "FINISHED"
    measured = out.count("\n  kv_cache=")  # front members and dropped ones are listed one per line
    if rc != 0:  # a loaded machine: a measurement flagged for load twice decides nothing (the rule), and its
        # re-measurements spend the budget the races needed
        assert ("dropped (measured under load):" in out and "Pareto front: no feasible configuration measured" in out
                or "best: undecided: budget" in out)
        return
    assert "Pareto front (feasible, measured):" in out and "best: " in out and opt.data.tags.get("final_config_hash")
    assert measured >= 1
    # the same command again: the study resumes with its verdicts (the races), so the same best, nothing measured
    assert main(args) == 0
    again = capsys.readouterr().out
    assert "configuration(s) already measured" in again and "the exploration ended in an earlier run" in again
    assert "0 trial(s) run" in again
    runs = mlflow_client.search_runs([exp.experiment_id], "tags.kind = 'optimize'", order_by=["attributes.start_time DESC"])
    assert runs[0].data.tags.get("final_config_hash") == opt.data.tags["final_config_hash"]


def test_hydras_own_spelling_of_an_axis_is_that_axis():
    """`hydra.sweeper.params.quant=a,b` (Hydra's key for a sweep axis) replaces the experiment's quant values;
    it once became an extra chain step named after the hydra key, comparing a trial with itself."""
    from experiments.optimize.space import read_space

    plain = read_space(["experiment=optimize-cpu", "quant=none,int4-weight"]).axes
    hydra = read_space(["experiment=optimize-cpu", "hydra.sweeper.params.quant=none,int4-weight"]).axes
    assert hydra == plain and hydra["quant"] == ["none", "int4-weight"]
    assert not [k for k in hydra if k.startswith("hydra")]


def test_the_cpp_step_is_a_value_the_chain_can_choose(tiny_overrides):
    """engine=native-cpp (conf/engine/native-cpp.yaml: engine.compile_mode=cpp) needs kv_cache=contiguous: on the
    baseline (kv_cache=off) that is an interaction with another axis of the space, not a bad value -- the space is
    accepted, the step comes after the chain's own steps, and its config hash is the long spelling's."""
    from experiments.config.compose import expand
    from experiments.optimize.chain import plan
    from experiments.optimize.run import OptimizeError, prepare

    space, _, disp = prepare([*tiny_overrides, "kv_cache=off,contiguous", "engine=hf,native-cpp", GATE_OFF])
    assert [s.key for s in plan(space.axes, {"kv_cache": "off", "engine": "hf"})] == ["kv_cache", "engine"]
    assert any("kv_cache.mode" in p for p in disp.validate({"kv_cache": "off", "engine": "native-cpp"}))
    assert disp.validate({"kv_cache": "contiguous", "engine": "native-cpp"}) == []
    long = expand([*tiny_overrides, "kv_cache=contiguous", "engine=native", "engine.compile=true",
                   "engine.compile_mode=cpp"])[0]
    assert disp.spec({"kv_cache": "contiguous", "engine": "native-cpp"}).config_hash == long.config_hash
    # both values are logits engines (native-cpp is engine=native): the KV cache still cannot change a task score
    from experiments.optimize.run import score_neutral

    with_tasks = dataclasses.replace(space, config={**space.config, "eval": {"tasks": ["arc_easy"]}})
    assert "kv_cache.mode" in score_neutral(with_tasks)
    # with the KV cache pinned off it is the value's own problem: refused before any trial, with the reason
    with pytest.raises(OptimizeError, match="engine=native-cpp: kv_cache.mode"):
        prepare([*tiny_overrides, "kv_cache=off", "attention=eager,sdpa", "engine=hf,native-cpp", GATE_OFF])
