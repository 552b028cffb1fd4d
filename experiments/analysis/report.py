"""`infersweep report SWEEP`: a sweep's trials read back from MLflow as a table (speedup vs the baseline,
accuracy deltas, regimes), plots, next-optimization advice and -- for `experiment=seed-claims` -- the seed's
claims. Written as Markdown + CSV + PNG under `reports/<SWEEP>/` and logged to the sweep's parent run
(artifact folder `report/`).

Baseline: by default, in each workload (trials equal on every non-optimization axis: context length,
batch, model, ...), the trial with the fewest optimizations of the seed's chain applied (ties: the hf
backend, then the first trial). `--baseline kv_cache=off,attention=eager` (groups or dotted keys) or
`--baseline HASH` (its optimization settings) chooses another; speedups are always within a workload.
"""
from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from engine import axes as axis_registry
from engine.axes import BACKEND
from engine.measure.noise import UNSTABLE
from engine.measure.spread import WITHIN_NOISE, Ratio

from ..config.compose import BUNDLE_GROUPS

from . import advice as adv
from . import claims as cl
from . import serving as sv
from ..errors import UserError
from .results import (
    CONTEXT,
    NOT_DECIDABLE,
    SPREAD,
    WHAT_TO_DO,
    causes,
    loaded,
    Selection,
    TrialRow,
    axes,
    compare,
    is_opt_axis,
    load,
    opt_label,
    speedup,
    workload_key,
    workload_labeler,
)

REPORTS_DIR = "reports"
ARTIFACT_DIR = "report"
SEED_CLAIMS = "seed-claims"
SERVING_CAPACITY = "serving-capacity"  # its report carries the re-prompting claim
QUANT_ACCURACY = "quant-accuracy"  # its report carries the accuracy claims
RIGHT_SIZE = "right-size"  # its report carries "right-size before you tune"


class ReportError(UserError):
    heading = "cannot report"


# --- baseline -------------------------------------------------------------------------------------------
def parse_baseline(spec: Optional[str]) -> Optional[dict[str, str]]:
    """'kv_cache=off,attention=eager' -> {'kv_cache': 'off', 'attention': 'eager'}; a bare hex string is a hash."""
    if not spec:
        return None
    if re.fullmatch(r"[0-9a-f]{6,64}", spec):
        return {"#hash": spec}
    out = {}
    for part in re.split(r"[,\s]+", spec.strip()):
        if not part:
            continue
        if "=" not in part:
            raise ValueError(f"--baseline: expected KEY=VALUE or a config hash, got {part!r}")
        k, v = part.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def _matches(row: TrialRow, spec: dict[str, str]) -> bool:
    for k, v in spec.items():
        if k in row.params:
            if row.params[k] != v:
                return False
            continue
        key = axis_registry.resolve_key(k)  # `kv_cache=off` names the axis' key, kv_cache.mode
        if row.params.get(key) != v:
            return False
    return True


def choose_baselines(rows: list[TrialRow], ax: list[str], spec: Optional[dict[str, str]]) -> dict[tuple, Optional[TrialRow]]:
    """Workload key -> its baseline trial (None when the spec matches nothing in that workload)."""
    done = [r for r in rows if r.finished]
    if spec and "#hash" in spec:
        ref = next((r for r in done if r.tags.get("config_hash", "").startswith(spec["#hash"])), None)
        if ref is None:
            raise ValueError(f"--baseline: no finished trial has config hash {spec['#hash']}...")
        spec = {k: ref.params[k] for k in ax if is_opt_axis(k)}
    groups: dict[tuple, list[TrialRow]] = {}
    for r in done:
        groups.setdefault(workload_key(r, ax), []).append(r)
    out: dict[tuple, Optional[TrialRow]] = {}
    for key, members in groups.items():
        if spec:
            out[key] = next((r for r in members if _matches(r, spec)), None)
        else:
            out[key] = min(members, key=lambda r: (adv.n_applied(r), r.params.get(BACKEND.key, BACKEND.off) != BACKEND.off))
    return out


