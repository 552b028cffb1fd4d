"""The C++ decode step for B sequences at once (issue 42 item 3): a static batch over the contiguous or paged cache,
and continuous batching's decode rows over the serving pool, each sequence at its own position through its block
table -- every weight row read once for all B rows.

Correctness only (speed: benchmarks/bench_native_vs_llamacpp.py --batch B, benchmarks/bench_batch_vs_vllm.py): logits
of B = 3 rows match the eager engine's step by step on the architectures of the single-sequence tests (Gemma 3 past
its window; 1-3 threads both ways they meet: tests/test_native_cpp.py, parametrized by batch); greedy tokens equal at
every weight layout; the paged cache gives the contiguous cache's logits; a model whose widths
are not multiples of 32 (the dense kernels' packed rows); continuous batching on the C++ step gives each request the
tokens it gets alone, with the decode steps really taken in C++.
"""
from __future__ import annotations

import pytest
import torch

from engine.config import BatchingConfig, ModelConfig, QuantConfig, SamplingConfig, WorkloadConfig, replace
from engine.engines import make_backend
from engine.engines.native.cpp_step import CppDecodeStep
from engine.generate import generate
from engine.models import LoadedModel, load_model
from engine.tokenizer import ByteTokenizer
from support import make_trial
from test_native import hf_tiny, incremental_logits
from test_native_cpp import FP32_TOL, _trial

TINY = ModelConfig(name="tiny", path="tiny://llama")
GREEDY = SamplingConfig(temperature=0.0)


def _batch_ids(b: int = 3, n: int = 29, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 320, (b, n), generator=torch.Generator().manual_seed(seed))


def alone_tokens(backend, requests) -> list[list[int]]:
    """Each serving request's greedy tokens, decoded alone (a one-sequence session of `backend`)."""
    return [generate(backend.new_session(1, r.prompt_len + r.max_new_tokens), torch.tensor([r.prompt]),
                     r.max_new_tokens, GREEDY, 0, lambda: None).tokens[0].tolist() for r in requests]


def _eager_and_cpp(loaded, dtype="float32", attention="sdpa", kv="contiguous", quant=None, kv_dtype="auto"):
    out = []
    for mode, compile in (("dynamic", False), ("cpp", True)):
        t = _trial(loaded.spec, mode=mode, compile=compile, attention=attention, kv_cache=kv, quant=quant)
        out.append(make_backend(loaded, replace(replace(t, "model.dtype", dtype), "kv_cache.dtype", kv_dtype)))
    assert isinstance(out[1].decode_step, CppDecodeStep)
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3", "gemma3-softcap"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_three_sequences_match_the_eager_engine_step_by_step(kind, attention):
    """B = 3, one token a step after a 5-token prefill, 29 positions (past Gemma 3's window of 8): fp32 within float
    rounding of the eager engine's batch, bf16 within its rounding; and every row the sequence decoded alone by the
    C++ step (whose single-sequence path the other tests hold to the eager engine) within the same."""
    ids = _batch_ids()
    for dtype in ("float32", "bfloat16"):
        loaded = hf_tiny(kind, attn=attention)
        if dtype == "bfloat16":
            loaded.model.to(torch.bfloat16)
        eager, cpp = _eager_and_cpp(loaded, dtype, attention)
        ref = incremental_logits(eager.new_session(3, 29), ids, 5)
        got = incremental_logits(cpp.new_session(3, 29), ids, 5)
        if dtype == "float32":
            torch.testing.assert_close(got, ref, **FP32_TOL)
        else:  # torch's bf16 GEMM over 3 rows is not its GEMV over one (its blocking rounds elsewhere): an ulp here
            assert (got.float() - ref.float()).abs().max() < 0.1
        for row in range(3):  # each row is the sequence decoded alone (its prefill in torch rounds as a batch of one)
            alone = incremental_logits(cpp.new_session(1, 29), ids[row:row + 1], 5)
            if dtype == "float32":
                torch.testing.assert_close(got[row:row + 1], alone, **FP32_TOL)
            else:
                assert (got[row:row + 1].float() - alone.float()).abs().max() < 0.1


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_the_paged_cache_gives_the_contiguous_caches_logits(kind):
    """Blocks of 4 positions through each row's block table (token-major blocks) vs one head-major row per sequence."""
    ids = _batch_ids(seed=2)
    loaded = hf_tiny(kind)
    _, contiguous = _eager_and_cpp(loaded)
    _, paged = _eager_and_cpp(loaded, kv="paged")
    torch.testing.assert_close(incremental_logits(paged.new_session(3, 29), ids, 5),
                               incremental_logits(contiguous.new_session(3, 29), ids, 5), **FP32_TOL)


