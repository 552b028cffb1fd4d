"""The axis registry (engine/axes.py): every key it names is a real config key, every "off" value is a
value the config accepts, and the README's axis x engine table is the registry's."""
from __future__ import annotations

from pathlib import Path

from engine import axes
from engine.config import (
    ATTENTION_IMPLS,
    BACKENDS,
    BATCHING_MODES,
    DTYPES,
    KV_CACHE_MODES,
    QUANT_LEVELS,
    SPECULATIVE_METHODS,
    ModelConfig,
    TrialConfig,
)
from engine.validation import _get

ALLOWED = {axes.KV_CACHE.key: KV_CACHE_MODES, axes.BATCHING.key: BATCHING_MODES, axes.ATTENTION.key: ATTENTION_IMPLS,
           axes.QUANT.key: QUANT_LEVELS, axes.SPECULATIVE.key: SPECULATIVE_METHODS, axes.BACKEND.key: BACKENDS,
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


def test_support_table_names_real_keys_engines_and_values():
    trial = TrialConfig(model=ModelConfig(name="m", path="tiny://llama"))
    assert set(axes.ENGINES) <= set(BACKENDS) | {"vllm"}
    for engine, table in axes.SUPPORT.items():
        for key, s in table.items():
            _get(trial, key)
            allowed = ALLOWED.get(key)
            if allowed is not None:
                assert set(s.values) <= set(allowed), (engine, key)
            assert s.why


def test_unsupported_names_engine_key_and_alternatives():
    (msg,) = axes.unsupported("hf", {"kv_cache.mode": "paged", "quant.level": "none"})
    assert msg[0] == "kv_cache.mode" and "engine=hf cannot honour kv_cache.mode=paged" in msg[1]
    assert "off, contiguous" in msg[1]
    assert axes.unsupported("native", {"kv_cache.mode": "paged"}) == []


def test_readme_axis_engine_table_is_the_registry():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert axes.support_markdown() in readme, "README's axis x engine table is stale: paste axes.support_markdown()"
