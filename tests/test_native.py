"""Backend `native`: parity with transformers, KV cache modes, attention kernels, block manager.

Fast tier: tiny seeded random models built from transformers config classes (Llama tied/untied, Qwen2 with
QKV bias, Mistral, Llama 3 rope scaling, linear rope scaling, Gemma 3 with a sliding window of 8 shorter
than the test sequences, so windowed and global layers differ). Slow tier: the real SmolLM2-135M and
Gemma 3 270M.
"""
from __future__ import annotations

import sys

import pytest
import torch

from support import make_trial
from engine import TrialConfig, EvalConfig, ModelConfig, SamplingConfig, WorkloadConfig
from engine.engines import make_backend
from engine.config import EngineError
from engine.generate import generate
from engine.measure.metrics import METRICS
from engine.models import LoadedModel, load_model, weights_bytes
from engine.engines.native.attention import EagerAttention, SdpaAttention
from engine.engines.native.block_manager import BlockManager, OutOfBlocks
from engine.engines.native.rope import inv_frequencies
from engine.pipeline import run_engine_trial
from engine.tokenizer import ByteTokenizer

TOL = 1e-4  # fp32 max abs logit difference vs transformers (the stated tolerance)
ATTN = ("eager", "sdpa")
KV = ("off", "contiguous", "paged")
SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.15, bos_token_id=1,
             eos_token_id=2, pad_token_id=0)


def hf_tiny(kind: str, attn: str = "sdpa", seed: int = 0):
    """A seeded random transformers model of one Llama-family variant."""
    import transformers as tf

    if kind == "llama":
        cfg, cls = tf.LlamaConfig(**SMALL, tie_word_embeddings=True), tf.LlamaForCausalLM
    elif kind == "llama-untied":
        cfg, cls = tf.LlamaConfig(**SMALL, tie_word_embeddings=False), tf.LlamaForCausalLM
    elif kind == "llama3-rope":
        # original_max_position_embeddings is small, so the scaling changes the frequencies we exercise.
        rope = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=32)
        cfg, cls = tf.LlamaConfig(**SMALL, rope_parameters=rope), tf.LlamaForCausalLM
    elif kind == "linear-rope":
        cfg = tf.LlamaConfig(**SMALL, rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0))
        cls = tf.LlamaForCausalLM
    elif kind == "qwen2":
        cfg, cls = tf.Qwen2Config(**SMALL, tie_word_embeddings=False), tf.Qwen2ForCausalLM
    elif kind == "mistral":
        cfg, cls = tf.MistralConfig(**SMALL, sliding_window=None, head_dim=32), tf.MistralForCausalLM
    elif kind in ("gemma3", "gemma3-softcap"):
        # Gemma 3's shape in miniature: one KV head, head_dim != hidden/heads, a query_pre_attn_scalar that is
        # not head_dim, local/global RoPE bases, windowed and global layers (window 8 < the 20-29 tokens here)
        gemma = dict(SMALL, num_key_value_heads=1, head_dim=32, num_hidden_layers=3, sliding_window=8,
                     layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                     query_pre_attn_scalar=24, rope_parameters=dict(
                         sliding_attention=dict(rope_type="default", rope_theta=10000.0),
                         full_attention=dict(rope_type="linear", rope_theta=1000000.0, factor=2.0)),
                     final_logit_softcapping=3.0 if kind == "gemma3-softcap" else None)
        cfg, cls = tf.Gemma3TextConfig(**gemma), tf.Gemma3ForCausalLM
    else:
        raise ValueError(kind)
    cfg._attn_implementation = attn
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(cfg)
        if kind == "qwen2":  # HF initializes biases to zero; make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    torch.nn.init.normal_(proj.bias, std=0.5)
        if kind.startswith("gemma3"):  # HF initializes Gemma's (1 + w) norm weights to w = 0; make them matter
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    torch.nn.init.normal_(p, std=0.3)
    return LoadedModel(model=model.eval(), tokenizer=ByteTokenizer(), spec=ModelConfig(name=kind, path="tiny://" + kind),
                       load_s=0.0)


