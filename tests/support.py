"""Shorthand for building engine configs in tests: `make_trial(model, backend="native", kv_cache="paged")`."""
from __future__ import annotations

import dataclasses
from typing import Optional

from engine.config import (
    AttentionConfig,
    EngineConfig,
    KVCacheConfig,
    ModelConfig,
    TrialConfig,
    WorkloadConfig,
)

SERVING_FIELDS = ("num_requests", "input_len", "output_len", "length_trace", "arrival", "rate", "burstiness",
                  "prefix_len", "max_concurrency")


def make_trial(model: ModelConfig, backend: str = "hf", attention: str = "sdpa", kv_cache: str = "contiguous",
          kv_block_size: int = 16, compile: bool = False, prefix_caching: bool = False, kv_num_blocks: int = 0,
          threads: int = 0, serving: Optional[WorkloadConfig] = None, **sections) -> TrialConfig:
    """A TrialConfig; `serving` (a WorkloadConfig whose serving fields are used) makes the workload a
    serving one on top of `sections["workload"]`."""
    wl = sections.pop("workload", None) or WorkloadConfig()
    if serving is not None:
        wl = dataclasses.replace(wl, kind="serving", **{f: getattr(serving, f) for f in SERVING_FIELDS})
    return TrialConfig(
        model=model,
        engine=EngineConfig(backend=backend, compile=compile, threads=threads),
        attention=AttentionConfig(impl=attention),
        kv_cache=KVCacheConfig(mode=kv_cache, block_size=kv_block_size, prefix_caching=prefix_caching,
                               num_blocks=kv_num_blocks),
        workload=wl,
        **sections,
    )


def served_trial_run(tmp_path, overrides: list[str], sweep_name: str):
    """One served trial swept in this process into a store under `tmp_path`, all its requests at once: (the
    MLflow client, the trial's run), after checking it FINISHED."""
    from mlflow.tracking import MlflowClient

    from experiments.run.sweep import run_sweep

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    over = overrides + ["workload.arrival=all-at-once", f"tracking.uri={uri}", f"tracking.spool_dir={tmp_path}/spool",
                        f"sweep_name={sweep_name}"]
    res = run_sweep(over, in_process=True, echo=lambda *_: None)
    assert [r["status"] for r in res.rows] == ["FINISHED"], res.rows
    client = MlflowClient(uri)
    return client, client.search_runs([client.get_experiment_by_name(sweep_name).experiment_id])[0]
