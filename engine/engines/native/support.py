"""Which models backend native can run, decided from a transformers config alone (no weights).

The one rule: loading applies it (model.py, backend.py; the self-speculative draft too) and pre-launch
validation applies it to a config.json (engine/validation.py), so a sweep refuses such a model before any
trial starts instead of recording a FAILED run per trial. Reasons are bare facts about the model; each
caller says what to do instead, which depends on how the native runtime came to be asked.
"""
from __future__ import annotations

from .rope import rope_problem

LLAMA_FAMILY = ("llama", "mistral", "qwen2")


def unsupported(config) -> str | None:
    """Why the native runtime cannot run a model with this config, or None when it can."""
    kind = getattr(config, "model_type", None)
    if kind not in LLAMA_FAMILY:
        return f"it runs the Llama family ({', '.join(LLAMA_FAMILY)}), not model_type {kind!r}"
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        return f"it implements SwiGLU (silu), not hidden_act {act!r}"
    return rope_problem(config)


def sliding_window(config) -> int | None:
    # transformers already sets it to None where the config turns the window off (Qwen2's use_sliding_window)
    return getattr(config, "sliding_window", None)


def window_exceeded(window: int | None, num_tokens: int) -> str | None:
    """Why `num_tokens` positions cannot run natively under this sliding window, or None."""
    if window is not None and num_tokens > window:
        return (f"{num_tokens} tokens exceed the model's sliding window of {window}, and the native runtime "
                "does not implement sliding-window attention")
    return None
