"""Plots logged with a trial's run: a capacity search's probe curve (engine/serving/capacity.py), and a needle
task's score by depth (engine/tasks/needle.py; the sweep report draws context x depth heatmaps from the same
metrics, experiments/analysis/needle.py)."""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Mapping, Optional

SYNC, POISSON, SATURATING = 0.0, 1.0, 2.0  # probe_kind (engine/measure/metrics.py capacity_metrics)


def plot_capacity_curve(series: dict[str, list[float]], path: Path) -> Optional[Path]:
    """Rate -> p50/p99 TTFT and TPOT (left), throughput and goodput (right). The Poisson probes are the
    curve; the synchronous (triangle) and saturating (square) probes are drawn at the rate they achieved;
    probes that miss the SLO are hollow. None when the series is not a capacity curve."""
    need = ("probe_rate", "probe_ttft_ms_p50", "probe_ttft_ms_p99", "probe_tpot_ms_p50", "probe_tpot_ms_p99",
            "probe_request_s", "probe_goodput", "probe_meets_slo")
    if any(k not in series or not series[k] for k in need):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rate = series["probe_rate"]
    kind = series.get("probe_kind") or [POISSON] * len(rate)
    ok = [bool(v) for v in series["probe_meets_slo"]]
    marker = {SYNC: "^", POISSON: "o", SATURATING: "s"}
    curve = [i for i, k in enumerate(kind) if k == POISSON]

    def draw(ax, key: str, label: str) -> None:
        line, = ax.plot([rate[i] for i in curve], [series[key][i] for i in curve], "-", label=label)
        for x, y, k, good in zip(rate, series[key], kind, ok):
            ax.plot([x], [y], marker.get(k, "o"), color=line.get_color(), fillstyle="full" if good else "none")

    fig, (lat, thr) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("probe_ttft_ms_p50", "TTFT p50"), ("probe_ttft_ms_p99", "TTFT p99"),
                       ("probe_tpot_ms_p50", "TPOT p50"), ("probe_tpot_ms_p99", "TPOT p99")):
        draw(lat, key, label)
    lat.set_xlabel("offered Poisson rate (req/s); ^ one at a time, s all at once: achieved rate")
    lat.set_ylabel("ms")
    lat.set_yscale("log")
    lat.legend(fontsize=8)
    lat.set_title("latency by probe (hollow: misses the SLO)", fontsize=10)
    draw(thr, "probe_request_s", "completed req/s")
    draw(thr, "probe_goodput", "goodput (req/s within SLO)")
    thr.set_xlabel("offered Poisson rate (req/s)")
    thr.legend(fontsize=8)
    thr.set_title("throughput by probe", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# a needle task's score at one depth (engine/tasks/run.py): task_score.<task>.d<percent>
DEPTH_KEY = re.compile(r"^task_score\.(?P<task>[^.]+)\.d(?P<depth>\d+)$")


def needle_artifact(task: str) -> str:
    """The file name of a needle task's plot, in a trial's run and in the sweep report (`report/`)."""
    return f"needle_{task}.png"


def needle_depths(metrics: Mapping[str, float]) -> dict[str, dict[int, float]]:
    """task -> {depth %: score} of the needle tasks in one trial's metrics ({} when it ran none)."""
    out: dict[str, dict[int, float]] = {}
    for k, v in metrics.items():
        m = DEPTH_KEY.match(k)
        if m:
            out.setdefault(m["task"], {})[int(m["depth"])] = float(v)
    return out


def plot_needle_depths(task: str, metrics: Mapping[str, float], context_len: int, path: Path) -> Optional[Path]:
    """One trial's needle task at its context length: a bar per depth (score, with its standard error over the
    depth's examples, sqrt(p(1-p)/(n-1)), where `task_n.<task>` says how many), and the fp32 reference's score at
    that depth (`task_ref.<task>.d<pct>`) as a black tick. None when the trial has no depth scores for `task`."""
    scores = needle_depths(metrics).get(task)
    if not scores:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = sorted(scores)
    ys = [scores[d] for d in depths]
    n = metrics.get(f"task_n.{task}")
    per_depth = n / len(depths) if n else 0
    # lm-eval's stderr of a mean of 0/1 scores (sample stdev / sqrt(n)), as task_score_stderr
    err = [math.sqrt(y * (1 - y) / (per_depth - 1)) if per_depth > 1 else 0.0 for y in ys]
    xs = range(len(depths))
    fig, ax = plt.subplots(figsize=(1.1 * len(depths) + 3.5, 3.4))
    ax.bar(xs, ys, yerr=err, capsize=3, color=[plt.cm.RdYlGn(y) for y in ys], edgecolor="#444444",
           label="this trial")
    refs = [metrics.get(f"task_ref.{task}.d{d}") for d in depths]
    if any(r is not None for r in refs):
        ax.scatter([x for x, r in zip(xs, refs) if r is not None], [r for r in refs if r is not None], marker="_",
                   s=600, color="black", linewidths=2, label="fp32 reference", zorder=3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_xticks(list(xs), [f"{d}%\n{y:.2f}" for d, y in zip(depths, ys)])
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("needle depth (score)")
    ax.set_ylabel("exact match")
    fit_title(ax, f"{task} at {context_len} tokens" + (f" ({per_depth:.0f} per depth)" if per_depth else ""), 10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def wrapped(ax, text: str, fontsize: float = 10) -> str:
    """`text` wrapped onto as many lines as the figure's width needs at `fontsize` (a long title or axis label --
    a final configuration, a legend in words -- is otherwise clipped at the figure's edges; `tight_layout` makes
    room for the extra lines)."""
    import textwrap

    # centred on the axes, which tick labels at their side narrow further when the layout is tightened
    width_pt = ax.figure.get_figwidth() * 72 * ax.get_position().width * 0.9
    per_line = max(20, int(width_pt / (0.6 * fontsize)))  # an average glyph of DejaVu Sans is ~0.6 em wide
    return textwrap.fill(text, per_line)


def fit_title(ax, text: str, fontsize: float = 10) -> None:
    """`ax.set_title(text)`, wrapped to the figure's width."""
    ax.set_title(wrapped(ax, text, fontsize), fontsize=fontsize)
