"""The chain strategy and its decision rules on a scripted synthetic objective (tests/optimize_synthetic.py):
known answers, injected noise, no model. (What the verdicts guarantee over many seeds:
tests/test_optimize_calibration.py.)"""
from __future__ import annotations

import dataclasses
import math

import pytest

from experiments.optimize.accuracy import (HOLDS, UNDECIDED, UNPAIRED, WORSE, UnpairedItems, item_key, pair_items,
                                           paired_accuracy)
from experiments.optimize.chain import Budget, Chain, baseline_of, plan
from experiments.optimize.decide import (ACCEPTED, REJECTED, SKIPPED, TOTAL, UNDECIDED_PAIR, judge_timing,
                                         limit_problems)
from experiments.optimize.measurement import Measurement
from experiments.optimize.objective import Objective, ObjectiveError
from experiments.optimize.settings import OptimizeConf, rules_of

from optimize_synthetic import Synthetic, tpot_of

SPACE = {
    "kv_cache": ["off", "contiguous"],
    "attention": ["eager", "sdpa"],
    "quant": ["none", "bnb-int8", "int8-weight"],
    "speculative": ["off", "prompt-lookup"],
}
RULES = rules_of(OptimizeConf(), True, 50)  # the shipped settings


def rules(**kw):
    return dataclasses.replace(RULES, **kw)


def budget(max_trials=60, max_s=0.0, max_items=200):
    return Budget(max_trials=max_trials, max_s=max_s, max_items=max_items)


def chain(measure, space=SPACE, budget=budget(), rules=RULES, **kw):
    return Chain(space, Objective.parse("tpot"), rules, budget, measure, eval_limit=50, **kw)


# --- the accuracy gate -----------------------------------------------------------------------------------
def test_gate_needs_items_enough_to_see_a_drop_before_it_holds():
    same = [1.0] * 30 + [0.0] * 20
    a = paired_accuracy("t", same, list(same), max_drop=0.03, alpha=0.05 / 3)
    # 0 of 50 lost: the interval is not [0, 0] -- a drop up to ~8% is not ruled out, so the gate cannot hold yet
    assert (a.verdict, a.b, a.c, a.delta) == (UNDECIDED, 0, 0, 0.0) and a.lo < -0.07
    a200 = paired_accuracy("t", same * 4, same * 4, max_drop=0.03, alpha=0.05 / 3)
    assert a200.verdict == HOLDS and -0.03 < a200.lo < -0.02
    drop = paired_accuracy("t", same, [0.0] * 8 + [1.0] * 22 + [0.0] * 20, max_drop=0.03, alpha=0.05 / 3)
    assert drop.verdict == WORSE and drop.b == 8 and drop.hi < -0.03  # the drop is shown beyond max_drop


def test_a_drop_inside_max_drop_is_not_worse():
    # 5 of 200 lost, none gained: a 2.5% drop, inside a 3% tolerance -- not "worse" (the old test said so at p=0.03)
    inc = [1.0] * 120 + [0.0] * 80
    cand = [0.0] * 5 + [1.0] * 115 + [0.0] * 80
    a = paired_accuracy("t", inc, cand, max_drop=0.03, alpha=0.05 / 3)
    assert a.verdict == UNDECIDED and a.lo < -0.03 < a.hi


def test_items_are_paired_by_identity():
    # the same accuracy (60%) on different items: paired, 10 items flipped each way
    inc = [1.0] * 30 + [0.0] * 20
    cand = [0.0] * 10 + [1.0] * 20 + [1.0] * 10 + [0.0] * 10
    a = paired_accuracy("t", inc, cand)
    assert (a.b, a.c, a.delta, a.verdict) == (10, 10, 0.0, UNDECIDED)
    # a larger eval.limit holds the smaller one's items: paired on those, not truncated by position alone
    assert pair_items({"0": 1.0, "1": 0.0}, {"0": 1.0, "1": 1.0, "2": 0.0}) == ([1.0, 0.0], [1.0, 1.0])
    # the same doc id with another text: an error, never a silent pairing
    with pytest.raises(UnpairedItems, match="different text"):
        pair_items({item_key(0, "a needle in 512 tokens"): 1.0}, {item_key(0, "a needle in 498 tokens"): 1.0})
    with pytest.raises(UnpairedItems, match="different items"):
        pair_items({"0": 1.0, "1": 1.0}, {"0": 1.0, "5": 1.0})
    # documents each model builds itself (needle tasks across tokenizers), with no text hash: unpaired
    u = paired_accuracy("needle", inc, inc, positional_ok=False)
    assert u.verdict == UNPAIRED and "no text hash" in u.why
    hashed = [{"doc_id": i, "text": f"doc {i}", "correct": x} for i, x in enumerate(inc)]
    assert paired_accuracy("needle", hashed, hashed, positional_ok=False).verdict != UNPAIRED
    # the engine's item identities (engine/tasks/run.py TaskResult.items: "<doc_id>:<digest>") key the answers
    from experiments.run.trial import identified_correct

    a = identified_correct({"t": [1.0, 0.0]}, {"t": ["0:aa", "1:bb"]})["t"]
    b = identified_correct({"t": [1.0, 1.0]}, {"t": ["0:aa", "1:cc"]})["t"]  # document 1 changed behind its index
    assert a == {"0:aa": 1.0, "1:bb": 0.0} and paired_accuracy("t", a, b).verdict == UNPAIRED