# --- table ----------------------------------------------------------------------------------------------
# each speedup against the baseline: (name in the table's values, the timing it compares)
SPEEDUPS = (("speedup", "output_tok_s"), ("decode_speedup", "decode_tok_s"), ("prefill_speedup", "prefill_tok_s"))
# A share of the roofline above 100% is not a fact about the engine: the probe's peaks describe torch's own
# kernels (another engine can beat them) or were measured on a loaded machine (too low).
ROOFLINE_MISMATCH = ("above the roofline: the probe's peaks do not describe this engine's kernels or were measured "
                     "under load (`infersweep probe --refresh` on a quiet machine) -- not a physical share")
# eval=fidelity's llama.cpp-style detail beside kl_div_mean and top1_agreement (trials.csv)
FIDELITY_DETAIL = ("kl_div_mean_stderr", "kl_div_p99", "kl_div_p999", "kl_div_max", "top1_agreement_stderr", "ppl_ratio",
                   "ppl_ratio_stderr")


@dataclass
class Line:
    """One trial with its comparisons to the baseline of its workload."""

    row: TrialRow
    workload: str
    optimizations: str
    baseline: Optional[TrialRow]
    values: dict[str, Any] = field(default_factory=dict)
    comparisons: dict[str, Optional[Ratio]] = field(default_factory=dict)  # speedup name -> interval, verdict

    @property
    def is_baseline(self) -> bool:
        return self.baseline is not None and self.baseline.run_id == self.row.run_id

    @property
    def pair(self) -> list[TrialRow]:
        """The trials its comparisons are drawn from (none for the baseline itself)."""
        return [] if self.baseline is None or self.is_baseline else [self.baseline, self.row]

    @property
    def decidable(self) -> bool:
        """False when its comparisons draw on a trial measured under machine load (results.loaded)."""
        return not any(loaded(r) for r in self.pair)


def lines(rows: list[TrialRow], ax: list[str], baselines: dict[tuple, Optional[TrialRow]],
          label: Callable[[tuple], str]) -> list[Line]:
    """`label`: workload key -> its name in the report (`workload_labeler` over the sweep's keys)."""
    out = []
    for r in rows:
        key = workload_key(r, ax)
        base = baselines.get(key)
        ln = Line(r, label(key), opt_label(r, ax), base)
        m, b = r.metrics, (base.metrics if base else {})
        v = ln.values
        for k in ("output_tok_s", "decode_tok_s", "prefill_tok_s", "ttft_ms_p50", "tpot_ms_p50", "roofline_tok_s",
                  "roofline_efficiency", "ppl", "kl_div_mean", "top1_agreement", "peak_mem_bytes", "attn_peak_bytes",
                  "weights_bytes", "decode_bw_util", "decode_compute_util", "prefill_bw_util", "prefill_compute_util",
                  *FIDELITY_DETAIL):
            v[k] = m.get(k)
        for name, metric in SPEEDUPS:
            v[name] = speedup(b.get(metric), m.get(metric))
            cmp = compare(base, r, metric) if base is not None and not ln.is_baseline else None
            ln.comparisons[name] = cmp
            if cmp is not None:
                v[f"{name}_lo"], v[f"{name}_hi"], v[f"{name}_verdict"] = cmp.lo, cmp.hi, cmp.verdict
            if not ln.decidable and v[name] is not None:
                v[f"{name}_verdict"] = f"{NOT_DECIDABLE} (unstable: load)"
        v[UNSTABLE] = r.tags.get(UNSTABLE)
        eff = m.get("roofline_efficiency")
        v["roofline_flag"] = ROOFLINE_MISMATCH if eff is not None and eff > 1 else None
        if m.get("ppl") is not None and b.get("ppl"):
            v["ppl_delta"] = m["ppl"] - b["ppl"]
            v["ppl_delta_pct"] = 100 * (m["ppl"] / b["ppl"] - 1)
        for t in ("regime", "regime.phase", "regime.prefill", "regime.decode", "regime.prefill.measured", "regime.decode.measured"):
            v[t] = r.tags.get(t)
        out.append(ln)
    return out


def _f(x: Optional[float], fmt: str) -> str:
    return "-" if x is None else fmt.format(x)


