"""Continuous batching with the prompt in C++ (issue 42 items 1 and 3): engine=native-cpp serving a request stream,
its prefill chunks in torch's GEMMs (`engine.prefill=default`: every step with a prompt chunk leaves the C++ step) or
in the C++ step (`engine.prefill=cpp`: every step, prompt chunks beside decode rows, one C++ call).

    python benchmarks/bench_cpp_prefill_serving.py [--rounds 5] [--requests 16] [--chunk 64] [--dtype float32]
                                                   [--quant none|int8-dynamic]

SmolLM2-135M, all requests at once (a burst: the scheduler mixes prompt chunks with decode rows), prompts 32-256
tokens after a 64-token shared prefix, 16-64 new tokens, chunked prefill of `--chunk` tokens a step, greedy. The two
configurations run interleaved round by round in this process (engine.run_interleaved: ABBA); the ratios are paired
over rounds (median of per-round ratios and its 95% interval). Same requests, same tokens (checked).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine import (AttentionConfig, EngineConfig, EvalConfig, KVCacheConfig, ModelConfig,  # noqa: E402
                    TrialConfig, WorkloadConfig)
from engine.config import BatchingConfig, LengthConfig, QuantConfig  # noqa: E402
from engine.measure.spread import paired_ratio, spread  # noqa: E402
from engine.pipeline import run_interleaved  # noqa: E402

MODEL = dict(name="smollm2-135m-instruct", path="prepared://smollm2-135m-instruct")
METRICS = [("output_tok_s", "output tok/s", True), ("ttft_ms_p50", "TTFT p50 ms", False),
           ("ttft_ms_p90", "TTFT p90 ms", False), ("e2e_s_p50", "e2e p50 s", False)]


def trial(prefill: str, a) -> TrialConfig:
    wl = WorkloadConfig(kind="serving", num_requests=a.requests, prefix_len=64,
                        input_len=LengthConfig("uniform", 0, 32, 256), output_len=LengthConfig("uniform", 0, 16, 64),
                        arrival="all-at-once", warmup=1, repeats=1)
    return TrialConfig(model=ModelConfig(**MODEL, dtype=a.dtype),
                       engine=EngineConfig(backend="native", threads=a.threads, compile=True, compile_mode="cpp",
                                           prefill=prefill),
                       attention=AttentionConfig(impl="sdpa"), kv_cache=KVCacheConfig(mode="paged"),
                       batching=BatchingConfig("continuous", 16, a.chunk, True),
                       quant=QuantConfig(level=a.quant, kernel="gemv-all" if a.quant == "none" else "dequant",
                                         skip_modules=[] if a.quant != "none" else ["lm_head"]),
                       workload=wl, eval=EvalConfig(enabled=False))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=64, help="batching.max_batch_tokens: tokens a step takes (chunked prefill)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quant", default="none", choices=["none", "int8-dynamic"])
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    load = lambda: " ".join(open("/proc/loadavg").read().split()[:3])  # noqa: E731
    start, load0, t0 = datetime.datetime.now(datetime.timezone.utc), load(), time.perf_counter()
    names = ("default", "cpp")
    res = dict(zip(names, run_interleaved([trial(n, a) for n in names], a.rounds,
                                          progress=lambda m: print(f"  {m}", file=sys.stderr, flush=True))))
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"Machine: {cpu}, {os.cpu_count()} CPUs; torch {torch.__version__}; {a.threads} threads.  ")
    print(f"Run: {start:%Y-%m-%d %H:%M} UTC, {time.perf_counter() - t0:.0f} s, load {load0} -> {load()}; {MODEL['name']} "
          f"{a.dtype} activations, quant {a.quant}, {a.requests} requests at once (64 + 32-256 prompt tokens, 16-64 new), "
          f"chunked prefill {a.chunk} tokens a step, {a.rounds} interleaved rounds.\n")
    print("| engine.prefill | " + " | ".join(h for _, h, _ in METRICS) + " |")
    print("|---|" + "---|" * len(METRICS))
    for n, r in res.items():
        cells = []
        for key, _, _ in METRICS:
            s = r.samples.get(key) or [r.metrics.get(key, float("nan"))]
            sp = spread(s)
            cells.append(f"{sp.median:.1f} [{sp.ci_lo:.1f}, {sp.ci_hi:.1f}]")
        print(f"| {n} | " + " | ".join(cells) + " |")
    print("\n| cpp vs default | ratio (median of per-round ratios) [95% CI] |")
    print("|---|---|")
    for key, head, higher in METRICS:
        base, new = res["default"].samples.get(key), res["cpp"].samples.get(key)
        if not base or not new:
            continue
        pr = paired_ratio(base, new) if higher else paired_ratio(new, base)  # > 1: cpp better
        if pr is not None:
            print(f"| {head} ({'higher' if higher else 'lower'} is better; > 1: cpp better) | x{pr.value:.2f} [{pr.lo:.2f}, {pr.hi:.2f}] |")
    same = res["default"].token_ids == res["cpp"].token_ids
    print(f"\nGreedy tokens of every request equal between the two: {'yes' if same else 'no'}")


if __name__ == "__main__":
    main()
