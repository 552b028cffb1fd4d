"""Backend registry: `make_backend(loaded, opt)` picks the implementation named by `opt.backend`."""
from __future__ import annotations

from ..config import EngineError, OptimizationSpec
from ..models import LoadedModel
from .base import Backend, DecodeSession


def make_backend(loaded: LoadedModel, opt: OptimizationSpec, threads: int = 0, batch_tokens: int = 2048) -> Backend:
    """`threads` and `batch_tokens` (tokens per forward call) are engine=llamacpp's; the torch backends take
    their threads from torch and run every call in one forward."""
    if opt.backend == "llamacpp":
        from .llamacpp import LlamaCppBackend

        return LlamaCppBackend(loaded, opt, threads=threads, batch_tokens=batch_tokens)
    if opt.backend == "hf":
        from .hf import HFBackend

        return HFBackend(loaded, opt)
    if opt.backend == "native":
        try:
            from ..native.backend import NativeBackend
        except ImportError as e:  # pragma: no cover - until the native engine lands
            raise EngineError(f"backend native is not available: {e}") from e
        return NativeBackend(loaded, opt)
    raise EngineError(f"unknown backend {opt.backend!r}; choose hf, native or llamacpp")


__all__ = ["Backend", "DecodeSession", "make_backend"]
