"""The decision's deliverable: the final configuration as the command that deploys it, where its engine is one
users deploy -- `vllm serve` arguments for vLLM (translated from the engine's own `engine_args`, the arguments
the trials ran with), `llama-server` and llama-cpp-python server arguments for llama.cpp. The in-process
research engines (hf, native) have no server: their deliverable is the configuration itself (`infersweep
reproduce HASH` re-runs it), and the text says so."""
from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Any, Callable, Optional

from engine.config import EngineError, TrialConfig

# vLLM engine arguments the trials set for measuring, not for serving
_VLLM_MEASURING = ("seed", "max_logprobs", "kv_cache_memory_bytes")


@dataclass(frozen=True)
class Deployment:
    engine: str
    commands: tuple[str, ...]  # empty where the engine is not one users deploy
    notes: tuple[str, ...] = ()

    def text(self) -> str:
        lines = [f"# deploy the final configuration (engine {self.engine})"]
        lines += list(self.commands) or ["# no server command: this engine runs in-process for measuring only"]
        lines += [f"# {n}" for n in self.notes]
        return "\n".join(lines) + "\n"


def _model_ref(trial: TrialConfig) -> tuple[str, list[str]]:
    path = trial.model.path or trial.model.name
    notes = []
    if "://" in path:
        notes.append(f"{path}: infersweep's local checkpoint of {trial.model.name} (`infersweep prepare` writes it "
                     f"under the cache); point the server at that directory")
    return path, notes


def _flags(args: dict[str, Any]) -> list[str]:
    out = []
    for k, v in args.items():
        flag = "--" + k.replace("_", "-")
        if v is None or v is False:
            continue
        if v is True:
            out.append(flag)
        elif isinstance(v, dict):
            out += [flag, shlex.quote(json.dumps(v, separators=(",", ":")))]
        else:
            out += [flag, shlex.quote(str(v))]
    return out


def vllm(trial: TrialConfig) -> Deployment:
    from engine.engines.vllm.engine import engine_args

    args = {k: v for k, v in engine_args(trial).items() if k not in _VLLM_MEASURING}
    if args.get("kv_cache_dtype") == "auto":
        args.pop("kv_cache_dtype")
    model, notes = _model_ref(trial)
    return Deployment("vllm", (" ".join(["vllm", "serve", shlex.quote(model)] + _flags(args)),), tuple(notes))


def llamacpp(trial: TrialConfig, gguf: Optional[Callable[[TrialConfig], str]] = None) -> Deployment:
    """`gguf`: the path of the GGUF the trials loaded (None: named by what it holds)."""
    path = gguf(trial) if gguf else f"<GGUF of {trial.model.name}, weights {trial.quant.level}>"
    threads = trial.engine.threads
    batch = trial.batching.max_batch_size if trial.workload.serving else trial.workload.batch_size
    ctx = trial.workload.context_len + trial.workload.max_new_tokens
    kv = trial.kv_cache.dtype if trial.kv_cache.dtype != "auto" else ""
    server = ["llama-server", "-m", shlex.quote(path), "-c", str(ctx * max(1, batch)), "-np", str(max(1, batch)),
              "-b", str(trial.batching.max_batch_tokens)]
    py = ["python", "-m", "llama_cpp.server", "--model", shlex.quote(path), "--n_ctx", str(ctx * max(1, batch)),
          "--n_batch", str(trial.batching.max_batch_tokens)]
    if threads:
        server += ["-t", str(threads), "-tb", str(threads)]
        py += ["--n_threads", str(threads), "--n_threads_batch", str(threads)]
    if trial.attention.impl == "flash":
        server += ["-fa", "on"]
        py += ["--flash_attn", "true"]
    if kv:
        server += ["-ctk", kv, "-ctv", kv]
        py += ["--type_k", kv, "--type_v", kv]
    notes = []
    if trial.speculative.method != "off":
        notes.append(f"speculative={trial.speculative.method} (k={trial.speculative.k}) was measured with infersweep's "
                     f"own drafter on llama.cpp's logits: set your server's matching speculative option")
    if not threads:
        notes.append("engine.threads=0: the trials used every CPU they were given; the server's default does too")
    return Deployment("llamacpp", (" ".join(server), " ".join(py)), tuple(notes))


def deployment(trial: TrialConfig, gguf: Optional[Callable[[TrialConfig], str]] = None) -> Deployment:
    """The deploy command(s) of `trial`'s configuration on its engine."""
    backend = trial.engine.backend
    try:
        if backend == "vllm":
            return vllm(trial)
        if backend == "llamacpp":
            return llamacpp(trial, gguf)
    except EngineError as e:  # e.g. a draft model that cannot be resolved here
        return Deployment(backend, (), (f"no deploy command: {e}",))
    return Deployment(backend, (), (f"engine {backend} is infersweep's in-process engine (measured, not served); "
                                    f"its configuration is the deliverable: `infersweep reproduce` re-runs it, and "
                                    f"the same settings run under engine=vllm or engine=llamacpp where they apply",))


def gguf_of(trial: TrialConfig) -> str:
    """The GGUF file the llama.cpp trials loaded (cached by content: written when the trial ran)."""
    from engine.engines.llamacpp.gguf_export import gguf_file, source_of

    return str(gguf_file(trial.model, trial.quant.level, trial.engine.threads, lambda m: None,
                         src=source_of(trial.model, lambda m: None)))
