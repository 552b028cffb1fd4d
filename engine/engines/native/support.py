"""Which models backend native can run, decided from a transformers config alone (no weights).

The one rule: loading applies it (model.py, backend.py; the self-speculative draft too) and pre-launch
validation applies it to a config.json (engine/validation.py), so a sweep refuses such a model before any
trial starts instead of recording a FAILED run per trial. Reasons are bare facts about the model; each
caller says what to do instead, which depends on how the native runtime came to be asked.
"""
from __future__ import annotations

from .rope import rope_problem

LLAMA_FAMILY = ("llama", "mistral", "qwen2")
GEMMA3 = ("gemma3_text",)  # Gemma 3's text decoder (Gemma3ForCausalLM)
FAMILIES = LLAMA_FAMILY + GEMMA3
LAYER_TYPES = ("sliding_attention", "full_attention")


def unsupported(config) -> str | None:
    """Why the native runtime cannot run a model with this config, or None when it can."""
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES:
        return f"it runs the Llama family ({', '.join(LLAMA_FAMILY)}) and Gemma 3 ({GEMMA3[0]}), not model_type {kind!r}"
    if kind in GEMMA3:
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            return f"it implements Gemma 3's gated GELU (tanh), not hidden_activation {act!r}"
        if getattr(config, "attn_logit_softcapping", None) is not None:
            # a tanh on the scores inside the softmax: no fused kernel (sdpa, flash) takes one
            return "attention logit softcapping (Gemma 2 style) is not supported"
        if getattr(config, "use_bidirectional_attention", False):
            return "bidirectional attention is not supported"
        bad = sorted(set(getattr(config, "layer_types", None) or ()) - set(LAYER_TYPES))
        if bad:
            return f"layer types {bad} are not supported (supported: {', '.join(LAYER_TYPES)})"
    else:
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            return f"it implements SwiGLU (silu), not hidden_act {act!r}"
    return rope_problem(config)


def layer_windows(config) -> tuple[int | None, ...]:
    """Per layer, the sliding window the native runtime applies (None: global attention). Gemma 3's
    `layer_types` alternate windowed and global layers; the Llama family's window is not implemented
    (see `unhonoured_window`), so its layers are all global here."""
    n = int(config.num_hidden_layers)
    if getattr(config, "model_type", None) not in GEMMA3:
        return (None,) * n
    window = getattr(config, "sliding_window", None)
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * n)
    return tuple(window if t == "sliding_attention" else None for t in types[:n])


def unhonoured_window(config) -> int | None:
    """The model's sliding window where the native runtime does not implement it (the Llama family: a
    context beyond it is refused); None where there is none or it is honoured (Gemma 3)."""
    if getattr(config, "model_type", None) in GEMMA3:
        return None
    # transformers already sets it to None where the config turns the window off (Qwen2's use_sliding_window)
    return getattr(config, "sliding_window", None)


sliding_window = unhonoured_window  # the name ModelArgs reads


def window_exceeded(window: int | None, num_tokens: int) -> str | None:
    """Why `num_tokens` positions cannot run natively under this (unhonoured) sliding window, or None."""
    if window is not None and num_tokens > window:
        return (f"{num_tokens} tokens exceed the model's sliding window of {window}, and the native runtime "
                "does not implement sliding-window attention for this architecture")
    return None