def _regime_cell(ln: Line) -> str:
    p = ln.values.get("regime.prefill.measured") or ln.values.get("regime.prefill")
    d = ln.values.get("regime.decode.measured") or ln.values.get("regime.decode")
    if not p and not d:
        return "-"
    return f"{(p or '?')[:3]}/{(d or '?')[:3]}"


TABLE_HEADER = ["workload", "optimizations", "hash", "regime p/d", "out tok/s", "speedup", "decode tok/s", "decode x",
                "prefill tok/s", "ttft ms", "roofline tok/s", "roofline %", "ppl", "Δppl", "peak MB", "status"]


SPREAD_DECIDED = "(unstable: spread; intervals separate)"
GROUP_MEMORY_NOTE = ("each variant's own footprint (its weights + what its own calls allocated: KV cache, scratch); "
                     "their process held the whole group's models, whose peak is `group_peak_mem_bytes`")


def _speedup_cell(ln: Line, name: str) -> str:
    """'x1.23 [1.10-1.35]' with its interval (' ~': within noise), or 'x1.23' where no interval was logged.
    Drawn from a trial measured under load: 'x1.23 (unstable: load)', no interval and no verdict; from a
    spread-flagged one whose interval still excludes x1: the verdict stands and the cell says why."""
    cmp, value = ln.comparisons.get(name), ln.values[name]
    if not ln.decidable:
        return "-" if value is None else f"x{value:.2f} (unstable: load)"
    if cmp is None:
        return _f(value, "x{:.2f}")
    spread = any(SPREAD in causes(r) for r in ln.pair)
    return cmp.cell() + (" " + SPREAD_DECIDED if spread and cmp.verdict != WITHIN_NOISE else "")


def _roofline_cell(v: dict[str, Any]) -> str:
    eff = v["roofline_efficiency"]
    if eff is None:
        return "-"
    return f">100 (!{100 * eff:.0f})" if v.get("roofline_flag") else f"{100 * eff:.3g}"


def table_cells(ln: Line) -> list[str]:
    v = ln.values
    mark = " (baseline)" if ln.is_baseline else ""
    dppl = "-" if v.get("ppl_delta_pct") is None else f"{v['ppl_delta']:+.3f} ({v['ppl_delta_pct']:+.1f}%)"
    return [
        ln.workload, ln.optimizations + mark, ln.row.hash[:8], _regime_cell(ln),
        _f(v["output_tok_s"], "{:.2f}"), _speedup_cell(ln, "speedup"), _f(v["decode_tok_s"], "{:.2f}"),
        _speedup_cell(ln, "decode_speedup"), _f(v["prefill_tok_s"], "{:.0f}"), _f(v["ttft_ms_p50"], "{:.1f}"),
        _f(v["roofline_tok_s"], "{:.1f}"), _roofline_cell(v),
        _f(v["ppl"], "{:.3f}"), dppl, _f(None if v["peak_mem_bytes"] is None else v["peak_mem_bytes"] / 1e6, "{:.0f}"),
        ln.row.status + (" unstable" if v.get(UNSTABLE) else ""),
    ]


def table_notes(ls: list[Line]) -> list[str]:
    """What the table's marks mean, for the marks it uses: intervals and '~', unstable trials and why,
    roofline shares above 100%."""
    out = []
    if any(ln.comparisons.get(n) for ln in ls for n, _ in SPEEDUPS):
        out.append("speedups: x median ratio [95% interval from both trials' intervals]; `~` = within noise "
                   "(the interval contains x1)")
    if any(not ln.decidable for ln in ls):
        out.append("`(unstable: load)`: not decidable -- the ratio draws on a trial measured while other processes "
                   "took the machine, which biases its median in a way its interval does not carry; no verdict. "
                   "To decide: " + WHAT_TO_DO)
    if any(SPREAD_DECIDED in _speedup_cell(ln, n) for ln in ls for n, _ in SPEEDUPS):
        out.append(f"`{SPREAD_DECIDED}`: a trial's interval is wider than the smallest effect judged (10%), but "
                   "the ratio's interval, which carries that width, still excludes x1: the verdict stands")
    for ln in ls:
        if ln.values.get(UNSTABLE):
            out.append(f"unstable ({ln.row.hash[:8]}, {ln.optimizations}): {ln.values[UNSTABLE]}")
    grouped = [ln.row.hash[:8] for ln in ls if ln.row.num("group_peak_mem_bytes") is not None]
    if grouped:
        out.append(f"peak MB of interleaved trials ({', '.join(grouped)}): {GROUP_MEMORY_NOTE}")
    flagged = [ln.row.hash[:8] for ln in ls if ln.values.get("roofline_flag")]
    if flagged:
        out.append(f"roofline % `>100 (!N)` ({', '.join(flagged)}): {ROOFLINE_MISMATCH}")
    return out


