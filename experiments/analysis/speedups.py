"""Speculative-decoding speedups over recorded trials: each speculative trial against its speculative=off twin.

The speedup is a property of a *pair* of trials, so it is computed here from the rows (reports, benchmarks)
rather than inside a trial. The twin is the finished trial with speculative.method=off that equals the
speculative one on every swept axis except the speculative.* keys (k, draft_layers... mean nothing when
off). Speedup = tpot_ms(off) / tpot_ms(speculative): the decode phase, the only one speculation changes
(the prefill is the same forward in both; the drafter's own prompt prefill counts against speculation).
"""
from __future__ import annotations

from typing import Optional

from engine.axes import SPECULATIVE

from .results import TrialRow, axes, counterpart

METHOD = SPECULATIVE.key
SPEEDUP = "speculative_speedup"  # engine.measure.metrics.METRICS documents it


def is_speculative(row: TrialRow) -> bool:
    return bool(SPECULATIVE.applied(row.params))


def off_twin(rows: list[TrialRow], row: TrialRow, ax: Optional[list[str]] = None) -> Optional[TrialRow]:
    """The finished speculative=off trial at `row`'s other settings, or None when the sweep has none."""
    ax = ax if ax is not None else axes(rows)
    changes: dict = {k: (lambda _v: True) for k in ax if k.startswith("speculative.") and k != METHOD}
    changes[METHOD] = SPECULATIVE.off
    return counterpart(rows, row, changes, ax)


def speculative_speedups(rows: list[TrialRow]) -> dict[str, float]:
    """run_id -> speedup over the off twin, for every finished speculative trial that has one."""
    ax = axes(rows)
    out: dict[str, float] = {}
    for r in rows:
        if not (r.finished and is_speculative(r)):
            continue
        base = off_twin(rows, r, ax)
        if base is not None and base.num("tpot_ms") and r.num("tpot_ms"):
            out[r.run_id] = base.num("tpot_ms") / r.num("tpot_ms")
    return out


def with_speedups(rows: list[TrialRow]) -> list[TrialRow]:
    """Add `speculative_speedup` to the metrics of the rows that have an off twin (in place); returns them."""
    sp = speculative_speedups(rows)
    for r in rows:
        if r.run_id in sp:
            r.metrics[SPEEDUP] = sp[r.run_id]
    return rows
