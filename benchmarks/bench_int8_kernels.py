"""Weight-only matmul kernels side by side at SmolLM2-135M's shapes (issue 28): ms per call and weight GB/s.

    python benchmarks/bench_int8_kernels.py [--threads 2] [--rows 1,4,128] [--rounds 5]

Kernels: `fp32` and `bf16` (F.linear, the float baselines), `dequant` (cast int8 -> float, GEMM, scale: the
`quant.kernel=dequant` path), `int8pack` (torch._weight_int8pack_mm), `gemv` (our fused dequantize-GEMV,
engine/quant_kernels.py, `quant.kernel=gemv`) and `int4-gemv` (the same for packed INT4, groups of 32;
`quant=int4-weight`). Shapes: the LM head (576 -> 49152) and a layer's projections (576 <-> 1536, 576 -> 576, 576 -> 192).
Every kernel is timed interleaved (round-robin, median of N rounds) so machine noise hits all alike; the
int8 kernels must agree with the dequantized reference (max |difference| printed).
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from engine import quant_kernels as qk
from engine.quant import quantize_per_channel

SHAPES = [(576, 49152), (576, 1536), (1536, 576), (576, 576), (576, 192)]  # (in, out): LM head, up/gate, down, q/o, k/v
BYTES = {"fp32": 4, "bf16": 2, "dequant": 1, "int8pack": 1, "gemv": 1, "int4-gemv": 0.5 + 4 / 32}


def _time(fn, min_s: float = 0.05) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while (el := time.perf_counter() - t0) < min_s:
        fn()
        n += 1
    return el / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,4,128")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--kernels", default=",".join(BYTES))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    kernels = a.kernels.split(",")
    load0 = open("/proc/loadavg").read().split()[:3]
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {a.threads} thread(s), "
          f"own kernels: {qk.isa()}, median of {a.rounds} interleaved rounds, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, load {' '.join(load0)}\n")
    print("| in -> out | rows | " + " | ".join(f"{k} ms (GB/s)" for k in kernels) + " | gemv / fp32 | gemv / bf16 | max abs diff gemv |")
    print("|---|---:|" + "---:|" * len(kernels) + "---:|---:|---:|")
    for i, o in SHAPES:
        w = torch.randn(o, i) * 0.02
        wb = w.bfloat16()
        q, s = quantize_per_channel(w)
        p4, s4 = qk.quantize_int4(w)
        for m in (int(r) for r in a.rows.split(",")):
            x = torch.randn(m, i)
            fns = {
                "fp32": lambda: F.linear(x, w),
                "bf16": lambda: F.linear(x.bfloat16(), wb),
                "dequant": lambda: F.linear(x, q.to(x.dtype)) * s,
                "int8pack": lambda: torch._weight_int8pack_mm(x, q, s),
                "gemv": lambda: qk.int8_gemv(x, q, s),
                "int4-gemv": lambda: qk.int4_gemv(x, p4, s4, i),
            }
            fns = {k: fns[k] for k in kernels}
            times: dict[str, list[float]] = {k: [] for k in fns}
            for _ in range(a.rounds):
                for k, fn in fns.items():
                    times[k].append(_time(fn))
            t = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            diff = (qk.int8_gemv(x, q, s) - F.linear(x, q.float()) * s).abs().max().item()
            cells = " | ".join(f"{t[k]:.3f} ({o * i * BYTES[k] / t[k] / 1e6:.1f})" for k in kernels)
            r32 = f"x{t['fp32'] / t['gemv']:.2f}" if "fp32" in t and "gemv" in t else "-"
            r16 = f"x{t['bf16'] / t['gemv']:.2f}" if "bf16" in t and "gemv" in t else "-"
            print(f"| {i} -> {o} | {m} | {cells} | {r32} | {r16} | {diff:.1e} |", flush=True)
    print(f"\nload at end: {' '.join(open('/proc/loadavg').read().split()[:3])}")


if __name__ == "__main__":
    main()
