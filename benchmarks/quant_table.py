"""Pivot the latest `experiment=quant-long-context` sweep from MLflow into the BENCHMARKS.md table.

    infersweep sweep experiment=quant-long-context && python benchmarks/quant_table.py
"""
from __future__ import annotations

import argparse
from collections import defaultdict

from mlflow.tracking import MlflowClient

from experiments.tracking import resolve_uri

LEVELS = ["none", "int8-weight", "int8-dynamic", "bnb-int8", "bnb-nf4", "bnb-fp4"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tracking-uri", default="sqlite:///mlflow/mlflow.db")
    ap.add_argument("--experiment", default="quant-long-context")
    a = ap.parse_args()
    client = MlflowClient(tracking_uri=resolve_uri(a.tracking_uri))
    exp = client.get_experiment_by_name(a.experiment)
    parents = client.search_runs([exp.experiment_id], "tags.kind = 'sweep'", order_by=["attributes.start_time DESC"], max_results=1)
    parent = parents[0]
    runs = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'", max_results=1000)
    cells: dict[tuple[str, int], dict] = {}
    for r in runs:
        cells[(r.data.params["quant.level"], int(r.data.params["workload.context_len"]))] = {
            "status": r.info.status, **r.data.metrics}
    ctxs = sorted({c for _, c in cells})
    env = runs[0].data.tags
    print(f"sweep {parent.data.tags.get('sweep_id')} on {env.get('env.device_name', '?')}, "
          f"torch threads {env.get('env.torch_threads', '?')}\n")
    print("| quant | context | prefill tok/s | vs none | decode tok/s | vs none | weights MB | kl_div_mean | kl_div_p99 | top1 | ppl | ppl_ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for lvl in LEVELS:
        for c in ctxs:
            m = cells.get((lvl, c))
            if not m:
                continue
            if m["status"] != "FINISHED":
                print(f"| {lvl} | {c} | {m['status']} ||||||||||")
                continue
            ref = cells.get(("none", c), {})

            def rel(key: str) -> str:
                return f"x{m[key] / ref[key]:.2f}" if ref.get(key) else "-"

            print(f"| {lvl} | {c} | {m['prefill_tok_s']:.0f} | {rel('prefill_tok_s')} | {m['decode_tok_s']:.2f} | "
                  f"{rel('decode_tok_s')} | {m['weights_bytes'] / 1e6:.0f} | "
                  f"{m['kl_div_mean']:.4f} | {m['kl_div_p99']:.4f} | {m['top1_agreement']:.3f} | {m['ppl']:.2f} | {m['ppl_ratio']:.4f} |")
    print("\nLong-context trap: KL at the longest context / KL at the shortest, per level")
    trend = defaultdict(dict)
    for (lvl, c), m in cells.items():
        if m["status"] == "FINISHED":
            trend[lvl][c] = m
    for lvl in LEVELS[1:]:
        t = trend.get(lvl, {})
        if ctxs[0] in t and ctxs[-1] in t and t[ctxs[0]]["kl_div_mean"] > 0:
            k0, k1 = t[ctxs[0]]["kl_div_mean"], t[ctxs[-1]]["kl_div_mean"]
            r0, r1 = t[ctxs[0]]["ppl_ratio"], t[ctxs[-1]]["ppl_ratio"]
            print(f"- {lvl}: KL {k0:.4f} @ {ctxs[0]} -> {k1:.4f} @ {ctxs[-1]} (x{k1 / k0:.2f}); "
                  f"ppl_ratio {r0:.4f} -> {r1:.4f}")


if __name__ == "__main__":
    main()
