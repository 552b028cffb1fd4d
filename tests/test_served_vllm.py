"""Served trials on vLLM's own OpenAI-compatible server (engine=vllm-server, `server=vllm-server`).

Fast tier, no vLLM needed: the refusals, the launched argv equal to the printed deploy command, a shell line's
variables carried into the launch. Marker `vllm` (`-m vllm`; needs `.venv-vllm/` and SmolLM2 prepared, fails
instead of skipping under CI=true): a served trial through the sweep (metrics under the in-process names, the
server's command and log recorded, nothing left running), accuracy through the API against engine=vllm's own worker
on the same checkpoint (continuation log-probs and greedy answers), and the printed command launched and serving."""
from __future__ import annotations

import dataclasses
import shlex

import pytest

from conftest import expand_with_engines_absent, need_prepared, require_installed
from engine.config import EngineError, ModelConfig, WorkloadConfig
from engine.served.verify import split_command
from experiments.config.compose import SweepError
from support import make_trial

needs_vllm = require_installed("vllm-server")
SMOL = "smollm2-135m-instruct"
SERVED = ["model=smollm2-135m", "server=vllm-server", "model.dtype=float32", "workload=serving-mixed",
          "workload.num_requests=4", "workload.output_len.min=4", "workload.output_len.max=8", "eval=none",
          "engine.threads=2"]


@pytest.fixture(autouse=True)
def own_records(tmp_path, monkeypatch):
    from engine.served.process import RECORDS_ENV

    monkeypatch.setenv(RECORDS_ENV, str(tmp_path / "servers"))


def _problems(overrides: list[str]) -> str:
    with pytest.raises(SweepError) as ei:
        expand_with_engines_absent(overrides, gpu_available=False)
    return str(ei.value)


def test_vllm_server_refuses_what_its_server_cannot_run():
    msg = _problems(["model=tiny-llama", "server=vllm-server", "workload=serving-mixed", "speculative=self-draft",
                     "model.dtype=float16"])
    assert "model.path: engine=vllm-server: the server tokenizes text with the checkpoint's own tokenizer" in msg
    assert "speculative.method: engine=vllm-server cannot honour speculative.method=self-draft" in msg
    assert "model.dtype: engine=vllm-server runs float32 or bfloat16 on CPU" in msg
    msg = _problems(["model=smollm2-135m", "engine=vllm-server"])
    assert "workload.kind: engine=vllm-server serves requests over HTTP: give it a serving workload" in msg


def _trial(**kw):
    from engine.config import BatchingConfig, KVCacheConfig, SpeculativeConfig

    t = make_trial(ModelConfig(name="smollm2-135m-instruct", path="/models/smollm2", dtype="bfloat16"),
                   backend="vllm-server", threads=1, workload=WorkloadConfig(kind="serving"),
                   speculative=SpeculativeConfig(method="prompt-lookup", k=3))
    return dataclasses.replace(t, kv_cache=KVCacheConfig(mode="paged", prefix_caching=True),
                               batching=BatchingConfig(mode="continuous", max_batch_size=4, chunked_prefill=True), **kw)


def test_a_served_trial_launches_the_printed_deploy_command():
    """The argv a trial starts is the deploy command's first line with the trial's host and port added, and its
    environment is the line's variables: what optimize prints is what was measured."""
    from engine import engines

    eng = engines.get("vllm-server")
    t = _trial()
    printed = eng.deploy_commands(t, lambda _: "/models/smollm2").commands[0]
    env, argv = split_command(printed)
    assert env == eng.server_env(t) and set(env) == {"VLLM_CPU_OMP_THREADS_BIND"}
    launched = eng.server_argv(t, "/models/smollm2", 8123, "127.0.0.1")
    n = len(argv) + 4
    assert launched[:n] == argv + ["--host", "127.0.0.1", "--port", "8123"]
    # scoring evaluation windows through the API asks for top-k log-probs, which vLLM caps at 20 unless told
    assert launched[n:] == (["--max-logprobs", str(t.eval.topk)] if t.eval.num_windows and t.eval.topk > 20 else [])
    assert "--max-num-seqs 4" in printed and "--enable-chunked-prefill" in printed and "--enable-prefix-caching" in printed
    assert '"method":"ngram"' in printed and "--enforce-eager" in printed


def test_split_command_takes_the_variables_before_the_program():
    env, argv = split_command("A=1 B='x y' /bin/prog --flag C=3")
    assert env == {"A": "1", "B": "x y"} and argv == ["/bin/prog", "--flag", "C=3"]
    assert split_command("prog") == ({}, ["prog"])


# --- real vLLM --------------------------------------------------------------------------------------------

