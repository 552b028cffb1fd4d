"""The search strategy (Optuna 5 ask/tell) on a synthetic function with a known Pareto front: no model."""
from __future__ import annotations

import itertools

import optuna
import pytest

from experiments.optimize.chain import Budget
from experiments.optimize.settings import OptimizeConf, rules_of
from experiments.optimize.measurement import point_key
from experiments.optimize.search import MINIMIZE, MAXIMIZE, Evaluated, Search, format_front, pareto_front, summary

from optimize_synthetic import Synthetic

RULES = rules_of(OptimizeConf(), True, 50)

# 4 x 3 x 3 = 36 points. Speed: a and b multiply TPOT; accuracy falls with b (b=2 also fails the gate);
# memory falls with c but c=2 slows decoding. a=3 with b=1 is refused by validation (never measured).
SPACE = {"a": ["0", "1", "2", "3"], "b": ["0", "1", "2"], "c": ["0", "1", "2"]}
FA, FB, FC = {"0": 1.0, "1": 0.8, "2": 0.6, "3": 0.5}, {"0": 1.0, "1": 0.7, "2": 0.5}, {"0": 1.0, "1": 1.0, "2": 1.3}
ACC = {"0": 0.6, "1": 0.5, "2": 0.2}
MEM = {"0": 4e8, "1": 3e8, "2": 2e8}


def tpot(p):
    return 100 * FA[p["a"]] * FB[p["b"]] * FC[p["c"]]


def extra(p):
    gate = 0.0 if p["b"] == "2" else 1.0
    return {"task_score.t": ACC[p["b"]], "task_gate": gate, "task_recovery.t": ACC[p["b"]] / 0.6}


def validate(p):
    return ["a=3 with b=1: refused (synthetic rule)"] if (p["a"], p["b"]) == ("3", "1") else []


def true_front():
    pts = [dict(zip(SPACE, v)) for v in itertools.product(*SPACE.values())]
    items = [Evaluated(p, (tpot(p), ACC[p["b"]], MEM[p["c"]]), {"accuracy_gate": 0.0 if p["b"] != "2" else 1.0})
             for p in pts if not validate(p)]
    return {point_key(e.point) for e in pareto_front(items, [MINIMIZE, MAXIMIZE, MINIMIZE])}


def synthetic(**kw):
    # b=2 loses 15 of every 50 items the baseline answers: the paired gate finds it worse; the others lose none
    return Synthetic(tpot, noise=0.0, drift=0.0, memory=lambda p: MEM[p["c"]], extra=extra,
                     wrong=lambda p: 15 if p.get("b") == "2" else 0, **kw)


def test_pareto_front_helper():
    items = [Evaluated({"x": "0"}, (1.0, 1.0), {}), Evaluated({"x": "1"}, (2.0, 2.0), {}),
             Evaluated({"x": "2"}, (2.0, 0.5), {}), Evaluated({"x": "3"}, (0.5, 3.0), {"gate": 1.0})]
    assert {e.point["x"] for e in pareto_front(items, [MINIMIZE, MAXIMIZE])} == {"0", "1"}


def test_search_recovers_the_known_pareto_front_within_its_budget(tmp_path):
    front = true_front()
    # by hand: c=0 is dominated by c=1 (same speed, more memory); b=2 fails the gate; a=3 is the fastest with
    # b=0, and a=3 b=1 is refused, so b=1's fastest is a=2; c=1 (fast) and c=2 (small) both trade
    assert front == {point_key(p) for p in ({"a": "3", "b": "0", "c": "1"}, {"a": "3", "b": "0", "c": "2"},
                                            {"a": "2", "b": "1", "c": "1"}, {"a": "2", "b": "1", "c": "2"})}
    syn = synthetic()
    search = Search(SPACE, ["tpot", "accuracy", "peak_memory"], RULES, Budget(max_trials=24, max_s=0, max_items=200), syn, batch=4, eval_limit=50,
                    validate=validate, storage=None, seed=0,
                    baseline={"a": "0", "b": "0", "c": "0"})
    res = search.run()
    assert res.trials - res.checks <= 24  # of the 35 valid points (then the checks of "best": items, race)
    assert {point_key(e.point) for e in res.front} == front
    measured = [r.points[0] for r in syn.requests]
    assert not any(validate(p) for p in measured)  # refused configurations are never measured
    assert res.invalid and all("refused" in why for _, why in res.invalid)
    assert res.best is not None and res.best.feasible and res.best.values[0] == pytest.approx(min(
        tpot(dict(zip(SPACE, v))) for v in itertools.product(*SPACE.values())
        if v[1] != "2" and not validate(dict(zip(SPACE, v)))))
    assert max(syn.batches) == 4  # measured in parallel batches of `batch`
    assert format_front(res)[0].startswith("a=")


def test_constraints_go_through_set_constraint_and_a_rerun_resumes(tmp_path):
    storage = f"sqlite:///{tmp_path}/study.db"
    syn = synthetic()
    kw = dict(validate=validate, storage=storage, study_name="s", seed=1, baseline={"a": "0", "b": "0", "c": "0"})
    first = Search(SPACE, ["tpot", "accuracy"], RULES, Budget(max_trials=6, max_s=0, max_items=200), syn, batch=2, eval_limit=50, **kw).run()
    assert first.stop == "budget: 6 trials"
    study = optuna.load_study(study_name="s", storage=storage)
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert done and all("accuracy_gate" in t.constraints for t in done)
    assert any(t.constraints["accuracy_gate"] > 0 for t in done) or all(t.params["b"] != "2" for t in done)
    runs = syn.runs
    second = Search(SPACE, ["tpot", "accuracy"], RULES, Budget(max_trials=6, max_s=0, max_items=200), syn, batch=2, eval_limit=50, **kw).run()
    assert len(second.evaluated) >= len(first.evaluated) + 1  # the first run's results, then new ones
    assert syn.runs - runs == second.trials


