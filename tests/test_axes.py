"""The axis registry (engine/axes.py): every key it names is a real config key, every "off" value is a
value the config accepts. What each engine honours per axis: tests/test_engines.py."""
from __future__ import annotations

from engine import axes, engines
from engine.config import (
    ATTENTION_IMPLS,
    BATCHING_MODES,
    DTYPES,
    KV_CACHE_MODES,
    SPECULATIVE_METHODS,
    ModelConfig,
    TrialConfig,
)
from engine.engines import _get

ALLOWED = {axes.KV_CACHE.key: KV_CACHE_MODES, axes.BATCHING.key: BATCHING_MODES, axes.ATTENTION.key: ATTENTION_IMPLS,
           axes.QUANT.key: engines.values(axes.QUANT.key), axes.SPECULATIVE.key: SPECULATIVE_METHODS, axes.BACKEND.key: engines.NAMES,
           axes.PRECISION.key: DTYPES}


def test_every_axis_is_a_config_key_with_a_valid_off_value():
    trial = TrialConfig(model=ModelConfig(name="m", path="tiny://llama"))
    for a in axes.AXES:
        _get(trial, a.key)  # raises for a key the config does not have
        assert a.off in ALLOWED.get(a.key, (a.off,)), a  # a numeric axis (a size, 0 = off) has no choice list
        assert a.key.split(".")[0] == a.group
    assert axes.is_optimization_key("kv_cache.block_size") and axes.is_optimization_key("model.dtype")
    assert not axes.is_optimization_key("model.name") and not axes.is_optimization_key("workload.context_len")
    assert [a.label for a in axes.CHAIN] == ["KV cache", "continuous batching", "fused (flash) attention",
                                            "quantization", "speculative decoding"]
