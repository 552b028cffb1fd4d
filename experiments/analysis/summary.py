"""The table printed at the end of every sweep (one row per trial), as plain text or Markdown."""
from __future__ import annotations

from typing import Any, Sequence

from engine.measure.noise import UNSTABLE

KEY_METRICS = (
    ("output_tok_s", "out tok/s", "{:.1f}"),
    ("ttft_ms_p50", "ttft ms", "{:.1f}"),
    ("tpot_ms_p50", "tpot ms", "{:.1f}"),
    ("ppl", "ppl", "{:.3f}"),
    ("kv_cache_bytes", "kv MB", "{:.2f}"),
    ("peak_mem_bytes", "peak MB", "{:.0f}"),
)


def _fmt(key: str, fmt: str, metrics: dict[str, float]) -> str:
    if key not in metrics:
        return "-"
    v = metrics[key] / 1e6 if key.endswith("_bytes") else metrics[key]
    return fmt.format(v)


def _grid(rows: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """rows: {'hash', 'swept': {k: v}, 'metrics': {...}, 'status'} -> (header, body)."""
    axes: list[str] = []
    for r in rows:
        axes += [k for k in r["swept"] if k not in axes]
    header = ["hash"] + axes + [label for _, label, _ in KEY_METRICS] + ["status"]
    body = [
        [r["hash"]]
        + [str(r["swept"].get(a, "")) for a in axes]
        + [_fmt(k, f, r["metrics"]) for k, _, f in KEY_METRICS]
        + [r["status"]]
        for r in rows
    ]
    return header, body


def table(rows: Sequence[dict[str, Any]]) -> str:
    header, body = _grid(rows)
    widths = [max(len(x) for x in col) for col in zip(header, *body)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(b) for b in body] + notes(rows))


def notes(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Lines under a results table for what a worker noted about its trials: a dtype without arithmetic
    units on that hardware (each note once with the trials it concerns), and each trial whose timings are
    unstable, with the reason."""
    by_note: dict[str, list[str]] = {}
    unstable = []
    for r in rows:
        outcome = r.get("outcome")
        if outcome is None:
            continue
        note = outcome.info.get("dtype_note")
        if note:
            by_note.setdefault(note, []).append(r["hash"])
        if outcome.labels.get(UNSTABLE):
            unstable.append(f"unstable ({r['hash']}): {outcome.labels[UNSTABLE]}")
    return [f"note ({', '.join(h)}): {n}" for n, h in by_note.items()] + unstable


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    header, body = _grid(rows)
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(b) + " |" for b in body]
    return "\n".join(out)
