"""The serving view of a report (vLLM's `plot_pareto`): for each configuration of a serving sweep, the
tokens/s one user sees (1000 / median TPOT) against the tokens/s the server delivers in total, the Pareto
frontier marked; and goodput against the offered rate (a capacity search: at its found rate).

A configuration is on the frontier when no other configuration of the same workload is at least as good on
both axes and better on one; a capacity search that found no rate within the SLO, or a trial measured under
machine load (`unstable: load`), is shown but not ranked. Works on the report's `Line`s (experiments/analysis/report.py), so the
configurations carry the names the trial table gives them.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class ServingPoint:
    name: str  # the configuration, as the trial table names it
    workload: str
    total_tok_s: float  # output tokens/s of the whole server
    user_tok_s: float  # tokens/s one request sees while decoding: 1000 / tpot_ms_p50
    rate: Optional[float]  # offered rate: max_rate_at_slo for a capacity search, else workload.rate (None: all at once)
    goodput: Optional[float]
    searched: bool
    hash: str
    loaded: bool = False  # measured under machine load (results.loaded): shown, never ranked

    @property
    def within_slo(self) -> bool:
        """False for a capacity search that found no rate: its numbers are the synchronous probe's (one
        request at a time), not a load it serves within the SLO, so it is left out of the frontier."""
        return not self.searched or bool(self.rate)


def points(lines) -> list[ServingPoint]:
    """The serving trials among `lines` (finished, with output_tok_s and a TPOT)."""
    from .results import loaded

    out = []
    for ln in lines:
        r = ln.row
        total, tpot = r.num("output_tok_s"), r.num("tpot_ms_p50")
        if not r.finished or total is None or not tpot or "goodput" not in r.metrics:
            continue
        searched = r.num("max_rate_at_slo") is not None
        if searched:
            rate = r.num("max_rate_at_slo")
        elif r.params.get("workload.arrival") in ("poisson", "fixed-rate"):
            rate = float(r.params["workload.rate"])
        else:
            rate = None
        out.append(ServingPoint(ln.optimizations or r.name, ln.workload, total, 1000.0 / tpot, rate,
                                r.num("goodput_at_slo") if searched else r.num("goodput"), searched, r.hash,
                                loaded(r)))
    return out


def frontier(xy: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point dominates (higher is better on both axes)."""
    front = []
    for i, (x, y) in enumerate(xy):
        if not any((a >= x and b >= y) and (a > x or b > y) for j, (a, b) in enumerate(xy) if j != i):
            front.append(i)
    return front


def by_workload(pts: list[ServingPoint]) -> dict[str, list[ServingPoint]]:
    g: dict[str, list[ServingPoint]] = {}
    for p in pts:
        g.setdefault(p.workload, []).append(p)
    return g


def ranked_front(ps: list[ServingPoint]) -> set[int]:
    """Indices (into `ps`) of the frontier among the points within the SLO and not measured under load."""
    ranked = [i for i, p in enumerate(ps) if p.within_slo and not p.loaded]
    return {ranked[j] for j in frontier([(ps[i].total_tok_s, ps[i].user_tok_s) for i in ranked])}


def to_markdown(pts: list[ServingPoint]) -> str:
    rows = ["| workload | configuration | max rate at SLO req/s | goodput req/s | total tok/s | tok/s per user | Pareto |",
            "|---|---|---:|---:|---:|---:|:---:|"]
    for wl, ps in sorted(by_workload(pts).items()):
        front = ranked_front(ps)
        for i, p in sorted(enumerate(ps), key=lambda ip: -ip[1].total_tok_s):
            rate = "-" if p.rate is None else f"{p.rate:.3g}"
            if not p.searched and p.rate is not None:
                rate = f"({rate} offered)"
            if not p.within_slo:
                rate = "none (one at a time shown)"
            good = "-" if p.goodput is None else f"{p.goodput:.3g}"
            mark = "*" if i in front else ("not ranked (unstable: load)" if p.loaded else "")
            rows.append(f"| {wl} | {p.name} | {rate} | {good} | {p.total_tok_s:.1f} | {p.user_tok_s:.1f} | {mark} |")
    return "\n".join(rows)


def plot(pts: list[ServingPoint], path: Path) -> Optional[Path]:
    """Per workload: tok/s per user vs total tok/s (frontier dashed, points numbered and named), and
    goodput vs rate. None without serving points."""
    groups = by_workload(pts)
    if not groups:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(groups)
    most = max(len(v) for v in groups.values())
    fig, axs = plt.subplots(n, 2, figsize=(12, (4.5 + 0.14 * most) * n), squeeze=False)
    for (left, right), (wl, ps) in zip(axs, sorted(groups.items())):
        xy = [(p.total_tok_s, p.user_tok_s) for p in ps]
        front = ranked_front(ps)
        fx = sorted((xy[i] for i in front))
        left.plot([x for x, _ in fx], [y for _, y in fx], "k--", lw=1, label="Pareto frontier", zorder=2)
        for i, p in enumerate(ps):
            on = i in front
            style = {"edgecolor": "black" if on else "none"} if p.within_slo else {"marker": "x"}
            left.scatter(*xy[i], s=70 if on else 35, zorder=3, **style,
                         label=f"{i + 1}: {p.name}" + (" *" if on else "") + ("" if p.within_slo else
                                                                                " (no rate within SLO: one at a time)"))
            left.annotate(str(i + 1), xy[i], fontsize=8, xytext=(4, 4), textcoords="offset points")
        left.set_xlabel("total output tok/s (right: more throughput)")
        left.set_ylabel("tok/s per user = 1000 / TPOT p50 (up: faster per user)")
        left.set_title(f"throughput vs interactivity: {wl}", fontsize=9)
        left.grid(True, alpha=0.3)
        left.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.15), frameon=False)
        rated = [(i, p) for i, p in enumerate(ps) if p.rate is not None and p.goodput is not None]
        for i, p in rated:
            right.scatter(p.rate, p.goodput, s=40, marker="o" if p.searched else "s")
            right.annotate(str(i + 1), (p.rate, p.goodput), fontsize=8, xytext=(4, 4), textcoords="offset points")
        if rated:
            hi = max(max(p.rate for _, p in rated), max(p.goodput for _, p in rated)) * 1.1
            right.plot([0, hi], [0, hi], ":", color="gray", lw=1, label="goodput = rate")
            right.legend(fontsize=7)
        right.set_xlabel("rate req/s (capacity search: max rate at SLO)")
        right.set_ylabel("goodput req/s")
        right.set_title(f"goodput vs rate: {wl}", fontsize=9)
        right.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
