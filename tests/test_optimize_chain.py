"""The chain strategy and its decision rules on a scripted synthetic objective (tests/optimize_synthetic.py):
known answers, injected noise, no model."""
from __future__ import annotations

import math

import pytest

from experiments.optimize.accuracy import (EXACT, HOLDS, MID_P, UNDECIDED, WORSE, mcnemar_p, min_discordant,
                                           paired_accuracy)
from experiments.optimize.chain import Budget, Chain, baseline_of, plan
from experiments.optimize.decide import ACCEPTED, REJECTED, SKIPPED, Rules, judge, limit_problems
from experiments.optimize.measurement import Measurement
from experiments.optimize.objective import Objective, ObjectiveError

from optimize_synthetic import Synthetic, tpot_of

SPACE = {
    "kv_cache": ["off", "contiguous"],
    "attention": ["eager", "sdpa"],
    "quant": ["none", "bnb-int8", "int8-weight"],
    "speculative": ["off", "prompt-lookup"],
}


def chain(measure, space=SPACE, budget=Budget(max_trials=40), rules=Rules(), **kw):
    return Chain(space, Objective.parse("tpot"), rules, budget, measure, eval_limit=50, **kw)


# --- McNemar against hand-computed values -------------------------------------------------------------
def test_mcnemar_exact_and_mid_p_match_hand_computed_values():
    # b=10, c=2: n=12, P(X<=2) = (1+12+66)/4096 = 79/4096; P(X=2) = 66/4096
    assert mcnemar_p(10, 2) == pytest.approx(2 * 79 / 4096)  # 0.03857
    assert mcnemar_p(10, 2, mid_p=True) == pytest.approx(2 * (79 - 33) / 4096)  # 0.02246
    # b=3, c=3: the most balanced -> p = 1 (exact); mid-p = 2 * (P(X<=3) - P(X=3)/2) = 2 * (42 - 10)/64
    assert mcnemar_p(3, 3) == 1.0
    assert mcnemar_p(3, 3, mid_p=True) == pytest.approx(2 * (42 - 10) / 64)
    assert mcnemar_p(0, 0) == 1.0
    # 5 one-way discordant items: 2/32 = 0.0625 (exact, not significant), mid-p 1/32 (significant)
    assert mcnemar_p(5, 0) == pytest.approx(0.0625)
    assert mcnemar_p(5, 0, mid_p=True) == pytest.approx(1 / 32)
    assert min_discordant(0.05) == 6 and min_discordant(0.05, mid_p=True) == 5


def test_paired_accuracy_verdicts():
    inc = [1.0] * 30 + [0.0] * 20
    same = paired_accuracy("t", inc, list(inc))
    assert (same.verdict, same.delta, same.lo, same.hi, same.b, same.c) == (HOLDS, 0.0, 0.0, 0.0, 0, 0)
    assert same.detectable == pytest.approx(5 / 50)  # mid-p needs 5 one-way discordant items
    drop = paired_accuracy("t", inc, [0.0] * 8 + [1.0] * 22 + [0.0] * 20, test=EXACT)
    assert drop.verdict == WORSE and drop.b == 8 and drop.delta == pytest.approx(-8 / 50)
    assert drop.p == pytest.approx(2 / 256)  # 2 * 0.5^8
    one = paired_accuracy("t", inc, [0.0] + [1.0] * 29 + [0.0] * 20, max_drop=0.01)
    assert one.verdict == UNDECIDED and one.b == 1  # one flip: not significant, and a drop > 1% not excluded


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
    assert limit_problems(m, Rules(slo={"ttft_ms_p99": 500}, max_memory_bytes=1e9)) == [
        "SLO: p99 TTFT 910 ms > 500", "memory: peak 2.00 GB > 1.00 GB"]


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


def test_within_noise_is_never_accepted_even_when_the_median_looks_faster():
    # a 2% gain buried in +-10% noise per round: the interval straddles 1
    syn = Synthetic(tpot_of({("kv_cache", "contiguous"): 0.98}), noise=0.10)
    res = chain(syn, space={"kv_cache": ["off", "contiguous"]}).run()
    assert res.rows[1].decision == REJECTED and res.rows[1].reason.startswith(("within noise", "below min effect"))
    assert res.incumbent == {"kv_cache": "off"}


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
    assert q[0].reason.startswith("accuracy gate: emoji_movie -20.0%")
    assert q[1].candidate == "quant=bnb-int8" and q[1].decision == ACCEPTED
    assert res.incumbent == {"quant": "bnb-int8"}


