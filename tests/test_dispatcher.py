"""The dispatcher on a scripted cluster: no Ray, no sleeps. Workers start, items finish and workers die
exactly when a test says so, and time is a number the test moves, so every scheduling decision is
checked deterministically. tests/test_cluster.py checks the same paths on a real Ray cluster."""
from __future__ import annotations

import random
from typing import Any, Optional

import pytest

from cluster import CANCELLED, CRASHED, DETERMINISTIC, UNPLACEABLE, Dispatcher, Placement, TaskFailure, capacity
from cluster.dispatcher import MAX_START_FAILURES, Worker

DIED = "ActorDiedError: The actor died unexpectedly before finishing this task."


def node(name: str, cpus: float = 2, **res: float) -> dict[str, Any]:
    return {"NodeID": name, "Alive": True, "Resources": {"CPU": cpus, "memory": 64e9, **res}}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ScriptedPool:
    """A `WorkerPool` whose workers do nothing until the test reports for them."""

    def __init__(self, nodes: list[dict[str, Any]]):
        self.alive = list(nodes)
        self.spawned: list[Worker] = []
        self.running: dict[int, Any] = {}  # worker id -> item it was given
        self.submits: list[tuple[int, Any]] = []
        self.retired: list[int] = []

    def nodes(self) -> list[dict[str, Any]]:
        return list(self.alive)

    def spawn(self, worker: Worker, placement: Placement) -> None:
        self.spawned.append(worker)

    def submit(self, worker: Worker, item: Any) -> None:
        assert worker.id not in self.running, "two items at once on one worker"
        self.running[worker.id] = item
        self.submits.append((worker.id, item))

    def retire(self, worker: Worker) -> None:
        assert worker.id not in self.retired
        self.running.pop(worker.id, None)
        self.retired.append(worker.id)


class Sim:
    """A dispatcher wired to a scripted pool, a clock and a recording `on_result`."""

    def __init__(self, items, nodes=(node("n0"),), placement_for=lambda item: Placement(), key_for=lambda item: None,
                 timeout=600.0, on_start=None):
        self.clock = Clock()
        self.pool = ScriptedPool(list(nodes))
        self.results: list[tuple[Any, Any, dict[str, Any]]] = []
        self.running_when_recorded: list[dict[int, Any]] = []  # what the workers ran as each result came in
        self.starts: list[tuple[Any, dict[str, Any]]] = []
        self.d = Dispatcher(items, placement_for, key_for, self.pool, self._on_result,
                            on_start=on_start or (lambda item, meta: self.starts.append((item, meta))),
                            placement_timeout_s=timeout, clock=self.clock)
        self.d.start()

    def _on_result(self, item, result, meta) -> bool:
        self.results.append((item, result, meta))
        self.running_when_recorded.append(dict(self.pool.running))
        return not isinstance(result, TaskFailure)

    def pending(self) -> list[Worker]:
        return [w for w in self.d.live if not w.ready]

    def start(self, w: Worker, node_id: Optional[str] = None) -> None:
        self.d.worker_started(w, {"node_id": node_id or w.node_id or "n0", "worker_pid": 1000 + w.id})

    def start_all(self) -> None:
        for w in self.pending():
            self.start(w)

    def worker_of(self, item) -> Worker:
        (wid,) = [i for i, it in self.pool.running.items() if it == item]
        return next(w for w in self.d.live if w.id == wid)

    def finish(self, item) -> None:
        w = self.worker_of(item)
        del self.pool.running[w.id]
        self.d.trial_finished(w, ("ok", item))

    def fail(self, item, error: str = DIED, retriable: bool = True) -> None:
        w = self.worker_of(item)
        del self.pool.running[w.id]
        self.d.trial_failed(w, error, retriable)

    def run_to_end(self) -> None:
        while not self.d.finished:
            self.start_all()
            for item in list(self.pool.running.values()):
                self.finish(item)

    def result(self, item):
        (r,) = [(res, meta) for it, res, meta in self.results if it == item]
        return r