@pytest.mark.parametrize("level,kernel", [("none", "gemv-all"), ("int8-weight", "gemv"), ("int4-weight", "gemv"),
                                          ("int4-weight", "gemv-q8"), ("int8-dynamic", "dequant")])
def test_batched_greedy_tokens_equal_the_eager_engine(level, kernel):
    """fp32, 4 sequences, 16 tokens: the same tokens at every weight layout the step reads (bf16 is held to its
    rounding by the logits test: torch's bf16 attention over a batch rounds an ulp elsewhere, which swaps the tiny
    random model's near-tied tokens)."""
    model = ModelConfig(name="tiny", path="tiny://llama")
    spec = QuantConfig(level=level, kernel=kernel)
    loaded = load_model(model, attention="sdpa", quant=spec)
    prompts = _batch_ids(4, 21, seed=3)
    tokens = {}
    for mode, compile in (("dynamic", False), ("cpp", True)):
        be = make_backend(loaded, _trial(model, mode=mode, compile=compile, quant=spec))
        tokens[mode] = torch.as_tensor(generate(be.new_session(4, 21 + 16), prompts, 16, GREEDY, seed=0,
                                                sync=lambda: None).tokens)
    assert torch.equal(tokens["cpp"], tokens["dynamic"])


def test_widths_that_are_not_multiples_of_32_pack_the_rows():
    """hidden 48, intermediate 80, head_dim 16: the dense kernels read B rows at stride K (the step's buffers are
    padded to 32), W8A8 quantizes each row on its own."""
    import transformers as tf

    from engine.quant import quantize_model

    cfg = tf.LlamaConfig(vocab_size=320, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                         num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=128,
                         initializer_range=0.15, tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    ids = _batch_ids(seed=6)
    for level in ("none", "int8-dynamic"):
        torch.manual_seed(0)
        model = tf.LlamaForCausalLM(cfg).eval()
        loaded = LoadedModel(model=model, tokenizer=ByteTokenizer(), spec=ModelConfig(name="odd", path="tiny://odd"),
                             load_s=0.0)
        spec = QuantConfig(level=level, kernel="dequant")
        if level != "none":
            quantize_model(model, spec, cfg.num_hidden_layers)
        eager, cpp = _eager_and_cpp(loaded, quant=spec)
        torch.testing.assert_close(incremental_logits(cpp.new_session(3, 29), ids, 5),
                                   incremental_logits(eager.new_session(3, 29), ids, 5), **FP32_TOL)


@pytest.mark.parametrize("kv_dtype,level", [("auto", "none"), ("bfloat16", "int8-dynamic")])
def test_continuous_batching_decodes_in_cpp_with_each_requests_own_tokens(kv_dtype, level):
    """The serving scheduler over the paged pool, engine.compile_mode=cpp: prefill chunks in torch, every all-decode
    step one C++ call over the rows' block tables; each request's greedy tokens equal its tokens alone (a one-sequence
    eager session with the same cache dtype and weights)."""
    from engine.engines.native.serving.serve import ServingSetup
    from engine.serving.requests import make_requests
    from test_serving import CORPUS, serving

    spec_q = QuantConfig(level=level, kernel="dequant")
    loaded = load_model(TINY, attention="sdpa", quant=spec_q)
    spec = serving(n=8, inp=(3, 30), out=(2, 12))
    requests = make_requests(spec, CORPUS, 0)
    ref = alone_tokens(make_backend(loaded, replace(make_trial(TINY, backend="native", quant=spec_q), "kv_cache.dtype",
                                                    kv_dtype)), requests)
    trial = make_trial(TINY, backend="native", kv_cache="paged", kv_block_size=4, serving=spec, compile=True,
                       quant=spec_q, batching=BatchingConfig("continuous", 4, 2048, False))
    trial = replace(replace(trial, "engine.compile_mode", "cpp"), "kv_cache.dtype", kv_dtype)
    from engine.validation import check_trial

    assert check_trial(trial, gpu_available=False) == []
    be = make_backend(loaded, trial)
    be.decode_step.profile()  # reset the step counter
    trace = ServingSetup(trial, be, check_invariants=True).run(requests)
    assert [list(r.output) for r in trace.requests] == ref
    assert trace.step_seqs / trace.steps > 1.5  # really batched
    assert be.decode_step.profile()["steps"] >= trace.steps // 2  # most steps decoded in C++


def _real(name: str, dtype: str = "float32"):
    from conftest import need_prepared
    from engine.models import prepare_model

    need_prepared(name)
    prepare_model(name)
    model = ModelConfig(name=name, path=f"prepared://{name}", dtype=dtype)
    return model, load_model(model, attention="sdpa", quant=QuantConfig(kernel="gemv-all"))


@pytest.mark.slow
def test_gemma3_batch_past_its_window_decodes_the_eager_engines_tokens():
    """The real Gemma 3 270M, 3 sequences of 600 tokens (past its 512-token sliding window: the windowed layers drop
    keys, the global ones keep them), 8 greedy tokens, fp32: the C++ step's batch and the eager engine's, the same
    tokens."""
    model, loaded = _real("gemma-3-270m")
    ids = torch.randint(1000, 50000, (3, 600), generator=torch.Generator().manual_seed(11))
    tokens = {}
    for mode, compile in (("dynamic", False), ("cpp", True)):
        be = make_backend(loaded, _trial(model, mode=mode, compile=compile, quant=QuantConfig(kernel="gemv-all")))
        tokens[mode] = torch.as_tensor(generate(be.new_session(3, 608), ids, 8, GREEDY, seed=0, sync=lambda: None).tokens)
    assert torch.equal(tokens["cpp"], tokens["dynamic"])


@pytest.mark.slow
def test_smollm2_continuous_batching_on_the_cpp_step_gives_each_request_its_own_tokens():
    """The real SmolLM2-135M serving 8 requests of different lengths (prompts 20-120 tokens, 4-16 new) under
    continuous batching with the C++ decode step: each request's greedy tokens equal the eager engine's alone."""
    from engine.engines.native.serving.serve import ServingSetup
    from engine.serving.requests import make_requests
    from test_serving import serving

    model, loaded = _real("smollm2-135m-instruct")
    corpus = torch.randint(1000, 40000, (5000,), generator=torch.Generator().manual_seed(12))
    spec = serving(n=8, inp=(20, 120), out=(4, 16))
    requests = make_requests(spec, corpus, 0)
    ref = alone_tokens(make_backend(loaded, make_trial(model, backend="native", quant=QuantConfig(kernel="gemv-all"))),
                       requests)
    trial = make_trial(model, backend="native", kv_cache="paged", serving=spec, compile=True,
                       quant=QuantConfig(kernel="gemv-all"), batching=BatchingConfig("continuous", 4, 2048, False))
    trial = replace(trial, "engine.compile_mode", "cpp")
    be = make_backend(loaded, trial)
    be.decode_step.profile()
    trace = ServingSetup(trial, be, check_invariants=True).run(requests)
    assert [list(r.output) for r in trace.requests] == ref
    assert be.decode_step.profile()["steps"] > 0