def native(loaded, attn="sdpa", kv="contiguous", block=16, compile=False):
    return make_backend(loaded, make_trial(loaded.spec, backend="native", attention=attn, kv_cache=kv, kv_block_size=block,
                                                 compile=compile))


def hf_logits(loaded, ids):
    with torch.inference_mode():
        return loaded.model(input_ids=ids, use_cache=False).logits.float()


def incremental_logits(session, ids, prefill: int, chunk: int = 1):
    """Prefill `prefill` tokens, then feed the rest `chunk` at a time; logits for every position [B, T, V]."""
    outs = [session.forward(ids[:, :prefill])]
    for i in range(prefill, ids.shape[1], chunk):
        outs.append(session.forward(ids[:, i:i + chunk]))
    return torch.cat(outs, dim=1)


VARIANTS = ("llama", "llama-untied", "qwen2", "mistral", "llama3-rope", "linear-rope", "gemma3", "gemma3-softcap")


@pytest.fixture(scope="module")
def variants():
    return {k: hf_tiny(k) for k in VARIANTS}


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 320, (2, 29), generator=torch.Generator().manual_seed(1))


# ---------------------------------------------------------------- parity with transformers


@pytest.mark.parametrize("kind", VARIANTS)
def test_score_matches_transformers(variants, ids, kind):
    loaded = variants[kind]
    ref = hf_logits(loaded, ids)
    for attn in ATTN:
        got = native(loaded, attn=attn).score(ids)
        assert got.shape == ref.shape and got.dtype == torch.float32
        assert (got - ref).abs().max().item() <= TOL, (kind, attn)


@pytest.mark.parametrize("kind", VARIANTS)
def test_cached_decode_matches_transformers(variants, ids, kind):
    """Every KV mode x attention kernel: prefill + one-token steps + a 3-token chunk == full forward."""
    loaded = variants[kind]
    ref = hf_logits(loaded, ids)
    for attn in ATTN:
        for kv in KV:
            be = native(loaded, attn=attn, kv=kv, block=5)
            got = incremental_logits(be.new_session(2, 40), ids[:, :20], prefill=11)
            assert (got - ref[:, :20]).abs().max().item() <= TOL, (kind, attn, kv)
            s = be.new_session(2, 40)
            chunked = incremental_logits(s, ids, prefill=8, chunk=3)  # 21 = 7 chunks of 3 after the prompt
            assert (chunked - ref).abs().max().item() <= TOL, (kind, attn, kv, "chunked")


@pytest.mark.parametrize("attn", ATTN)
def test_varlen_batch_matches_transformers_under_a_sliding_window(variants, ids, attn):
    """Continuous batching's path (forward_varlen over a paged pool): prefills, a chunk appended to a cached
    prefix and decode rows in one step, each sequence longer than Gemma 3's window of 8."""
    from engine.engines.native.kv_cache import KVPool
    from engine.engines.native.varlen import VarlenBatch

    loaded = variants["gemma3"]
    ref = hf_logits(loaded, ids)  # [2, 29, V]
    be = native(loaded, attn=attn)
    a = be.model.args
    pool = KVPool(a.num_layers, 32, 4, a.num_kv_heads, a.head_dim, torch.float32, torch.device("cpu"))
    tables = [list(range(0, 8)), list(range(8, 16))]  # 8 blocks of 4 = 32 positions each

    def step(q_lens, ctx_lens):
        toks = torch.cat([ids[i, c - q:c] for i, (q, c) in enumerate(zip(q_lens, ctx_lens))])
        batch = VarlenBatch(pool, q_lens, ctx_lens, tables)
        with torch.inference_mode():
            out = be.model.forward_varlen(toks, batch, be.kernel, torch.arange(len(toks)))
        want = torch.cat([ref[i, c - q:c] for i, (q, c) in enumerate(zip(q_lens, ctx_lens))])
        assert (out - want).abs().max().item() <= TOL, (attn, q_lens, ctx_lens)

    step([17, 12], [17, 12])  # two prompts, both past the window
    step([1, 5], [18, 17])  # a decode row beside a chunk appended to a cached prefix
    step([1, 1], [19, 18])  # all decodes (one padded gather, per-row window masks)
    step([10, 11], [29, 29])


