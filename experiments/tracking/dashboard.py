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
import time
from typing import Any, Optional
from urllib.parse import urlencode

from engine.measure.noise import UNSTABLE

KIND_TAG = "mlflow.experimentKind"
KIND = "custom_model_development"
VIEW_TAG_PREFIX = "mlflow.sharedViewState."
VIEW_KEY = "infersweep"

# in this order, left to right; a metric no run logged (kl_div_mean without a reference) shows no column
METRIC_COLUMNS = ("output_tok_s", "ttft_ms_p50", "tpot_ms_p50", "ppl", "kl_div_mean", "peak_mem_bytes")


def column_id(metric: str) -> str:
    """The UI's key of a metric column (also the grid's col-id)."""
    return f"metrics.`{metric}`"


# tag columns after them: why a trial's timings cannot be trusted (engine/measure/metrics.py UNSTABLE; the
# UI shows the column once any run has the tag)
TAG_COLUMNS = (UNSTABLE,)


def tag_column_id(tag: str) -> str:
    return f"tags.`{tag}`"


def view_state() -> dict[str, Any]:
    """The runs table as it opens: trial runs only (a sweep's parent run has no metrics), fastest first."""
    cols = [column_id(m) for m in METRIC_COLUMNS] + [tag_column_id(t) for t in TAG_COLUMNS]
    return {
        "searchFilter": "tags.kind = 'trial'",
        "orderByKey": column_id("output_tok_s"),
        "orderByAsc": False,
        "selectedColumns": cols,
        "columnOrder": cols,
    }


def view_tag(now_ms: Optional[int] = None) -> tuple[str, str]:
    """(key, value) of the saved-view tag, in the UI's envelope: the state is a JSON string inside JSON."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    envelope = {"name": VIEW_KEY, "createdAt": now, "updatedAt": now, "state": json.dumps(view_state())}
    return VIEW_TAG_PREFIX + VIEW_KEY, json.dumps(envelope)


def experiment_tags() -> dict[str, str]:
    key, value = view_tag()
    return {KIND_TAG: KIND, key: value}


def tag_experiment(client, experiment) -> None:
    """Add the tags an experiment lacks. An existing saved view is kept: a user may have edited it in
    the UI ("Overwrite view")."""
    have = experiment.tags or {}
    for key, value in experiment_tags().items():
        if key not in have or (key == KIND_TAG and have[key] != KIND):
            client.set_experiment_tag(experiment.experiment_id, key, value)


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
