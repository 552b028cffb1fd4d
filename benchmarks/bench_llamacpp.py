"""engine=llamacpp on SmolLM2-135M: decode speed per GGUF weight type, side by side with hf fp32.

All through `engine.run_engine_trial` (warm-up first, medians of the timed repeats), batch 1, flash
attention on for llama.cpp (sdpa for hf), greedy, eval off. Decode tok/s = 1000 / tpot_ms. Each row runs
in its own process, so peak RSS is that configuration's alone (a freed HF model stays in the RSS of the
process that held it). Prints a Markdown table; speed claims are the ratios to hf measured in the same run.
On a machine shared with other work, use --threads 1: llama.cpp's threads spin at barriers, and with a
core taken by another process two threads decode 2-5x slower than one (measured here under load).

    python benchmarks/bench_llamacpp.py                       # F32, Q8_0, Q4_K_M + hf, context 512, 32 tokens
    python benchmarks/bench_llamacpp.py --levels none --context 128 --repeats 1   # smoke
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine import (  # noqa: E402
    AttentionConfig,
    EngineConfig,
    EvalConfig,
    KVCacheConfig,
    ModelConfig,
    QuantConfig,
    TrialConfig,
    WorkloadConfig,
    run_engine_trial,
)

MODEL = ModelConfig(name="smollm2-135m-instruct", path="prepared://smollm2-135m-instruct")
NAMES = {"none": "F32", "gguf-q8_0": "Q8_0", "gguf-q4_0": "Q4_0", "gguf-q4_k_m": "Q4_K_M"}


def measure(kind: str, level: str, args) -> dict[str, float]:
    llamacpp = kind != "hf"
    trial = TrialConfig(model=MODEL, quant=QuantConfig(level=level),
                        engine=EngineConfig(backend="llamacpp" if llamacpp else "hf", threads=args.threads),
                        attention=AttentionConfig(impl="flash" if llamacpp else "sdpa"),
                        kv_cache=KVCacheConfig(dtype=args.kv if llamacpp else "auto"),
                        workload=WorkloadConfig(context_len=args.context, max_new_tokens=args.new_tokens, batch_size=1,
                                                warmup=1, repeats=args.repeats),
                        eval=EvalConfig(enabled=False))
    return run_engine_trial(trial, progress=lambda msg: print("  ", msg, file=sys.stderr)).metrics


def run_row(kind: str, level: str, args) -> dict[str, float]:
    """One configuration in a fresh process; its metrics come back as JSON on the last stdout line."""
    cmd = [sys.executable, __file__, "--one", f"{kind}:{level}", "--context", str(args.context), "--new-tokens",
           str(args.new_tokens), "--repeats", str(args.repeats), "--threads", str(args.threads), "--kv", args.kv]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", help=argparse.SUPPRESS)  # kind:level, run in this process (the child)
    ap.add_argument("--levels", default="none,gguf-q8_0,gguf-q4_k_m")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv", default="auto", help="kv_cache.dtype of the llama.cpp rows")
    ap.add_argument("--no-hf", action="store_true", help="skip the hf fp32 baseline")
    args = ap.parse_args()
    if args.one:
        kind, level = args.one.split(":")
        print(json.dumps(measure(kind, level, args)))
        return
    rows = []
    if not args.no_hf:
        rows.append(("hf fp32 sdpa", run_row("hf", "none", args)))
    for level in args.levels.split(","):
        rows.append((f"llamacpp {NAMES[level]} flash kv={args.kv}", run_row("llamacpp", level, args)))
    base = rows[0][1] if not args.no_hf else None
    print(f"\nSmolLM2-135M, batch 1, context {args.context}, {args.new_tokens} new tokens, {args.threads} threads, "
          f"median of {args.repeats}\n")
    print("| engine / weights | decode tok/s | x hf | ttft ms | prefill tok/s | weights MB | peak RSS MB |")
    print("|---|---|---|---|---|---|---|")
    for name, m in rows:
        dec = 1000.0 / m["tpot_ms_p50"]
        ratio = f"{dec / (1000.0 / base['tpot_ms_p50']):.2f}" if base else "-"
        print(f"| {name} | {dec:.1f} | {ratio} | {m['ttft_ms_p50']:.0f} | {m['prefill_tok_s']:.0f} | "
              f"{m['weights_bytes'] / 1e6:.0f} | {m['peak_mem_bytes'] / 1e6:.0f} |")


if __name__ == "__main__":
    main()
