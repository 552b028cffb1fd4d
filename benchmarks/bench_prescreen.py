"""The fidelity pre-screen's prediction, measured: how many task items change their answer per position whose
argmax changes on fixed text (optimize's pre-screen, experiments/optimize/accuracy.py `Prescreen`).

For each quantization level of SmolLM2-135M-Instruct (the optimize-cpu settings: contiguous KV cache, eager
attention, the fused GEMV kernels, `model.dtype` as given), one trial through the engine's own pipeline
(`engine.pipeline.run_engine_trial`) gives (a) its argmax at every position of the pre-screen's windows (eval.fidelity,
`--windows` windows of the workload's 64 tokens) and (b) its 0/1 answer on the gate's pooled items (ARC-Easy, SciQ,
PIQA, eval.order=pooled, `--items`). For every pair of levels it prints the share of positions whose argmax
differs (d), the share of items whose answer differs (p), their ratio p / d with the ratio's 95% interval
(a Poisson interval on the discordant items, the positions' share taken as known), and what the pre-screen's
`DISCORDANCE_PER_FLIP` then predicts. Needs `infersweep prepare --data`.

    .venv/bin/python benchmarks/bench_prescreen.py [--items 1000] [--windows 16] [--dtype auto]
        [--levels none,int8-weight,int4-weight,int8-dynamic]
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import time


def main() -> None:
    from engine.config import EvalConfig, ModelConfig, TrialConfig, WorkloadConfig, replace
    from engine.measure.hardware import preferred_cpu_dtype
    from engine.pipeline import TOP1_ARTIFACT, run_engine_trial
    from experiments.optimize.accuracy import DISCORDANCE_PER_FLIP, pair_items, prescreen
    from experiments.run.trial import identified_correct

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", type=int, default=1000, help="pooled items (eval.limit, eval.order=pooled)")
    p.add_argument("--windows", type=int, default=16, help="pre-screen windows of 64 tokens")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--levels", default="none,int8-weight,int4-weight,int8-dynamic")
    args = p.parse_args()
    dtype = preferred_cpu_dtype() if args.dtype == "auto" else args.dtype
    base = TrialConfig(model=ModelConfig(name="smollm2-135m-instruct", path="prepared://smollm2-135m-instruct",
                                         dtype=dtype),
                       workload=WorkloadConfig(context_len=64, max_new_tokens=8, repeats=1),
                       eval=EvalConfig(tasks=["arc_easy", "sciq", "piqa"], limit=args.items, order="pooled",
                                       fidelity=True, num_windows=args.windows))
    base = replace(replace(base, "kv_cache.mode", "contiguous"), "quant.kernel", "gemv")
    print(f"SmolLM2-135M-Instruct, model.dtype={dtype}, {args.items} pooled items, {args.windows} windows x 64 tokens")
    top1, items = {}, {}
    for level in args.levels.split(","):
        t0 = time.perf_counter()
        res = run_engine_trial(replace(base, "quant.level", level))
        top1[level] = json.loads(res.artifacts[TOP1_ARTIFACT])  # {"windows": digest, "top1": ids per window}
        correct = identified_correct(res.correct, res.items)
        items[level] = {f"{t}/{k}": v for t, per in correct.items() for k, v in per.items()}
        acc = sum(items[level].values()) / len(items[level])
        print(f"  {level}: accuracy {acc:.3f} on {len(items[level])} items, "
              f"top-1 vs the fp32 reference {res.metrics['top1_agreement']:.3f} ({time.perf_counter() - t0:.0f} s)",
              flush=True)
    print("\n| pair | positions differ (d) | items differ (p) | p / d [95%] | predicted p |")
    print("|---|---:|---:|---:|---:|")
    for a, b in itertools.combinations(top1, 2):
        ps = prescreen(top1[a], top1[b])
        x, y = pair_items(items[a], items[b])
        disc = sum(1 for u, v in zip(x, y) if u != v)
        d = ps.differ / ps.positions
        lo, hi = _poisson(disc)
        r = (disc / len(x)) / d if d else math.inf
        rng = f"[{lo / len(x) / d:.2f}, {hi / len(x) / d:.2f}]" if d else ""
        print(f"| {a} vs {b} | {ps.differ}/{ps.positions} = {100 * d:.1f}% | {disc}/{len(x)} = "
              f"{100 * disc / len(x):.1f}% | {r:.2f} {rng} | {100 * ps.discordance:.1f}% |")
    print(f"\n(predicted p = DISCORDANCE_PER_FLIP {DISCORDANCE_PER_FLIP} x (d's positions + 1 differing) share)")


def _poisson(k: int) -> tuple[float, float]:
    """An exact 95% Poisson interval for a count k (Garwood), by bisection on the regularized gamma."""
    from scipy.stats import chi2

    lo = 0.0 if k == 0 else chi2.ppf(0.025, 2 * k) / 2
    return lo, chi2.ppf(0.975, 2 * k + 2) / 2


if __name__ == "__main__":
    main()
