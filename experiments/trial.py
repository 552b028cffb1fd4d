"""Run one TrialSpec on the engine and package the result as plain data (runs on a Ray worker).

Application errors are caught and returned as a FAILED outcome with the traceback, so one bad trial never
stops a sweep; a worker that dies is the cluster layer's business (retries). A warm worker keeps the last
loaded model and reuses it for the next trial with the same `model_key` (then `model_load_s` is 0).
"""
from __future__ import annotations

import gc
import os
import socket
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Optional

from .spec import TrialSpec, model_key, to_engine_trial

FINISHED, FAILED = "FINISHED", "FAILED"


@dataclass
class TrialOutcome:
    config_hash: str
    index: int
    status: str
    metrics: dict[str, float] = field(default_factory=dict)
    token_ids: list[list[int]] = field(default_factory=list)
    sample_text: str = ""
    info: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)  # the engine's labels of the trial (regime.*)
    error: Optional[str] = None
    start_ms: int = 0
    end_ms: int = 0
    attempts: int = 1  # set by the driver: 1 + retries after worker/node crashes
    attempt_errors: list[str] = field(default_factory=list)  # why earlier attempts died


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except Exception:
        pass


# The model of the last trial run in this process (a warm Ray actor, or the driver for --in-process),
# keyed by `model_key`: at most one, so a worker never holds two models.
_WARM: dict[str, Any] = {}


def release_models() -> None:
    """Drop the warm model (frees its memory)."""
    _WARM.clear()
    gc.collect()


def _reset_between_trials(device) -> None:
    """Measurement isolation in a reused process: nothing of the previous trial's allocations, caches or
    peaks leaks into this one (KV caches are per session; RSS / CUDA peaks are reset by the engine)."""
    import torch

    gc.collect()
    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def execute_trial(spec: TrialSpec) -> TrialOutcome:
    from engine import run_engine_trial
    from engine.models import load_model

    _quiet_libraries()
    start = int(time.time() * 1000)
    base: dict[str, Any] = dict(config_hash=spec.config_hash, index=spec.index, start_ms=start)
    proc = {"host": socket.gethostname(), "pid": str(os.getpid())}
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        proc["cuda_visible_devices"] = os.environ["CUDA_VISIBLE_DEVICES"]
    key = model_key(spec.config) if spec.config["cluster"].get("warm_workers", True) else None
    reused = False
    try:
        trial = to_engine_trial(spec.config)
        if trial.optimization.backend == "vllm":  # vLLM loads the model in its own interpreter
            key, loaded = None, None
            release_models()
        elif key is not None and key in _WARM:
            loaded, reused = _WARM[key], True
        else:
            release_models()  # before loading the next one: never two models in memory
            loaded = load_model(trial.model, attention=trial.optimization.attention, quant=trial.quant)
            if key is not None:
                _WARM[key] = loaded
        if loaded is not None:
            _reset_between_trials(loaded.device)
        result = run_engine_trial(trial, loaded=loaded)
    except Exception as e:
        _WARM.pop(key, None)  # a model that saw a failure is not trusted for the next trial
        return TrialOutcome(
            status=FAILED,
            error=f"{type(e).__name__}: {e}\n\n{traceback.format_exc()}",
            end_ms=int(time.time() * 1000),
            info=proc,
            **base,
        )
    metrics = dict(result.metrics)
    if loaded is not None:  # engine=vllm reports its own start-up time
        metrics["model_load_s"] = 0.0 if reused else float(loaded.load_s)
    info = dict(result.info, **proc, model_cache="hit" if reused else ("miss" if key else "off"))
    return TrialOutcome(
        status=FINISHED,
        metrics=metrics,
        token_ids=result.token_ids,
        sample_text=result.sample_text,
        info=info,
        labels=dict(result.labels),
        end_ms=int(time.time() * 1000),
        **base,
    )
