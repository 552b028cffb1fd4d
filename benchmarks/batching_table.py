"""Tables of the latest `experiment=batching` sweep (static vs continuous batching, prefix caching off/on,
per arrival rate) from MLflow, for BENCHMARKS.md.

    infersweep sweep experiment=batching && python benchmarks/batching_table.py
"""
from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

from mlflow.tracking import MlflowClient  # noqa: E402

from experiments.tracking.store import TOKENS_ARTIFACT, Tracker, resolve_uri  # noqa: E402

MODES = ("static", "continuous")


def _f(m: dict, k: str, fmt: str = "{:.0f}") -> str:
    return fmt.format(m[k]) if k in m else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tracking-uri", default="sqlite:///mlflow/mlflow.db")
    ap.add_argument("--artifact-root", default="mlflow/artifacts")
    ap.add_argument("--experiment", default="batching")
    a = ap.parse_args()
    client = MlflowClient(tracking_uri=resolve_uri(a.tracking_uri))
    tracker = Tracker({"uri": a.tracking_uri, "artifact_root": a.artifact_root})
    exp = client.get_experiment_by_name(a.experiment)
    parent = client.search_runs([exp.experiment_id], "tags.kind = 'sweep'", order_by=["attributes.start_time DESC"],
                                max_results=1)[0]
    runs = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'", max_results=1000)
    cells: dict[tuple[float, str, str], dict] = {}
    tokens: dict[tuple[float, str, str], list] = {}
    for r in runs:
        p = r.data.params
        key = (float(p["workload.rate"]), p["batching.mode"], p["kv_cache.prefix_caching"])
        cells[key] = {"status": r.info.status, **r.data.metrics}
        if r.info.status == "FINISHED":
            tokens[key] = json.loads(tracker.load_text(r.info.run_id, TOKENS_ARTIFACT))
    env = runs[0].data.tags
    p = runs[0].data.params
    print(f"sweep {parent.data.tags.get('sweep_id')} on {env.get('env.device_name', '?')}, torch threads "
          f"{env.get('env.torch_threads', '?')}; {p.get('workload.num_requests')} requests, prefix "
          f"{p.get('workload.prefix_len')} + input {p.get('workload.input_len.min')}-{p.get('workload.input_len.max')}, "
          f"output {p.get('workload.output_len.min')}-{p.get('workload.output_len.max')} tokens, "
          f"max_batch_size {p.get('batching.max_batch_size')}, SLO ttft <= {p.get('slo.ttft_ms')} ms, "
          f"tpot <= {p.get('slo.tpot_ms')} ms\n")
    print("| rate req/s | batching | prefix cache | req/s | output tok/s | goodput req/s | TTFT ms p50 / p90 / p99 | "
          "TPOT ms p50 / p90 / p99 | ITL ms p99 | e2e s p50 | batch | prefix hit | preempt | same tokens |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
    for key in sorted(cells, key=lambda k: (k[0], MODES.index(k[1]) if k[1] in MODES else 9, k[2])):
        rate, mode, pc = key
        m = cells[key]
        if m["status"] != "FINISHED":
            print(f"| {rate:g} | {mode} | {pc} | {m['status']} |||||||||||")
            continue
        ref = tokens.get((rate, "static", "False"))
        same = "-" if ref is None else f"{sum(x == y for x, y in zip(tokens[key], ref))}/{len(ref)}"
        print(f"| {rate:g} | {mode} | {pc} | {m['request_s']:.3f} | {m['output_tok_s']:.1f} | {m['goodput']:.3f} | "
              f"{m['ttft_ms_p50']:.0f} / {m['ttft_ms_p90']:.0f} / {m['ttft_ms_p99']:.0f} | "
              f"{m['tpot_ms_p50']:.0f} / {m['tpot_ms_p90']:.0f} / {m['tpot_ms_p99']:.0f} | {m['itl_ms_p99']:.0f} | "
              f"{m['e2e_s_p50']:.1f} | {m['mean_batch_size']:.1f} | {m['prefix_hit_rate']:.2f} | {m['preemptions']:.0f} | {same} |")
    print("\nContinuous / static, output tok/s (same rate, same prefix caching):")
    for rate in sorted({k[0] for k in cells}):
        for pc in ("False", "True"):
            s, c = cells.get((rate, "static", pc), {}), cells.get((rate, "continuous", pc), {})
            if "output_tok_s" in s and "output_tok_s" in c:
                r = c["output_tok_s"] / s["output_tok_s"]
                print(f"- rate {rate:g}, prefix caching {pc.lower()}: x{r:.2f} (static reaches {100 / r:.0f}% of "
                      f"continuous; TTFT p50 {s['ttft_ms_p50']:.0f} -> {c['ttft_ms_p50']:.0f} ms, "
                      f"TPOT p50 {s['tpot_ms_p50']:.0f} -> {c['tpot_ms_p50']:.0f} ms)")
    print("\nPrefix caching on / off, output tok/s:")
    for rate in sorted({k[0] for k in cells}):
        for mode in ("static", "continuous"):
            off, on = cells.get((rate, mode, "False"), {}), cells.get((rate, mode, "True"), {})
            if "output_tok_s" in off and "output_tok_s" in on:
                print(f"- rate {rate:g}, {mode}: x{on['output_tok_s'] / off['output_tok_s']:.2f} "
                      f"(hit rate {on['prefix_hit_rate']:.2f}; TTFT p50 {off['ttft_ms_p50']:.0f} -> {on['ttft_ms_p50']:.0f} ms)")


if __name__ == "__main__":
    main()
