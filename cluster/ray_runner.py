"""Run one Ray task per item with per-item resources, report each result as it arrives.

Resources come from the trial's `cluster` config: CPUs, GPUs (Ray sets CUDA_VISIBLE_DEVICES per task),
memory. System failures (a dead worker or node) are retried `max_retries` times by Ray; application
exceptions are never retried (the function is expected to return failures as data).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from tqdm.auto import tqdm

log = logging.getLogger(__name__)


@dataclass
class TaskFailure:
    """The task never returned (worker or node died past its retries, or the task was cancelled)."""

    error: str


def ensure_ray(cluster: dict[str, Any]) -> dict[str, float]:
    """Connect to `cluster.address`, or start an embedded local Ray once. Returns the cluster resources."""
    import ray

    if not ray.is_initialized():
        address = cluster.get("address")
        kwargs: dict[str, Any] = dict(
            include_dashboard=False,
            logging_level=logging.WARNING,
            log_to_driver=False,
            # project code is importable on workers via the installed package; keep env minimal
            runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}},
        )
        if address:
            ray.init(address=address, **kwargs)
        else:
            kwargs["num_cpus"] = cluster.get("local_num_cpus") or os.cpu_count()
            if cluster.get("local_num_gpus") is not None:
                kwargs["num_gpus"] = cluster["local_num_gpus"]
            ray.init(**kwargs)
    return dict(ray.cluster_resources())


def task_options(cluster: dict[str, Any]) -> dict[str, Any]:
    opts: dict[str, Any] = {
        "num_cpus": float(cluster.get("num_cpus_per_trial", 1)),
        "num_gpus": float(cluster.get("num_gpus_per_trial", 0)),
        "max_retries": int(cluster.get("max_retries", 1)),
        "retry_exceptions": False,
    }
    mem = float(cluster.get("memory_per_trial_gb") or 0)
    if mem > 0:
        opts["memory"] = int(mem * 1024**3)
    return opts


def run_on_ray(
    fn: Callable[[Any], Any],
    items: Sequence[Any],
    options_for: Callable[[Any], dict[str, Any]],
    on_result: Callable[[Any, Any], bool],
    desc: str = "trials",
    slots: int | None = None,
) -> None:
    """Submit `fn(item)` for every item; call `on_result(item, result_or_TaskFailure)` as each finishes.
    `on_result` returns True when the result counts as a success (for the progress bar). `slots` (how
    many tasks the cluster can run at once) turns the in-flight count into running vs queued."""
    import ray

    remote = ray.remote(fn)
    pending = {remote.options(**options_for(item)).remote(item): item for item in items}
    done = failed = 0
    with tqdm(total=len(items), desc=desc, unit="trial", dynamic_ncols=True) as bar:
        def show() -> None:
            running = len(pending) if slots is None else min(len(pending), slots)
            bar.set_postfix(done=done, failed=failed, running=running, queued=len(pending) - running)

        show()
        try:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1)
                ref = ready[0]
                item = pending.pop(ref)
                try:
                    result = ray.get(ref)
                except Exception as e:  # RayTaskError / WorkerCrashedError / NodeDiedError ...
                    result = TaskFailure(f"{type(e).__name__}: {e}")
                ok = on_result(item, result)
                done += ok
                failed += not ok
                bar.update(1)
                show()
        except KeyboardInterrupt:
            for ref in pending:
                ray.cancel(ref, force=True)
            raise
