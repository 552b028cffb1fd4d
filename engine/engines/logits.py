"""The interface every backend implements. The generation loop, workloads and fidelity evaluation are
written once against it, so a backend only has to turn token ids into logits.

Shapes: B = batch, T = new tokens in this call, V = vocabulary.
"""
from __future__ import annotations

from typing import Protocol

import torch


class DecodeSession(Protocol):
    """One batch of sequences being generated, owning its KV cache (if any)."""

    @property
    def length(self) -> int:
        """Tokens currently held per sequence (prompt + generated)."""
        ...

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append tokens [B, T] to every sequence and return their logits [B, T, V] (float32)."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` positions (rejected speculative tokens)."""
        ...

    def kv_cache_bytes(self) -> tuple[int, int]:
        """(allocated, used) bytes of the KV cache; (0, 0) when caching is off."""
        ...


class Backend(Protocol):
    name: str

    def new_session(self, batch_size: int, max_len: int) -> DecodeSession:
        """A fresh session able to hold `max_len` tokens per sequence."""
        ...

    def score(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits [B, T, V] for input_ids [B, T] (no cache kept)."""
        ...

    def weights_bytes(self) -> int: ...