def test_model_shares_weights_with_transformers(variants):
    for kind in ("llama", "llama-untied", "qwen2"):
        loaded = variants[kind]
        be = native(loaded)
        hf_ptrs = {p.data_ptr() for p in loaded.model.parameters()}
        assert all(p.data_ptr() in hf_ptrs for p in be.model.parameters()), kind
        assert be.weights_bytes() == weights_bytes(loaded.model)  # shared, so the same bytes, counted once
        tied = be.model.lm_head.weight is be.model.embed_tokens.weight
        assert tied == (kind == "llama")
    qwen = native(variants["qwen2"]).model.layers[0].self_attn
    assert qwen.q_proj.bias is not None and qwen.o_proj.bias is None


def test_rope_scaling_changes_frequencies(variants):
    base = inv_frequencies(variants["llama"].config, 16)
    l3 = inv_frequencies(variants["llama3-rope"].config, 16)
    lin = inv_frequencies(variants["linear-rope"].config, 16)
    assert torch.allclose(lin, base / 4)
    assert l3[0] == base[0] and l3[-1] == pytest.approx(base[-1].item() / 8)  # high freq kept, low divided


# ---------------------------------------------------------------- greedy generation == hf backend


def test_greedy_tokens_identical_to_hf_backend_for_every_combination():
    prompt = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(3))
    ref_tokens = None
    for attn in ATTN:
        loaded = load_model(ModelConfig(name="tiny", path="tiny://llama"), attention=attn)
        hf = make_backend(loaded, make_trial(loaded.spec, backend="hf", attention=attn, kv_cache="contiguous"))
        ref = generate(hf.new_session(2, 40), prompt, 16, SamplingConfig(), 0, lambda: None).tokens
        if ref_tokens is None:
            ref_tokens = ref
        assert torch.equal(ref, ref_tokens)
        for kv in KV:
            be = native(loaded, attn=attn, kv=kv, block=7)  # 7 divides neither 24 nor 40
            got = generate(be.new_session(2, 40), prompt, 16, SamplingConfig(), 0, lambda: None).tokens
            assert torch.equal(got, ref), (attn, kv)
    assert len(set(ref_tokens[0].tolist())) > 1  # not a degenerate repetition of one token


def test_run_engine_trial_native_reports_attention_memory():
    def trial(backend, attn):
        return make_trial(ModelConfig(name="tiny", path="tiny://llama"), backend=backend, attention=attn, kv_cache="contiguous",
                           workload=WorkloadConfig(context_len=32, max_new_tokens=6, batch_size=2, warmup=1, repeats=2),
                           eval=EvalConfig(enabled=True, num_windows=1))
    hf = run_engine_trial(trial("hf", "sdpa"))
    eager = run_engine_trial(trial("native", "eager"))
    sdpa = run_engine_trial(trial("native", "sdpa"))
    assert eager.token_ids == hf.token_ids == sdpa.token_ids
    assert eager.metrics["ppl"] == pytest.approx(hf.metrics["ppl"], rel=1e-5)
    assert "attn_peak_bytes" in METRICS and "attn_peak_bytes" not in hf.metrics
    # prefill of 32 tokens dominates: eager holds scores + probs [B, Hkv, g*T, S] fp32 (4 heads), + 2 bool masks
    assert eager.metrics["attn_peak_bytes"] == 2 * (2 * 4 * 32 * 32 * 4) + 2 * 32 * 32
    assert 0 < sdpa.metrics["attn_peak_bytes"] < eager.metrics["attn_peak_bytes"]
    assert sdpa.metrics["kv_cache_bytes"] == 2 * 2 * 2 * 2 * 38 * 16 * 4  # K+V, layers, B, Hkv, max_len, D, fp32


# ---------------------------------------------------------------- KV cache modes


def _token_bytes(cfg) -> int:
    """Bytes of K + V of one token over all layers, fp32, from the config's shapes."""
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4


