"""Where the MLflow UI opens: the runs table of a sweep experiment, with the metric columns that matter.

MLflow 3.x opens an experiment on its GenAI pages (Overview, Traces, runs called "Evaluations") unless
told otherwise. Two things tell it otherwise, and both are plain MLflow data, no patched UI:

- the experiment tag `mlflow.experimentKind=custom_model_development` (what MLflow 3.x up to ~3.5 reads
  to pick the classic runs view), and the URL parameter `workflowType=machine_learning` (what later 3.x
  UIs read instead: their "GenAI | Model training" switch, stored per browser, defaults to GenAI);
- a saved view: the experiment tag `mlflow.sharedViewState.<key>` holds the runs table's state (columns,
  filter, sort) as the UI's own "Saved views" menu writes it, and `?viewStateShareKey=<key>` opens it.
  The UI's column choice otherwise lives only in the browser's local storage.

MLflow 3.17 reads the mode from the URL or the browser only (the tag is ignored there) and opens its Assistant
panel on local hosts; `infersweep ui`'s front (ui_front.py) gives a new browser MLflow's own defaults for both.
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
# (display name, source metric, scale); memory in whole MB (1e6 bytes, as the report prints it). No "/" in a name:
# MLflow reads it as a group separator (a chart "s" in a section "tok").
THROUGHPUT = "tok per s"
DISPLAY_METRICS = (
    (THROUGHPUT, "output_tok_s", 1.0),
    ("TPOT ms", "tpot_ms_p50", 1.0),
    ("TTFT ms", "ttft_ms_p50", 1.0),
    ("PPL", "ppl", 1.0),
    ("KL", "kl_div_mean", 1.0),
    ("mem MB", "peak_mem_bytes", 1e-6),
)
# a variant measured in an interleaved group logs its own footprint (weights + what its own calls allocated) as
# peak_mem_bytes, a trial alone its process's peak: not one quantity, so not one column
OWN_MEM = "own MB"
WHOLE = {"mem MB", OWN_MEM}
TASK_DISPLAY = "acc "  # + <task>: task_score.<task>, rounded
UNSTABLE_FLAG = UNSTABLE  # a 0/1 metric beside the tag of that name (the tag's reason is too long to scan)

# in this order, left to right (the flag qualifies the timings before it; a sweep's task accuracy comes before
# its perplexity); a metric no run logged (KL without a reference, the gate without eval.tasks) shows no column.
# task_gate (eval.tasks: every task within eval.gate of the fp32 reference; already 0/1) is followed by the
# sweep's `acc <task>` columns (the names depend on the sweep's tasks: `columns(tasks)`)
METRIC_COLUMNS = (THROUGHPUT, "TPOT ms", "TTFT ms", UNSTABLE_FLAG, "task_gate", "PPL", "KL", "mem MB", OWN_MEM)
GATE = "task_gate"
SORT_METRIC = THROUGHPUT  # fastest first
# px, per column: its short name (the widest text: 12 px padding either side) and a 4-digit value fit, so that
# the columns of a sweep without eval.tasks are all on the first screen of a 1440 px window even while MLflow's
# Assistant panel (which MLflow opens once per browser on a local server) takes a quarter of it. (The run-name
# and date columns are pinned: the UI ignores a view's widths for them.)
WIDTHS = {THROUGHPUT: 80, "TPOT ms": 70, "TTFT ms": 70, UNSTABLE_FLAG: 72, "PPL": 60, "KL": 60, GATE: 84, "mem MB": 70,
          OWN_MEM: 70}
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
    if "group_peak_mem_bytes" in metrics and "mem MB" in out:
        out[OWN_MEM] = out.pop("mem MB")
    out.update({TASK_DISPLAY + k[len("task_score."):]: readable(v) for k, v in metrics.items()
                if k.startswith("task_score.") and k.count(".") == 1})
    out[UNSTABLE_FLAG] = 1.0 if labels.get(UNSTABLE) else 0.0
    return out


def ordered_display(shown: dict[str, float]) -> list[tuple[str, float]]:
    """The display copies in the runs table's column order (the task scores after the gate), then any other."""
    order = {name: i for i, name in enumerate(METRIC_COLUMNS)}
    gate = order[GATE]
    return sorted(shown.items(), key=lambda kv: (order.get(kv[0], gate + 0.5 if kv[0].startswith(TASK_DISPLAY) else 99),
                                                 kv[0]))


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


