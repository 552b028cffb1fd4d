"""Number formats: bf16 detection from /proc/cpuinfo flags, its environment override, the preferred dtype,
and the cost model reading the probed numbers of the trial's own dtype."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from engine.config import EngineError, TrialConfig, ModelConfig
from engine.measure.costmodel import assess_trial
from engine.model_facts import ModelShape
from engine.measure.hardware import (
    CPU_BF16_ENV,
    DtypeRates,
    NodeProbe,
    cache_path,
    cpu_bf16_support,
    cpu_flags,
    device_name,
    node_peaks,
    preferred_cpu_dtype,
    preferred_dtype,
    probe_key,
    slow_dtype_note,
)

# Abbreviated /proc/cpuinfo of the machines the design notes describe (two processors each: the flags repeat).
EPYC_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu vme de pse tsc msr sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2 sha_ni
bugs\t\t: sysret_ss_attrs

processor\t: 1
model name\t: AMD EPYC
flags\t\t: fpu vme de pse tsc msr sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2 sha_ni
"""
EPYC_BF16 = EPYC_AVX2.replace("avx2 bmi2", "avx2 bmi2 avx512f avx512bw avx512_vnni avx512_bf16")
SAPPHIRE_RAPIDS = EPYC_AVX2.replace("avx2 bmi2", "avx2 bmi2 avx512f amx_tile amx_int8 amx_bf16 avx512_fp16")
# avx_ne_convert only converts between bf16 and fp32: no bf16 arithmetic
CONVERT_ONLY = EPYC_AVX2.replace("avx2 bmi2", "avx2 bmi2 avx_ne_convert")
GRAVITON3 = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng
CPU implementer\t: 0x41
"""
GRAVITON2 = GRAVITON3.replace(" svei8mm svebf16 i8mm bf16 dgh rng", "")


@pytest.fixture
def no_override(monkeypatch):
    monkeypatch.delenv(CPU_BF16_ENV, raising=False)


def test_cpu_flags_parse_x86_and_arm_lines():
    assert {"avx2", "sha_ni"} <= cpu_flags(EPYC_AVX2) and "avx512_bf16" not in cpu_flags(EPYC_AVX2)
    assert {"sve", "bf16", "svebf16"} <= cpu_flags(GRAVITON3)
    assert cpu_flags("") == frozenset()


@pytest.mark.parametrize("text,has_bf16", [(EPYC_AVX2, False), (EPYC_BF16, True), (SAPPHIRE_RAPIDS, True),
                                          (CONVERT_ONLY, False), (GRAVITON3, True), (GRAVITON2, False), ("", False)])
def test_bf16_detection_from_cpuinfo(no_override, text, has_bf16):
    assert cpu_bf16_support(text) is has_bf16
    assert preferred_cpu_dtype(text) == ("bfloat16" if has_bf16 else "float32")


def test_environment_overrides_the_detection_both_ways(monkeypatch):
    monkeypatch.setenv(CPU_BF16_ENV, "1")
    assert cpu_bf16_support(EPYC_AVX2) is True and preferred_cpu_dtype(EPYC_AVX2) == "bfloat16"
    assert preferred_dtype("cpu") == "bfloat16"
    monkeypatch.setenv(CPU_BF16_ENV, "0")
    assert cpu_bf16_support(EPYC_BF16) is False and preferred_cpu_dtype(GRAVITON3) == "float32"
    assert preferred_dtype(torch.device("cpu")) == "float32"
    monkeypatch.setenv(CPU_BF16_ENV, "maybe")
    with pytest.raises(EngineError, match=CPU_BF16_ENV):
        cpu_bf16_support(EPYC_AVX2)


def test_this_machine_is_detected_from_its_own_flags(no_override):
    with open("/proc/cpuinfo") as f:
        text = f.read()
    assert cpu_bf16_support() is bool(cpu_flags(text) & {"avx512_bf16", "amx_bf16", "bf16", "svebf16"})


# A node where bf16 is native and fast, fp16 emulated (the AMD EPYC of the design notes, rounded).
PROBE = NodeProbe("test-cpu", stream_bw=20e9, rates={
    "float32": DtypeRates(gemm_flops=158e9, gemv_bw=11e9),
    "bfloat16": DtypeRates(gemm_flops=249e9, gemv_bw=17e9),
    "float16": DtypeRates(gemm_flops=0.2e9, gemv_bw=0.15e9),
})


def test_probe_peaks_per_dtype_and_fast_formats():
    assert PROBE.fast_dtypes() == ("float32", "bfloat16")
    bf16 = PROBE.peaks("bfloat16", "cache")
    assert (bf16.flops, bf16.mem_bw, bf16.gemv_bw) == (249e9, 20e9, 17e9)
    # fp16's GEMV does 2 FLOP per 2-byte weight: 0.15 GFLOP/s < its GEMM rate, which stays the compute roof
    assert PROBE.peaks("float16", "cache").flops == 0.2e9
    slow_gemm = NodeProbe("x", 20e9, {"bfloat16": DtypeRates(gemm_flops=0.3e9, gemv_bw=4e9)})
    # a GEMV that outruns the GEMM raises the compute roof: the roofline must bound every kernel
    assert slow_gemm.peaks("bfloat16", "cache").flops == 4e9
    with pytest.raises(EngineError, match="no numbers for dtype"):
        slow_gemm.peaks("float32", "cache")
    assert PROBE.merged(NodeProbe("test-cpu", 30e9, {"float32": DtypeRates(100e9, 12e9)})).rates["float32"] == \
        DtypeRates(158e9, 12e9)


def test_cost_model_uses_the_trial_dtype_numbers(tmp_path, monkeypatch):
    """A cached probe with different numbers per dtype: each trial's roofline reads its own dtype's row."""
    from transformers import LlamaConfig

    monkeypatch.setenv("INFERSWEEP_CACHE", str(tmp_path))
    device, threads = torch.device("cpu"), torch.get_num_threads()
    path = cache_path()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({probe_key(device_name(device), device, threads): PROBE.to_json()}))
    cfg = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    measured = {"output_tok_s": 10.0, "prefill_tok_s": 100.0, "decode_tok_s": 10.0}
    seen = {}
    for dtype in ("float32", "bfloat16", "float16"):
        trial = TrialConfig(model=ModelConfig(name="tiny", path="tiny://llama", dtype=dtype))
        m = assess_trial(trial, ModelShape.from_hf_config(cfg), device, measured, materialize_scores=False).metrics
        seen[dtype] = (m["hw_flops"], m["hw_gemv_bw"])
        assert m["decode_gemv_util"] > 0
    assert seen == {"float32": (158e9, 11e9), "bfloat16": (249e9, 17e9), "float16": (0.2e9, 0.15e9)}
    assert node_peaks(device, "bfloat16", threads).source == "cache"  # read, never re-probed


# --- the engine's own fast paths: each engine says which dtype its matmuls run in --------------------------
def _tiny(backend: str, dtype: str, quant: str = "none") -> TrialConfig:
    from engine.config import EngineConfig, QuantConfig

    return TrialConfig(model=ModelConfig(name="tiny", path="tiny://llama", dtype=dtype),
                       engine=EngineConfig(backend=backend), quant=QuantConfig(level=quant))


@pytest.mark.parametrize("bf16", ["0", "1"])
def test_engines_declare_the_dtype_their_matmuls_run_in(monkeypatch, bf16):
    """torch (hf, native) computes in the model's dtype; llama.cpp widens f16 weights to f32 (F16C), runs
    quantized blocks as integer dot products and bf16 with bf16 dot products only where the CPU has them."""
    from engine import engines

    monkeypatch.setenv(CPU_BF16_ENV, bf16)
    cpu = torch.device("cpu")
    for name in ("hf", "native"):
        for dtype in ("float32", "bfloat16", "float16"):
            assert engines.get(name).compute_dtype(_tiny(name, dtype), cpu) == dtype
    cpp = engines.get("llamacpp")
    assert cpp.compute_dtype(_tiny("llamacpp", "float16"), cpu) == "float32"
    assert cpp.compute_dtype(_tiny("llamacpp", "float32"), cpu) == "float32"
    assert cpp.compute_dtype(_tiny("llamacpp", "bfloat16"), cpu) == ("bfloat16" if bf16 == "1" else "float32")
    for level in ("gguf-q8_0", "gguf-q4_0", "gguf-q4_k_m"):  # quantized from the F32 file, whatever model.dtype
        assert cpp.compute_dtype(_tiny("llamacpp", "bfloat16", level), cpu) == "float32"


@pytest.mark.parametrize("bf16", ["0", "1"])
def test_dtype_note_is_the_engines(monkeypatch, bf16):
    """llama.cpp f16 (and bf16 without bf16 units) runs at f32 speed: no "expect ~8-10x slower" note, which a
    torch trial at the same dtype still gets where this CPU lacks the units."""
    from engine import engines
    from engine.measure.hardware import cpu_fp16_support
    from engine.pipeline import dtype_note

    monkeypatch.setenv(CPU_BF16_ENV, bf16)
    cpu = torch.device("cpu")
    for dtype in ("float32", "float16", "bfloat16"):
        assert dtype_note(_tiny("llamacpp", dtype), engines.get("llamacpp"), cpu) is None
    hf16 = dtype_note(_tiny("hf", "float16"), engines.get("hf"), cpu)
    assert (hf16 is None) is cpu_fp16_support()
    hf_bf16 = dtype_note(_tiny("hf", "bfloat16"), engines.get("hf"), cpu)
    assert (hf_bf16 is None) is (bf16 == "1")


def test_roofline_uses_the_peaks_of_the_dtype_the_engine_computes_in(tmp_path, monkeypatch):
    """A cached probe where fp16 matmuls crawl (0.2 GFLOP/s, torch on a CPU without fp16 units): hf's fp16
    trial is judged with those roofs, llama.cpp's with f32's (its f16 trial decoded x1.77 faster than its f32
    one on such a CPU, and read `>100 (!279)` of an fp16 roofline)."""
    from engine import engines
    from engine.pipeline import roofline

    monkeypatch.setenv("INFERSWEEP_CACHE", str(tmp_path))
    device, threads = torch.device("cpu"), torch.get_num_threads()
    path = cache_path()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({probe_key(device_name(device), device, threads): PROBE.to_json()}))
    measured = {"output_tok_s": 10.0, "prefill_tok_s": 100.0, "decode_tok_s": 10.0}
    seen = {}
    for name in ("hf", "llamacpp"):
        m = dict(measured)
        labels = roofline(_tiny(name, "float16"), engines.get(name), device, m)
        assert labels["hw.source"] == "cache"
        seen[name] = (m["hw_flops"], m["hw_gemv_bw"])
    assert seen == {"hf": (0.2e9, 0.15e9), "llamacpp": (158e9, 11e9)}


def test_matmul_probe_skips_a_size_its_budget_cannot_pay_for():
    """An emulated dtype (100x slower) must not run a size whose predicted cost (n^3 scaling of the last
    one, warm-up included) overruns the budget. Timings are injected through the probe's clock and timer
    parameters (nothing global is patched): this checks the rule, not the clock."""
    from engine.measure import hardware

    tried, now = [], [0.0]

    def timer(n):  # a timed matmul of size n: advance the clock as it would (warm-up + repeats calls)
        tried.append(n)
        now[0] += per_call[n] * (3 + 1)
        return per_call[n]

    clock = lambda: now[0]  # noqa: E731
    per_call = {256: 0.024, 512: 0.19, 1024: 1.5, 2048: 12.0}  # ~1.4 GFLOP/s: bf16/fp16 emulated on a CPU
    flops = hardware.probe_matmul(torch.device("cpu"), torch.float32, budget_s=1.0, clock=clock, timer=timer)
    assert tried == [256, 512] and flops == pytest.approx(2 * 512**3 / 0.19)
    tried.clear()
    now[0] = 0.0
    per_call = {256: 1e-4, 512: 1e-3, 1024: 8e-3, 2048: 0.07}  # fast fp32: every size fits
    flops = hardware.probe_matmul(torch.device("cpu"), torch.float32, budget_s=1.0, clock=clock, timer=timer)
    assert tried == [256, 512, 1024, 2048]
    assert flops == pytest.approx(max(2 * n**3 / t for n, t in per_call.items()))  # the best size's rate
    # a budget the first size already spent: that size is measured (a probe always has one number), no other
    tried.clear()
    now[0] = 0.0
    hardware.probe_matmul(torch.device("cpu"), torch.float32, budget_s=1e-6, clock=clock, timer=timer)
    assert tried == [256]


def test_best_of_reads_the_injected_clock_around_each_repeat():
    """The probe's timing loop: a warm-up call that is not timed, then the fastest of `repeats` timed calls."""
    from engine.measure.hardware import _best_of

    durations = iter([5.0, 3.0, 4.0])  # seconds each timed call takes on the fake clock
    now, calls = [0.0], []

    def fn():
        calls.append(now[0])
        if len(calls) > 1:  # the first call is the warm-up: it costs nothing on this clock
            now[0] += next(durations)

    assert _best_of(fn, lambda: None, 3, clock=lambda: now[0]) == 3.0
    assert len(calls) == 4


