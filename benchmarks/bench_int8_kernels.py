"""Weight-only INT8 matmul kernels side by side: fp32 GEMM vs dequant-then-GEMM vs torch._weight_int8pack_mm.

    python benchmarks/bench_int8_kernels.py [--threads 1] [--rows 1,8,128,2048]

For SmolLM2-135M's projection shapes (576 -> 1536 up/gate, 1536 -> 576 down, 576 -> 576 q/o), each kernel
is timed interleaved (round-robin, median of N rounds) so machine noise hits all three alike; the table
gives ms per call and the ratio to fp32. The two INT8 kernels must agree (max |difference| printed).
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from engine.quant import quantize_per_channel

SHAPES = [(576, 1536), (1536, 576), (576, 576)]  # (in, out)


def _time(fn, min_s: float = 0.05) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while (el := time.perf_counter() - t0) < min_s:
        fn()
        n += 1
    return el / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,8,32,128,512,2048")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {a.threads} thread(s), "
          f"median of {a.rounds} interleaved rounds\n")
    print("| in -> out | rows | fp32 ms | dequant ms | int8pack ms | dequant / fp32 | int8pack / fp32 | int8pack / dequant | max abs diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for i, o in SHAPES:
        w = torch.randn(o, i) * 0.02
        q, s = quantize_per_channel(w)
        for m in (int(r) for r in a.rows.split(",")):
            x = torch.randn(m, i)
            fns = {
                "fp32": lambda: F.linear(x, w),
                "dequant": lambda: F.linear(x, q.to(x.dtype)) * s,
                "int8pack": lambda: torch._weight_int8pack_mm(x, q, s),
            }
            times: dict[str, list[float]] = {k: [] for k in fns}
            for _ in range(a.rounds):
                for k, fn in fns.items():
                    times[k].append(_time(fn))
            t = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            diff = (fns["dequant"]() - fns["int8pack"]()).abs().max().item()
            print(f"| {i} -> {o} | {m} | {t['fp32']:.3f} | {t['dequant']:.3f} | {t['int8pack']:.3f} | "
                  f"x{t['dequant'] / t['fp32']:.2f} | x{t['int8pack'] / t['fp32']:.2f} | "
                  f"x{t['int8pack'] / t['dequant']:.1f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
