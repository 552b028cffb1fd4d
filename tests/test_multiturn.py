"""Multi-turn conversations (workload.kind=multi-turn): prompts grow by exactly the previous turn, and the
engine's cached state (prefix caching) gives the same tokens as re-prompting from scratch while computing
fewer prompt tokens. Fast tier: the tiny random model, greedy."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from support import make_trial
from engine.config import BatchingConfig, EvalConfig, LengthConfig, ModelConfig, SLOConfig, TimingConfig, WorkloadConfig
from engine.engines import make_backend
from engine.engines.native.serving.serve import ServingSetup
from engine.models import load_model
from engine.pipeline import run_engine_trial
from engine.serving.conversations import make_conversations
from engine.serving.requests import Request, max_request_tokens

TINY = ModelConfig(name="tiny", path="tiny://llama")
CORPUS = torch.arange(3, 3 + 5000) % 300 + 3


def chat(c=3, t=3, think=0.0, prefix=8, inp=(3, 9), out=(2, 6), **kw) -> WorkloadConfig:
    return WorkloadConfig(kind="multi-turn", conversations=c, turns=t, think_time_s=think, prefix_len=prefix,
                          input_len=LengthConfig("uniform", 0, *inp), output_len=LengthConfig("uniform", 0, *out),
                          warmup=1, repeats=1, **kw)


def test_each_turn_is_the_conversation_so_far_plus_a_new_message():
    spec = chat(c=2, t=3, think=0.5, arrival="fixed-rate", rate=2.0)
    convs = make_conversations(spec, CORPUS, 0)
    assert convs == make_conversations(spec, CORPUS, 0)  # seeded
    assert convs.num_requests == 6 and [r.id for r in convs.first_turns()] == [0, 3]
    assert [r.arrival_s for r in convs.first_turns()] == [0.0, 0.5]  # conversations arrive like requests
    prefix = tuple(CORPUS[:8].tolist())
    for conv in convs.items:
        req = next(r for r in convs.first_turns() if r.id == conv.id * 3)
        assert req.prompt[:8] == prefix and req.prompt == conv.messages[0]
        for turn in range(1, 3):
            answer = [7 + turn] * req.max_new_tokens  # any answer: the prompt must carry it verbatim
            nxt = convs.next_turn(req, answer, finished_s=10.0)
            assert nxt.prompt == req.prompt + tuple(answer) + conv.messages[turn]  # grows by exactly that
            assert nxt.id == req.id + 1 and nxt.arrival_s == 10.5 and nxt.max_new_tokens == conv.max_new_tokens[turn]
            req = nxt
        assert convs.next_turn(req, [1], 11.0) is None  # after the last turn
    # the user messages are distinct slices of the text, none repeated
    msgs = [m for c in convs.items for m in c.messages]
    assert len({m for m in msgs}) == len(msgs)
    longest = max(len(r.prompt) for r in convs.first_turns())
    assert max_request_tokens(spec) >= longest + 2 * (9 + 6) + 6


@pytest.fixture(scope="module")
def tiny():
    return load_model(TINY, attention="sdpa")


def converse(loaded, spec, prefix_caching: bool, mode="continuous"):
    trial = make_trial(TINY, backend="native", kv_cache="paged", kv_block_size=4, prefix_caching=prefix_caching,
                       workload=spec, batching=BatchingConfig(mode, max_batch_size=4))
    convs = make_conversations(spec, CORPUS, 0)
    setup = ServingSetup(trial, make_backend(loaded, trial), check_invariants=True)
    return convs, setup.run(convs.first_turns(), convs.next_turn)


@pytest.mark.parametrize("mode", ["continuous", "static"])
def test_cached_state_gives_the_same_tokens_as_reprompting_and_computes_less(tiny, mode):
    spec = chat(c=3, t=3, arrival="all-at-once")
    convs, cached = converse(tiny, spec, True, mode)
    _, scratch = converse(tiny, spec, False, mode)
    assert len(cached.requests) == len(scratch.requests) == 9
    assert [r.output for r in cached.requests] == [r.output for r in scratch.requests]  # identical tokens
    for run in (cached, scratch):
        recs = {r.id: r for r in run.requests}
        for conv in convs.items:
            for turn in range(1, 3):
                prev, cur = recs[conv.id * 3 + turn - 1], recs[conv.id * 3 + turn]
                assert cur.prompt_len == prev.prompt_len + len(prev.output) + len(conv.messages[turn])
                assert cur.sent_s >= prev.token_times_s[-1]  # a turn waits for the answer before it
    assert all(r.cached_tokens == 0 for r in scratch.requests)
    later = [r for r in cached.requests if r.id % 3 > 0]
    # the history (prompt + answer, minus the answer's last token, whose K/V is never computed) in whole blocks
    assert all(r.cached_tokens >= (r.prompt_len - 9 - 1) // 4 * 4 - 4 for r in later)
    assert sum(r.prompt_len - r.cached_tokens for r in cached.requests) < sum(r.prompt_len for r in scratch.requests)


def test_multi_turn_trial_reports_prefill_and_ttft_per_turn(tiny):
    spec = chat(c=2, t=3, arrival="all-at-once")
    trial = make_trial(TINY, backend="native", kv_cache="paged", kv_block_size=4, prefix_caching=True, workload=spec,
                       batching=BatchingConfig("continuous", max_batch_size=4), eval=EvalConfig(enabled=False),
                       slo=SLOConfig(ttft_ms=1e6, tpot_ms=1e6), timing=TimingConfig(max_repeats=1))  # one timed run
    on = run_engine_trial(trial, loaded=tiny)
    off = run_engine_trial(dataclasses.replace(trial, kv_cache=dataclasses.replace(trial.kv_cache, prefix_caching=False)),
                           loaded=tiny)
    assert on.token_ids == off.token_ids and len(on.token_ids) == 6
    assert on.metrics["prompt_tokens"] == off.metrics["prompt_tokens"] == off.metrics["prefill_tokens"]
    assert on.metrics["prefill_tokens"] < off.metrics["prefill_tokens"]
    assert on.metrics["prefill_tokens_last_turn"] < off.metrics["prefill_tokens_last_turn"]
    for r in (on, off):
        assert {len(v) for k, v in r.series.items() if k.startswith("turn_")} == {3}
        grow = r.series["turn_prompt_tokens"]
        assert grow == sorted(grow) and grow[0] < grow[-1]  # the history grows every turn
        assert r.metrics["ttft_ms_last_turn"] == r.series["turn_ttft_ms"][-1]
        from engine.measure.metrics import METRICS, base_metric

        assert {base_metric(k) for k in r.metrics} | set(r.series) <= set(METRICS)


def test_capacity_search_runs_on_a_multi_turn_workload(tiny):
    from engine.config import CapacityConfig

    trial = make_trial(TINY, backend="native", kv_cache="paged", kv_block_size=4, prefix_caching=True,
                       workload=chat(c=2, t=2, arrival="poisson", rate=5.0),
                       batching=BatchingConfig("continuous", max_batch_size=4), eval=EvalConfig(enabled=False),
                       slo=SLOConfig(ttft_ms=1e7, tpot_ms=1e7), capacity=CapacityConfig(search=True, max_probes=3))
    r = run_engine_trial(trial, loaded=tiny)
    assert r.metrics["max_rate_at_slo"] > 0 and r.metrics["capacity_token_mismatches"] == 0 and len(r.token_ids) == 4


def test_bad_multi_turn_input_is_refused_before_launch_all_at_once():
    from experiments.config.compose import SweepError, expand

    base = ["model=tiny-llama", "workload=serving-multiturn", "engine=native", "kv_cache=paged"]
    assert len(expand(base + ["kv_cache.prefix_caching=false,true"])) == 2
    with pytest.raises(SweepError) as ei:
        expand(base + ["workload.conversations=0", "workload.turns=0", "workload.think_time_s=-1"])
    text = "\n".join(ei.value.problems)
    for key in ("workload.conversations: must be >= 1", "workload.turns: must be >= 1",
                "workload.think_time_s: must be >= 0"):
        assert key in text, (key, text)
    with pytest.raises(SweepError) as ei:
        expand(base + ["workload.kind=chat"])
    assert any(p.startswith("workload.kind: 'chat' is not allowed") for p in ei.value.problems)


def test_an_engine_that_serves_but_not_conversations_is_refused():
    from engine import engines
    from engine.validation import check_trial

    trial = make_trial(TINY, backend="native", kv_cache="paged", workload=chat(),
                       batching=BatchingConfig("continuous"))
    for e in engines.all_engines():
        if e.serves and not e.serves_conversations:
            p = check_trial(dataclasses.replace(trial, engine=dataclasses.replace(trial.engine, backend=e.name)), False)
            assert any(k == "workload.kind" and e.serves_conversations_why in m for k, m in p), p
