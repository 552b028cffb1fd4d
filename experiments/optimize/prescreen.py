"""The accuracy gate's fidelity pre-screen: before a step's candidates spend any task items, each configuration
(the incumbent, the baseline where its scores can differ, every variant) runs once with `eval.fidelity` on fixed
text -- `optimize.gate.prescreen` windows of the workload's context, no task items -- and logs its argmax at every
position (engine/pipeline.py TOP1_ARTIFACT). Two configurations then compare position by position, with no trial
more: the share of positions whose argmax differs predicts the share of task items whose answer differs
(accuracy.py `Prescreen`), which is what the gate's power rests on.

What the chain does with it (chain.py): orders a step's variants from the most faithful to the incumbent to the
least (ties: the seed's order); sizes a candidate's first look at the items its predicted discordance needs (on
pooled items: the ladder's size, so the incumbent's answers at it are still shared); and leaves a candidate
undecided without a trial where even its predicted discordance needs more items than the pool or
`optimize.gate.max_items` can give -- a hopeless one, since the prediction errs toward too few items. The
pre-screen never says "holds" or "worse": the gate's items do, at the gate's calibrated levels.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence

from .accuracy import Prescreen, prescreen
from .measurement import Measurement, Point, Request, point_key

FIDELITY = {"eval.enabled": "true", "eval.fidelity": "true", "eval.tasks": "[]"}


class Prescreener:
    """Each configuration's argmax ids on the pre-screen's windows, measured once (one trial, alone) and kept."""

    def __init__(self, windows: int, run: Callable[[Request], list[Measurement]]):
        self.windows = windows
        self._run = run
        self._ids: dict[tuple, dict] = {}

    def point(self, p: Point) -> Point:
        """The pre-screen trial of `p`: its fidelity on `windows` windows, no task items."""
        return {**p, **FIDELITY, "eval.num_windows": str(self.windows)}

    def measure(self, points: Sequence[Point]) -> None:
        """The argmax ids of every point not measured yet, as one request (its trials count toward the budget)."""
        todo: dict[tuple, Point] = {}
        for p in points:
            if point_key(p) not in self._ids:
                todo.setdefault(point_key(p), dict(p))
        if not todo:
            return
        ms = self._run(Request(tuple(self.point(p) for p in todo.values())))
        for k, m in zip(todo, ms):
            self._ids[k] = m.top1 if m.ok else {}

    def compare(self, a: Mapping[str, str], b: Mapping[str, str]) -> Optional[Prescreen]:
        """`b` against `a` position by position; None where either was not measured or their windows differ."""
        return prescreen(self._ids.get(point_key(a), {}), self._ids.get(point_key(b), {}))
