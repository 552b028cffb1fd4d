"""A scripted synthetic objective for the optimize strategies: a `Measure` that answers from formulas (no
model, no Ray, no MLflow), with seeded noise, shared round drift for interleaved groups, per-item accuracy, and
a store of FINISHED results by group of points, in the order they ran, so that a rerun reuses them as the real dispatcher does."""
from __future__ import annotations

import random
import zlib
from typing import Callable, Mapping, Optional, Sequence

from experiments.optimize.measurement import (EVAL_LIMIT, EVAL_OFF, FINISHED, Measurement, Point, Request, point_key)

ROUNDS = 9  # the chain's minimum at the shipped settings (decide.min_rounds): fewer can give no bound


def tpot_of(factors: Mapping[tuple[str, str], float], base: float = 100.0) -> Callable[[Point], float]:
    """TPOT (ms) of a point: `base` times the factor of each (key, value) it sets."""
    def f(p: Point) -> float:
        v = base
        for kv in p.items():
            v *= factors.get(kv, 1.0)
        return v
    return f


class Synthetic:
    def __init__(self, tpot: Callable[[Point], float], *, noise: float = 0.005, drift: float = 0.05,
                 wrong: Optional[Callable[[Point], int]] = None, unstable: Optional[Callable[[Point, int], str]] = None,
                 labels: Optional[dict] = None, items: int = 50, memory: Optional[Callable[[Point], float]] = None,
                 extra: Optional[Callable[[Point], dict]] = None, seed: int = 0):
        self.tpot, self.noise, self.drift, self.seed = tpot, noise, drift, seed
        self.wrong = wrong or (lambda p: 0)  # items (of the first ones) a point gets wrong that the baseline gets right
        self.unstable = unstable or (lambda p, attempt: "")
        self.labels = labels if labels is not None else {"regime.decode.measured": "memory", "regime.phase": "decode",
                                                         "regime": "memory"}
        self.items, self.memory = items, memory or (lambda p: 1e8)
        self.extra = extra or (lambda p: {})  # more metrics of a point (task_score.*, task_gate, ...)
        self.store: dict = {}
        self.runs = 0  # trials actually "run" (not reused)
        self.requests: list[Request] = []
        self.batches: list[int] = []  # requests per call

    def _correct(self, p: Point) -> list[float]:
        n = int(p.get(EVAL_LIMIT, self.items))
        rng = random.Random(1234)  # the same items for every point: baseline right on ~60%
        base = [1.0 if rng.random() < 0.6 else 0.0 for _ in range(n)]
        k = self.wrong(p) * n // self.items  # the drop scales with the item count
        out, flipped = list(base), 0
        for i, x in enumerate(out):
            if flipped >= k:
                break
            if x == 1.0:
                out[i], flipped = 0.0, flipped + 1
        return out

    def _memory(self, p: Point, req: Request) -> dict:
        """A solo trial logs the process peak; a variant of an interleaved group its own small footprint, beside
        the group's peak (as engine.pipeline.run_interleaved does)."""
        if req.interleaved and len(req.points) > 1:
            return {"peak_mem_bytes": 0.01 * self.memory(p), "group_peak_mem_bytes": sum(map(self.memory, req.points))}
        return {"peak_mem_bytes": self.memory(p)}

    def __call__(self, requests: Sequence[Request]) -> list[list[Measurement]]:
        out = []
        self.batches.append(len(requests))
        for req in requests:
            self.requests.append(req)
            # stored groups of these points, in the order they ran: attempt k reuses the k-th one `skip` leaves
            group = (tuple(point_key(p) for p in req.points), req.interleaved)
            stored = [ms for ms in self.store.get(group, []) if not any(m.run_id in req.skip for m in ms)]
            if len(stored) > req.attempt:
                out.append([Measurement(**{**m.__dict__, "reused": True}) for m in stored[req.attempt]])
                continue
            n = len(self.store.get(group, []))  # the n-th run of the group: its own noise, its own load flag
            key = (*group, n)
            rng = random.Random(zlib.crc32(repr((key, self.seed)).encode()))  # stable across processes
            drift = [1 + rng.uniform(-self.drift, self.drift) for _ in range(ROUNDS)]  # shared by the group
            ms = []
            for p in req.points:
                rounds = [self.tpot(p) * d * (1 + rng.gauss(0, self.noise)) for d in drift]
                ms.append(Measurement(
                    point=dict(p), status=FINISHED,
                    metrics={"tpot_ms_p50": sorted(rounds)[ROUNDS // 2], **self._memory(p, req), **self.extra(p)},
                    rounds={"tpot_ms_p50": rounds},
                    correct={} if p.get(EVAL_OFF) == "false" else {"bigbench_emoji_movie": self._correct(p)},
                    labels={**self.labels, **({"unstable": u} if (u := self.unstable(p, n)) else {})},
                    config_hash=f"{zlib.crc32(repr(point_key(p)).encode()):08x}", run_id=f"run{self.runs}"))
                self.runs += 1
            self.store.setdefault(group, []).append(ms)
            out.append(ms)
        return out
