"""Engine `llamacpp`: llama.cpp through llama-cpp-python's C API (backend.py), on a GGUF the package
writes from the trial's checkpoint (gguf_export.py: converted once per weight type, then cached).

Setup: `make setup-llamacpp` (cluster/install_llamacpp.sh): PyPI has no binary wheel, so llama-cpp-python
is compiled once (10-20 min on 2 cores, -DGGML_NATIVE=ON) into ~/.cache/infersweep/wheels, and installed
from there in seconds afterwards.
"""
from __future__ import annotations

import functools
import importlib.util
import shlex
from typing import Any, Optional

import torch

from ...config import TrialConfig
from ...models import PREPARED_MODELS, PREPARED_SCHEME
from ..base import DeployCommands, Support, WeightsFile
from ..hf import own_kernels
from ..logits import LogitsEngine

from .kv_types import KV_CACHE_DTYPES, KV_TYPE_BYTES, QUANTIZED_KV, kv_type

# re-exported from the reference checkpoint by llama.cpp's quantizer (gguf_export.py)
GGUF_QUANT = ("gguf-q8_0", "gguf-q4_0", "gguf-q4_k_m")
# the GGUF a prepared model shipped as, run as is (SmolLM2: Q4_1; Gemma 3 270M: Q4_K_M): the weights as their
# publisher quantized them, where a gguf-* level quantizes again what `prepare` dequantized
SHIPPED = "gguf-shipped"
ENGINE_LABEL = "engine=llamacpp"


