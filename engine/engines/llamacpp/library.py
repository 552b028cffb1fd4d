"""llama-cpp-python, loaded once per process, its log routed to `logging` (the engine's runtime library)."""
from __future__ import annotations

import ctypes
import logging
from typing import Any

from ...config import EngineError

log = logging.getLogger(__name__)
LABEL = "engine=llamacpp"

_LIB: Any = None
_LOG_CALLBACK: Any = None  # referenced here so ctypes never frees it while llama.cpp may call it
_last_problem: list[str] = []  # llama.cpp's latest warning/error line: it says why a call failed


def lib():
    """The llama_cpp module, its backend initialized once per process, its log routed to `logging`."""
    global _LIB, _LOG_CALLBACK
    if _LIB is None:
        try:
            import llama_cpp
        except ImportError as e:
            raise EngineError(f"{LABEL} needs llama-cpp-python: run `make setup-llamacpp` ({e})") from e

        @llama_cpp.llama_log_callback
        def on_log(level: int, text: bytes, user_data) -> None:
            if level in (2, 3):  # GGML_LOG_LEVEL_WARN, _ERROR; info and debug lines are per-tensor noise
                line = text.decode("utf-8", "replace").rstrip()
                _last_problem[:] = [line]
                log.debug("llama.cpp: %s", line)

        llama_cpp.llama_log_set(on_log, ctypes.c_void_p(0))
        _LOG_CALLBACK = on_log
        llama_cpp.llama_backend_init()
        _LIB = llama_cpp
    return _LIB


def last_problem() -> str:
    """llama.cpp's own words for the latest failure ('' if it said nothing)."""
    return f": llama.cpp said {_last_problem[0]!r}" if _last_problem else ""


def loaded_library() -> Any:
    """The module if `lib()` loaded it in this process, else None (finalizers must not load it)."""
    return _LIB
