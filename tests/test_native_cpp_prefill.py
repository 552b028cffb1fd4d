"""The prompt through the C++ step (`engine.prefill=cpp`, issue 42 item 1): a prompt's T positions as T rows of one
call -- every row's key and value stored before any row attends, each row attending over its own sequence up to its
position (causal by position, no T x T matrix) -- for static batches (`NativeSession.prefill` / multi-token `forward`)
and for continuous batching, where every step (prompt chunks beside decode rows) becomes one C++ call.

Correctness only (speed: benchmarks/bench_cpp_prefill.py): the last position's logits match the eager engine's
(torch's GEMMs) within float rounding on every architecture of the decode-step tests, over the contiguous and the
paged cache, over a second chunk that continues a cached prefix, past Gemma 3's window; every position's logits (a
multi-token step: speculative verification); greedy tokens at every weight layout; continuous batching with chunked
prefill gives each request its tokens alone with every step taken in C++; refusals; config hashes kept.
"""
from __future__ import annotations

import pytest
import torch

from engine.config import BatchingConfig, ModelConfig, QuantConfig, SamplingConfig, replace
from engine.engines import make_backend
from engine.generate import generate
from engine.models import load_model
from engine.validation import check_trial
from support import make_trial
from test_native import hf_tiny
from test_native_cpp import FP32_TOL, _trial, over_threads_and_sync
from test_native_cpp_batch import _batch_ids, alone_tokens

TINY = ModelConfig(name="tiny", path="tiny://llama")
GREEDY = SamplingConfig(temperature=0.0)


def _backends(loaded, attention="sdpa", kv="contiguous", quant=None, dtype="float32", kv_dtype="auto"):
    """The eager engine (torch's prefill and step) and the C++ step with engine.prefill=cpp."""
    out = []
    for mode, compile, prefill in (("dynamic", False, "default"), ("cpp", True, "cpp")):
        t = _trial(loaded.spec, mode=mode, compile=compile, attention=attention, kv_cache=kv, quant=quant)
        t = replace(replace(replace(t, "engine.prefill", prefill), "model.dtype", dtype), "kv_cache.dtype", kv_dtype)
        out.append(make_backend(loaded, t))
    assert out[1].cpp_prefill and not out[0].cpp_prefill
    return out


def _prefill_then_more(backend, ids: torch.Tensor, cut: int):
    """prefill ids[:, :cut] (last logits), then the rest as one multi-token forward (every position's logits),
    then one decode step: the three outputs."""
    s = backend.new_session(int(ids.shape[0]), int(ids.shape[1]) + 2)
    with torch.inference_mode():
        first = s.prefill(ids[:, :cut])
        rest = s.forward(ids[:, cut:])
        step = s.forward(ids[:, :1])
    return first, rest, step


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3", "gemma3-softcap"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("kv", ["contiguous", "paged"])
def test_prefill_in_cpp_matches_torchs_prefill(kind, attention, kv):
    """B = 2 prompts of 20 tokens, then 9 more in one step (its every position), then a decode step -- 30 positions,
    past Gemma 3's window of 8: fp32 within float rounding of the eager engine at each."""
    loaded = hf_tiny(kind, attn=attention)
    eager, cpp = _backends(loaded, attention, kv)
    ids = _batch_ids(2, 29)
    for got, ref in zip(_prefill_then_more(cpp, ids, 20), _prefill_then_more(eager, ids, 20)):
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, **FP32_TOL)


def test_bf16_activations_and_a_bf16_cache_stay_within_their_rounding():
    """bf16 model: torch's bf16 GEMMs over T rows round elsewhere than the step's fp32 sums (an ulp of bf16 logits);
    fp32 model with kv_cache.dtype=bfloat16: the keys and values rounded as stored on both paths, so fp32 rounding."""
    ids = _batch_ids(2, 29, seed=4)
    loaded = hf_tiny("llama")
    eager, cpp = _backends(loaded, kv_dtype="bfloat16")
    for got, ref in zip(_prefill_then_more(cpp, ids, 20), _prefill_then_more(eager, ids, 20)):
        torch.testing.assert_close(got, ref, **FP32_TOL)
    loaded.model.to(torch.bfloat16)
    eager, cpp = _backends(loaded, dtype="bfloat16")
    for got, ref in zip(_prefill_then_more(cpp, ids, 20), _prefill_then_more(eager, ids, 20)):
        assert (got.float() - ref.float()).abs().max() < 0.1