# --- affinity and ordering ------------------------------------------------------------------------
def test_items_with_one_key_stay_on_the_worker_that_holds_it():
    items = [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    s = Sim(items, key_for=lambda it: it[0])  # 2 CPUs: two workers
    assert len(s.pool.spawned) == 2
    s.run_to_end()
    by_worker: dict[int, list] = {}
    for wid, item in s.pool.submits:
        by_worker.setdefault(wid, []).append(item)
    assert sorted(by_worker.values()) == [[("a", 0), ("a", 1), ("a", 2)], [("b", 0), ("b", 1), ("b", 2)]]
    assert sorted(it for it, _, _ in s.results) == sorted(items)


def test_a_free_worker_takes_the_key_no_other_worker_holds():
    items = [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("c", 1), ("a", 2)]
    s = Sim(items, key_for=lambda it: it[0])
    s.start_all()
    assert sorted(s.pool.running.values()) == [("a", 0), ("b", 0)]
    s.finish(("b", 0))  # its worker's key ran out: "c" (held by none) rather than "a" (held by the other)
    assert sorted(s.pool.running.values()) == [("a", 0), ("c", 0)]


def test_one_worker_walks_the_keys_in_first_seen_order():
    items = [("a", 0), ("b", 0), ("a", 1), ("c", 0), ("b", 1)]
    s = Sim(items, nodes=[node("n0", cpus=1)], key_for=lambda it: it[0])
    s.run_to_end()
    assert [it for _, it in s.pool.submits] == [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("c", 0)]
    assert len(s.pool.spawned) == 1


def test_the_next_item_is_handed_over_before_the_last_result_is_recorded():
    s = Sim(["x", "y"], nodes=[node("n0", cpus=1)])
    s.run_to_end()
    (w,) = s.pool.spawned
    assert s.running_when_recorded == [{w.id: "y"}, {}]  # while x was recorded, its worker already ran y


# --- faults ---------------------------------------------------------------------------------------
def test_a_dead_worker_costs_an_attempt_and_the_item_reruns_on_a_fresh_worker():
    s = Sim([0, 1], nodes=[node("n0", cpus=1)], placement_for=lambda it: Placement(max_retries=2))
    s.start_all()
    first = s.worker_of(0)
    s.fail(0)
    assert s.pool.retired == [first.id] and s.results == []
    (fresh,) = s.pending()  # replaced at once
    s.start(fresh)
    assert s.pool.running == {fresh.id: 0}  # the retried item goes before the one that waited
    s.run_to_end()
    res, meta = s.result(0)
    assert res == ("ok", 0)
    assert meta["attempts"] == 2 and meta["errors"] == [DIED] and meta["worker_pid"] == 1000 + fresh.id
    assert s.result(1)[1]["attempts"] == 1
    assert [m["attempts"] for it, m in s.starts if it == 0] == [1, 2]
    assert len(s.results) == 2


def test_an_application_error_is_never_retried():
    s = Sim([0], placement_for=lambda it: Placement(max_retries=5))
    s.start_all()
    s.fail(0, "RayTaskError(ValueError): bad checkpoint", retriable=False)
    res, meta = s.result(0)
    assert isinstance(res, TaskFailure) and res.kind == DETERMINISTIC and "bad checkpoint" in res.error
    assert meta["attempts"] == 1
    assert len(s.pool.spawned) == 1 and s.d.finished


@pytest.mark.parametrize("max_retries", [0, 1, 3])
def test_retries_after_crashes_are_bounded_by_max_retries(max_retries):
    s = Sim([0], placement_for=lambda it: Placement(max_retries=max_retries))
    for _ in range(max_retries + 1):
        s.start_all()
        s.fail(0)
    res, meta = s.result(0)
    assert isinstance(res, TaskFailure) and res.kind == CRASHED and res.error == DIED
    assert meta["attempts"] == max_retries + 1 and meta["errors"] == [DIED] * (max_retries + 1)
    assert len(s.pool.spawned) == max_retries + 1 and s.d.finished and not s.d.live


def test_trials_of_a_dead_node_move_to_another_node():
    nodes = [node("n0"), node("n1")]
    s = Sim([0, 1, 2], nodes=nodes, placement_for=lambda it: Placement(isolation="exclusive-node", max_retries=2))
    assert sorted(w.node_id for w in s.pool.spawned) == ["n0", "n1"]
    s.start_all()
    on_n0 = next(it for wid, it in s.pool.running.items() if s.worker_of(it).node_id == "n0")
    s.pool.alive = [nodes[1]]  # n0 is gone with its worker
    s.fail(on_n0)
    assert not s.pending()  # n1 is taken: no second worker on it
    s.run_to_end()
    res, meta = s.result(on_n0)
    assert res == ("ok", on_n0) and meta["attempts"] == 2 and meta["node_id"] == "n1"
    assert len(s.results) == 3


def test_workers_that_fail_to_start_are_replaced_then_the_queue_fails():
    s = Sim([0, 1], nodes=[node("n0", cpus=1)])
    for i in range(MAX_START_FAILURES - 1):
        (w,) = s.pending()
        s.d.worker_failed_to_start(w, "RuntimeEnvSetupError: no such package")
    assert s.results == []
    (w,) = s.pending()
    s.d.worker_failed_to_start(w, "RuntimeEnvSetupError: no such package")
    assert [it for it, _, _ in s.results] == [0, 1]
    for _, res, meta in s.results:
        assert res.kind == DETERMINISTIC and "worker failed to start: RuntimeEnvSetupError" in res.error
        assert meta["attempts"] == 0
    assert s.d.finished and len(s.pool.spawned) == MAX_START_FAILURES


def test_a_worker_that_starts_resets_the_start_failure_count():
    s = Sim([0, 1, 2], nodes=[node("n0", cpus=1)])
    for _ in range(MAX_START_FAILURES - 1):
        s.d.worker_failed_to_start(s.pending()[0], "NodeDiedError")
    s.start_all()
    s.fail(0, retriable=True)
    for _ in range(MAX_START_FAILURES - 1):
        s.d.worker_failed_to_start(s.pending()[0], "NodeDiedError")
    s.run_to_end()
    assert [res for _, res, _ in s.results] == [("ok", 0), ("ok", 1), ("ok", 2)]


def test_ctrl_c_reports_the_running_items_as_cancelled_and_nothing_else():
    s = Sim([0, 1, 2])
    s.start_all()
    s.d.cancel_running()
    assert [(it, res.kind) for it, res, _ in s.results] == [(0, CANCELLED), (1, CANCELLED)]
    assert all(meta["errors"] == ["interrupted"] for _, _, meta in s.results)
    s.d.close()
    assert not s.d.live and sorted(s.pool.retired) == [0, 1]


# --- placement ------------------------------------------------------------------------------------
def test_no_more_workers_than_the_alive_nodes_fit_or_the_queue_needs():
    nodes = [node("n0", cpus=2), node("n1", cpus=1)]
    assert len(Sim(range(10), nodes=nodes).pool.spawned) == 3
    assert len(Sim(range(10), nodes=nodes, placement_for=lambda it: Placement(num_cpus=2)).pool.spawned) == 1
    assert len(Sim(range(2), nodes=nodes).pool.spawned) == 2
    s = Sim(range(10), nodes=nodes)
    while not s.d.finished:
        assert len(s.d.live) <= 3
        s.start_all()
        s.finish(next(iter(s.pool.running.values())))
    assert len(s.results) == 10


def test_exclusive_node_workers_get_one_node_each():
    nodes = [node("n0"), node("n1"), node("small", cpus=0.5)]
    s = Sim(range(5), nodes=nodes, placement_for=lambda it: Placement(isolation="exclusive-node"))
    assert sorted(w.node_id for w in s.pool.spawned) == ["n0", "n1"]
    s.run_to_end()
    assert len(s.pool.spawned) == 2 and {m["node_id"] for _, _, m in s.results} == {"n0", "n1"}


def test_shapes_get_their_own_workers_and_a_worker_retires_when_its_shape_is_done():
    small, big = Placement(num_cpus=1), Placement(num_cpus=2)
    s = Sim(["s0", "s1", "b0"], nodes=[node("n0", cpus=2)], placement_for=lambda it: big if it[0] == "b" else small)
    assert sorted(w.shape for w in s.pool.spawned) == sorted([small.shape()] * 2 + [big.shape()])
    s.run_to_end()
    assert {it for _, it in s.pool.submits} == {"s0", "s1", "b0"}
    assert not s.d.live and sorted(s.pool.retired) == [0, 1, 2]


def test_unplaceable_items_fail_once_the_timeout_passes_on_the_clock():
    gpu = Placement(resources=(("accel", 1.0),))
    s = Sim(["cpu", "gpu"], placement_for=lambda it: gpu if it == "gpu" else Placement(), timeout=600)
    s.start_all()
    s.clock.now = 5.0
    s.finish("cpu")  # the last progress
    assert not s.d.live and not s.d.finished
    s.clock.now = 5.0 + 600
    s.d.idle()
    assert [it for it, _, _ in s.results] == ["cpu"]
    s.clock.now = 5.0 + 600.5
    s.d.idle()
    res, meta = s.result("gpu")
    assert res.kind == UNPLACEABLE and "'accel': 1.0" in res.error and "within 600 s" in res.error
    assert meta == {"attempts": 0, "errors": []} and s.d.finished


def test_workers_that_never_start_are_given_up_after_the_timeout():
    s = Sim([0, 1], nodes=[node("n0", cpus=1)], timeout=10)
    (w,) = s.pending()
    s.clock.now = 9.0
    s.d.idle()
    assert s.d.live == (w,) and not s.results
    s.clock.now = 11.0
    s.d.idle()
    assert not s.d.live and s.pool.retired == [w.id]
    assert [res.kind for _, res, _ in s.results] == [UNPLACEABLE, UNPLACEABLE]


def test_a_long_running_item_is_not_a_placement_timeout():
    s = Sim([0, 1], nodes=[node("n0", cpus=1)], timeout=10)
    s.start_all()
    s.clock.now = 1e6
    s.d.idle()
    assert not s.results
    s.run_to_end()
    assert [res for _, res, _ in s.results] == [("ok", 0), ("ok", 1)]


def test_a_node_that_joins_later_gets_the_waiting_items():
    s = Sim([0], nodes=[], timeout=600)
    assert not s.pool.spawned
    s.clock.now = 100
    s.d.idle()
    assert not s.pool.spawned and not s.results
    s.pool.alive = [node("late")]
    s.d.idle()
    (w,) = s.pending()
    s.start(w, "late")
    s.clock.now = 10_000  # a long trial: no placement timeout while a worker runs
    s.d.idle()
    s.finish(0)
    assert s.result(0) == (("ok", 0), {"attempts": 1, "errors": [], "node_id": "late", "worker_pid": 1000})


# --- every item exactly once, whatever happens ------------------------------------------------------
@pytest.mark.parametrize("seed", range(25))
def test_every_item_is_reported_exactly_once_under_random_faults(seed):
    rng = random.Random(seed)
    nodes = [node("n0", cpus=2), node("n1", cpus=1, accel=1)]
    shapes = [Placement(max_retries=rng.randint(0, 2)), Placement(num_cpus=1, resources=(("accel", 1.0),)),
              Placement(isolation="exclusive-node", max_retries=1), Placement(resources=(("nowhere", 1.0),))]
    items = [(i, rng.randrange(len(shapes)), rng.choice("ab")) for i in range(30)]
    s = Sim(items, nodes=nodes, placement_for=lambda it: shapes[it[1]], key_for=lambda it: it[2], timeout=50)
    for _ in range(10_000):
        if s.d.finished:
            break
        for w in s.d.live:  # the invariant the Ray loop relies on: one start or one item outstanding per worker
            assert (w.id in s.pool.running) == w.ready
        for sh in shapes:
            assert sum(w.shape == sh.shape() for w in s.d.live) <= capacity(sh, nodes)
        s.clock.now += rng.random() * 5
        pending, running = s.pending(), list(s.pool.running.values())
        roll = rng.random()
        if pending and roll < 0.3:
            w = rng.choice(pending)
            if rng.random() < 0.1:
                s.d.worker_failed_to_start(w, "NodeDiedError")
            else:
                s.start(w)
        elif running and roll < 0.9:
            item, fate = rng.choice(running), rng.random()
            if fate < 0.7:
                s.finish(item)
            else:
                s.fail(item, DIED if fate < 0.9 else "RayTaskError: boom", retriable=fate < 0.9)
        else:
            s.d.idle()
    assert s.d.finished
    assert sorted(it for it, _, _ in s.results) == sorted(items)
    for item, res, meta in s.results:
        if item[1] == 3:  # never placed: timed out, or failed with the queue when workers kept failing to start
            assert res.kind in (UNPLACEABLE, DETERMINISTIC) and meta["attempts"] == 0
        if isinstance(res, TaskFailure) and res.kind == CRASHED:
            assert meta["attempts"] == shapes[item[1]].max_retries + 1
        assert meta["attempts"] <= shapes[item[1]].max_retries + 1
    s.d.close()
    assert not s.d.live


def test_an_unknown_event_is_refused():
    from cluster.dispatcher import WorkerEvent

    s = Sim([0])
    (w,) = s.pending()
    with pytest.raises(ValueError, match="unknown worker event 'exploded'"):
        s.d.handle(WorkerEvent(w, "exploded"))


# --- the in-process pool: the same dispatcher, one worker, this process ------------------------------------
class State:
    """A worker's warm state; records what it ran and whether it was released."""

    made: list["State"] = []

    def __init__(self) -> None:
        self.ran: list[Any] = []
        self.released = False
        State.made.append(self)

    def release(self) -> None:
        self.released = True


def _local(items, fn, key_for=lambda it: None, placement_for=lambda it: Placement(), make_state=State):
    from cluster import Job, run_in_process

    State.made = []
    results, starts = [], []

    def on_result(item, res, meta):
        results.append((item, res, meta))
        return not isinstance(res, TaskFailure)

    run_in_process(fn, Job(items, placement_for, on_result, key_for=key_for,
                           on_start=lambda item, meta: starts.append((item, meta))), worker_state=make_state)
    return results, starts


def _remember(item, state):
    state.ran.append(item)
    return ("ok", item)


def test_in_process_items_run_one_at_a_time_in_key_order_on_one_warm_state():
    import os

    from cluster import LOCAL_NODE

    items = [("a", 0), ("b", 0), ("a", 1), ("c", 0), ("b", 1)]
    # placements that would need two nodes on Ray mean nothing here: one worker runs everything
    shapes = {"a": Placement(num_gpus=1), "b": Placement(isolation="exclusive-node"), "c": Placement(num_cpus=64)}
    results, starts = _local(items, _remember, key_for=lambda it: it[0], placement_for=lambda it: shapes[it[0]])
    (state,) = State.made
    assert state.ran == [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("c", 0)]  # the dispatcher's affinity order
    assert [it for it, _, _ in results] == state.ran and [it for it, _ in starts] == state.ran
    assert all(res == ("ok", it) for it, res, _ in results)
    assert {(m["node_id"], m["worker_pid"], m["attempts"]) for _, _, m in results} == {(LOCAL_NODE, os.getpid(), 1)}
    assert state.released  # the worker retired when the queue ran out


def test_in_process_an_error_fails_its_item_once_and_the_next_item_gets_a_fresh_worker():
    def fn(item, state):
        if item == 1:
            raise RuntimeError("bad checkpoint")
        return _remember(item, state)

    results, _ = _local([0, 1, 2], fn, placement_for=lambda it: Placement(max_retries=3))
    assert [it for it, _, _ in results] == [0, 1, 2]
    res, meta = results[1][1:]
    assert isinstance(res, TaskFailure) and res.kind == DETERMINISTIC  # never retried, whatever max_retries
    assert res.error.startswith("RuntimeError: bad checkpoint") and "Traceback" in res.error
    assert meta["attempts"] == 1
    first, second = State.made
    assert first.ran == [0] and first.released  # the worker that saw the error is not trusted again
    assert second.ran == [2] and second.released


def test_in_process_ctrl_c_reports_the_running_item_cancelled_and_releases_the_state():
    def fn(item, state):
        if item == 1:
            raise KeyboardInterrupt
        return _remember(item, state)

    from cluster import Job, run_in_process

    State.made, results = [], []
    with pytest.raises(KeyboardInterrupt):
        run_in_process(fn, Job([0, 1, 2], lambda it: Placement(),
                               lambda item, res, meta: results.append((item, res, meta)) or True), worker_state=State)
    assert [(it, getattr(res, "kind", None)) for it, res, _ in results] == [(0, None), (1, CANCELLED)]
    assert results[1][2]["errors"] == ["interrupted"]  # item 2 never started: no result at all
    (state,) = State.made
    assert state.released


def test_in_process_a_state_that_cannot_be_built_fails_the_queue():
    def broken():
        raise OSError("no such model cache")

    results, starts = _local([0, 1], _remember, make_state=broken)
    assert not starts
    for _, res, meta in results:
        assert res.kind == DETERMINISTIC and "worker failed to start: OSError: no such model cache" in res.error
        assert meta["attempts"] == 0


def test_an_interrupt_while_the_next_item_is_handed_out_still_records_the_finished_one():
    def interrupt_at_y(item, meta):
        if item == "y":
            raise KeyboardInterrupt

    s = Sim(["x", "y"], nodes=[node("n0", cpus=1)], on_start=interrupt_at_y)
    s.start_all()
    with pytest.raises(KeyboardInterrupt):
        s.finish("x")
    s.d.cancel_running()
    assert [(it, getattr(res, "kind", res)) for it, res, _ in s.results] == [("x", ("ok", "x")), ("y", CANCELLED)]


def test_a_long_trial_keeps_the_bar_moving_in_a_terminal_and_quiet_in_a_log():
    """While a trial runs, each call redraws the bar in a terminal (its elapsed time moves: not a bare `0/1` for
    minutes); written to a log file, nothing is added until a count changes."""
    import io
    import types

    from tqdm.auto import tqdm

    from cluster.dispatcher import Progress, _show

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    running = types.SimpleNamespace(progress=lambda: Progress(0, 0, 1, 0))
    for stream, redrawn in ((Terminal(), True), (io.StringIO(), False)):
        bar = tqdm(total=1, file=stream, mininterval=0, ascii=True)
        _show(bar, running)
        before = len(stream.getvalue())
        _show(bar, running)
        assert (len(stream.getvalue()) > before) == redrawn
        bar.close()