def markdown_table(ls: list[Line]) -> str:
    out = ["| " + " | ".join(TABLE_HEADER) + " |", "|" + "---|" * len(TABLE_HEADER)]
    out += ["| " + " | ".join(c.replace("|", "/") for c in table_cells(ln)) + " |" for ln in ls]
    return "\n".join(out)


def text_table(ls: list[Line]) -> str:
    body = [table_cells(ln) for ln in ls]
    widths = [max(len(x) for x in col) for col in zip(TABLE_HEADER, *body)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(TABLE_HEADER), fmt(["-" * w for w in widths])] + [fmt(b) for b in body])


CSV_FIELDS = ["run_id", "hash", "name", "status", UNSTABLE, "workload", "optimizations", "baseline_hash", "chain",
              "output_tok_s", "speedup", "speedup_lo", "speedup_hi", "speedup_verdict", "decode_tok_s", "decode_speedup",
              "decode_speedup_lo", "decode_speedup_hi", "decode_speedup_verdict", "prefill_tok_s", "prefill_speedup",
              "prefill_speedup_lo", "prefill_speedup_hi", "prefill_speedup_verdict", "roofline_flag", "ttft_ms_p50",
              "tpot_ms_p50", "roofline_tok_s", "roofline_efficiency", "ppl", "ppl_delta", "ppl_delta_pct",
              "kl_div_mean", "top1_agreement", *FIDELITY_DETAIL, "peak_mem_bytes", "attn_peak_bytes", "weights_bytes",
              "decode_bw_util", "decode_compute_util", "prefill_bw_util", "prefill_compute_util", "regime",
              "regime.phase", "regime.prefill.measured", "regime.decode.measured", "regime.prefill", "regime.decode"]