# --- objectives ----------------------------------------------------------------------------------------
def test_objective_parsing_and_combinations():
    assert Objective.parse("tpot").metrics == ("tpot_ms_p50",)
    with pytest.raises(ObjectiveError, match="unknown objective 'speed'"):
        Objective.parse("speed")
    w = Objective.parse("0.5*tpot+0.5*peak_memory")
    inc = Measurement({}, metrics={"peak_mem_bytes": 100.0}, rounds={"tpot_ms_p50": [10.0, 10.0, 10.0]})
    cand = Measurement({}, metrics={"peak_mem_bytes": 25.0}, rounds={"tpot_ms_p50": [10.0, 10.0, 10.0]})
    assert w.compare(inc, cand).value == pytest.approx(math.sqrt(1.0 * 4.0))  # geometric mean of x1 and x4
    lex = Objective.parse("tpot>peak_memory")
    assert lex.compare(inc, cand).value == pytest.approx(4.0)  # tpot within noise: memory decides


def test_limits_name_the_metric_and_value():
    m = Measurement({}, metrics={"ttft_ms_p99": 910.0, "peak_mem_bytes": 2e9})
    assert limit_problems(m, rules(slo={"ttft_ms_p99": 500}, max_memory_bytes=1e9)) == [
        "SLO: p99 TTFT 910 ms > 500", "memory: peak 2.00 GB > 1.00 GB"]
    # measured in a pair, the peak is the variant's own footprint: the memory limit is judged on a solo run
    grouped = Measurement({}, metrics={"peak_mem_bytes": 2e9, "group_peak_mem_bytes": 3e9})
    assert limit_problems(grouped, rules(max_memory_bytes=1e9)) == []


# --- the chain -------------------------------------------------------------------------------------------
def test_plan_follows_the_seed_order_and_quant_int8_weight_first():
    steps = plan(SPACE, baseline_of(SPACE))
    assert [s.key for s in steps] == ["kv_cache", "attention", "quant", "speculative"]
    assert steps[2].variants == ("int8-weight", "bnb-int8")
    assert baseline_of(SPACE) == {"kv_cache": "off", "attention": "eager", "quant": "none", "speculative": "off"}


def test_chain_accepts_real_gains_and_stops_on_within_noise():
    syn = Synthetic(tpot_of({("kv_cache", "contiguous"): 0.5, ("attention", "sdpa"): 0.995,
                             ("quant", "int8-weight"): 0.8}))
    res = chain(syn).run()
    by = {r.label: r for r in res.rows}
    assert by["KV cache"].decision == ACCEPTED and by["KV cache"].reason.startswith(("faster x1.9", "faster x2.0"))
    assert by["fused (flash) attention"].decision == REJECTED
    assert by["fused (flash) attention"].reason.startswith(("within noise", "below min effect"))
    quant = [(r.candidate, r.decision) for r in res.rows if r.label == "quantization"]
    # int8 first; the other level then has to beat int8 (bnb-int8 is no faster than it here)
    assert quant == [("quant=int8-weight", ACCEPTED), ("quant=bnb-int8", REJECTED)]
    assert res.incumbent == {"kv_cache": "contiguous", "attention": "eager", "quant": "int8-weight", "speculative": "off"}
    assert res.stop == "end of chain"
    assert [r.decision for r in res.rows if r.label == "speculative decoding"] == [REJECTED]


def test_a_gain_not_shown_to_clear_min_effect_is_never_accepted_even_when_the_median_looks_faster():
    # a 2% gain buried in +-10% noise per round: measured again (rounds pooled), then left undecided
    syn = Synthetic(tpot_of({("kv_cache", "contiguous"): 0.98}), noise=0.10)
    res = chain(syn, space={"kv_cache": ["off", "contiguous"]}, rules=rules(gate=False)).run()
    assert res.rows[1].decision in (UNDECIDED_PAIR, REJECTED) and res.incumbent == {"kv_cache": "off"}
    # three measurements in the walk, then the chain's end retries the undecided pair once (optimize.retries=1),
    # pooled with its three: each a fresh measurement (the runs already used are skipped)
    assert [len(r.skip) for r in syn.requests if r.interleaved] == [1, 3, 5, 7]  # the baseline, then 2 runs a pair
    retry = res.rows[-1]
    assert retry.label == "KV cache (retry)" and retry.attempts == 1 and retry.decision in (UNDECIDED_PAIR, REJECTED)
    assert retry.decision == REJECTED or retry.reason.endswith("stopped after 4 measurement(s)")
    # a 6% gain whose point estimate clears x1.03 but whose interval does not: not accepted on the estimate
    rounds = [100.0, 90.0, 110.0, 95.0, 105.0, 100.0, 92.0, 108.0, 100.0]
    inc = Measurement({}, rounds={"tpot_ms_p50": rounds})
    cand = Measurement({}, rounds={"tpot_ms_p50": [x / 1.06 * f for x, f in zip(rounds, (1.1, 0.9, 1.0, 1.05, 0.95,
                                                                                        1.08, 0.92, 1.0, 1.0))]})
    v = judge_timing([(inc, cand)], Objective.parse("tpot"), RULES)
    assert v.ratio.value > 1.03 and v.ratio.lo < 1.03 and v.decision == UNDECIDED_PAIR


