"""bfloat16 on both backends: the native runtime against transformers on the tiny model (fast tier).

bf16 keeps 8 significant bits, so two correct implementations that accumulate in a different order (a
one-token attention step against a full causal pass) differ by an ulp or two of the logits. The stated
tolerance: max |logit difference| <= 4 bf16 ulps at the magnitude of the largest reference logit
(0.125 for logits in [4, 8)). Measured here: the native full-sequence forward is bit-identical to
transformers (same rounding points, rope included); cached steps differ by <= 2 ulps. bf16 matmuls run on
any CPU (emulated where there are no bf16 units, slowly), so the shapes stay tiny.
"""
from __future__ import annotations

import math

import pytest
import torch

from engine.engines import make_backend
from engine.config import ModelConfig, SamplingConfig
from support import make_trial
from engine.generate import generate
from engine.models import load_model

ATTN = ("eager", "sdpa")
KV = ("off", "contiguous", "paged")
ULPS = 4


def bf16_tol(ref: torch.Tensor) -> float:
    """ULPS bf16 units in the last place at the largest |logit| (bf16: 7 stored mantissa bits)."""
    return ULPS * 2.0 ** (math.floor(math.log2(ref.abs().max().item())) - 7)


@pytest.fixture(scope="module", params=ATTN)
def tiny_bf16(request):
    loaded = load_model(ModelConfig(name="tiny", path="tiny://llama", dtype="bfloat16"), attention=request.param)
    return request.param, loaded


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 300, (2, 29), generator=torch.Generator().manual_seed(1))


def hf_logits(loaded, ids):
    with torch.inference_mode():
        return loaded.model(input_ids=ids, use_cache=False).logits.float()


def incremental(session, ids, prefill: int):
    """Prefill, one-token steps, then a 3-token chunk (a speculative verification's shape): [B, T, V]."""
    outs = [session.forward(ids[:, :prefill])]
    for i in range(prefill, ids.shape[1] - 3):
        outs.append(session.forward(ids[:, i:i + 1]))
    outs.append(session.forward(ids[:, ids.shape[1] - 3:]))
    return torch.cat(outs, dim=1)


def test_weights_and_caches_really_are_bf16(tiny_bf16):
    attn, loaded = tiny_bf16
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    be = make_backend(loaded, make_trial(loaded.spec, backend="native", attention=attn, kv_cache="paged", kv_block_size=5))
    assert be.dtype == torch.bfloat16 and be.new_session(2, 40).cache.pool.k[0].dtype == torch.bfloat16


def test_native_logits_match_transformers_in_bf16(tiny_bf16, ids):
    attn, loaded = tiny_bf16
    ref = hf_logits(loaded, ids)
    tol = bf16_tol(ref)
    assert 0.03 < tol <= 0.25  # the logits are O(1-10): the tolerance is a few ulps, not a free pass
    native = make_backend(loaded, make_trial(loaded.spec, backend="native", attention=attn))
    assert (native.score(ids) - ref).abs().max().item() <= tol, attn
    for kv in KV:
        be = make_backend(loaded, make_trial(loaded.spec, backend="native", attention=attn, kv_cache=kv, kv_block_size=5))
        got = incremental(be.new_session(2, 40), ids, prefill=11)
        assert got.shape == ref.shape
        assert (got - ref).abs().max().item() <= tol, (attn, kv)
        assert torch.equal(got.argmax(-1), ref.argmax(-1)), (attn, kv)


def test_hf_backend_cached_steps_match_its_full_forward_in_bf16(tiny_bf16, ids):
    attn, loaded = tiny_bf16
    ref = hf_logits(loaded, ids)
    for kv in ("off", "contiguous"):
        be = make_backend(loaded, make_trial(loaded.spec, backend="hf", attention=attn, kv_cache=kv))
        got = incremental(be.new_session(2, 40), ids, prefill=11)
        assert (got - ref).abs().max().item() <= bf16_tol(ref), (attn, kv)


def test_greedy_tokens_identical_across_backends_in_bf16(tiny_bf16):
    attn, loaded = tiny_bf16
    prompt = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(3))
    hf = make_backend(loaded, make_trial(loaded.spec, backend="hf", attention=attn, kv_cache="contiguous"))
    ref = generate(hf.new_session(2, 40), prompt, 16, SamplingConfig(), 0, lambda: None).tokens
    assert len(set(ref[0].tolist())) > 1  # not a degenerate repetition of one token
    for kv in KV:
        be = make_backend(loaded, make_trial(loaded.spec, backend="native", attention=attn, kv_cache=kv, kv_block_size=7))
        got = generate(be.new_session(2, 40), prompt, 16, SamplingConfig(), 0, lambda: None).tokens
        assert torch.equal(got, ref), (attn, kv)