def csv_text(ls: list[Line]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for ln in ls:
        w.writerow({**{k: ("" if v is None else v) for k, v in ln.values.items()}, "run_id": ln.row.run_id,
                    "hash": ln.row.hash, "name": ln.row.name, "status": ln.row.status, "workload": ln.workload,
                    "optimizations": ln.optimizations, "chain": adv.chain_label(ln.row),
                    "baseline_hash": ln.baseline.hash if ln.baseline else ""})
    return buf.getvalue()


# --- plots ----------------------------------------------------------------------------------------------
REGIME_COLORS = {"memory": "#3b75af", "compute": "#ef8636", None: "#9a9a9a"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def variant_label(ln: Line, ax_keys: list[str]) -> str:
    """What varies, as briefly as it can be said: the run name's settings (what the sweep set: a bundle such as
    `engine_variant=llamacpp-q8_0` is one word, not the five keys it sets) without the workload axes a plot
    already shows, or the optimization axes' settings, whichever is shorter."""
    workload = {k for k in ax_keys if not is_opt_axis(k)}
    words = []
    for tok in ln.row.name.split():
        key, eq, value = tok.partition("=")
        if not eq or key in workload:
            continue
        words.append(value if key in BUNDLE_GROUPS else tok)
    by_name = " ".join(words)
    return by_name if by_name and len(by_name) < len(ln.optimizations) else ln.optimizations


def _yerr(lns: list[Line], metric: str) -> Optional[list[list[float]]]:
    """Asymmetric error bars [below, above] from each trial's logged 95% interval (0 where it has none)."""
    lo, hi = [], []
    for ln in lns:
        m, v = ln.row.metrics, ln.row.num(metric) or 0.0
        lo.append(max(0.0, v - m[f"{metric}_ci_lo"]) if f"{metric}_ci_lo" in m else 0.0)
        hi.append(max(0.0, m[f"{metric}_ci_hi"] - v) if f"{metric}_ci_hi" in m else 0.0)
    return [lo, hi] if any(lo) or any(hi) else None


def plot_footer(lns: list[Line]) -> str:
    """Machine, load and date of the trials a plot shows, for its bottom line."""
    import time as _time

    rows = [ln.row for ln in lns]
    hw = "; ".join(dict.fromkeys(r.hardware() for r in rows)) or "?"
    loads = [r.num("noise_load_avg") for r in rows if r.num("noise_load_avg") is not None]
    other = [r.num("noise_other_cpu_frac") for r in rows if r.num("noise_other_cpu_frac") is not None]
    load = (f"load {min(loads):.2f}-{max(loads):.2f}/CPU" if loads else "load not recorded")
    if other:
        load += f", other processes {100 * min(other):.0f}-{100 * max(other):.0f}% of the CPUs"
    n_unstable = sum(bool(r.tags.get(UNSTABLE)) for r in rows)
    if n_unstable:
        load += f"; {n_unstable} unstable trial(s)"
    starts = [r.start_ms for r in rows if r.start_ms]
    day = _time.strftime("%Y-%m-%d %H:%M UTC", _time.gmtime(min(starts) / 1000)) if starts else "date unknown"
    return f"{hw} | {load} | {day} | error bars: 95% interval of the median"


def _footer(fig, lns: list[Line]) -> None:
    import textwrap

    width = int(fig.get_figwidth() * 21)  # characters of 6-pt text across the figure
    fig.text(0.01, 0.004, textwrap.fill(plot_footer(lns), width), fontsize=6, color="#555555", ha="left", va="bottom")


def plot_throughput_vs_context(ls: list[Line], ax_keys: list[str], path: Path) -> Optional[Path]:
    done = [ln for ln in ls if ln.row.finished and ln.row.context_len and ln.values["output_tok_s"]]
    if not done:
        return None
    plt = _plt()
    other = [k for k in ax_keys if not is_opt_axis(k) and k != CONTEXT]
    series: dict[str, list[Line]] = {}
    for ln in done:
        extra = " ".join(f"{k.split('.')[-1]}={ln.row.params.get(k)}" for k in other)
        series.setdefault((variant_label(ln, ax_keys) + (" " + extra if extra else "")).strip(), []).append(ln)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 5.4))
    for label, pts in sorted(series.items()):
        pts.sort(key=lambda ln: ln.row.context_len)
        xs = [ln.row.context_len for ln in pts]
        a1.errorbar(xs, [ln.values["output_tok_s"] for ln in pts], yerr=_yerr(pts, "output_tok_s"), marker="o",
                    capsize=3, label=label)
        eff = [100 * ln.values["roofline_efficiency"] if ln.values["roofline_efficiency"] else float("nan") for ln in pts]
        a2.plot(xs, eff, marker="o", label=label)
    for a, title, ylabel in ((a1, "throughput vs context length", "output tok/s (log)"),
                             (a2, "share of the roofline reached", "roofline efficiency %")):
        a.set_xscale("log", base=2)
        a.set_xlabel("context length (tokens)")
        a.set_ylabel(ylabel)
        a.set_title(title)
        a.grid(True, alpha=0.3)
    a1.set_yscale("log")
    a1.legend(fontsize=7, loc="best")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    _footer(fig, done)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# Perplexity is measured deterministically; kernels that only reorder float sums (eager vs sdpa attention,
# a KV cache or none) move it by ~1e-6 relative, while a real accuracy change (quantization, lower
# precision) moves it by 1e-3 or more. Differences below this relative spread are float noise.
ACCURACY_RTOL = 1e-4


def accuracy_tolerance(ys: list[float]) -> float:
    return ACCURACY_RTOL * max(abs(y) for y in ys) if ys else 0.0


def pareto_front(points: list[tuple[float, float]], tol: float = 0.0) -> list[int]:
    """Indices of the points not dominated (higher throughput x is better, lower loss y is better); a loss
    lower by no more than `tol` does not count as better."""
    idx = sorted(range(len(points)), key=lambda i: (-points[i][0], points[i][1]))
    front, best_y = [], float("inf")
    for i in idx:
        if points[i][1] < best_y - tol:
            front.append(i)
            best_y = points[i][1]
    return front


