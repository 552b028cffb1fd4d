"""Needle-in-a-haystack heatmaps for the sweep report: context length x depth, the score in each cell, one
panel per configuration (e.g. quantization level), one figure per needle task (docs/accuracy.md)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..tracking.curves import DEPTH_KEY, needle_artifact
from .results import TrialRow

VARIANT_PARAMS = ("engine.backend", "quant.level", "kv_cache.dtype", "model.dtype", "attention.impl", "kv_cache.mode")


def needle_cells(rows: list[TrialRow]) -> dict[str, dict[str, dict[tuple[int, int], float]]]:
    """task -> variant label -> {(context_len, depth %): score} over the finished trials."""
    variants = {p: {r.params.get(p) for r in rows} for p in VARIANT_PARAMS}
    varying = [p for p in VARIANT_PARAMS if len(variants[p]) > 1]
    out: dict[str, dict[str, dict[tuple[int, int], float]]] = {}
    for r in rows:
        if not r.finished:
            continue
        ctx = int(float(r.params.get("workload.context_len", 0)))
        label = ", ".join(f"{p.split('.')[-1]}={r.params.get(p)}" for p in varying) or "all trials"
        for k, v in r.metrics.items():
            m = DEPTH_KEY.match(k)
            if m:
                out.setdefault(m["task"], {}).setdefault(label, {})[(ctx, int(m["depth"]))] = float(v)
    return out


def needle_heatmaps(rows: list[TrialRow], out: Path) -> list[Path]:
    """One PNG per needle task (`needle_<task>.png`); none where the sweep measured no needle task."""
    paths = []
    for task, by_variant in sorted(needle_cells(rows).items()):
        p = _heatmap(task, by_variant, out / needle_artifact(task))
        if p is not None:
            paths.append(p)
    return paths


def _heatmap(task: str, by_variant: dict[str, dict[tuple[int, int], float]], path: Path) -> Optional[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(by_variant)
    fig, axs = plt.subplots(1, n, figsize=(3.2 * n + 1, 3.6), squeeze=False)
    for a, (label, cells) in zip(axs[0], sorted(by_variant.items())):
        ctxs = sorted({c for c, _ in cells})
        depths = sorted({d for _, d in cells})
        grid = [[cells.get((c, d), float("nan")) for d in depths] for c in ctxs]
        im = a.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
        a.set_xticks(range(len(depths)), [f"{d}%" for d in depths])
        a.set_yticks(range(len(ctxs)), [str(c) for c in ctxs])
        a.set_xlabel("needle depth")
        a.set_ylabel("context tokens")
        a.set_title(label, fontsize=9)
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if v == v:
                    a.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=axs[0].tolist(), shrink=0.8, label="exact match")
    fig.suptitle(f"{task}: score by context length and depth")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
