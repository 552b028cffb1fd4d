"""Task accuracy of a candidate against a reference (the incumbent, or the chain's baseline) on the same items.

Two configurations answer the same items, paired by identity (`items_of`: the document's id, plus a hash of its
text where the task gives one). Only the items where they disagree carry information about a difference:
b = the reference right and the candidate wrong, c = the reverse; the accuracy difference is (c - b) / n.

The question is non-inferiority against `max_drop` (a share of the items): the candidate **holds** when the
interval of the difference lies above -max_drop, is **worse** when it lies below -max_drop, and is
**undecided** otherwise (more items may decide). The interval is Tango's score interval for a paired difference
of proportions (Tango 1998): unlike a bootstrap it stays honest with zero or few discordant items -- 0 of 50 items
lost gives a lower bound of -7.1% at 95%, not [0, 0] -- so a gate cannot hold on items too few to see a drop.

The gate looks at a pair up to `looks` times (eval.limit doubled while undecided: 50 -> 100 -> 200 is three
looks); each look's interval is at the one-sided level `false_holds / looks`, so the chance that a candidate
that truly loses `max_drop` is ever said to hold stays below `false_holds` over the whole procedure
(Bonferroni; tests/test_optimize_calibration.py measures it).
"""
from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any, Mapping, Optional, Sequence

import numpy as np

HOLDS, WORSE, UNDECIDED, UNPAIRED = "holds", "worse", "undecided", "unpaired"
_CODES = (HOLDS, WORSE, UNDECIDED)


class UnpairedItems(ValueError):
    """The two answer lists are not answers to the same items: comparing them would compare nothing."""


# --- items by identity -------------------------------------------------------------------------------
def item_key(doc_id: Any, text: str = "") -> str:
    """An item's identity: its document id, plus a hash of the document's text when known."""
    return f"{doc_id}:{hashlib.sha256(text.encode()).hexdigest()[:12]}" if text else str(doc_id)


def items_of(correct: Any) -> dict[str, float]:
    """Item identity -> 0/1 from what a trial logged: a list in document order (identity = the position,
    which is lm-eval's doc_id), a list of {"doc_id", "doc_hash" | "text", "correct"}, or a mapping id -> 0/1."""
    if isinstance(correct, Mapping):
        return {str(k): float(v) for k, v in correct.items()}
    correct = list(correct or [])
    if not any(isinstance(x, dict) for x in correct):  # the common case: 0/1 in document order
        return {str(i): float(x) for i, x in enumerate(correct)}
    out: dict[str, float] = {}
    for i, x in enumerate(correct):
        if isinstance(x, Mapping):
            key = str(x.get("doc_id", i))
            if x.get("doc_hash"):
                key += f":{x['doc_hash']}"
            elif x.get("text"):
                key = item_key(x.get("doc_id", i), str(x["text"]))
            out[key] = float(x["correct"])
        else:
            out[str(i)] = float(x)
    return out


def identified(items: Mapping[str, float]) -> bool:
    """Whether the keys carry the document's text hash (not just a position)."""
    return bool(items) and all(":" in k for k in items)


def pair_items(ref: Mapping[str, float], cand: Mapping[str, float]) -> tuple[list[float], list[float]]:
    """The two answer lists on the shared items, by identity. One side may hold more items than the other (a
    larger eval.limit: the first documents are the same); a document id whose text differs, or a side whose
    items the other lacks entirely, is an `UnpairedItems` error -- never a silent truncation."""
    def doc(k: str) -> str:
        return k.split(":", 1)[0]

    ra, ca = {doc(k): k for k in ref}, {doc(k): k for k in cand}
    clash = [d for d in ra.keys() & ca.keys() if ra[d] != ca[d]]
    if clash:
        raise UnpairedItems(f"{len(clash)} item(s) with the same id but different text (e.g. doc {sorted(clash)[0]})")
    shared = [k for k in ref if k in cand]
    small, large = (ref, cand) if len(ref) <= len(cand) else (cand, ref)
    if not shared or any(k not in large for k in small):
        raise UnpairedItems(f"the answers are to different items ({len(ref)} and {len(cand)}, {len(shared)} shared)")
    return [ref[k] for k in shared], [cand[k] for k in shared]