def test_min_effect_rejects_a_real_but_small_gain():
    syn = Synthetic(tpot_of({("kv_cache", "contiguous"): 0.985}), noise=0.0005)
    res = chain(syn, space={"kv_cache": ["off", "contiguous"]}).run()
    assert res.rows[1].decision == REJECTED and res.rows[1].reason.startswith("below min effect")


def test_failed_accuracy_gate_rejects_a_faster_candidate():
    # int8-weight is much faster but loses 10 of 50 items; bnb-int8 is faster and keeps them
    syn = Synthetic(tpot_of({("quant", "int8-weight"): 0.6, ("quant", "bnb-int8"): 0.8}),
                    wrong=lambda p: 10 if p.get("quant") == "int8-weight" else 0)
    res = chain(syn, space={"quant": ["none", "bnb-int8", "int8-weight"]}).run()
    q = [r for r in res.rows if r.label == "quantization"]
    assert q[0].candidate == "quant=int8-weight" and q[0].decision == REJECTED
    assert q[0].reason.startswith("accuracy gate: vs incumbent: emoji_movie -20.0%")
    assert q[1].candidate == "quant=bnb-int8" and q[1].decision == ACCEPTED
    assert res.incumbent == {"quant": "bnb-int8"}


def test_the_gate_plans_its_items_from_the_first_look_and_grows_up_the_ladder():
    # 6% of the items lost: 3 of 50 cannot show a drop beyond 3%; the plan sizes the next look from the 3 discordant
    # items (~1,000 at 90% power), rounded up the shared ladder 50 x sqrt(2)^k, within the cap of 1,500
    syn = Synthetic(tpot_of({("quant", "int8-weight"): 0.6}), wrong=lambda p: 3 if p.get("quant") == "int8-weight" else 0)
    said: list[str] = []
    res = chain(syn, space={"quant": ["none", "int8-weight"]}, budget=budget(max_items=1500), echo=said.append).run()
    limits = [r.points[0].get("eval.limit") for r in syn.requests if not r.interleaved][1:]  # after the baseline
    assert limits[0] is None and limits[1] in ("1131", "1500") and len(limits) == 2  # the first look, then the plan
    assert any("3 of 50 items differ" in m and "items decide it" in m for m in said)  # the plan, printed
    assert res.rows[1].decision == REJECTED and res.rows[1].reason.startswith("accuracy gate")  # 6% of 1,131: worse
    assert "worse" in res.rows[1].accuracy
    # the same candidate where only 200 items may be used: the plan cannot decide it there -- said, nothing spent
    syn = Synthetic(tpot_of({("quant", "int8-weight"): 0.6}), wrong=lambda p: 3 if p.get("quant") == "int8-weight" else 0)
    res = chain(syn, space={"quant": ["none", "int8-weight"]}, budget=budget(max_items=200)).run()
    assert [r.points[0].get("eval.limit") for r in syn.requests if not r.interleaved][1:] == [None]
    assert res.rows[1].decision == UNDECIDED_PAIR and "more than the 200 optimize.gate.max_items (not spent)" in res.rows[1].reason
    # no item lost: 0 of 50 differ -> one planned look decides that it holds
    syn = Synthetic(tpot_of({("quant", "int8-weight"): 0.6}))
    res = chain(syn, space={"quant": ["none", "int8-weight"]}, budget=budget(max_items=1500)).run()
    assert res.rows[1].decision == ACCEPTED and "holds" in res.rows[1].accuracy and res.rows[1].attempts == 3


