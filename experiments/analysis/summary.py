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


def task_names(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The eval.tasks any row measured (metric keys `task_score.<task>`; needle depths `.d<pct>` excluded)."""
    names: list[str] = []
    for r in rows:
        for k in r["metrics"]:
            t = k[len("task_score."):]
            if k.startswith("task_score.") and "." not in t and t not in names:
                names.append(t)
    return names


def _task_cell(task: str, m: dict[str, float]) -> str:
    """`score±stderr Δdelta` of one task (Δ against the fp32 reference), "-" where not measured."""
    if f"task_score.{task}" not in m:
        return "-"
    cell = f"{m[f'task_score.{task}']:.3f}±{m.get(f'task_score_stderr.{task}', float('nan')):.3f}"
    if f"task_delta.{task}" in m:
        cell += f" Δ{m[f'task_delta.{task}']:+.3f}"
    return cell


def _gate_cell(m: dict[str, float]) -> str:
    if "task_gate" not in m:
        return "-"
    worst = min((v for k, v in m.items() if k.startswith("task_recovery.")), default=float("nan"))
    return ("pass" if m["task_gate"] == 1.0 else "FAIL") + f" ({worst:.1%})"


def _grid(rows: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """rows: {'hash', 'swept': {k: v}, 'metrics': {...}, 'status'} -> (header, body). Task accuracy columns
    (one per task, and the accuracy gate with the worst recovery) appear when a row measured tasks."""
    axes: list[str] = []
    for r in rows:
        axes += [k for k in r["swept"] if k not in axes]
    tasks = task_names(rows)
    header = (["hash"] + axes + [label for _, label, _ in KEY_METRICS] + [t.removeprefix("bigbench_") for t in tasks]
              + (["acc gate"] if tasks else []) + ["status"])
    body = [
        [r["hash"]]
        + [str(r["swept"].get(a, "")) for a in axes]
        + [_fmt(k, f, r["metrics"]) for k, _, f in KEY_METRICS]
        + [_task_cell(t, r["metrics"]) for t in tasks]
        + ([_gate_cell(r["metrics"])] if tasks else [])
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
    grouped = [r["hash"] for r in rows if r.get("outcome") is not None and "group_peak_mem_bytes" in r["metrics"]]
    group = ([f"peak MB ({', '.join(grouped)}): each interleaved variant's own footprint (weights + KV cache + "
              "scratch of its own calls); the group's process peak is group_peak_mem_bytes"] if grouped else [])
    return [f"note ({', '.join(h)}): {n}" for n, h in by_note.items()] + unstable + group


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    header, body = _grid(rows)
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(b) + " |" for b in body]
    return "\n".join(out)
