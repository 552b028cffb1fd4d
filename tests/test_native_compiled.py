"""engine.compile_mode=static on engine=native: the static KV cache and the compiled one-token step.

Correctness only (no speed): greedy tokens of the compiled static step equal the eager native path and
transformers on the tiny model, in float32 and (on a CPU with bf16 units, detected at run time) bfloat16;
the static cache's eager (uncompiled) step matches the contiguous cache's logits; bad combinations are
refused before launch. Each compiled case costs one inductor compile (tens of seconds on a loaded CPU).
"""
from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig, SamplingConfig, replace
from engine.engines import make_backend, problems
from engine.engines.native.compiled import CompiledDecodeStep, StaticKVCache
from engine.generate import generate
from engine.measure.hardware import cpu_bf16_support
from engine.models import load_model
from engine.validation import check_trial
from support import make_trial

GREEDY = SamplingConfig(temperature=0.0)
NEW = 12


def _trial(dtype: str, attention: str = "sdpa", compile: bool = True, mode: str = "static", backend: str = "native"):
    t = make_trial(ModelConfig(name="tiny", path="tiny://llama", dtype=dtype), backend=backend, attention=attention,
                   kv_cache="contiguous", compile=compile)
    return replace(t, "engine.compile_mode", mode)


def _greedy(backend, prompts):
    session = backend.new_session(int(prompts.shape[0]), int(prompts.shape[1]) + NEW)
    return generate(session, prompts, NEW, GREEDY, seed=0, sync=lambda: None).tokens


@pytest.fixture(scope="module")
def prompts():
    return torch.randint(3, 300, (2, 21), generator=torch.Generator().manual_seed(3))


CASES = [("float32", "static"), ("float32", "static-autotune"), pytest.param("bfloat16", "static", marks=pytest.mark.skipif(
    not cpu_bf16_support(), reason="no bf16 units on this CPU (avx512_bf16/amx_bf16): bf16 would be emulated"))]


@pytest.mark.parametrize("dtype,mode", CASES)
def test_compiled_static_step_greedy_tokens_equal_eager_native_and_hf(dtype, mode, prompts):
    loaded = load_model(ModelConfig(name="tiny", path="tiny://llama", dtype=dtype), attention="sdpa")
    compiled = make_backend(loaded, _trial(dtype, mode=mode))
    assert isinstance(compiled.decode_step, CompiledDecodeStep)
    got = _greedy(compiled, prompts)
    assert compiled.extra_metrics()["compile_s"] > 0  # the first step compiled, and its time was kept
    first = compiled.extra_metrics()["compile_s"]
    again = _greedy(compiled, prompts)  # a new session of the same shape reuses the graph
    assert compiled.extra_metrics()["compile_s"] == first
    eager = _greedy(make_backend(loaded, _trial(dtype, compile=False, mode="dynamic")), prompts)
    hf = _greedy(make_backend(loaded, _trial(dtype, compile=False, mode="dynamic", backend="hf")), prompts)
    assert torch.equal(got, again)
    assert torch.equal(got, eager)
    assert torch.equal(got, hf)
    assert compiled.extra_info() == {"cudagraphs": "off (cpu)"}  # graphs are a CUDA thing: said so in the trial


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (CUDA graphs are a CUDA thing)")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_static_step_on_cuda_engages_cudagraphs(dtype, prompts):
    """On CUDA the step replays CUDA graphs (its K/V, token and position tensors at static addresses, so
    cudagraph trees accept the in-place cache writes) and still gives eager's greedy tokens, session after
    session (the static K/V tensors are reused and zeroed per session)."""
    loaded = load_model(ModelConfig(name="tiny", path="tiny://llama", dtype=dtype), attention="sdpa", device="cuda")
    compiled = make_backend(loaded, _trial(dtype))
    cuda_prompts = prompts.to("cuda")
    got = _greedy(compiled, cuda_prompts)
    assert compiled.extra_info() == {"cudagraphs": "engaged"}
    first = compiled.extra_metrics()["compile_s"]
    again = _greedy(compiled, cuda_prompts)
    assert compiled.extra_metrics()["compile_s"] == first  # no recompile, no re-record for a new session
    eager = _greedy(make_backend(loaded, _trial(dtype, compile=False, mode="dynamic")), cuda_prompts)
    assert torch.equal(got, again)
    assert torch.equal(got, eager)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_static_cache_step_matches_contiguous_cache_logits(attention, prompts):
    """The static step's arithmetic, uncompiled: write at a position tensor, attend over all max_len slots
    under a mask; logits equal the contiguous cache's within fp32 rounding, rollback included."""
    loaded = load_model(ModelConfig(name="tiny", path="tiny://llama"), attention=attention)
    ref = make_backend(loaded, _trial("float32", attention, compile=False, mode="dynamic"))
    step = CompiledDecodeStep(ref.model, attention, torch.device("cpu"), compile=False)
    a = ref.model.args
    cache = StaticKVCache(a.num_layers, 2, 40, a.num_kv_heads, a.head_dim, torch.float32, torch.device("cpu"))
    session = ref.new_session(2, 40)
    with torch.inference_mode():
        ref.model(prompts, cache.append(prompts.shape[1]), ref.kernel, cache)
        session.forward(prompts)
        toks = torch.randint(3, 300, (2, 6), generator=torch.Generator().manual_seed(4))
        for j in (0, 1, 2, 3, None, 4, 5):
            if j is None:  # forget two steps, as after a rejected speculative draft, then go on
                cache.rollback(2)
                session.rollback(2)
                continue
            got = step(toks[:, j:j + 1], cache.append(1), ref.kernel, cache)
            want = session.forward(toks[:, j:j + 1])
            assert got.shape == want.shape == (2, 1, a.vocab_size)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert cache.bytes() == session.kv_cache_bytes()


def test_static_modes_are_refused_where_they_cannot_run():
    bad = _trial("float32", compile=False)
    assert ("engine.compile_mode" in {k for k, _ in problems(bad, None, False)})
    paged = replace(_trial("float32"), "kv_cache.mode", "paged")
    assert "kv_cache.mode" in {k for k, _ in problems(paged, None, False)}
    hf = _trial("float32", backend="hf")
    assert any(k == "engine.compile_mode" and "native" in why for k, why in problems(hf, None, False))
    typo = _trial("float32", mode="statik")
    assert any(k == "engine.compile_mode" for k, _ in check_trial(typo, False))
    assert not problems(_trial("float32"), None, False)
    assert not problems(_trial("float32", mode="static-autotune"), None, False)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not cpu_bf16_support(), reason="no bf16 units on this CPU"))])
def test_smollm2_compiled_static_greedy_tokens_equal_eager(dtype):
    """The real checkpoint: in bf16 fused kernels that skip eager's rounding points flip greedy tokens here
    (seen 2026-12-04 before emulate_precision_casts), which random tiny weights do not show."""
    loaded = load_model(ModelConfig(name="smollm2", path="prepared://smollm2-135m-instruct", dtype=dtype), attention="sdpa")
    prompts = torch.randint(3, 40000, (1, 128), generator=torch.Generator().manual_seed(0))
    spec = dict(dtype=dtype)
    eager = make_backend(loaded, replace(_trial(**spec, compile=False, mode="dynamic"), "model", loaded.spec))
    static = make_backend(loaded, replace(_trial(**spec), "model", loaded.spec))
    new = 32
    a = generate(eager.new_session(1, 128 + new), prompts, new, GREEDY, 0, lambda: None).tokens
    b = generate(static.new_session(1, 128 + new), prompts, new, GREEDY, 0, lambda: None).tokens
    assert torch.equal(a, b)