def test_kv_cache_bytes_exact(variants, ids):
    loaded = variants["llama"]
    tb = _token_bytes(loaded.config)
    b, max_len, n = 2, 40, 29
    for kv in KV:
        s = native(loaded, kv=kv, block=6).new_session(b, max_len)
        assert s.kv_cache_bytes() == ((b * max_len * tb, 0) if kv == "contiguous" else (0, 0))
        s.forward(ids[:, :n])
        alloc, used = s.kv_cache_bytes()
        if kv == "off":
            assert (alloc, used) == (0, 0)
        elif kv == "contiguous":
            assert (alloc, used) == (b * max_len * tb, b * n * tb)
        else:  # 29 tokens in blocks of 6 -> 5 blocks per sequence, the last one partly filled
            assert (alloc, used) == (b * 5 * 6 * tb, b * n * tb)
            assert s.cache.pool_bytes() == b * 7 * 6 * tb  # ceil(40 / 6) = 7 blocks reserved per sequence
            assert [len(t) for t in s.cache.block_tables] == [5, 5]


@pytest.mark.parametrize("kv", KV)
def test_rollback_equals_never_appending(variants, ids, kv):
    loaded = variants["qwen2"]
    be = native(loaded, kv=kv, block=4)
    prompt, spec, fix = ids[:, :13], ids[:, 13:18], ids[:, 18:22]
    s = be.new_session(2, 32)
    s.forward(prompt)
    s.forward(spec)  # 5 speculative tokens...
    s.rollback(3)  # ...of which 2 are accepted
    assert s.length == 15
    got = s.forward(fix)
    fresh = be.new_session(2, 32)  # the same calls, minus the rejected tokens
    fresh.forward(prompt)
    fresh.forward(spec[:, :2])
    want = fresh.forward(fix)
    # Not bit-equal: the kept K/V were computed in a 5-token matmul rather than a 2-token one (rounding).
    assert (got - want).abs().max() <= 1e-5
    assert (got - hf_logits(loaded, torch.cat([prompt, spec[:, :2], fix], 1))[:, -4:]).abs().max() <= TOL
    if kv == "paged":
        cache = s.cache
        assert [len(t) for t in cache.block_tables] == [5, 5]  # ceil(19 / 4)
        assert cache.manager.num_used == 10
        s.rollback(8)  # back to 11 tokens: 3 blocks each, the rest returned to the free list
        assert cache.manager.num_used == 6 and s.kv_cache_bytes()[1] == 2 * 11 * _token_bytes(loaded.config)
        cache.manager.check_invariants()
        cache.release()
        assert cache.manager.num_free == cache.manager.num_blocks


def test_session_refuses_overflow(variants, ids):
    for kv in KV:
        s = native(variants["llama"], kv=kv).new_session(2, 10)
        with pytest.raises(EngineError, match="max_len"):
            s.forward(ids[:, :11])


# ---------------------------------------------------------------- block manager


def test_block_manager_alloc_free_refcount_invariants():
    bm = BlockManager(num_blocks=4, block_size=16)
    assert bm.blocks_for(0) == 0 and bm.blocks_for(16) == 1 and bm.blocks_for(17) == 2
    got = [bm.allocate() for _ in range(4)]
    assert sorted(got) == [0, 1, 2, 3] and bm.num_free == 0
    bm.check_invariants()
    with pytest.raises(OutOfBlocks, match="out of blocks"):
        bm.allocate()
    assert isinstance(OutOfBlocks("x"), EngineError)
    bm.share(got[1])  # a second sequence shares the prefix block
    assert bm.ref_count(got[1]) == 2
    bm.free(got[1])
    assert bm.ref_count(got[1]) == 1 and bm.num_free == 0  # still owned by the first sequence
    bm.free(got[1])
    bm.free(got[2])
    assert bm.num_free == 2 and bm.ref_count(got[1]) == 0
    bm.check_invariants()
    with pytest.raises(EngineError, match="double free"):
        bm.free(got[1])
    with pytest.raises(EngineError, match="not allocated"):
        bm.share(got[2])
    assert bm.allocate() == got[1]  # FIFO: the earliest freed block is reused first
    bm.check_invariants()


