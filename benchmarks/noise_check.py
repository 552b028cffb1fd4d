"""Quiet vs loaded: does a trial's spread and `unstable` flag tell a loaded machine from a quiet one?

Runs the same trial (SmolLM2-135M, engine=hf fp32 by default) with the machine as it is, then with one busy
process per core that this script starts and ends itself, and prints each timing's median, 95% interval
width (relative to the median), CV, the other-process CPU share and the `unstable` verdict.

    .venv/bin/python benchmarks/noise_check.py [--rounds 2] [--repeats 5] [--engine hf] [--tiny]
"""
from __future__ import annotations

import argparse
import os
import time



def run_once(args, loaded: bool) -> dict:
    from cpu_load import CpuBurners

    from engine import EvalConfig, ModelConfig, TrialConfig, WorkloadConfig, run_engine_trial
    from engine.config import EngineConfig, KVCacheConfig, TinyModelConfig

    model = (ModelConfig(name="tiny", path="tiny://llama", tiny=TinyModelConfig(num_layers=4, hidden_size=256,
                                                                                 intermediate_size=512))
             if args.tiny else ModelConfig(name="smollm2-135m-instruct", path="prepared://smollm2-135m-instruct",
                                           dtype="float32"))
    trial = TrialConfig(model=model, engine=EngineConfig(backend=args.engine, threads=os.cpu_count() or 1),
                        kv_cache=KVCacheConfig(mode="contiguous"),
                        workload=WorkloadConfig(context_len=args.context, max_new_tokens=args.new_tokens,
                                                repeats=args.repeats, warmup=1),
                        eval=EvalConfig(enabled=False))
    with CpuBurners(enabled=loaded):
        r = run_engine_trial(trial)
    return {"metrics": r.metrics, "unstable": r.labels.get("unstable", "")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="quiet/loaded pairs")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--engine", default="hf")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model instead of SmolLM2")
    args = ap.parse_args()
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f} at start")
    print("| round | machine | timing | median | 95% CI width | CV | other CPU | unstable |")
    print("|---|---|---|---|---|---|---|---|")
    for i in range(args.rounds):
        for loaded in (False, True):
            r = run_once(args, loaded)
            m = r["metrics"]
            for k in ("tpot_ms_p50", "ttft_ms_p50", "output_tok_s"):
                width = (m[f"{k}_ci_hi"] - m[f"{k}_ci_lo"]) / m[k]
                print(f"| {i + 1} | {'loaded' if loaded else 'quiet'} | {k} | {m[k]:.4g} | {width:.1%} | "
                      f"{m[f'{k}_cv']:.1%} | {m.get('noise_other_cpu_frac', float('nan')):.0%} | "
                      f"{r['unstable'] or 'no'} |")


if __name__ == "__main__":
    main()
