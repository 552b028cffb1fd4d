"""Engine `hf`: the transformers model's own forward (backend.py), driven by our decode loop so every
token is timed. The reference engine: fidelity metrics compare against an fp32 sdpa run of it.

Setup: nothing beyond `make setup`.
"""
from __future__ import annotations

from typing import Any

from ...config import QUANT_LEVELS, TrialConfig
from ..base import Support
from ..logits import LogitsEngine, torch_checks

TORCH_QUANT = QUANT_LEVELS  # engine/quant.py's levels
# shared by the engines that run torch kernels in this process (hf, native)
TORCH_SUPPORT = {
    "quant.level": Support(TORCH_QUANT, "gguf-* levels are GGUF weight types written by llama.cpp (engine=llamacpp)"),
    "kv_cache.dtype": Support(("auto",), "K/V stay in model.dtype on the torch engines"),
}


class HFEngine(LogitsEngine):
    name = "hf"
    summary = "transformers' own forward (eager / sdpa / flash_attention_2), DynamicCache or no cache"
    support = {
        "kv_cache.mode": Support(("off", "contiguous"), "transformers' DynamicCache is contiguous; paged is engine=native's"),
        "batching.mode": Support(("static",), "engine=hf runs one static batch; continuous batching is engine=native's"),
        "engine.compile_mode": Support(("dynamic",), "the static compiled decode step (compile_mode=static*) is engine=native's"),
        **TORCH_SUPPORT,
    }

    def check(self, trial: TrialConfig, facts, gpu_available: bool):
        return torch_checks(trial, gpu_available)

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
