"""Place one call `fn(item)` per item on a pool of long-lived Ray actors ("warm workers").

Knows nothing of engines or MLflow: an item has a `Placement` (resources, retries, isolation) and an
affinity key; the caller's `fn` runs in the actor's process, so whatever the function keeps in its module
(a loaded model, say) survives to the next item with the same key, which this scheduler routes to the same
actor when it can.

- Resources: each actor requests the item's CPUs, GPUs (Ray gives it its own CUDA_VISIBLE_DEVICES for its
  lifetime), memory and custom resources, so no more items run at once than the cluster fits.
- `isolation="exclusive-node"`: at most one actor per node (pinned with a hard node affinity), so no two
  items ever share a node.
- Faults: an actor that dies mid-item (killed worker process, dead node) is replaced and its item
  re-queued, at most `max_retries` times; exceptions of `fn` itself and Ray's out-of-memory kills are
  deterministic and never retried. `on_result` sees every item exactly once, with its final result.
"""
from __future__ import annotations

import logging
import math
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from tqdm.auto import tqdm

log = logging.getLogger(__name__)

SHARED, EXCLUSIVE_NODE = "shared", "exclusive-node"
ISOLATIONS = (SHARED, EXCLUSIVE_NODE)

# TaskFailure.kind
CRASHED = "crashed"  # the worker or its node died, past the retries
DETERMINISTIC = "deterministic"  # fn raised / Ray's OOM killer: retrying would fail the same way
CANCELLED = "cancelled"  # the run was interrupted (Ctrl-C) while this item was running
UNPLACEABLE = "unplaceable"  # no worker could be placed for it within the placement timeout


@dataclass
class TaskFailure:
    """The item never produced a result of `fn`."""

    error: str
    kind: str = CRASHED


@dataclass(frozen=True)
class Placement:
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    memory_bytes: int = 0
    resources: tuple[tuple[str, float], ...] = ()  # custom resources, sorted (hashable)
    isolation: str = SHARED
    max_retries: int = 1

    def demand(self) -> dict[str, float]:
        d = {"CPU": self.num_cpus, "GPU": self.num_gpus, "memory": float(self.memory_bytes), **dict(self.resources)}
        return {k: v for k, v in d.items() if v > 0}

    def actor_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, "max_restarts": 0}
        if self.memory_bytes > 0:
            opts["memory"] = self.memory_bytes
        if self.resources:
            opts["resources"] = dict(self.resources)
        return opts

    def shape(self) -> tuple:
        """Actors are interchangeable between items of the same shape (retries do not matter)."""
        return (self.num_cpus, self.num_gpus, self.memory_bytes, self.resources, self.isolation)


def placement(cluster: dict[str, Any]) -> Placement:
    """A `Placement` from a trial's `cluster` config section."""
    mem = float(cluster.get("memory_per_trial_gb") or 0)
    res = cluster.get("resources") or {}
    return Placement(
        num_cpus=float(cluster.get("num_cpus_per_trial", 1)),
        num_gpus=float(cluster.get("num_gpus_per_trial", 0)),
        memory_bytes=int(mem * 1024**3),
        resources=tuple(sorted((str(k), float(v)) for k, v in res.items())),
        isolation=str(cluster.get("isolation") or SHARED),
        max_retries=int(cluster.get("max_retries", 1)),
    )


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


def fits(node_resources: dict[str, float], p: Placement) -> int:
    """How many actors of placement `p` one node holds (by its total resources)."""
    n = math.inf
    for k, need in p.demand().items():
        n = min(n, math.floor(node_resources.get(k, 0.0) / need + 1e-9))
    return 0 if n is math.inf else int(n)


def capacity(p: Placement, nodes: Optional[list[dict[str, Any]]] = None) -> int:
    """How many items of placement `p` the alive nodes run at once."""
    nodes = alive_nodes() if nodes is None else nodes
    per = [fits(n.get("Resources", {}), p) for n in nodes]
    if p.isolation == EXCLUSIVE_NODE:
        return sum(1 for k in per if k > 0)
    return sum(per)


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
    """The actor: calls `fn(item)` in one long-lived process (module-level state persists)."""

    def __init__(self, fn: Callable[[Any], Any]):
        self._fn = fn

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
        return self._fn(item)


