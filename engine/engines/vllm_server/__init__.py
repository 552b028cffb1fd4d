"""Engine `vllm-server`: vLLM behind its own OpenAI-compatible server (`vllm.entrypoints.openai.api_server`, what
`vllm serve` runs), started per trial on 127.0.0.1 from `.venv-vllm` and driven over HTTP (engine/served/).

The trial's settings are vLLM's engine arguments, as engine=vllm runs them (`engine_args`), passed as the server's
flags (`server_argv` in engine/engines/vllm/__init__.py):
  batching.max_batch_size     --max-num-seqs             batching.max_batch_tokens  --max-num-batched-tokens
  batching.chunked_prefill    --[no-]enable-chunked-prefill
  kv_cache.prefix_caching     --[no-]enable-prefix-caching   kv_cache.dtype=fp8     --kv-cache-dtype fp8
  engine.compile=false        --enforce-eager            engine.threads             VLLM_CPU_OMP_THREADS_BIND
  speculative=prompt-lookup   --speculative-config {"method": "ngram", ...}   speculative=draft: a draft model
and a KV pool sized for the workload (--kv-cache-memory-bytes; vLLM CPU otherwise takes most of the host's RAM).

Accuracy goes through the same API: a task's continuations are scored by the server's prompt log-probabilities and
its generations are the server's greedy answers (token ids as the server returns them), so the gate judges what the
deployed server answers. Perplexity / fidelity windows (top-k of every position) are scored by engine=vllm in its
own worker on the same checkpoint and engine arguments. Setup: `make setup-vllm`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from ...config import TrialConfig
from ..vllm import ENGINE as VLLM, VLLMEngine, server_argv
from ...served.session import ServedEngine, ServedModel

LABEL = "engine=vllm-server"


class VLLMServerEngine(ServedEngine, VLLMEngine):
    name = "vllm-server"
    summary = "vLLM's OpenAI-compatible server (vllm-cpu), started per trial and driven over HTTP"
    setup = "make setup-vllm"
    serving_usage = "server=vllm-server"
    exact_length_key = "ignore_eos"
    api_scores = True  # continuations and greedy generations through the server's own API
    # measured: in bf16 under Poisson arrivals, a request's greedy tokens changed between repeats with the requests
    # it was batched with (so did ngram speculation's); counted as `outputs_changed`, not a failed trial
    batch_variant_outputs = True
    ready_timeout_s = 600.0  # vLLM's start: a minute eager on 2 cores, more where it compiles
    support = dict(VLLMEngine.support)

    def missing(self) -> Optional[str]:
        why = VLLMEngine.missing(self)
        return why.replace("engine=vllm", LABEL) if why else None

    def check(self, trial: TrialConfig, facts, gpu_available: bool):
        p = [(k, why.replace("engine=vllm", LABEL)) for k, why in VLLMEngine.check(self, trial, facts, gpu_available)]
        b = trial.batching
        if trial.workload.serving and not b.chunked_prefill:
            from ..vllm import serving_len

            n = serving_len(trial)
            if b.max_batch_tokens < n:
                p.append(("batching.max_batch_tokens", f"{LABEL} without chunked prefill needs max_batch_tokens >= the "
                                                       f"server's --max-model-len {n}, got {b.max_batch_tokens}; or "
                                                       f"batching.chunked_prefill=true"))
        return p + self.served_problems(trial, "engine=vllm", "the checkpoint's own tokenizer, and a tiny random "
                                                              "model has none")

    def load(self, trial: TrialConfig, say) -> ServedModel:
        """The checkpoint directory the server will load and its tokenizer; no weights here."""
        from ..vllm.engine import checkpoint

        model_dir, tokenizer = checkpoint(trial.model)
        return ServedModel(path=Path(model_dir), tokenizer=tokenizer)

    def weights_file(self, trial: TrialConfig) -> str:
        from ...models import resolve_path

        return resolve_path(trial.model)

    def server_argv(self, trial: TrialConfig, weights: str, port: int, host: str) -> list[str]:
        """The printed deploy command's argv on `host:port`; where the trial scores evaluation windows through the
        API, also --max-logprobs (it lets a request ask for more log-probs; serving is unchanged)."""
        argv = server_argv(trial, weights, host, port)[1]
        ev = trial.eval
        if ev.enabled and ev.num_windows > 0 and ev.topk > 20:
            argv += ["--max-logprobs", str(ev.topk)]
        return argv

    def server_env(self, trial: TrialConfig) -> dict[str, str]:
        from ..vllm.engine import cpu_binding

        return cpu_binding(trial.engine.threads)

    def request_body(self, trial: TrialConfig) -> dict[str, Any]:
        s = trial.workload.sampling
        body = dict(ServedEngine.request_body(self, trial))
        if s.top_k > 0:
            body["top_k"] = s.top_k
        return body

    def default_launch(self, trial: TrialConfig, weights: str):
        import shlex

        from ...served.verify import Launch
        from ..vllm.engine import vllm_python

        # vLLM's defaults, but for the KV pool: vLLM CPU sizes it from the host's free RAM (20 GiB of 24 here), and
        # two servers are up at once during the check; VLLM_CPU_KVCACHE_SPACE=4 (GiB) is vLLM CPU's former default
        return Launch("the defaults", "VLLM_CPU_KVCACHE_SPACE=4 " + shlex.join(
            [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", weights]), weights)

    def local_engine(self) -> VLLMEngine:
        return VLLM


ENGINE = VLLMServerEngine()