def _groups(ls: list[Line]) -> dict[str, list[Line]]:
    g: dict[str, list[Line]] = {}
    for ln in ls:
        g.setdefault(ln.workload, []).append(ln)
    return g


def pareto_figure(ls: list[Line], ax_keys: Optional[list[str]] = None):
    """The throughput-vs-perplexity figure, one panel per workload; None without finished points."""
    ax_keys = ax_keys or []
    groups = {k: [ln for ln in v if ln.row.finished and ln.values["ppl"] and ln.values["output_tok_s"]] for k, v in _groups(ls).items()}
    groups = {k: v for k, v in groups.items() if v}
    if not groups:
        return None
    plt = _plt()
    n = len(groups)
    rows = max(len(v) for v in groups.values())
    fig, axs = plt.subplots(1, n, figsize=(6 * n, 5 + 0.15 * rows), squeeze=False)
    for a, (wl, pts) in zip(axs[0], sorted(groups.items())):
        xy = [(ln.values["output_tok_s"], ln.values["ppl"]) for ln in pts]
        ys = [p[1] for p in xy]
        tol = accuracy_tolerance(ys)
        flat = max(ys) - min(ys) <= tol
        if flat:  # one accuracy: draw it as one line, not the float noise around it magnified
            level = sum(ys) / len(ys)
            xy = [(x, level) for x, _ in xy]
        front = pareto_front(xy, tol)
        fx = sorted((xy[i] for i in front), key=lambda p: p[0])
        a.plot([p[0] for p in fx], [p[1] for p in fx], "k--", lw=1, label="Pareto front", zorder=2)
        xerr = _yerr(pts, "output_tok_s")
        if xerr is not None:
            a.errorbar([p[0] for p in xy], [p[1] for p in xy], xerr=xerr, fmt="none", ecolor="#777777", capsize=2, zorder=2)
        for i, ln in enumerate(pts):  # numbered points, named in the legend (long labels would overlap)
            reg = ln.values.get("regime")
            a.scatter(*xy[i], s=70 if i in front else 35, color=REGIME_COLORS.get(reg, REGIME_COLORS[None]),
                      edgecolor="black" if i in front else "none", zorder=3,
                      label=f"{i + 1}: {variant_label(ln, ax_keys)} ({reg or '?'}-bound)" + (" *" if i in front else ""))
            a.annotate(str(i + 1), xy[i], fontsize=8, xytext=(4, 4 + 8 * (i % 2)), textcoords="offset points")
        a.set_xscale("log")
        from matplotlib.ticker import NullFormatter

        a.xaxis.set_minor_formatter(NullFormatter())  # minor labels of a short log axis overlap
        a.set_xlabel("output tok/s (log; right is faster)")
        if flat:
            a.set_ylim(level * 0.9, level * 1.1)
            a.set_yticks([level], [f"{level:.4g}"])
            a.set_ylabel("perplexity (all points equal)")
            a.text(0.5, 0.92, f"all points equal accuracy: ppl {level:.4g}\n(spread {max(ys) - min(ys):.1e}, "
                   f"within {ACCURACY_RTOL:.0e} relative)", transform=a.transAxes, ha="center", va="top", fontsize=8,
                   bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.8})
        else:
            a.set_ylabel("perplexity (lower is better)")
        a.set_title(f"throughput vs accuracy: {wl}", fontsize=9)
        a.grid(True, alpha=0.3)
        a.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=1, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    _footer(fig, [ln for v in groups.values() for ln in v])
    return fig


