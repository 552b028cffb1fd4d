"""Task accuracy (lm-evaluation-harness, engine/tasks) on engine=vllm: continuations scored by vLLM's prompt
log-probs and greedy generation, each task phase on one vLLM start (engine/engines/vllm/engine.py `task_job`,
worker.py `_tasks`).

Fast tier: the job's shape and the shared cut rule (no vLLM needed). Marker `vllm` (needs `.venv-vllm/`,
`make setup-vllm`; skipped without it, failed under CI=true): vLLM's log-likelihoods, greedy flags and task
answers equal transformers' on a tiny random fp32 model with the 5-example task of tests/test_tasks.py; `slow`
and `vllm`: SmolLM2 fp32's accuracy on vLLM equals transformers' on the same examples.
"""
from __future__ import annotations

import json
import os

import pytest

from engine import engines
from engine.config import EvalConfig, ModelConfig, SpeculativeConfig, TinyModelConfig, WorkloadConfig, replace
from engine.engines.base import cut_generation
from engine.engines.vllm import engine as vllm_runner
from engine.models import tiny_checkpoint
from engine.tasks.lmeval import SessionLM
from engine.tasks.run import run_lmeval, task_problems
from conftest import need_task_data
from support import make_trial
from test_tasks import GEN_ITEMS, MC_ITEMS, MC_TASK, _fake_data, _jsonl, _Req
from test_vllm import needs_vllm

TINY32 = ModelConfig(name="tiny", path="tiny://llama", tiny=TinyModelConfig(num_heads=2, num_kv_heads=1))
# fp32 on both sides; vLLM's CPU kernels (its own GEMMs and paged attention) against torch's: a summed log-prob
# of up to ~30 tokens agrees to ~1e-5 relative here (measured 1e-7); 1e-4 relative leaves margin and is still
# far below any difference between choices that could flip an answer
LL_REL = 1e-4
SAY = lambda m: None  # noqa: E731


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERSWEEP_CACHE", str(tmp_path))
    _fake_data(tmp_path)
    return tmp_path


def _open(backend: str, model: ModelConfig = TINY32, **kw):
    trial = make_trial(model, backend=backend, threads=2, **kw)
    eng = engines.get(backend)
    return trial, eng.open(trial, eng.load(trial, SAY), SAY)


# ------------------------------------------------------------------------------------------ fast tier

def test_task_job_carries_every_request_on_one_start_with_the_trials_configuration():
    trial = make_trial(TINY32, backend="vllm", kv_cache="paged", prefix_caching=True)
    score = [{"prompt": [5, 6, 7, 8], "start": 3}, {"prompt": list(range(3, 40)), "start": 30}]
    gen = [{"prompt": list(range(3, 100)), "max_new_tokens": 16}]
    job = json.loads(json.dumps(vllm_runner.task_job(trial, str(tiny_checkpoint(TINY32.tiny)), score, gen)))
    assert job["task"] == {"score": score, "generate": gen}
    a = job["engine_args"]
    assert a["max_model_len"] == 97 + 16  # the longest request: 97 prompt tokens and 16 generated
    assert a["max_num_batched_tokens"] >= a["max_model_len"] and a["enable_chunked_prefill"] is False
    assert a["logprobs_mode"] == "raw_logprobs" and a["dtype"] == "float32" and a["enable_prefix_caching"] is True
    assert 1 <= a["max_num_seqs"] <= vllm_runner.TASK_MAX_SEQS
    assert "requests" not in job and "warmup" not in job
    spec = make_trial(TINY32, backend="vllm", speculative=SpeculativeConfig(method="prompt-lookup", k=3))
    assert vllm_runner.task_job(spec, "/ckpt", [], gen)["engine_args"]["speculative_config"]["method"] == "ngram"
    assert "speculative_config" not in vllm_runner.task_job(spec, "/ckpt", score, [])["engine_args"]  # a prefill each


def test_the_cut_rule_vllm_applies_is_where_the_decode_loop_stops():
    """vLLM generates the whole budget (its stop strings need its detokenizer); cut_generation must end the
    answer exactly where the other engines' decode loop stops by itself."""
    _, s = _open("hf")
    prompt = s.tokenizer.encode("Once upon a time")
    free = s.generate_greedy(prompt, 24, [], SAY)
    text = s.tokenizer.decode(free)
    stop = text[8:10]
    assert stop and len(free) == 24
    stopped = s.generate_greedy(prompt, 24, [stop], SAY)
    assert len(stopped) < 24 and cut_generation(free, s.tokenizer, [stop]) == stopped
    assert cut_generation(free, s.tokenizer, []) == free
    # the batched path of the contract falls back to one generate_greedy per request on the logits engines
    assert s.generate_greedy_many([(prompt, 24, [stop]), (prompt, 24, [])], SAY) == [stopped, free]