@dataclass
class _Entry:
    item: Any
    placement: Placement
    key: Any
    attempts: int = 0
    errors: list[str] = field(default_factory=list)


@dataclass
class _Slot:
    actor: Any
    shape: tuple
    ready_ref: Any
    node_id: Optional[str] = None  # known once ready (or chosen up front: exclusive-node)
    info: dict[str, Any] = field(default_factory=dict)
    ready: bool = False
    last_key: Any = None
    entry: Optional[_Entry] = None
    started: float = 0.0


def run_on_ray(
    fn: Callable[[Any], Any],
    items: Sequence[Any],
    placement_for: Callable[[Any], Placement],
    on_result: Callable[[Any, Any, dict[str, Any]], bool],
    key_for: Callable[[Any], Any] = lambda item: None,
    desc: str = "trials",
    placement_timeout_s: float = 600.0,
    on_start: Optional[Callable[[Any, dict[str, Any]], None]] = None,
) -> None:
    """Run `fn(item)` for every item on warm actors; call `on_result(item, result, meta)` once per item
    with its final result (`fn`'s return value, or a `TaskFailure`), `meta` = {attempts, errors, node_id,
    worker_pid, gpu_ids, cuda_visible_devices}. `on_result` returns True for a success (progress bar).
    `on_start(item, meta)` is called when an item is handed to a worker. Ctrl-C kills the actors, reports
    the running items as `TaskFailure(kind=CANCELLED)` and re-raises."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor_cls = ray.remote(_Worker)
    entries = [_Entry(it, placement_for(it), key_for(it)) for it in items]
    # queued[shape][key] -> entries; keys keep first-seen order so workers walk through them
    queued: dict[tuple, dict[Any, deque]] = {}
    placements: dict[tuple, Placement] = {}
    for e in entries:
        queued.setdefault(e.placement.shape(), {}).setdefault(e.key, deque()).append(e)
        placements.setdefault(e.placement.shape(), e.placement)
    slots: dict[Any, _Slot] = {}  # ready_ref or run ref -> slot (one outstanding ref per slot)
    live: list[_Slot] = []
    done = failed = start_failures = 0
    last_progress = time.monotonic()

    def n_queued(shape: tuple) -> int:
        return sum(len(q) for q in queued.get(shape, {}).values())

    def meta_of(slot: _Slot, e: _Entry) -> dict[str, Any]:
        return {"attempts": e.attempts, "errors": list(e.errors), **slot.info}

    def spawn(shape: tuple, nodes: list[dict[str, Any]]) -> bool:
        p = placements[shape]
        opts = p.actor_options()
        node_id = None
        if p.isolation == EXCLUSIVE_NODE:
            taken = {s.node_id for s in live}
            free = [n for n in nodes if n["NodeID"] not in taken and fits(n.get("Resources", {}), p) > 0]
            if not free:
                return False
            node_id = free[0]["NodeID"]
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
        actor = actor_cls.options(**opts).remote(fn)
        slot = _Slot(actor=actor, shape=shape, ready_ref=actor.info.remote(), node_id=node_id)
        live.append(slot)
        slots[slot.ready_ref] = slot
        return True

    def top_up() -> None:
        """Keep as many workers per shape as the alive cluster fits and the queue needs."""
        nodes = None
        for shape in queued:
            want = n_queued(shape) + sum(1 for s in live if s.shape == shape and s.entry is not None)
            have = sum(1 for s in live if s.shape == shape)
            if have >= want:
                continue
            if nodes is None:
                nodes = alive_nodes()
            target = min(want, capacity(placements[shape], nodes))
            while have < target and spawn(shape, nodes):
                have += 1

    def retire(slot: _Slot) -> None:
        if slot in live:
            live.remove(slot)
        try:
            ray.kill(slot.actor, no_restart=True)
        except Exception:
            pass

    def next_entry(slot: _Slot) -> Optional[_Entry]:
        qs = queued.get(slot.shape, {})
        if slot.last_key in qs and qs[slot.last_key]:
            q = qs[slot.last_key]
        else:
            candidates = [k for k, q in qs.items() if q]
            if not candidates:
                return None
            held = {}
            for s in live:
                if s.shape == slot.shape and s.last_key is not None:
                    held[s.last_key] = held.get(s.last_key, 0) + 1
            # a key no other worker holds first: spreads workers over keys, so each key loads ~once
            q = qs[min(candidates, key=lambda k: held.get(k, 0))]
        return q.popleft()

    def dispatch(slot: _Slot) -> None:
        e = next_entry(slot)
        if e is None:
            retire(slot)  # nothing left for this shape: free its resources for other shapes
            return
        e.attempts += 1
        slot.entry, slot.last_key, slot.started = e, e.key, time.monotonic()
        if on_start is not None:
            on_start(e.item, meta_of(slot, e))
        slots[slot.actor.run.remote(e.item)] = slot

    def finish(e: _Entry, result: Any, meta: dict[str, Any]) -> None:
        nonlocal done, failed
        ok = on_result(e.item, result, meta)
        done += bool(ok)
        failed += not ok
        bar.update(1)

    def fail_queued(msg: str, kind: str) -> None:
        for qs in queued.values():
            for q in qs.values():
                while q:
                    e = q.popleft()
                    finish(e, TaskFailure(msg, kind), {"attempts": e.attempts, "errors": list(e.errors)})

    def fail_unplaceable() -> None:
        demand = "; ".join(str(p.demand()) for sh, p in placements.items() if n_queued(sh))
        fail_queued(f"no worker could be placed for {demand} within {placement_timeout_s:.0f} s", UNPLACEABLE)

    bar = tqdm(total=len(entries), desc=desc, unit="trial", dynamic_ncols=True)
    try:
        top_up()
        while any(s.entry is not None for s in live) or any(n_queued(s) for s in queued):
            running = sum(1 for s in live if s.entry is not None)
            bar.set_postfix(done=done, failed=failed, running=running,
                            queued=sum(n_queued(s) for s in queued), refresh=False)
            if not slots:  # items queued but no worker exists (all dead / none fits now)
                top_up()
                if not slots:
                    if time.monotonic() - last_progress > placement_timeout_s:
                        fail_unplaceable()
                        break
                    time.sleep(0.5)
                    continue
            ready, _ = ray.wait(list(slots), num_returns=1, timeout=1.0)
            if not ready:
                if not any(s.ready for s in live) and time.monotonic() - last_progress > placement_timeout_s:
                    for s in list(live):
                        slots.pop(s.ready_ref, None)
                        retire(s)
                    fail_unplaceable()
                    break
                continue
            ref = ready[0]
            slot = slots.pop(ref)
            last_progress = time.monotonic()
            if not slot.ready:  # actor start-up finished (or failed)
                try:
                    slot.info = ray.get(ref)
                    slot.node_id = slot.info["node_id"]
                    slot.ready = True
                    start_failures = 0
                except Exception as ex:
                    start_failures += 1
                    last_start_error = f"worker failed to start: {type(ex).__name__}: {ex}"
                    log.warning(last_start_error)
                    retire(slot)
                    if start_failures < 3:  # transient (its node just died): replace it
                        top_up()
                    elif not live:  # nothing can run the queue: fail it rather than respawn forever
                        fail_queued(last_start_error, DETERMINISTIC)
                        break
                    continue
                dispatch(slot)
                continue
            e = slot.entry
            slot.entry = None
            try:
                result = ray.get(ref)
            except Exception as ex:
                msg, retriable = classify(ex)
                e.errors.append(msg)
                retire(slot)  # a dead actor stays dead; a live one after an odd error is not trusted
                if retriable and e.attempts <= e.placement.max_retries:
                    log.warning("retrying after a worker failure (attempt %d): %s", e.attempts, msg.splitlines()[0])
                    queued[e.placement.shape()].setdefault(e.key, deque()).appendleft(e)
                    top_up()
                else:
                    finish(e, TaskFailure(msg, CRASHED if retriable else DETERMINISTIC), meta_of(slot, e))
                    top_up()
                continue
            meta = meta_of(slot, e)
            dispatch(slot)  # the worker starts its next item while the caller records this one
            finish(e, result, meta)
    except KeyboardInterrupt:
        for s in list(live):
            if s.entry is not None:
                s.entry.errors.append("interrupted")
                try:
                    on_result(s.entry.item, TaskFailure("interrupted (KeyboardInterrupt)", CANCELLED), meta_of(s, s.entry))
                except Exception as ex:  # recording must not hide the interrupt
                    log.warning("could not record an interrupted item: %s", ex)
        raise
    finally:
        bar.close()
        for s in list(live):
            retire(s)
