"""The plot of a capacity search's probe curve (engine/serving/capacity.py), logged with the trial's run."""
from __future__ import annotations

from pathlib import Path
from typing import Optional


def plot_capacity_curve(series: dict[str, list[float]], path: Path) -> Optional[Path]:
    """Rate -> p50/p99 TTFT and TPOT (left), throughput and goodput (right); failing probes hollow.
    None when the series is not a capacity curve."""
    need = ("probe_rate", "probe_ttft_ms_p50", "probe_ttft_ms_p99", "probe_tpot_ms_p50", "probe_tpot_ms_p99",
            "probe_request_s", "probe_goodput", "probe_meets_slo")
    if any(k not in series or not series[k] for k in need):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rate = series["probe_rate"]
    ok = [bool(v) for v in series["probe_meets_slo"]]
    fig, (lat, thr) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("probe_ttft_ms_p50", "TTFT p50"), ("probe_ttft_ms_p99", "TTFT p99"),
                       ("probe_tpot_ms_p50", "TPOT p50"), ("probe_tpot_ms_p99", "TPOT p99")):
        line, = lat.plot(rate, series[key], "-", label=label)
        for x, y, good in zip(rate, series[key], ok):
            lat.plot([x], [y], "o", color=line.get_color(), fillstyle="full" if good else "none")
    lat.set_xlabel("offered rate (req/s)")
    lat.set_ylabel("ms")
    lat.set_yscale("log")
    lat.legend(fontsize=8)
    lat.set_title("latency by probe (hollow: misses the SLO)")
    thr.plot(rate, series["probe_request_s"], "o-", label="completed req/s")
    thr.plot(rate, series["probe_goodput"], "s-", label="goodput (req/s within SLO)")
    thr.set_xlabel("offered rate (req/s)")
    thr.legend(fontsize=8)
    thr.set_title("throughput by probe")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
