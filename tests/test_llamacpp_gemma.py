"""engine=llamacpp on Gemma 3: the `gemma3` architecture of the GGUF exporter, the shipped GGUF run as is
(quant.level=gguf-shipped), and what stays refused before launch.

Fast tier: validation only (tiny random checkpoints written with transformers; no llama.cpp needed), and,
with the `llamacpp` marker, tiny random Gemma 3 checkpoints exported to F32 and run by llama.cpp against
transformers at fp32. Slow tier: the real Gemma 3 270M, its shipped Q4_K_M and a re-exported Q8_0.

Tolerance of the tiny parity (flash off, f32 K/V): 1e-3 max abs on logits of spread ~0.17 (measured
2.2e-4 to 3.7e-4; ggml's GELU is not torch's to the last bit). What it tells apart, measured on the same
weights in transformers: the sliding layers' RoPE base 10000 vs 500 moves the logits by 0.26, the window 8
vs 16 by 0.65, the score scale (query_pre_attn_scalar 32 vs 24) by 0.09, the final soft-cap by 0.01.
"""
from __future__ import annotations

import pytest
import torch

from conftest import require_installed
from engine.config import ModelConfig, QuantConfig, SamplingConfig, replace
from experiments.config.compose import SweepError, expand
from support import make_trial

needs_llamacpp = require_installed("llamacpp")
ATOL = 1e-3
SMALL = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_attention_heads=4, max_position_embeddings=256,
             num_key_value_heads=1, head_dim=32, sliding_window=8)
ROPE = dict(sliding_attention=dict(rope_type="default", rope_theta=10000.0),
            full_attention=dict(rope_type="default", rope_theta=1e6))
# window 8 < the 40 tokens scored; the global layer every third (llama.cpp's pattern 3, the real model's 6)
GEMMA3 = {
    "gemma3-p3": dict(num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                      query_pre_attn_scalar=32, rope_parameters=ROPE),
    # another local RoPE base, linear scaling on the global layers, a final logit soft-cap, pattern 2
    "gemma3-variant": dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                           query_pre_attn_scalar=32, final_logit_softcapping=3.0, rope_parameters=dict(
                               sliding_attention=dict(rope_type="default", rope_theta=500.0),
                               full_attention=dict(rope_type="linear", rope_theta=1e6, factor=2.0))),
    # what llama.cpp's gemma3 graph cannot run: scores scaled by 24**-0.5 where it fixes head_dim**-0.5
    "gemma3-scalar": dict(num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                          query_pre_attn_scalar=24, rope_parameters=ROPE),
}


def _write(root, kind: str):
    """A seeded random checkpoint directory (safetensors + config.json) and its transformers model."""
    import transformers as tf

    if kind == "qwen2":
        cfg, cls = tf.Qwen2Config(**{k: v for k, v in SMALL.items() if k != "sliding_window"}), tf.Qwen2ForCausalLM
    else:
        cfg, cls = tf.Gemma3TextConfig(**SMALL, **GEMMA3[kind]), tf.Gemma3ForCausalLM
    cfg._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = cls(cfg)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma's (1 + w) norms start at w = 0; make them matter
                torch.nn.init.normal_(p, std=0.3)
    path = root / kind
    model.save_pretrained(path)
    return path, model.eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {kind: _write(root, kind) for kind in (*GEMMA3, "qwen2")}


def _problems(overrides: list[str]) -> str:
    with pytest.raises(SweepError) as ei:
        expand(["model=tiny-llama", "engine=llamacpp"] + overrides, gpu_available=False)
    return str(ei.value)


# --- validation (fast tier, no llama.cpp needed) ---------------------------------------------------------

@needs_llamacpp  # a valid llama.cpp sweep expands only where llama.cpp is installed
def test_gemma3_checkpoints_pass_validation_and_the_shipped_level_needs_a_prepared_model(checkpoints):
    path, _ = checkpoints["gemma3-p3"]
    specs = expand(["model=tiny-llama", "engine=llamacpp", f"model.path={path}", "model.name=g",
                    "quant=none,gguf-q8_0,gguf-q4_k_m"], gpu_available=False)
    assert [s.trial.quant.level for s in specs] == ["none", "gguf-q8_0", "gguf-q4_k_m"]
    specs = expand(["model=gemma-3-270m", "engine_variant=llamacpp-shipped,llamacpp-q8_0"], gpu_available=False)
    assert [s.trial.quant.level for s in specs] == ["gguf-shipped", "gguf-q8_0"]
    msg = _problems(["quant=gguf-shipped"])
    assert "quant.level: engine=llamacpp: quant.level=gguf-shipped runs the GGUF a prepared model shipped as; " \
           "tiny://llama is not one" in msg and "use a re-exported level (gguf-q8_0, gguf-q4_0, gguf-q4_k_m) or none" in msg
    msg = _problems(["model=gemma-3-270m", "engine=native", "quant=gguf-shipped"])
    assert "engine=native cannot honour quant.level=gguf-shipped" in msg