def test_loaded_measurements_are_dropped_and_the_pair_measured_again():
    # the first measurement of the kv pair ran under load, the second did not: decided on the second alone
    load = "load: other processes used 40.3% of the CPUs (> 25.0%)"
    syn = Synthetic(tpot_of({("kv_cache", "contiguous"): 0.5}), unstable=lambda p, attempt: load if attempt == 0 else "")
    res = chain(syn, space={"kv_cache": ["off", "contiguous"]}, rules=rules(gate=False)).run()
    assert [len(r.skip) for r in syn.requests if r.interleaved][:2] == [1, 3]  # the second: a fresh measurement
    assert res.rows[1].decision == ACCEPTED and res.rows[1].attempts == 2 and "(9 rounds)" in res.rows[1].reason
    # flagged for spread only: the interval carries it, and x2 separates from x1.03 -> decided at once
    spread = Synthetic(tpot_of({("kv_cache", "contiguous"): 0.5}),
                       unstable=lambda p, attempt: "spread: tpot_ms_p50 CI half-width 12.3% > 10.0%")
    res = chain(spread, space={"kv_cache": ["off", "contiguous"]}, rules=rules(gate=False)).run()
    assert res.rows[1].attempts == 1
    assert res.rows[1].decision == ACCEPTED
    # always loaded: measured `attempts` times, then never accepted or rejected on noise
    noisy = Synthetic(tpot_of({("kv_cache", "contiguous"): 0.5}), unstable=lambda p, a: load)
    res = chain(noisy, space={"kv_cache": ["off", "contiguous"]}, rules=rules(gate=False)).run()
    # three in the walk, one more at the chain's end (pooled: still nothing clean), no total (nothing was kept)
    assert len([r for r in noisy.requests if r.interleaved]) == 4
    assert res.rows[1].decision == UNDECIDED_PAIR and res.rows[1].reason.startswith("unstable: incumbent load")
    assert res.rows[1].reason.endswith("stopped after 3 measurement(s)")
    assert res.rows[2].label == "KV cache (retry)" and res.rows[2].reason.endswith("stopped after 4 measurement(s)")
    assert res.incumbent == {"kv_cache": "off"} and len(res.rows) == 3
    # without retries (optimize.retries=0): the walk's three measurements only
    res = chain(Synthetic(tpot_of({("kv_cache", "contiguous"): 0.5}), unstable=lambda p, a: load),
                space={"kv_cache": ["off", "contiguous"]}, rules=rules(gate=False, retries=0)).run()
    assert [r.label for r in res.rows] == ["baseline", "KV cache"]


def test_an_undecided_pair_is_retried_at_the_end_and_can_be_accepted_there():
    # the kv pair is loaded in the walk (three measurements, undecided), quiet at the end: the retry pools the
    # clean one and accepts; the incumbent changed since (sdpa accepted), so it is a new pair on top of sdpa
    load = "load: other processes used 40.3% of the CPUs (> 25.0%)"
    syn = Synthetic(tpot_of({("kv_cache", "contiguous"): 0.5, ("attention", "sdpa"): 0.7}),
                    unstable=lambda p, n: load if p.get("kv_cache") == "contiguous" and p.get("attention") == "eager" else "")
    res = chain(syn, space={"kv_cache": ["off", "contiguous"], "attention": ["eager", "sdpa"]},
                rules=rules(gate=False)).run()
    by = {r.label: r for r in res.rows}
    assert by["KV cache"].decision == UNDECIDED_PAIR and by["fused (flash) attention"].decision == ACCEPTED
    assert by["KV cache (retry)"].decision == ACCEPTED and by["KV cache (retry)"].candidate == "kv_cache=contiguous"
    assert res.incumbent == {"kv_cache": "contiguous", "attention": "sdpa"} and res.rows[-1].decision == TOTAL
    # budget spent at the end of the walk: no retry
    syn2 = Synthetic(tpot_of({("kv_cache", "contiguous"): 0.5, ("attention", "sdpa"): 0.7}), unstable=syn.unstable)
    res = chain(syn2, space={"kv_cache": ["off", "contiguous"], "attention": ["eager", "sdpa"]},
                budget=budget(max_trials=9), rules=rules(gate=False)).run()
    assert "KV cache (retry)" not in {r.label for r in res.rows} and res.stop.startswith("budget")


def test_the_memory_limit_is_judged_on_the_candidate_measured_alone():
    # in a pair each variant logs only its own footprint (1% here): the limit is judged on a solo run of it
    syn = Synthetic(tpot_of({("kv_cache", "contiguous"): 0.5}),
                    memory=lambda p: 1.2e9 if p.get("kv_cache") == "contiguous" else 0.4e9)
    res = chain(syn, space={"kv_cache": ["off", "contiguous"]}, rules=rules(gate=False, max_memory_bytes=1e9)).run()
    assert res.rows[1].decision == REJECTED and res.rows[1].reason.startswith("memory: peak 1.20 GB > 1.00 GB (measured alone")
    solo = [r.points for r in syn.requests if not r.interleaved][1:]
    assert solo == [({"kv_cache": "contiguous", "eval.enabled": "false"},)]
    res = chain(Synthetic(syn.tpot, memory=lambda p: 0.9e9), space={"kv_cache": ["off", "contiguous"]},
                rules=rules(gate=False, max_memory_bytes=1e9)).run()
    assert res.rows[1].decision == ACCEPTED


