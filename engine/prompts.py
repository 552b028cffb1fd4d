"""Workloads turn a text into token-exact prompts."""
from __future__ import annotations

import functools

import torch

from .config import PROMPT_STYLES, EngineError, TextConfig, WorkloadConfig
from .text import load_text
from .tokenizer import Tokenizer


@functools.lru_cache(maxsize=8)
def _token_ids(tokenizer: Tokenizer, src: TextConfig) -> torch.Tensor:
    return torch.tensor(tokenizer.encode(load_text(src)), dtype=torch.long)


def corpus_ids(tokenizer: Tokenizer, src: TextConfig) -> torch.Tensor:
    """The text's token ids [N]: a copy of the cached tensor (a copy costs ~1 ms; building the tensor from
    Python ints again, ~40 ms for the default text, was paid twice per trial)."""
    ids = _token_ids(tokenizer, src)
    if ids.numel() < 2:
        raise EngineError(f"text source {src} is empty after tokenization")
    return ids.clone()


def windows(ids: torch.Tensor, length: int, count: int) -> torch.Tensor:
    """`count` consecutive non-overlapping windows of exactly `length` tokens: [count, length].
    A text shorter than needed is repeated, so any length is served (and said so by the caller)."""
    need = length * count
    if ids.numel() < need:
        ids = ids.repeat(need // ids.numel() + 1)
    return ids[:need].view(count, length).clone()


def static_batch_prompts(tokenizer: Tokenizer, src: TextConfig, context_len: int, batch_size: int) -> torch.Tensor:
    """`batch_size` different prompts of exactly `context_len` tokens: [B, context_len]."""
    return windows(corpus_ids(tokenizer, src), context_len, batch_size)


# prompt_style=repeat: the passage, then a cue and the passage's first PRIMER tokens, so the prompt ends
# inside the copy. A 135M model does not follow "repeat this" on its own, but continues a copy it has begun
# (induction); the output then quotes its context, as summaries, edits and code rewrites do.
REPEAT_INSTRUCTION = "Repeat the following text exactly.\n\nText:\n"
REPEAT_CUE = "\n\nThe same text, repeated exactly:\n"
REPEAT_PRIMER = 8


def repeat_min_context(tokenizer: Tokenizer) -> int:
    """The shortest context a repeat prompt fits in: instruction + cue + a passage of at least the primer."""
    return len(tokenizer.encode(REPEAT_INSTRUCTION)) + len(tokenizer.encode(REPEAT_CUE)) + 2 * REPEAT_PRIMER


def repeat_prompts(tokenizer: Tokenizer, src: TextConfig, context_len: int, batch_size: int) -> torch.Tensor:
    """[B, context_len]: instruction + passage + cue + the passage's first REPEAT_PRIMER tokens, with the
    passage (a window of the text, a different one per sequence) sized so the whole is context_len tokens."""
    if context_len < (need := repeat_min_context(tokenizer)):
        raise EngineError(f"workload.prompt_style=repeat needs context_len >= {need} for this tokenizer, got {context_len}")
    head, cue = tokenizer.encode(REPEAT_INSTRUCTION), tokenizer.encode(REPEAT_CUE)
    n = context_len - len(head) - len(cue) - REPEAT_PRIMER
    passages = windows(corpus_ids(tokenizer, src), n, batch_size)  # [B, n]
    b = passages.shape[0]
    parts = [torch.tensor(head).expand(b, -1), passages, torch.tensor(cue).expand(b, -1), passages[:, :REPEAT_PRIMER]]
    out = torch.cat(parts, dim=1)
    assert out.shape == (b, context_len), out.shape
    return out


def workload_prompts(tokenizer: Tokenizer, wl: WorkloadConfig) -> torch.Tensor:
    """The static batch's prompts [batch_size, context_len] in the workload's prompt style."""
    if wl.prompt_style == "window":
        return static_batch_prompts(tokenizer, wl.text, wl.context_len, wl.batch_size)
    if wl.prompt_style == "repeat":
        return repeat_prompts(tokenizer, wl.text, wl.context_len, wl.batch_size)
    raise EngineError(f"workload.prompt_style {wl.prompt_style!r} unknown; choose one of {', '.join(PROMPT_STYLES)}")