def run_url(base_url: str, experiment_id: str, run_id: str) -> str:
    """A run's own page (its artifacts: an optimize run's chain table, deploy command and plot)."""
    return f"{base_url.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def latest_optimize_run(client, experiment_id: str):
    """The experiment's most recent `optimize` run, or None (the saved view lists trial runs only)."""
    runs = client.search_runs([experiment_id], filter_string="tags.kind = 'optimize'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0] if runs else None


def latest_experiment(client):
    """The experiment of the most recently started sweep or `optimize` run; else the newest experiment with any
    run; None for a store without runs."""
    from mlflow.entities import ViewType

    exps = list(client.search_experiments(view_type=ViewType.ACTIVE_ONLY))
    if not exps:
        return None
    ids = [e.experiment_id for e in exps]
    for kinds in (("sweep", "optimize"), ("",)):
        runs = [r for kind in kinds for r in client.search_runs(
            ids, filter_string=f"tags.kind = '{kind}'" if kind else "", order_by=["attributes.start_time DESC"],
            max_results=1)]
        if runs:
            latest = max(runs, key=lambda r: r.info.start_time or 0)
            return next(e for e in exps if e.experiment_id == latest.info.experiment_id)
    return None


# --- run names: what tells the rows apart, short ------------------------------------------------------------
# A trial run is named by the sweep's varying axes only, each as short as it reads unambiguously in the table's
# run-name column (`kv=on sdpa ctx=512 bf16`; the UI keeps that column ~23 characters wide whatever a view says):
# the values of the well-known axes alone where the value says which axis it is (attention kernel, dtype,
# quantization level, engine), a short key for the common workload and optimization keys (`kv=`, `ctx=`, `bs=`,
# `spec=`), the full `key=value` otherwise.
SHORT_KEYS = {"kv_cache": "kv", "kv_cache.mode": "kv", "workload.context_len": "ctx", "workload.batch_size": "bs",
              "workload.max_new_tokens": "new", "speculative": "spec", "speculative.method": "spec",
              "batching": "batch", "batching.mode": "batch", "cluster.interleave": "rounds"}
VALUE_ONLY = ("attention", "attention.impl", "model.dtype", "quant", "quant.level", "engine", "engine.backend",
              "engine_variant", "model", "server")
SHORT_VALUES = {"contiguous": "contig", "bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}


def short_name(swept: dict[str, str]) -> str:
    """`{'kv_cache': 'contiguous', 'attention': 'sdpa', 'workload.context_len': '512', 'model.dtype': 'bfloat16'}`
    -> `kv=on sdpa ctx=512 bf16` (the contiguous cache is "on": paged is `kv=paged`); "" for a trial that varies
    nothing."""
    out = []
    for k, v in swept.items():
        v = "on" if k in ("kv_cache", "kv_cache.mode") and v == "contiguous" else SHORT_VALUES.get(str(v), str(v))
        if k in VALUE_ONLY:
            out.append(v)
        else:
            out.append(f"{SHORT_KEYS.get(k, k)}={v}")
    return " ".join(out)


# --- an `optimize` run as the report reads it ---------------------------------------------------------------
NOTE_TAG = "mlflow.note.content"  # MLflow's run description (the run page's "Description", markdown)
STEP_TAG, CANDIDATE_TAG, DECISION_TAG, ROLE_TAG = "optimize.step", "optimize.candidate", "optimize.decision", "optimize.role"


def _as_dict(row: Any) -> dict[str, Any]:
    return row if isinstance(row, dict) else row.as_dict()


def _candidate(text: str) -> str:
    """`quant=int8-weight` -> `int8-weight` (one axis: its value says it); several axes stay as they are."""
    key, eq, value = text.partition("=")
    return value if eq and " " not in text and "," not in text else text


def optimize_trial_names(rows: Sequence[Any]) -> list[tuple[tuple[str, ...], list[tuple[str, str]], dict[str, str]]]:
    """For each measured row of a chain table: (its config hashes in request order, (name, role) of each member's
    runs in that order, the tags). A step's pair is (incumbent, candidate), the total's (baseline, final); the
    baseline row has one member."""
    out = []
    for r in map(_as_dict, rows):
        hashes = tuple(h for h in r.get("hashes") or () if h)
        if not hashes:
            continue
        step, label, cand = r["step"], r["label"], _candidate(str(r["candidate"]))
        tags = {STEP_TAG: str(step), CANDIDATE_TAG: str(r["candidate"])[:250], DECISION_TAG: str(r["decision"])}
        if len(hashes) == 1:
            members = [(f"{step} {label}: {cand}", "baseline" if label == "baseline" else "candidate")]
        elif label == "total":
            members = [(f"{step} total: baseline vs final", "baseline"), (f"{step} total: final ({cand})", "final")]
        else:
            members = [(f"{step} {label}: incumbent vs {cand}", "incumbent"), (f"{step} {label}: {cand}", "candidate")]
        out.append((hashes, members, tags))
    return out


def label_optimize_trials(client, optimize_run_id: str, rows: Sequence[Any]) -> int:
    """Name the trial runs of an `optimize` run by chain step and candidate (`3 quantization: int8-weight`; the
    incumbent it was paired with: `3 quantization: incumbent vs int8-weight`) and tag them with step, candidate,
    decision and role. A pair's runs are found by their interleave group (the hashes of its members, in order;
    every attempt of the pair), the baseline's by its hash. Returns how many runs were labelled."""
    from ..run.trial import group_id

    run = client.get_run(optimize_run_id)
    children = client.search_runs([run.info.experiment_id], f"tags.`mlflow.parentRunId` = '{optimize_run_id}'",
                                  max_results=1000)
    named = list(optimize_trial_names(rows))

    def runs_of(hashes) -> list:  # a pair's runs by its interleave group, a lone trial's by its hash
        group = group_id(list(hashes)) if len(hashes) > 1 else None
        return [c for c in children if c.data.tags.get("config_hash") in hashes
                and c.data.tags.get("env.interleave_group") == group]

    # the chain's total pair (final vs baseline) is measured last and may share its group with the one step
    # between them: it owns the newest run of each hash there, the step every earlier one
    total_runs: set[str] = set()
    for hashes, _, tags in named:
        if tags.get(DECISION_TAG) == "total":
            newest = {}
            for c in sorted(runs_of(hashes), key=lambda c: c.info.start_time):
                newest[c.data.tags["config_hash"]] = c.info.run_id
            total_runs.update(newest.values())
    n = 0
    for hashes, members, tags in named:
        is_total = tags.get(DECISION_TAG) == "total"
        for c in runs_of(hashes):
            if (c.info.run_id in total_runs) != is_total:
                continue
            name, role = members[hashes.index(c.data.tags["config_hash"])]
            client.update_run(c.info.run_id, name=name[:250])
            for k, v in {**tags, ROLE_TAG: role}.items():
                client.set_tag(c.info.run_id, k, v)
            n += 1
    return n


def optimize_description(res: Any) -> str:
    """The optimize run's description (markdown, on its overview page): the final configuration and its hash
    with the command that re-runs it, why it stopped, then the chain table (or the search's summary) and the
    notes."""
    final = getattr(res, "final", None) or {}
    h = getattr(res, "final_hash", "") or ""
    lines = [f"**optimize ({res.strategy})** -- final: `{' '.join(f'{k}={v}' for k, v in final.items()) or '(none)'}`",
             "",
             (f"final config_hash **`{h[:12]}`** (`{h}`): `infersweep reproduce {h[:12]}`" if h else "no final configuration"),
             "",
             f"stopped: {res.stop}; {res.trials} trial(s) run, {res.reused} reused from the store", ""]
    if res.strategy == "chain":
        lines += [res.table, ""]
    else:
        lines += ["```", *getattr(res, "summary", ()), "```", ""]
    lines += [f"- {n}" for n in getattr(res, "notes", ())]
    return "\n".join(lines).rstrip() + "\n"


def show_optimize(client, run_id: str, res: Any) -> None:
    """What the dashboard shows of a finished `optimize` run: its description, and its trial runs named and
    tagged by chain step (chain strategy)."""
    client.set_tag(run_id, NOTE_TAG, optimize_description(res))
    if res.strategy == "chain":
        label_optimize_trials(client, run_id, res.rows)
