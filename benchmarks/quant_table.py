"""Pivot the latest `experiment=quant-long-context` sweep from MLflow into the BENCHMARKS.md table.

    infersweep sweep experiment=quant-long-context && python benchmarks/quant_table.py
"""
from __future__ import annotations

import argparse
from collections import defaultdict

from mlflow.tracking import MlflowClient

from experiments.analysis.results import load
from experiments.tracking.store import resolve_uri

LEVELS = ["none", "int8-weight", "int8-dynamic", "bnb-int8", "bnb-nf4", "bnb-fp4"]


def _early_late(m: dict) -> str:
    if "kl_div_early" not in m:
        return "-"
    return f"{m['kl_div_early']:.4f} / {m['kl_div_late']:.4f}"


def _tail(m: dict) -> str:
    """KL p99.9 / max (llama.cpp's '99.9% KLD' and 'Maximum KLD'); '-' for runs recorded before them."""
    if "kl_div_p999" not in m:
        return "-"
    return f"{m['kl_div_p999']:.4f} / {m['kl_div_max']:.4f}"


def _pm(m: dict, key: str, fmt: str) -> str:
    """value ± its stderr (`<key>_stderr`), or the value alone for runs recorded before the stderr."""
    se = m.get(f"{key}_stderr")
    return fmt.format(m[key]) + ("" if se is None else " ± " + fmt.format(se))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tracking-uri", default="sqlite:///mlflow/mlflow.db")
    ap.add_argument("--experiment", default="quant-long-context")
    a = ap.parse_args()
    client = MlflowClient(tracking_uri=resolve_uri(a.tracking_uri))
    # the latest sweep's plan, newest FINISHED run per config hash (a resumed sweep's skipped trials included)
    sel = load(client, a.experiment)
    cells: dict[tuple[str, int], dict] = {}
    for r in sel.rows:
        cells[(r.params["quant.level"], int(r.params["workload.context_len"]))] = {"status": r.status, **r.metrics}
    ctxs = sorted({c for _, c in cells})
    env = sel.rows[0].tags
    print(f"sweep(s) {', '.join(sel.sweep_ids)} on {env.get('env.device_name', '?')}, "
          f"torch threads {env.get('env.torch_threads', '?')}\n")
    print("| quant | context | prefill tok/s | vs none | decode tok/s | vs none | weights MB | kl_div_mean | kl_div_p99 | "
          "KL p99.9 / max | KL early / late quarter | top1 | ppl | ppl_ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for lvl in LEVELS:
        for c in ctxs:
            m = cells.get((lvl, c))
            if not m:
                continue
            if m["status"] != "FINISHED":
                print(f"| {lvl} | {c} | {m['status']} ||||||||||||")
                continue
            ref = cells.get(("none", c), {})

            def rel(key: str) -> str:
                return f"x{m[key] / ref[key]:.2f}" if ref.get(key) else "-"

            print(f"| {lvl} | {c} | {m['prefill_tok_s']:.0f} | {rel('prefill_tok_s')} | {m['decode_tok_s']:.2f} | "
                  f"{rel('decode_tok_s')} | {m['weights_bytes'] / 1e6:.0f} | "
                  f"{_pm(m, 'kl_div_mean', '{:.4f}')} | {m['kl_div_p99']:.4f} | {_tail(m)} | {_early_late(m)} | "
                  f"{_pm(m, 'top1_agreement', '{:.3f}')} | {m['ppl']:.2f} | {_pm(m, 'ppl_ratio', '{:.4f}')} |")
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
                  f"ppl_ratio {r0:.4f} -> {r1:.4f}; late/early quarter of the window: "
                  + ", ".join(f"{c}: x{t[c]['kl_div_late'] / t[c]['kl_div_early']:.2f}" for c in ctxs
                              if c in t and t[c].get("kl_div_early")))


if __name__ == "__main__":
    main()
