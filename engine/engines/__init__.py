"""Backend registry: `make_backend(loaded, trial)` picks the implementation named by `engine.backend`."""
from __future__ import annotations

from ..config import EngineError, TrialConfig
from ..models import LoadedModel
from .base import Backend, DecodeSession


def make_backend(loaded: LoadedModel, trial: TrialConfig) -> Backend:
    name = trial.engine.backend
    if name == "llamacpp":
        from .llamacpp import LlamaCppBackend

        return LlamaCppBackend(loaded, trial)
    if name == "hf":
        from .hf import HFBackend

        return HFBackend(loaded, trial)
    if name == "native":
        from ..native.backend import NativeBackend

        return NativeBackend(loaded, trial)
    if name == "vllm":
        raise EngineError("engine.backend=vllm runs whole trials in its own interpreter (engine.backends.vllm_runner), "
                          "not as a model backend of this process")
    raise EngineError(f"engine.backend: unknown backend {name!r}; choose hf, native, llamacpp or vllm")


__all__ = ["Backend", "DecodeSession", "make_backend"]