@pytest.mark.vllm
@needs_vllm
def test_a_vllm_served_trial_is_recorded_like_any_serving_trial_and_leaves_no_server(tmp_path):
    need_prepared(SMOL)
    from engine.served.process import records_dir
    from support import served_trial_run

    client, run = served_trial_run(tmp_path, SERVED, "t-vllm-served")
    for k in ("ttft_ms_p50", "tpot_ms_p50", "itl_ms_p50", "e2e_s_p99", "goodput", "output_tok_s", "slo_attainment",
              "peak_mem_bytes", "model_load_s"):
        assert k in run.data.metrics, k
    assert run.data.metrics["incomplete_requests"] == 0  # ignore_eos: every request ran its whole length
    cmd = run.data.tags["env.server_command"]
    assert "vllm.entrypoints.openai.api_server" in cmd and cmd.startswith("VLLM_CPU_OMP_THREADS_BIND=")
    log = client.download_artifacts(run.info.run_id, "server/server.log", str(tmp_path))
    assert "POST /v1/completions" in open(log).read()
    assert not list(records_dir().glob("*.json"))  # the server ended with its trial, its record gone


@pytest.mark.vllm
@needs_vllm
def test_accuracy_through_the_api_matches_vllms_own_worker(tmp_path):
    """Continuation log-probs and greedy answers through the server's API equal engine=vllm's worker on the same
    checkpoint and engine arguments (fp32; tolerance: vLLM's batched CPU kernels, 1e-3 nats a token)."""
    need_prepared(SMOL)
    from engine import engines
    from experiments.config.compose import expand

    spec = expand(SERVED, gpu_available=False)[0]
    trial = spec.trial
    eng = engines.get("vllm-server")
    session = eng.open(trial, eng.load(trial, lambda *_: None), lambda *_: None)
    tok = session.tokenizer
    pairs = [(tok.encode("The capital of France is"), tok.encode(" Paris")),
             (tok.encode("Water boils at 100 degrees"), tok.encode(" Celsius at sea level")),
             (tok.encode("def add(a, b):\n    return"), tok.encode(" a + b"))]
    prompts = [(tok.encode("Question: what is 2 + 2?\nAnswer:"), 6, ["\n\n"]), (tok.encode("Once upon a time"), 8, [])]
    try:
        served_ll = session.loglikelihood(pairs, lambda *_: None)
        served_gen = session.generate_greedy_many(prompts, lambda *_: None)
    finally:
        session.close()
    assert not session._server.running()  # close() ended the server
    local = engines.get("vllm")
    worker = local.open(dataclasses.replace(trial, engine=dataclasses.replace(trial.engine, backend="vllm"),
                                            workload=WorkloadConfig()), None, lambda *_: None)
    try:
        ref_ll = worker.loglikelihood(pairs, lambda *_: None)
        ref_gen = worker.generate_greedy_many(prompts, lambda *_: None)
    finally:
        worker.close()
    for (lp, greedy), (rlp, rgreedy), (_, cont) in zip(served_ll, ref_ll, pairs):
        assert abs(lp - rlp) <= 1e-3 * len(cont), (lp, rlp)
        assert greedy == rgreedy
    assert served_gen == ref_gen


@pytest.mark.vllm
@needs_vllm
def test_the_printed_vllm_command_starts_and_serves(tmp_path):
    need_prepared(SMOL)
    from engine import engines
    from engine.served.verify import measure_launches
    from experiments.config.compose import expand

    trial = expand(SERVED, gpu_available=False)[0].trial
    eng = engines.get("vllm-server")
    weights = eng.weights_file(trial)
    launch = eng.deploy_launch(trial, weights)
    assert launch.command == eng.deploy_commands(trial).commands[0]
    (res,) = measure_launches([launch], trial, eng.load(trial, lambda *_: None).tokenizer, eng.request_body(trial),
                              eng.exact_length_key, 2, lambda *_: None, ready_timeout_s=eng.ready_timeout_s)
    assert len(res.rounds) == 2 and all(r["output_tok_s"] > 0 for r in res.rounds)
    assert all(r.get("incomplete_requests", 0) == 0 for r in res.rounds)
    with pytest.raises(EngineError, match="at least 2 rounds"):
        measure_launches([launch], trial, None, {}, "", 1, lambda *_: None)
    assert shlex.split(launch.command)[0].startswith("VLLM_CPU_OMP_THREADS_BIND=")


def test_repeats_that_differ_are_counted_on_a_batch_variant_engine_and_refused_elsewhere():
    from engine import engines
    from engine.engines.base import Runs
    from engine.pipeline import Workload

    assert engines.get("vllm-server").batch_variant_outputs and not engines.get("llamacpp-server").batch_variant_outputs
    traces = [[[1, 2], [3, 4], [5]], [[1, 2], [3, 9], [5]]]  # the second request's tokens changed in repeat 2
    runs = Runs(traces, [{}, {}], 0)
    w = Workload(lambda *_: runs, lambda t, x: {"n": len(t)}, lambda t: t, batch_variant=True)
    per_run, first = w.outcome(runs)
    assert first == traces[0] and [m["outputs_changed"] for m in per_run] == [0.0, pytest.approx(1 / 3)]
    with pytest.raises(EngineError, match="not deterministic"):
        Workload(lambda *_: runs, lambda t, x: {}, lambda t: t).outcome(runs)
