"""The package's shared types, a leaf (it imports nothing of experiments.optimize): the decision rules and
budget a strategy runs under, the chain table's row, and the names of the decisions. settings.py (imported by
the config schema) builds them from `optimize.*`; the strategies, the table and the report read them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

ACCEPTED, REJECTED, UNDECIDED_PAIR = "accepted", "rejected", "undecided"
RUN_FAILED, SKIPPED, BASELINE, TOTAL = "failed", "skipped", "baseline", "total"
REMEASURE, MORE_ITEMS = "remeasure", "more_items"  # what could still decide an undecided pair
RETRY = " (retry)"  # the label suffix of a row the chain's end measured again (an undecided pair, retried)
REFUSED = "refused before a trial: "  # the reason of a candidate validation refused on its incumbent (SKIPPED)

# engine/pipeline.py run_interleaved: the pair's rounds, then rounds added at most twice while its interval holds x1
ENGINE_LOOKS = 3


@dataclass(frozen=True)
class Rules:
    """How a pair is decided. Built from `optimize.*` by settings.rules_of (its defaults: conf/optimize/)."""
    min_effect: float  # the smallest gain worth taking (0.03: 3%), decided on the interval's lower bound
    false_accept: float  # P(accept | true gain < min_effect) over the whole procedure of one pair
    attempts: int  # measurements of a pair at most in the chain's walk (1 + optimize.remeasure)
    max_drop: float  # the accuracy drop (share of items) the gate tolerates
    false_holds: float  # P(gate holds | true drop = max_drop) over all of the gate's looks
    gate_looks: int  # looks of the gate at one pair (eval.limit doubled up to gate.max_items)
    gate: bool = True  # judge task accuracy (when the trials have per-item results)
    slo: dict[str, float] = field(default_factory=dict)  # metric -> upper limit (ttft_ms_p99: 500)
    max_memory_bytes: Optional[float] = None  # None: no limit
    model_documents: tuple[str, ...] = ()  # tasks whose documents each model builds with its own tokenizer
    retries: int = 0  # further measurements, at the chain's end, of a pair whose timing is still undecided

    @property
    def looks(self) -> int:
        """Measurements of one pair at most, over the whole procedure (the walk's, then the end's retries)."""
        return max(1, self.attempts) + max(0, self.retries)

    @property
    def timing_alpha(self) -> float:
        """The one-sided level of one look of the timing rule."""
        return self.false_accept / (ENGINE_LOOKS * self.looks)

    @property
    def gate_alpha(self) -> float:
        """The one-sided level of one look of the accuracy gate."""
        return self.false_holds / max(1, self.gate_looks)


@dataclass(frozen=True)
class Budget:
    max_trials: int  # trials run now (trials found FINISHED in the store are free)
    max_s: float  # 0: no time limit
    max_items: int  # eval.limit ceiling when a pair's accuracy is undecided


@dataclass
class Row:
    step: int
    label: str
    candidate: str
    decision: str
    reason: str
    ratio: Optional[tuple[float, float, float]] = None  # (value, lo, hi) of the ratio the decision rests on
    accuracy: str = ""
    regime_before: str = ""
    regime_after: str = ""
    hashes: tuple[str, ...] = ()
    attempts: int = 1  # measurements of the pair (re-measurements, more items)

    def as_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}

    @property
    def ratio_cell(self) -> str:
        if self.ratio is None:
            return ""
        v, lo, hi = self.ratio
        return f"x{v:.2f} [{lo:.2f}-{hi:.2f}]" + (" ~" if lo <= 1 <= hi else "")


