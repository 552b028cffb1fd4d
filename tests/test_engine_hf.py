"""The hf backend and the shared decode loop on a tiny random Llama: correctness, not just running."""
from __future__ import annotations

import math

import pytest
import torch

from support import make_trial
from engine import EngineError, TrialConfig, ModelConfig, SamplingConfig, WorkloadConfig, load_model, run_engine_trial
from engine.engines import make_backend
from engine.config import TimingConfig
from engine.measure.fidelity import perplexity

TINY = ModelConfig(name="tiny", path="tiny://llama")


def _trial(kv="contiguous", attn="sdpa", **wl):
    w = dict(context_len=40, max_new_tokens=12, batch_size=2, warmup=0, repeats=1)
    w.update(wl)
    # one timed repeat, pinned (timing.max_repeats=0): the definitions below hold within a repeat, and medians
    # of several repeats may come from different ones
    return make_trial(TINY, kv_cache=kv, attention=attn, workload=WorkloadConfig(**w), timing=TimingConfig(max_repeats=0))


@pytest.fixture(scope="module")
def greedy_reference():
    return run_engine_trial(_trial("off", "eager")).token_ids


@pytest.mark.parametrize("kv", ["off", "contiguous"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_greedy_tokens_identical_across_kv_cache_and_attention(kv, attn, greedy_reference):
    r = run_engine_trial(_trial(kv, attn))
    assert r.token_ids == greedy_reference
    assert len(r.token_ids) == 2 and all(len(t) == 12 for t in r.token_ids)
    assert len(set(map(tuple, r.token_ids))) == 2  # different prompts, different continuations


def test_greedy_matches_transformers_generate():
    lm = load_model(TINY, "sdpa")
    r = run_engine_trial(_trial(batch_size=1), loaded=lm)
    from engine.prompts import static_batch_prompts
    from engine.config import TextConfig

    prompt = static_batch_prompts(lm.tokenizer, TextConfig(), 40, 1)
    ref = lm.model.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12, pad_token_id=0)
    assert r.token_ids[0] == ref[0, 40:].tolist()


def test_seeded_sampling_is_reproducible_and_differs_from_greedy(greedy_reference):
    s = dict(sampling=SamplingConfig(temperature=1.0, top_k=50))
    a = run_engine_trial(_trial(**s)).token_ids
    b = run_engine_trial(_trial(repeats=2, **s)).token_ids  # repeats are checked for equality inside
    assert a == b and a != greedy_reference


def test_latency_metrics_follow_vllm_definitions():
    r = run_engine_trial(_trial(batch_size=2, max_new_tokens=8))
    m = r.metrics
    e2e_ms, ttft = m["e2e_s_mean"] * 1e3, m["ttft_ms_mean"]
    assert m["tpot_ms_mean"] == pytest.approx((e2e_ms - ttft) / 7, rel=1e-9)
    assert m["output_tok_s"] == pytest.approx(2 * 8 / m["e2e_s_mean"], rel=1e-9)
    assert m["prefill_tok_s"] == pytest.approx(2 * 40 / (ttft / 1e3), rel=1e-9)
    assert m["itl_ms_p50"] <= m["itl_ms_p99"]
    assert m["peak_mem_bytes"] > m["weights_bytes"] > 0


def test_kv_cache_bytes_are_exact():
    r = run_engine_trial(_trial(max_new_tokens=5))
    # layers * (K and V) * batch * kv_heads * tokens cached * head_dim * fp32; the last token is not cached
    expected = 2 * 2 * 2 * 2 * (40 + 5 - 1) * 16 * 4
    assert r.metrics["kv_cache_bytes"] == expected
    assert run_engine_trial(_trial("off", max_new_tokens=5)).metrics["kv_cache_bytes"] == 0


def test_weights_bytes_counts_parameters():
    lm = load_model(TINY, "sdpa")
    backend = make_backend(lm, make_trial(lm.spec))
    assert backend.weights_bytes() == sum(p.numel() * 4 for p in lm.model.parameters())


def test_session_rollback_restores_logits():
    lm = load_model(TINY, "sdpa")
    backend = make_backend(lm, make_trial(lm.spec))
    ids = torch.randint(3, 200, (1, 20), generator=torch.Generator().manual_seed(0))
    s = backend.new_session(1, 64)
    s.forward(ids[:, :15])
    s.forward(ids[:, 15:19])
    s.rollback(4)
    assert s.length == 15
    a = s.forward(ids[:, 15:16])
    ref = backend.score(ids[:, :16])[:, -1:]
    torch.testing.assert_close(a, ref, atol=1e-4, rtol=1e-4)


def test_perplexity_equals_transformers_loss():
    lm = load_model(TINY, "eager")
    backend = make_backend(lm, make_trial(lm.spec, attention="eager"))
    w = torch.randint(3, 259, (2, 32), generator=torch.Generator().manual_seed(1))
    ours = perplexity(backend, w)
    with torch.no_grad():
        losses = [float(lm.model(input_ids=x[None], labels=x[None]).loss) for x in w]
    assert ours["nll_mean"] == pytest.approx(sum(losses) / 2, rel=1e-5)
    assert ours["ppl"] == pytest.approx(math.exp(sum(losses) / 2), rel=1e-5)


def test_flash_attention_is_a_clear_error_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    with pytest.raises(EngineError, match="flash needs a CUDA GPU"):
        load_model(TINY, "flash")


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(EngineError, match="does not exist"):
        load_model(ModelConfig(name="x", path=str(tmp_path / "nope")))


def test_context_beyond_model_maximum_is_an_engine_error():
    with pytest.raises(EngineError, match="exceeds the model's maximum"):
        run_engine_trial(_trial(context_len=2048, max_new_tokens=4))


@pytest.mark.parametrize("case", ["contiguous-sdpa-fidelity", "off-eager", "self-draft", "prompt-lookup", "native"])
def test_no_future_warning_from_transformers_during_a_trial(case):
    """The hf engine is on transformers' current API: a trial -- load, warm-up, timed decode, perplexity and
    fidelity against the reference, speculative decoding, the native engine on the same HF weights -- raises
    no FutureWarning (transformers announces a removal with one; pyproject's filterwarnings ignores them for
    the rest of the suite, so they are caught here explicitly). `cache=` replaced `past_key_values=` in 5.25:
    the old name warned on every forward and stops working in 5.40."""
    from engine.config import EvalConfig, SpeculativeConfig

    wl = dict(context_len=24, max_new_tokens=6, batch_size=1, warmup=1, repeats=1)
    kw = dict(workload=WorkloadConfig(**wl), timing=TimingConfig(max_repeats=0))
    trial = {
        "contiguous-sdpa-fidelity": lambda: make_trial(TINY, eval=EvalConfig(num_windows=1, fidelity=True), **kw),
        "off-eager": lambda: make_trial(TINY, kv_cache="off", attention="eager", **kw),
        "self-draft": lambda: make_trial(TINY, speculative=SpeculativeConfig(method="self-draft", k=2), **kw),
        "prompt-lookup": lambda: make_trial(TINY, speculative=SpeculativeConfig(method="prompt-lookup", k=2), **kw),
        "native": lambda: make_trial(TINY, backend="native", kv_cache="paged", **kw),
    }[case]()
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FutureWarning)
        r = run_engine_trial(trial)
    assert r.token_ids and len(r.token_ids[0]) == 6  # the trial ran to the end
    future = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if issubclass(w.category, FutureWarning)]
    assert not future, "\n".join(future)


def test_a_future_warning_from_transformers_fails_the_check(monkeypatch):
    """The check above sees transformers' deprecation: the old keyword, put back, is caught."""
    import warnings

    from engine.engines.hf import backend as hf_backend

    monkeypatch.setattr(hf_backend, "cache_kwarg", lambda model: "past_key_values")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FutureWarning)
        run_engine_trial(_trial(max_new_tokens=3))
    assert any(issubclass(w.category, FutureWarning) and "past_key_values" in str(w.message) for w in caught)
