"""Place one call `fn(item)` per item on a pool of long-lived Ray actors ("warm workers").

Knows nothing of engines or MLflow: an item has a `Placement` (resources, retries, isolation) and an
affinity key. `Dispatcher` decides which item goes to which actor, when to start or stop actors and what
to retry; this module is the Ray half only: it starts and kills actors, submits calls, waits on them and
feeds what happened back to the dispatcher.

- Resources: each actor requests the item's CPUs, GPUs (Ray gives it its own CUDA_VISIBLE_DEVICES for its
  lifetime), memory and custom resources, so no more items run at once than the cluster fits.
- `isolation="exclusive-node"`: at most one actor per node (pinned with a hard node affinity), so no two
  items ever share a node.
- Warm state: with `worker_state`, each actor builds `worker_state()` once, in its own process, and calls
  `fn(item, state)`; items with the same key go to the same actor when they can, so the state (a loaded
  model, say) is reused. It dies with the actor.
- Faults: an actor that dies mid-item (killed worker process, dead node) is replaced and its item
  re-queued, at most `max_retries` times; exceptions of `fn` itself and Ray's out-of-memory kills are
  deterministic and never retried. `on_result` sees every item exactly once, with its final result.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Optional, Sequence

from tqdm.auto import tqdm

from .dispatcher import Dispatcher, Worker
from .placement import Placement

log = logging.getLogger(__name__)


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


def alive_nodes() -> list[dict[str, Any]]:
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


def classify(e: BaseException) -> tuple[str, bool]:
    """(message, retriable) for an exception raised by `ray.get` on an actor call."""
    import ray.exceptions as rex

    msg = f"{type(e).__name__}: {e}"
    if isinstance(e, rex.OutOfMemoryError) or "memory monitor" in str(e).lower():
        return msg, False  # Ray killed it for memory: it would again
    if isinstance(e, rex.TaskCancelledError):
        return msg, False
    if isinstance(e, rex.RayTaskError):  # fn (or unpickling its result) raised: deterministic
        return msg, False
    if isinstance(e, (rex.ActorDiedError, rex.ActorUnavailableError, rex.WorkerCrashedError,
                      rex.NodeDiedError, rex.ObjectLostError, rex.RaySystemError)):
        return msg, True
    return msg, False


class _Worker:
    """The actor: calls `fn(item)` (or `fn(item, state)`) in one long-lived process."""

    def __init__(self, fn: Callable[..., Any], make_state: Optional[Callable[[], Any]] = None):
        self._fn = fn
        self._make_state = make_state
        # built here, in the actor's process, so what it holds lives exactly as long as the actor
        self._state = make_state() if make_state is not None else None

    def info(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {
            "node_id": ctx.get_node_id(),
            "worker_pid": os.getpid(),
            "gpu_ids": ",".join(str(g) for g in ray.get_gpu_ids()),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        }

    def run(self, item: Any) -> Any:
        return self._fn(item) if self._make_state is None else self._fn(item, self._state)


class _RayWorkers:
    """The dispatcher's `WorkerPool` on Ray actors. `outstanding`: each object ref in flight -> (worker,
    whether it is the worker's start-up call rather than an item)."""

    def __init__(self, fn: Callable[..., Any], make_state: Optional[Callable[[], Any]]):
        import ray

        self._actor_cls = ray.remote(_Worker)
        self._fn, self._make_state = fn, make_state
        self._actors: dict[int, Any] = {}
        self.outstanding: dict[Any, tuple[Worker, bool]] = {}

    def nodes(self) -> list[dict[str, Any]]:
        return alive_nodes()

    def spawn(self, worker: Worker, placement: Placement) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        opts = placement.actor_options()
        if worker.node_id is not None:
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(worker.node_id, soft=False)
        actor = self._actor_cls.options(**opts).remote(self._fn, self._make_state)
        self._actors[worker.id] = actor
        self.outstanding[actor.info.remote()] = (worker, True)

    def submit(self, worker: Worker, item: Any) -> None:
        self.outstanding[self._actors[worker.id].run.remote(item)] = (worker, False)

    def retire(self, worker: Worker) -> None:
        import ray

        for ref in [r for r, (w, _) in self.outstanding.items() if w is worker]:
            del self.outstanding[ref]
        try:
            ray.kill(self._actors.pop(worker.id), no_restart=True)
        except Exception:
            pass


def _show(bar: tqdm, d: Dispatcher) -> None:
    p = d.progress()
    bar.set_postfix(done=p.done, failed=p.failed, running=p.running, queued=p.queued, refresh=False)
    if p.done + p.failed > bar.n:
        bar.update(p.done + p.failed - bar.n)


def run_on_ray(
    fn: Callable[..., Any],
    items: Sequence[Any],
    placement_for: Callable[[Any], Placement],
    on_result: Callable[[Any, Any, dict[str, Any]], bool],
    key_for: Callable[[Any], Any] = lambda item: None,
    desc: str = "trials",
    placement_timeout_s: float = 600.0,
    on_start: Optional[Callable[[Any, dict[str, Any]], None]] = None,
    worker_state: Optional[Callable[[], Any]] = None,
) -> None:
    """Run `fn(item)` for every item on warm actors; call `on_result(item, result, meta)` once per item
    with its final result (`fn`'s return value, or a `TaskFailure`), `meta` = {attempts, errors, node_id,
    worker_pid, gpu_ids, cuda_visible_devices}. `on_result` returns True for a success (progress bar).
    `on_start(item, meta)` is called when an item is handed to a worker. With `worker_state`, each actor
    calls `fn(item, state)` with its own `state = worker_state()`. Ctrl-C kills the actors, reports the
    running items as `TaskFailure(kind=CANCELLED)` and re-raises."""
    import ray

    pool = _RayWorkers(fn, worker_state)
    d = Dispatcher(items, placement_for, key_for, pool, on_result, on_start=on_start,
                   placement_timeout_s=placement_timeout_s, clock=time.monotonic)
    bar = tqdm(total=len(items), desc=desc, unit="trial", dynamic_ncols=True)
    try:
        d.start()
        while not d.finished:
            _show(bar, d)
            if not pool.outstanding:  # items queued but no worker exists (all dead / none fits now)
                d.idle()
                if not pool.outstanding and not d.finished:
                    time.sleep(0.5)
                continue
            ready, _ = ray.wait(list(pool.outstanding), num_returns=1, timeout=1.0)
            if not ready:
                d.idle()
                continue
            worker, is_start = pool.outstanding.pop(ready[0])
            try:
                value = ray.get(ready[0])
            except Exception as ex:
                if is_start:
                    d.worker_failed_to_start(worker, f"{type(ex).__name__}: {ex}")
                else:
                    d.trial_failed(worker, *classify(ex))
                continue
            if is_start:
                d.worker_started(worker, value)
            else:
                d.trial_finished(worker, value)
    except KeyboardInterrupt:
        d.cancel_running()
        raise
    finally:
        _show(bar, d)
        bar.close()
        d.close()
