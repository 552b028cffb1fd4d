"""infersweep engine: a plain-Python library (no Hydra, Ray or MLflow) that loads a model, applies the
chosen optimizations, runs a workload and returns plain results.

    from engine import EngineTrial, ModelSpec, WorkloadSpec, run_engine_trial
    r = run_engine_trial(EngineTrial(model=ModelSpec(name="tiny", path="tiny://llama")))
    r.metrics["output_tok_s"]
"""
from .config import (
    EngineError,
    EngineTrial,
    EvalSpec,
    ModelSpec,
    OptimizationSpec,
    SamplingSpec,
    TextSource,
    TinyModelSpec,
    WorkloadSpec,
)
from .metrics import METRICS
from .models import LoadedModel, load_model, prepare_model
from .runner import EngineResult, run_engine_trial

__all__ = [
    "EngineError",
    "EngineResult",
    "EngineTrial",
    "EvalSpec",
    "LoadedModel",
    "METRICS",
    "ModelSpec",
    "OptimizationSpec",
    "SamplingSpec",
    "TextSource",
    "TinyModelSpec",
    "WorkloadSpec",
    "load_model",
    "prepare_model",
    "run_engine_trial",
]
