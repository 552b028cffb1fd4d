"""Tables of the latest `experiment=serving-capacity` sweep from MLflow, for BENCHMARKS.md: each
configuration's max rate at the SLO with its bracket and probes, and the multi-turn workload's prefill
tokens and TTFT per turn with and without the cached conversation state.

    infersweep sweep experiment=serving-capacity && python benchmarks/capacity_table.py
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

from mlflow.tracking import MlflowClient  # noqa: E402

from experiments.tracking.store import resolve_uri  # noqa: E402

MODES = ("static", "continuous")


def _f(m: dict, k: str, fmt: str = "{:.0f}") -> str:
    return fmt.format(m[k]) if k in m else "-"


def _history(client, run_id: str, key: str) -> list[float]:
    return [h.value for h in sorted(client.get_metric_history(run_id, key), key=lambda h: h.step)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tracking-uri", default="sqlite:///mlflow/mlflow.db")
    ap.add_argument("--experiment", default="serving-capacity")
    a = ap.parse_args()
    client = MlflowClient(tracking_uri=resolve_uri(a.tracking_uri))
    exp = client.get_experiment_by_name(a.experiment)
    parent = client.search_runs([exp.experiment_id], "tags.kind = 'sweep'", order_by=["attributes.start_time DESC"],
                                max_results=1)[0]
    runs = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'", max_results=1000)

    def key(r):
        p = r.data.params
        return (p["workload.name"], p["engine.backend"], MODES.index(p["batching.mode"]) if p["batching.mode"] in MODES else 9,
                p["kv_cache.prefix_caching"])

    runs.sort(key=key)
    p, env = runs[0].data.params, runs[0].data.tags
    print(f"sweep {parent.data.tags.get('sweep_id')} on {env.get('env.device_name', '?')}, torch threads "
          f"{env.get('env.torch_threads', '?')}; SLO: p{p.get('capacity.percentile')} TTFT <= {p.get('slo.ttft_ms')} ms "
          f"and TPOT <= {p.get('slo.tpot_ms')} ms; <= {p.get('capacity.max_probes')} probes, tolerance "
          f"{p.get('capacity.tolerance')}, <= {p.get('capacity.max_s')} s per search\n")
    print("| workload | engine | batching | prefix cache | max rate at SLO (bracket) | probes | sync req/s | saturation req/s | "
          "goodput at SLO | output tok/s at SLO | TTFT p90 ms | TPOT p90 ms | search s | why it stopped |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in runs:
        p, m = r.data.params, r.data.metrics
        head = f"| {p['workload.name']} | {p['engine.backend']} | {p['batching.mode']} | {p['kv_cache.prefix_caching']} |"
        if r.info.status != "FINISHED":
            print(f"{head} {r.info.status}: {(r.data.tags.get('error') or '')[:80]} ||||||||||")
            continue
        hi = m.get("capacity_bracket_hi")
        bracket = f"{m['max_rate_at_slo']:.3g}" + (f" [{m['max_rate_at_slo']:.3g}, {hi:.3g})" if hi else "")
        print(f"{head} {bracket} | {_f(m, 'capacity_probes')} | {_f(m, 'capacity_sync_request_s', '{:.3f}')} | "
              f"{_f(m, 'capacity_saturation_request_s', '{:.3f}')} | {_f(m, 'goodput_at_slo', '{:.3f}')} | "
              f"{_f(m, 'output_tok_s_at_slo', '{:.1f}')} | {_f(m, 'ttft_ms_p90')} | {_f(m, 'tpot_ms_p90')} | "
              f"{_f(m, 'capacity_search_s')} | {r.data.tags.get('capacity', '-')} |")
    multi = [r for r in runs if r.data.params.get("workload.kind") == "multi-turn" and r.info.status == "FINISHED"]
    if multi:
        print("\nMulti-turn, per turn (mean over conversations, the probe at the found rate):\n")
        print("| engine | batching | prefix cache | prompt tokens per turn | prefill tokens computed per turn | TTFT ms per turn | "
              "prefill computed / prompt (all turns) |")
        print("|---|---|---|---|---|---|---:|")
        for r in multi:
            p, m = r.data.params, r.data.metrics
            cols = [" / ".join(f"{v:.0f}" for v in _history(client, r.info.run_id, k))
                    for k in ("turn_prompt_tokens", "turn_prefill_tokens", "turn_ttft_ms")]
            share = m["prefill_tokens"] / m["prompt_tokens"] if m.get("prompt_tokens") else float("nan")
            print(f"| {p['engine.backend']} | {p['batching.mode']} | {p['kv_cache.prefix_caching']} | {cols[0]} | {cols[1]} | {cols[2]} | {share:.2f} |")


if __name__ == "__main__":
    main()
