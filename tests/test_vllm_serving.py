"""engine=vllm serving beyond one list of requests: the capacity search (every probe on ONE vLLM start, the
worker's `--serve` mode) and multi-turn conversations (each next turn built here from the answer before it).

Fast tier: the server's protocol and failure without vLLM. Marker `vllm` (`-m vllm`; needs `.venv-vllm/`,
fails instead of skipping under CI=true): real vLLM on the tiny random model (head_dim 32), greedy, fp32."""
from __future__ import annotations

import dataclasses
import json
import sys

import pytest

from conftest import expand_with_engines_absent, require_installed
from support import make_trial
from engine.config import (BatchingConfig, CapacityConfig, EngineError, EvalConfig, LengthConfig, ModelConfig,
                           SLOConfig, TinyModelConfig, WorkloadConfig)
from engine.engines.vllm import engine as vllm_runner
from engine.pipeline import close_session, open_trial, run_engine_trial, serving_plan
from engine.prompts import corpus_ids
from engine.serving.conversations import make_conversations
from engine.tokenizer import ByteTokenizer

TINY32 = ModelConfig(name="tiny", path="tiny://llama", tiny=TinyModelConfig(num_heads=2, num_kv_heads=1))


needs_vllm = require_installed("vllm")


def chat(**kw) -> WorkloadConfig:
    """Conversations whose history crosses vLLM's CPU block of 128 tokens from the second turn on (its prefix
    cache holds whole blocks): a 120-token system prompt, 60-80-token messages, 4-8-token answers."""
    base = dict(kind="multi-turn", conversations=2, turns=3, think_time_s=0.05, prefix_len=120,
                input_len=LengthConfig("uniform", 0, 60, 80), output_len=LengthConfig("uniform", 0, 4, 8),
                arrival="all-at-once", warmup=1, repeats=1)
    base.update(kw)
    return WorkloadConfig(**base)


def _trial(workload: WorkloadConfig, prefix_caching: bool = False, **kw):
    kw.setdefault("eval", EvalConfig(enabled=False))
    return make_trial(TINY32, backend="vllm", kv_cache="paged", prefix_caching=prefix_caching, workload=workload,
                      threads=1, batching=BatchingConfig("continuous", max_batch_size=4, max_batch_tokens=2048), **kw)


# ------------------------------------------------------------------------------------------ fast tier

def test_a_multi_turn_command_asks_for_each_next_turn():
    trial = _trial(chat(max_concurrency=1))
    tok = ByteTokenizer()
    plan = serving_plan(trial.workload, corpus_ids(tok, trial.workload.text), trial.seed, 1, 1)
    cmd = json.loads(json.dumps(vllm_runner.serving_command(plan)))
    convs = make_conversations(trial.workload, corpus_ids(tok, trial.workload.text), trial.seed)
    assert cmd["follow"] is True and cmd["max_concurrency"] == 1
    assert [r["prompt"] for r in cmd["requests"]] == [list(r.prompt) for r in convs.first_turns()]  # turn 0 only
    assert [r["id"] for r in cmd["requests"]] == [0, 3]


def test_a_server_that_dies_is_an_engine_error_with_its_output(monkeypatch):
    # the project's own python has no vllm: the real worker dies at its first vLLM import, before "ready"
    monkeypatch.setenv(vllm_runner.VLLM_PYTHON_ENV, sys.executable)
    with pytest.raises(EngineError) as ei:
        run_engine_trial(_trial(chat()))
    msg = str(ei.value)
    assert "vLLM server" in msg and "exit code 1" in msg and "No module named 'vllm'" in msg


def test_capacity_search_and_multi_turn_on_vllm_validate_and_the_sweep_has_no_vllm_static_point():
    tiny = ["model=tiny-llama", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1", "engine=vllm",
            "batching=continuous"]
    specs, absent = expand_with_engines_absent(tiny + ["workload=serving-multiturn", "kv_cache.prefix_caching=false,true",
                                                       "capacity.search=false,true"])
    assert len(specs) == 4 and set(absent) <= {"vllm"}
    specs, _ = expand_with_engines_absent(["experiment=serving-capacity"])
    points = {(s.trial.engine.backend, s.trial.batching.mode) for s in specs}
    assert points == {("native", "static"), ("native", "continuous"), ("vllm", "continuous")} and len(specs) == 12


