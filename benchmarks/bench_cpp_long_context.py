"""The C++ decode step at long context (issue 42 item 2): attention split along the sequence (flash-decoding, the
default from 256 positions) against the same step with attention split by query heads only, side by side.

    python benchmarks/bench_cpp_long_context.py [--contexts 1024,4096] [--rounds 5] [--tokens 16] [--threads 2]
                                                [--variants fp32,bf16] [--shape smollm2|gemma3]

The prepared SmolLM2-135M-Instruct (or Gemma 3 270M: `--shape gemma3`), batch 1: one prefill of `context` tokens per
variant and context (torch), then rounds in which each mode decodes `--tokens` greedy tokens continuing the same
sequence, the modes' order alternating by round (the context grows by rounds x modes x tokens: < 5% at 4k). Prints
markdown: decode tok/s medians with 95% intervals and the paired per-round ratio split / heads
(engine/measure/spread.py's paired_ratio).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_native_cpp_profile import SMOL, VARIANTS, cpp_backend  # noqa: E402

from engine.measure.spread import paired_ratio, spread  # noqa: E402

SHAPES = {"smollm2": SMOL, "gemma3": dict(name="gemma-3-270m", path="prepared://gemma-3-270m")}
MODES = {"split": (256, 64), "heads": (0, 64)}  # isw_set_split: from 256 positions (the default), never


def decode(session, tok: torch.Tensor, tokens: int) -> tuple[float, torch.Tensor]:
    with torch.inference_mode():
        t0 = time.perf_counter()
        for _ in range(tokens):
            tok = session.forward(tok)[:, -1:].argmax(-1)
        return tokens / (time.perf_counter() - t0), tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", default="fp32,bf16")
    ap.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"C++ step at long context, {SHAPES[a.shape]['name']}, batch 1, {a.threads} threads, {a.rounds} rounds of "
          f"{a.tokens} tokens per mode, load {' '.join(open('/proc/loadavg').read().split()[:3])}, "
          f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, {os.cpu_count()} CPUs\n")
    print("| variant | context | split tok/s | heads tok/s | split / heads (paired) |")
    print("|---|---:|---:|---:|---:|")
    t_start = time.perf_counter()
    for name in a.variants.split(","):
        dtype, quant = VARIANTS[name]
        backend = cpp_backend(SHAPES[a.shape], dtype, quant, a.threads)
        lib = backend.decode_step.lib
        for ctx in (int(c) for c in a.contexts.split(",")):
            ids = torch.randint(3, 1000, (1, ctx), generator=torch.Generator().manual_seed(ctx))
            session = backend.new_session(1, ctx + 2 * a.tokens * (a.rounds + 1) + 2)
            with torch.inference_mode():
                tok = session.forward(ids)[:, -1:].argmax(-1)
            _, tok = decode(session, tok, 2)  # warm
            samples: dict[str, list[float]] = {m: [] for m in MODES}
            for r in range(a.rounds):
                for mode in (list(MODES) if r % 2 == 0 else list(MODES)[::-1]):
                    lib.isw_set_split(*MODES[mode])
                    v, tok = decode(session, tok, a.tokens)
                    samples[mode].append(v)
            lib.isw_set_split(*MODES["split"])
            s, h, rr = spread(samples["split"]), spread(samples["heads"]), paired_ratio(samples["heads"], samples["split"])
            print(f"| {name} ({dtype}) | {ctx} | {s.median:.1f} [{s.ci_lo:.1f}, {s.ci_hi:.1f}] | "
                  f"{h.median:.1f} [{h.ci_lo:.1f}, {h.ci_hi:.1f}] | x{rr.value:.2f} [{rr.lo:.2f}, {rr.hi:.2f}] |",
                  flush=True)
        del backend
    print(f"\n{time.perf_counter() - t_start:.0f} s; load after {' '.join(open('/proc/loadavg').read().split()[:3])}")


if __name__ == "__main__":
    main()
