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

from ..config.spec import TrialSpec, model_key

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
    series: dict[str, list[float]] = field(default_factory=dict)  # metric -> values by step (capacity curve)
    answers: dict[str, list] = field(default_factory=dict)  # eval.tasks: task -> per-example answers
    correct: dict[str, list] = field(default_factory=dict)  # eval.tasks: task -> per-example 0/1
    items: dict[str, list] = field(default_factory=dict)  # eval.tasks: task -> each example's identity (engine)
    error: Optional[str] = None
    start_ms: int = 0
    end_ms: int = 0
    attempts: int = 1  # set by the driver: 1 + retries after worker/node crashes
    attempt_errors: list[str] = field(default_factory=list)  # why earlier attempts died
    samples: dict[str, list[float]] = field(default_factory=dict)  # each timed repeat's whole-run timings
    artifacts: dict[str, str] = field(default_factory=dict)  # file name -> text, logged with the run (a server's log)


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except Exception:
        pass


class WarmModels:
    """The model of the last trial one worker ran (a Ray actor, or the driver for --in-process), with its
    `model_key`: only one, so a worker never holds two models. The worker owns it and hands it to every
    `execute_trial` call; a new worker starts with an empty one."""

    def __init__(self) -> None:
        self._key: Optional[str] = None
        self._loaded: Any = None

    def get(self, key: str) -> Optional[Any]:
        return self._loaded if key == self._key else None

    def keep(self, key: str, loaded: Any) -> None:
        self._key, self._loaded = key, loaded

    def discard(self, key: Optional[str]) -> None:
        if key is not None and key == self._key:
            self._key = self._loaded = None

    def release(self) -> None:
        """Drop the warm model (frees its memory)."""
        self._key = self._loaded = None
        collect_garbage(freeze=True)


def collect_garbage(freeze: bool = False) -> None:
    """`gc.collect()` over what trials leave behind. A full collection scans every object of the process:
    with torch, transformers and MLflow imported that is ~500k objects, 0.25 s a call, twice per trial.
    `freeze` (only where no model is held: before one is loaded) then moves the survivors out of the
    collector's sight (`gc.freeze`): the libraries, lazily imported ones included, and the process's own
    state. Later collections scan only objects created since, which is all a trial allocates; frozen
    objects are still freed by reference counting."""
    gc.collect()
    if freeze:
        gc.freeze()


def _reset_between_trials(device) -> None:
    """Measurement isolation in a reused process: nothing of the previous trial's allocations, caches or
    peaks leaks into this one (KV caches are per session; RSS / CUDA peaks are reset by the engine)."""
    import torch

    collect_garbage()
    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def execute_trial(spec: TrialSpec, warm: Optional[WarmModels] = None) -> TrialOutcome:
    """Run one trial, reusing `warm`'s model when it has this trial's; without `warm` the model is loaded
    for this call only."""
    from engine import run_engine_trial
    from engine.pipeline import load_trial_model

    _quiet_libraries()
    start = int(time.time() * 1000)
    base: dict[str, Any] = dict(config_hash=spec.config_hash, index=spec.index, start_ms=start)
    proc = {"host": socket.gethostname(), "pid": str(os.getpid())}
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        proc["cuda_visible_devices"] = os.environ["CUDA_VISIBLE_DEVICES"]
    key = model_key(spec.config) if spec.cluster.warm_workers else None
    warm = WarmModels() if warm is None else warm
    reused = False
    try:
        trial = spec.trial
        if key is not None and warm.get(key) is not None:
            loaded, reused = warm.get(key), True
        else:
            warm.release()  # before loading the next one: never two models in memory
            loaded = load_trial_model(trial)
            if loaded is None:  # the engine loads in its own process: nothing to keep warm
                key = None
            elif key is not None:
                warm.keep(key, loaded)
        if loaded is not None:
            _reset_between_trials(loaded.device)
        result = run_engine_trial(trial, loaded=loaded)
    except Exception as e:
        warm.discard(key)  # a model that saw a failure is not trusted for the next trial
        return TrialOutcome(
            status=FAILED,
            error=f"{type(e).__name__}: {e}\n\n{traceback.format_exc()}",
            end_ms=int(time.time() * 1000),
            info=proc,
            **base,
        )
    metrics = dict(result.metrics)
    if reused:  # the engine reported the warm model's original load time
        metrics["model_load_s"] = 0.0
    info = dict(result.info, **proc, model_cache="hit" if reused else ("miss" if key else "off"))
    return _finished(base, result, metrics, info)


def _finished(base: dict[str, Any], result, metrics: dict[str, float], info: dict[str, str]) -> TrialOutcome:
    return TrialOutcome(
        status=FINISHED,
        metrics=metrics,
        token_ids=result.token_ids,
        sample_text=result.sample_text,
        info=info,
        labels=dict(result.labels),
        series={k: list(v) for k, v in result.series.items()},
        answers=dict(result.answers),
        correct=dict(getattr(result, "correct", {})),
        items=dict(getattr(result, "items", {})),
        end_ms=int(time.time() * 1000),
        samples=dict(result.samples),
        artifacts=dict(getattr(result, "artifacts", {})),
        **base,
    )


def identified_correct(correct: dict, items: dict) -> dict:
    """task -> per-item correctness keyed by the item's identity (`<doc_id>:<document digest>`, engine/tasks/run.py
    TaskResult.items) where the trial gives one for every item, else the list in document order (what a run logged
    before items had identities; experiments/optimize/accuracy.py items_of reads both)."""
    out = {}
    for task, values in (correct or {}).items():
        ids = (items or {}).get(task)
        out[task] = dict(zip(ids, values)) if ids and len(ids) == len(values) else list(values)
    return out


def interleave_group_id(specs: list[TrialSpec]) -> str:
    return group_id([s.config_hash for s in specs])


def group_id(config_hashes: list[str]) -> str:
    """The interleave group of trials with these config hashes, in measuring order (tag env.interleave_group)."""
    import hashlib

    return hashlib.sha256("|".join(config_hashes).encode()).hexdigest()[:12]


def execute_interleaved(specs: list[TrialSpec], warm: Optional[WarmModels] = None) -> list[TrialOutcome]:
    """Run a group of trials round-robin on this worker (`cluster.interleave` rounds, engine.run_interleaved):
    one outcome per spec, in order. A failure fails the whole group (its variants share their rounds)."""
    from engine import run_interleaved

    _quiet_libraries()
    if warm is not None:
        warm.release()  # every variant loads its own model for the group's lifetime
    start = int(time.time() * 1000)
    proc = {"host": socket.gethostname(), "pid": str(os.getpid())}
    rounds = int(specs[0].cluster.interleave)
    group = {"interleave_group": interleave_group_id(specs), "interleave_rounds": str(rounds),
             "interleave_size": str(len(specs))}
    bases = [dict(config_hash=s.config_hash, index=s.index, start_ms=start) for s in specs]
    try:
        results = run_interleaved([s.trial for s in specs], rounds)
    except Exception as e:
        err = f"{type(e).__name__}: {e} (in an interleaved group of {len(specs)})\n\n{traceback.format_exc()}"
        return [TrialOutcome(status=FAILED, error=err, end_ms=int(time.time() * 1000), info=dict(proc, **group), **b)
                for b in bases]
    return [_finished(b, r, dict(r.metrics), dict(r.info, **proc, **group, model_cache="off"))
            for b, r in zip(bases, results)]
