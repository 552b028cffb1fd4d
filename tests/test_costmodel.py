"""Cost model numbers against hand-computed values for SmolLM2-135M's shape, hardware peaks, regimes."""
from __future__ import annotations

import json

import pytest
import torch

from engine.measure.costmodel import (
    COMPUTE,
    MEMORY,
    ModelShape,
    Precision,
    Workload,
    assess,
    forward_cost,
    predict,
    weight_bytes_per_param,
)
from engine.measure.hardware import PROBE_DTYPES, HardwarePeaks, cache_path, gpu_spec, node_peaks

# SmolLM2-135M (its config.json): 30 layers, hidden 576, MLP 1536, 9 heads / 3 KV heads of 64, vocab 49152, tied
SMOL = ModelShape(num_layers=30, hidden=576, intermediate=1536, num_heads=9, num_kv_heads=3, head_dim=64, vocab=49152)
# peaks measured on a 2-core development machine (2026-12): 18 GB/s read, 85 GFLOP/s fp32 matmul
CPU = HardwarePeaks("cpu", mem_bw=18e9, flops=85e9, dtype="float32", source="table")
FP32 = Precision.of("float32")


def test_shape_parameter_counts_by_hand():
    # q,o: 2*576*576 = 663552; k,v: 2*576*(3*64) = 221184; gated MLP: 3*576*1536 = 2654208
    assert SMOL.layer_params == 663552 + 221184 + 2654208 == 3538944
    assert SMOL.lm_head_params == 49152 * 576 == 28311552
    assert SMOL.matmul_params == 30 * 3538944 + 28311552 == 134479872
    assert SMOL.kv_bytes_per_token(4) == 2 * 30 * 3 * 64 * 4 == 46080


def test_from_hf_config_reads_llama_fields():
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    assert ModelShape.from_hf_config(cfg) == SMOL


# Gemma 3 270M (its prepared config.json): 18 layers (5 windowed of 512 : 1 global), hidden 640, MLP 2048,
# 4 heads / 1 KV head of 256, vocab 262144, tied: the LM head is most of what a decode step reads
GEMMA_WINDOWS = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))
GEMMA = ModelShape(num_layers=18, hidden=640, intermediate=2048, num_heads=4, num_kv_heads=1, head_dim=256,
                   vocab=262144, layer_windows=GEMMA_WINDOWS)


def test_gemma3_shape_lm_head_dominates_decode_bytes():
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512)
    assert ModelShape.from_hf_config(cfg) == GEMMA
    # q,o: 2*640*1024; k,v: 2*640*256; gated MLP: 3*640*2048
    assert GEMMA.layer_params == 1310720 + 327680 + 3932160 == 5570560
    assert GEMMA.lm_head_params == 262144 * 640 == 167772160
    assert GEMMA.matmul_params == 18 * 5570560 + 167772160 == 268042240  # the 268M of the model
    c = forward_cost(GEMMA, FP32, batch=1, new_tokens=1, past_tokens=100, cached=True, materialize_scores=False)
    assert c.weight_bytes == 268042240 * 4
    assert GEMMA.lm_head_params * 4 / c.weight_bytes > 0.62  # the head: 63% of the weight bytes per token
    # int8 layers with the head kept at fp32 save little on this model: the head stays 167.8M * 4 bytes
    q8 = Precision.of("float32", "int8-weight")
    assert q8.weight_bytes(GEMMA) == pytest.approx(18 * 5570560 * q8.quant_bytes + 167772160 * 4)


def test_sliding_window_caps_kv_reads_and_attention_flops():
    kv_token = GEMMA.kv_bytes_per_token(4)
    assert kv_token == 2 * 18 * 256 * 4
    short = forward_cost(GEMMA, FP32, batch=1, new_tokens=1, past_tokens=299, cached=True, materialize_scores=False)
    assert short.kv_bytes == 300 * kv_token  # within the window every layer reads its whole past
    long = forward_cost(GEMMA, FP32, batch=1, new_tokens=1, past_tokens=1999, cached=True, materialize_scores=False)
    # 15 windowed layers read 512 tokens, 3 global ones all 2000
    assert long.kv_bytes == pytest.approx((15 * 512 + 3 * 2000) / 18 * kv_token)
    attn = long.flops - 2 * GEMMA.matmul_params
    assert attn == 4 * 4 * 256 * (15 * 512 + 3 * 2000)
    # a 1000-token prefill: query i of a windowed layer sees min(i + 1, 512) keys
    pre = forward_cost(GEMMA, FP32, batch=1, new_tokens=1000, past_tokens=0, cached=True, materialize_scores=False)
    windowed = 512 * 513 / 2 + (1000 - 512) * 512
    assert pre.flops - 2 * 1000 * 18 * 5570560 - 2 * GEMMA.lm_head_params == 4 * 4 * 256 * (
        15 * windowed + 3 * 1000 * 1001 / 2)