class LlamaCppEngine(LogitsEngine):
    name = "llamacpp"
    summary = "llama.cpp (GGUF weights, its own KV cache types, CPU flash attention)"
    setup = "make setup-llamacpp"
    support = {
        "kv_cache.mode": Support(("contiguous",), "llama.cpp keeps its own KV cache, one contiguous stream per sequence"),
        "batching.mode": Support(("static",), "llama.cpp runs the static batch as parallel sequences"),
        # llama.cpp has a flash path and one non-flash path, which materializes the scores: that is eager;
        # asking for sdpa runs the same thing, so it folds to eager (one config hash)
        "attention.impl": Support(("eager", "flash"), "llama.cpp has a flash and a non-flash attention path",
                                  aliases={"sdpa": "eager"}),
        "quant.level": Support(("none",) + GGUF_QUANT + (SHIPPED,),
                               "llama.cpp quantizes to GGUF weight types with its own quantizer"),
        "speculative.method": Support(("off", "prompt-lookup"), "our prompt-lookup drafter verifies on llama.cpp; a draft "
                                                                "model or self-draft would need a second llama.cpp model"),
        "kv_cache.dtype": Support(KV_CACHE_DTYPES, "llama.cpp's K/V types (auto = f16)"),
        "engine.compile": Support(("False",), "llama.cpp runs its own C++ graph: torch.compile does not apply"),
        "engine.compile_mode": Support(("dynamic",), "llama.cpp runs its own C++ graph: torch.compile does not apply"),
        "engine.prefill": Support(("default",), "llama.cpp prefills with its own graph (engine.prefill=cpp is engine=native's)"),
        "quant.kernel": own_kernels("llama.cpp"),
    }

    def missing(self) -> Optional[str]:
        if importlib.util.find_spec("llama_cpp") is None:
            return f"{ENGINE_LABEL} needs llama-cpp-python, which is not installed: run `make setup-llamacpp`"
        broken = _import_problem()
        if broken:
            return (f"{ENGINE_LABEL} needs llama-cpp-python, which is installed but does not import ({broken}): "
                    "run `make setup-llamacpp` to reinstall it")
        return None

    def check(self, trial: TrialConfig, facts, gpu_available: bool):
        q, kv = trial.quant, trial.kv_cache
        attention = self.attention(trial)
        p = []
        if q.keep_last_layers:
            p.append(("quant.keep_last_layers", f"{ENGINE_LABEL}: llama.cpp's quantizer picks per-tensor types itself "
                                                "(gguf-q4_k_m mixes them); keep_last_layers is not supported"))
        if kv.dtype in QUANTIZED_KV:
            if attention != "flash":
                p.append(("kv_cache.dtype", f"{ENGINE_LABEL}: a quantized V cache ({kv.dtype}) needs flash "
                                            f"attention in llama.cpp: set attention=flash (now {trial.attention.impl})"))
            head_dim = facts.head_dim if facts is not None else None
            if head_dim and head_dim % 32:
                p.append(("kv_cache.dtype", f"{ENGINE_LABEL}: {kv.dtype} packs blocks of 32 values, which must "
                                            f"divide the head dimension ({head_dim} in this model)"))
        if q.level == SHIPPED:
            name = trial.model.path[len(PREPARED_SCHEME):] if trial.model.path.startswith(PREPARED_SCHEME) else None
            if name not in PREPARED_MODELS:
                p.append(("quant.level", f"{ENGINE_LABEL}: quant.level={SHIPPED} runs the GGUF a prepared model shipped "
                                         f"as; {trial.model.path} is not one ({', '.join(sorted(PREPARED_MODELS))} are): "
                                         f"use a re-exported level ({', '.join(GGUF_QUANT)}) or none"))
            return p  # llama.cpp's own file: nothing to convert
        p += [("model.path", why) for why in _conversion_problems(trial, facts)]
        return p

    def weight_level(self, trial: TrialConfig) -> str:
        if trial.quant.level == SHIPPED and trial.model.path.startswith(PREPARED_SCHEME):
            return PREPARED_MODELS[trial.model.path[len(PREPARED_SCHEME):]].gguf_level
        return trial.quant.level

    def skip_modules(self, trial: TrialConfig) -> list[str]:
        # a GGUF weight type covers the output matrix too (the tied token_embd for SmolLM2 and Gemma): quant.skip_modules
        # is our levels' option, not llama.cpp's
        return [] if trial.quant.level != "none" else list(trial.quant.skip_modules)

    def attention(self, trial: TrialConfig) -> str:
        return self.support["attention.impl"].runs_as(trial.attention.impl)

    def materializes_scores(self, trial: TrialConfig) -> bool:
        return self.attention(trial) != "flash"  # the non-flash path writes KQ and softmax(KQ) to memory

    def kv_element_bytes(self, trial: TrialConfig) -> Optional[float]:
        return KV_TYPE_BYTES.get(kv_type(trial.kv_cache.dtype))

    def compute_dtype(self, trial: TrialConfig, device) -> str:
        """ggml's CPU matmuls run F16 weights widened to f32 with F16C, quantized weights as integer block dot
        products and BF16 as f32 too unless the CPU has bf16 dot products (avx512_bf16): every path but that one
        runs at f32 rate and is bandwidth-bound at decode (measured: llama.cpp f16 decoded x1.77 faster than its
        f32 on a CPU without fp16 units, where torch's fp16 runs 8-10x slower than fp32)."""
        from ...measure.hardware import cpu_bf16_support

        if torch.device(device).type != "cpu":
            return trial.model.dtype
        if trial.quant.level == "none" and trial.model.dtype == "bfloat16" and cpu_bf16_support():
            return "bfloat16"
        return "float32"

    def load(self, trial: TrialConfig, say) -> Any:
        from .backend import load_gguf_model

        return load_gguf_model(trial.model, trial.quant, trial.engine.threads, say)

    def make_backend(self, loaded: Any, trial: TrialConfig):
        from .backend import LlamaCppBackend

        return LlamaCppBackend(loaded, trial)

    def weights_file(self, trial: TrialConfig) -> str:
        """The GGUF file the trials loaded (cached by content: written when the trial ran)."""
        from .gguf_export import gguf_file, source_of

        return str(gguf_file(trial.model, trial.quant.level, trial.engine.threads, lambda m: None,
                             src=source_of(trial.model, lambda m: None)))

    def deploy_commands(self, trial: TrialConfig, weights_file: Optional[WeightsFile] = None) -> DeployCommands:
        """`llama-server` and llama-cpp-python server arguments. `weights_file`: the path of the GGUF the trials
        loaded (None: named by what it holds). The second is the command a served trial (engine=llamacpp-server)
        launches, with this project's interpreter (which has the server's extras after `make setup-llamacpp`)."""
        path = weights_file(trial) if weights_file else f"<GGUF of {trial.model.name}, weights {trial.quant.level}>"
        threads = trial.engine.threads
        batch = max(1, trial.batching.max_batch_size if trial.workload.serving else trial.workload.batch_size)
        kv = trial.kv_cache.dtype if trial.kv_cache.dtype != "auto" else ""
        server = ["llama-server", "-m", shlex.quote(path), "-c", str(serving_context(trial) * batch), "-np", str(batch),
                  "-b", str(trial.batching.max_batch_tokens)]
        if threads:
            server += ["-t", str(threads), "-tb", str(threads)]
        if trial.attention.impl == "flash":
            server += ["-fa", "on"]
        if kv:
            server += ["-ctk", kv, "-ctv", kv]
        py = shlex.join(python_server_argv(trial, path, 8000, "127.0.0.1"))
        notes = []
        if trial.speculative.method != "off":
            notes.append(f"speculative={trial.speculative.method} (k={trial.speculative.k}) was measured with infersweep's "
                         f"own drafter on llama.cpp's logits; llama-cpp-python's server runs its own prompt-lookup drafter "
                         f"(--draft_model prompt-lookup-decoding)")
        if not threads:
            notes.append("engine.threads=0: the trials used every CPU they were given; the server's default does too")
        if batch > 1:
            notes.append(f"llama-cpp-python's server runs one request at a time; llama-server's -np {batch} gives "
                         f"{batch} parallel slots")
        return DeployCommands((" ".join(server), py), tuple(notes))


