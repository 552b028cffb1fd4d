"""Batched decode (issue 42 item 3's vLLM row): the native engine's C++ step against vLLM CPU (engine=vllm, its own
venv) at the same batch, SmolLM2-135M, both fp32 and bf16 where the CPU has bf16 units.

    make setup-vllm && python benchmarks/bench_batch_vs_vllm.py [--batches 4,16] [--context 128] [--new-tokens 32]
                                                                [--blocks 2] [--repeats 3] [--dtypes float32]

vLLM runs in its own process, so the two cannot be interleaved round by round (engine.run_interleaved refuses it):
each block runs one trial of each engine back to back (`--repeats` timed repeats after a warm-up, the order
alternating by block: ABBA), and the ratio is the median over blocks of native / vLLM decode tok/s (the batch's
generated tokens after the first / decode time), with every repeat's value printed so the spread shows. Same
prompts (the trial's seed), greedy, the same threads.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine import (AttentionConfig, EngineConfig, EvalConfig, KVCacheConfig, ModelConfig,  # noqa: E402
                    TrialConfig, WorkloadConfig, run_engine_trial)
from engine.config import QuantConfig  # noqa: E402

MODEL = dict(name="smollm2-135m-instruct", path="prepared://smollm2-135m-instruct")


def trial(engine: str, dtype: str, batch: int, a) -> TrialConfig:
    wl = WorkloadConfig(context_len=a.context, max_new_tokens=a.new_tokens, batch_size=batch, warmup=1,
                        repeats=a.repeats)
    if engine == "native-cpp":
        eng = EngineConfig(backend="native", threads=a.threads, compile=True, compile_mode="cpp")
        quant = QuantConfig(kernel="gemv-all")
    else:
        eng, quant = EngineConfig(backend="vllm", threads=a.threads), QuantConfig()
    return TrialConfig(model=ModelConfig(**MODEL, dtype=dtype), engine=eng, attention=AttentionConfig(impl="sdpa"),
                       kv_cache=KVCacheConfig(mode="contiguous" if engine == "native-cpp" else "paged"), quant=quant,
                       workload=wl, eval=EvalConfig(enabled=False))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="4,16")
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    load = lambda: " ".join(open("/proc/loadavg").read().split()[:3])  # noqa: E731
    print(f"native C++ step vs vLLM CPU, {MODEL['name']}, context {a.context}, {a.new_tokens} new tokens, greedy, "
          f"{a.threads} threads, {a.blocks} ABBA blocks x {a.repeats} repeats; {os.cpu_count()} CPUs, load {load()}, "
          f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC\n")
    print("| dtype | batch | native C++ decode tok/s (repeats) | vLLM decode tok/s (repeats) | native / vLLM (median of blocks) |")
    print("|---|---:|---|---|---:|")
    for dtype in a.dtypes.split(","):
        for batch in (int(b) for b in a.batches.split(",")):
            runs: dict[str, list[float]] = {"native-cpp": [], "vllm": []}
            ratios = []
            for block in range(a.blocks):
                order = ["native-cpp", "vllm"] if block % 2 == 0 else ["vllm", "native-cpp"]
                med = {}
                for eng in order:
                    r = run_engine_trial(trial(eng, dtype, batch, a))
                    vals = r.samples["decode_tok_s"]
                    runs[eng] += vals
                    med[eng] = statistics.median(vals)
                ratios.append(med["native-cpp"] / med["vllm"])
            fmt = lambda v: ", ".join(f"{x:.0f}" for x in v)  # noqa: E731
            print(f"| {dtype} | {batch} | {statistics.median(runs['native-cpp']):.0f} ({fmt(runs['native-cpp'])}) | "
                  f"{statistics.median(runs['vllm']):.0f} ({fmt(runs['vllm'])}) | x{statistics.median(ratios):.2f} "
                  f"(blocks: {', '.join(f'x{x:.2f}' for x in ratios)}) |", flush=True)
    print(f"\nload at the end {load()}")


if __name__ == "__main__":
    main()
