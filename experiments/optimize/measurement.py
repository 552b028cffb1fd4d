"""What a strategy sends to be measured and what comes back: the one interface between decision logic and
the machinery that runs trials (experiments/optimize/dispatch.py in production, a scripted fake in tests)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

from engine.measure.noise import UNSTABLE

FINISHED, FAILED, INVALID = "FINISHED", "FAILED", "INVALID"

# A configuration: {override key: value}, e.g. {"kv_cache": "contiguous", "quant": "int8-weight"}; keys are the
# space's axes (config groups or dotted keys) and `eval.limit` when a pair's accuracy needed more items.
Point = dict[str, str]
EVAL_LIMIT = "eval.limit"
EVAL_OFF = "eval.enabled"  # set to "false" on both trials of a pair whose task scores cannot differ (chain.py)


def point_key(p: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((str(k), str(v)) for k, v in p.items()))


def describe(p: Mapping[str, str], base: Optional[Mapping[str, str]] = None) -> str:
    """`kv_cache=contiguous quant=int8-weight`: the values of `p` that differ from `base` (all without one)."""
    diff = [(k, v) for k, v in p.items() if base is None or base.get(k) != v]
    return " ".join(f"{k}={v}" for k, v in diff) or "(baseline)"


def unstable_reason(labels: Mapping[str, str]) -> str:
    """Why a trial's timings cannot be trusted ('' when they can): the engine's `unstable` label (an MLflow tag
    on stored runs). The one place that reads the flag, so a change of how trials are flagged lands here."""
    return str(labels.get(UNSTABLE) or "")


@dataclass
class Measurement:
    point: Point
    status: str = FINISHED  # FINISHED | FAILED | INVALID (validation refused it: never ran)
    metrics: dict[str, float] = field(default_factory=dict)
    rounds: dict[str, list[float]] = field(default_factory=dict)  # metric -> value per interleaved round
    correct: dict[str, list[float]] = field(default_factory=dict)  # task -> per-item 0/1 (eval.tasks)
    labels: dict[str, str] = field(default_factory=dict)  # the trial's labels (regime, unstable, ...)
    config_hash: str = ""
    error: str = ""
    reused: bool = False  # a FINISHED trial found in the store by hash, not run now
    run_id: Optional[str] = None
    # eval.fidelity: {"windows": digest of the text's token ids, "top1": the argmax at each position, per window}
    top1: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == FINISHED

    @property
    def unstable(self) -> str:
        return unstable_reason(self.labels)

    @property
    def regime(self) -> str:
        """'decode memory' / 'prefill compute' ('' when the trial had no regime)."""
        phase, r = self.labels.get("regime.phase", ""), self.labels.get("regime", "")
        return f"{phase} {r}".strip()


@dataclass(frozen=True)
class Request:
    """Measure `points`; `interleaved`: as one round-robin group on one worker (a pair: candidate vs incumbent).
    `attempt`: the n-th measurement of this same group (a re-measurement of an unstable pair is attempt 1, ...),
    so that a rerun finds each attempt's stored trials again instead of reusing the first for all. `skip`: run ids
    this invocation already used, never reused again (the chain's total pair: a fresh measurement even where the
    final configuration and the baseline are a step's own pair, and on a rerun the stored one after the step's)."""

    points: tuple[Point, ...]
    interleaved: bool = False
    attempt: int = 0
    skip: frozenset = frozenset()


# Measures a batch of requests (the search sends several at once: they run in parallel); one list of
# Measurements per request, in the order of its points.
Measure = Callable[[Sequence[Request]], list[list[Measurement]]]


def spent(measurements: Sequence[Measurement]) -> tuple[int, int]:
    """(trials reused from the store, trials run) among `measurements`: what counts toward the budget (a
    configuration that validation refused never ran and counts as neither)."""
    reused = sum(1 for m in measurements if m.reused)
    return reused, sum(1 for m in measurements if not m.reused and m.status != INVALID)