def test_paged_cache_runs_out_of_blocks_when_pool_is_small(variants, ids):
    from engine.engines.native.kv_cache import PagedKVCache

    cfg = variants["llama"].config
    cache = PagedKVCache(cfg.num_hidden_layers, 2, 64, cfg.num_key_value_heads, 16, block_size=4,
                         dtype=torch.float32, device=torch.device("cpu"), num_blocks=5)
    cache.append(8)  # 2 blocks x 2 sequences
    with pytest.raises(OutOfBlocks):
        cache.append(4)  # needs 2 more, only 1 left
    cache.manager.check_invariants()


# ---------------------------------------------------------------- attention kernels


def _attn_inputs(t, b=1, hq=8, hkv=2, d=32):
    g = torch.Generator().manual_seed(t)
    return (torch.randn(b, hq, t, d, generator=g), torch.randn(b, hkv, t, d, generator=g),
            torch.randn(b, hkv, t, d, generator=g))


def test_eager_and_sdpa_agree_and_eager_memory_grows_quadratically():
    peaks = {}
    for t in (128, 256, 512):
        q, k, v = _attn_inputs(t)
        e, s = EagerAttention(), SdpaAttention()
        oe, os_ = e(q, k, v, None, 0, 0), s(q, k, v, None, 0, 0)
        assert torch.allclose(oe, os_, atol=1e-5)
        peaks[t] = (e.peak_bytes, s.peak_bytes)
    assert peaks[256][0] == 4 * peaks[128][0] and peaks[512][0] == 4 * peaks[256][0]  # O(N^2)
    assert peaks[512][1] < 2.5 * peaks[256][1]  # O(N): tiles + logsumexp
    assert peaks[512][0] > 20 * peaks[512][1]
    # a chunk appended to a cached prefix: explicit causal mask with an offset, both kernels agree
    q, k, v = _attn_inputs(64)
    oe = EagerAttention()(q[:, :, -5:], k, v, None, 0, 59)
    os_ = SdpaAttention()(q[:, :, -5:], k, v, None, 0, 59)
    full = SdpaAttention()(q, k, v, None, 0, 0)[:, :, -5:]
    assert torch.allclose(oe, full, atol=1e-5) and torch.allclose(os_, full, atol=1e-5)


def test_flash_gives_clear_error_on_cpu(variants):
    with pytest.raises(EngineError, match="CUDA"):
        native(variants["llama"], attn="flash")
    assert "flash_attn" not in sys.modules  # the guarded import never ran


# ---------------------------------------------------------------- unsupported models


def test_unsupported_architecture_names_hf_backend():
    import transformers as tf

    cfg = tf.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    loaded = LoadedModel(model=tf.GPT2LMHeadModel(cfg).eval(), tokenizer=ByteTokenizer(),
                         spec=ModelConfig(name="gpt2", path="tiny://gpt2"), load_s=0.0)
    with pytest.raises(EngineError, match=r"model_type 'gpt2'.*backend hf"):
        native(loaded)


def test_unsupported_rope_type_is_an_error():
    import transformers as tf

    rope = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL, rope_parameters=rope))
    loaded = LoadedModel(model=model.eval(), tokenizer=ByteTokenizer(), spec=ModelConfig(name="y", path="tiny://y"),
                         load_s=0.0)
    with pytest.raises(EngineError, match="rope type 'yarn'.*backend hf"):
        native(loaded)


def test_sliding_window_beyond_window_is_refused():
    import transformers as tf

    model = tf.MistralForCausalLM(tf.MistralConfig(**SMALL, sliding_window=16)).eval()
    loaded = LoadedModel(model=model, tokenizer=ByteTokenizer(), spec=ModelConfig(name="m", path="tiny://m"), load_s=0.0)
    be = native(loaded)
    be.new_session(1, 16)  # within the window: exact
    with pytest.raises(EngineError, match="sliding window"):
        be.new_session(1, 17)


# ---------------------------------------------------------------- slow tier


