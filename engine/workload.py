"""Workloads turn a text into token-exact prompts."""
from __future__ import annotations

import functools

import torch

from .config import EngineError, TextSource
from .text import load_text
from .tokenizer import Tokenizer


@functools.lru_cache(maxsize=8)
def _token_ids(tokenizer: Tokenizer, src: TextSource) -> tuple[int, ...]:
    return tuple(tokenizer.encode(load_text(src)))


def corpus_ids(tokenizer: Tokenizer, src: TextSource) -> torch.Tensor:
    ids = _token_ids(tokenizer, src)
    if len(ids) < 2:
        raise EngineError(f"text source {src} is empty after tokenization")
    return torch.tensor(ids, dtype=torch.long)


def windows(ids: torch.Tensor, length: int, count: int) -> torch.Tensor:
    """`count` consecutive non-overlapping windows of exactly `length` tokens: [count, length].
    A text shorter than needed is repeated, so any length is served (and said so by the caller)."""
    need = length * count
    if ids.numel() < need:
        ids = ids.repeat(need // ids.numel() + 1)
    return ids[:need].view(count, length).clone()


def static_batch_prompts(tokenizer: Tokenizer, src: TextSource, context_len: int, batch_size: int) -> torch.Tensor:
    """`batch_size` different prompts of exactly `context_len` tokens: [B, context_len]."""
    return windows(corpus_ids(tokenizer, src), context_len, batch_size)
