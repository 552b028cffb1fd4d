"""Where the MLflow UI opens: the runs table of a sweep experiment, with the metric columns that matter.

MLflow 3.x opens an experiment on its GenAI pages (Overview, Traces, runs called "Evaluations") unless
told otherwise. Two things tell it otherwise, and both are plain MLflow data, no patched UI:

- the experiment tag `mlflow.experimentKind=custom_model_development` (what MLflow 3.x up to ~3.5 reads
  to pick the classic runs view), and the URL parameter `workflowType=machine_learning` (what later 3.x
  UIs read instead: their "GenAI | Model training" switch, stored per browser, defaults to GenAI);
- a saved view: the experiment tag `mlflow.sharedViewState.<key>` holds the runs table's state (columns,
  filter, sort) as the UI's own "Saved views" menu writes it, and `?viewStateShareKey=<key>` opens it.
  The UI's column choice otherwise lives only in the browser's local storage.
"""
from __future__ import annotations

import json
import math
import time
from typing import Any, Optional, Sequence
from urllib.parse import urlencode

from engine.measure.noise import UNSTABLE

KIND_TAG = "mlflow.experimentKind"
KIND = "custom_model_development"
VIEW_TAG_PREFIX = "mlflow.sharedViewState."
VIEW_KEY = "infersweep"

# What the runs table shows: display copies of the metrics a reader scans, rounded to 4 significant digits
# and in readable units, under short names that fit a narrow column (MLflow prints a metric's value in full,
# `130.681909...`, cut off by the column). The full-precision metrics keep their names for analysis
# (docs/metrics.md); these exist only for the table, and report/analysis never read them.
# (display name, source metric, scale); memory in whole MB (1e6 bytes, as the report prints it)
DISPLAY_METRICS = (
    ("tok/s", "output_tok_s", 1.0),
    ("TPOT ms", "tpot_ms_p50", 1.0),
    ("TTFT ms", "ttft_ms_p50", 1.0),
    ("PPL", "ppl", 1.0),
    ("KL", "kl_div_mean", 1.0),
    ("mem MB", "peak_mem_bytes", 1e-6),
)
WHOLE = {"mem MB"}
TASK_DISPLAY = "acc "  # + <task>: task_score.<task>, rounded
UNSTABLE_FLAG = UNSTABLE  # a 0/1 metric beside the tag of that name (the tag's reason is too long to scan)

# in this order, left to right (the flag qualifies the timings before it; a sweep's task accuracy comes before
# its perplexity); a metric no run logged (KL without a reference, the gate without eval.tasks) shows no column.
# task_gate (eval.tasks: every task within eval.gate of the fp32 reference; already 0/1) is followed by the
# sweep's `acc <task>` columns (the names depend on the sweep's tasks: `columns(tasks)`)
METRIC_COLUMNS = ("tok/s", "TPOT ms", "TTFT ms", UNSTABLE_FLAG, "task_gate", "PPL", "KL", "mem MB")
GATE = "task_gate"
SORT_METRIC = "tok/s"  # fastest first
# px, per column: its short name (the widest text: 12 px padding either side) and a 4-digit value fit, so that
# the columns of a sweep without eval.tasks are all on the first screen of a 1440 px window even while MLflow's
# Assistant panel (which MLflow opens once per browser on a local server) takes a quarter of it. (The run-name
# and date columns are pinned: the UI ignores a view's widths for them.)
WIDTHS = {"tok/s": 60, "TPOT ms": 70, "TTFT ms": 70, UNSTABLE_FLAG: 72, "PPL": 60, "KL": 60, GATE: 84, "mem MB": 70}
METRIC_WIDTH, REASON_WIDTH = 72, 240  # an `acc <task>` column; the unstable tag's reason


def readable(value: float) -> float:
    """`value` to 4 significant digits, integer digits kept (1039.90138 -> 1040, 0.908339 -> 0.9083)."""
    if not math.isfinite(value) or value == 0:
        return value
    return round(value, max(0, 3 - math.floor(math.log10(abs(value)))))


def display_metrics(metrics: dict[str, float], labels: dict[str, str]) -> dict[str, float]:
    """The display copies of a trial's `metrics` (those it has), and the 0/1 unstable flag from its `labels`."""
    out = {name: float(round(metrics[src] * scale)) if name in WHOLE else readable(metrics[src] * scale)
           for name, src, scale in DISPLAY_METRICS if src in metrics}
    out.update({TASK_DISPLAY + k[len("task_score."):]: readable(v) for k, v in metrics.items()
                if k.startswith("task_score.") and k.count(".") == 1})
    out[UNSTABLE_FLAG] = 1.0 if labels.get(UNSTABLE) else 0.0
    return out


def column_id(metric: str) -> str:
    """The UI's key of a metric column (also the grid's col-id)."""
    return f"metrics.`{metric}`"


# tag columns after them: why a trial's timings cannot be trusted (engine/measure/noise.py UNSTABLE; the
# UI shows the column once any run has the tag)
TAG_COLUMNS = (UNSTABLE,)


def tag_column_id(tag: str) -> str:
    return f"tags.`{tag}`"