@pytest.mark.slow
def test_compile_decode_step_keeps_logits_and_tokens(variants, ids):
    loaded = variants["llama"]
    prompt = ids[:, :12]
    ref = generate(native(loaded).new_session(2, 32), prompt, 10, SamplingConfig(), 0, lambda: None).tokens
    be = native(loaded, compile=True)
    got = generate(be.new_session(2, 32), prompt, 10, SamplingConfig(), 0, lambda: None).tokens
    assert torch.equal(got, ref)
    logits = incremental_logits(be.new_session(2, 32), ids, prefill=12)
    assert (logits - hf_logits(loaded, ids)).abs().max() <= TOL


@pytest.fixture(scope="module")
def smol():
    return load_model(ModelConfig(name="smollm2", path="prepared://smollm2-135m-instruct"), attention="sdpa")


@pytest.fixture(scope="module")
def smol_ids(smol):
    from engine.config import TextConfig
    from engine.prompts import static_batch_prompts

    return static_batch_prompts(smol.tokenizer, TextConfig(), 96, 2)


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smol, smol_ids):
    ref = hf_logits(smol, smol_ids)
    assert native(smol, attn="sdpa").model.args.num_kv_heads == 3
    for attn in ATTN:
        got = native(smol, attn=attn).score(smol_ids)
        assert (got - ref).abs().max().item() <= TOL, attn
        for kv in ("contiguous", "paged"):
            inc = incremental_logits(native(smol, attn=attn, kv=kv, block=16).new_session(2, 96), smol_ids, prefill=80)
            # one-token steps against a cache sum in another order than the full forward: on SmolLM2's logits
            # (|x| up to ~25) that reached 1.03e-4 once (2026-12-03), 5 fp32 ulps at that magnitude
            assert (inc - ref).abs().max().item() <= 2 * TOL, (attn, kv)


@pytest.mark.slow
def test_smollm2_greedy_tokens_identical_to_hf(smol, smol_ids):
    prompt = smol_ids[:, :64]
    hf = make_backend(smol, make_trial(smol.spec, backend="hf", kv_cache="contiguous"))
    ref = generate(hf.new_session(2, 88), prompt, 24, SamplingConfig(), 0, lambda: None).tokens
    for attn in ATTN:
        for kv in KV:
            be = native(smol, attn=attn, kv=kv, block=10)
            got = generate(be.new_session(2, 88), prompt, 24, SamplingConfig(), 0, lambda: None).tokens
            assert torch.equal(got, ref), (attn, kv)


@pytest.mark.parametrize("kv", ["off", "contiguous", "paged"])
def test_prefill_gives_the_last_positions_logits_without_the_others(variants, kv):
    """generate's prefill asks only for the next token's logits: the same values as forward's last row, the cache
    left as forward leaves it (the next step's logits agree too)."""
    ids = torch.randint(3, 320, (2, 12), generator=torch.Generator().manual_seed(7))
    be = native(variants["gemma3"], kv=kv)
    a, b = be.new_session(2, 16), be.new_session(2, 16)
    torch.testing.assert_close(a.prefill(ids), b.forward(ids)[:, -1], atol=1e-5, rtol=1e-5)
    assert a.length == b.length == 12
    nxt = torch.tensor([[5], [9]])
    torch.testing.assert_close(a.forward(nxt), b.forward(nxt), atol=1e-5, rtol=1e-5)


def test_a_long_prefill_runs_in_chunks_with_the_same_logits(variants, monkeypatch):
    """Chunks of 5 positions through the cache (PREFILL_CHUNK, 2048 shipped) give the whole prompt's last logits and
    the same cache: Gemma 3's window of 8 crossed inside and between chunks."""
    from engine.engines.native import backend as nb

    ids = torch.randint(3, 320, (2, 23), generator=torch.Generator().manual_seed(8))
    be = native(variants["gemma3"])
    whole = be.new_session(2, 30)
    ref = whole.prefill(ids)
    monkeypatch.setattr(nb, "PREFILL_CHUNK", 5)
    chunked = be.new_session(2, 30)
    torch.testing.assert_close(chunked.prefill(ids), ref, atol=1e-5, rtol=1e-5)
    nxt = torch.tensor([[5], [9]])
    torch.testing.assert_close(chunked.forward(nxt), whole.forward(nxt), atol=1e-5, rtol=1e-5)
