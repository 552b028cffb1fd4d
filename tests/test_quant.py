"""Quantization levels on the tiny model: real low-bit storage, generation, and fidelity vs the reference."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import TrialConfig, EvalConfig, ModelConfig, WorkloadConfig, load_model, run_engine_trial
from engine.config import EngineError, QuantConfig
from engine.measure.fidelity import ReferenceCache
from engine.models import cache_root, weights_bytes
from engine.quant import DynamicInt8Linear, WeightOnlyInt8Linear, quantize_per_channel

TINY = ModelConfig(name="tiny", path="tiny://llama")
LEVELS = ["none", "int8-weight", "int8-dynamic", "bnb-int8", "bnb-nf4", "bnb-fp4"]


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty fidelity-reference cache. This node's hardware probe is carried over: these tests are about
    references, and re-probing would only cost seconds."""
    import shutil

    if (cache_root() / "hardware").is_dir():
        shutil.copytree(cache_root() / "hardware", tmp_path / "hardware")
    monkeypatch.setenv("INFERSWEEP_CACHE", str(tmp_path))
    return tmp_path


def _trial(level, fid=True, **wl):
    w = dict(context_len=48, max_new_tokens=6, warmup=0, repeats=1)
    w.update(wl)
    return TrialConfig(model=TINY, quant=QuantConfig(level=level), workload=WorkloadConfig(**w),
                       eval=EvalConfig(fidelity=fid, num_windows=2))


@pytest.mark.parametrize("level", LEVELS)
def test_each_level_loads_and_generates(level):
    r = run_engine_trial(_trial(level, fid=False))
    assert len(r.token_ids[0]) == 6 and all(0 <= t < 384 for t in r.token_ids[0])
    assert r.metrics["ppl"] > 1


def _proj(lm):
    return lm.model.model.layers[0].mlp.gate_proj


