"""`draft`: a separate, smaller model that shares the target's tokenizer, with its own KV cache.

The classic setup (Leviathan et al. 2023; transformers' assisted generation): the draft is loaded once per
trial, unquantized, on the target's device, with the target's backend and attention; its KV cache follows
the target's mode (contiguous when the target runs without a cache). Draft and target must agree on what
every token id means, so the tokenizers are compared when the draft is loaded.
"""
from __future__ import annotations

import dataclasses

from ..engines import make_backend
from ..config import EngineError, TrialConfig, replace
from ..models import LoadedModel, load_model


def vocabulary(tokenizer) -> object:
    """What identifies a tokenizer's id -> token mapping (HF: the full vocabulary; byte tokenizer: itself)."""
    inner = getattr(tokenizer, "_tok", None)
    if inner is not None and hasattr(inner, "get_vocab"):
        return inner.get_vocab()
    return (type(tokenizer).__name__, tokenizer.vocab_size)


def check_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """Raise EngineError unless the draft's token ids and logits mean what the target's do."""
    tv, dv = vocabulary(target.tokenizer), vocabulary(draft.tokenizer)
    if tv != dv:
        if isinstance(tv, dict) and isinstance(dv, dict):
            differ = sorted(set(tv.items()) ^ set(dv.items()))[:3]
            detail = f"{len(tv)} vs {len(dv)} tokens; e.g. {differ}"
        else:
            detail = f"{tv} vs {dv}"
        raise EngineError(
            f"draft model {draft.spec.name!r} does not share the target's tokenizer ({detail}); speculative "
            "decoding needs the same token ids (use a draft of the same model family, or self-draft / prompt-lookup)"
        )
    t_v, d_v = int(target.config.vocab_size), int(draft.config.vocab_size)
    if t_v != d_v:
        raise EngineError(f"draft model {draft.spec.name!r} has {d_v} output logits, the target {t_v}; they must match")


def load_draft_backend(trial: TrialConfig, target: LoadedModel):
    """(backend, loaded draft) for trial.speculative.draft_model."""
    spec = trial.speculative.draft_model.resolve(trial.model)
    if spec is None:
        raise EngineError("speculative.method=draft needs speculative.draft_model.path")
    draft = load_model(spec, attention=trial.attention.impl, device=str(target.device))
    check_compatible(target, draft)
    kv = "contiguous" if trial.kv_cache.mode == "off" else trial.kv_cache.mode
    return make_backend(draft, replace(trial, "kv_cache.mode", kv)), draft