def test_a_candidate_whose_weights_alone_exceed_the_memory_limit_is_skipped_not_measured():
    """Its peak holds its weights, so no measurement could meet the limit: skipped with that reason, no trial
    spent; a candidate whose weights fit is measured and judged as before."""
    weights = {"none": 0.54e9, "int8-weight": 0.22e9, "int4-weight": 0.18e9}
    syn = Synthetic(tpot_of({("quant", "int8-weight"): 0.6, ("quant", "int4-weight"): 0.5}), memory=lambda p: 0.3e9)
    res = chain(syn, space={"quant": ["none", "int8-weight", "int4-weight"]}, rules=rules(gate=False, max_memory_bytes=0.2e9),
                weights=lambda p: weights[p.get("quant", "none")]).run()
    int8, int4 = res.rows[1], res.rows[2]
    assert int8.decision == SKIPPED and int8.reason == ("memory: its weights alone (0.22 GB) exceed optimize.max_memory_gb "
                                                        "(0.20 GB): not spent as a trial")
    assert not any(p.get("quant") == "int8-weight" for r in syn.requests for p in r.points)
    assert int4.decision == REJECTED and int4.reason.startswith("memory: peak 0.30 GB > 0.20 GB (measured alone")


def test_regime_skips_steps_that_cannot_pay_off():
    syn = Synthetic(tpot_of({("quant", "int8-weight"): 0.5}),
                    labels={"regime.decode.measured": "compute", "regime.phase": "decode", "regime": "compute"})
    res = chain(syn, space={"quant": ["none", "int8-weight"]}).run()
    assert res.rows[1].decision == SKIPPED and "compute-bound" in res.rows[1].reason
    assert chain(syn, space={"quant": ["none", "int8-weight"]}, trust_regime=False).run().rows[1].decision == ACCEPTED


def test_no_regime_skip_rests_on_an_undecided_pair_or_a_loaded_incumbent():
    compute = {"regime.decode.measured": "compute", "regime.phase": "decode", "regime": "compute"}
    space = {"kv_cache": ["off", "contiguous"], "quant": ["none", "int8-weight"]}
    # the KV cache step stays undecided (always loaded): the quantization step is measured, not skipped
    load = "load: other processes used 40.3% of the CPUs (> 25.0%)"
    syn = Synthetic(tpot_of({("quant", "int8-weight"): 0.5}), labels=compute,
                    unstable=lambda p, a: load if p.get("kv_cache") == "contiguous" else "")
    res = chain(syn, space=space, rules=rules(gate=False)).run()
    assert [r.decision for r in res.rows[1:3]] == [UNDECIDED_PAIR, ACCEPTED]
    # a baseline flagged for load: its regime decides nothing
    syn = Synthetic(tpot_of({("quant", "int8-weight"): 0.5}), labels=compute,
                    unstable=lambda p, a: load if len(p) == 1 else "")
    res = chain(syn, space={"quant": ["none", "int8-weight"]}, rules=rules(gate=False)).run()
    assert res.rows[1].decision != SKIPPED


def test_budget_stops_the_chain_and_a_rerun_resumes_from_finished_results():
    factors = {("kv_cache", "contiguous"): 0.5, ("attention", "sdpa"): 0.7, ("quant", "int8-weight"): 0.8}
    syn = Synthetic(tpot_of(factors))
    first = chain(syn, budget=budget(max_trials=3), rules=rules(gate=False)).run()  # baseline + one pair
    # ... and the total pair (final vs baseline), which runs even when the budget is spent
    assert first.stop.startswith("budget") and first.trials == 5 and [r.decision for r in first.rows][1:] == [
        ACCEPTED, TOTAL]
    runs = syn.runs
    again = chain(syn, rules=rules(gate=False)).run()  # same store: the finished trials are reused
    assert again.reused == 3 and again.trials == syn.runs - runs
    assert [r.__dict__ for r in again.rows[:2]] == [r.__dict__ for r in first.rows[:2]]
    assert again.stop == "end of chain"
    assert again.incumbent == {"kv_cache": "contiguous", "attention": "sdpa", "quant": "int8-weight", "speculative": "off"}


def test_the_total_pair_is_fresh_and_a_rerun_reuses_it_with_nothing_run():
    # one step from the baseline, a pair that cannot change the scores (no eval): the total's two points are the
    # step's own, same group -- it must still be a measurement of its own, and a rerun must find it again
    syn = Synthetic(tpot_of({("kv_cache", "contiguous"): 0.5}))
    one = dict(space={"kv_cache": ["off", "contiguous"]}, score_neutral=("kv_cache.mode",))
    first = chain(syn, **one).run()
    step, total = first.rows[1], first.rows[-1]
    assert (step.decision, total.decision) == (ACCEPTED, TOTAL) and step.hashes == total.hashes
    pair_groups = [r for r in syn.requests if r.interleaved]
    assert len(pair_groups) == 2 and pair_groups[-1].skip  # the total skipped the runs the step used
    runs = syn.runs
    again = chain(syn, **one).run()
    assert syn.runs == runs and again.trials == 0 and again.reused == first.trials
    assert [r.__dict__ for r in again.rows] == [r.__dict__ for r in first.rows]
    assert again.total == first.total