def test_undecided_accuracy_grows_the_item_count_up_to_the_budget():
    # 2 of 50 items lost: not significant, a 3% drop not excluded -> 100, 200 items (the drop scales with n)
    syn = Synthetic(tpot_of({("quant", "int8-weight"): 0.6}), wrong=lambda p: 2 if p.get("quant") == "int8-weight" else 0)
    res = chain(syn, space={"quant": ["none", "int8-weight"]}, budget=Budget(max_trials=40, max_items=200)).run()
    limits = [r.points[0].get("eval.limit") for r in syn.requests if r.interleaved]
    assert limits == [None, "100", "200"]
    assert res.rows[1].decision == REJECTED and res.rows[1].reason.startswith("accuracy gate")  # 8 of 200: significant


def test_unstable_pairs_are_remeasured_then_undecided_too_noisy():
    # the first measurement of the kv pair ran under load, the second did not: decided on the second
    load = "load: other processes used 40.3% of the CPUs (> 25.0%)"
    syn = Synthetic(tpot_of({("kv_cache", "contiguous"): 0.5}), unstable=lambda p, attempt: load if attempt == 0 else "")
    res = chain(syn, space={"kv_cache": ["off", "contiguous"]}).run()
    assert [r.attempt for r in syn.requests if r.interleaved] == [0, 1]
    assert res.rows[1].decision == ACCEPTED and res.rows[1].attempts == 2
    # flagged for spread only: the interval carries it, and x2 separates from x1 -> decided at once, and it says so
    spread = Synthetic(tpot_of({("kv_cache", "contiguous"): 0.5}),
                       unstable=lambda p, attempt: "spread: tpot_ms_p50 CI half-width 12.3% > 10.0%")
    res = chain(spread, space={"kv_cache": ["off", "contiguous"]}).run()
    assert [r.attempt for r in spread.requests if r.interleaved] == [0]
    assert res.rows[1].decision == ACCEPTED and "unstable: spread of incumbent and candidate; intervals separate" in res.rows[1].reason
    # always unstable: re-measured `remeasure` times, then never accepted or rejected on noise
    noisy = Synthetic(tpot_of({("kv_cache", "contiguous"): 0.5}), unstable=lambda p, a: "other processes busy 40%")
    res = chain(noisy, space={"kv_cache": ["off", "contiguous"]}, budget=Budget(remeasure=2)).run()
    assert [r.attempt for r in noisy.requests if r.interleaved] == [0, 1, 2]
    assert res.rows[1].decision == "undecided" and res.rows[1].reason.startswith("too noisy after 3 measurement(s) (unstable: incumbent other processes busy")
    assert res.incumbent == {"kv_cache": "off"}


def test_regime_skips_steps_that_cannot_pay_off():
    syn = Synthetic(tpot_of({("quant", "int8-weight"): 0.5}),
                    labels={"regime.decode.measured": "compute", "regime.phase": "decode", "regime": "compute"})
    res = chain(syn, space={"quant": ["none", "int8-weight"]}).run()
    assert res.rows[1].decision == SKIPPED and "compute-bound" in res.rows[1].reason
    assert chain(syn, space={"quant": ["none", "int8-weight"]}, trust_regime=False).run().rows[1].decision == ACCEPTED


def test_budget_stops_the_chain_and_a_rerun_resumes_from_finished_results():
    factors = {("kv_cache", "contiguous"): 0.5, ("attention", "sdpa"): 0.7, ("quant", "int8-weight"): 0.8}
    syn = Synthetic(tpot_of(factors))
    first = chain(syn, budget=Budget(max_trials=3)).run()  # baseline + one pair
    assert first.stop.startswith("budget") and first.trials == 3 and len(first.rows) == 2
    runs = syn.runs
    again = chain(syn, budget=Budget(max_trials=40)).run()  # same store: the finished trials are reused
    assert again.reused == 3 and again.trials == syn.runs - runs
    assert [r.__dict__ for r in again.rows[:2]] == [r.__dict__ for r in first.rows]
    assert again.stop == "end of chain"
    assert again.incumbent == {"kv_cache": "contiguous", "attention": "sdpa", "quant": "int8-weight", "speculative": "off"}


def test_time_budget_uses_the_injected_clock():
    t = iter(range(0, 1000, 10))
    syn = Synthetic(tpot_of({("kv_cache", "contiguous"): 0.5}))
    res = chain(syn, budget=Budget(max_s=15), clock=lambda: next(t)).run()
    assert res.stop == "budget: 15 s"


def test_judge_reports_slower():
    slow = Measurement({}, rounds={"tpot_ms_p50": [12.0, 12.1, 11.9]}, metrics={})
    fast = Measurement({}, rounds={"tpot_ms_p50": [10.0, 10.1, 9.9]}, metrics={})
    v = judge(fast, slow, Objective.parse("tpot"), Rules())
    assert v.decision == REJECTED and v.reason.startswith("slower x0.83")


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
    assert (last.label, last.candidate, last.decision) == ("right-size the model", "model=gemma-3-270m", SKIPPED)
    assert last.reason.startswith("cost model: predicted x1.60 slower per token with x2.0 the weight bytes")
    assert not any(p.get("model") == "gemma-3-270m" for r in syn.requests for p in r.points)  # never measured
    assert res.incumbent == {"kv_cache": "contiguous", "model": "smollm2-135m"}
    # no prediction (the roofline cannot say): measured, and rejected on the measurement
    res = chain(Synthetic(syn.tpot), space=MODELS, predict=lambda p: None).run()
    assert res.rows[-1].decision == REJECTED and res.rows[-1].reason.startswith("slower x0.6")