def test_validation_lets_tasks_run_on_vllm(cache, tmp_path):
    files = [str(_jsonl(tmp_path / "my_mc.jsonl", MC_ITEMS)), str(_jsonl(tmp_path / "my_gen.jsonl", GEN_ITEMS))]
    for tasks in ([MC_TASK], ["niah_single"], ["my_mc", "my_gen"]):
        trial = replace(make_trial(TINY32, backend="vllm"), "eval", EvalConfig(tasks=tasks, task_files=files))
        assert not [v for k, v in task_problems(trial, 2048) if "does not serve" in v or "unknown task" in v]


@pytest.mark.vllm
@needs_vllm
def test_user_task_files_on_vllm_equal_transformers(cache, tmp_path):
    """The user's own multiple-choice and generation items: the same answers on vLLM as on transformers."""
    files = [str(_jsonl(tmp_path / "my_mc.jsonl", MC_ITEMS)), str(_jsonl(tmp_path / "my_gen.jsonl", GEN_ITEMS))]
    out = {}
    for backend in ("hf", "vllm"):
        trial, s = _open(backend)
        trial = replace(trial, "eval", EvalConfig(tasks=["my_mc", "my_gen"], task_files=files, limit=10))
        out[backend] = run_lmeval(s, trial, ["my_mc", "my_gen"], 2048, SAY)
    assert out["vllm"].answers == out["hf"].answers and len(out["hf"].answers["my_gen"]) == 2
    assert out["vllm"].correct == out["hf"].correct


# ------------------------------------------------------------------------------------------ real vLLM

@pytest.mark.vllm
@needs_vllm
def test_vllm_loglikelihood_and_greedy_flags_equal_transformers_fp32():
    _, hf = _open("hf")
    _, vl = _open("vllm")
    tok = hf.tokenizer
    pairs = [(tok.encode(c), tok.encode(t)) for c, t in
             [("Q: How many legs do horses have?\nA:", " four"), ("Q: What do bees make?\nA:", " honey"),
              ("x", " a longer continuation of several bytes")]]
    # continuations that ARE the greedy ones (is_greedy true), from transformers' own decode loop
    for ctx in ("Once upon a time", "Q: Which is the largest planet?\nA:"):
        c = tok.encode(ctx)
        pairs.append((c, hf.generate_greedy(c, 6, [], SAY)))
    want = hf.loglikelihood(pairs, SAY)
    got = vl.loglikelihood(pairs, SAY)  # one vLLM start for all
    assert [g for _, g in want] == [False, False, False, True, True]
    assert [g for _, g in got] == [g for _, g in want]
    for (a, _), (b, _) in zip(got, want):
        assert a == pytest.approx(b, rel=LL_REL)
    assert vl.info()["vllm_task_calls"] == "1"