def test_a_chain_that_ended_with_an_undecided_pair_replays_from_the_store_with_nothing_run():
    # the pair measured again while undecided (a loaded machine, every attempt), then retried at the chain's end: a
    # rerun of the same command finds each attempt again in order -- the same rows, no trial run (the CI flake this
    # guards: a rerun re-measured a pair the first run had left undecided)
    load = "load: other processes used 40.3% of the CPUs (> 25.0%)"
    syn = Synthetic(tpot_of({("kv_cache", "contiguous"): 0.5}),
                    unstable=lambda p, a: load if p.get("kv_cache") == "contiguous" else "")
    first = chain(syn, space={"kv_cache": ["off", "contiguous"]}, rules=rules(gate=False)).run()
    assert first.stop == "end of chain" and UNDECIDED_PAIR in [r.decision for r in first.rows]
    assert sum(1 for r in syn.requests if r.interleaved) > 1  # measured again
    runs = syn.runs
    again = chain(syn, space={"kv_cache": ["off", "contiguous"]}, rules=rules(gate=False)).run()
    assert syn.runs == runs and again.trials == 0 and again.reused == first.trials
    assert [r.__dict__ for r in again.rows] == [r.__dict__ for r in first.rows]


def test_time_budget_uses_the_injected_clock():
    t = iter(range(0, 1000, 10))
    syn = Synthetic(tpot_of({("kv_cache", "contiguous"): 0.5}))
    res = chain(syn, budget=budget(max_s=15), clock=lambda: next(t)).run()
    assert res.stop == "budget: 15 s"


def test_judge_reports_slower_and_pools_attempts():
    slow = Measurement({}, rounds={"tpot_ms_p50": [12.0, 12.1, 11.9] * 3}, metrics={})
    fast = Measurement({}, rounds={"tpot_ms_p50": [10.0, 10.1, 9.9] * 3}, metrics={})
    v = judge_timing([(fast, slow)], Objective.parse("tpot"), RULES)
    assert v.decision == REJECTED and v.reason.startswith("slower x0.83")
    # 3 rounds cannot give a bound at the look's level; two attempts' 6 rounds pooled cannot either, 9 can
    short = [(Measurement({}, rounds={"tpot_ms_p50": [12.0, 12.1, 11.9]}),
              Measurement({}, rounds={"tpot_ms_p50": [10.0, 10.1, 9.9]}))]
    assert judge_timing(short, Objective.parse("tpot"), RULES).decision == UNDECIDED_PAIR
    assert judge_timing(short * 3, Objective.parse("tpot"), RULES).decision == ACCEPTED


# --- right-size: the model axis is the chain's last step -------------------------------------------------
MODELS = {"kv_cache": ["off", "contiguous"], "model": ["smollm2-135m", "gemma-3-270m"]}


def bytes_of(p):
    return {"smollm2-135m": 2.7e8, "gemma-3-270m": 5.4e8}[p["model"]]


def test_plan_puts_the_model_last_and_keeps_dtype_out_of_right_size():
    steps = plan({"model": ["smollm2-135m", "gemma-3-270m"], "kv_cache": ["off", "contiguous"],
                  "model.dtype": ["float32", "bfloat16"]}, {"model": "smollm2-135m", "kv_cache": "off",
                                                            "model.dtype": "float32"})
    assert [s.key for s in steps] == ["kv_cache", "model.dtype", "model"]
    assert steps[-1].label == "right-size the model"


def test_right_size_skips_a_larger_model_predicted_slower_without_spending_a_trial():
    syn = Synthetic(tpot_of({("kv_cache", "contiguous"): 0.5, ("model", "gemma-3-270m"): 1.6}))
    res = chain(syn, space=MODELS, predict=lambda p: (syn.tpot(p) / 1e3, bytes_of(p))).run()
    last = res.rows[-1]
    assert res.rows[-1].decision == TOTAL  # the kv cache: final vs baseline
    last = res.rows[-2]
    assert (last.label, last.candidate, last.decision) == ("right-size the model", "model=gemma-3-270m", SKIPPED)
    assert last.reason.startswith("cost model: predicted x1.60 slower per token with x2.0 the weight bytes")
    assert not any(p.get("model") == "gemma-3-270m" for r in syn.requests for p in r.points)  # never measured
    assert res.incumbent == {"kv_cache": "contiguous", "model": "smollm2-135m"}
    # no prediction (the roofline cannot say): measured, and rejected on the measurement
    res = chain(Synthetic(syn.tpot), space=MODELS, predict=lambda p: None).run()
    assert res.rows[-2].decision == REJECTED and res.rows[-2].reason.startswith("slower x0.6")


def test_right_size_measures_a_larger_model_when_speculation_is_on():
    """With speculative decoding in the incumbent the per-token roofline says nothing about the tokens a target
    pass yields (they depend on the model): the larger model is measured, and accepted when it is faster."""
    space = {"speculative": ["off", "prompt-lookup"], "model": ["smollm2-135m", "gemma-3-270m"]}
    syn = Synthetic(tpot_of({("speculative", "prompt-lookup"): 0.8, ("model", "gemma-3-270m"): 0.6}))
    res = chain(syn, space=space, predict=lambda p: (1.6e-3 if p["model"] == "gemma-3-270m" else 1e-3, bytes_of(p))).run()
    last = res.rows[-2]
    assert (last.candidate, last.decision) == ("model=gemma-3-270m", ACCEPTED), last
    assert res.incumbent == {"speculative": "prompt-lookup", "model": "gemma-3-270m"}


