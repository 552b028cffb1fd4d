"""The accept/reject rule of speculative decoding, as one pure function over one target forward.

The target has scored the committed last token followed by the k drafted tokens d_1..d_k, giving k+1
next-token distributions p_1..p_{k+1}. Greedy: d_i is accepted while it is the target's argmax, and the
target's argmax at the first mismatch (or after d_k) is appended -- exactly the tokens greedy decoding
would produce. Sampling (Leviathan et al. 2023; Chen et al. 2023): accept d_i with probability
min(1, p_i(d_i) / q_i(d_i)); at the first rejection sample from norm(max(0, p_i - q_i)); if all are
accepted sample a bonus token from p_{k+1}. Every emitted token is then distributed exactly as sampling
the target alone would. A deterministic drafter (a copy) has a one-hot q: accept with probability
p_i(d_i), on rejection sample p_i with d_i removed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..config import SamplingConfig
from ..sampling import is_greedy, probabilities


@dataclass(frozen=True)
class Verdict:
    accepted: int  # how many drafted tokens were accepted (0..k)
    tokens: torch.Tensor  # [accepted + 1] the accepted drafts followed by one token of the target's own


def _leading_true(mask: torch.Tensor) -> int:
    """Length of the all-True prefix of a bool vector [k]."""
    return int(torch.cumprod(mask.to(torch.int32), dim=0).sum()) if mask.numel() else 0


def verify(
    draft_tokens: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    target_logits: torch.Tensor,
    sampling: SamplingConfig,
    generator: Optional[torch.Generator],
) -> Verdict:
    """draft_tokens [k]; draft_probs [k, V] or None (deterministic drafter); target_logits [k+1, V]."""
    k = int(draft_tokens.shape[0])
    assert target_logits.shape[0] == k + 1, (target_logits.shape, k)
    if is_greedy(sampling):
        best = target_logits.argmax(dim=-1)  # [k+1]
        n = _leading_true(draft_tokens == best[:k])
        return Verdict(n, best[: n + 1])
    p = probabilities(target_logits, sampling)  # [k+1, V]
    rows = torch.arange(k, device=p.device)
    p_d = p[rows, draft_tokens]  # [k] target probability of each drafted token
    q_d = draft_probs[rows, draft_tokens] if draft_probs is not None else torch.ones_like(p_d)
    u = torch.rand(k, generator=generator, device=p.device)
    n = _leading_true(u * q_d < p_d)  # u < p/q without dividing by q
    if n < k:
        if draft_probs is not None:
            residual = (p[n] - draft_probs[n]).clamp_(min=0.0)
        else:
            residual = p[n].clone()
            residual[draft_tokens[n]] = 0.0
        if not float(residual.sum()) > 0.0:  # p == q up to rounding: rejection had probability ~0
            residual = p[n]
        last = torch.multinomial(residual, 1, generator=generator)
    else:
        last = torch.multinomial(p[k], 1, generator=generator)
    return Verdict(n, torch.cat([draft_tokens[:n], last]))
