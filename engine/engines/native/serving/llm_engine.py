"""The serving loop: requests arrive on the wall clock, the scheduler picks each step's chunks, the model
runner computes them, the sampler picks tokens, the scheduler accounts for them.

Time is real: a request is released to the scheduler once `arrival_s` seconds have passed since the
start of the run (immediately when the loop is busy past it; the loop sleeps when nothing is runnable
before the next arrival). Its latency counts from its arrival -- or, with a client-side
`max_concurrency`, from when a finishing request let it be sent. A token's time is the end of the step
that produced it (after the device synchronized).
"""
from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

from .model_runner import ModelRunner
from .sampler import Sampler
from .scheduler import Scheduler, SchedulerStats
from .sequence import Sequence
from ....serving.requests import Request, RequestRecord


@dataclass
class RequestTimeline:
    """The engine loop's record of one request (its only owner); seconds since the start of the run."""

    sent_s: float
    token_times_s: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class ServingTrace:
    requests: tuple[RequestRecord, ...]  # by request id
    duration_s: float  # start of the run -> last token
    steps: int  # forward passes
    step_seqs: int  # sequences summed over steps
    step_tokens: int  # tokens summed over steps
    stats: SchedulerStats
    kv_pool_bytes: int
    kv_peak_bytes: int  # most bytes of blocks held at once

    def scheduler_metrics(self) -> dict[str, float]:
        """What the scheduler and KV pool did in this run, under the names engine/measure/metrics.py defines
        (vLLM's session reports the same names from its own counters)."""
        return {
            "prefix_hit_rate": self.stats.prefix_hit_rate,
            "preemptions": float(self.stats.preemptions),
            "mean_batch_size": self.step_seqs / self.steps,
            "kv_cache_bytes": float(self.kv_pool_bytes),
            "kv_peak_bytes": float(self.kv_peak_bytes),
        }


class ServingEngine:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, sampler: Sampler, sync: Callable[[], None],
                 clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep,
                 check_invariants: bool = False):
        self.runner, self.scheduler, self.sampler, self.sync = runner, scheduler, sampler, sync
        self.clock, self.sleep, self.check_invariants = clock, sleep, check_invariants

    def run(self, requests: list[Request], max_concurrency: int = 0,
            follow_up: Optional[Callable[[Request, list[int], float], Optional[Request]]] = None) -> ServingTrace:
        """Serve `requests`; `follow_up(request, output, finished_s)` may return a request that a finished
        one leads to (a conversation's next turn), which then arrives at its own `arrival_s`."""
        sched = self.scheduler
        pending = deque(sorted(requests, key=lambda r: (r.arrival_s, r.id)))
        timelines: dict[int, RequestTimeline] = {}
        records: dict[int, RequestRecord] = {}
        in_flight, gate_open_s = 0, 0.0
        steps = step_seqs = step_tokens = 0
        t = 0.0
        t0 = self.clock()
        while pending or sched.has_unfinished():
            now = self.clock() - t0
            while pending and pending[0].arrival_s <= now and (not max_concurrency or in_flight < max_concurrency):
                r = pending.popleft()
                timelines[r.id] = RequestTimeline(sent_s=max(r.arrival_s, gate_open_s))
                sched.add(Sequence(r))
                in_flight += 1
            if not sched.has_unfinished():  # idle until the next arrival
                self.sleep(max(0.0, pending[0].arrival_s - (self.clock() - t0)))
                continue
            batch = sched.schedule()
            logits = self.runner.execute(batch)
            ids = batch.sampling_ids
            tokens = self.sampler.sample(ids, logits)
            self.sync()
            t = self.clock() - t0
            for sid in ids:
                timelines[sid].token_times_s.append(t)
            was_full = bool(max_concurrency) and in_flight >= max_concurrency
            for seq in sched.postprocess(batch, tokens):
                tl = timelines.pop(seq.id)
                records[seq.id] = RequestRecord(seq.id, seq.prompt_len, tuple(seq.output), tl.sent_s,
                                                tuple(tl.token_times_s), seq.num_preemptions,
                                                seq.cached_at_admission)
                nxt = follow_up(seq.request, seq.output, t) if follow_up else None
                if nxt is not None:
                    bisect.insort(pending, nxt, key=lambda r: (r.arrival_s, r.id))
                self.sampler.forget(seq.id)
                in_flight -= 1
            if was_full and in_flight < max_concurrency:
                gate_open_s = t  # requests held back by the client are sent now
            steps += 1
            step_seqs += len(batch.chunks)
            step_tokens += batch.num_tokens
            if self.check_invariants:
                sched.check_invariants()
        assert not timelines and len(records) >= len(requests)
        space = sched.space
        return ServingTrace(
            requests=tuple(records[i] for i in sorted(records)),
            duration_s=t,
            steps=steps,
            step_seqs=step_seqs,
            step_tokens=step_tokens,
            stats=sched.stats,
            kv_pool_bytes=self.runner.pool.bytes(),
            kv_peak_bytes=space.peak_used * space.block_size * self.runner.pool.token_bytes,
        )