def test_the_cost_model_prices_a_shipped_gguf_at_its_own_type():
    from engine import engines
    from engine.measure.costmodel import GGUF_BYTES, Precision

    eng = engines.get("llamacpp")
    for name, level in (("gemma-3-270m", "gguf-q4_k_m"), ("smollm2-135m-instruct", "gguf-q4_1")):
        trial = replace(make_trial(ModelConfig(name=name, path=f"prepared://{name}"), backend="llamacpp"),
                        "quant.level", "gguf-shipped")
        assert eng.weight_level(trial) == level
        assert Precision.of("float32", eng.weight_level(trial)).quant_bytes == GGUF_BYTES[level]
    tiny = make_trial(ModelConfig(name="t", path="tiny://llama"), backend="llamacpp")
    assert eng.weight_level(replace(tiny, "quant.level", "gguf-q8_0")) == "gguf-q8_0"
    # the LM head (Gemma's 168M-parameter tied embedding) is in the GGUF's type, not kept at fp32 as our levels'
    # default quant.skip_modules=[lm_head] keeps it: llama.cpp's decode reads it quantized (priced at fp32, the
    # shipped Gemma decoded at 142% of the roofline's bandwidth)
    assert eng.skip_modules(replace(tiny, "quant.level", "gguf-q8_0")) == [] and tiny.quant.skip_modules == ["lm_head"]
    assert eng.skip_modules(tiny) == ["lm_head"]  # level none: nothing quantized either way
    assert engines.get("native").skip_modules(replace(tiny, "quant.level", "int8-weight")) == ["lm_head"]


def test_unsupported_architectures_and_gemma3_variants_are_refused_before_launch(checkpoints):
    msg = _problems([f"model.path={checkpoints['qwen2'][0]}", "model.name=q"])
    assert "model.path: engine=llamacpp converts the Llama and Gemma 3 architectures only (model_type 'llama' or " \
           "'gemma3_text'); " in msg and "is 'qwen2': use engine=hf or engine=native for it" in msg
    msg = _problems([f"model.path={checkpoints['gemma3-scalar'][0]}", "model.name=g"])
    assert "model.path: engine=llamacpp: Gemma 3 with query_pre_attn_scalar=24" in msg
    assert "llama.cpp's gemma3 graph fixes the scale at head_dim**-0.5 (32)" in msg


def test_gemma3_layer_layouts_llama_cpp_cannot_run_are_named():
    from engine.engines.llamacpp.gguf_export import _swa_pattern, conversion_problem

    s, f = "sliding_attention", "full_attention"
    assert _swa_pattern([s] * 5 + [f] + [s] * 5 + [f]) == 6 and _swa_pattern([s, f, s, f]) == 2
    assert _swa_pattern([s, s, s]) == 4  # never global: a period past the last layer
    base = dict(model_type="gemma3_text", num_hidden_layers=3, num_attention_heads=4, hidden_size=64,
                intermediate_size=128, vocab_size=384, head_dim=32, sliding_window=8)
    assert conversion_problem(dict(base, layer_types=[s, s, f])) is None
    assert "not a repeating pattern" in conversion_problem(dict(base, layer_types=[f, s, s]))
    assert "attn_logit_softcapping" in conversion_problem(dict(base, layer_types=[s, s, f], attn_logit_softcapping=50.0))


# --- tiny random Gemma 3 through llama.cpp ---------------------------------------------------------------

def _load(path, level="none"):
    from engine.engines.llamacpp.backend import load_gguf_model
    from engine.tokenizer import ByteTokenizer

    return load_gguf_model(ModelConfig(name=path.name, path=str(path)), QuantConfig(level=level), threads=2,
                           tokenizer=ByteTokenizer())


def _backend(loaded, attention="sdpa", kv="f32"):
    from engine.engines import make_backend

    return make_backend(loaded, replace(make_trial(loaded.spec, backend="llamacpp", attention=attention, threads=2),
                                        "kv_cache.dtype", kv))


def _greedy(backend, prompt, n):
    from engine.generate import generate

    return generate(backend.new_session(prompt.shape[0], prompt.shape[1] + n), prompt, n, SamplingConfig(), 0,
                    lambda: None).tokens


