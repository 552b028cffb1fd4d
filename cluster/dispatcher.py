"""Which item runs on which worker, and what happens when one dies: the scheduling of every sweep, with no
Ray in it.

The `Dispatcher` owns the queue and every worker's state. The workers themselves live behind a
`WorkerPool` (Ray actors in `ray_pool`, this process in `local_pool`, a scripted cluster in the tests), which
reports back what happened to them as `WorkerEvent`s: a worker started or failed to start, an item finished
or failed. `run_pool` is the one loop that feeds a pool's events to a dispatcher, for every pool. Time comes
from an injected clock, so the placement timeout is exercised without sleeping.

- Affinity: a worker takes the next item with the key it ran last (the model it holds); a fresh worker
  takes the key the fewest workers hold, so each key is loaded about once.
- Placement limits: per shape, no more workers than the alive nodes fit (`capacity`) and the queue needs;
  an exclusive-node worker is pinned to a node no other worker holds.
- Faults: an item whose worker died (retriable) goes back to the front of its queue, at most `max_retries`
  times; a deterministic failure is never retried. Items no worker could be placed for within
  `placement_timeout_s` fail as UNPLACEABLE. `on_result` sees every item exactly once.
- Ctrl-C: the running items are reported CANCELLED, the queued ones not at all, every worker is retired.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

from .config import ClusterConfig
from .placement import EXCLUSIVE_NODE, Placement, capacity, fits

log = logging.getLogger(__name__)

# TaskFailure.kind
CRASHED = "crashed"  # the worker or its node died, past the retries
DETERMINISTIC = "deterministic"  # fn raised / Ray's OOM killer: retrying would fail the same way
CANCELLED = "cancelled"  # the run was interrupted (Ctrl-C) while this item was running
UNPLACEABLE = "unplaceable"  # no worker could be placed for it within the placement timeout

# Consecutive workers that die before their first item: past this, a start failure is taken as
# permanent (a bad runtime env, say) instead of a node that just went away.
MAX_START_FAILURES = 3


@dataclass
class TaskFailure:
    """The item never produced a result of `fn`."""

    error: str
    kind: str = CRASHED


@dataclass(eq=False)
class Entry:
    """One item and its attempts so far."""

    item: Any
    placement: Placement
    key: Any
    attempts: int = 0
    errors: list[str] = field(default_factory=list)
    reported: bool = False  # on_result has seen it; it must not see it again


@dataclass(eq=False)
class Worker:
    """A worker as the dispatcher sees it; the pool maps `id` to the real thing."""

    id: int
    shape: tuple
    node_id: Optional[str] = None  # known once started (or chosen up front: exclusive-node)
    info: dict[str, Any] = field(default_factory=dict)
    ready: bool = False
    last_key: Any = None  # key of the last item it was given: what it holds warm
    entry: Optional[Entry] = None  # the item it is running


# WorkerEvent.kind
STARTED, START_FAILED, FINISHED, FAILED = "started", "start_failed", "finished", "failed"


@dataclass(frozen=True)
class WorkerEvent:
    """What happened to one worker. `value`: its start info (STARTED: where it runs, with `node_id`), the
    item's result (FINISHED) or an error message (START_FAILED, FAILED). `retriable` (FAILED): the worker or
    its node died, rather than the item's function raising."""

    worker: Worker
    kind: str
    value: Any = None
    retriable: bool = False


class WorkerPool(Protocol):
    """The operations the dispatcher needs on real workers. Each spawned worker later reports exactly one
    of started / failed to start, and each submitted item exactly one of finished / failed, unless the
    worker was retired first."""

    @property
    def busy(self) -> bool:
        """A start or an item is outstanding on some worker (`wait` has something to wait for)."""

    def wait(self, timeout_s: float) -> Optional[WorkerEvent]:
        """The next event; None when none came within `timeout_s` (at once when the pool is not busy)."""

    def nodes(self) -> list[dict[str, Any]]:
        """The alive nodes, shaped like `ray.nodes()` entries ({"NodeID", "Resources", ...})."""

    def spawn(self, worker: Worker, placement: Placement) -> None:
        """Start a worker with `placement`'s resources, on `worker.node_id` when that is set."""

    def submit(self, worker: Worker, item: Any) -> None:
        """Run `item` on a started worker."""

    def retire(self, worker: Worker) -> None:
        """Stop the worker and drop whatever it still has outstanding."""


