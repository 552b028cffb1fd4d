"""Tables of the latest `experiment=quant-accuracy` sweep from MLflow, for BENCHMARKS.md: per quantization level
(engine variant) the multiple-choice tasks' accuracy +- stderr and the paired delta against the fp32
reference, and the needle tasks' exact match by context length (and by depth).

    infersweep sweep experiment=quant-accuracy && python benchmarks/accuracy_table.py
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

from mlflow.tracking import MlflowClient  # noqa: E402

from experiments.tracking.store import resolve_uri  # noqa: E402

MC = ("arc_easy", "sciq", "piqa")  # conf/accuracy_point/mc.yaml
NEEDLE = ("niah_single", "niah_multikey")


def _variant(p: dict) -> str:
    return f"{p.get('engine.backend')} {p.get('quant.level')}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tracking-uri", default="sqlite:///mlflow/mlflow.db")
    ap.add_argument("--experiment", default="quant-accuracy")
    a = ap.parse_args()
    client = MlflowClient(tracking_uri=resolve_uri(a.tracking_uri))
    exp = client.get_experiment_by_name(a.experiment)
    runs = [r for r in client.search_runs([exp.experiment_id], "tags.kind != 'sweep'", max_results=5000)
            if r.info.status == "FINISHED"]
    latest: dict[tuple, object] = {}  # the newest finished run of each configuration
    for r in sorted(runs, key=lambda r: r.info.start_time):
        latest[(_variant(r.data.params), r.data.params.get("workload.context_len"), r.data.params.get("eval.tasks"))] = r
    runs = list(latest.values())
    order = []
    for r in sorted(runs, key=lambda r: r.info.start_time):
        if _variant(r.data.params) not in order:
            order.append(_variant(r.data.params))

    print("Multiple choice (eval.limit examples each; accuracy +- stderr; delta vs fp32 +- paired stderr; gate = "
          ">= 99% of the reference):\n")
    print("| level | " + " | ".join(MC) + " | gate |")
    print("|---|" + "---|" * (len(MC) + 1))
    for v in order:
        for r in runs:
            m = r.data.metrics
            if _variant(r.data.params) != v or f"task_score.{MC[0]}" not in m:
                continue
            cells = [f"{m[f'task_score.{t}']:.3f} ± {m.get(f'task_score_stderr.{t}', float('nan')):.3f} "
                     f"(Δ {m[f'task_delta.{t}']:+.3f} ± {m[f'task_delta_stderr.{t}']:.3f})" if f"task_score.{t}" in m else "-"
                     for t in MC]
            gate = "pass" if m.get("task_gate") == 1.0 else "fail"
            print(f"| {v} | " + " | ".join(cells) + f" | {gate} |")
    ctxs = sorted({int(r.data.params["workload.context_len"]) for r in runs
                   if f"task_score.{NEEDLE[0]}" in r.data.metrics})
    for task in NEEDLE:
        print(f"\n`{task}` exact match by context length (documents found / run, depths "
              f"{', '.join(k.split('.d')[-1] + '%' for k in sorted(next((r.data.metrics for r in runs if f'task_score.{task}' in r.data.metrics), {})) if k.startswith(f'task_score.{task}.d'))}):\n")
        print("| level | " + " | ".join(str(c) for c in ctxs) + " |")
        print("|---|" + "---:|" * len(ctxs))
        for v in order:
            cells = []
            for c in ctxs:
                got = [r for r in runs if _variant(r.data.params) == v and int(r.data.params["workload.context_len"]) == c
                       and f"task_score.{task}" in r.data.metrics]
                if not got:
                    cells.append("-")
                    continue
                m = got[0].data.metrics
                n = int(m.get(f"task_n.{task}", 0))
                depths = "/".join(f"{m[k]:.0f}" for k in sorted(m) if k.startswith(f"task_score.{task}.d"))
                cells.append(f"{m[f'task_score.{task}'] * n:.0f}/{n} ({depths})")
            if any(c != "-" for c in cells):
                print(f"| {v} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