def test_right_size_accepts_a_smaller_model_only_when_faster_and_the_paired_gate_holds():
    big_first = {"kv_cache": ["off", "contiguous"], "model": ["gemma-3-270m", "smollm2-135m"]}
    faster = tpot_of({("kv_cache", "contiguous"): 0.5, ("model", "smollm2-135m"): 0.6})
    # same answers on the items: accepted
    syn = Synthetic(faster)
    res = chain(syn, space=big_first, predict=lambda p: (syn.tpot(p) / 1e3, bytes_of(p))).run()
    assert res.rows[-2].decision == ACCEPTED and res.rows[-2].reason.endswith("accuracy holds")
    assert res.incumbent == {"kv_cache": "contiguous", "model": "smollm2-135m"}
    # the smaller model loses 10 of the 50 items the larger one answers: rejected by the paired gate, per item
    lossy = Synthetic(faster, wrong=lambda p: 10 if p["model"] == "smollm2-135m" else 0)
    res = chain(lossy, space=big_first, predict=lambda p: (lossy.tpot(p) / 1e3, bytes_of(p))).run()
    assert res.rows[-2].decision == REJECTED and res.rows[-2].reason.startswith("accuracy gate: vs incumbent: emoji_movie -20.0%")
    assert res.incumbent == {"kv_cache": "contiguous", "model": "gemma-3-270m"}
    # no faster than noise: rejected, whatever the accuracy
    near = Synthetic(tpot_of({("kv_cache", "contiguous"): 0.5, ("model", "smollm2-135m"): 1.0}))
    res = chain(near, space=big_first, predict=lambda p: (near.tpot(p) / 1e3, bytes_of(p))).run()
    assert res.rows[-2].decision == REJECTED and res.rows[-2].reason.startswith("below min effect")


def test_a_pair_that_cannot_change_the_task_scores_is_measured_without_the_eval():
    # kv_cache and speculation touch only generation: their pairs run with eval.enabled=false on both trials;
    # attention and quantization change the numerics: their pairs are judged by the paired gate
    neutral = ("kv_cache.mode", "speculative.method")
    syn = Synthetic(tpot_of({("kv_cache", "contiguous"): 0.5, ("attention", "sdpa"): 0.8,
                             ("quant", "int8-weight"): 0.8, ("speculative", "prompt-lookup"): 0.8}))
    res = chain(syn, score_neutral=neutral).run()
    pairs = [r.points for r in syn.requests if r.interleaved]
    off = [p for p in pairs if all(x.get("eval.enabled") == "false" for x in p)]
    on = [p for p in pairs if not any("eval.enabled" in x for x in p)]
    # with the gate on every timing pair runs without the eval (the gate's looks are trials of their own): the kv,
    # attention, two quantization and speculative pairs, and the total pair (final vs baseline)
    assert [p[1]["kv_cache"] for p in off[:1]] == ["contiguous"] and len(off) == 6 and on == []
    assert off[4][1]["speculative"] == "prompt-lookup" and off[5][0] == {**baseline_of(SPACE), "eval.enabled": "false"}
    looks = [r.points for r in syn.requests if not r.interleaved and len(r.points) == 2]
    # the gate looked only at the pairs whose scores can change: attention, and int8-weight (bnb-int8 is slower)
    assert {tuple(sorted(set(p[1].items()) - set(p[0].items()))) for p in looks} == {
        (("attention", "sdpa"),), (("quant", "int8-weight"),)}
    by = {r.label: r for r in res.rows if r.candidate != "quant=bnb-int8"}
    assert by["KV cache"].decision == ACCEPTED and by["KV cache"].accuracy == ""
    assert by["KV cache"].reason.endswith("accuracy equal by construction (kv_cache: task scores do not depend on it)")
    assert by["quantization"].reason.endswith("accuracy holds")  # measured and judged
    assert res.incumbent_measurement.point.get("eval.enabled") == "false"  # the speculative pair's trial: the final
    # the baseline's own accuracy decides nothing: without eval_baseline it runs without the eval
    syn = Synthetic(tpot_of({("kv_cache", "contiguous"): 0.5}))
    res = chain(syn, space={"kv_cache": ["off", "contiguous"]}, score_neutral=neutral, eval_baseline=False).run()
    assert syn.requests[0].points == ({"kv_cache": "off", "eval.enabled": "false"},)
    assert res.rows[0].candidate == "kv_cache=off" and res.rows[1].decision == ACCEPTED


def test_a_later_variant_must_beat_the_accepted_one():
    """Within a step an accepted variant becomes the incumbent: the next level is judged against it (a level
    faster than fp32 but no faster than the accepted INT8 is rejected; one faster than INT8 replaces it)."""
    space = {"quant": ["none", "int8-weight", "int4-weight", "int8-dynamic"]}
    syn = Synthetic(tpot_of({("quant", "int8-weight"): 0.7, ("quant", "int4-weight"): 0.5,
                             ("quant", "int8-dynamic"): 0.69}))
    res = chain(syn, space=space).run()
    quant = [(r.candidate, r.decision) for r in res.rows if r.label == "quantization"]
    assert quant == [("quant=int8-weight", ACCEPTED), ("quant=int4-weight", ACCEPTED), ("quant=int8-dynamic", REJECTED)]
    assert res.incumbent == {"quant": "int4-weight"}
    assert res.path == [{"quant": "none"}, {"quant": "int8-weight"}, {"quant": "int4-weight"}]


