"""A pool of one worker: this process. `run_in_process` takes items through the same `Dispatcher` and
`run_pool` loop as `run_on_ray`, so a sweep run with `--in-process` has the same affinity order, the same
results (`on_result` exactly once per item, `TaskFailure`s included), the same `on_start` and the same
Ctrl-C behaviour (the running item CANCELLED, the queued ones never started) as one on Ray.

What one process cannot give, and how it differs:
- Resources and isolation mean nothing here: every item runs in this process, one at a time, whatever its
  `Placement` asks for (only `max_retries` is kept), so nothing is ever UNPLACEABLE.
- No retries: a worker crash is the driver's crash (a segfault, the OOM killer), which takes the sweep
  with it; what already finished is recorded, and `infersweep sweep` again resumes from there. An exception
  escaping `fn` is an application error, as a `RayTaskError` is on Ray: the item fails (DETERMINISTIC),
  never retried, and the sweep goes on.
- Warm state: the worker builds `worker_state()` when it starts, as an actor does. After a failed item
  the worker is retired like an actor (a worker that saw an odd error is not trusted) and its state is
  released (`state.release()` when it has one; an actor's dies with its process); the next worker builds
  a fresh one.
"""
from __future__ import annotations

import dataclasses
import os
import traceback
from collections import deque
from typing import Any, Callable, Optional

from .dispatcher import FAILED, FINISHED, START_FAILED, STARTED, Job, Worker, WorkerEvent, run_pool
from .placement import Placement

LOCAL_NODE = "in-process"  # the node_id an in-process worker reports (it is no Ray node)

# the one node this pool has; it fits exactly one worker of the one shape `run_in_process` gives every item
_NODE = {"NodeID": LOCAL_NODE, "Alive": True, "Resources": {"CPU": 1.0}}


def _one_slot(p: Placement) -> Placement:
    return Placement(num_cpus=1.0, max_retries=p.max_retries)


class LocalPool:
    """The dispatcher's `WorkerPool` in this process. Spawning and submitting only queue the work; `wait`
    runs the next queued start or item, synchronously, and reports what happened."""

    def __init__(self, fn: Callable[..., Any], make_state: Optional[Callable[[], Any]] = None):
        self._fn, self._make_state = fn, make_state
        self._states: dict[int, Any] = {}  # worker id -> its state, once started
        self._todo: deque[tuple[Worker, bool, Any]] = deque()  # (worker, is start, item)

    def nodes(self) -> list[dict[str, Any]]:
        return [_NODE]

    def spawn(self, worker: Worker, placement: Placement) -> None:
        self._todo.append((worker, True, None))

    def submit(self, worker: Worker, item: Any) -> None:
        self._todo.append((worker, False, item))

    def retire(self, worker: Worker) -> None:
        self._todo = deque(t for t in self._todo if t[0] is not worker)
        state = self._states.pop(worker.id, None)
        if state is not None and callable(getattr(state, "release", None)):
            state.release()

    @property
    def busy(self) -> bool:
        return bool(self._todo)

    def wait(self, timeout_s: float) -> Optional[WorkerEvent]:
        """Runs the next start or item now (`timeout_s` does not apply: the work happens in this call)."""
        if not self._todo:
            return None
        worker, is_start, item = self._todo.popleft()
        if is_start:
            try:
                self._states[worker.id] = self._make_state() if self._make_state is not None else None
            except Exception as ex:
                return WorkerEvent(worker, START_FAILED, f"{type(ex).__name__}: {ex}")
            return WorkerEvent(worker, STARTED, {"node_id": LOCAL_NODE, "worker_pid": os.getpid()})
        try:
            result = self._fn(item) if self._make_state is None else self._fn(item, self._states[worker.id])
        except Exception as ex:  # KeyboardInterrupt is not caught: run_pool reports the item CANCELLED
            return WorkerEvent(worker, FAILED, f"{type(ex).__name__}: {ex}\n\n{traceback.format_exc()}")
        return WorkerEvent(worker, FINISHED, result)


def run_in_process(fn: Callable[..., Any], job: Job, worker_state: Optional[Callable[[], Any]] = None) -> None:
    """`run_on_ray`'s contract, on one worker in this process (see the module's notes for what differs);
    `meta` = {attempts, errors, node_id ("in-process"), worker_pid}. A single item shows no progress bar."""
    placement_for = job.placement_for
    run_pool(LocalPool(fn, worker_state), dataclasses.replace(job, placement_for=lambda it: _one_slot(placement_for(it))),
             progress=len(job.items) > 1)