def test_a_choice_a_server_contradicts_exits_2_naming_both_keys():
    from experiments.config.compose import SweepError, expand

    base = ["model=tiny-llama", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1", "workload=serving-multiturn"]
    for extra, want in ((["server=vllm", "batching=static"], "batching=static conflicts with server=vllm, which sets "
                                                             "batching.mode=continuous: a server sets the engine"),
                        (["server=native-static,vllm", "engine=native"], "engine=native conflicts with server=vllm, "
                                                                        "which sets engine.backend=vllm")):
        with pytest.raises(SweepError) as ei:
            expand(base + extra)
        assert any(p.startswith(want) for p in ei.value.problems), ei.value.problems


# ------------------------------------------------------------------------------------------ real vLLM

@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("slo, found", [(SLOConfig(ttft_ms=1e6, tpot_ms=1e6), True),
                                        (SLOConfig(ttft_ms=1e-3, tpot_ms=1e6), False)], ids=["found", "none"])
def test_capacity_search_on_vllm_runs_every_probe_on_one_vllm_start(monkeypatch, slo, found):
    starts, jobs = [], []
    real_init, real_call = vllm_runner.VLLMServer.__init__, vllm_runner.call_worker
    monkeypatch.setattr(vllm_runner.VLLMServer, "__init__", lambda self, *a, **k: (starts.append(1), real_init(self, *a, **k))[1])
    monkeypatch.setattr(vllm_runner, "call_worker", lambda *a, **k: (jobs.append(1), real_call(*a, **k))[1])
    wl = WorkloadConfig(kind="serving", num_requests=6, prefix_len=16, input_len=LengthConfig("uniform", 0, 16, 48),
                        output_len=LengthConfig("uniform", 0, 4, 8), arrival="poisson", rate=5.0, warmup=1, repeats=1)
    cap = CapacityConfig(search=True, max_probes=4, percentile=90)
    r = run_engine_trial(_trial(wl, slo=slo, capacity=cap, eval=EvalConfig(num_windows=1)))
    m = r.metrics
    assert starts == [1] and jobs == []  # every probe and the evaluation ran on one vLLM start
    assert 1 <= m["capacity_probes"] <= cap.max_probes
    assert m["capacity_token_mismatches"] == 0 and len(r.token_ids) == 6 and m["ppl"] > 0
    assert len(r.series["probe_rate"]) == m["capacity_probes"]
    if found:  # every probe meets an SLO this loose: the search stops at the saturating throughput
        assert m["max_rate_at_slo"] > 0 and m["capacity_meets_slo"] == 1 and m["goodput_at_slo"] > 0
        assert m["max_rate_at_slo"] == pytest.approx(m["capacity_saturation_request_s"])
    else:  # not even one request at a time: a result, not a crash
        assert m["max_rate_at_slo"] == 0 and m["capacity_meets_slo"] == 0 and m["capacity_probes"] == 1
        assert r.labels["capacity"].startswith("no rate meets the SLO")


def _converse(prefix_caching: bool):
    """One run of the conversations on vLLM: (conversations, request records by id, per-run metrics, block size)."""
    trial = _trial(chat(), prefix_caching=prefix_caching, slo=SLOConfig(ttft_ms=1e6, tpot_ms=1e6))
    m = open_trial(trial)
    try:
        runs = m.workload.run(1, 1)
        per_run, _ = m.workload.outcome(runs)
        block = int(m.session.info()["vllm_block_size"])
    finally:
        close_session(m.session)
    convs = make_conversations(trial.workload, corpus_ids(m.session.tokenizer, trial.workload.text), trial.seed)
    return convs, {r.id: r for r in runs.traces[0].requests}, per_run[0], block


@pytest.mark.vllm
@needs_vllm
def test_multi_turn_on_vllm_cached_state_gives_the_reprompted_tokens_and_hits_the_prefix_cache():
    convs, cached, m_on, block = _converse(True)
    _, scratch, m_off, _ = _converse(False)
    assert sorted(cached) == sorted(scratch) == list(range(6))
    assert [cached[i].output for i in range(6)] == [scratch[i].output for i in range(6)]  # identical greedy tokens
    for recs in (cached, scratch):
        for conv in convs.items:
            for turn in range(1, conv.turns):
                prev, cur = recs[conv.id * 3 + turn - 1], recs[conv.id * 3 + turn]
                # the prompt grows by exactly the previous answer and the new user message
                assert cur.prompt_len == prev.prompt_len + len(prev.output) + len(conv.messages[turn])
                assert cur.sent_s >= prev.token_times_s[-1] + convs.think_time_s  # after the answer and the think time
    assert all(r.cached_tokens == 0 for r in scratch.values())  # re-prompting computes every prompt token
    for conv in convs.items:
        for turn in range(1, conv.turns):  # the previous turn's prompt is cached in whole blocks
            prev, cur = cached[conv.id * 3 + turn - 1], cached[conv.id * 3 + turn]
            assert cur.cached_tokens >= prev.prompt_len // block * block > 0
    assert m_on["prompt_tokens"] == m_off["prompt_tokens"] == m_off["prefill_tokens"] > m_on["prefill_tokens"]
    assert m_on["prefill_tokens_last_turn"] < m_off["prefill_tokens_last_turn"] and m_on["prefix_hit_rate"] > 0
