"""Engine `hf`: the transformers model's own forward (backend.py), driven by our decode loop so every
token is timed. The reference engine: fidelity metrics compare against an fp32 sdpa run of it.

Setup: nothing beyond `make setup`.
"""
from __future__ import annotations

from typing import Any

from ...config import QUANT_LEVELS, TrialConfig
from ..base import Problems, Support
from ..logits import LogitsEngine, torch_checks

TORCH_QUANT = QUANT_LEVELS  # engine/quant.py's levels
# quant.kernel, the matmul of engine/quant.py's weight-only levels (the modules' KERNELS say which level runs which):
# dequant = cast the int8 weight to the activation dtype per call, then a float GEMM;
# int8pack = torch._weight_int8pack_mm (gpt-fast's op; CPU/MPS only; unvectorized in some CPU builds);
# gemv = our fused dequantize-GEMV (engine/quant_kernels.py) for decode-sized batches, dequant+GEMM above;
# auto = per weight shape the fastest of the kernels the level has, timed once per machine (engine/quant.py);
# gemv-all = gemv, and our dense fp32/bf16 GEMV for the linears the level leaves in full precision (level none: all);
# gemv-q8 (int4-weight) = INT4 x INT8: the activation quantized per block of 32 (llama.cpp's Q4_0 x Q8_0)
TORCH_KERNELS = ("dequant", "int8pack", "gemv", "auto", "gemv-all", "gemv-q8")


def own_kernels(engine: str) -> Support:
    """quant.kernel on an engine that runs its own kernels (llama.cpp, vLLM): every torch kernel runs as the same
    trial there, so each folds to the default (one config hash) instead of being silently ignored."""
    return Support(("dequant",), f"{engine} runs its own kernels; quant.kernel picks engine/quant.py's torch matmuls",
                   aliases={k: "dequant" for k in TORCH_KERNELS if k != "dequant"})
# shared by the engines that run torch kernels in this process (hf, native)
TORCH_SUPPORT = {
    "quant.level": Support(TORCH_QUANT, "gguf-* levels are GGUF weight types written by llama.cpp (engine=llamacpp)"),
    "quant.kernel": Support(TORCH_KERNELS, "quant.kernel picks the matmul of engine/quant.py's levels"),
    "kv_cache.dtype": Support(("auto",), "K/V stay in model.dtype on engine=hf (engine=native also stores them in bfloat16)"),
}


def quant_kernel_checks(trial: TrialConfig) -> Problems:
    """quant.kernel x quant.level on the engines that run engine/quant.py's modules (hf, native): which level runs
    which kernel (engine/quant.py `kernel_problems`). An unknown kernel is the support table's to refuse."""
    q = trial.quant
    if q.kernel not in TORCH_KERNELS:
        return []
    from ...quant import kernel_problems

    return [("quant.kernel", why) for why in kernel_problems(q.level, q.kernel)]


class HFEngine(LogitsEngine):
    name = "hf"
    summary = "transformers' own forward (eager / sdpa / flash_attention_2), DynamicCache or no cache"
    support = {
        "kv_cache.mode": Support(("off", "contiguous"), "transformers' DynamicCache is contiguous; paged is engine=native's"),
        "batching.mode": Support(("static",), "engine=hf runs one static batch; continuous batching is engine=native's"),
        "engine.compile_mode": Support(("dynamic",), "the static compiled decode step (compile_mode=static*) is engine=native's"),
        "engine.prefill": Support(("default",), "the C++ prefill (engine.prefill=cpp) is engine=native's C++ step's"),
        **TORCH_SUPPORT,
    }

    def check(self, trial: TrialConfig, facts, gpu_available: bool):
        return torch_checks(trial, gpu_available) + quant_kernel_checks(trial)

    def materializes_scores(self, trial: TrialConfig) -> bool:
        return trial.attention.impl == "eager"  # torch's eager path writes softmax(QK^T); sdpa / flash fuse it

    def load(self, trial: TrialConfig, say) -> Any:
        from ...models import load_model

        return load_model(trial.model, attention=trial.attention.impl, quant=trial.quant)

    def make_backend(self, loaded: Any, trial: TrialConfig):
        from .backend import HFBackend

        return HFBackend(loaded, trial)

    def reference(self, trial: TrialConfig, loaded: Any):
        """The unoptimized reference of `trial`'s model: float32, sdpa, no quantization, on this engine.
        Reuses `loaded` when it is an HF model in the reference configuration (hf or native at fp32, sdpa,
        unquantized: native shares the HF model's weights)."""
        import dataclasses

        from ...models import LoadedModel, load_model
        from .backend import HFBackend

        ref = TrialConfig(model=dataclasses.replace(trial.model, dtype="float32"))  # defaults: hf, sdpa, no quant
        if (isinstance(loaded, LoadedModel) and trial.model.dtype == "float32"
                and loaded.quant.level == "none" and trial.attention.impl == "sdpa"):
            return HFBackend(loaded, ref)
        device = str(loaded.device) if loaded is not None and hasattr(loaded, "device") else "cpu"
        return HFBackend(load_model(ref.model, attention="sdpa", device=device), ref)


ENGINE = HFEngine()