def test_the_shipped_settings_have_one_set_of_values():
    """conf/optimize/chain.yaml (what a user reads and Hydra composes) and OptimizeConf (its typed schema) carry
    the same defaults; Rules and Budget have none of their own (settings.rules_of / budget_of build them)."""
    import yaml

    from experiments.config.compose import conf_dir
    from experiments.optimize.settings import from_dict
    from experiments.optimize.types import Budget, Rules

    shipped = yaml.safe_load((conf_dir() / "optimize" / "chain.yaml").read_text())
    assert from_dict(shipped) == OptimizeConf()
    with pytest.raises(TypeError):
        Budget()
    with pytest.raises(TypeError):
        Rules()


def test_every_accepted_step_is_also_gated_against_the_baseline():
    syn = Synthetic(tpot_of({("attention", "sdpa"): 0.7, ("quant", "int8-weight"): 0.7}))
    res = chain(syn, space={"attention": ["eager", "sdpa"], "quant": ["none", "int8-weight"]}).run()
    att, quant = res.rows[1], res.rows[2]
    assert att.decision == ACCEPTED and "vs baseline" not in att.accuracy  # its incumbent is the baseline itself
    assert quant.decision == ACCEPTED and "vs baseline: emoji_movie +0.0%" in quant.accuracy
    assert "n=200 holds" in quant.accuracy.split("vs baseline:")[1]
    # the baseline's answers at 100 and 200 items were measured alone (kept for later steps), at 50 it was the baseline trial
    alone = [r.points[0] for r in syn.requests if not r.interleaved and len(r.points) == 1]
    assert {"attention": "eager", "quant": "none", "eval.limit": "200"} in alone
    # a loss vs the baseline rejects even where the pair vs the incumbent holds (decide.judge_accuracy)
    from experiments.optimize.decide import judge_accuracy

    ok = paired_accuracy("t", [1.0] * 200, [1.0] * 200, 0.03, 0.05 / 3)
    bad = paired_accuracy("t", [1.0] * 200, [0.0] * 20 + [1.0] * 180, 0.03, 0.05 / 3)
    decision, why, _ = judge_accuracy([ok], [bad])
    assert decision == REJECTED and why.startswith("accuracy gate: vs baseline: t -10.0%")


def test_the_chain_table_has_as_many_cells_in_every_row_as_in_its_header():
    """The terminal, chain.md and the dashboard show the same markdown: a `|` left unescaped in a header or a
    cell (the accuracy column's header, a reason quoting `a | b`) shifts every column after it."""
    import re

    from experiments.optimize.table import COLUMNS, to_markdown
    from experiments.optimize.types import Row

    syn = Synthetic(tpot_of({("attention", "sdpa"): 0.7, ("quant", "int8-weight"): 0.7}))
    res = chain(syn, space={"attention": ["eager", "sdpa"], "quant": ["none", "int8-weight"]}).run()
    assert "vs baseline:" in res.rows[2].accuracy  # a cell with both comparisons
    rows = [*res.rows, Row(3, "engine", "engine=x", SKIPPED, "refused before a trial: a | b", accuracy="t | u")]
    lines = to_markdown(rows).splitlines()
    cells = [len(re.split(r"(?<!\\)\|", ln.strip().strip("|"))) for ln in lines]
    assert cells == [len(COLUMNS)] * len(lines), lines


def test_a_candidate_validation_refuses_on_its_incumbent_is_skipped_not_failed_and_notes_group_retries():
    from experiments.optimize.measurement import INVALID
    from experiments.optimize.table import order_notes
    from experiments.optimize.types import Row

    why = "kv_cache.mode: engine.compile_mode=cpp preallocates a static contiguous cache: use kv_cache=contiguous"
    inc = Measurement({"engine": "hf"}, rounds={"tpot_ms_p50": [1.0] * 9})
    v = judge_timing([(inc, Measurement({"engine": "native-cpp"}, status=INVALID, error=why))],
                     Objective.parse("tpot"), RULES)
    assert v.decision == SKIPPED and v.reason == "refused before a trial: " + why
    notes = order_notes([Row(0, "baseline", "b", "baseline", ""), Row(1, "engine", "engine=native-cpp", SKIPPED, v.reason),
                         Row(2, "KV cache", "kv_cache=contiguous", UNDECIDED_PAIR, "unstable"),
                         Row(3, "KV cache (retry)", "kv_cache=contiguous", ACCEPTED, "faster")])
    # the retry's acceptance answers the step: no note for it; the refused step is named as such
    assert notes == [f"the step 'engine' could not run on this chain's incumbent (engine=native-cpp: {v.reason})"]
