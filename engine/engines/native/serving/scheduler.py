"""Which sequences run in the next forward pass: admission and preemption only (no torch, no time).

Both schedulers see the same `BlockSpace` and emit the same `ScheduledBatch`, so the engine loop, the
model runner and the metrics are shared and the comparison is about scheduling alone.

`StaticScheduler` (request-level batching): when no batch is running, take up to `max_batch_size`
waiting sequences (first come, first served) whose whole run -- prompt + every output token -- fits in
the free blocks, prefill them together, then decode them step by step until the longest one is done;
only then is the next batch formed. A sequence that finishes early leaves its slot empty (it is not
computed any more -- a padded implementation would still compute it) and new arrivals wait for the
whole batch. Blocks are reserved up front, so a static batch never preempts.

`ContinuousScheduler` (iteration-level batching, Orca/vLLM): every step, first the running sequences
(in admission order) get their next token -- or their next prefill chunk -- then waiting sequences are
admitted first come, first served while the batch has fewer than `max_batch_size` sequences, the step
has fewer than `max_batch_tokens` new tokens and their blocks fit (keeping a small watermark free for
the running sequences' growth). A sequence that finishes leaves at once. When a running sequence needs
a block and none is free, the most recently admitted running sequence is preempted by *recompute*:
its blocks are freed, it goes back to the front of the queue with the tokens it generated so far, and
on re-admission it is prefilled with prompt + those tokens (with prefix caching, its own published
blocks are usually still cached and reused). Recompute rather than swap: on CPU "swapping" would be a
copy inside the same RAM, and recompute needs no second pool. No new sequence is admitted in a step
that preempted.

`chunked_prefill`: a prompt longer than the step's remaining token budget is split across steps (each
chunk attends to the chunks before it through the cache) instead of waiting for a step with room.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ....config import EngineError
from .block_space import BlockSpace
from .sequence import Sequence, Status


@dataclass(frozen=True)
class ScheduledChunk:
    """New tokens of one sequence in the next forward pass, snapshotted for the model runner."""

    seq_id: int
    tokens: tuple[int, ...]  # the tokens this step computes
    start: int  # position of tokens[0]
    block_table: tuple[int, ...]  # covers positions 0 .. start + len(tokens) - 1
    sample: bool  # the chunk reaches the newest token: the next token is sampled from its logits

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass(frozen=True)
class ScheduledBatch:
    chunks: tuple[ScheduledChunk, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.chunks)

    @property
    def sampling_ids(self) -> list[int]:
        return [c.seq_id for c in self.chunks if c.sample]


@dataclass
class SchedulerStats:
    preemptions: int = 0
    admitted_tokens: int = 0  # tokens of sequences at admission (prompt, + generated on re-admission)
    cached_tokens: int = 0  # of those, found in the prefix cache

    @property
    def prefix_hit_rate(self) -> float:
        return self.cached_tokens / self.admitted_tokens if self.admitted_tokens else 0.0


class Scheduler:
    """The queue, the running set and the transitions between them; subclasses decide each step."""

    def __init__(self, space: BlockSpace, max_batch_size: int, max_batch_tokens: int, chunked_prefill: bool = False):
        if max_batch_size < 1 or max_batch_tokens < 1:
            raise EngineError(f"need max_batch_size >= 1 and max_batch_tokens >= 1, got {max_batch_size}, {max_batch_tokens}")
        self.space = space
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self._by_id: dict[int, Sequence] = {}
        self.stats = SchedulerStats()

    def add(self, seq: Sequence) -> None:
        assert seq.status is Status.WAITING and seq.id not in self._by_id, seq
        self._by_id[seq.id] = seq
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = self._schedule()
        if not batch.chunks and self.has_unfinished():
            raise EngineError(f"scheduler stalled: {len(self.waiting)} waiting, {len(self.running)} running, "
                              f"{self.space.manager.num_free} free blocks (is the KV pool smaller than one request?)")
        return batch

    def _schedule(self) -> ScheduledBatch:
        raise NotImplementedError

    def postprocess(self, batch: ScheduledBatch, sampled: list[int]) -> list[Sequence]:
        """Account for a forward pass: chunks are computed, sampled tokens appended (one per sampling
        chunk, in order). Returns the sequences that finished; their blocks are released."""
        assert len(sampled) == len(batch.sampling_ids), (len(sampled), len(batch.sampling_ids))
        tokens = iter(sampled)
        finished = []
        for c in batch.chunks:
            seq = self._by_id[c.seq_id]
            assert seq.num_computed == c.start, (seq, c.start)
            seq.computed(len(c.tokens))
            self.space.publish(seq.id, seq.tokens, seq.num_computed)
            if c.sample:
                seq.append(next(tokens))
                if seq.status is Status.FINISHED:
                    self.space.release(seq.id)
                    self.running.remove(seq)
                    del self._by_id[seq.id]
                    finished.append(seq)
        return finished

    # ---------------------------------------------------------------- helpers

    def _admit(self, seq: Sequence, hits: list[int], num_new: int) -> ScheduledChunk:
        cached = len(hits) * self.space.block_size
        self.space.admit(seq.id, seq.tokens, hits, cached + num_new)
        seq.admit(cached)
        self.stats.admitted_tokens += seq.num_tokens
        self.stats.cached_tokens += cached
        self.running.append(seq)
        return self._chunk(seq, num_new)

    def _chunk(self, seq: Sequence, n: int) -> ScheduledChunk:
        start = seq.num_computed
        assert 0 < n <= seq.num_uncomputed, (seq, n)
        table = self.space.table(seq.id)
        assert len(table) * self.space.block_size >= start + n, (seq, len(table))
        return ScheduledChunk(seq.id, tuple(seq.tokens[start:start + n]), start, tuple(table),
                              sample=start + n == seq.num_tokens)

    def check_invariants(self) -> None:
        self.space.check_invariants()
        assert all(s.status is Status.WAITING and not self.space.holds(s.id) for s in self.waiting)
        assert all(s.status is Status.RUNNING and self.space.holds(s.id) for s in self.running)
        assert len(self.running) <= self.max_batch_size
        for s in self.running:
            s.check()


class StaticScheduler(Scheduler):
    def _schedule(self) -> ScheduledBatch:
        chunks = []
        if not self.running:  # the previous batch is done: form the next one from what is waiting
            reserve = 0
            while self.waiting and len(self.running) < self.max_batch_size:
                seq = self.waiting[0]
                whole = self.space.manager.blocks_for(seq.prompt_len + seq.max_new_tokens)
                if reserve + whole > self.space.manager.num_free:
                    break
                reserve += whole
                self.waiting.popleft()
                hits = self.space.cached_prefix(seq.tokens)
                chunks.append(self._admit(seq, hits, seq.num_tokens - len(hits) * self.space.block_size))
            return ScheduledBatch(tuple(chunks))
        for seq in self.running:  # decode every unfinished member of the batch
            self.space.grow(seq.id, seq.num_tokens)  # reserved at admission: cannot run out
            chunks.append(self._chunk(seq, seq.num_uncomputed))
        return ScheduledBatch(tuple(chunks))


class ContinuousScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Blocks admission leaves free while others run, so running sequences can grow without
        # preempting the sequence just admitted (vLLM keeps 1% of the pool the same way).
        self.watermark = max(1, self.space.manager.num_blocks // 100)

    def _schedule(self) -> ScheduledBatch:
        budget = self.max_batch_tokens
        chunks: list[ScheduledChunk] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed, budget) if self.chunked_prefill else seq.num_uncomputed
            if n > budget:
                break
            while not self.space.can_grow(seq.id, seq.num_computed + n):
                victim = self.running[-1]  # the most recently admitted
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break  # it preempted itself: it was the last running sequence
            self.space.grow(seq.id, seq.num_computed + n)
            chunks.append(self._chunk(seq, n))
            budget -= n
            i += 1
        while not preempted and self.waiting and len(self.running) < self.max_batch_size and budget > 0:
            seq = self.waiting[0]
            hits = self.space.cached_prefix(seq.tokens)
            cached = len(hits) * self.space.block_size
            n = seq.num_tokens - cached
            if self.chunked_prefill:
                n = min(n, budget)
            elif n > budget:
                break  # first come, first served: nobody overtakes the head of the queue
            keep = self.watermark if self.running else 0
            if not self.space.can_admit(hits, cached + n + keep * self.space.block_size):
                break
            self.waiting.popleft()
            chunks.append(self._admit(seq, hits, n))
            budget -= n
        return ScheduledBatch(tuple(chunks))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.space.release(seq.id)
        seq.preempt()
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1