@pytest.mark.vllm
@needs_vllm
def test_vllm_task_answers_equal_transformers_on_the_tiny_model(cache):
    """The 5-example multiple-choice task (loglikelihood) and a needle task (generate_until): same per-example
    answers, same scores; each task phase is one vLLM start."""
    results = {}
    for backend in ("hf", "vllm"):
        trial, s = _open(backend, workload=WorkloadConfig(context_len=700))
        mc = run_lmeval(s, replace(trial, "eval", EvalConfig(tasks=[MC_TASK], limit=5)), [MC_TASK], 2048, SAY)
        needle = run_lmeval(s, replace(trial, "eval", EvalConfig(tasks=["niah_single"], limit=2, depths=[0.2, 0.8])),
                            ["niah_single"], 2048, SAY)
        lls = SessionLM(s, 2048).loglikelihood([_Req("Q: What do bees make?\nA:", c) for c in (" honey", " milk")],
                                               disable_tqdm=True)
        results[backend] = (mc, needle, lls, s)
    (hmc, hn, hll, _), (vmc, vn, vll, vs) = results["hf"], results["vllm"]
    assert vmc.answers == hmc.answers and len(vmc.answers[MC_TASK]) == 5
    assert vmc.metrics[f"acc.{MC_TASK}"] == hmc.metrics[f"acc.{MC_TASK}"]
    assert vmc.metrics[f"acc_norm.{MC_TASK}"] == hmc.metrics[f"acc_norm.{MC_TASK}"]
    assert vn.answers == hn.answers and len(vn.answers["niah_single"]) == 4  # the generated texts, as cut
    assert vn.metrics["task_score.niah_single"] == hn.metrics["task_score.niah_single"]
    assert [x for x, _ in vll] == pytest.approx([x for x, _ in hll], rel=LL_REL)
    assert vs.info()["vllm_task_calls"] == "3"  # multiple choice, needle, and the two pairs: one start each


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_smollm2_fp32_task_accuracy_on_vllm_equals_transformers():
    """The real model on the same 20 examples per task: identical per-example answers, so identical accuracy
    (fp32 log-likelihoods differ by ~1e-5 relative, far below the gaps between choices)."""
    need_task_data()
    tasks = ["arc_easy", "sciq"]
    model = ModelConfig(name="smollm2-135m-instruct", path="prepared://smollm2-135m-instruct", dtype="float32")
    out = {}
    for backend in ("hf", "vllm"):
        trial, s = _open(backend, model, workload=WorkloadConfig(context_len=512))
        trial = replace(trial, "eval", EvalConfig(tasks=tasks, limit=20))
        out[backend] = run_lmeval(s, trial, tasks, 8192, SAY)
    for t in tasks:
        assert out["vllm"].answers[t] == out["hf"].answers[t], t
        assert out["vllm"].metrics[f"task_score.{t}"] == out["hf"].metrics[f"task_score.{t}"], t


@pytest.mark.vllm
@needs_vllm
def test_vllm_task_trial_records_answers_and_reproduce_matches(cache, tracking_overrides, tracking, mlflow_client):
    """A sweep trial on engine=vllm with a multiple-choice and a needle task, then `reproduce`: the per-example
    answers and task scores MATCH (greedy answers are deterministic on vLLM too)."""
    from experiments.run.reproduce import reproduce
    from experiments.run.sweep import run_sweep
    from test_vllm import TINY32_OVERRIDES

    res = run_sweep(TINY32_OVERRIDES + tracking_overrides + [
        "engine=vllm", "sweep_name=t-vllm-tasks", "seed=929", "workload.context_len=700", "workload.max_new_tokens=4",
        "workload.repeats=1", "workload.warmup=0", "eval=tasks", f"eval.tasks=[{MC_TASK},niah_single]", "eval.limit=3",
        "eval.depths=[0.5]"], in_process=True, echo=lambda *_: None)
    (row,) = res.rows
    assert row["status"] == "FINISHED", row
    run = mlflow_client.get_run(row["run_id"])
    assert run.data.metrics[f"task_n.{MC_TASK}"] == 3 and run.data.metrics["task_n.niah_single"] == 3
    assert run.data.tags["env.vllm_task_calls"] == "2"  # one vLLM start per task phase (multiple choice, needle)
    cmp = reproduce(row["hash"][:10], tracking)
    verdicts = {k: v for k, _, _, v in cmp.rows}
    for t in (MC_TASK, "niah_single"):
        assert verdicts[f"answers {t}"] == "MATCH" and verdicts[f"task_score.{t}"] == "MATCH", verdicts
    assert cmp.deterministic_match


def test_worker_gives_up_when_the_engine_core_dies():
    """`_gather_alive`: requests waiting on a dead engine core end in an error (the worker exits non-zero and
    the trial fails with its log) instead of hanging until the worker's timeout. The worker module imports only
    the standard library at load; its `errored` flag is AsyncLLM's."""
    import asyncio
    import importlib.util

    spec = importlib.util.spec_from_file_location("vllm_worker_under_test", vllm_runner.worker_script())
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)

    class Core:  # AsyncLLM's `errored` after its engine core exited
        errored = False

    async def scenario():
        core = Core()

        async def never():
            await asyncio.Event().wait()

        async def die():
            await asyncio.sleep(0.1)
            core.errored = True

        asyncio.ensure_future(die())
        with pytest.raises(RuntimeError, match="engine core died"):
            await worker._gather_alive(core, [never(), never()])

        async def value(x):
            return x

        assert await worker._gather_alive(Core(), [value(1), value(2)]) == [1, 2]

    asyncio.run(scenario())
