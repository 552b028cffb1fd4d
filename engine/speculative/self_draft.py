"""`self-draft`: the target's own first N decoder blocks, then its final norm and LM head, as the draft.

Early exit (the idea of LayerSkip / Draft&Verify, here without any training): no second model and no
extra weights -- every module is the target's -- but a KV cache of its own (N layers). It works with any
Llama-family checkpoint, so SmolLM2 alone suffices. Its cost per token is about (N/L of the blocks + the
LM head) of a target step, and its acceptance depends on how much of the final prediction the first N
blocks already hold, which an untrained exit does not promise.

The draft is a truncated model run by the engine that declares `runs_self_draft` (the registry's
`self_draft_runtime`), whatever engine runs the target: that engine's own rules apply to it.
"""
from __future__ import annotations

from typing import Any, Optional

from ..config import TrialConfig


def self_draft_backend(loaded: Any, trial: TrialConfig, num_layers: int):
    """A backend over the first `num_layers` blocks of `loaded` (weights shared with the target)."""
    from ..engines import self_draft_runtime

    return self_draft_runtime().self_draft_backend(loaded, trial, num_layers)


def model_problem(facts, num_tokens: int) -> Optional[str]:
    """Why the self-draft cannot run a model with these facts (engine.model_facts.ModelFacts) over
    `num_tokens` positions: its draft's runtime's own rules (architecture, sliding window); None when it can."""
    from ..engines import self_draft_runtime

    return self_draft_runtime().self_draft_problem(facts, num_tokens)


def runtime_name() -> str:
    """The engine that runs the draft, for messages."""
    from ..engines import self_draft_runtime

    return self_draft_runtime().name
