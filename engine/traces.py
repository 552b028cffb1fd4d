"""The types every layer hands around, in one leaf module (it imports no other module of the package at run
time): `DecodeSession`, the protocol the decode loops drive (engine/generate.py, engine/speculative/) and the
logits-level engines implement (engine/engines/logits.py), and the traces a run leaves for measurement
(engine/measure/metrics.py): `GenerationTrace` for a static batch, `ServedRun` for a serving run.

Being a leaf, it is what breaks the cycle the decode loops, the metrics and the engines would otherwise form
through one another's modules. Shapes: B = batch, T = new tokens in this call, V = vocabulary, N = generated.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, Union

import torch

if TYPE_CHECKING:  # a type only: the serving package's record of one finished request
    from .serving.requests import RequestRecord


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

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """`forward` for a prompt whose next token is all the caller needs: each row's last logits [B, V] (native and
        llama.cpp never keep a long prompt's [B, T, V]: Gemma 3's 262k vocabulary at 16k tokens is 17 GB)."""
        ...

    def kv_cache_bytes(self) -> tuple[int, int]:
        """(allocated, used) bytes of the KV cache; (0, 0) when caching is off."""
        ...


@dataclass
class GenerationTrace:
    tokens: torch.Tensor  # [B, N] generated ids
    token_times_s: list[float]  # [N] seconds since the request arrived when each step's token was ready
    prefill_s: float
    prompt_len: int
    batch_size: int
    kv_cache_allocated: int = 0
    kv_cache_used: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def e2e_s(self) -> float:
        return self.token_times_s[-1]

    @property
    def decode_s(self) -> float:
        return self.token_times_s[-1] - self.token_times_s[0]


class ServedRun(Protocol):
    """One serving run as every engine that serves reports it (native's `ServingTrace`, vLLM's `RequestTrace`):
    the finished requests, by request id, and the run's duration (start -> last token)."""

    @property
    def requests(self) -> tuple[RequestRecord, ...]: ...

    @property
    def duration_s(self) -> float: ...


Trace = Union[GenerationTrace, ServedRun]  # what `Runs.traces` holds, one per timed repeat