# --- Tango's score interval for a paired difference of proportions (vectorized) -------------------------
def _tango_z(b, c, n, d0):
    """Tango's score statistic for H0: p_cand - p_ref = d0, at arrays b, c, n, d0 (decreasing in d0)."""
    a_ = 2 * n
    bb = -b - c + (2 * n - c + b) * d0
    cc = -b * d0 * (1 - d0)
    q = (np.sqrt(np.maximum(bb * bb - 4 * a_ * cc, 0.0)) - bb) / (2 * a_)
    var = n * np.maximum(2 * q + d0 * (1 - d0), 1e-300)
    return (c - b - n * d0) / np.sqrt(var)


def tango_bounds(b, c, n, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """One-sided bounds, each at level `alpha`, of the accuracy difference (c - b) / n of paired items (b: the
    reference right and the candidate wrong; c: the reverse): arrays (lower, upper). Bisection on the score
    statistic; exact enough (1e-9 of the [-1, 1] range) for any decision."""
    b, c, n = (np.asarray(v, dtype=float) for v in np.broadcast_arrays(b, c, n))
    z = NormalDist().inv_cdf(1 - alpha)
    est = np.where(n > 0, (c - b) / np.maximum(n, 1), 0.0)
    lo_a, lo_b = np.full(b.shape, -1 + 1e-12), est.copy()  # lower bound in [-1, est]: z(lo) = z
    hi_a, hi_b = est.copy(), np.full(b.shape, 1 - 1e-12)  # upper bound in [est, 1]: z(hi) = -z
    for _ in range(32):
        m = (lo_a + lo_b) / 2
        above = _tango_z(b, c, n, m) > z  # still inside the region the data reject: the bound is higher
        lo_a, lo_b = np.where(above, m, lo_a), np.where(above, lo_b, m)
        m2 = (hi_a + hi_b) / 2
        below = _tango_z(b, c, n, m2) < -z
        hi_a, hi_b = np.where(below, hi_a, m2), np.where(below, m2, hi_b)
    lo = np.where(_tango_z(b, c, n, np.full(b.shape, -1 + 1e-12)) <= z, -1.0, (lo_a + lo_b) / 2)
    hi = np.where(_tango_z(b, c, n, np.full(b.shape, 1 - 1e-12)) >= -z, 1.0, (hi_a + hi_b) / 2)
    return np.where(n > 0, lo, -1.0), np.where(n > 0, hi, 1.0)


def gate_verdicts(lo, hi, max_drop: float) -> np.ndarray:
    """Non-inferiority verdicts of intervals [lo, hi] of the difference: HOLDS when lo > -max_drop, WORSE when
    hi < -max_drop, else UNDECIDED (codes 0, 1, 2: `_CODES`)."""
    lo, hi = np.asarray(lo, dtype=float), np.asarray(hi, dtype=float)
    return np.where(lo > -max_drop, 0, np.where(hi < -max_drop, 1, 2))


GATE_LOOKS = 3  # the gate's looks at one pair at most: the first (eval.limit), the planned one, one re-planned
POWER = 0.8  # the power the docs state: P(holds | a harmless change), checked by simulation (calibration.py)
# The plan asks for the items that give this power at the look's level from the discordance seen: above POWER,
# since the discordance it plans on is itself an estimate from the first look's few discordant items.
PLAN_POWER = 0.9
STEP = math.sqrt(2)  # look sizes: eval.limit x sqrt(2)^k (a shared ladder: an incumbent's look is reused by hash)


def gate_looks(limit: int, max_items: int) -> int:
    """How many times the gate may look at one pair: GATE_LOOKS, or fewer where the ladder from `limit` to
    `max_items` has fewer sizes (a first look already at the cap is the only one)."""
    return min(GATE_LOOKS, len(ladder(limit, max_items)))


def ladder(first: int, cap: int) -> list[int]:
    """The item counts a look may take: `first` x sqrt(2)^k, then `cap` itself. One ladder for every pair, so the
    incumbent's and the baseline's answers at a size are measured once and reused by every candidate."""
    out, k = [], 0
    first = max(1, first)
    while True:
        n = int(round(first * STEP ** k))
        if n >= cap:
            break
        if not out or n > out[-1]:
            out.append(n)
        k += 1
    return out + [max(1, cap)]


@functools.lru_cache(maxsize=64)
def min_items(max_drop: float, alpha: float) -> int:
    """The fewest items whose interval can rule out `max_drop` at all (no item differing): below it the gate
    cannot hold whatever it sees."""
    n = np.arange(1, 100_001)
    lo, _ = tango_bounds(np.zeros_like(n), np.zeros_like(n), n, alpha)
    ok = np.nonzero(lo > -max_drop)[0]
    return int(n[ok[0]]) if len(ok) else 100_001


FLOOR = 0.5  # a look the plan cannot size within the cap is still taken at the cap when it decides this often


def _plan_terms(a: "PairedAccuracy", max_drop: float) -> tuple[float, float]:
    """(planned discordance, distance of the planned difference to -max_drop) from one look."""
    disc = (a.b + a.c + 1) / (a.n + 1)
    # planned as a harmless change (no difference): the power the gate owes is the power to pass one. The
    # difference a first look sees is too noisy to plan on (at 150 items and 10% discordance its sd is 2.6 points);
    # a candidate truly worse by 2 x max_drop is then shown worse with the same power.
    return disc, max_drop


def power_at(a: "PairedAccuracy", n: int, max_drop: float, alpha: float) -> float:
    """The chance that a look at `n` items decides the pair, by the plan's own model (items_needed)."""
    disc, dist = _plan_terms(a, max_drop)
    return _power(disc, dist, n, max_drop, alpha)


def items_needed(a: "PairedAccuracy", max_drop: float, alpha: float, power: float = PLAN_POWER) -> float:
    """Items for the next look to decide the pair with `power` at the look's level `alpha`, from what this look
    saw: its discordance (b + c of n; one more discordant item assumed, so that none seen is no proof of none), for
    a harmless change. The normal approximation of the paired difference: n = p_disc (z_alpha + z_power)^2 /
    max_drop^2, and never fewer than `min_items`."""
    if a.n <= 0:
        return math.inf
    return _need(*_plan_terms(a, max_drop), max_drop, alpha, power)


def _power(disc: float, dist: float, n: int, max_drop: float, alpha: float) -> float:
    """The plan's model of a look at `n` items: P(decided) at discordance `disc`, `dist` from -max_drop."""
    if n < min_items(max_drop, alpha):
        return 0.0
    return NormalDist().cdf(dist * math.sqrt(n / disc) - NormalDist().inv_cdf(1 - alpha))


def _need(disc: float, dist: float, max_drop: float, alpha: float, power: float) -> float:
    """The plan's model inverted: the items that decide with `power` (never fewer than `min_items`)."""
    if dist < 1e-6:
        return math.inf
    z = NormalDist().inv_cdf(1 - alpha) + NormalDist().inv_cdf(power)
    return max(disc * z * z / dist ** 2, float(min_items(max_drop, alpha)))


@dataclass(frozen=True)
class Plan:
    """The gate's next look at a pair still undecided: how many items decide it, and the look that takes them."""
    need: float  # items that decide it with PLAN_POWER (inf: none do)
    items: Optional[int]  # the next look's item count; None: not within the cap (not spent)
    differ: str  # what the plan rests on: '6 of 200 items differ'
    cap: int

    def undecided(self, what: str = "optimize.gate.max_items") -> str:
        """The reason of a pair left undecided because the plan cannot be met."""
        need = f"{math.ceil(self.need):,}" if math.isfinite(self.need) else "inf"
        return f"plan: {self.differ}, ~{need} items would decide it, more than the {self.cap} {what} (not spent)"


def plan_look(open_: Sequence["PairedAccuracy"], seen: int, first: int, cap: int, max_drop: float,
              alpha: float) -> Plan:
    """The gate's plan after a look that left `open_` undecided (the chain's and the search's one rule): the items
    that decide every open judgement with PLAN_POWER from the discordance seen, up the ladder from `first` past
    `seen`; where that is past `cap`, the cap itself when it decides at least FLOOR of the time, else no look."""
    need = max(items_needed(a, max_drop, alpha) for a in open_)
    nxt = next_look(need, seen, first, cap)
    if nxt is None and cap > seen and min(power_at(a, cap, max_drop, alpha) for a in open_) >= FLOOR:
        nxt = cap  # short of the planned power, but the cap decides more often than not
    worst = max(open_, key=lambda a: a.b + a.c)
    return Plan(need, nxt, f"{worst.b + worst.c} of {worst.n} items differ", cap)


def next_look(need: float, seen: int, first: int, cap: int) -> Optional[int]:
    """The ladder's first size >= `need` and > `seen` (None where that is past `cap`: the pool or the budget
    cannot decide the pair)."""
    if need > cap:
        return None
    return next((n for n in ladder(first, cap) if n >= need and n > seen), None)


@dataclass(frozen=True)
class PairedAccuracy:
    task: str
    n: int
    b: int  # the reference right, the candidate wrong
    c: int  # the candidate right, the reference wrong
    delta: float  # candidate accuracy - reference accuracy (share of items)
    lo: float
    hi: float
    confidence: float  # two-sided level of [lo, hi] (1 - 2 * the look's one-sided level)
    verdict: str
    why: str = ""  # UNPAIRED: why the items could not be paired

    def cell(self) -> str:
        """'emoji_movie -6.4% [-9.5, -3.3] n=100 holds'"""
        name = self.task.removeprefix("bigbench_")
        if self.verdict == UNPAIRED:
            return f"{name} unpaired ({self.why})"
        return (f"{name} {100 * self.delta:+.1f}% [{100 * self.lo:+.1f}, {100 * self.hi:+.1f}] n={self.n} "
                f"{self.verdict}")


def paired_accuracy(task: str, ref: Any, cand: Any, max_drop: float = 0.03, alpha: float = 0.05 / 3,
                    positional_ok: bool = True) -> PairedAccuracy:
    """Judge `cand`'s per-item correctness against `ref`'s on the same items at the one-sided level `alpha`
    (the look's share of `false_holds`). `positional_ok`: False where the two trials built the documents
    themselves from different tokenizers (needle tasks across models), so a position is no identity: the items
    are then paired only when they carry a text hash, else the verdict is UNPAIRED."""
    ri, ci = items_of(ref), items_of(cand)
    conf = 1 - 2 * alpha
    if not positional_ok and not (identified(ri) and identified(ci)):
        return PairedAccuracy(task, 0, 0, 0, 0.0, -1.0, 1.0, conf, UNPAIRED,
                              "each model builds its own documents and the items carry no text hash")
    try:
        a, y = pair_items(ri, ci)
    except UnpairedItems as e:
        return PairedAccuracy(task, 0, 0, 0, 0.0, -1.0, 1.0, conf, UNPAIRED, str(e))
    n = len(a)
    b = sum(1 for x, z in zip(a, y) if x > z)
    c = sum(1 for x, z in zip(a, y) if z > x)
    lo, hi = tango_bounds(b, c, n, alpha)
    verdict = _CODES[int(gate_verdicts(lo, hi, max_drop))]
    return PairedAccuracy(task, n, b, c, (c - b) / n if n else 0.0, float(lo), float(hi), conf, verdict)


POOLED = "pooled"


def pooled_accuracy(ref: Mapping[str, Any], cand: Mapping[str, Any], max_drop: float, alpha: float,
                    unpaired_tasks: Sequence[str] = ()) -> PairedAccuracy:
    """One paired judgement over the items of every task both answered, pooled (each item keyed by its task): the
    gate's question is the accuracy over the pool, and pooling tasks gives it the items a single task lacks. Tasks
    in `unpaired_tasks` (documents each model builds itself, without a text hash) are left out of the pool."""
    tasks = [t for t in cand if t in ref and t not in unpaired_tasks]
    name = f"{POOLED} ({'+'.join(t.removeprefix('bigbench_') for t in tasks)})" if len(tasks) > 1 else \
        (tasks[0] if tasks else POOLED)
    ri: dict[str, float] = {}
    ci: dict[str, float] = {}
    for t in tasks:
        try:
            a, y = pair_items(items_of(ref[t]), items_of(cand[t]))
        except UnpairedItems as e:
            return PairedAccuracy(name, 0, 0, 0, 0.0, -1.0, 1.0, 1 - 2 * alpha, UNPAIRED, f"{t}: {e}")
        ri.update({f"{t}/{i}": x for i, x in enumerate(a)})
        ci.update({f"{t}/{i}": x for i, x in enumerate(y)})
    if not tasks:
        return PairedAccuracy(name, 0, 0, 0, 0.0, -1.0, 1.0, 1 - 2 * alpha, UNPAIRED, "no task both answered")
    return paired_accuracy(name, ri, ci, max_drop, alpha)


def resolution(n: int, alpha: float) -> float:
    """The smallest drop `n` items can rule out with no item lost: the lower bound at b = c = 0."""
    return -float(tango_bounds(0, 0, n, alpha)[0])


# --- the fidelity pre-screen ------------------------------------------------------------------------------
# Items whose answer differs per position whose argmax differs on the pre-screen's fixed text: a multiple-choice
# answer changes only where a candidate moves the ranking of its choices, which one flipped argmax rarely does.
# Measured on SmolLM2-135M in bf16 (benchmarks/bench_prescreen.py, BENCHMARKS.md "The fidelity pre-screen"; 1,000
# pooled items, 1,008 positions, every pair of none / int8-weight / int4-weight / int8-dynamic): 0.36-0.59, the
# lowest 95% lower bound 0.30. The pre-screen predicts with that bound, so a prediction errs toward too few items
# (a look more), never toward refusing a candidate its items could decide.
DISCORDANCE_PER_FLIP = 0.3


@dataclass(frozen=True)
class Prescreen:
    """Two configurations' argmax compared position by position on the same fixed text (eval.fidelity windows)."""
    differ: int  # positions whose argmax differs
    positions: int

    @property
    def share(self) -> float:
        return self.differ / self.positions if self.positions else 1.0

    @property
    def discordance(self) -> float:
        """The share of task items predicted to change their answer (one more differing position assumed, so
        that none seen predicts a little, not nothing)."""
        return min(1.0, DISCORDANCE_PER_FLIP * (self.differ + 1) / (self.positions + 1))

    def need(self, max_drop: float, alpha: float, power: float = PLAN_POWER) -> float:
        """Items that decide a harmless change with `power` at this discordance (the plan's own model)."""
        return _need(self.discordance, max_drop, max_drop, alpha, power)

    def power_at(self, n: int, max_drop: float, alpha: float) -> float:
        """The chance that a look at `n` items decides a harmless change at this discordance."""
        return _power(self.discordance, max_drop, n, max_drop, alpha)

    def cell(self) -> str:
        return f"top-1 differs at {self.differ:,} of {self.positions:,} positions ({100 * self.share:.1f}%)"


def prescreen(a: Mapping[str, Any], b: Mapping[str, Any]) -> Optional[Prescreen]:
    """Compare two trials' argmax ids (TOP1_ARTIFACT: {"windows": digest, "top1": per window}); None where they
    are not over the same windows (another text or tokenizer, or nothing logged: no comparison)."""
    if not a or not b or a.get("windows") != b.get("windows"):
        return None
    wa, wb = a.get("top1") or [], b.get("top1") or []
    if not wa or len(wa) != len(wb) or any(len(x) != len(y) for x, y in zip(wa, wb)):
        return None
    x, y = np.concatenate([np.asarray(w) for w in wa]), np.concatenate([np.asarray(w) for w in wb])
    return Prescreen(int((x != y).sum()), int(x.size))
