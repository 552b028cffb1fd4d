"""How often does `unstable` cry wolf on a quiet machine? Engine only (no Ray, no MLflow), so it runs on any
machine with torch and transformers.

1. Solo: the quickstart's grid (KV cache off/on x eager/sdpa x context 128/512) twice over -- 16 trials, each
   with the default adaptive repeats -- on a tiny random Llama sized so a run takes tens of ms. Each trial
   is judged by the legacy rule (a judged timing's CV > 10%) and by the current one (the trial's
   `unstable` label, engine.measure.metrics.instability: load, or the median's interval half-width > 10%).
2. Interleaved: the four variants at context 512, `--rounds` rounds, measured as before issue 26 (each
   variant's warm-up, then the timed rounds) and as now (`engine.run_interleaved`: an untimed round between),
   with how far each variant's first timed round sat from the median of the others (TTFT), and the flags
   (now: a variant's spread judged on its paired ratios, engine.measure.metrics.paired_instability).
   Also each variant's peak_mem_bytes (own footprint) against group_peak_mem_bytes.

    CUDA_VISIBLE_DEVICES= python benchmarks/quiet_flag_check.py [--rounds 6] [--layers 4 --hidden 256]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

JUDGED = ("tpot_ms_p50", "ttft_ms_p50", "output_tok_s")


def legacy(m: dict) -> str:
    return "; ".join(f"{k} CV {m[k + '_cv']:.0%}" for k in JUDGED
                     if m.get(k + "_n", 0) > 1 and m.get(k + "_cv", 0) > 0.10)


def grid(base):
    from engine.config import AttentionConfig, KVCacheConfig

    out = []
    for ctx in (128, 512):
        for kv in ("off", "contiguous"):
            for attn in ("eager", "sdpa"):
                out.append(dataclasses.replace(base, kv_cache=KVCacheConfig(mode=kv), attention=AttentionConfig(impl=attn),
                                               workload=dataclasses.replace(base.workload, context_len=ctx)))
    return out


def old_interleaved(trials, rounds):
    """run_interleaved as it was before the untimed warm-up round (and the per-variant memory)."""
    from engine.engines.base import Runs
    from engine.measure.noise import NoiseMonitor
    from engine.pipeline import open_trial

    ms = [open_trial(t) for t in trials]
    collected = [[] for _ in ms]
    for m in ms:
        m.workload.run(m.trial.workload.warmup, 0)
    with NoiseMonitor() as noise:
        for r in range(rounds):
            order = list(range(len(ms))) if r % 2 == 0 else list(reversed(range(len(ms))))
            for i in order:
                collected[i].append(ms[i].workload.run(0, 1))
    out = []
    for m, parts in zip(ms, collected):
        runs = Runs([t for p in parts for t in p.traces], [x for p in parts for x in p.extra],
                    max(p.peak_mem_bytes for p in parts))
        out.append(m.finish(runs, "old", noise.result))
    return out


def first_round(res) -> str:
    xs = res.samples.get("ttft_ms_p50", [])
    return f"{xs[0] / statistics.median(xs[1:]):.2f}" if len(xs) > 2 else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--solo-passes", type=int, default=2)
    args = ap.parse_args()

    import torch

    from engine import EvalConfig, ModelConfig, TrialConfig, WorkloadConfig, run_engine_trial, run_interleaved
    from engine.config import TinyModelConfig

    base = TrialConfig(model=ModelConfig(name="tiny-q", path="tiny://llama", tiny=TinyModelConfig(
                           num_layers=args.layers, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                           num_heads=8, num_kv_heads=4, vocab_size=8192)),
                       workload=WorkloadConfig(context_len=128, max_new_tokens=16, repeats=2, warmup=1),
                       eval=EvalConfig(enabled=False))
    print(f"{os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads, load "
          f"{os.getloadavg()[0]:.2f} at start, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    n_old = n_new = n = 0
    print("\n| solo trial | repeats | legacy (CV > 10%) | current rule |\n|---|---|---|---|")
    t0 = time.perf_counter()
    for _ in range(args.solo_passes):
        for t in grid(base):
            r = run_engine_trial(t)
            m = r.metrics
            old, new = legacy(m), r.labels.get("unstable", "")
            n, n_old, n_new = n + 1, n_old + bool(old), n_new + bool(new)
            print(f"| kv={t.kv_cache.mode} attn={t.attention.impl} ctx={t.workload.context_len} | "
                  f"{m['timed_repeats']:.0f} | {old or '-'} | {new or '-'} |", flush=True)
    print(f"\nsolo: flagged {n_old}/{n} by the legacy rule, {n_new}/{n} by the current one "
          f"({time.perf_counter() - t0:.0f} s)\n", flush=True)
    group = [t for t in grid(base) if t.workload.context_len == 512]
    for name, fn in (("before (no warm-up round)", old_interleaved), ("now (untimed warm-up round)", run_interleaved)):
        res = fn(group, args.rounds)
        print(f"interleaved, {name}: first-round TTFT / median of the rest = "
              + ", ".join(first_round(r) for r in res)
              + f"; rounds {res[0].metrics['timed_repeats']:.0f}; flagged legacy {sum(bool(legacy(r.metrics)) for r in res)}/{len(res)}, "
                f"current {sum(bool(r.labels.get('unstable')) for r in res)}/{len(res)}")
        for r in res:
            why = r.labels.get("unstable", "")
            if why:
                print(f"  {why}")
        if "group_peak_mem_bytes" in res[0].metrics:
            print("  peak MB own / weights MB / group peak MB: " + "; ".join(
                f"{r.metrics['peak_mem_bytes'] / 1e6:.1f} / {r.metrics['weights_bytes'] / 1e6:.1f} / "
                f"{r.metrics['group_peak_mem_bytes'] / 1e6:.0f}" for r in res), flush=True)


if __name__ == "__main__":
    main()
