"""`self-draft`: the target's own first N decoder blocks, then its final norm and LM head, as the draft.

Early exit (the idea of LayerSkip / Draft&Verify, here without any training): no second model and no
extra weights -- every module is the target's -- but a KV cache of its own (N layers). It works with any
Llama-family checkpoint, so SmolLM2 alone suffices. Its cost per token is about (N/L of the blocks + the
LM head) of a target step, and its acceptance depends on how much of the final prediction the first N
blocks already hold, which an untrained exit does not promise.
"""
from __future__ import annotations

from ..config import EngineError, TrialConfig, replace
from ..models import LoadedModel


def self_draft_backend(loaded: LoadedModel, trial: TrialConfig, num_layers: int):
    """A native backend over the first `num_layers` blocks of `loaded` (weights shared with the target).
    The draft's cache follows the target's native layout (contiguous or paged); contiguous otherwise."""
    from ..engines.native.backend import NativeBackend
    from ..engines.native.support import unsupported

    why = unsupported(loaded.config)
    if why is not None:  # whatever the target's backend: the draft always runs natively
        raise EngineError(f"{DRAFT_RUNTIME}, which cannot run this model: {why}; {INSTEAD}")
    total = int(getattr(loaded.config, "num_hidden_layers", 0) or 0)
    if not 1 <= num_layers < total:
        raise EngineError(f"speculative.draft_layers must be in [1, {total}) for this {total}-layer model, got {num_layers}")
    mode = trial.kv_cache.mode
    kv = mode if (trial.engine.backend == "native" and mode in ("contiguous", "paged")) else "contiguous"
    draft = replace(replace(trial, "engine.backend", "native"), "kv_cache.mode", kv)
    return NativeBackend(loaded, draft, num_layers=num_layers,
                         instead=f"{DRAFT_RUNTIME}: {INSTEAD}, or a context within the window")


# The draft is a truncated native model, so a model the native runtime cannot run has no self-draft on
# either backend: switching the target to backend hf (what backend native's own error advises) fixes nothing.
DRAFT_RUNTIME = "speculative.method=self-draft runs its draft (the target's first layers) on the native runtime"
INSTEAD = "use speculative.method=draft or prompt-lookup with this model"


def model_problem(facts, num_tokens: int) -> str | None:
    """Why the self-draft cannot run a model with these facts (engine.model_facts.ModelFacts) over
    `num_tokens` positions: its draft runs on the native runtime whatever the engine, so that runtime's own
    rules apply (architecture, sliding window); None when it can."""
    from ..engines.native.support import unhonoured_window, unsupported, window_exceeded

    if facts is None or facts.config is None:
        return None
    return unsupported(facts.config) or window_exceeded(unhonoured_window(facts.config), num_tokens)
