"""The speculative decode loop (batch size 1): target prefill, then steps of propose -> verify -> roll back.

One step: the drafter proposes k' <= k tokens after the committed context; the target scores the last
committed token followed by the k' drafts in ONE forward ([1, 1+k'] tokens -> [1, 1+k', V] logits); `verify`
keeps the accepted prefix and appends one token of the target's own; the target's KV cache forgets the
rejected drafts (`DecodeSession.rollback`), and the drafter brings its own state in line at the next step.
Each step emits between 1 and k'+1 tokens, all stamped with the time the step finished.

Exactly `max_new_tokens` tokens are generated, as in the plain loop: near the end the lookahead shrinks so
that a step can never emit more than what is left (and the KV cache never holds more than max_len).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..config import SamplingConfig
from ..sampling import sample
from ..traces import DecodeSession, GenerationTrace
from .drafter import Drafter, Proposal
from .verify import Verdict, verify


@dataclass
class SpeculativeStats:
    """Counts and clocks of one speculative generation (what engine.measure.metrics.speculative_metrics reads)."""

    k: int  # the configured lookahead
    steps: int = 0  # target forwards after the prefill; each verifies the drafts and adds one token of its own
    step_tokens: int = 0  # tokens those steps emitted (accepted + 1 each)
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    rejections: int = 0  # steps that rejected a draft token (the others accepted every token they drafted)
    draft_s: float = 0.0  # drafter time in the steps
    draft_prefill_s: float = 0.0  # the drafter taking in the prompt (once)
    verify_s: float = 0.0  # target forwards in the steps
    draft_kv_cache_bytes: int = 0

    def add(self, r: "StepResult") -> None:
        self.steps += 1
        self.step_tokens += r.verdict.accepted + 1
        self.drafted += r.drafted
        self.accepted += r.verdict.accepted
        self.rejections += int(r.verdict.accepted < r.drafted)
        self.draft_s += r.draft_s
        self.verify_s += r.verify_s


@dataclass(frozen=True)
class StepResult:
    verdict: Verdict
    drafted: int  # k' tokens proposed
    draft_s: float
    verify_s: float


def step(
    session: DecodeSession,
    drafter: Drafter,
    committed: list[int],
    lookahead: int,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    sync: Callable[[], None],
    device: torch.device,
) -> StepResult:
    """One speculative step after `committed` (prompt + generated ids). `session` holds every committed
    token but the last, before and after (the rejected drafts are rolled back); `lookahead` 0 makes it a
    plain decode step."""
    clock = time.perf_counter
    last = torch.tensor([committed[-1]], dtype=torch.long, device=device)
    a = clock()
    prop = drafter.propose(committed, lookahead, sampling, generator) if lookahead > 0 else Proposal.empty(device)
    sync()
    b = clock()
    logits = session.forward(torch.cat([last, prop.tokens])[None])[0]  # [1 + k', V]
    sync()
    c = clock()
    verdict = verify(prop.tokens, prop.probs, logits, sampling, generator)
    drafted = int(prop.tokens.shape[0])
    session.rollback(drafted - verdict.accepted)
    return StepResult(verdict, drafted, b - a, c - b)


def generate_speculative(
    session: DecodeSession,
    drafter: Drafter,
    prompt: torch.Tensor,
    max_new_tokens: int,
    k: int,
    sampling: SamplingConfig,
    seed: int,
    sync: Callable[[], None],
) -> GenerationTrace:
    """prompt [1, T] -> a GenerationTrace of `max_new_tokens` tokens, `extra["speculative"]` its statistics."""
    assert prompt.dim() == 2 and prompt.shape[0] == 1, "speculative decoding runs one sequence (batch size 1)"
    assert max_new_tokens >= 1 and k >= 1
    device = prompt.device
    gen = torch.Generator(device=device).manual_seed(seed)
    stats = SpeculativeStats(k=k)
    clock = time.perf_counter
    t0 = clock()
    first = sample(session.prefill(prompt), sampling, gen)  # prefill: [1]
    sync()
    times = [clock() - t0]
    out = [int(first)]
    committed = prompt[0].tolist() + out
    a = clock()
    drafter.prefill(committed[:-1])
    sync()
    stats.draft_prefill_s = clock() - a
    while len(out) < max_new_tokens:
        r = step(session, drafter, committed, min(k, max_new_tokens - len(out) - 1), sampling, gen, sync, device)
        t = clock() - t0
        new = r.verdict.tokens.tolist()
        out += new
        committed += new
        times += [t] * len(new)
        stats.add(r)
    assert len(out) == max_new_tokens and session.length == prompt.shape[1] + max_new_tokens - 1
    allocated, used = session.kv_cache_bytes()
    stats.draft_kv_cache_bytes = drafter.kv_cache_bytes()[0]
    return GenerationTrace(
        tokens=torch.tensor([out], dtype=torch.long, device=device),
        token_times_s=times,
        prefill_s=times[0],
        prompt_len=int(prompt.shape[1]),
        batch_size=1,
        kv_cache_allocated=allocated,
        kv_cache_used=used,
        extra={"speculative": stats},
    )