@dataclass(frozen=True)
class Progress:
    done: int  # on_result said success
    failed: int
    running: int
    queued: int


class Dispatcher:
    """Feed it events (`worker_started`, `worker_failed_to_start`, `trial_finished`, `trial_failed`,
    `idle`) until `finished`; it calls the pool and `on_result(item, result, meta)` in response.
    `meta` = {attempts, errors, **the worker's start info}; `on_result` returns True for a success."""

    def __init__(
        self,
        items: Sequence[Any],
        placement_for: Callable[[Any], Placement],
        key_for: Callable[[Any], Any],
        pool: WorkerPool,
        on_result: Callable[[Any, Any, dict[str, Any]], bool],
        on_start: Optional[Callable[[Any, dict[str, Any]], None]] = None,
        placement_timeout_s: float = ClusterConfig.placement_timeout_s,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._pool = pool
        self._on_result = on_result
        self._on_start = on_start
        self._placement_timeout_s = placement_timeout_s
        self._clock = clock
        # queued[shape][key] -> entries; keys keep first-seen order so workers walk through them
        self._queued: dict[tuple, dict[Any, deque[Entry]]] = {}
        self._placements: dict[tuple, Placement] = {}
        for it in items:
            e = Entry(it, placement_for(it), key_for(it))
            self._queued.setdefault(e.placement.shape(), {}).setdefault(e.key, deque()).append(e)
            self._placements.setdefault(e.placement.shape(), e.placement)
        self._live: list[Worker] = []  # spawned and not retired; each has one start or item outstanding
        self._next_id = 0
        self._done = self._failed = 0
        self._start_failures = 0
        self._last_progress = clock()

    # --- state ------------------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return not any(w.entry is not None for w in self._live) and not self._n_queued()

    @property
    def live(self) -> tuple[Worker, ...]:
        return tuple(self._live)

    def progress(self) -> Progress:
        running = sum(1 for w in self._live if w.entry is not None)
        return Progress(self._done, self._failed, running, self._n_queued())

    # --- events -----------------------------------------------------------------------------------
    def start(self) -> None:
        self._top_up()

    def handle(self, ev: WorkerEvent) -> None:
        """Apply one event a pool reported."""
        if ev.kind == STARTED:
            self.worker_started(ev.worker, ev.value)
        elif ev.kind == START_FAILED:
            self.worker_failed_to_start(ev.worker, ev.value)
        elif ev.kind == FINISHED:
            self.trial_finished(ev.worker, ev.value)
        elif ev.kind == FAILED:
            self.trial_failed(ev.worker, ev.value, ev.retriable)
        else:
            raise ValueError(f"unknown worker event {ev.kind!r}")

    def worker_started(self, worker: Worker, info: dict[str, Any]) -> None:
        """`info` describes where it runs; it must name its `node_id`."""
        self._heard_from(worker)
        assert not worker.ready, f"worker {worker.id} started twice"
        worker.info = dict(info)
        worker.node_id = info["node_id"]
        worker.ready = True
        self._start_failures = 0
        self._dispatch(worker)

    def worker_failed_to_start(self, worker: Worker, error: str) -> None:
        self._heard_from(worker)
        self._start_failures += 1
        msg = f"worker failed to start: {error}"
        log.warning(msg)
        self._retire(worker)
        if self._start_failures < MAX_START_FAILURES:  # transient (its node just died): replace it
            self._top_up()
        elif not self._live:  # nothing can run the queue: fail it rather than respawn forever
            self._fail_queued(msg, DETERMINISTIC)

    def trial_finished(self, worker: Worker, result: Any) -> None:
        e = self._take(worker)
        meta = self._meta(worker, e)
        try:
            self._dispatch(worker)  # the worker starts its next item while the caller records this one
        finally:  # a Ctrl-C while handing out the next item must not lose this result
            self._report(e, result, meta)

    def trial_failed(self, worker: Worker, error: str, retriable: bool) -> None:
        """The item raised (`retriable=False`) or its worker / node died (`retriable=True`)."""
        e = self._take(worker)
        e.errors.append(error)
        self._retire(worker)  # a dead worker stays dead; a live one after an odd error is not trusted
        if retriable and e.attempts <= e.placement.max_retries:
            log.warning("retrying after a worker failure (attempt %d): %s", e.attempts, error.splitlines()[0])
            self._queued[e.placement.shape()].setdefault(e.key, deque()).appendleft(e)
        else:
            self._report(e, TaskFailure(error, CRASHED if retriable else DETERMINISTIC), self._meta(worker, e))
        self._top_up()

    def idle(self) -> None:
        """No worker reported anything for a while. With no worker at all, try to place some; when none
        has started since `placement_timeout_s`, give up on the queue (UNPLACEABLE)."""
        if not self._live:
            self._top_up()
            if self._live:
                return
        elif any(w.ready for w in self._live):
            return  # busy workers: waiting is progress
        if self._clock() - self._last_progress > self._placement_timeout_s:
            for w in list(self._live):
                self._retire(w)
            demand = "; ".join(str(p.demand()) for sh, p in self._placements.items() if self._n_queued(sh))
            self._fail_queued(f"no worker could be placed for {demand} within {self._placement_timeout_s:.0f} s",
                              UNPLACEABLE)

    def cancel_running(self) -> None:
        """The run is being interrupted: report the running items as CANCELLED (the queued ones get no
        result at all, as they never started)."""
        for w in self._live:
            e, w.entry = w.entry, None
            if e is None:
                continue
            e.errors.append("interrupted")
            try:
                self._report(e, TaskFailure("interrupted (KeyboardInterrupt)", CANCELLED), self._meta(w, e))
            except Exception as ex:  # recording must not hide the interrupt
                log.warning("could not record an interrupted item: %s", ex)

    def close(self) -> None:
        """Retire every worker still alive (idle ones, or ones still starting)."""
        for w in list(self._live):
            self._retire(w)

    # --- internals --------------------------------------------------------------------------------
    def _n_queued(self, shape: Optional[tuple] = None) -> int:
        shapes = self._queued if shape is None else [shape]
        return sum(len(q) for sh in shapes for q in self._queued.get(sh, {}).values())

    def _heard_from(self, worker: Worker) -> None:
        assert worker in self._live, f"event from retired worker {worker.id}"
        self._last_progress = self._clock()

    def _take(self, worker: Worker) -> Entry:
        self._heard_from(worker)
        e, worker.entry = worker.entry, None
        assert e is not None, f"worker {worker.id} reported an item it was not running"
        return e

    @staticmethod
    def _meta(worker: Worker, e: Entry) -> dict[str, Any]:
        return {"attempts": e.attempts, "errors": list(e.errors), **worker.info}

    def _report(self, e: Entry, result: Any, meta: dict[str, Any]) -> None:
        assert not e.reported, f"{e.item!r} reported twice"
        e.reported = True
        ok = self._on_result(e.item, result, meta)
        self._done += bool(ok)
        self._failed += not ok

    def _fail_queued(self, msg: str, kind: str) -> None:
        for qs in self._queued.values():
            for q in qs.values():
                while q:
                    e = q.popleft()
                    self._report(e, TaskFailure(msg, kind), {"attempts": e.attempts, "errors": list(e.errors)})

    def _spawn(self, shape: tuple, nodes: list[dict[str, Any]]) -> bool:
        p = self._placements[shape]
        worker = Worker(id=self._next_id, shape=shape)
        if p.isolation == EXCLUSIVE_NODE:
            taken = {w.node_id for w in self._live}
            free = [n for n in nodes if n["NodeID"] not in taken and fits(n.get("Resources", {}), p) > 0]
            if not free:
                return False
            worker.node_id = free[0]["NodeID"]
        self._pool.spawn(worker, p)
        self._next_id += 1
        self._live.append(worker)
        return True

    def _top_up(self) -> None:
        """Keep as many workers per shape as the alive nodes fit and the queue needs."""
        nodes = None  # asked for only when a shape needs workers (a cluster-wide query)
        for shape in self._queued:
            have = sum(1 for w in self._live if w.shape == shape)
            want = self._n_queued(shape) + sum(1 for w in self._live if w.shape == shape and w.entry is not None)
            if have >= want:
                continue
            if nodes is None:
                nodes = self._pool.nodes()
            target = min(want, capacity(self._placements[shape], nodes))
            while have < target and self._spawn(shape, nodes):
                have += 1

    def _retire(self, worker: Worker) -> None:
        self._live.remove(worker)
        self._pool.retire(worker)

    def _next_entry(self, worker: Worker) -> Optional[Entry]:
        qs = self._queued.get(worker.shape, {})
        if worker.last_key in qs and qs[worker.last_key]:
            return qs[worker.last_key].popleft()
        candidates = [k for k, q in qs.items() if q]
        if not candidates:
            return None
        held: dict[Any, int] = {}
        for w in self._live:
            if w.shape == worker.shape and w.last_key is not None:
                held[w.last_key] = held.get(w.last_key, 0) + 1
        # a key no other worker holds first: spreads workers over keys, so each key loads ~once
        return qs[min(candidates, key=lambda k: held.get(k, 0))].popleft()

    def _dispatch(self, worker: Worker) -> None:
        e = self._next_entry(worker)
        if e is None:
            self._retire(worker)  # nothing left for this shape: free its resources for other shapes
            return
        e.attempts += 1
        worker.entry, worker.last_key = e, e.key
        if self._on_start is not None:
            self._on_start(e.item, self._meta(worker, e))
        self._pool.submit(worker, e.item)


def _show(bar, d: Dispatcher) -> None:
    """The counts as the bar's postfix; in a terminal the bar is redrawn at every call (each second while trials
    run), so its elapsed time moves during a trial of minutes instead of a bare `0/1` (a log file gets a line per
    change only)."""
    p = d.progress()
    bar.set_postfix(done=p.done, failed=p.failed, running=p.running, queued=p.queued, refresh=False)
    if p.done + p.failed > bar.n:
        bar.update(p.done + p.failed - bar.n)
    elif p.running and _is_terminal(bar):
        bar.refresh()


def _is_terminal(bar) -> bool:
    fp = getattr(bar, "fp", None)
    try:
        return bool(fp is not None and fp.isatty())
    except (AttributeError, ValueError):
        return False


def _no_key(item: Any) -> Any:
    return None


@dataclass(frozen=True)
class Job:
    """What a pool runs, whichever pool (`run_pool`, `run_in_process`, `run_on_ray`): the items, where each may
    run (`placement_for(item)`), which share a worker's warm state (`key_for(item)`: equal keys prefer one
    worker; None never shares), and the callbacks. `on_result(item, result, meta)` is called exactly once per
    item, `result` being what the worker returned or a `TaskFailure`, `meta` = {attempts, errors, **the worker's
    start info}; it returns True for a success (progress bar). `on_start(item, meta)` is called as an item is
    handed to a worker."""

    items: Sequence[Any]
    placement_for: Callable[[Any], Placement]
    on_result: Callable[[Any, Any, dict[str, Any]], bool]
    key_for: Callable[[Any], Any] = _no_key
    desc: str = "trials"  # the progress bar's label
    placement_timeout_s: float = ClusterConfig.placement_timeout_s
    on_start: Optional[Callable[[Any, dict[str, Any]], None]] = None


def run_pool(pool: WorkerPool, job: Job, progress: bool = True) -> None:
    """Dispatch `job.items` on `pool` until each has its final result (`Job` says what is called when). Ctrl-C
    reports the running items as `TaskFailure(kind=CANCELLED)`, retires every worker and re-raises."""
    from tqdm.auto import tqdm

    items = job.items
    d = Dispatcher(items, job.placement_for, job.key_for, pool, job.on_result, on_start=job.on_start,
                   placement_timeout_s=job.placement_timeout_s, clock=time.monotonic)
    bar = tqdm(total=len(items), desc=job.desc, unit="trial", dynamic_ncols=True, disable=not progress)
    try:
        d.start()
        while not d.finished:
            _show(bar, d)
            ev = pool.wait(timeout_s=1.0)
            if ev is None:  # nothing happened: waiting is progress, unless no worker could be placed
                d.idle()
                if not pool.busy and not d.finished:  # items queued but no worker exists (all dead / none fits)
                    time.sleep(0.5)
                continue
            d.handle(ev)
    except KeyboardInterrupt:
        d.cancel_running()
        raise
    finally:
        _show(bar, d)
        bar.close()
        d.close()