def columns(tasks: Sequence[str] = ()) -> list[str]:
    """The view's columns, left to right, for a sweep that evaluates `tasks` (eval.tasks)."""
    out = []
    for m in METRIC_COLUMNS:
        out.append(column_id(m))
        if m == GATE:
            out += [column_id(TASK_DISPLAY + t) for t in tasks]
    return out + [tag_column_id(t) for t in TAG_COLUMNS]


def widths(cols: Sequence[str]) -> dict[str, int]:
    named = {column_id(m): w for m, w in WIDTHS.items()}
    return {c: REASON_WIDTH if c.startswith("tags.") else named.get(c, METRIC_WIDTH) for c in cols}


def view_state(tasks: Sequence[str] = ()) -> dict[str, Any]:
    """The runs table as it opens: trial runs only (a sweep's parent run has no metrics), fastest first."""
    cols = columns(tasks)
    return {
        "searchFilter": "tags.kind = 'trial'",
        "orderByKey": column_id(SORT_METRIC),
        "orderByAsc": False,
        "selectedColumns": cols,
        "columnOrder": cols,
        "columnWidths": widths(cols),
    }


def view_tag(now_ms: Optional[int] = None, tasks: Sequence[str] = ()) -> tuple[str, str]:
    """(key, value) of the saved-view tag, in the UI's envelope: the state is a JSON string inside JSON."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    envelope = {"name": VIEW_KEY, "createdAt": now, "updatedAt": now, "state": json.dumps(view_state(tasks))}
    return VIEW_TAG_PREFIX + VIEW_KEY, json.dumps(envelope)


def experiment_tags(tasks: Sequence[str] = ()) -> dict[str, str]:
    key, value = view_tag(tasks=tasks)
    return {KIND_TAG: KIND, key: value}


def with_task_columns(value: str, tasks: Sequence[str], now_ms: Optional[int] = None) -> Optional[str]:
    """The saved view `value` (the tag's JSON) with the gate and `acc <task>` columns of `tasks` added
    in their place, or None: nothing is missing, or the view is not one infersweep wrote (a column of the
    user's own, or columns reordered in the UI: then it is the user's and stays as it is)."""
    try:
        envelope = json.loads(value)
        state = json.loads(envelope["state"])
        have = list(state["selectedColumns"])
    except (ValueError, KeyError, TypeError):
        return None
    need = [column_id(GATE)] + [column_id(TASK_DISPLAY + t) for t in tasks]
    if not tasks or all(c in have for c in need):
        return None
    prefix = column_id(TASK_DISPLAY)[:-1]  # metrics.`acc <task>`
    known = [c[len(prefix):-1] for c in have if c.startswith(prefix)]
    order = columns(sorted(set(known) | set(tasks)))
    if have != [c for c in order if c in have] or state.get("columnOrder", have) != have:
        return None
    cols = [c for c in order if c in have or c in need]
    now = int(time.time() * 1000) if now_ms is None else now_ms
    grown = dict(state, selectedColumns=cols, columnOrder=cols, columnWidths={**widths(cols), **state.get("columnWidths", {})})
    return json.dumps(dict(envelope, updatedAt=now, state=json.dumps(grown)))


def tag_experiment(client, experiment, tasks: Sequence[str] = ()) -> None:
    """Add the tags an experiment lacks. An existing saved view is kept (a user may have edited it in the UI,
    "Overwrite view"), except that one infersweep wrote gains the gate and task-score columns of `tasks`."""
    have = experiment.tags or {}
    for key, value in experiment_tags(tasks).items():
        if key not in have or (key == KIND_TAG and have[key] != KIND):
            client.set_experiment_tag(experiment.experiment_id, key, value)
        elif key.startswith(VIEW_TAG_PREFIX) and (grown := with_task_columns(have[key], tasks)) is not None:
            client.set_experiment_tag(experiment.experiment_id, key, grown)


def logged_tasks(client, experiment) -> list[str]:
    """The eval.tasks the experiment's trial runs logged (`task_score.<task>`; needle depths aside), for
    experiments recorded before their view had task columns."""
    runs = client.search_runs([experiment.experiment_id], filter_string="tags.kind = 'trial'", max_results=500)
    return sorted({k.split(".")[1] for r in runs for k in r.data.metrics if k.startswith("task_score.") and k.count(".") == 1})


def runs_url(base_url: str, experiment_id: str) -> str:
    query = urlencode({"workflowType": "machine_learning", "viewStateShareKey": VIEW_KEY})
    return f"{base_url.rstrip('/')}/#/experiments/{experiment_id}/runs?{query}"


def latest_experiment(client):
    """The experiment of the most recently started sweep; else the newest experiment with any run;
    None for a store without runs."""
    from mlflow.entities import ViewType

    exps = list(client.search_experiments(view_type=ViewType.ACTIVE_ONLY))
    if not exps:
        return None
    ids = [e.experiment_id for e in exps]
    for flt in ("tags.kind = 'sweep'", ""):
        runs = client.search_runs(ids, filter_string=flt, order_by=["attributes.start_time DESC"], max_results=1)
        if runs:
            return next(e for e in exps if e.experiment_id == runs[0].info.experiment_id)
    return None
