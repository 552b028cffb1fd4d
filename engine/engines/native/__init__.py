"""Engine `native`: a compact Llama-family and Gemma 3 runtime (gpt-fast / nano-vllm style).

One concept per file:
  rope.py           rotary position embedding, incl. the checkpoint's rope scaling
  support.py        which models it can run, from their config alone (shared with validation)
  model.py          the decoder (RMSNorm, GQA attention block, SwiGLU), weights shared with the HF model
  attention.py      attention kernels: eager | sdpa | flash, with transient-memory accounting
  block_manager.py  pure-Python ref-counted block allocator (paged KV cache, later prefix caching)
  kv_cache.py       KV cache layouts: contiguous (static per sequence) and paged (block pool + block table)
  backend.py        NativeBackend / NativeSession: the logits-level Backend protocol on top of the above
  __init__.py       the engine's declaration (what it honours, its checks) and its serving session

Setup: nothing beyond `make setup`.
"""
from __future__ import annotations

from typing import Any

from ...config import TrialConfig
from ..base import Runs, ServingPlan
from ..base import Support
from ..hf import TORCH_SUPPORT, quant_kernel_checks
from ..logits import LogitsEngine, LogitsSession, torch_checks

# engine.compile_mode, how engine.compile=true compiles: dynamic = torch.compile(dynamic=True) of the whole forward;
# static = a static KV cache and a one-token step compiled with inductor freezing (compiled.py, gpt-fast style);
# static-autotune = static plus inductor max_autotune (its C++ GEMM templates; long compile);
# cpp = the one-token step in C++ (cpp_step.py: one call per token, no torch dispatch)
COMPILE_MODES = ("dynamic", "static", "static-autotune", "cpp")
# kv_cache.dtype: auto = model.dtype; bfloat16 = K/V stored in bf16 under any model dtype (half of fp32's bytes per
# cached token: the bytes a long-context decode step reads), the new keys and values rounded to bf16 on every path
KV_DTYPES = ("auto", "bfloat16")
# engine.prefill: default = torch's GEMMs (MKL / oneDNN: AMX where the CPU has it) over the prompt; cpp = the C++ step
# over the prompt's rows (cpp_step.py `prefill`; in serving, every step's chunks): no per-op dispatch, the row-tiled
# kernels -- ahead on short chunks and W8A8, behind torch's GEMMs on long fp32 / bf16 prompts (BENCHMARKS.md)
PREFILLS = ("default", "cpp")


