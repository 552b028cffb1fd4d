"""infersweep engine: a plain-Python library (no Hydra, Ray or MLflow) that loads a model, applies the
chosen optimizations, runs a workload and returns plain results.

    from engine import KVCacheConfig, ModelConfig, TrialConfig, run_engine_trial
    r = run_engine_trial(TrialConfig(model=ModelConfig(name="tiny", path="tiny://llama"),
                                     kv_cache=KVCacheConfig(mode="off")))
    r.metrics["output_tok_s"]
"""
from . import axes
from .config import (
    AttentionConfig,
    BatchingConfig,
    DraftModelConfig,
    EngineConfig,
    EngineError,
    EvalConfig,
    KVCacheConfig,
    LengthConfig,
    ModelConfig,
    QuantConfig,
    SamplingConfig,
    SLOConfig,
    SpeculativeConfig,
    TextConfig,
    TinyModelConfig,
    TrialConfig,
    WorkloadConfig,
)
# The runtime (torch, transformers) is imported on first use, so `engine.config` and the axis registry
# stay cheap to import: the CLI's --help, `report` and `sync` need the config model, not a model.
_LAZY = {"METRICS": ".measure.metrics", "LoadedModel": ".models", "load_model": ".models",
         "prepare_model": ".models", "EngineResult": ".pipeline", "run_engine_trial": ".pipeline", "run_interleaved": ".pipeline"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "AttentionConfig",
    "BatchingConfig",
    "DraftModelConfig",
    "EngineConfig",
    "EngineError",
    "EngineResult",
    "EvalConfig",
    "KVCacheConfig",
    "LengthConfig",
    "LoadedModel",
    "METRICS",
    "ModelConfig",
    "QuantConfig",
    "SamplingConfig",
    "SLOConfig",
    "SpeculativeConfig",
    "TextConfig",
    "TinyModelConfig",
    "TrialConfig",
    "WorkloadConfig",
    "axes",
    "load_model",
    "prepare_model",
    "run_engine_trial",
    "run_interleaved",
]
