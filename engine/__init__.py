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
from .measure.metrics import METRICS
from .models import LoadedModel, load_model, prepare_model
from .runner import EngineResult, run_engine_trial

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
]