@pytest.mark.llamacpp
@needs_llamacpp
@pytest.mark.parametrize("kind", ["gemma3-p3", "gemma3-variant"])
def test_tiny_gemma3_f32_gguf_logits_and_greedy_tokens_equal_transformers(checkpoints, kind):
    import gguf

    path, model = checkpoints[kind]
    gg = _load(path)
    reader = gguf.GGUFReader(str(gg.path))
    assert reader.fields["general.architecture"].contents() == "gemma3"
    names = {t.name for t in reader.tensors}
    assert {"blk.0.attn_q_norm.weight", "blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight"} <= names
    assert "output.weight" not in names  # tied to token_embd
    ids = torch.randint(3, 259, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = model(input_ids=ids).logits.float()
    got = _backend(gg).score(ids)
    assert got.shape == ref.shape
    assert torch.allclose(got, ref, atol=ATOL, rtol=0), float((got - ref).abs().max())
    prompt = ids[:, :12]
    with torch.inference_mode():
        want = model.generate(prompt, max_new_tokens=20, do_sample=False, min_new_tokens=20)[:, 12:]
    assert _greedy(_backend(gg, attention="flash", kv="auto"), prompt, 20).tolist() == want.tolist()


# --- the real Gemma 3 270M (slow tier) -------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.llamacpp
@needs_llamacpp
def test_gemma3_270m_shipped_and_reexported_ggufs_greedy_and_fidelity():
    """The F32, BF16 and F16 re-exports of the reference, the shipped Q4_K_M (the very weights the fp32 reference was
    dequantized from, run by llama.cpp's quantized kernels) and a Q8_0 re-exported from that reference: 16 greedy tokens equal transformers' at
    fp32, and over a 128-token window the logits stay close (measured here: shipped top-1 0.90, KL 0.052;
    Q8_0 top-1 0.96, KL 0.011; a wrong norm, window or RoPE layout gives nonsense text and KL >> 1)."""
    from engine.config import TextConfig
    from engine.engines.hf.backend import HFBackend
    from engine.engines.llamacpp.backend import load_gguf_model
    from engine.models import load_model, source_gguf
    from engine.prompts import static_batch_prompts
    from engine.config import TrialConfig

    spec = ModelConfig(name="gemma-3-270m", path="prepared://gemma-3-270m", dtype="float32")
    try:
        hf = load_model(spec, attention="sdpa", device="cpu")
    except Exception as e:  # noqa: BLE001 - not prepared here
        pytest.skip(f"run `infersweep prepare gemma-3-270m` ({e})")
    prompt = torch.tensor([[hf.config.bos_token_id] + hf.tokenizer.encode(
        "The capital of France is Paris. The capital of Germany is")])
    ref = _greedy(HFBackend(hf, TrialConfig(model=spec)), prompt, 16)
    ids = static_batch_prompts(hf.tokenizer, TextConfig(), 128, 1)
    with torch.inference_mode():
        ref_logp = hf.model(input_ids=ids, use_cache=False).logits.float().log_softmax(-1)
    del hf
    # (level, the re-export's float type, K/V type, KL bound, top-1 bound): F32 re-exports the reference itself
    # (f32 K/V: only float order differs); BF16 / F16 round the weights once more (measured here: F32 KL 1e-5,
    # top-1 1.0; BF16 5e-4, 0.96; F16 3e-5, 1.0)
    cases = (("none", "float32", "f32", 1e-3, 0.99), ("none", "bfloat16", "auto", 0.02, 0.9), ("none", "float16", "auto", 0.02, 0.9),
             ("gguf-shipped", "float32", "auto", 0.1, 0.85), ("gguf-q8_0", "float32", "auto", 0.1, 0.85))
    for level, dtype, kv, max_kl, min_top1 in cases:
        gg = load_gguf_model(replace(spec, "dtype", dtype), QuantConfig(level=level), threads=2)
        if level == "gguf-shipped":
            assert gg.path == source_gguf("gemma-3-270m")
        be = _backend(gg, attention="flash", kv=kv)
        assert _greedy(be, prompt, 16).tolist() == ref.tolist(), (level, dtype)
        logp = be.score(ids).log_softmax(-1)
        kl = float((ref_logp.exp() * (ref_logp - logp)).sum(-1).mean())
        top1 = float((logp.argmax(-1) == ref_logp.argmax(-1)).float().mean())
        print(f"{level} {dtype}: KL {kl:.5f} top-1 {top1:.3f}")
        assert kl < max_kl and top1 >= min_top1, (level, dtype, kl, top1)
        del be, gg