def test_real_matmul_timer_runs_the_size_it_is_asked_for():
    """The default timer times a real n x n matmul on the given clock (a counting clock: no wall time read)."""
    from engine.measure.hardware import matmul_timer

    ticks = [0]

    def clock():
        ticks[0] += 1
        return float(ticks[0])

    assert matmul_timer(torch.device("cpu"), torch.float32, repeats=2, clock=clock)(64) == 1.0
    assert ticks[0] == 4  # two reads around each of the two timed calls


# --- slow number formats: a note for the results table ------------------------------------------------
@pytest.mark.parametrize("text,dtype,note", [
    (EPYC_AVX2, "bfloat16", "bfloat16 on this CPU has no bf16 units (avx512_bf16/amx_bf16): expect ~8-10x slower than float32"),
    (EPYC_AVX2, "float16", "float16 on this CPU has no fp16 units (avx512_fp16/amx_fp16): expect ~8-10x slower than float32"),
    (EPYC_AVX2, "float32", None),
    (EPYC_BF16, "bfloat16", None),
    (EPYC_BF16, "float16", "float16 on this CPU has no fp16 units (avx512_fp16/amx_fp16): expect ~8-10x slower than float32"),
    (SAPPHIRE_RAPIDS, "bfloat16", None),
    (SAPPHIRE_RAPIDS, "float16", None),  # avx512_fp16
    (CONVERT_ONLY, "bfloat16", "bfloat16 on this CPU has no bf16 units (avx512_bf16/amx_bf16): expect ~8-10x slower than float32"),
    (GRAVITON3, "bfloat16", None),
    (GRAVITON2, "bfloat16", "bfloat16 on this CPU has no bf16 units (avx512_bf16/amx_bf16): expect ~8-10x slower than float32"),
])
def test_slow_dtype_note_from_cpu_flags(no_override, text, dtype, note):
    assert slow_dtype_note(dtype, "cpu", text) == note
    assert slow_dtype_note(dtype, torch.device("cpu"), text) == note