def test_quantized_weights_really_are_low_bit():
    fp = load_model(TINY)
    full = weights_bytes(fp.model)
    n_lin = sum(m.weight.numel() for n, m in fp.model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head")
    emb = fp.model.model.embed_tokens.weight.numel()
    other = full - 4 * n_lin
    # ours: int8 weights + one fp32 scale per output channel
    w8 = load_model(TINY, quant=QuantConfig(level="int8-weight"))
    assert isinstance(_proj(w8), WeightOnlyInt8Linear) and _proj(w8).weight.dtype == torch.int8
    scales = sum(m.scales.numel() for m in w8.model.modules() if isinstance(m, WeightOnlyInt8Linear))
    assert weights_bytes(w8.model) == other + n_lin + 4 * scales
    dyn = load_model(TINY, quant=QuantConfig(level="int8-dynamic"))
    assert isinstance(_proj(dyn), DynamicInt8Linear) and _proj(dyn).weight.dtype == torch.int8
    # bitsandbytes: int8 (LLM.int8) and packed 4-bit (two weights per byte)
    b8 = load_model(TINY, quant=QuantConfig(level="bnb-int8"))
    assert _proj(b8).weight.dtype == torch.int8
    assert weights_bytes(b8.model) < other + 1.1 * n_lin
    for lvl in ("bnb-nf4", "bnb-fp4"):
        b4 = load_model(TINY, quant=QuantConfig(level=lvl))
        w = _proj(b4).weight
        assert w.dtype == torch.uint8 and w.numel() == _proj(fp).weight.numel() // 2
        assert weights_bytes(b4.model) < other + 0.6 * n_lin
    assert emb > 0  # tied embedding/lm_head stays full precision (skip_modules default)


@pytest.mark.parametrize("kernel", ["dequant", "int8pack"])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_weight_only_int8_kernel_matches_dequantized_matmul(kernel, rows):
    torch.manual_seed(0)
    lin = nn.Linear(64, 96, bias=True)
    q = WeightOnlyInt8Linear(lin, kernel=kernel)
    x = torch.randn(rows, 64)
    qw, s = quantize_per_channel(lin.weight)
    ref = x @ (qw.float() * s[:, None]).t() + lin.bias
    torch.testing.assert_close(q(x), ref, atol=1e-4, rtol=1e-4)
    # and the quantization error vs full precision is the expected per-channel rounding error
    err = (q(x) - lin(x)).abs().max()
    assert 0 < err < 0.05


def test_dynamic_int8_kernel_matches_simulated_w8a8():
    torch.manual_seed(0)
    lin = nn.Linear(64, 96, bias=False)
    q = DynamicInt8Linear(lin)
    for rows in (1, 3, 40):  # small batches go through the padded path
        x = torch.randn(rows, 64)
        xs = x.abs().amax(1, keepdim=True) / 127
        xq = torch.round(x / xs).clamp(-127, 127)
        qw, s = quantize_per_channel(lin.weight)
        ref = (xq @ qw.float().t()) * xs * s
        torch.testing.assert_close(q(x), ref, atol=1e-4, rtol=1e-4)


def test_mixed_precision_keeps_last_layers_and_skipped_modules():
    lm = load_model(TINY, quant=QuantConfig(level="int8-weight", keep_last_layers=1, skip_modules=("lm_head", "down_proj")))
    layers = lm.model.model.layers
    assert isinstance(layers[0].self_attn.q_proj, WeightOnlyInt8Linear)
    assert type(layers[0].mlp.down_proj) is nn.Linear
    assert all(type(m) is nn.Linear for m in layers[-1].modules() if isinstance(m, (nn.Linear, WeightOnlyInt8Linear)))
    b = load_model(TINY, quant=QuantConfig(level="bnb-int8", keep_last_layers=1))
    assert type(b.model.model.layers[-1].mlp.up_proj) is nn.Linear
    assert type(b.model.model.layers[0].mlp.up_proj) is not nn.Linear


def test_fidelity_is_exact_for_reference_and_worse_for_4bit(fresh_cache):
    none = run_engine_trial(_trial("none")).metrics
    assert none["kl_div_mean"] == 0.0 and none["kl_div_p99"] == 0.0
    assert none["kl_div_early"] == 0.0 and none["kl_div_late"] == 0.0
    assert none["top1_agreement"] == 1.0 and none["ppl_ratio"] == 1.0
    for k in ("kl_div_mean_stderr", "kl_div_p999", "kl_div_max", "top1_agreement_stderr", "ppl_ratio_stderr"):
        assert none[k] == 0.0, k
    for lvl in ("bnb-nf4", "bnb-fp4"):
        m = run_engine_trial(_trial(lvl)).metrics
        assert m["kl_div_mean"] > 0 and m["kl_div_p99"] >= m["kl_div_mean"]
        assert m["kl_div_p99"] <= m["kl_div_p999"] <= m["kl_div_max"] and m["kl_div_mean_stderr"] > 0
        assert m["ppl_ratio_stderr"] > 0 and m["top1_agreement_stderr"] > 0
        assert m["kl_div_early"] > 0 and m["kl_div_late"] > 0
        assert m["top1_agreement"] < 1.0
    w8 = run_engine_trial(_trial("int8-weight")).metrics
    nf4 = run_engine_trial(_trial("bnb-nf4")).metrics
    assert 0 < w8["kl_div_mean"] < nf4["kl_div_mean"]  # 8-bit is closer to the reference than 4-bit


def test_reference_is_computed_once_and_corruption_is_detected(fresh_cache):
    c0, h0 = ReferenceCache.computations, ReferenceCache.hits
    a = run_engine_trial(_trial("int8-weight")).metrics
    b = run_engine_trial(_trial("bnb-nf4")).metrics
    c = run_engine_trial(_trial("none")).metrics
    assert ReferenceCache.computations - c0 == 1 and ReferenceCache.hits - h0 == 2
    assert (a["fidelity_ref_cached"], b["fidelity_ref_cached"], c["fidelity_ref_cached"]) == (0.0, 1.0, 1.0)
    (entry,) = (cache_root() / "fidelity").glob("*.pt")
    entry.write_bytes(entry.read_bytes()[:-10] + b"corrupted!")
    d = run_engine_trial(_trial("int8-weight")).metrics
    assert d["fidelity_ref_cached"] == 0.0 and ReferenceCache.computations - c0 == 2
    assert d["kl_div_mean"] == a["kl_div_mean"]  # recomputed reference is identical
    e = run_engine_trial(_trial("int8-weight")).metrics
    assert e["fidelity_ref_cached"] == 1.0  # the rewritten entry is valid again
    # a different context length is a different reference
    run_engine_trial(_trial("none", context_len=32))
    assert ReferenceCache.computations - c0 == 3


def test_quant_levels_are_config_options():
    from experiments.config.compose import SweepError, expand

    specs = expand(["model=tiny-llama", "quant=none,int8-weight,int8-dynamic,bnb-int8,bnb-nf4,bnb-fp4", "eval=fidelity"])
    assert len(specs) == 6 and len({s.config_hash for s in specs}) == 6
    with pytest.raises(SweepError) as ei:
        expand(["model=tiny-llama", "quant=int3", "quant.keep_last_layers=-1"])
    text = "\n".join(ei.value.problems)
    assert "quant: unknown option" in text and "bnb-nf4" in text and "keep_last_layers" in text


@pytest.mark.parametrize("level", ["int8-weight", "int8-dynamic", "bnb-int8", "bnb-nf4"])
def test_native_backend_inherits_every_quantization_level(level):
    from support import make_trial

    def run(backend):
        return run_engine_trial(make_trial(TINY, backend=backend, quant=QuantConfig(level=level),
            workload=WorkloadConfig(context_len=32, max_new_tokens=8, warmup=0, repeats=1)))

    hf, native = run("hf"), run("native")
    assert native.token_ids == hf.token_ids
    assert native.metrics["weights_bytes"] == hf.metrics["weights_bytes"]
    assert native.metrics["ppl"] == pytest.approx(hf.metrics["ppl"], rel=1e-4)


def test_int8_kernel_is_a_validated_config_option():
    from experiments.config.compose import SweepError, expand

    trials = expand(["model=tiny-llama", "quant=int8-weight", "quant.kernel=dequant,int8pack"])
    assert [t.config["quant"]["kernel"] for t in trials] == ["dequant", "int8pack"]
    assert len({t.config_hash for t in trials}) == 2  # the kernel changes the numbers, so it is in the hash
    with pytest.raises(SweepError) as ei:
        expand(["model=tiny-llama", "quant=int8-weight", "quant.kernel=fast"])
    assert any("quant.kernel" in p and "dequant" in p for p in ei.value.problems), ei.value.problems
    with pytest.raises(EngineError, match="kernel"):
        WeightOnlyInt8Linear(nn.Linear(4, 4), kernel="fast")


def test_both_int8_kernels_generate_the_same_greedy_tokens():
    a = load_model(TINY, quant=QuantConfig(level="int8-weight", kernel="dequant"))
    b = load_model(TINY, quant=QuantConfig(level="int8-weight", kernel="int8pack"))
    ids = torch.arange(3, 19)[None]
    la, lb = a.model(ids).logits, b.model(ids).logits
    torch.testing.assert_close(la, lb, atol=1e-4, rtol=1e-4)