def test_right_size_measures_a_larger_model_when_speculation_is_on():
    """With speculative decoding in the incumbent the per-token roofline says nothing about the tokens a target
    pass yields (they depend on the model): the larger model is measured, and accepted when it is faster."""
    space = {"speculative": ["off", "prompt-lookup"], "model": ["smollm2-135m", "gemma-3-270m"]}
    syn = Synthetic(tpot_of({("speculative", "prompt-lookup"): 0.8, ("model", "gemma-3-270m"): 0.6}))
    res = chain(syn, space=space, predict=lambda p: (1.6e-3 if p["model"] == "gemma-3-270m" else 1e-3, bytes_of(p))).run()
    last = res.rows[-1]
    assert (last.candidate, last.decision) == ("model=gemma-3-270m", ACCEPTED), last
    assert res.incumbent == {"speculative": "prompt-lookup", "model": "gemma-3-270m"}


def test_right_size_accepts_a_smaller_model_only_when_faster_and_the_paired_gate_holds():
    big_first = {"kv_cache": ["off", "contiguous"], "model": ["gemma-3-270m", "smollm2-135m"]}
    faster = tpot_of({("kv_cache", "contiguous"): 0.5, ("model", "smollm2-135m"): 0.6})
    # same answers on the items: accepted
    syn = Synthetic(faster)
    res = chain(syn, space=big_first, predict=lambda p: (syn.tpot(p) / 1e3, bytes_of(p))).run()
    assert res.rows[-1].decision == ACCEPTED and res.rows[-1].reason.endswith("accuracy holds")
    assert res.incumbent == {"kv_cache": "contiguous", "model": "smollm2-135m"}
    # the smaller model loses 10 of the 50 items the larger one answers: rejected by the paired gate, per item
    lossy = Synthetic(faster, wrong=lambda p: 10 if p["model"] == "smollm2-135m" else 0)
    res = chain(lossy, space=big_first, predict=lambda p: (lossy.tpot(p) / 1e3, bytes_of(p))).run()
    assert res.rows[-1].decision == REJECTED and res.rows[-1].reason.startswith("accuracy gate: emoji_movie -20.0%")
    assert res.incumbent == {"kv_cache": "contiguous", "model": "gemma-3-270m"}
    # no faster than noise: rejected, whatever the accuracy
    near = Synthetic(tpot_of({("kv_cache", "contiguous"): 0.5, ("model", "smollm2-135m"): 1.0}))
    res = chain(near, space=big_first, predict=lambda p: (near.tpot(p) / 1e3, bytes_of(p))).run()
    assert res.rows[-1].decision == REJECTED and res.rows[-1].reason.startswith(("within noise", "below min effect"))


def test_paired_accuracy_pairs_by_item_not_by_score():
    # the same accuracy (60%) on different items: unpaired nothing changed, paired 10 items flipped each way
    inc = [1.0] * 30 + [0.0] * 20
    cand = [0.0] * 10 + [1.0] * 20 + [1.0] * 10 + [0.0] * 10
    a = paired_accuracy("t", inc, cand)
    assert (a.b, a.c, a.delta, a.verdict) == (10, 10, 0.0, UNDECIDED)  # 20 discordant items: a drop not excluded
    assert a.detectable == pytest.approx(9 / 50)  # ceil(1.96 * sqrt(20)) = 9 items


def test_a_pair_that_cannot_change_the_task_scores_is_measured_without_the_eval():
    # kv_cache and speculation touch only generation: their pairs run with eval.enabled=false on both trials;
    # attention and quantization change the numerics: their pairs are judged by the paired gate
    neutral = ("kv_cache.mode", "speculative.method")
    syn = Synthetic(tpot_of({("kv_cache", "contiguous"): 0.5, ("attention", "sdpa"): 0.8,
                             ("quant", "int8-weight"): 0.8, ("speculative", "prompt-lookup"): 0.8}))
    res = chain(syn, score_neutral=neutral).run()
    off = [r.points for r in syn.requests if all(p.get("eval.enabled") == "false" for p in r.points)]
    on = [r.points for r in syn.requests if not any("eval.enabled" in p for p in r.points)]
    assert [p[1]["kv_cache"] for p in off[:1]] == ["contiguous"] and len(off) == 2  # the kv and speculative pairs
    assert off[1][1]["speculative"] == "prompt-lookup"
    assert len(on) == 4  # the baseline, the attention pair, the two quantization pairs (int8, then bnb-int8 vs int8)
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
