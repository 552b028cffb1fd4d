"""Accuracy of a (possibly optimized) model: teacher-forced perplexity over the evaluation text."""
from __future__ import annotations

import math

import torch

from .backends.base import Backend


def window_nll(backend: Backend, window: torch.Tensor) -> tuple[float, int]:
    """Sum of next-token NLL over one window [T] and the number of predicted tokens (T-1)."""
    logits = backend.score(window[None])[0, :-1]  # [T-1, V]
    logp = torch.log_softmax(logits.float(), dim=-1)
    nll = -logp.gather(-1, window[1:, None]).squeeze(-1)
    return float(nll.sum()), int(nll.numel())


def perplexity(backend: Backend, windows: torch.Tensor) -> dict[str, float]:
    """windows [W, T] -> {'ppl', 'nll_mean'}; windows are scored one at a time to bound memory."""
    total, count = 0.0, 0
    for w in windows:
        s, n = window_nll(backend, w)
        total += s
        count += n
    nll = total / count
    return {"ppl": math.exp(nll), "nll_mean": nll}