def test_decode_step_bytes_flops_and_intensity_by_hand():
    # one new token against 2048 cached ones, batch 1, fp32
    c = forward_cost(SMOL, FP32, batch=1, new_tokens=1, past_tokens=2048, cached=True, materialize_scores=False)
    assert c.weight_bytes == 134479872 * 4 == 537919488
    assert c.kv_bytes == 2049 * 46080 == 94417920  # read 2048 cached K/V, write the new one
    # matmuls 2*134479872 + attention 4 * layers * heads * head_dim * keys = 4*30*9*64*2049
    assert c.flops == 2 * 134479872 + 4 * 30 * 9 * 64 * 2049 == 410586624
    assert c.intensity == pytest.approx(410586624 / (537919488 + 94417920))
    assert c.regime(CPU) == MEMORY
    assert c.bound_s(CPU) == pytest.approx((537919488 + 94417920) / 18e9)


def test_batch1_decode_roofline_matches_the_design_estimate():
    # 18 GB/s -> fp32 decode roofline for the 135M model ~ 34 tok/s at batch 1
    p = predict(SMOL, FP32, Workload(batch=1, context=1, new_tokens=2), CPU)
    assert p.decode_tok_s == pytest.approx(18e9 / (537919488 + 2 * 46080), rel=1e-9)
    assert 33 < p.decode_tok_s < 34