def test_slow_dtype_note_follows_the_bf16_override_and_this_machine(monkeypatch):
    monkeypatch.setenv(CPU_BF16_ENV, "1")
    assert slow_dtype_note("bfloat16", "cpu", EPYC_AVX2) is None
    monkeypatch.setenv(CPU_BF16_ENV, "0")
    assert "no bf16 units" in slow_dtype_note("bfloat16", "cpu", GRAVITON3)
    monkeypatch.delenv(CPU_BF16_ENV)
    with open("/proc/cpuinfo") as f:
        flags = cpu_flags(f.read())
    # this machine, detected at run time: a note exactly where its flags lack the units
    assert (slow_dtype_note("bfloat16", "cpu") is None) is bool(flags & {"avx512_bf16", "amx_bf16", "bf16", "svebf16"})
    assert (slow_dtype_note("float16", "cpu") is None) is bool(flags & {"avx512_fp16", "amx_fp16"})
    assert slow_dtype_note("float32", "cpu") is None


@pytest.mark.slow  # two full probes (~10-20 s on 2 cores)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the load capture reads /proc")
def test_probe_under_load_is_never_cached_and_a_quiet_one_records_its_load(tmp_path, monkeypatch):
    """The loaded machine of the noise issue cached 4 GB/s instead of 20.9, and every roofline share read
    ~5x high. A probe while processes the test starts keep every core busy is used but flagged and never
    written; a probe without them is cached with when and under what load it ran, and its own spread."""
    import os
    import subprocess

    from engine.measure import hardware
    from engine.measure.noise import NoiseMonitor

    monkeypatch.setenv("INFERSWEEP_CACHE", str(tmp_path))
    device, threads = torch.device("cpu"), torch.get_num_threads()
    with NoiseMonitor() as before:
        import time

        time.sleep(1.0)
    if before.result.get("noise_other_cpu_frac", 0) > hardware.PROBE_MAX_OTHER_CPU:
        pytest.skip("the machine is already loaded by other work: the quiet half cannot be checked")
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        _, source = hardware.node_probe(device, threads)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    assert source == hardware.PROBE_LOADED
    assert hardware.cached_entry(device, threads) is None  # nothing written: the next trial probes again
    probe, source = hardware.node_probe(device, threads)
    entry = hardware.cached_entry(device, threads)
    if source == hardware.PROBE_LOADED:  # other work arrived meanwhile: the rule held, the quiet half is untestable
        assert entry is None
        pytest.skip("other work loaded the machine during the quiet probe")
    assert source == "probe" and entry is not None
    assert entry["load"]["noise_other_cpu_frac"] <= hardware.PROBE_MAX_OTHER_CPU and "measured_at" in entry
    assert entry["stream_bw_cv"] == probe.stream_bw_cv >= 0
    assert hardware.node_probe(device, threads)[1] == "cache"
