"""kv_cache.dtype=bfloat16 on engine=native: the K/V cache stored in bf16 under an fp32 model (issue 42 item 2).

What it must hold: the cache really is bf16 (half the bytes, counted so); every path attends over the same rounded
keys and values -- the C++ decode step (reading bf16 rows), the eager decode, the cacheless scoring forward that
perplexity and fidelity use (so a fidelity trial measures what the cache costs), the paged pool and continuous
batching -- within float rounding of each other; the rounding really happens (logits move from the fp32 cache's, by
bf16's relative error); where no path exists it is refused before launch; `auto` keeps every existing hash.
"""
from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig, QuantConfig, replace
from engine.engines import make_backend
from engine.models import load_model
from support import make_trial
from test_native import hf_tiny, incremental_logits
from test_native_cpp import FP32_TOL, _greedy, _problems, _trial

TINY = ModelConfig(name="tiny", path="tiny://llama")
# one key or value rounded differently when the k/v projection sums in another order (the whole window at once vs one
# token) flips a bf16 ulp: logits then differ by ~1e-4 where the fp32 cache's paths agree to ~5e-6
ROUNDING_EDGE_TOL = dict(atol=1e-3, rtol=1e-4)


def _kv(trial, dtype: str):
    return replace(trial, "kv_cache.dtype", dtype)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_every_path_attends_over_the_same_bf16_keys_and_values(kind, attention):
    """29 positions after a 5-token prefill (past Gemma 3's window of 8): the C++ step, whole and split along the
    sequence, and the eager decode agree within fp32 rounding on the bf16 cache; the scoring forward (no cache)
    within a bf16 ulp's edge; and the bf16 cache's logits are not the fp32 cache's (the rounding is applied)."""
    ids = torch.randint(3, 320, (1, 29), generator=torch.Generator().manual_seed(1))
    loaded = hf_tiny(kind, attn=attention)
    out = {}
    for kv in ("auto", "bfloat16"):
        eager = make_backend(loaded, _kv(_trial(loaded.spec, mode="dynamic", compile=False, attention=attention), kv))
        out[kv] = incremental_logits(eager.new_session(1, 29), ids, 5)
        if kv == "bfloat16":
            torch.testing.assert_close(eager.score(ids), out[kv], **ROUNDING_EDGE_TOL)
    cpp = make_backend(loaded, _kv(_trial(loaded.spec, attention=attention), "bfloat16"))
    session = cpp.new_session(1, 29)
    assert session.cache.k[0].dtype == torch.bfloat16
    torch.testing.assert_close(incremental_logits(session, ids, 5), out["bfloat16"], **FP32_TOL)
    lib, threads0 = cpp.decode_step.lib, torch.get_num_threads()
    try:
        lib.isw_set_split(8, 4)  # flash-decoding from 8 positions: 2-6 blocks per KV group
        torch.set_num_threads(2)
        torch.testing.assert_close(incremental_logits(cpp.new_session(1, 29), ids, 5), out["bfloat16"], **FP32_TOL)
    finally:
        lib.isw_set_split(256, 64)
        torch.set_num_threads(threads0)
    moved = (out["bfloat16"] - out["auto"]).abs().max().item()
    scale = out["auto"].abs().max().item()
    assert 1e-4 < moved < 2 ** -7 * scale * 4, (moved, scale)  # rounded, by about bf16's relative error


def test_the_bf16_cache_holds_half_the_bytes_and_the_cost_model_knows():
    from engine.engines import get as get_engine

    loaded = load_model(TINY, attention="sdpa")
    sizes = {}
    for kv in ("auto", "bfloat16"):
        for mode in ("contiguous", "paged"):
            be = make_backend(loaded, _kv(make_trial(TINY, backend="native", kv_cache=mode), kv))
            s = be.new_session(2, 40)
            s.forward(torch.randint(3, 300, (2, 9)))
            sizes[kv, mode] = s.kv_cache_bytes()
    for mode in ("contiguous", "paged"):
        assert sizes["bfloat16", mode][0] * 2 == sizes["auto", mode][0] > 0
        assert sizes["bfloat16", mode][1] * 2 == sizes["auto", mode][1] > 0
    native = get_engine("native")
    assert native.kv_element_bytes(_kv(make_trial(TINY, backend="native"), "bfloat16")) == 2.0
    assert native.kv_element_bytes(make_trial(TINY, backend="native")) is None  # auto: the model's dtype


