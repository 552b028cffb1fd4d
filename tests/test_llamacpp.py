"""engine=llamacpp: GGUF conversion, the backend under the engine's trial contract, and its validation.

The validation tests need no llama.cpp. The others carry the `llamacpp` marker and skip cleanly when
llama-cpp-python is not installed (`make setup-llamacpp`).

Tolerances, on the tiny model (logit std ~1.2), measured: flash off + f32 K/V 5e-6 max abs (the conversion
is exact: a wrong Q/K permutation is off by O(1)); f16 K/V (llama.cpp's default) 6e-3; flash on 1.2e-2
whatever the K/V type (llama.cpp's flash path computes in f16). Greedy tokens match exactly.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import (
    ModelConfig,
    QuantConfig,
    SamplingConfig,
    SpeculativeConfig,
    TinyModelConfig,
    TrialConfig,
    WorkloadConfig,
    replace,
)
from experiments.config.compose import SweepError, expand
from conftest import expand_with_engines_absent, require_installed
from support import make_trial

needs_llamacpp = require_installed("llamacpp")
TINY = ModelConfig(name="tiny-llama", path="tiny://llama")
# quantized K/V packs blocks of 32 values along the head dimension: the default tiny's heads are 16 wide
TINY32 = ModelConfig(name="tiny-llama-hd32", path="tiny://llama",
                   tiny=TinyModelConfig(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2))
EXACT_ATOL = 1e-4  # flash off, f32 K/V
F16_ATOL = 2e-2  # f16 K/V or flash on (f16 inside)


# --- validation (fast tier, no llama.cpp needed) ---------------------------------------------------------

def _problems(overrides: list[str]) -> str:
    with pytest.raises(SweepError) as ei:
        expand(["model=tiny-llama"] + overrides, gpu_available=False)
    return str(ei.value)


def test_llamacpp_rejects_what_it_cannot_honour_naming_keys_and_engine():
    msg = _problems(["engine=llamacpp", "kv_cache=paged", "quant=int8-weight", "engine.compile=true"])
    assert "kv_cache.mode: engine=llamacpp cannot honour kv_cache.mode=paged: llama.cpp keeps its own KV cache" in msg
    assert "quant.level: engine=llamacpp cannot honour quant.level=int8-weight: llama.cpp quantizes to GGUF" in msg
    assert "engine.compile: engine=llamacpp cannot honour engine.compile=True: llama.cpp runs its own C++ graph" in msg


def test_llamacpp_rejects_model_drafters_and_serving():
    msg = _problems(["engine=llamacpp", "speculative=self-draft"])
    assert "speculative.method: engine=llamacpp cannot honour speculative.method=self-draft" in msg
    msg = _problems(["engine=llamacpp", "workload=serving-mixed", "kv_cache=paged"])
    assert "engine llamacpp runs one static batch only" in msg


def test_quantized_kv_cache_needs_flash_attention():
    msg = _problems(["engine=llamacpp", "kv_cache.dtype=q8_0", "attention=sdpa"])
    assert "kv_cache.dtype: engine=llamacpp: a quantized V cache (q8_0) needs flash attention" in msg
    assert "kv_cache.dtype: 'q5' is not allowed" in _problems(["engine=llamacpp", "kv_cache.dtype=q5"])
    msg = _problems(["engine=llamacpp", "kv_cache.dtype=q4_0", "attention=flash"])  # tiny heads are 16 wide
    assert "kv_cache.dtype: engine=llamacpp: q4_0 packs blocks of 32 values, which must divide the head dimension (16" in msg


def test_gguf_levels_and_kv_dtype_belong_to_llamacpp():
    msg = _problems(["engine=hf", "quant=gguf-q8_0", "kv_cache.dtype=q8_0"])
    assert "quant.level: engine=hf cannot honour quant.level=gguf-q8_0: gguf-* levels are GGUF weight types written by llama.cpp (engine=llamacpp)" in msg
    assert "kv_cache.dtype: engine=hf cannot honour kv_cache.dtype=q8_0: K/V stay in model.dtype" in msg


def test_an_installed_llama_cpp_that_does_not_import_is_missing(tmp_path):
    """A llama_cpp package that fails to import (a wheel built for another CPU, a lost libllama.so) is found
    by find_spec but would fail every trial: the engine reports it missing, with the import error."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "llama_cpp.py").write_text("raise OSError('libllama.so: cannot open shared object file')\n")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(root)]))
    p = subprocess.run([sys.executable, "-c", "from engine.engines import get; print(get('llamacpp').missing())"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == ("engine=llamacpp needs llama-cpp-python, which is installed but does not import "
                                "(OSError: libllama.so: cannot open shared object file): run `make setup-llamacpp` "
                                "to reinstall it")


def test_llamacpp_accepts_flash_on_cpu_and_gguf_levels():
    specs, absent = expand_with_engines_absent(
        ["model=tiny-llama", "model.tiny.hidden_size=128", "engine=llamacpp", "attention=flash", "kv_cache.dtype=q8_0,q4_0",
         "quant=none,gguf-q8_0,gguf-q4_0,gguf-q4_k_m", "speculative=off,prompt-lookup"], gpu_available=False)
    assert len(specs) == 16 and set(absent) <= {"llamacpp"}


# --- the backend on the tiny random Llama ----------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_tiny():
    from engine.models import load_model

    return load_model(TINY, attention="sdpa", device="cpu")


def _gguf(level: str = "none", spec: ModelConfig = TINY):
    from engine.engines.llamacpp.backend import load_gguf_model

    return load_gguf_model(spec, QuantConfig(level=level), threads=2)


@pytest.fixture(scope="module")
def tiny_f32():
    return _gguf()


def _backend(loaded, attention="sdpa", kv_cache_dtype="auto"):
    from engine.engines import make_backend

    trial = make_trial(loaded.spec, backend="llamacpp", attention=attention, threads=2)
    return make_backend(loaded, replace(trial, "kv_cache.dtype", kv_cache_dtype))


def _ids(b: int, t: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 259, (b, t), generator=g)


def _greedy(backend, prompt, n):
    from engine.generate import generate

    return generate(backend.new_session(prompt.shape[0], prompt.shape[1] + n), prompt, n, SamplingConfig(), 0,
                    lambda: None).tokens


@pytest.mark.llamacpp
@needs_llamacpp
def test_converted_gguf_logits_match_transformers(hf_tiny, tiny_f32):
    """Wrong Q/K permutation or tensor mapping gives logits off by O(1); the conversion must be exact."""
    ids = _ids(1, 48)
    with torch.inference_mode():
        ref = hf_tiny.model(input_ids=ids).logits.float()
    exact = _backend(tiny_f32, attention="sdpa", kv_cache_dtype="f32").score(ids)
    assert exact.shape == ref.shape
    assert torch.allclose(exact, ref, atol=EXACT_ATOL, rtol=0), float((exact - ref).abs().max())
    for attention in ("sdpa", "flash"):
        got = _backend(tiny_f32, attention=attention).score(ids)  # kv auto = f16
        assert torch.allclose(got, ref, atol=F16_ATOL, rtol=0), (attention, float((got - ref).abs().max()))


@pytest.mark.llamacpp
@needs_llamacpp
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_every_float_gguf_loads_and_matches_transformers_at_its_dtype(hf_tiny, dtype):
    """Each model.dtype the validation accepts is written as its GGUF type (F32 / F16 / BF16), loads in
    llama.cpp (BF16 did not: its header gave every row half its length, so the next tensor sat at twice its
    offset) and gives transformers' logits at the same dtype (flash off, f32 K/V). Tolerance: F32 exact (1e-4);
    a 16-bit run may differ from transformers' at that dtype by twice what that dtype's own rounding moves
    transformers' logits from float32 (the two round activations at different places). Measured on the tiny
    model: F16 0.013 vs a rounding error of 0.012, BF16 0.087 vs 0.149; a wrong layout is off by O(1) (the
    logits' spread is ~1.2)."""
    from engine.engines.llamacpp.gguf_export import FLOAT_TYPES
    from engine.models import load_model

    spec = dataclasses.replace(TINY, dtype=dtype)
    ids = _ids(1, 48)
    with torch.inference_mode():
        f32 = hf_tiny.model(input_ids=ids).logits.float()
        ref = load_model(spec, attention="sdpa", device="cpu").model(input_ids=ids).logits.float()
    gg = _gguf(spec=spec)
    assert gg.path.name == f"model-{FLOAT_TYPES[dtype]}.gguf"
    got = _backend(gg, kv_cache_dtype="f32").score(ids)
    err, rounding = float((got - ref).abs().max()), float((ref - f32).abs().max())
    assert err <= max(EXACT_ATOL, 2 * rounding), (dtype, err, rounding)


@pytest.mark.llamacpp
@needs_llamacpp
def test_a_reused_context_takes_longer_rows_than_it_was_made_for(tiny_f32):
    """llama.cpp clamps n_batch to the n_ctx asked for and then pads n_ctx: a context made for 20-token rows
    holds 256 cells but takes only 20 tokens per decode call. Scoring 100-token rows on it (reused: they fit
    the cells) used to abort the process (GGML_ASSERT n_tokens_all <= n_batch, seen in lm-eval's log-likelihood
    requests of varying lengths); now it splits the calls, and the logits equal a fresh context's."""
    backend = _backend(tiny_f32, kv_cache_dtype="f32")
    backend.score(_ids(1, 20))
    long = _ids(1, 100, seed=1)
    got = backend.score(long)
    fresh = _backend(tiny_f32, kv_cache_dtype="f32").score(long)
    assert torch.allclose(got, fresh, atol=EXACT_ATOL, rtol=0), float((got - fresh).abs().max())


@pytest.mark.llamacpp
@needs_llamacpp
def test_greedy_tokens_equal_transformers_and_batch_rows_equal_single_runs(hf_tiny, tiny_f32):
    from engine.engines.hf.backend import HFBackend

    prompts = _ids(3, 20, seed=1)
    ref = _greedy(HFBackend(hf_tiny, TrialConfig(model=TINY)), prompts, 12)
    be = _backend(tiny_f32, attention="flash")
    batched = _greedy(be, prompts, 12)
    assert torch.equal(batched, ref)
    for row in range(3):  # parallel sequences do not see each other
        assert torch.equal(_greedy(be, prompts[row:row + 1], 12), batched[row:row + 1])


@pytest.mark.llamacpp
@needs_llamacpp
def test_rollback_makes_prompt_lookup_equal_plain_greedy(tiny_f32):
    from engine.speculative.decode import generate_speculative
    from engine.speculative.prompt_lookup import PromptLookupDrafter

    be = _backend(tiny_f32, attention="flash")
    passage = _ids(1, 16, seed=1)
    prompt = torch.cat([passage, passage, passage[:, :4]], dim=1)  # this seed's output repeats in places
    n = 40
    plain = _greedy(be, prompt, n)
    accepted = rejections = 0
    for k in (1, 3, 6):
        trace = generate_speculative(be.new_session(1, prompt.shape[1] + n), PromptLookupDrafter(1, 3, torch.device("cpu")),
                                     prompt, n, k, SamplingConfig(), 0, lambda: None)
        assert torch.equal(trace.tokens, plain), k
        stats = trace.extra["speculative"]
        accepted, rejections = accepted + stats.accepted, rejections + stats.rejections
    assert accepted > 0 and rejections > 0, (accepted, rejections)  # both accept and reject + roll back
    # an explicit rollback forgets positions: re-feeding them gives the first logits again
    s = be.new_session(1, 40)
    first = s.forward(prompt[:, :20])
    s.rollback(5)
    assert s.length == 15
    again = s.forward(prompt[:, 15:20])
    assert torch.allclose(again, first[:, 15:20], atol=1e-5)


@pytest.mark.llamacpp
@needs_llamacpp
def test_q8_0_runs_close_to_f32_and_is_smaller(tiny_f32):
    q8, q4, q4km = _gguf("gguf-q8_0"), _gguf("gguf-q4_0"), _gguf("gguf-q4_k_m")
    assert q8.path.name.startswith("model-Q8_0") and q8.path.parent == tiny_f32.path.parent
    assert q4.weights_bytes() < q4km.weights_bytes() < q8.weights_bytes() < 0.4 * tiny_f32.weights_bytes()
    ids = _ids(1, 32, seed=3)
    ref = torch.log_softmax(_backend(tiny_f32, attention="flash").score(ids), -1)

    def kl(loaded) -> float:
        got = torch.log_softmax(_backend(loaded, attention="flash").score(ids), -1)
        return float((ref.exp() * (ref - got)).sum(-1).mean())

    kl8, kl4, kl4km = kl(q8), kl(q4), kl(q4km)
    assert kl8 < 1e-3 and kl8 < kl4 / 4, (kl8, kl4)  # 8-bit blocks sit far closer to F32 than 4-bit ones
    # Q4_K_M mixes in 6-bit types (and, for the tiny model's 64-wide rows, Q4_K's fallback): between the two
    assert kl8 < kl4km < kl4, (kl8, kl4km, kl4)


@pytest.mark.llamacpp
@needs_llamacpp
def test_engine_trial_metrics_and_fidelity_through_the_runner():
    from engine.pipeline import run_engine_trial

    trial = make_trial(
        TINY32, backend="llamacpp", attention="flash", threads=2,
        workload=WorkloadConfig(context_len=96, max_new_tokens=8, batch_size=2, repeats=2, prompt_style="repeat"),
        eval=dataclasses.replace(TrialConfig(model=TINY32).eval, num_windows=1, fidelity=True),
    )
    trial = replace(trial, "kv_cache.dtype", "q8_0")
    res = run_engine_trial(trial)
    m = res.metrics
    for key in ("ttft_ms_mean", "tpot_ms_p50", "output_tok_s", "peak_mem_bytes", "weights_bytes", "kv_cache_bytes",
                "kl_div_mean", "top1_agreement", "ppl"):
        assert key in m, key
    assert len(res.token_ids) == 2 and len(res.token_ids[0]) == 8
    assert m["kl_div_mean"] < 0.01 and m["top1_agreement"] > 0.9
    spec = run_engine_trial(dataclasses.replace(
        trial, workload=dataclasses.replace(trial.workload, batch_size=1), eval=dataclasses.replace(trial.eval, enabled=False),
        speculative=SpeculativeConfig(method="prompt-lookup", k=3)))
    assert spec.token_ids[0] == res.token_ids[0]
    assert spec.metrics["tokens_per_step"] >= 1  # the speculative loop ran (acceptance needs drafts to exist)


@pytest.mark.llamacpp
@needs_llamacpp
def test_sweep_engine_llamacpp_end_to_end(ray_local, tiny_overrides, mlflow_client):
    from experiments.run.sweep import run_sweep

    res = run_sweep(tiny_overrides + ["sweep_name=t-llamacpp", "seed=1313", "engine=llamacpp", "attention=flash",
                                      "quant=none,gguf-q8_0"], echo=lambda *_: None)
    assert [r["status"] for r in res.rows] == ["FINISHED"] * 2, res.rows
    exp_id = mlflow_client.get_run(res.parent_run_id).info.experiment_id
    runs = mlflow_client.search_runs([exp_id], filter_string=f"tags.mlflow.parentRunId = '{res.parent_run_id}'")
    assert len(runs) == 2
    for run in runs:
        assert run.data.params["engine.backend"] == "llamacpp"
        assert {"output_tok_s", "ttft_ms_p50", "weights_bytes", "ppl"} <= set(run.data.metrics)
    sizes = {run.data.params["quant.level"]: run.data.metrics["weights_bytes"] for run in runs}
    assert sizes["gguf-q8_0"] < sizes["none"]


@pytest.mark.llamacpp
@needs_llamacpp
def test_sweep_engine_llamacpp_at_16_bit_dtypes_finishes_without_a_slow_dtype_note(ray_local, tiny_overrides, mlflow_client):
    """model.dtype=auto is bfloat16 on a CPU with bf16 units: every llama.cpp trial failed there (the BF16
    GGUF did not load). f16 and bf16 both finish, and neither carries torch's "expect ~8-10x slower" note:
    llama.cpp widens those weights and multiplies in f32 (Engine.compute_dtype)."""
    from experiments.run.sweep import run_sweep

    res = run_sweep(tiny_overrides + ["sweep_name=t-llamacpp-dtypes", "engine=llamacpp", "model.dtype=float16,bfloat16"],
                    echo=lambda *_: None)
    assert [r["status"] for r in res.rows] == ["FINISHED"] * 2, res.rows
    exp_id = mlflow_client.get_run(res.parent_run_id).info.experiment_id
    runs = mlflow_client.search_runs([exp_id], filter_string=f"tags.mlflow.parentRunId = '{res.parent_run_id}'")
    assert sorted(r.data.params["model.dtype"] for r in runs) == ["bfloat16", "float16"]
    for run in runs:
        assert "env.dtype_note" not in run.data.tags, run.data.tags["env.dtype_note"]
        assert run.data.metrics["ppl"] > 0 and run.data.metrics["output_tok_s"] > 0


# --- the real model (slow tier) ---------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.llamacpp
@needs_llamacpp
def test_smollm2_greedy_tokens_equal_transformers():
    from engine.engines.hf.backend import HFBackend
    from engine.engines.llamacpp.backend import load_gguf_model
    from engine.models import load_model
    from engine.prompts import workload_prompts

    spec = ModelConfig(name="smollm2-135m-instruct", path="prepared://smollm2-135m-instruct")
    hf = load_model(spec, attention="sdpa", device="cpu")
    prompt = workload_prompts(hf.tokenizer, WorkloadConfig(context_len=128, max_new_tokens=24))
    ref = _greedy(HFBackend(hf, TrialConfig(model=spec)), prompt, 24)
    del hf
    gg = load_gguf_model(spec, QuantConfig(), threads=2)
    got = _greedy(_backend(gg, attention="flash"), prompt, 24)
    assert got.tolist() == ref.tolist()


@pytest.mark.llamacpp
@needs_llamacpp
def test_prefill_keeps_each_rows_last_logits_only(tiny_f32):
    """generate's prefill: each row's last position's logits, the same as forward's, across llama_decode calls of
    n_batch tokens (batching.max_batch_tokens=128: 3 rows of 200 tokens in 5 calls); row ends inside and between."""
    from engine.engines import make_backend

    be = make_backend(tiny_f32, replace(make_trial(tiny_f32.spec, backend="llamacpp", threads=2),
                                        "batching.max_batch_tokens", 128))
    assert be.n_batch == 128
    ids = _ids(3, 200, seed=9)
    a = be.new_session(3, 210)
    last = a.prefill(ids)
    b = be.new_session(3, 210)  # a new session resets the context: `a` is done
    torch.testing.assert_close(last, b.forward(ids)[:, -1], atol=1e-5, rtol=1e-5)
    assert last.shape == (3, be.n_vocab) and b.length == 200
