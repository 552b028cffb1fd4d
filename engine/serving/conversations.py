"""Multi-turn conversations (workload.kind=multi-turn): C conversations x T turns, each turn's prompt the
whole conversation so far plus a new user message.

Conversation c starts at its arrival time (`workload.arrival`/`rate`, as requests would); turn 0's prompt is
the shared system prefix (`prefix_len` tokens) and the first user message. When turn t finishes, turn t+1
is sent `think_time_s` later with prompt = turn t's prompt + turn t's answer (the tokens the model really
generated) + the next user message (`input_len` tokens of real text). An engine with cached state (prefix
caching) finds the history's K/V already computed; re-prompting from scratch computes it every turn again.

Requests are numbered c * turns + t. Everything but the answers is fixed by the seed, so cached and
re-prompted runs serve the same conversations, and their answers must be identical.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..config import EngineError, WorkloadConfig
from .requests import Request, _draw, arrival_times


@dataclass(frozen=True)
class Conversation:
    id: int
    start_s: float
    messages: tuple[tuple[int, ...], ...]  # the user message of each turn (turn 0 starts with the system prefix)
    max_new_tokens: tuple[int, ...]  # the answer length of each turn

    @property
    def turns(self) -> int:
        return len(self.messages)


@dataclass(frozen=True)
class Conversations:
    """The workload: its conversations and the think time between a turn's answer and the next message."""

    items: tuple[Conversation, ...]
    think_time_s: float

    @property
    def turns(self) -> int:
        return self.items[0].turns if self.items else 0

    @property
    def num_requests(self) -> int:
        return sum(c.turns for c in self.items)

    def request_id(self, conv: int, turn: int) -> int:
        return conv * self.turns + turn

    def turn_of(self, request_id: int) -> tuple[int, int]:
        return divmod(request_id, self.turns)

    def first_turns(self) -> list[Request]:
        return [Request(self.request_id(c.id, 0), c.messages[0], c.max_new_tokens[0], c.start_s) for c in self.items]

    def next_turn(self, done: Request, answer: Sequence[int], finished_s: float) -> Optional[Request]:
        """The request that follows `done` once its `answer` was generated at `finished_s` (None after
        the last turn): the whole conversation so far plus the next user message."""
        c, t = self.turn_of(done.id)
        conv = self.items[c]
        if t + 1 >= conv.turns:
            return None
        prompt = done.prompt + tuple(answer) + conv.messages[t + 1]
        return Request(done.id + 1, prompt, conv.max_new_tokens[t + 1], finished_s + self.think_time_s)


def make_conversations(spec: WorkloadConfig, corpus: torch.Tensor, seed: int) -> Conversations:
    """`spec.conversations` conversations of `spec.turns` turns; user messages are consecutive slices of the
    corpus of `input_len` tokens each, answers `output_len` tokens; starts follow `spec.arrival`."""
    if spec.conversations < 1 or spec.turns < 1:
        raise EngineError(f"a multi-turn workload needs conversations >= 1 and turns >= 1, got "
                          f"{spec.conversations} x {spec.turns}")
    if spec.think_time_s < 0:
        raise EngineError(f"workload.think_time_s must be >= 0, got {spec.think_time_s}")
    rng = random.Random(f"turns-{seed}")
    lens = [[(_draw(rng, spec.input_len), _draw(rng, spec.output_len)) for _ in range(spec.turns)]
            for _ in range(spec.conversations)]
    starts = arrival_times(dataclasses.replace(spec, num_requests=spec.conversations), seed)
    ids = corpus.tolist()
    if not ids:
        raise EngineError("the workload text is empty after tokenization")
    need = spec.prefix_len + sum(i for conv in lens for i, _ in conv)
    if len(ids) < need:
        ids = ids * (need // len(ids) + 1)
    prefix = tuple(ids[: spec.prefix_len])
    pos, out = spec.prefix_len, []
    for c, (conv, start) in enumerate(zip(lens, starts)):
        msgs = []
        for t, (n_in, _) in enumerate(conv):
            msgs.append((prefix if t == 0 else ()) + tuple(ids[pos: pos + n_in]))
            pos += n_in
        out.append(Conversation(c, start, tuple(msgs), tuple(o for _, o in conv)))
    return Conversations(tuple(out), spec.think_time_s)