@pytest.mark.parametrize("level", ["none", "int8-dynamic"])
def test_cpp_step_greedy_tokens_equal_the_eager_engine_on_a_bf16_cache(level):
    prompts = torch.randint(3, 300, (1, 21), generator=torch.Generator().manual_seed(3))
    spec = QuantConfig(level=level, kernel="dequant")
    loaded = load_model(TINY, attention="sdpa", quant=spec)
    cpp = _greedy(make_backend(loaded, _kv(_trial(TINY, quant=spec), "bfloat16")), prompts)
    eager = _greedy(make_backend(loaded, _kv(_trial(TINY, mode="dynamic", compile=False, quant=spec), "bfloat16")),
                    prompts)
    assert torch.equal(cpp, eager)


def test_continuous_batching_over_a_bf16_pool_equals_each_request_alone():
    """The serving path (paged pool in bf16, varlen prefill and decode rows) gives each request the greedy tokens a
    one-sequence contiguous bf16 session gives it."""
    from test_serving import CORPUS, serving
    from engine.config import BatchingConfig, SamplingConfig
    from engine.engines.native.serving.serve import ServingSetup
    from engine.generate import generate
    from engine.serving.requests import make_requests

    loaded = load_model(TINY, attention="sdpa")
    spec = serving(n=8, inp=(3, 30), out=(2, 10))
    requests = make_requests(spec, CORPUS, 0)
    alone = make_backend(loaded, _kv(make_trial(TINY, backend="native"), "bfloat16"))
    ref = [generate(alone.new_session(1, r.prompt_len + r.max_new_tokens), torch.tensor([r.prompt]),
                    r.max_new_tokens, SamplingConfig(), 0, lambda: None).tokens[0].tolist() for r in requests]
    trial = _kv(make_trial(TINY, backend="native", kv_cache="paged", kv_block_size=4, serving=spec,
                           batching=BatchingConfig("continuous", 4, 2048, False)), "bfloat16")
    be = make_backend(loaded, trial)
    assert be.kv_dtype == torch.bfloat16
    trace = ServingSetup(trial, be, check_invariants=True).run(requests)
    assert [list(r.output) for r in trace.requests] == ref
    assert trace.step_seqs / trace.steps > 1.5  # really batched


def test_where_no_path_exists_it_is_refused_before_launch():
    fp32 = _kv(_trial(TINY, mode="static"), "bfloat16")
    assert any("compiled step reads K/V in model.dtype" in m for m in _problems(fp32, "kv_cache.dtype"))
    assert _problems(replace(fp32, "model.dtype", "bfloat16"), "kv_cache.dtype") == []  # the cache is bf16 anyway
    assert _problems(_kv(_trial(TINY), "bfloat16")) == []  # the C++ step runs it
    flash = _kv(make_trial(TINY, backend="native", attention="flash"), "bfloat16")
    assert any("flash-attn" in m for m in _problems(flash, "kv_cache.dtype"))
    assert _problems(_kv(make_trial(TINY, backend="hf"), "bfloat16"), "kv_cache.dtype")  # hf keeps model.dtype
    assert _problems(_kv(make_trial(TINY, backend="native"), "int8"), "kv_cache.dtype")  # not a value native has


def test_auto_keeps_the_config_hash_and_bfloat16_is_an_ordinary_value():
    """The axis existed (llama.cpp's, vLLM's types): `auto` hashes as before, bfloat16 apart from it."""
    from experiments.config.compose import expand

    base = expand(["model=tiny-llama", "engine=native"])[0]
    both = expand(["model=tiny-llama", "engine=native", "kv_cache.dtype=auto,bfloat16"])
    assert base.config_hash == both[0].config_hash != both[1].config_hash
