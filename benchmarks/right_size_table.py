"""The table of the latest `experiment=right-size` trials from MLflow, for BENCHMARKS.md: per model and engine
variant its dtype, the three BIG-bench tasks' accuracy +- stderr, output tok/s, TPOT, TTFT, peak memory and
whether the trial was measured under load. The verdicts themselves are `infersweep report right-size`'s.

    infersweep sweep experiment=right-size && infersweep report right-size && python benchmarks/right_size_table.py
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

from mlflow.tracking import MlflowClient  # noqa: E402

from experiments.tracking.store import resolve_uri  # noqa: E402

MC = ("arc_easy", "sciq", "piqa")  # conf/accuracy_point/mc.yaml


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tracking-uri", default="sqlite:///mlflow/mlflow.db")
    ap.add_argument("--experiment", default="right-size")
    a = ap.parse_args()
    client = MlflowClient(tracking_uri=resolve_uri(a.tracking_uri))
    exp = client.get_experiment_by_name(a.experiment)
    runs = [r for r in client.search_runs([exp.experiment_id], "tags.kind != 'sweep'", max_results=5000)
            if r.info.status == "FINISHED" and "output_tok_s" in r.data.metrics]
    latest: dict[tuple, object] = {}  # the newest finished run of each configuration hash
    for r in sorted(runs, key=lambda r: r.info.start_time):
        latest[r.data.tags.get("config_hash")] = r
    print("| model | engine | quant | dtype | eval.limit | " + " | ".join(MC) + " | out tok/s | TPOT ms | TTFT ms | "
          "peak MB | unstable |")
    print("|---|---|---|---|---|" + "---|" * (len(MC) + 5))
    for r in sorted(latest.values(), key=lambda r: (r.data.params.get("eval.limit"), r.data.params.get("model.name"),
                                                    r.info.start_time)):
        p, m = r.data.params, r.data.metrics
        cells = [f"{m[f'task_score.{t}']:.2f} ± {m.get(f'task_score_stderr.{t}', float('nan')):.2f}"
                 if f"task_score.{t}" in m else "-" for t in MC]
        unstable = r.data.tags.get("unstable", "")
        print(f"| {p.get('model.name')} | {p.get('engine.backend')} | {p.get('quant.level')} | {p.get('model.dtype')} | "
              f"{p.get('eval.limit')} | " + " | ".join(cells)
              + f" | {m['output_tok_s']:.2f} | {m.get('tpot_ms_p50', float('nan')):.0f} | {m.get('ttft_ms_p50', float('nan')):.0f}"
              f" | {m.get('peak_mem_bytes', 0) / 1e6:.0f} | {unstable.split(':')[0] or '-'} |")


if __name__ == "__main__":
    main()
