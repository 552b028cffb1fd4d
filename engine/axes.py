"""The optimization axes, in the seed's chain order: one registry every reader of configs and results uses.

An axis is one switch of the optimization chain: the config key that holds its choice, the value that
means "not applied", its place in the seed's order (KV cache -> continuous batching -> fused attention ->
quantization -> speculative decoding -> right-sized model) and its label. `engine.backend` is an axis too
(which runtime executes the chain) but not a step of the chain; what each engine honours on each axis is
the engine's own declaration (engine/engines/). Analysis code (advice, claims, report,
results, summary) and the cost model ask this module; none of them spells a key or an "off" value itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from .config import EngineConfig


@dataclass(frozen=True)
class RegimeGate:
    """How a step's payoff follows the measured regime: it attacks the bytes a memory-bound decode moves, so the
    regime says yes when decode is memory-bound and no when the time goes to compute. Each field: why."""
    memory: str  # decode is memory-bound: why the step should pay off
    compute: str  # decode (or, with `prefill`, a compute-bound prefill) takes the time in compute: why it cannot
    # the step runs in prefill too (quantized weights do; speculation only decodes): a compute-bound prefill that
    # takes the time says no as well
    prefill: bool = False


@dataclass(frozen=True)
class Axis:
    group: str  # config group / section: `kv_cache`
    key: str  # the config key holding the choice: `kv_cache.mode`
    off: str  # the value meaning "not applied"
    label: str  # what the seed calls the step
    chain: Optional[int]  # position in the seed's chain; None: an axis that is not a step of it
    whole_group: bool = True  # every key of the group belongs to the optimization (kv_cache.block_size does)
    first: tuple[str, ...] = ()  # values tried before the others, in the seed's order (weight-only INT8 first)
    regime: Optional[RegimeGate] = None  # whether the regime decides if the step pays off; None: it has no say
    # it changes only how tokens are generated, never a teacher-forced log-likelihood score (no cache is used there)
    generation_only: bool = False
    # with it applied, each generated token still costs one pass of the target model (the cost model's roofline
    # prices exactly that); speculation's passes yield as many tokens as the draft gets accepted
    one_pass_per_token: bool = True

    def value(self, params: Mapping[str, Any]) -> Optional[str]:
        """The axis' value in a flat {config key: value} mapping (None when the key is absent)."""
        v = params.get(self.key)
        return None if v is None else str(v)

    def applied(self, params: Mapping[str, Any]) -> Optional[bool]:
        """True/False, or None when the mapping has no such key (the feature did not exist then)."""
        v = self.value(params)
        return None if v is None else v != self.off


KV_CACHE = Axis("kv_cache", "kv_cache.mode", "off", "KV cache", 0, generation_only=True)
BATCHING = Axis("batching", "batching.mode", "static", "continuous batching", 1, generation_only=True)
ATTENTION = Axis("attention", "attention.impl", "eager", "fused (flash) attention", 2)
QUANT = Axis("quant", "quant.level", "none", "quantization", 3, first=("int8-weight",), regime=RegimeGate(
    memory="fewer weight bytes per step", compute="quantization cuts bytes, not FLOPs", prefill=True))
SPECULATIVE = Axis("speculative", "speculative.method", "off", "speculative decoding", 4, generation_only=True,
                   one_pass_per_token=False, regime=RegimeGate(
                       memory="verifying k drafted tokens costs about one weight pass",
                       compute="verifying k drafted tokens costs ~k times the FLOPs"))
BACKEND = Axis("engine", "engine.backend", EngineConfig.backend, "engine", None)  # off: the default (reference) engine
# the number format the weights and activations run in: an optimization like quantization, though its key
# lives in the model's group (whose other keys -- name, path -- say which model, not how it runs)
PRECISION = Axis("model", "model.dtype", "float32", "half precision", None, whole_group=False)

AXES: tuple[Axis, ...] = (KV_CACHE, BATCHING, ATTENTION, QUANT, SPECULATIVE, BACKEND, PRECISION)
CHAIN: tuple[Axis, ...] = tuple(sorted((a for a in AXES if a.chain is not None), key=lambda a: a.chain))
RIGHT_SIZE = "right-size the model"  # the chain's last step: a different model, not a switch

_BY_GROUP = {a.group: a for a in AXES if a.whole_group}
_BY_KEY = {a.key: a for a in AXES}


def is_optimization_key(key: str) -> bool:
    """Whether a config key belongs to an optimization axis (`kv_cache.block_size` does, `model.name`
    does not)."""
    if key in _BY_KEY:
        return True
    a = _BY_GROUP.get(key.split(".", 1)[0])
    return a is not None and a.whole_group


def of_key(name: str) -> Optional[Axis]:
    """The axis a config key or a user's short name (`quant`, `quant.level`) chooses; None for other keys."""
    return _BY_KEY.get(resolve_key(name))


def resolve_key(name: str) -> str:
    """A user's short name for an axis (`kv_cache`, `attention`) -> its config key; other keys unchanged."""
    a = _BY_GROUP.get(name)
    return a.key if a is not None else name


def short_key(key: str) -> str:
    """The label of a config key in tables: an axis' choice key shows as its group (`kv_cache`)."""
    a = _BY_KEY.get(key)
    return a.group if a is not None and a.whole_group else key

