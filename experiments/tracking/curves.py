"""The plot of a capacity search's probe curve (engine/serving/capacity.py), logged with the trial's run."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

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