class NativeEngine(LogitsEngine):
    name = "native"
    summary = "our Llama-family runtime: contiguous or paged KV cache, continuous batching, prefix caching"
    support = {
        **TORCH_SUPPORT,
        "engine.compile_mode": Support(COMPILE_MODES, "these are the ways our runtime's decode step is compiled"),
        "kv_cache.dtype": Support(KV_DTYPES, "our runtime stores K/V in model.dtype (auto) or bfloat16"),
        "engine.prefill": Support(PREFILLS, "our runtime prefills with torch's GEMMs (default) or its C++ step (cpp)"),
    }
    serves = True
    serving_usage = "engine=native kv_cache=paged"
    searches_capacity = True
    serves_conversations = True
    runs_self_draft = True  # over the HF model hf or native loaded (native shares its weights)

    def check(self, trial: TrialConfig, facts, gpu_available: bool):
        p = torch_checks(trial, gpu_available) + quant_kernel_checks(trial)
        if facts is not None and facts.config is not None and not trial.model.path.startswith("tiny://"):
            from .support import unhonoured_window, unsupported, window_exceeded

            why = unsupported(facts.config)
            if why is None:
                try:
                    why = window_exceeded(unhonoured_window(facts.config), _tokens_needed(trial))
                except Exception:  # invalid request lengths: validation reports them
                    why = None
            if why is not None:
                p.append(("engine.backend", f"native cannot run {trial.model.path}: {why}; use engine=hf"))
        if trial.workload.serving:
            p += _serving_checks(trial)
        if trial.engine.compile_mode != "dynamic":
            p += _static_step_checks(trial, facts)
        if trial.engine.prefill == "cpp" and not (trial.engine.compile and trial.engine.compile_mode == "cpp"):
            p.append(("engine.prefill", "engine.prefill=cpp runs the prompt through the C++ step: use engine=native-cpp "
                                        "(engine.compile=true engine.compile_mode=cpp)"))
        return p + _kv_dtype_checks(trial)

    def kv_element_bytes(self, trial: TrialConfig):
        from .backend import kv_dtype_of  # torch: the cost model asks at trial time, never at import

        return None if trial.kv_cache.dtype == "auto" else float(kv_dtype_of(trial.kv_cache.dtype, None).itemsize)

    def materializes_scores(self, trial: TrialConfig) -> bool:
        return trial.attention.impl == "eager"  # our eager kernel writes softmax(QK^T); sdpa / flash fuse it

    def load(self, trial: TrialConfig, say) -> Any:
        from ...models import load_model

        return load_model(trial.model, attention=trial.attention.impl, quant=trial.quant)

    def make_backend(self, loaded: Any, trial: TrialConfig):
        from .backend import NativeBackend

        return NativeBackend(loaded, trial)

    @property
    def session_class(self):
        return NativeTrialSession

    def self_draft_backend(self, loaded: Any, trial: TrialConfig, num_layers: int):
        """A native backend over the first `num_layers` blocks of `loaded` (weights shared with the target).
        The draft's cache follows the target's native layout (contiguous or paged); contiguous otherwise."""
        from ...config import EngineError, replace
        from .backend import NativeBackend
        from .support import unsupported

        why = unsupported(loaded.config)
        if why is not None:  # whatever the target's backend: the draft always runs natively
            raise EngineError(f"{DRAFT_RUNTIME}, which cannot run this model: {why}; {INSTEAD}")
        total = int(getattr(loaded.config, "num_hidden_layers", 0) or 0)
        if not 1 <= num_layers < total:
            raise EngineError(f"speculative.draft_layers must be in [1, {total}) for this {total}-layer model, got {num_layers}")
        mode = trial.kv_cache.mode
        kv = mode if (trial.engine.backend == self.name and mode in ("contiguous", "paged")) else "contiguous"
        draft = replace(replace(trial, "engine.backend", self.name), "kv_cache.mode", kv)
        return NativeBackend(loaded, draft, num_layers=num_layers,
                             instead=f"{DRAFT_RUNTIME}: {INSTEAD}, or a context within the window")

    def self_draft_problem(self, facts, num_tokens: int):
        """The native runtime's own rules (architecture, sliding window) for the self-draft's truncated model."""
        from .support import unhonoured_window, unsupported, window_exceeded

        if facts is None or facts.config is None:
            return None
        return unsupported(facts.config) or window_exceeded(unhonoured_window(facts.config), num_tokens)


# The self-draft's draft is a truncated native model, so a model the native runtime cannot run has no self-draft on
# either backend: switching the target to backend hf (what backend native's own error advises) fixes nothing.
DRAFT_RUNTIME = "speculative.method=self-draft runs its draft (the target's first layers) on the native runtime"
INSTEAD = "use speculative.method=draft or prompt-lookup with this model"


def _kv_dtype_checks(trial: TrialConfig):
    """Where a bf16 K/V cache under another model dtype has no path: the static compiled step (its graph reads the
    cache in the activations' dtype) and flash-attn (its kernel takes K/V in the queries' dtype)."""
    if trial.kv_cache.dtype == "auto" or trial.model.dtype == trial.kv_cache.dtype:
        return []
    why = []
    if trial.engine.compile and trial.engine.compile_mode in ("static", "static-autotune"):
        why.append(f"engine.compile_mode={trial.engine.compile_mode}'s compiled step reads K/V in model.dtype")
    if trial.attention.impl == "flash":
        why.append("flash-attn takes K/V in the queries' dtype")
    return [("kv_cache.dtype", f"kv_cache.dtype={trial.kv_cache.dtype} under model.dtype={trial.model.dtype}: {w}; "
                               f"use kv_cache.dtype=auto, or engine.compile_mode=cpp / attention=sdpa") for w in why]


def _tokens_needed(trial: TrialConfig) -> int:
    w = trial.workload
    if w.serving:
        from ...serving.requests import max_request_tokens

        return max_request_tokens(w)
    return w.context_len + w.max_new_tokens


