"""`prompt-lookup`: draft the tokens that followed an earlier occurrence of the context's last n-gram.

No model: the proposal is a copy from the context (prompt lookup decoding, Saxena 2023; vLLM's `ngram`
speculator, transformers' `prompt_lookup_num_tokens`). It pays off when the output repeats its input --
summaries quoting the source, edits of a given text, code completions -- and drafts nothing otherwise.
The n-gram is matched longest first (`ngram_max` down to `ngram_min`), and among the occurrences of one
n-gram the most recent wins. A copy is deterministic, so its q is one-hot (Proposal.probs = None).
"""
from __future__ import annotations

import torch

from .drafter import Proposal


def lookup(context: list[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Up to k tokens following the latest earlier occurrence of context's last n-gram; [] if none."""
    length = len(context)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        tail = context[length - n:]
        first = tail[0]
        for j in range(length - n - 1, -1, -1):  # start of an earlier occurrence, most recent first
            if context[j] == first and context[j:j + n] == tail:
                return context[j + n: j + n + k]  # non-empty: j + n <= length - 1
    return []


class PromptLookupDrafter:
    def __init__(self, ngram_min: int, ngram_max: int, device: torch.device):
        assert 1 <= ngram_min <= ngram_max, (ngram_min, ngram_max)
        self.ngram_min, self.ngram_max, self.device = ngram_min, ngram_max, device

    def prefill(self, prompt: list[int]) -> None:
        pass  # nothing to cache: the context itself is the draft model

    def propose(self, context, k, sampling, generator) -> Proposal:
        toks = lookup(context, k, self.ngram_min, self.ngram_max)
        return Proposal(torch.tensor(toks, dtype=torch.long, device=self.device))

    def kv_cache_bytes(self) -> tuple[int, int]:
        return (0, 0)
