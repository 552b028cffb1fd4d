"""Place one call `fn(item)` per item on a pool of long-lived Ray actors ("warm workers").

Knows nothing of engines or MLflow: an item has a `Placement` (resources, retries, isolation) and an
affinity key. `Dispatcher` decides which item goes to which actor, when to start or stop actors and what
to retry, and `run_pool` is the loop that drives it (the same for the in-process pool, `local_pool`); this
module is the Ray half only: `RayPool` starts and kills actors, submits calls and turns what `ray.wait`
returns into `WorkerEvent`s.

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

import contextlib
import logging
import os
import signal
import threading
from typing import Any, Callable, Mapping, Optional

from .config import ClusterConfig
from .dispatcher import FAILED, FINISHED, START_FAILED, STARTED, Job, Worker, WorkerEvent, run_pool
from .leftovers import end_dead_sessions, record_session
from .placement import Placement

log = logging.getLogger(__name__)


def ensure_ray(cluster: ClusterConfig | Mapping[str, Any], say: Callable[[str], None] = print) -> dict[str, float]:
    """Connect to `cluster.address`, or start an embedded local Ray once (and end what the embedded Ray of a
    SIGKILLed predecessor left, cluster/leftovers.py; `say` tells). Returns the cluster resources."""
    import ray

    cluster = ClusterConfig.from_dict(cluster)
    if not ray.is_initialized():
        main = threading.current_thread() is threading.main_thread()
        term = signal.getsignal(signal.SIGTERM) if main else None
        address = cluster.address
        kwargs: dict[str, Any] = dict(
            include_dashboard=False,
            logging_level=logging.WARNING,
            log_to_driver=False,
            # project code is importable on workers via the installed package; keep env minimal
            runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}},
        )
        with _quiet_token_auth_notice():
            if address:
                ray.init(address=address, **kwargs)
            else:
                kwargs["num_cpus"] = cluster.local_num_cpus or os.cpu_count()
                if cluster.local_num_gpus is not None:
                    kwargs["num_gpus"] = cluster.local_num_gpus
                # what a driver killed with SIGKILL left of its embedded Ray: ended before ours starts, and
                # again in the temp dir ours actually uses (where Ray's default is not known)
                end_dead_sessions(_default_ray_temp_dir(), say)
                # "local": always a new embedded cluster; a bare ray.init() would join any cluster `ray start` left
                # on this machine (and refuse our num_cpus: "When connecting to an existing cluster, ...")
                ctx = ray.init(address="local", **kwargs)
                session = (getattr(ctx, "address_info", None) or {}).get("session_dir")
                if session:
                    end_dead_sessions(os.path.dirname(session), say)
                    record_session(session)
        if callable(term):  # ray.init installs a handler that aborts the process: keep the caller's own
            signal.signal(signal.SIGTERM, term)
    return dict(ray.cluster_resources())


def _default_ray_temp_dir() -> str:
    """Where a new local Ray puts its sessions (/tmp/ray unless RAY_TMPDIR or TMPDIR say otherwise)."""
    try:
        from ray._common.utils import get_default_ray_temp_dir  # private: a Ray without it skips this look

        return get_default_ray_temp_dir()
    except Exception:
        return ""


# Ray 2.5x enables token authentication on a new local cluster when RAY_AUTH_MODE is unset, and says so with
# this warning on every start; the embedded cluster keeps it on (nothing for the user to do), so the notice
# is dropped, exactly that message and only while infersweep starts or joins Ray. (docs/cluster-and-tracking.md:
# how cluster=existing passes the token.)
TOKEN_AUTH_NOTICE = "Token authentication is enabled for this Ray cluster."
_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


@contextlib.contextmanager
def _quiet_token_auth_notice():
    logger, drop = logging.getLogger(_AUTH_LOGGER), _DropMessage(TOKEN_AUTH_NOTICE)
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


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


class RayPool:
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

    @property
    def busy(self) -> bool:
        return bool(self.outstanding)

    def wait(self, timeout_s: float) -> Optional[WorkerEvent]:
        import ray

        if not self.outstanding:
            return None
        ready, _ = ray.wait(list(self.outstanding), num_returns=1, timeout=timeout_s)
        if not ready:
            return None
        worker, is_start = self.outstanding.pop(ready[0])
        try:
            value = ray.get(ready[0])
        except Exception as ex:
            if is_start:
                return WorkerEvent(worker, START_FAILED, f"{type(ex).__name__}: {ex}")
            msg, retriable = classify(ex)
            return WorkerEvent(worker, FAILED, msg, retriable)
        return WorkerEvent(worker, STARTED if is_start else FINISHED, value)


def run_on_ray(fn: Callable[..., Any], job: Job, worker_state: Optional[Callable[[], Any]] = None) -> None:
    """Run `fn(item)` for every item on warm actors (`run_pool`'s contract for `on_result` and `on_start`);
    `meta` = {attempts, errors, node_id, worker_pid, gpu_ids, cuda_visible_devices}. With `worker_state`,
    each actor calls `fn(item, state)` with its own `state = worker_state()`, which dies with the actor. Ctrl-C
    kills the actors, reports the running items as `TaskFailure(kind=CANCELLED)` and re-raises."""
    run_pool(RayPool(fn, worker_state), job)
