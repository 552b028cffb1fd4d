"""The Drafter protocol, and SessionDrafter: any DecodeSession run ahead of the target.

A drafter is the one owner of its own state (its KV cache and what that cache holds). It is told the
committed context at every step and brings itself in line: it keeps the longest prefix of what it holds
that still agrees with the context, rolls the rest back (its rejected drafts) and feeds the new tokens.
So the decode loop never has to know how many of a drafter's tokens were rejected.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from ..config import SamplingConfig
from ..sampling import is_greedy, probabilities


@dataclass(frozen=True)
class Proposal:
    tokens: torch.Tensor  # [k'] drafted ids, k' <= k (0 when the drafter has nothing to offer)
    probs: Optional[torch.Tensor] = None  # [k', V] the distribution each token was sampled from; None = deterministic

    @staticmethod
    def empty(device) -> "Proposal":
        return Proposal(torch.empty(0, dtype=torch.long, device=device))


class Drafter(Protocol):
    def prefill(self, prompt: list[int]) -> None:
        """Take in the prompt (called once, after the target's prefill)."""
        ...

    def propose(self, context: list[int], k: int, sampling: SamplingConfig,
                generator: Optional[torch.Generator]) -> Proposal:
        """Up to `k` tokens that may follow `context` (every committed token: prompt + generated)."""
        ...

    def kv_cache_bytes(self) -> tuple[int, int]:
        """(allocated, used) bytes of the drafter's own KV cache."""
        ...


class SessionDrafter:
    """Drafts by running a DecodeSession autoregressively: greedy when the trial is greedy, otherwise
    sampling from (and returning) `probabilities(logits, sampling)`, the same transform the target uses."""

    def __init__(self, session, device: torch.device):
        self.session = session
        self.device = device
        self._held: list[int] = []  # the tokens in the session's cache, in order (session.length of them)
        self._agreed = 0  # a prefix of `_held` known to equal the committed context (which only grows)

    def prefill(self, prompt: list[int]) -> None:
        self._feed(prompt)
        self._agreed = len(prompt)

    def _feed(self, tokens: list[int]) -> torch.Tensor:
        """Append tokens; logits [V] of the last one."""
        self._held += tokens
        logits = self.session.forward(torch.tensor([tokens], dtype=torch.long, device=self.device))  # [1, T, V]
        assert self.session.length == len(self._held), (self.session.length, len(self._held))
        return logits[0, -1]

    def _sync(self, context: list[int]) -> torch.Tensor:
        """Roll back what disagrees with `context`, feed the rest; logits [V] after context's last token.
        At least the last context token is always fed, so its logits are fresh."""
        n, limit = self._agreed, min(len(self._held), len(context) - 1)
        while n < limit and self._held[n] == context[n]:
            n += 1
        self.session.rollback(len(self._held) - n)
        del self._held[n:]
        self._agreed = n
        return self._feed(context[n:])

    def propose(self, context, k, sampling, generator) -> Proposal:
        logits = self._sync(context)
        greedy = is_greedy(sampling)
        toks: list[int] = []
        qs: list[torch.Tensor] = []
        for i in range(k):
            if greedy:
                tok = int(logits.argmax())
            else:
                q = probabilities(logits, sampling)  # [V]
                tok = int(torch.multinomial(q, 1, generator=generator))
                qs.append(q)
            toks.append(tok)
            if i + 1 < k:
                logits = self._feed([tok])
        tokens = torch.tensor(toks, dtype=torch.long, device=self.device)
        return Proposal(tokens, torch.stack(qs) if qs else None)

    def kv_cache_bytes(self) -> tuple[int, int]:
        return self.session.kv_cache_bytes()
