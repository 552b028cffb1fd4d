"""The decode loop, written once against `DecodeSession`: a stream that yields each step's tokens with
the time they became available, and `generate`, which collects the stream into a `GenerationTrace`.

Every request in a static batch arrives at t=0, so time to first token is the prefill (plus sampling).
Generation runs exactly `max_new_tokens` steps (EOS is not a stop, as in vLLM's benchmarks), so every
configuration does the same work and throughput compares like with like.
"""
from __future__ import annotations

import time
from typing import Callable, Iterator

import torch

from .config import SamplingConfig
from .sampling import sample
from .traces import DecodeSession, GenerationTrace  # noqa: F401 (GenerationTrace: what `generate` returns)


def device_synchronizer(device: torch.device) -> Callable[[], None]:
    """Clocks are read only after the device finished its queued work."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def stream(
    session: DecodeSession,
    prompt: torch.Tensor,
    max_new_tokens: int,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    sync: Callable[[], None],
) -> Iterator[tuple[torch.Tensor, float]]:
    """Yield (tokens [B], seconds since start) for each of `max_new_tokens` steps. prompt: [B, T]."""
    t0 = time.perf_counter()
    logits = session.prefill(prompt)  # [B, V]
    for step in range(max_new_tokens):
        nxt = sample(logits, sampling, generator)
        sync()
        yield nxt, time.perf_counter() - t0
        if step + 1 < max_new_tokens:
            logits = session.forward(nxt[:, None])[:, -1]  # decode: [B, V]


def generate(
    session: DecodeSession,
    prompt: torch.Tensor,
    max_new_tokens: int,
    sampling: SamplingConfig,
    seed: int,
    sync: Callable[[], None],
) -> GenerationTrace:
    assert max_new_tokens >= 1
    gen = torch.Generator(device=prompt.device).manual_seed(seed)
    toks, times = [], []
    for nxt, t in stream(session, prompt, max_new_tokens, sampling, gen, sync):
        toks.append(nxt)
        times.append(t)
    allocated, used = session.kv_cache_bytes()
    return GenerationTrace(
        tokens=torch.stack(toks, dim=1),
        token_times_s=times,
        prefill_s=times[0],
        prompt_len=int(prompt.shape[1]),
        batch_size=int(prompt.shape[0]),
        kv_cache_allocated=allocated,
        kv_cache_used=used,
    )
