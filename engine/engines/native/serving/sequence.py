"""`Sequence`: the generation state of one request.

Its mutable state -- generated tokens, how many tokens have K/V in the cache, status -- is changed only
by the scheduler, through the methods below, each of which asserts the invariants
    0 <= num_computed < num_tokens while unfinished   (the newest token always still needs a forward)
    len(output) <= max_new_tokens, FINISHED exactly when len(output) == max_new_tokens.
Block tables live in `BlockSpace`, timings in the engine loop's `RequestTimeline`: one owner each.
"""
from __future__ import annotations

import enum
from typing import Optional

from ....serving.requests import Request


class Status(enum.Enum):
    WAITING = "waiting"  # queued: not yet admitted, or preempted (its K/V is recomputed on re-admission)
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request: Request):
        self.request = request
        self.id = request.id
        self.max_new_tokens = request.max_new_tokens
        self._tokens: list[int] = list(request.prompt)  # prompt + generated, in order
        self.output: list[int] = []
        self.num_computed = 0  # leading tokens whose K/V is in the cache
        self.status = Status.WAITING
        self.num_preemptions = 0
        self.cached_at_admission: Optional[int] = None  # prompt tokens the prefix cache held at first admission

    # ---------------------------------------------------------------- reads

    @property
    def tokens(self) -> list[int]:
        """Prompt + generated tokens (a read-only view by convention; never mutate it)."""
        return self._tokens

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    @property
    def num_uncomputed(self) -> int:
        return len(self._tokens) - self.num_computed

    @property
    def prompt_len(self) -> int:
        return self.request.prompt_len

    # ---------------------------------------------------------------- transitions (scheduler only)

    def admit(self, num_cached: int) -> None:
        """WAITING -> RUNNING, with the first `num_cached` tokens' K/V already in the cache (prefix hit)."""
        assert self.status is Status.WAITING and self.num_computed == 0, (self.id, self.status)
        assert 0 <= num_cached < self.num_tokens, (num_cached, self.num_tokens)
        self.status = Status.RUNNING
        self.num_computed = num_cached
        if self.cached_at_admission is None:
            self.cached_at_admission = num_cached

    def computed(self, n: int) -> None:
        """`n` more tokens now have K/V in the cache (a forward pass ran over them)."""
        assert self.status is Status.RUNNING and 0 < n <= self.num_uncomputed, (self.id, n, self.num_uncomputed)
        self.num_computed += n

    def append(self, token: int) -> None:
        """A sampled token: only once every token before it is computed."""
        assert self.status is Status.RUNNING and self.num_computed == self.num_tokens, (self.id, self.num_computed)
        self._tokens.append(int(token))
        self.output.append(int(token))
        if len(self.output) == self.max_new_tokens:
            self.status = Status.FINISHED
        self.check()

    def preempt(self) -> None:
        """RUNNING -> WAITING by recompute: its K/V is dropped, its generated tokens are kept and become
        part of the prompt it is prefilled with when re-admitted."""
        assert self.status is Status.RUNNING, (self.id, self.status)
        self.status = Status.WAITING
        self.num_computed = 0
        self.num_preemptions += 1

    def check(self) -> None:
        assert len(self.output) <= self.max_new_tokens
        assert (self.status is Status.FINISHED) == (len(self.output) == self.max_new_tokens)
        assert self.num_tokens == self.prompt_len + len(self.output)
        if self.status is not Status.FINISHED:
            assert 0 <= self.num_computed < self.num_tokens, (self.id, self.num_computed, self.num_tokens)

    def __repr__(self) -> str:
        return (f"Sequence({self.id}, {self.status.value}, tokens={self.num_tokens}, computed={self.num_computed}, "
                f"out={len(self.output)}/{self.max_new_tokens})")