def plot_pareto(ls: list[Line], path: Path, ax_keys: Optional[list[str]] = None) -> Optional[Path]:
    fig = pareto_figure(ls, ax_keys)
    if fig is None:
        return None
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def plot_regime_chain(ls: list[Line], path: Path, ax_keys: Optional[list[str]] = None) -> Optional[Path]:
    groups = {k: sorted([ln for ln in v if ln.row.finished and ln.values["output_tok_s"]], key=lambda ln: adv.chain_order(ln.row))
              for k, v in _groups(ls).items()}
    groups = {k: v for k, v in groups.items() if v}
    if not groups:
        return None
    plt = _plt()
    from matplotlib.patches import Patch

    import textwrap

    n = len(groups)
    width = max(7, max(len(v) for v in groups.values()) * 1.6)
    fig, axs = plt.subplots(n, 1, figsize=(width, 4.6 * n), squeeze=False)
    for a, (wl, pts) in zip(axs[:, 0], sorted(groups.items())):
        xs = range(len(pts))
        ys = [ln.values["output_tok_s"] for ln in pts]
        colors = [REGIME_COLORS.get(ln.values.get("regime"), REGIME_COLORS[None]) for ln in pts]
        a.bar(xs, ys, color=colors, yerr=_yerr(pts, "output_tok_s"), capsize=3, ecolor="#333333")
        for x, ln in zip(xs, pts):
            p = ln.values.get("regime.prefill.measured") or "?"
            d = ln.values.get("regime.decode.measured") or "?"
            a.annotate(f"P:{p[:3]}\nD:{d[:3]}", (x, ln.values["output_tok_s"]), ha="center", va="bottom", fontsize=7,
                       xytext=(0, 6), textcoords="offset points")
        a.set_xticks(list(xs))
        # wrapped to the bar's width and set at an angle: long settings used to run into each other
        a.set_xticklabels([textwrap.fill(variant_label(ln, ax_keys or []), 22) + "\n" + textwrap.fill(adv.chain_label(ln.row), 22)
                           for ln in pts], fontsize=6, rotation=30, ha="right", rotation_mode="anchor")
        a.set_yscale("log")
        tops = [max(y, ln.row.num("output_tok_s_ci_hi") or y) for y, ln in zip(ys, pts)]
        a.set_ylim(top=max(tops) * 2.5)  # room for the error bars and the labels above the bars
        a.set_ylabel("output tok/s (log)")
        a.set_title(f"bottleneck along the optimization chain: {wl}", fontsize=9)
        a.grid(True, axis="y", alpha=0.3)
    axs[0, 0].legend(handles=[Patch(color=REGIME_COLORS["memory"], label="memory-bound"),
                              Patch(color=REGIME_COLORS["compute"], label="compute-bound")], fontsize=7)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    _footer(fig, [ln for v in groups.values() for ln in v])
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --- the report -----------------------------------------------------------------------------------------
@dataclass
class Report:
    selection: Selection
    lines: list[Line]
    advice: list[adv.Advice]
    claims: Optional[list[cl.ClaimRow]]
    out_dir: Path
    files: list[Path] = field(default_factory=list)
    logged_to: Optional[str] = None  # parent run id the artifacts went to

    @property
    def markdown_path(self) -> Path:
        return self.out_dir / "report.md"