def serving_context(trial: TrialConfig) -> int:
    """The context a server is launched with: the longest request the trial's workload sends (static: prompt +
    new tokens), rounded up to 256, and at least 2,048 (llama-cpp-python's own default), so the deployed server
    takes requests longer than the benchmark's."""
    from ...serving.requests import max_request_tokens

    wl = trial.workload
    need = max_request_tokens(wl) if wl.serving else wl.context_len + wl.max_new_tokens
    return max(2048, -(-need // 256) * 256)


def python_server_argv(trial: TrialConfig, weights: str, port: int, host: str,
                       python: Optional[str] = None) -> list[str]:
    """llama-cpp-python's OpenAI-compatible server (`python -m llama_cpp.server`) with the trial's settings, as a
    served trial launches it and as the deploy command prints it. `python`: this interpreter by default (the
    project's venv, where `make setup-llamacpp` installs the server's extras)."""
    import sys

    from .kv_types import KV_GGML_IDS

    argv = [python or sys.executable, "-m", "llama_cpp.server", "--model", weights, "--model_alias", trial.model.name,
            "--host", host, "--port", str(port), "--n_ctx", str(serving_context(trial)),
            "--n_batch", str(trial.batching.max_batch_tokens),
            # the server's default computes the logits of every prompt token (for prompt log-probs, which no
            # request here asks for): prefill then writes n_ctx x vocab floats
            "--logits_all", "false", "--verbose", "false",
            # the server's default cancels the request being generated whenever a new one arrives (an interactive
            # chat's "stop, I typed again"): under a serving load every overlapped request would end after a token
            "--interrupt_requests", "false"]
    if trial.engine.threads:
        argv += ["--n_threads", str(trial.engine.threads), "--n_threads_batch", str(trial.engine.threads)]
    if trial.attention.impl == "flash":
        argv += ["--flash_attn", "true"]
    if trial.kv_cache.dtype != "auto":  # the server takes ggml's type numbers, not names
        argv += ["--type_k", str(KV_GGML_IDS[trial.kv_cache.dtype]), "--type_v", str(KV_GGML_IDS[trial.kv_cache.dtype])]
    if trial.kv_cache.prefix_caching:
        argv += ["--cache", "true"]
    if trial.speculative.method == "prompt-lookup":
        argv += ["--draft_model", "prompt-lookup-decoding", "--draft_model_num_pred_tokens", str(trial.speculative.k)]
    return argv


def _conversion_problems(trial: TrialConfig, facts) -> list[str]:
    """What keeps the exporter from writing this checkpoint (an architecture it does not convert, a Gemma 3
    variant llama.cpp's graph does not run), known from its config before anything loads."""
    from .gguf_export import ARCHITECTURES, conversion_problem

    if facts is None or facts.model_type is None:
        return []
    if facts.model_type not in ARCHITECTURES:
        return [f"{ENGINE_LABEL} converts the Llama and Gemma 3 architectures only (model_type {' or '.join(map(repr, ARCHITECTURES))}); "
                f"{trial.model.path} is {facts.model_type!r}: use engine=hf or engine=native for it"]
    if facts.config is None:
        return []
    why = conversion_problem(facts.config.to_dict())
    return [why] if why else []


@functools.lru_cache(maxsize=1)
def _import_problem() -> Optional[str]:
    """Why `import llama_cpp` fails here, or None. Importing loads libllama: a build for another CPU or a
    half-installed package fails here, before launch, instead of in every trial."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as e:  # ImportError, OSError from ctypes, RuntimeError from llama_cpp's loader
        first = str(e).strip().splitlines()
        return f"{type(e).__name__}: {first[0]}" if first else type(e).__name__
    return None


ENGINE = LlamaCppEngine()
