"""Serving workloads: `num_requests` seeded requests with input/output lengths and arrival times.

The same `WorkloadConfig` and seed always give the same requests (lengths, arrivals and prompt tokens), so
static and continuous batching, or prefix caching on and off, serve exactly the same traffic.
Prompt tokens are real text: the shared prefix is the first `prefix_len` tokens of the corpus (a
"system prompt"), and each request's own `input_len` tokens are the next consecutive slice of it.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Optional

import torch

from ..config import EngineError, LengthConfig, WorkloadConfig


@dataclass(frozen=True)
class Request:
    id: int
    prompt: tuple[int, ...]  # shared prefix + own input tokens
    max_new_tokens: int  # generation runs exactly this many tokens (EOS is not a stop)
    arrival_s: float  # seconds after the start of the run

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)


def _draw(rng: random.Random, spec: LengthConfig) -> int:
    if spec.dist == "fixed":
        return spec.value
    if spec.dist == "uniform":
        return rng.randint(spec.min, spec.max)
    raise EngineError(f"length distribution {spec.dist!r} unknown; choose fixed or uniform")


def read_length_trace(path: str) -> list[tuple[int, int]]:
    """(input_len, output_len) per line of a JSONL file of {"input_len": .., "output_len": ..} objects."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise EngineError(f"length trace {path!r}: {e}") from e
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            row = (int(d["input_len"]), int(d["output_len"]))
        except (ValueError, KeyError, TypeError) as e:
            raise EngineError(f"length trace {path!r} line {n}: expected {{\"input_len\": N, \"output_len\": M}} ({e})") from e
        if row[0] < 1 or row[1] < 1:
            raise EngineError(f"length trace {path!r} line {n}: lengths must be >= 1, got {row}")
        rows.append(row)
    if not rows:
        raise EngineError(f"length trace {path!r} has no lines")
    return rows


def lengths(spec: WorkloadConfig, seed: int) -> list[tuple[int, int]]:
    """(input_len, output_len) of each request; input_len excludes the shared prefix."""
    if spec.length_trace:
        rows = read_length_trace(spec.length_trace)
        return [rows[i % len(rows)] for i in range(spec.num_requests)]
    rng = random.Random(f"lengths-{seed}")
    return [(_draw(rng, spec.input_len), _draw(rng, spec.output_len)) for _ in range(spec.num_requests)]


def arrival_times(spec: WorkloadConfig, seed: int) -> list[float]:
    """Arrival time of each request, seconds from the start; the first arrives at 0."""
    n = spec.num_requests
    if spec.arrival == "all-at-once":
        return [0.0] * n
    if spec.arrival == "fixed-rate":
        return [i / spec.rate for i in range(n)]
    if spec.arrival == "poisson":
        # gamma gaps of shape k and mean 1/rate (k = 1: exponential gaps, a Poisson process)
        rng = random.Random(f"arrivals-{seed}")
        k = spec.burstiness
        t, out = 0.0, [0.0]
        for _ in range(n - 1):
            t += rng.gammavariate(k, 1.0 / (spec.rate * k))
            out.append(t)
        return out
    raise EngineError(f"arrival {spec.arrival!r} unknown; choose all-at-once, fixed-rate or poisson")


def make_requests(spec: WorkloadConfig, corpus: torch.Tensor, seed: int) -> list[Request]:
    """The workload's requests in arrival order. corpus: [L] token ids (repeated when too short)."""
    lens = lengths(spec, seed)
    arrivals = arrival_times(spec, seed)
    need = spec.prefix_len + sum(i for i, _ in lens)
    ids = corpus.tolist()
    if not ids:
        raise EngineError("the workload text is empty after tokenization")
    if len(ids) < need:
        ids = ids * (need // len(ids) + 1)
    prefix = tuple(ids[: spec.prefix_len])
    pos, out = spec.prefix_len, []
    for i, ((n_in, n_out), t) in enumerate(zip(lens, arrivals)):
        out.append(Request(id=i, prompt=prefix + tuple(ids[pos: pos + n_in]), max_new_tokens=n_out, arrival_s=t))
        pos += n_in
    return out


def max_request_tokens(spec: WorkloadConfig) -> int:
    """The longest prompt + output any request of this spec can have (for pool sizing and validation);
    multi-turn: the last turn of the longest conversation."""
    if spec.multi_turn:
        return spec.prefix_len + spec.turns * (_hi(spec.input_len) + _hi(spec.output_len))
    if spec.length_trace:
        rows = read_length_trace(spec.length_trace)
        return spec.prefix_len + max(i + o for i, o in rows)

    def hi(s: LengthConfig) -> int:
        return s.value if s.dist == "fixed" else s.max

    return spec.prefix_len + hi(spec.input_len) + hi(spec.output_len)


def _hi(s: LengthConfig) -> int:
    return s.value if s.dist == "fixed" else s.max


def max_prompt_tokens(spec: WorkloadConfig) -> int:
    if spec.multi_turn:
        return max_request_tokens(spec) - _hi(spec.output_len)
    if spec.length_trace:
        return spec.prefix_len + max(i for i, _ in read_length_trace(spec.length_trace))
    s = spec.input_len
    return spec.prefix_len + (s.value if s.dist == "fixed" else s.max)


@dataclass(frozen=True)
class RequestRecord:
    """One finished request as measured: what the metrics of every engine that serves are computed from."""

    id: int
    prompt_len: int
    output: tuple[int, ...]
    sent_s: float
    token_times_s: tuple[float, ...]
    preemptions: int
    cached_tokens: Optional[int] = None  # prompt tokens found in the prefix cache at admission (None: not known)
    # it ran its whole length (a served request the server ended early -- cancelled, stopped at EOS where the
    # server ignored the exact-length option -- is False: it never counts as meeting the SLO)
    complete: bool = True

    @property
    def ttft_s(self) -> float:
        return self.token_times_s[0] - self.sent_s

    @property
    def e2e_s(self) -> float:
        return self.token_times_s[-1] - self.sent_s


def warmup_requests(requests: list[Request]) -> list[Request]:
    """Two requests at t=0 generating two tokens: prefill, a mixed step and decode kernels all run once."""
    return [Request(i, r.prompt, min(2, r.max_new_tokens), 0.0) for i, r in enumerate(requests[:2])]