def test_cost_model_predictions_skip_configurations_and_are_counted(tmp_path):
    syn = synthetic()
    res = Search(SPACE, ["tpot"], RULES, Budget(max_trials=10, max_s=0, max_items=200), syn, batch=2,
                 predict=lambda p, done: "predicted slower: c=2 decodes 1.3x slower" if p["c"] == "2" else "",
                 storage=None, seed=0, baseline={"a": "0", "b": "0", "c": "0"}).run()
    assert res.predicted and all(p["c"] == "2" for p, _ in res.predicted)
    assert not any(r.points[0]["c"] == "2" for r in syn.requests)


def test_refused_configurations_are_told_so_the_sampler_learns_and_duplicates_are_not_told_again():
    syn = synthetic()
    study_name, storage = "learn", "sqlite:///:memory:"
    search = Search(SPACE, ["tpot"], RULES, Budget(max_trials=20, max_s=0, max_items=200), syn, batch=2, eval_limit=50,
                    validate=validate, storage=None, study_name=study_name, seed=0, baseline={"a": "0", "b": "0", "c": "0"})
    study = search._study()
    search._study = lambda: study  # keep the in-memory study to inspect it
    res = search.run()
    trials = study.get_trials(deepcopy=False)
    refused = [t for t in trials if "refused" in (t.constraints or {})]
    # told COMPLETE with a violated constraint (TPE models COMPLETE trials; a FAIL would teach it nothing)
    assert refused and all(t.state == optuna.trial.TrialState.COMPLETE and t.constraints["refused"] > 0 for t in refused)
    assert len(refused) == len(res.invalid)
    # each point told COMPLETE once: a repeated proposal is told FAIL (it would count twice toward the startup)
    complete = [tuple(sorted(t.params.items())) for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(complete) == len(set(complete))
    assert res.duplicates == sum(1 for t in trials if t.user_attrs.get("duplicate"))


def test_load_flagged_measurements_decide_nothing():
    load = "load: other processes used 40.3% of the CPUs (> 25.0%)"
    # a=1 is loaded at its first measurement (measured again: used), a=2 always (dropped, never on the front)
    syn = Synthetic(lambda p: {"0": 100.0, "1": 80.0, "2": 60.0}[p["a"]], noise=0.0, drift=0.0,
                    unstable=lambda p, attempt: load if p.get("a") == "2" or (p.get("a") == "1" and attempt == 0) else "")
    res = Search({"a": ["0", "1", "2"]}, ["tpot"], RULES, Budget(max_trials=10, max_s=0, max_items=200), syn, batch=3,
                 eval_limit=50, storage=None, seed=0, baseline={"a": "0"}).run()
    assert [p["a"] for p, _ in res.dropped] == ["2"] and "under load twice" in res.dropped[0][1]
    assert {e.point["a"] for e in res.evaluated} == {"0", "1"}
    assert [r.attempt for r in syn.requests if r.points[0].get("a") == "1" and not r.interleaved][:2] == [0, 1]


def test_best_is_raced_and_its_gate_decided_on_more_items():
    # a=1 is faster than a=0 by 2% only: by median it is "best"; raced against a=0, not shown >= x1.03 faster,
    # so the median's pick stays but with the race in the summary. Its accuracy: 50 items cannot hold, 200 can.
    syn = Synthetic(lambda p: {"0": 100.0, "1": 98.0, "2": 130.0}[p["a"]], noise=0.03, drift=0.0)
    res = Search({"a": ["0", "1", "2"]}, ["tpot"], RULES, Budget(max_trials=10, max_s=0, max_items=200), syn, batch=3,
                 eval_limit=50, storage=None, seed=0, baseline={"a": "0"}).run()
    assert res.best is not None and res.races and all(r.decision != "accepted" for r in res.races)
    assert res.best.gate and res.best.gate[0].n == 200 and res.best.gate[0].verdict == "holds"
    assert any(r.interleaved for r in syn.requests)  # the race: interleaved pairs
    lines = summary(res)
    assert lines[0].startswith("Pareto front") and any(l.startswith("raced for best") for l in lines)


def test_pruning_drops_only_points_predicted_dominated_on_every_objective():
    from experiments.optimize.predict import CostModelSkip

    space = {"kv_cache": ["off", "contiguous"]}
    pred = {point_key({"kv_cache": "off"}): (1.0, 1e8), point_key({"kv_cache": "contiguous"}): (0.2, 1e8)}
    with_memory = CostModelSkip(None, space, 0.25, memory=True)
    with_memory._pred = dict(pred)
    assert with_memory({"kv_cache": "off"}, []) == ""  # 5x slower, but without a cache it may win on memory
    time_only = CostModelSkip(None, space, 0.25, memory=False)
    time_only._pred = dict(pred)
    assert time_only({"kv_cache": "off"}, []).startswith("predicted 5.0x slower per token than kv_cache=contiguous")
