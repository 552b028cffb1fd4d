"""Token selection from logits: greedy, or seeded sampling with temperature / top-k / top-p."""
from __future__ import annotations

import torch

from .config import SamplingConfig


def is_greedy(spec: SamplingConfig) -> bool:
    return spec.temperature <= 0.0


def probabilities(logits: torch.Tensor, spec: SamplingConfig) -> torch.Tensor:
    """The distribution sampling draws from, after temperature, top-k and top-p. logits [..., V]."""
    logits = logits.float() / max(spec.temperature, 1e-8)
    if spec.top_k > 0:
        kth = torch.topk(logits, min(spec.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if spec.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token is always kept)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= spec.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, spec: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """logits [B, V] -> token ids [B]."""
    if is_greedy(spec):
        return logits.argmax(dim=-1)
    probs = probabilities(logits, spec)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
