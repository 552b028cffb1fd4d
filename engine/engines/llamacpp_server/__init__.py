"""Engine `llamacpp-server`: llama.cpp behind its own OpenAI-compatible server -- llama-cpp-python's
`python -m llama_cpp.server` -- started per trial on 127.0.0.1 and driven over HTTP (engine/served/).

The same GGUF files, K/V types, attention paths and checks as engine=llamacpp (it is that engine's server), with
the server's own knobs as the trial's settings (python_server_argv in engine/engines/llamacpp/__init__.py):
  batching.max_batch_tokens  --n_batch            engine.threads           --n_threads, --n_threads_batch
  attention=flash            --flash_attn true    kv_cache.dtype           --type_k, --type_v (ggml type numbers)
  kv_cache.prefix_caching    --cache true (its prompt cache: a request sharing the last one's prefix reuses its state)
  speculative=prompt-lookup  --draft_model prompt-lookup-decoding --draft_model_num_pred_tokens k
  quant.level                the GGUF weight type (gguf-q8_0, gguf-q4_0, gguf-q4_k_m, gguf-shipped, none)
llama-cpp-python's server answers one request at a time (llama-server's parallel slots are not in it), so
batching.max_batch_size is 1. Setup: `make setup-llamacpp` (llama-cpp-python with its [server] extras).
"""
from __future__ import annotations

import importlib.util
from typing import Any, Optional

from ...config import TrialConfig
from ..base import Support
from ..llamacpp import ENGINE as LLAMACPP, LlamaCppEngine, python_server_argv
from ...served.session import ServedEngine, ServedModel

LABEL = "engine=llamacpp-server"
SERVER_MODULES = ("llama_cpp", "uvicorn", "fastapi", "sse_starlette", "starlette_context", "pydantic_settings")


class LlamaCppServerEngine(ServedEngine, LlamaCppEngine):
    name = "llamacpp-server"
    summary = "llama.cpp's OpenAI-compatible server (llama-cpp-python), started per trial and driven over HTTP"
    setup = "make setup-llamacpp"
    serving_usage = "server=llamacpp"
    exact_length_key = "min_tokens"  # llama-cpp-python: no ignore_eos; min_tokens = max_tokens holds EOS back
    support = {
        **LlamaCppEngine.support,
        "batching.mode": Support(("static",), "llama-cpp-python's server answers one request at a time, in arrival order"),
        "speculative.method": Support(("off", "prompt-lookup"), "llama-cpp-python's server has a prompt-lookup drafter "
                                                                 "and no draft-model option"),
    }

    def missing(self) -> Optional[str]:
        why = LlamaCppEngine.missing(self)
        if why:
            return why.replace("engine=llamacpp", LABEL)
        absent = [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]
        if absent:
            return (f"{LABEL} needs llama-cpp-python's server extras ({', '.join(absent)} not installed): run "
                    "`make setup-llamacpp`")
        return None

    def check(self, trial: TrialConfig, facts, gpu_available: bool):
        p = [(k, why.replace("engine=llamacpp", LABEL)) for k, why in LlamaCppEngine.check(self, trial, facts, gpu_available)]
        if trial.batching.max_batch_size != 1:
            p.append(("batching.max_batch_size", f"{LABEL}: llama-cpp-python's server answers one request at a time; "
                                                 f"set batching.max_batch_size=1 (server=llamacpp does), not "
                                                 f"{trial.batching.max_batch_size}"))
        return p + self.served_problems(trial, "engine=llamacpp in this process",
                                        "the GGUF's own vocabulary, and a tiny random model's GGUF has none")

    def load(self, trial: TrialConfig, say) -> ServedModel:
        """The GGUF the server will load (converted once, then cached) and the tokenizer; no weights here."""
        from transformers import AutoTokenizer

        from ...tokenizer import HFTokenizer
        from ..llamacpp.gguf_export import gguf_file, source_of

        src = source_of(trial.model, say)
        path = gguf_file(trial.model, trial.quant.level, trial.engine.threads, say, src=src)
        return ServedModel(path=path, tokenizer=HFTokenizer(AutoTokenizer.from_pretrained(str(src.path))))

    def server_argv(self, trial: TrialConfig, weights: str, port: int, host: str) -> list[str]:
        return python_server_argv(trial, weights, port, host)

    def request_body(self, trial: TrialConfig) -> dict[str, Any]:
        s = trial.workload.sampling
        # llama-cpp-python's request defaults are not plain sampling: top_k 40, min_p 0.05, repeat_penalty 1.1
        return dict(ServedEngine.request_body(self, trial), top_k=s.top_k, min_p=0.0, repeat_penalty=1.0,
                    presence_penalty=0.0, frequency_penalty=0.0)

    def deploy_commands(self, trial: TrialConfig, weights_file=None):
        """The server its trials launch first (llama-cpp-python's, with this venv's python), llama-server's
        equivalent second."""
        from ..base import DeployCommands

        d = LlamaCppEngine.deploy_commands(self, trial, weights_file)
        return DeployCommands((d.commands[1], d.commands[0]), d.notes)

    def default_launch(self, trial: TrialConfig, weights: str):
        import shlex
        import sys

        from ...served.verify import Launch

        # llama-cpp-python's server names the model by its path unless --model_alias says otherwise
        return Launch("the defaults", shlex.join([sys.executable, "-m", "llama_cpp.server", "--model", weights]), weights)

    def local_engine(self) -> LlamaCppEngine:
        return LLAMACPP


ENGINE = LlamaCppServerEngine()
