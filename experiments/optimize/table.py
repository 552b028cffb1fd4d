"""The chain table (markdown, also the terminal's), the notes on where this machine's order differs from the
seed's, and the plot of the path taken."""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from .types import ACCEPTED, BASELINE, REFUSED, REJECTED, RETRY, SKIPPED, TOTAL, UNDECIDED_PAIR, Row

COLUMNS = ("step", "candidate", "decision", "reason", "ratio [interval]", "accuracy (paired: vs incumbent / vs baseline)",
           "regime before -> after", "trials")


def _esc(s: str) -> str:
    """A markdown cell: a `|` in it would end the cell and shift every column after it."""
    return str(s).replace("|", "\\|").replace("\n", " ")


def to_markdown(rows: Sequence[Row]) -> str:
    lines = ["| " + " | ".join(_esc(c) for c in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        regime = (f"{r.regime_before or '?'} -> {r.regime_after or '?'}" if r.decision not in (SKIPPED, BASELINE, TOTAL)
                  else (r.regime_before or ""))
        hashes = ", ".join(h[:8] for h in r.hashes if h)
        cells = (f"{r.step} {r.label}", r.candidate, r.decision, r.reason, r.ratio_cell, r.accuracy, regime,
                 f"{hashes}" + (f" (x{r.attempts})" if r.attempts > 1 else ""))
        lines.append("| " + " | ".join(_esc(c) for c in cells) + " |")
    return "\n".join(lines)


def order_notes(rows: Sequence[Row]) -> list[str]:
    """Where this machine's measured chain differs from the seed's (each step paying off after the one before)."""
    out = []
    steps: dict[str, list[Row]] = {}  # a step's rows and its retry's (the chain's end) together
    for r in rows:
        if r.step and r.decision != TOTAL:
            steps.setdefault(r.label.removesuffix(RETRY), []).append(r)
    for rs in steps.values():
        if any(r.decision == ACCEPTED for r in rs):
            continue
        why = "; ".join(f"{r.candidate}: {r.reason}" for r in rs)
        if all(r.decision == UNDECIDED_PAIR for r in rs):
            out.append(f"the seed's step '{rs[0].label}' could not be decided here ({why})")
        elif all(r.reason.startswith(REFUSED) for r in rs):
            out.append(f"the step '{rs[0].label}' could not run on this chain's incumbent ({why})")
        else:
            out.append(f"the seed's step '{rs[0].label}' did not pay off here ({why})")
    return out


def plot_path(rows: Sequence[Row], out: Path, title: str = "") -> Optional[Path]:
    """Each measured candidate's ratio to its incumbent with its 95% interval, coloured by the decision; the
    accepted ones form the path."""
    import math

    pts = [(f"{r.step}: {r.candidate}", *r.ratio, r.decision) for r in rows
           if r.ratio is not None and all(math.isfinite(x) for x in r.ratio)]
    if not pts:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {ACCEPTED: "tab:green", REJECTED: "tab:red", TOTAL: "tab:blue"}
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(pts) + 1.5))
    for y, (label, v, lo, hi, decision) in enumerate(reversed(pts)):
        ax.errorbar(v, y, xerr=[[v - lo], [hi - v]], fmt="o", color=colors.get(decision, "tab:gray"), capsize=3)
    ax.set_yticks(range(len(pts)), [p[0] for p in reversed(pts)], fontsize=8)
    ax.axvline(1.0, color="black", lw=0.8)
    from ..tracking.curves import fit_title, wrapped

    ax.set_xlabel(wrapped(ax, "candidate vs incumbent (x, > 1 better; green accepted, red rejected, grey undecided, blue total)"))
    fit_title(ax, title or "optimize: the path taken", fontsize=10)  # wrapped: a long final configuration fits
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