def test_prefill_is_compute_bound_and_eager_adds_score_traffic():
    fused = forward_cost(SMOL, FP32, 1, 2048, 0, cached=True, materialize_scores=False)
    # matmuls over 2048 tokens + lm_head of the last position + causal attention over 2048*2049/2 pairs
    assert fused.flops == 2 * 2048 * 30 * 3538944 + 2 * 28311552 + 4 * 30 * 9 * 64 * (2048 * 2049 // 2)
    assert fused.flops == 579947986944
    assert fused.bytes == 537919488 + 2048 * 46080
    assert fused.regime(CPU) == COMPUTE
    eager = forward_cost(SMOL, FP32, 1, 2048, 0, cached=True, materialize_scores=True)
    assert eager.attn_score_bytes == 4 * 30 * 9 * 2048 * 2048 * 4  # scores+probs written and read, fp32
    assert eager.flops == fused.flops


def test_regime_flips_from_memory_to_compute_as_batch_grows():
    # decode at context 128: intensity ~ 277.9M*B / (537.9M + 5.9M*B) crosses the balance 85/18 = 4.7 at B ~ 10
    intensities, regimes = [], []
    for b in (1, 4, 8, 16, 64):
        p = predict(SMOL, FP32, Workload(batch=b, context=128, new_tokens=4), CPU)
        intensities.append(p.decode.intensity)
        regimes.append(p.decode_regime)
    assert intensities == sorted(intensities)
    assert regimes == [MEMORY, MEMORY, MEMORY, COMPUTE, COMPUTE]


def test_kv_cache_moves_decode_from_compute_to_memory_bound():
    # the seed: without KV cache compute-bound, with it memory-bandwidth-bound
    off = predict(SMOL, FP32, Workload(batch=1, context=2048, new_tokens=4, kv_cache=False), CPU)
    on = predict(SMOL, FP32, Workload(batch=1, context=2048, new_tokens=4, kv_cache=True), CPU)
    assert off.decode_regime == COMPUTE and on.decode_regime == MEMORY
    assert on.decode_tok_s / off.decode_tok_s > 50  # O(n^2) recompute vs one token per step


def test_quantized_weights_shrink_the_bytes_read():
    assert weight_bytes_per_param("float32") == 4 and weight_bytes_per_param("bfloat16") == 2
    assert weight_bytes_per_param("float32", "bnb-int8") == 1
    assert weight_bytes_per_param("float32", "bnb-nf4") == 0.5 + 4 / 64
    q = Precision.of("float32", "int8-weight", skip_lm_head=True)
    assert q.weight_bytes(SMOL) == 30 * 3538944 * 1 + 28311552 * 4
    mixed = Precision.of("float32", "int8-weight", skip_lm_head=False, full_last_layers=2)
    assert mixed.weight_bytes(SMOL) == 28 * 3538944 + 2 * 3538944 * 4 + 28311552
    with pytest.raises(Exception, match="unknown quantization"):
        weight_bytes_per_param("float32", "int3-magic")


def test_assess_measured_regime_and_efficiency():
    wl = Workload(batch=1, context=128, new_tokens=9)
    p = predict(SMOL, FP32, wl, CPU)
    measured = {"output_tok_s": p.output_tok_s / 4, "prefill_tok_s": p.prefill_tok_s / 2, "decode_tok_s": p.decode_tok_s / 4}
    a = assess(p, measured)
    assert a.metrics["roofline_tok_s"] == pytest.approx(p.output_tok_s)
    assert a.metrics["roofline_efficiency"] == pytest.approx(0.25)
    assert a.metrics["roofline_decode_efficiency"] == pytest.approx(0.25)
    assert a.metrics["roofline_prefill_efficiency"] == pytest.approx(0.5)
    assert a.metrics["decode_bw_util"] == pytest.approx(0.25)  # memory-bound: the bound is the bandwidth roof
    assert a.metrics["cost_weight_bytes_per_step"] == 537919488
    assert a.labels["regime.decode"] == a.labels["regime.decode.measured"] == MEMORY
    assert a.labels["regime.prefill"] == COMPUTE
    assert a.labels["regime.phase"] == "decode" and a.labels["regime"] == MEMORY


def test_speculative_decode_streams_the_weights_once_per_target_pass():
    wl = Workload(batch=1, context=128, new_tokens=9)
    p = predict(SMOL, FP32, wl, CPU)
    plain = assess(p, {"decode_tok_s": p.decode_tok_s})
    spec = assess(p, {"decode_tok_s": p.decode_tok_s, "tokens_per_step": 2.5})
    # same tokens per second, but each weight pass emitted 2.5 tokens: 1/2.5 of the bytes moved
    assert spec.metrics["decode_bw_util"] == pytest.approx(plain.metrics["decode_bw_util"] / 2.5)
    assert spec.metrics["decode_compute_util"] == pytest.approx(plain.metrics["decode_compute_util"])


def test_gpu_table_matches_specific_names_first():
    assert gpu_spec("NVIDIA H200").mem_bw == 4.8e12
    assert gpu_spec("NVIDIA H100 80GB HBM3").mem_bw == 3.35e12
    assert gpu_spec("NVIDIA H100 PCIe").mem_bw == 2.0e12
    assert gpu_spec("NVIDIA A100-SXM4-80GB").mem_bw == 2.039e12
    assert gpu_spec("NVIDIA L4").flops["bfloat16"] == 121e12
    assert gpu_spec("Some Future Accelerator") is None


def test_cpu_peaks_are_probed_once_then_cached(tmp_path, monkeypatch):
    from engine.measure.hardware import PROBE_LOADED

    monkeypatch.setenv("INFERSWEEP_CACHE", str(tmp_path))
    first = node_peaks(torch.device("cpu"), "float32", threads=1)
    if first.source == PROBE_LOADED:  # other work kept the CPUs busy: such a probe is never cached (test_hardware)
        assert not cache_path().exists()
        pytest.skip("the machine was loaded during the probe: nothing to read back from the cache")
    assert first.source == "probe" and first.mem_bw > 1e8 and first.flops > 1e8 and first.gemv_bw > 1e8
    again = node_peaks(torch.device("cpu"), "float32", threads=1)
    assert again.source == "cache" and (again.mem_bw, again.flops) == (first.mem_bw, first.flops)
    # one probe measured every format: asking for bf16 reads the same entry, not a new probe
    assert node_peaks(torch.device("cpu"), "bfloat16", threads=1).source == "cache"
    entries = json.loads(cache_path().read_text())
    assert len(entries) == 1
    (entry,) = entries.values()
    assert entry["threads"] == 1 and set(entry["rates"]) == set(PROBE_DTYPES)
    assert all(r["gemm_flops"] > 0 and r["gemv_bw"] > 0 for r in entry["rates"].values())
    assert "float32" in entry["fast_dtypes"]


@pytest.mark.slow  # a real multi-process cluster/server or a full re-probe: the slow tier (CI runs it)
def test_refresh_reprobes_and_keeps_the_higher_peaks(tmp_path, monkeypatch):
    from engine.measure.hardware import PROBE_LOADED

    monkeypatch.setenv("INFERSWEEP_CACHE", str(tmp_path))
    first = node_peaks(torch.device("cpu"), "float32", threads=1)
    if first.source == PROBE_LOADED:
        pytest.skip("the machine was loaded during the probe: it was not cached, so there is nothing to refresh")
    path = cache_path()
    entries = json.loads(path.read_text())
    (key,) = entries
    entries[key]["stream_bw"] = 1e15  # as if an earlier, quieter probe had read more
    path.write_text(json.dumps(entries))
    again = node_peaks(torch.device("cpu"), "float32", threads=1, refresh=True)
    assert again.source == "probe" and again.mem_bw == 1e15 and again.flops >= first.flops
    assert node_peaks(torch.device("cpu"), "float32", threads=1).mem_bw == 1e15