def _odd_llama():
    """hidden 48, intermediate 80, head_dim 16: widths that are not multiples of 32 (the packed rows), of 64 (the
    outer-product kernels' 64-row panels) or of 6 (their weight tiles)."""
    import transformers as tf

    from engine.models import LoadedModel
    from engine.tokenizer import ByteTokenizer

    cfg = tf.LlamaConfig(vocab_size=320, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                         num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=256,
                         initializer_range=0.15, tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LoadedModel(model=tf.LlamaForCausalLM(cfg).eval(), tokenizer=ByteTokenizer(),
                       spec=ModelConfig(name="odd", path="tiny://odd"), load_s=0.0)


@pytest.mark.parametrize("tier", __import__("engine.quant_kernels", fromlist=["cpu_tiers"]).cpu_tiers()[:-1])
@pytest.mark.parametrize("case", ["llama", "llama-int8", "llama-bf16-kv", "gemma3", "odd"])
def test_long_prompts_match_torch_on_every_isa_tier(case, tier, monkeypatch):
    """2 prompts of 100 tokens (200 rows: the linears' outer-product kernels from 64 rows, 64-row panels with a
    remainder; the tiled attention's blocks of 16 rows over key blocks of 64 positions, its running maximum rescaled
    block to block; Gemma 3's window of 8 inside the prompt), then 9 more tokens: fp32 within float rounding of the
    eager engine -- built for each ISA tier this CPU runs (AVX-512: those kernels; AVX2: the row tiles and the
    per-row attention), each its own build."""
    from engine import quant_kernels as qk

    monkeypatch.setenv(qk.ISA_ENV, tier)
    kind = case.split("-")[0]
    if kind == "odd":
        loaded = _odd_llama()
        kw = {}
    elif case == "llama-int8":
        spec = QuantConfig(level="int8-weight", kernel="gemv")
        loaded = load_model(TINY, attention="sdpa", quant=spec)
        kw = {"quant": spec}
    else:
        loaded = hf_tiny(kind)
        kw = {"kv_dtype": "bfloat16"} if case == "llama-bf16-kv" else {}
    eager, cpp = _backends(loaded, **kw)
    assert cpp.decode_step.isa == tier
    ids = _batch_ids(2, 109, seed=7)
    for got, ref in zip(_prefill_then_more(cpp, ids, 100), _prefill_then_more(eager, ids, 100)):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)  # 100 positions of fp32 sums in another order


def test_a_prompt_longer_than_one_calls_rows_is_cut_into_calls(monkeypatch):
    """At most CPP_PREFILL_ROWS rows (sequences x positions) per C++ call: 2 x 100 positions at 48 rows a call are 5
    calls of 24 positions (and a multi-token step likewise), the same logits as one long call and as torch."""
    from engine.engines.native import backend as nb

    loaded = hf_tiny("gemma3")
    eager, cpp = _backends(loaded)
    ids = _batch_ids(2, 109, seed=8)
    whole = _prefill_then_more(cpp, ids, 100)
    monkeypatch.setattr(nb, "CPP_PREFILL_ROWS", 48)
    calls = []
    real = cpp.decode_step.prefill
    monkeypatch.setattr(cpp.decode_step, "prefill", lambda t, *a, **k: calls.append(t.shape[1]) or real(t, *a, **k))
    cut = _prefill_then_more(cpp, ids, 100)
    assert calls == [24, 24, 24, 24, 4, 9]
    for got, one, ref in zip(cut, whole, _prefill_then_more(eager, ids, 100)):
        torch.testing.assert_close(got, one, **FP32_TOL)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("rows", [40, 200])