def safe_name(ref: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", ref).strip("_") or "sweep"


def render_markdown(rep: Report, ax_keys: list[str], plots: list[Path], baseline_spec: Optional[str]) -> str:
    sel = rep.selection
    done = sel.finished
    hw = "; ".join(dict.fromkeys(r.hardware() for r in done)) or "-"
    how = f"`--baseline {baseline_spec}`" if baseline_spec else "the trial with the fewest optimizations of the seed's chain applied"
    out = [
        f"# Sweep report: {sel.experiment}",
        "",
        f"- sweep(s): {', '.join(sel.sweep_ids) or '-'}; {len(sel.rows)} trial(s), {len(done)} finished",
        f"- hardware: {hw}",
        f"- baseline: in each workload, {how}; speedup = output tok/s / baseline's; Δppl vs baseline",
        "- regime p/d: prefill/decode, measured (the roof each phase runs nearer to; see `engine/costmodel.py`)",
        "",
        "## Trials",
        "",
        markdown_table(rep.lines),
        "",
        *[f"- {n}" for n in table_notes(rep.lines)],
        "",
        "## Next optimization",
        "",
        adv.to_markdown(rep.advice, ax_keys) if rep.advice else "no finished trials",
    ]
    serving_pts = sv.points(rep.lines)
    if serving_pts:
        out += ["## Serving: throughput vs interactivity", "",
                "tok/s per user = 1000 / TPOT p50; * = on the Pareto frontier of its workload (no configuration has "
                "both more total tok/s and more tok/s per user); a capacity search's numbers are at its found rate.",
                "", sv.to_markdown(serving_pts), ""]
    if rep.claims is not None:
        out += ["## Seed claims", "", cl.to_markdown(rep.claims), ""]
    if plots:
        out += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    return "\n".join(out)


def build(
    ref: str,
    tracking: dict[str, Any],
    baseline: Optional[str] = None,
    out_dir: Optional[Path] = None,
    log_artifacts: bool = True,
    claims: Optional[bool] = None,
    progress: bool = True,
    all_trials: bool = False,
) -> Report:
    """Read `ref` from MLflow, write the report files, log them to the sweep's parent run."""
    from tqdm.auto import tqdm

    from ..config.compose import PROJECT_ROOT
    from .results import NotFound
    from ..tracking.store import missing_store, open_store, resolve_uri

    # everything that can refuse (the baseline's syntax, the store, the reference) before a bar is drawn
    spec = parse_baseline(baseline)
    uri = resolve_uri(tracking["uri"])
    db = missing_store(uri)
    if db is not None:
        raise NotFound(f"no tracking store at {db} (tracking.uri={tracking['uri']})")
    client = open_store(uri)
    sel = load(client, ref, all_trials=all_trials)
    steps = ["read runs", "table", "advice", "claims", "plots", "write", "log to MLflow"]
    bar = tqdm(total=len(steps), desc=f"report {ref}", unit="step", disable=not progress, leave=False)

    def done(name: str) -> None:
        bar.set_postfix_str(name)
        bar.update(1)

    done("read runs")
    ax_keys = axes(sel.finished) if len(sel.finished) > 1 else []
    baselines = choose_baselines(sel.rows, ax_keys, spec)
    groups: dict[tuple, list[TrialRow]] = {}
    for r in sel.rows:
        groups.setdefault(workload_key(r, ax_keys), []).append(r)
    label = workload_labeler(groups)
    ls = lines(sel.rows, ax_keys, baselines, label)
    ls.sort(key=lambda ln: (ln.workload, adv.chain_order(ln.row)))
    done("table")
    advices = [a for k, rows in sorted(groups.items())
               if (a := adv.advise(rows, ax_keys, label(k), sweep_rows=sel.rows))]
    done("advice")
    want_claims = claims if claims is not None else sel.experiment in (SEED_CLAIMS, SERVING_CAPACITY, QUANT_ACCURACY,
                                                                                  RIGHT_SIZE)
    claim_rows = cl.evaluate(sel.rows) if want_claims else None
    done("claims")
    out = Path(out_dir) if out_dir else PROJECT_ROOT / REPORTS_DIR / safe_name(ref)
    out.mkdir(parents=True, exist_ok=True)
    plots = [p for p in (
        plot_throughput_vs_context(ls, ax_keys, out / "throughput_vs_context.png"),
        plot_pareto(ls, out / "pareto.png", ax_keys),
        plot_regime_chain(ls, out / "regime_chain.png", ax_keys),
        sv.plot(sv.points(ls), out / "serving_pareto.png"),
    ) if p is not None]
    from .needle import needle_heatmaps

    plots += needle_heatmaps(sel.finished, out)  # eval.tasks needle tasks: context x depth
    done("plots")
    rep = Report(sel, ls, advices, claim_rows, out)
    (out / "trials.csv").write_text(csv_text(ls))
    files = [out / "trials.csv"]
    if claim_rows is not None:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["name", "claim", "measured here", "hardware", "holds?"])
        w.writerows([[c.name, c.claim, c.measured, c.hardware, c.holds] for c in claim_rows])
        (out / "claims.csv").write_text(buf.getvalue())
        files.append(out / "claims.csv")
    rep.markdown_path.write_text(render_markdown(rep, ax_keys, plots, baseline))
    rep.files = [rep.markdown_path, *files, *plots]
    done("write")
    if log_artifacts and sel.parent_run_id:
        for f in rep.files:
            client.log_artifact(sel.parent_run_id, str(f), ARTIFACT_DIR)
        rep.logged_to = sel.parent_run_id
    done("log to MLflow")
    bar.close()
    return rep
