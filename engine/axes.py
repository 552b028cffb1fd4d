"""The optimization axes, in the seed's chain order: one registry every reader of configs and results uses.

An axis is one switch of the optimization chain: the config key that holds its choice, the value that
means "not applied", its place in the seed's order (KV cache -> continuous batching -> fused attention ->
quantization -> speculative decoding -> right-sized model) and its label. `engine.backend` is an axis too
(which runtime executes the chain) but not a step of the chain. Analysis code (advice, claims, report,
results, summary) and the cost model ask this module; none of them spells a key or an "off" value itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional


@dataclass(frozen=True)
class Axis:
    group: str  # config group / section: `kv_cache`
    key: str  # the config key holding the choice: `kv_cache.mode`
    off: str  # the value meaning "not applied"
    label: str  # what the seed calls the step
    chain: Optional[int]  # position in the seed's chain; None: an axis that is not a step of it

    def value(self, params: Mapping[str, Any]) -> Optional[str]:
        """The axis' value in a flat {config key: value} mapping (None when the key is absent)."""
        v = params.get(self.key)
        return None if v is None else str(v)

    def applied(self, params: Mapping[str, Any]) -> Optional[bool]:
        """True/False, or None when the mapping has no such key (the feature did not exist then)."""
        v = self.value(params)
        return None if v is None else v != self.off


KV_CACHE = Axis("kv_cache", "kv_cache.mode", "off", "KV cache", 0)
BATCHING = Axis("batching", "batching.mode", "static", "continuous batching", 1)
ATTENTION = Axis("attention", "attention.impl", "eager", "fused (flash) attention", 2)
QUANT = Axis("quant", "quant.level", "none", "quantization", 3)
SPECULATIVE = Axis("speculative", "speculative.method", "off", "speculative decoding", 4)
BACKEND = Axis("engine", "engine.backend", "hf", "engine", None)

AXES: tuple[Axis, ...] = (KV_CACHE, BATCHING, ATTENTION, QUANT, SPECULATIVE, BACKEND)
CHAIN: tuple[Axis, ...] = tuple(sorted((a for a in AXES if a.chain is not None), key=lambda a: a.chain))
RIGHT_SIZE = "right-size the model"  # the chain's last step: a different model, not a switch

_BY_GROUP = {a.group: a for a in AXES}
_BY_KEY = {a.key: a for a in AXES}


def by_group(group: str) -> Optional[Axis]:
    return _BY_GROUP.get(group)


def by_key(key: str) -> Optional[Axis]:
    return _BY_KEY.get(key)


def is_optimization_key(key: str) -> bool:
    """Whether a config key belongs to an optimization axis' group (`kv_cache.block_size` does)."""
    return key.split(".", 1)[0] in _BY_GROUP


def resolve_key(name: str) -> str:
    """A user's short name for an axis (`kv_cache`, `attention`) -> its config key; other keys unchanged."""
    a = _BY_GROUP.get(name)
    return a.key if a is not None else name


def short_key(key: str) -> str:
    """The label of a config key in tables: an axis' choice key shows as its group (`kv_cache`)."""
    a = _BY_KEY.get(key)
    return a.group if a is not None else key


def is_off(key: str, value: Any) -> bool:
    a = _BY_KEY.get(key)
    return a is not None and str(value) == a.off
