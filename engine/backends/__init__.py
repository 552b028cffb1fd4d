"""Backend registry: `make_backend(loaded, opt)` picks the implementation named by `opt.backend`."""
from __future__ import annotations

from ..config import EngineError, OptimizationSpec
from ..models import LoadedModel
from .base import Backend, DecodeSession


def make_backend(loaded: LoadedModel, opt: OptimizationSpec) -> Backend:
    if opt.backend == "hf":
        from .hf import HFBackend

        return HFBackend(loaded, opt)
    if opt.backend == "native":
        try:
            from ..native.backend import NativeBackend
        except ImportError as e:  # pragma: no cover - until the native engine lands
            raise EngineError(f"backend native is not available: {e}") from e
        return NativeBackend(loaded, opt)
    if opt.backend == "vllm":
        raise EngineError("backend vllm runs whole trials in its own interpreter (engine.backends.vllm_runner), "
                          "not as a model backend of this process")
    raise EngineError(f"unknown backend {opt.backend!r}; choose hf, native or vllm")


__all__ = ["Backend", "DecodeSession", "make_backend"]
