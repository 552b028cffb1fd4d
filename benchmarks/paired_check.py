"""Sequential vs interleaved: does measuring two variants round-robin (ABBA) narrow the interval of their
ratio when the machine drifts?

Measures variant A (engine=hf) and variant B (engine=native) of the same model and workload twice:
- sequential: all of A's repeats, then all of B's (the way a sweep runs trials one after another); the
  ratio's interval comes from each trial's own interval (`engine.measure.spread.ratio`);
- interleaved: `engine.run_interleaved`, one repeat of each per round; the interval comes from the per-round
  ratios (`engine.measure.spread.paired_ratio`).
Halfway through each (sequential: when B starts; interleaved: when round rounds/2 starts), the script
starts one busy process per core (and ends them at the end), so the machine's speed changes during the
measurement as it does when other work arrives on a shared machine.

    .venv/bin/python benchmarks/paired_check.py [--rounds 8] [--tiny] [--no-drift]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time


def main() -> None:
    from cpu_load import CpuBurners
    from engine import EvalConfig, ModelConfig, TrialConfig, WorkloadConfig, run_engine_trial, run_interleaved
    from engine.config import EngineConfig, KVCacheConfig, TimingConfig, TinyModelConfig
    from engine.measure.spread import paired_ratio, ratio, spread

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8, help="repeats per variant (rounds when interleaved)")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--metric", default="output_tok_s")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model instead of SmolLM2")
    ap.add_argument("--no-drift", action="store_true", help="do not start the busy processes")
    args = ap.parse_args()

    model = (ModelConfig(name="tiny", path="tiny://llama", tiny=TinyModelConfig(num_layers=4, hidden_size=256,
                                                                                 intermediate_size=512))
             if args.tiny else ModelConfig(name="smollm2-135m-instruct", path="prepared://smollm2-135m-instruct",
                                           dtype="float32"))
    threads = os.cpu_count() or 1
    base = TrialConfig(model=model, kv_cache=KVCacheConfig(mode="contiguous"), eval=EvalConfig(enabled=False),
                       workload=WorkloadConfig(context_len=args.context, max_new_tokens=args.new_tokens,
                                               repeats=args.rounds, warmup=1),
                       timing=TimingConfig(max_repeats=0))  # exactly --rounds repeats: the same n both ways
    a = dataclasses.replace(base, engine=EngineConfig(backend="hf", threads=threads))
    b = dataclasses.replace(base, engine=EngineConfig(backend="native", threads=threads))
    print(f"A = engine=hf, B = engine=native; {model.name}, context {args.context}, {args.new_tokens} new tokens, "
          f"{args.rounds} repeats each, {threads} threads; load {os.getloadavg()[0]:.2f} at start, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)

    # sequential: A then B; the drift starts when A is done (halfway through the measurement)
    run_engine_trial(a)  # warm caches and the hardware probe outside both measurements
    ra = run_engine_trial(a)
    with CpuBurners(enabled=not args.no_drift):
        rb = run_engine_trial(b)
    seq = ratio(spread(ra.samples[args.metric]), spread(rb.samples[args.metric]))

    # interleaved: ABBA rounds; the drift starts halfway through, when round rounds/2 begins
    with CpuBurners(after_s=float("inf"), enabled=not args.no_drift) as load:
        ia, ib = run_interleaved([a, b], args.rounds,
                                 on_round=lambda r: load.start_now() if r == args.rounds // 2 else None)
    inter = paired_ratio(ia.samples[args.metric], ib.samples[args.metric])

    print(f"\n| mode | {args.metric} A (median) | B (median) | B/A | 95% interval | width | verdict |")
    print("|---|---|---|---|---|---|---|")
    for name, ma, mb, r in (("sequential", ra, rb, seq), ("interleaved (ABBA)", ia, ib, inter)):
        print(f"| {name} | {ma.metrics[args.metric]:.2f} | {mb.metrics[args.metric]:.2f} | x{r.value:.3f} | "
              f"{r.lo:.3f}-{r.hi:.3f} | {100 * (r.hi - r.lo) / r.value:.1f}% | {r.verdict} |")
    rel = lambda r: (r.hi - r.lo) / r.value  # noqa: E731
    print(f"\ninterleaved / sequential relative interval width: {rel(inter) / rel(seq):.2f}")


if __name__ == "__main__":
    main()
