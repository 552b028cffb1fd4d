"""How often is a trial labelled `unstable`, and why? The quickstart's grid (KV cache off/on x eager/sdpa x
context 128/512, model.dtype auto/float32) run once into a throwaway MLflow store -- each trial alone, or
with `--interleave N` as interleaved groups of N rounds -- then every trial judged three ways from what it
logged:
- `tag`: the `unstable` label the running code gave it;
- `legacy`: the rule before issue 26 (a judged timing's CV above 10%, or other processes above 25% of the CPUs);
- `rule`: the rule in engine/measure/metrics.py: `instability` over the logged metrics (the same as `tag`
  when this code ran the sweep).
For interleaved trials it also prints how far each variant's first timed round sat from its median
(TTFT and output tok/s): a first round still warming shows as a large ratio.

    .venv/bin/python benchmarks/flag_check.py [--model tiny-llama] [--interleave 6] [extra overrides...]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

LEGACY_CV, LEGACY_OTHER_CPU = 0.10, 0.25
JUDGED = ("tpot_ms_p50", "ttft_ms_p50", "output_tok_s")


def legacy(m: dict[str, float]) -> str:
    why = [f"{k} CV {m[k + '_cv']:.0%}" for k in JUDGED
           if m.get(k + "_cv") is not None and m.get(k + "_n", 0) > 1 and m[k + "_cv"] > LEGACY_CV]
    if (m.get("noise_other_cpu_frac") or 0) > LEGACY_OTHER_CPU:
        why.append(f"other CPU {m['noise_other_cpu_frac']:.0%}")
    return "; ".join(why)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--interleave", type=int, default=0, help="rounds per interleaved group (0: each trial alone)")
    ap.add_argument("extra", nargs="*", help="more overrides for the sweep")
    args = ap.parse_args()

    from engine.measure.metrics import instability
    from experiments.analysis.results import load
    from experiments.run.sweep import run_sweep
    from experiments.tracking.store import REPEAT_PREFIX, open_store

    store = tempfile.mkdtemp(prefix="flag-check-")
    uri = f"sqlite:///{store}/mlflow.db"
    name = "flag-check"
    overrides = ["experiment=quickstart", f"model={args.model}", "eval=none", f"sweep_name={name}",
                 f"tracking.uri={uri}", f"tracking.artifact_root={store}/artifacts", *args.extra]
    if args.interleave:
        overrides.append(f"cluster.interleave={args.interleave}")
    print(f"sweep: {' '.join(overrides[:4] + overrides[6:])}; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f} "
          f"at start, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    t0 = time.perf_counter()
    res = run_sweep(overrides, echo=lambda *_: None, force=True)
    print(f"{time.perf_counter() - t0:.0f} s, {len(res.failed)} failed, load {os.getloadavg()[0]:.2f} at the end")
    client = open_store(uri)
    rows = [r for r in load(client, name).rows if r.finished]
    n_tag = n_legacy = n_rule = 0
    print("\n| trial | other CPU | tag | legacy rule | first round / median (ttft, out tok/s) |")
    print("|---|---|---|---|---|")
    for r in rows:
        m, tag, old, new = r.metrics, r.tags.get("unstable", ""), legacy(r.metrics), instability(r.metrics)
        n_tag, n_legacy, n_rule = n_tag + bool(tag), n_legacy + bool(old), n_rule + bool(new)
        first = []
        for k in ("ttft_ms_p50", "output_tok_s"):
            hist = sorted(client.get_metric_history(r.run_id, REPEAT_PREFIX + k), key=lambda x: x.step)
            if len(hist) > 2:
                first.append(f"{hist[0].value / statistics.median(h.value for h in hist[1:]):.2f}")
        print(f"| {r.name} | {100 * (m.get('noise_other_cpu_frac') or 0):.0f}% | {tag or '-'} | {old or '-'} | "
              f"{', '.join(first) or '-'} |")
    print(f"\nflagged: tag {n_tag}/{len(rows)}, legacy rule {n_legacy}/{len(rows)}, current rule {n_rule}/{len(rows)}")
    grouped = [r for r in rows if r.num("group_peak_mem_bytes") is not None]
    if grouped:  # an interleaved group's memory: each variant's own footprint, and the group process's peak
        print("peak MB (own) / weights MB / group peak MB: " + "; ".join(
            f"{r.num('peak_mem_bytes') / 1e6:.1f} / {r.num('weights_bytes') / 1e6:.1f} / "
            f"{r.num('group_peak_mem_bytes') / 1e6:.0f}" for r in grouped))
    try:  # what the report decides from these trials (the code that ran the sweep may predate the rule)
        from experiments.analysis import advice
        from experiments.analysis.report import build

        rep = build(name, {"uri": uri}, out_dir=tempfile.mkdtemp(prefix="flag-report-"), log_artifacts=False,
                    progress=False)
        cells = [ln for ln in rep.lines if not ln.is_baseline and ln.baseline is not None]
        undecided = sum(not getattr(ln, "decidable", True) for ln in cells)
        print(f"report: {undecided} of {len(cells)} speedup lines not decidable (unstable: load)")
        for a in rep.advice:
            print(f"[{a.workload}] " + ("no winner named" if a.best is None else
                                        f"best: {advice.chain_label(a.best)} ({a.best.hash[:8]})"))
    except Exception as e:  # noqa: BLE001 -- a summary line, not the benchmark's result
        print(f"report: {e}")


if __name__ == "__main__":
    main()