def test_prefill_logits_do_not_depend_on_threads_or_how_they_meet(rows):
    """1, 2 and 3 threads, with the phases' chunks taken from counters (the default) and with the static split and
    OpenMP barriers (isw_set_sync(1)): the same logits -- each phase's every chunk (the store phase's (row, group)
    pairs, the attention's tiles) done whoever takes it. 40 rows (the row tiles) and 200 (the outer products)."""
    loaded = hf_tiny("gemma3")
    eager, cpp = _backends(loaded)
    ids = _batch_ids(2, rows // 2 + 9, seed=9)
    out = over_threads_and_sync(cpp.decode_step.lib, lambda: _prefill_then_more(cpp, ids, rows // 2))
    ref = _prefill_then_more(eager, ids, rows // 2)
    for key, got in out.items():
        for g, r in zip(got, ref):
            torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-5, msg=lambda m: f"sync, threads {key}: {m}")


@pytest.mark.parametrize("level,kernel", [("none", "gemv-all"), ("int8-weight", "gemv"), ("int4-weight", "gemv"),
                                          ("int4-weight", "gemv-q8"), ("int8-dynamic", "dequant")])
def test_greedy_tokens_equal_torchs_prefill_at_every_weight_layout(level, kernel):
    """fp32 activations, 3 prompts of 21 tokens, 12 greedy tokens: prefill=cpp vs the default prefill, both decoding
    in C++ -- the same tokens at every weight layout the step reads."""
    spec = QuantConfig(level=level, kernel=kernel)
    loaded = load_model(TINY, attention="sdpa", quant=spec)
    prompts = _batch_ids(3, 21, seed=5)
    tokens = {}
    for prefill in ("default", "cpp"):
        be = make_backend(loaded, replace(_trial(TINY, quant=spec), "engine.prefill", prefill))
        tokens[prefill] = torch.as_tensor(generate(be.new_session(3, 21 + 12), prompts, 12, GREEDY, seed=0,
                                                   sync=lambda: None).tokens)
    assert torch.equal(tokens["cpp"], tokens["default"])


@pytest.mark.parametrize("chunked", [False, True])
def test_continuous_batching_runs_every_step_in_cpp_with_each_requests_own_tokens(chunked):
    """The serving scheduler over the paged pool with engine.prefill=cpp: every step -- prompt chunks (cut to 16
    tokens a step when chunked) beside decode rows -- one C++ call; each request's greedy tokens equal its tokens
    decoded alone by the eager engine."""
    from engine.engines.native.serving.serve import ServingSetup
    from engine.serving.requests import make_requests
    from test_serving import CORPUS, serving

    loaded = load_model(TINY, attention="sdpa", quant=QuantConfig())
    spec = serving(n=8, inp=(3, 30), out=(2, 12))
    requests = make_requests(spec, CORPUS, 0)
    ref = alone_tokens(make_backend(loaded, make_trial(TINY, backend="native")), requests)
    trial = make_trial(TINY, backend="native", kv_cache="paged", kv_block_size=4, serving=spec, compile=True,
                       batching=BatchingConfig("continuous", 4, 16 if chunked else 2048, chunked))
    trial = replace(replace(trial, "engine.compile_mode", "cpp"), "engine.prefill", "cpp")
    assert check_trial(trial, gpu_available=False) == []
    be = make_backend(loaded, trial)
    be.decode_step.profile()  # reset the step counter
    trace = ServingSetup(trial, be, check_invariants=True).run(requests)
    assert [list(r.output) for r in trace.requests] == ref
    assert trace.step_seqs / trace.steps > 1.5  # really batched
    assert be.decode_step.profile()["steps"] == trace.steps  # every step, prefill too, in C++


def test_prefill_cpp_is_refused_where_it_cannot_run_and_keeps_the_hashes():
    from experiments.config.hashing import config_hash

    hf = make_trial(TINY, backend="hf")
    assert any(k == "engine.prefill" and "engine=native" in m
               for k, m in check_trial(replace(hf, "engine.prefill", "cpp"), gpu_available=False))
    native = make_trial(TINY, backend="native", kv_cache="contiguous")
    why = [m for k, m in check_trial(replace(native, "engine.prefill", "cpp"), gpu_available=False)
           if k == "engine.prefill"]
    assert why and "engine=native-cpp" in why[0]
    assert check_trial(replace(_trial(TINY), "engine.prefill", "cpp"), gpu_available=False) == []
    # the default leaves every earlier config's hash as it was; cpp is a configuration of its own
    cfg = {"engine": {"backend": "native", "compile": True, "compile_mode": "cpp"}, "model": {"path": "tiny://llama"}}
    with_default = {**cfg, "engine": {**cfg["engine"], "prefill": "default"}}
    with_cpp = {**cfg, "engine": {**cfg["engine"], "prefill": "cpp"}}
    assert config_hash(with_default) == config_hash(cfg) != config_hash(with_cpp)


def _real(name: str):
    from conftest import need_prepared
    from engine.models import prepare_model

    need_prepared(name)
    prepare_model(name)
    model = ModelConfig(name=name, path=f"prepared://{name}")
    return model, load_model(model, attention="sdpa", quant=QuantConfig(kernel="gemv-all"))


@pytest.mark.slow
@pytest.mark.parametrize("name,n,new", [("smollm2-135m-instruct", 300, 16), ("gemma-3-270m", 600, 8)])
def test_real_models_prefill_in_cpp_gives_the_eager_engines_tokens(name, n, new):
    """The real SmolLM2-135M (a 300-token prompt) and Gemma 3 270M (600 tokens: past its 512-token sliding window,
    the windowed layers drop keys inside the prompt's own rows), fp32, 2 sequences: prefill=cpp's greedy tokens are
    the eager engine's, and its last-position logits within float rounding of torch's prefill."""
    model, loaded = _real(name)
    ids = torch.randint(1000, 40000, (2, n), generator=torch.Generator().manual_seed(13))
    eager, cpp = _backends(loaded)
    with torch.inference_mode():
        last = [be.new_session(2, n).prefill(ids) for be in (cpp, eager)]
    torch.testing.assert_close(last[0], last[1], atol=2e-3, rtol=1e-4)  # 30 / 18 layers of fp32 sums in another order
    toks = [torch.as_tensor(generate(be.new_session(2, n + new), ids, new, GREEDY, seed=0, sync=lambda: None).tokens)
            for be in (cpp, eager)]
    assert torch.equal(toks[0], toks[1])
