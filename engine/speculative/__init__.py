"""Speculative decoding: a cheap drafter proposes k tokens, the target verifies all of them in one forward.

One concept per file:
  drafter.py        the Drafter protocol, Proposal, and SessionDrafter (any DecodeSession run ahead greedily
                    or by sampling: the common part of the two model drafters)
  draft_model.py    `draft`: a separate model sharing the target's tokenizer, with its own KV cache
  self_draft.py     `self-draft`: the target's first N blocks + final norm + LM head (weights shared)
  prompt_lookup.py  `prompt-lookup`: the continuation of an earlier occurrence of the last n-gram (no model)
  verify.py         the pure accept/reject rule (greedy match, or rejection sampling) over one target forward
  decode.py         the loop: prefill, propose, verify, roll back; returns a GenerationTrace + statistics

Expected tokens per target step with per-token acceptance probability a and lookahead k:
(1 - a^(k+1)) / (1 - a)  (Leviathan et al. 2023; the seed's formula) -- `engine.measure.metrics.expected_tokens_per_step`.
"""
from dataclasses import dataclass
from typing import Callable

from .decode import SpeculativeStats, generate_speculative
from .drafter import Drafter, Proposal
from .verify import Verdict, verify

__all__ = ["DraftSource", "Drafter", "Proposal", "SpeculativeStats", "Verdict", "generate_speculative", "make_draft_source", "verify"]


@dataclass(frozen=True)
class DraftSource:
    """Makes a fresh drafter per generation (`new(max_len)`); `weights_bytes` = extra weights it holds."""

    new: Callable[[int], Drafter]
    weights_bytes: int = 0


def make_draft_source(trial, loaded) -> DraftSource:
    """The drafter of `trial.speculative` for the target `loaded` (a draft model is loaded here, once)."""
    from ..config import EngineError
    from ..models import weights_bytes
    from .drafter import SessionDrafter

    spec, device = trial.speculative, loaded.device
    if spec.method == "prompt-lookup":
        from .prompt_lookup import PromptLookupDrafter

        return DraftSource(lambda max_len: PromptLookupDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max, device))
    if spec.method == "self-draft":
        from .self_draft import self_draft_backend

        draft = self_draft_backend(loaded, trial, spec.draft_layers)
        return DraftSource(lambda max_len: SessionDrafter(draft.new_session(1, max_len), device))  # shares weights
    if spec.method == "draft":
        from .draft_model import load_draft_backend

        backend, draft_model = load_draft_backend(trial, loaded)
        return DraftSource(lambda max_len: SessionDrafter(backend.new_session(1, max_len), device),
                           weights_bytes=weights_bytes(draft_model.model))
    raise EngineError(f"speculative method {spec.method!r} has no drafter")
