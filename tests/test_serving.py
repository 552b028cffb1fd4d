"""Serving workloads, static vs continuous batching, paged KV with preemption, prefix caching.

Fast tier: tiny seeded random models. The schedulers are tested without torch (plain sequences and
block counts); correctness is "every request's greedy output under batching equals its output when run
alone" (a static one-sequence session of the native backend: an independent code path).
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from support import make_trial
from engine import TrialConfig, EvalConfig, ModelConfig, WorkloadConfig
from engine.engines import make_backend
from engine.config import BatchingConfig, EngineError, LengthConfig, SamplingConfig, WorkloadConfig, SLOConfig, TimingConfig
from engine.generate import generate
from engine.measure.metrics import METRICS, base_metric
from engine.models import load_model
from engine.engines.native.block_manager import BlockManager
from engine.pipeline import run_engine_trial
from engine.engines.native.serving.block_space import BlockSpace
from engine.engines.native.serving.serve import ServingSetup, pool_blocks
from engine.engines.native.serving.scheduler import ContinuousScheduler, StaticScheduler
from engine.engines.native.serving.sequence import Sequence, Status
from engine.serving.requests import Request, arrival_times, make_requests

TINY = ModelConfig(name="tiny", path="tiny://llama")
CORPUS = torch.arange(3, 3 + 5000) % 300 + 3  # deterministic "text"


def serving(n=8, inp=(4, 40), out=(2, 12), prefix=0, arrival="all-at-once", rate=50.0, **kw) -> WorkloadConfig:
    return WorkloadConfig(num_requests=n, input_len=LengthConfig("uniform", 0, *inp), output_len=LengthConfig("uniform", 0, *out),
                       prefix_len=prefix, arrival=arrival, rate=rate, **kw)


# ---------------------------------------------------------------- workload


def test_same_seed_same_requests_and_lengths_in_range():
    spec = serving(n=20, prefix=8, arrival="poisson", rate=4.0)
    a, b = make_requests(spec, CORPUS, seed=1), make_requests(spec, CORPUS, seed=1)
    assert a == b
    c = make_requests(spec, CORPUS, seed=2)
    assert [r.prompt_len for r in a] != [r.prompt_len for r in c]
    prefix = a[0].prompt[:8]
    for r in a:
        assert r.prompt[:8] == prefix and 8 + 4 <= r.prompt_len <= 8 + 40 and 2 <= r.max_new_tokens <= 12
    assert a[0].arrival_s == 0 and all(x.arrival_s < y.arrival_s for x, y in zip(a, a[1:]))
    assert len({r.prompt[8:] for r in a}) == 20  # every request has its own text after the shared prefix


def test_arrival_processes():
    assert arrival_times(serving(n=5), 0) == [0.0] * 5
    assert arrival_times(serving(n=4, arrival="fixed-rate", rate=2.0), 0) == [0.0, 0.5, 1.0, 1.5]
    n = 4000
    poisson = arrival_times(serving(n=n, arrival="poisson", rate=10.0), 0)
    gaps = [b - a for a, b in zip(poisson, poisson[1:])]
    mean = sum(gaps) / len(gaps)
    cv = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean
    assert mean == pytest.approx(0.1, rel=0.05) and cv == pytest.approx(1.0, abs=0.08)  # exponential gaps
    bursty = arrival_times(serving(n=n, arrival="poisson", rate=10.0, burstiness=0.25), 0)
    bg = [b - a for a, b in zip(bursty, bursty[1:])]
    bmean = sum(bg) / len(bg)
    bcv = (sum((g - bmean) ** 2 for g in bg) / len(bg)) ** 0.5 / bmean
    assert bmean == pytest.approx(0.1, rel=0.15) and bcv == pytest.approx(2.0, rel=0.15)  # gamma k: cv = 1/sqrt(k)


def test_length_trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps({"input_len": i, "output_len": o}) for i, o in [(5, 2), (9, 3)]) + "\n")
    reqs = make_requests(WorkloadConfig(num_requests=3, length_trace=str(path), prefix_len=2), CORPUS, 0)
    assert [(r.prompt_len, r.max_new_tokens) for r in reqs] == [(7, 2), (11, 3), (7, 2)]


# ---------------------------------------------------------------- schedulers (no torch)


def seqs(*shape) -> list[Sequence]:
    """Sequences of (prompt_len, max_new_tokens) with distinct tokens."""
    return [Sequence(Request(i, tuple(range(1000 * i, 1000 * i + p)), o, 0.0)) for i, (p, o) in enumerate(shape)]


def drive(sched, max_steps=500):
    """Run a scheduler to completion with a fake model that always samples token 7; returns batches."""
    batches = []
    while sched.has_unfinished():
        batch = sched.schedule()
        batches.append(batch)
        sched.postprocess(batch, [7] * len(batch.sampling_ids))
        sched.check_invariants()
        assert len(batches) < max_steps
    sched.space.check_invariants()
    assert sched.space.manager.num_free == sched.space.manager.num_blocks
    return batches


def space(num_blocks, block_size=4, prefix=False):
    return BlockSpace(BlockManager(num_blocks, block_size), prefix)


def test_continuous_admission_bounded_by_batch_size_tokens_and_blocks():
    # max_batch_size
    s = ContinuousScheduler(space(100), max_batch_size=2, max_batch_tokens=1000)
    for q in seqs((5, 3), (6, 3), (7, 3)):
        s.add(q)
    first = s.schedule()
    assert [c.seq_id for c in first.chunks] == [0, 1] and first.num_tokens == 11 and len(s.waiting) == 1
    # max_batch_tokens: the second prompt does not fit next to the first; FCFS: the third may not overtake
    s = ContinuousScheduler(space(100), max_batch_size=8, max_batch_tokens=12)
    for q in seqs((8, 3), (8, 3), (2, 3)):
        s.add(q)
    assert [c.seq_id for c in s.schedule().chunks] == [0]
    # blocks: 5 blocks of 4 tokens; a 12-token prompt takes 3 (+1 watermark while another runs)
    s = ContinuousScheduler(space(5), max_batch_size=8, max_batch_tokens=1000)
    for q in seqs((12, 2), (8, 2)):
        s.add(q)
    b = s.schedule()
    assert [c.seq_id for c in b.chunks] == [0] and s.space.manager.num_free == 2
    s.postprocess(b, [7])
    b2 = s.schedule()  # seq 0's 13th token takes a 4th block
    assert [c.seq_id for c in b2.chunks] == [0]  # seq 1 needs 2 blocks + 1 watermark: only 1 free
    drive(s)


def test_continuous_steps_join_and_leave_every_iteration():
    s = ContinuousScheduler(space(100), max_batch_size=2, max_batch_tokens=1000)
    for q in seqs((4, 1), (4, 3), (4, 2)):
        s.add(q)
    batches = drive(s)
    ids = [[c.seq_id for c in b.chunks] for b in batches]
    # step 1 prefills 0 and 1; 0 finishes at once (1 token); step 2 decodes 1 and admits 2 in the same step
    assert ids[0] == [0, 1] and ids[1] == [1, 2]
    assert [len(c.tokens) for c in batches[1].chunks] == [1, 4]


def test_static_batch_runs_to_its_longest_request_before_the_next():
    s = StaticScheduler(space(100), max_batch_size=2, max_batch_tokens=1000)
    for q in seqs((4, 1), (4, 4), (4, 2)):
        s.add(q)
    ids = [[c.seq_id for c in b.chunks] for b in drive(s)]
    # batch {0, 1} runs until 1 is done (4 steps) although 0 finished after the first; then {2}
    assert ids == [[0, 1], [1], [1], [1], [2], [2]]


def test_preemption_by_recompute_when_blocks_run_out():
    # 6 blocks of 4 tokens; two sequences of 8-token prompts growing to 16 tokens need 8 blocks
    s = ContinuousScheduler(space(6), max_batch_size=4, max_batch_tokens=1000)
    a, b = seqs((8, 8), (8, 8))
    s.add(a)
    s.add(b)
    s.watermark = 0  # admit both at once, so that growth has to preempt
    batches = drive(s)
    assert s.stats.preemptions >= 1 and b.num_preemptions >= 1 and a.num_preemptions == 0  # the newest goes
    assert a.output == [7] * 8 and b.output == [7] * 8
    # after preemption b is re-prefilled with prompt + its generated tokens in one chunk
    readmit = [c for bt in batches for c in bt.chunks if c.seq_id == b.id and c.start == 0]
    assert len(readmit) == 2 and len(readmit[1].tokens) > 8


def test_chunked_prefill_splits_long_prompts():
    s = ContinuousScheduler(space(100), max_batch_size=4, max_batch_tokens=8, chunked_prefill=True)
    (q,) = seqs((20, 2))
    s.add(q)
    batches = drive(s)
    assert [(c.start, len(c.tokens), c.sample) for b in batches for c in b.chunks] == [
        (0, 8, False), (8, 8, False), (16, 4, True), (20, 1, True)]


def test_prefix_cache_shares_published_blocks_and_survives_free():
    sp = space(20, block_size=4, prefix=True)
    s = ContinuousScheduler(sp, max_batch_size=4, max_batch_tokens=1000)
    shared = tuple(range(500, 510))  # 10 tokens: 2 full blocks
    a = Sequence(Request(0, shared + (1, 2), 2, 0.0))
    s.add(a)
    drive(s)  # a finished; its blocks are free but keep their content
    b = Sequence(Request(1, shared + (3,), 2, 0.0))
    c = Sequence(Request(2, shared[:8], 2, 0.0))  # exactly 2 blocks: the last token is still recomputed
    s.add(b)
    s.add(c)
    first = s.schedule()
    assert [(ch.start, len(ch.tokens)) for ch in first.chunks] == [(8, 3), (4, 4)]
    assert s.stats.cached_tokens == 8 + 4 and s.stats.admitted_tokens == 12 + 11 + 8
    t0 = sp.table(1)[0]
    assert sp.table(2)[0] == t0 and sp.manager.ref_count(t0) == 2  # shared, not copied
    s.postprocess(first, [7, 7])
    drive(s)


def test_sequence_invariants_are_asserted():
    (q,) = seqs((3, 2))
    with pytest.raises(AssertionError):
        q.computed(1)  # not running
    q.admit(0)
    with pytest.raises(AssertionError):
        q.append(5)  # tokens not computed yet
    q.computed(3)
    q.append(5)
    assert q.status is Status.RUNNING and q.num_uncomputed == 1


# ---------------------------------------------------------------- correctness on the tiny model


@pytest.fixture(scope="module")
def tiny():
    return load_model(TINY, attention="sdpa")


def alone(loaded, requests, attn="sdpa"):
    """Greedy output of each request run alone: a one-sequence static session (contiguous cache)."""
    be = make_backend(loaded, make_trial(loaded.spec, backend="native", attention=attn, kv_cache="contiguous"))
    out = []
    for r in requests:
        prompt = torch.tensor([r.prompt])
        out.append(generate(be.new_session(1, r.prompt_len + r.max_new_tokens), prompt, r.max_new_tokens,
                            SamplingConfig(), 0, lambda: None).tokens[0].tolist())
    return out


def serve(loaded, spec, mode="continuous", attn="sdpa", block=4, num_blocks=0, prefix=False, chunked=False,
          max_batch_size=4, max_batch_tokens=2048):
    trial = make_trial(TINY, backend="native", attention=attn, kv_cache="paged",
                                                                  kv_block_size=block, prefix_caching=prefix,
                                                                  kv_num_blocks=num_blocks,
                        serving=spec, batching=BatchingConfig(mode, max_batch_size, max_batch_tokens, chunked))
    be = make_backend(loaded, trial)
    setup = ServingSetup(trial, be, check_invariants=True)
    requests = make_requests(spec, CORPUS, 0)
    return requests, setup.run(requests)


@pytest.fixture(scope="module")
def mixed(tiny):
    spec = serving(n=10, inp=(3, 30), out=(1, 10))
    requests = make_requests(spec, CORPUS, 0)
    return spec, requests, alone(tiny, requests)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_continuous_greedy_equals_alone_mixed_lengths(tiny, mixed, attn):
    spec, requests, ref = mixed
    _, trace = serve(tiny, spec, attn=attn)
    assert [list(r.output) for r in trace.requests] == ref
    assert trace.stats.preemptions == 0 and trace.step_seqs / trace.steps > 1.5  # really batched


def test_continuous_equals_alone_under_forced_preemption(tiny, mixed):
    spec, requests, ref = mixed
    _, trace = serve(tiny, spec, num_blocks=12, max_batch_size=6)  # 12 blocks of 4: the longest needs 10
    assert trace.stats.preemptions > 0 and any(r.preemptions for r in trace.requests)
    assert [list(r.output) for r in trace.requests] == ref


def test_continuous_equals_alone_with_chunked_prefill(tiny, mixed):
    spec, requests, ref = mixed
    _, trace = serve(tiny, spec, chunked=True, max_batch_tokens=8)
    assert [list(r.output) for r in trace.requests] == ref


def test_prefix_caching_hits_and_keeps_outputs(tiny):
    spec = serving(n=8, inp=(3, 12), out=(2, 6), prefix=13, max_concurrency=2)  # 13: 3 full blocks + 1 token
    requests = make_requests(spec, CORPUS, 0)
    ref = alone(tiny, requests)
    _, off = serve(tiny, spec)
    _, on = serve(tiny, spec, prefix=True)
    _, tight = serve(tiny, spec, prefix=True, num_blocks=10)  # eviction + preemption with sharing
    assert off.stats.prefix_hit_rate == 0
    assert on.step_seqs / on.steps <= 2  # max_concurrency=2: never more than two requests in flight
    assert on.stats.prefix_hit_rate > 0.3 and on.stats.cached_tokens >= 6 * 12
    for t in (off, on, tight):
        assert [list(r.output) for r in t.requests] == ref


def test_static_and_continuous_finish_every_request_with_the_same_tokens(tiny, mixed):
    spec, requests, ref = mixed
    _, st = serve(tiny, spec, mode="static")
    _, co = serve(tiny, spec, mode="continuous")
    assert [list(r.output) for r in st.requests] == ref == [list(r.output) for r in co.requests]
    assert all(len(r.token_times_s) == r_.max_new_tokens for r, r_ in zip(st.requests, requests))
    assert co.steps < st.steps  # iteration-level scheduling needs fewer forward passes for the same work


def test_sampling_is_per_request_so_scheduling_does_not_change_it(tiny):
    spec = serving(n=6, inp=(3, 20), out=(4, 10))
    hot = dataclasses.replace(spec)
    trials = {}
    for mode in ("static", "continuous"):
        trial = make_trial(TINY, backend="native", kv_cache="paged", kv_block_size=4,
                            workload=WorkloadConfig(sampling=SamplingConfig(temperature=1.0, top_k=50)), serving=hot,
                            batching=BatchingConfig(mode, max_batch_size=3), seed=5)
        setup = ServingSetup(trial, make_backend(tiny, trial))
        trials[mode] = [list(r.output) for r in setup.run(make_requests(spec, CORPUS, 0)).requests]
    assert trials["static"] == trials["continuous"]
    assert trials["static"] != alone(tiny, make_requests(spec, CORPUS, 0))  # really sampled, not greedy


def test_pool_sizing():
    spec = serving(n=4, inp=(10, 10), out=(6, 6), prefix=4)  # 20 tokens -> 5 blocks of 4
    assert pool_blocks(spec, BatchingConfig(max_batch_size=3), 4, 0) == 15 + 1
    assert pool_blocks(spec, BatchingConfig(max_batch_size=3), 4, 7) == 7


# ---------------------------------------------------------------- the trial path and metrics


def test_run_engine_trial_serving_metrics_consistent():
    spec = serving(n=6, inp=(4, 20), out=(2, 8), prefix=8, arrival="poisson", rate=40.0)
    trial = make_trial(TINY, backend="native", kv_cache="paged", kv_block_size=4,
                                                                  prefix_caching=True,
                        workload=WorkloadConfig(warmup=1, repeats=1), eval=EvalConfig(enabled=False), serving=spec,
                        batching=BatchingConfig("continuous", max_batch_size=4), slo=SLOConfig(ttft_ms=1e6, tpot_ms=1e6),
                        timing=TimingConfig(max_repeats=0))  # one repeat: the identities below hold within a run
    r = run_engine_trial(trial)
    m = r.metrics
    for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_s"):
        assert m[f"{k}_p50"] <= m[f"{k}_p90"] <= m[f"{k}_p99"]
        assert f"{k}_mean" in m
    for k in m:
        assert base_metric(k) in METRICS, k  # percentiles and spread suffixes of a METRICS entry
    assert m["goodput"] == pytest.approx(m["request_s"]) and m["slo_attainment"] == 1.0  # SLOs nobody misses
    assert m["request_s"] == pytest.approx(6 / m["duration_s"])
    assert m["output_tok_s"] == pytest.approx(sum(map(len, r.token_ids)) / m["duration_s"])
    assert 0 < m["prefix_hit_rate"] < 1 and m["mean_batch_size"] >= 1 and m["kv_peak_bytes"] <= m["kv_cache_bytes"]
    assert m["e2e_s_p99"] <= m["duration_s"]
    assert m["duration_s"] >= make_requests(spec, torch.zeros(1), 0)[-1].arrival_s  # arrivals are waited for
    assert [len(t) for t in r.token_ids] == [q.max_new_tokens for q in make_requests(spec, torch.zeros(1), 0)]
    strict = run_engine_trial(dataclasses.replace(trial, slo=SLOConfig(ttft_ms=1e-3, tpot_ms=1e-3)))
    assert strict.metrics["goodput"] == 0 <= strict.metrics["request_s"]


def test_serving_with_hf_backend_is_refused():
    trial = make_trial(TINY, backend="hf", serving=serving(n=2),
                        batching=BatchingConfig("continuous"))
    with pytest.raises(EngineError, match="native"):
        run_engine_trial(trial)


# ---------------------------------------------------------------- config and validation


def test_config_validation_names_the_keys():
    from experiments.config.compose import SweepError, expand

    base = ["model=tiny-llama", "workload=serving-mixed", "engine=native", "kv_cache=paged"]
    assert len(expand(base + ["batching=static,continuous", "kv_cache.prefix_caching=false,true"])) == 4
    with pytest.raises(SweepError) as ei:
        expand(["model=tiny-llama", "batching=continuous", "engine=hf"])
    text = "\n".join(ei.value.problems)
    assert "engine.backend: batching=continuous runs on engine=native" in text and "serving workload" in text
    bad = base + ["batching=continuous", "workload.input_len.min=50", "workload.input_len.max=10", "workload.rate=0",
                  "workload.output_len.dist=gauss", "slo.tpot_ms=-1", "kv_cache.num_blocks=2", "batching.max_batch_size=0",
                  "workload.burstiness=0", "workload.max_concurrency=-1"]
    with pytest.raises(SweepError) as ei:
        expand(bad)
    text = "\n".join(ei.value.problems)
    for key in ("workload.input_len.max: must be >= its min (50)", "workload.rate: must be > 0",
                "workload.output_len.dist: 'gauss' is not allowed", "slo.tpot_ms: must be > 0",
                "batching.max_batch_size: must be >= 1", "workload.burstiness", "workload.max_concurrency"):
        assert key in text, (key, text)
    with pytest.raises(SweepError) as ei:
        expand(base + ["kv_cache.num_blocks=2"])
    assert "kv_cache.num_blocks: 2 blocks of 16 tokens cannot hold the longest request" in ei.value.problems[0]
    with pytest.raises(SweepError) as ei:
        expand(["model=tiny-llama", "workload=serving-mixed"])
    assert any("kv_cache=paged" in p for p in ei.value.problems)
    with pytest.raises(SweepError) as ei:
        expand(base + ["batching=continuous", "batching.max_batch_tokens=100"])
    assert "batching.max_batch_tokens: must be >= 320" in ei.value.problems[0]
    assert len(expand(base + ["batching=continuous", "batching.max_batch_tokens=100", "batching.chunked_prefill=true"])) == 1


# ---------------------------------------------------------------- slow tier: the real model


@pytest.mark.slow
def test_smollm2_continuous_with_preemption_and_prefix_cache_equals_alone():
    smol = load_model(ModelConfig(name="smollm2", path="prepared://smollm2-135m-instruct"), attention="sdpa")
    from engine.prompts import corpus_ids
    from engine.config import TextConfig

    spec = WorkloadConfig(num_requests=6, input_len=LengthConfig("uniform", 0, 8, 40), output_len=LengthConfig("uniform", 0, 4, 12),
                       prefix_len=32)
    corpus = corpus_ids(smol.tokenizer, TextConfig())
    requests = make_requests(spec, corpus, 0)
    ref = alone(smol, requests)
    trial = make_trial(smol.spec, backend="native", kv_cache="paged", kv_block_size=16,
                                                                       prefix_caching=True, kv_num_blocks=10,
                        serving=spec, batching=BatchingConfig("continuous", max_batch_size=4))
    trace = ServingSetup(trial, make_backend(smol, trial), check_invariants=True).run(requests)
    assert trace.stats.prefix_hit_rate > 0
    assert [list(r.output) for r in trace.requests] == ref