def _static_step_checks(trial: TrialConfig, facts):
    """What the static compiled decode step (compiled.py) or the C++ step (cpp_step.py) needs."""
    from .compiled import STATIC_FAMILY

    mode, p = trial.engine.compile_mode, []
    kind = getattr(getattr(facts, "config", None), "model_type", None)
    if mode == "cpp":
        from .cpp_step import problems

        p += problems(trial, kind)
    if not trial.engine.compile:
        p.append(("engine.compile_mode", f"{mode} is how the decode step is compiled: set engine.compile=true "
                                         "(or leave compile_mode=dynamic)"))
    if trial.kv_cache.mode != "contiguous" and not (mode == "cpp" and trial.kv_cache.mode == "paged"):
        p.append(("kv_cache.mode", f"engine.compile_mode={mode} preallocates a static contiguous cache: use kv_cache=contiguous"
                                   + (" (or paged)" if mode == "cpp" else "")))
    if trial.attention.impl not in ("eager", "sdpa"):
        p.append(("attention.impl", f"engine.compile_mode={mode} runs attention eager or sdpa"))
    if kind is not None and kind not in STATIC_FAMILY and mode != "cpp":
        p.append(("engine.compile_mode", f"{mode} drives the Llama-family block ({', '.join(STATIC_FAMILY)}), "
                                         f"not model_type {kind!r}; use compile_mode=dynamic"))
    return p


def _serving_checks(trial: TrialConfig):
    """What our scheduler (engine/serving/) needs of a serving trial."""
    from ...serving.requests import max_prompt_tokens, max_request_tokens

    p = []
    b = trial.batching
    if trial.kv_cache.mode != "paged":
        p.append(("kv_cache.mode", "serving workloads need kv_cache=paged: the scheduler admits requests by free KV blocks"))
    if trial.attention.impl == "flash":
        p.append(("attention.impl", "flash has no varlen (continuous batching) path yet; use sdpa or eager"))
    if trial.engine.compile and trial.engine.compile_mode != "cpp":
        p.append(("engine.compile", "torch.compile is not supported with serving workloads (shapes change every step); "
                                    "engine.compile_mode=cpp decodes them in C++"))
    if trial.speculative.enabled:
        p.append(("speculative.method", "speculative decoding is not implemented for serving workloads"))
    if b.mode == "continuous" and not b.chunked_prefill:
        try:
            total, prompt = max_request_tokens(trial.workload), max_prompt_tokens(trial.workload)
        except Exception:  # request lengths are invalid: validation reports them
            return p
        # a preempted request is re-prefilled with its generated tokens in one step
        need = total - 1 if trial.kv_cache.num_blocks else prompt
        if b.max_batch_tokens < need:
            p.append(("batching.max_batch_tokens", f"must be >= {need} (the longest {'prompt + output - 1' if trial.kv_cache.num_blocks else 'prompt'}) "
                                                   f"unless batching.chunked_prefill=true, got {b.max_batch_tokens}"))
    return p


class NativeTrialSession(LogitsSession):
    """The logits adapter plus serving: requests scheduled over a paged KV pool (engine/serving/)."""

    def run_serving(self, plan: ServingPlan, say) -> Runs:
        from ...measure.memory import PeakMemory
        from .serving.serve import ServingSetup

        setup = ServingSetup(self.trial, self.backend)
        for i in range(plan.warmup):
            say(f"warm-up {i + 1}/{plan.warmup}")
            setup.run(plan.warmup_requests)
        self.reset_peaks()
        traces = []
        with PeakMemory(self.device) as mem:
            for i in range(plan.repeats):
                say(f"serving run {i + 1}/{plan.repeats}: {len(plan.requests)} requests, "
                    f"{self.trial.batching.mode} batching")
                traces.append(setup.run(plan.requests, plan.follow_up, plan.max_concurrency))
        return Runs(traces, [t.scheduler_metrics() for t in traces], mem.peak_bytes)

    def reset_peaks(self) -> None:
        self.backend.kernel.reset_peak()

    def metrics(self) -> dict[str, float]:
        return dict(super().metrics(), **self.backend.extra_metrics())

    def info(self) -> dict[str, str]:
        return dict(super().info(), **self.backend.extra_info())


ENGINE = NativeEngine()
