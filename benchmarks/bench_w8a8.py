"""W8A8 (int8-dynamic) kernel on many rows: the time of one `isw_w8a8_gemv` call at prefill / task-scoring shapes
against bf16 `F.linear` on the same shape, both interleaved call by call (median of 20 each; GOPS = 2 R K N / s).
Needs the compiled kernels (engine/quant_kernels.py builds them on first use).

    .venv/bin/python benchmarks/bench_w8a8.py [--rows 256] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    import torch
    import torch.nn.functional as F

    from engine import quant_kernels as qk
    from engine.quant import quantize_per_channel

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    lib = qk.load()
    if lib is None:
        raise SystemExit("the compiled kernels are not available here (engine/quant_kernels.py says why)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"kernels built for {lib.isa}; {args.threads} threads; rows {args.rows}")
    print("| K -> N | W8A8 ms | bf16 F.linear ms | W8A8 GOPS | W8A8 / bf16 |\n|---|---:|---:|---:|---:|")
    for k, n in ((576, 1536), (1536, 576), (576, 576)):  # SmolLM2-135M's MLP up, down, attention projections
        w = torch.randn(n, k) * 0.05
        q, s = quantize_per_channel(w)
        x, wb = torch.randn(args.rows, k), w.bfloat16()
        xb = x.bfloat16()
        y, xq, xs = torch.empty(args.rows, n), torch.empty(args.rows, k, dtype=torch.int8), torch.empty(args.rows)
        times: dict[str, list[float]] = {"w8a8": [], "bf16": []}
        for i in range(21):
            t = time.perf_counter()
            lib.isw_w8a8_gemv(x.data_ptr(), args.rows, k, xq.data_ptr(), xs.data_ptr(), q.data_ptr(), s.data_ptr(),
                              y.data_ptr(), n, qk.MIN_BYTES_PER_THREAD, args.threads)
            t1 = time.perf_counter()
            F.linear(xb, wb)
            t2 = time.perf_counter()
            if i:  # the first call of each warms up
                times["w8a8"].append(t1 - t)
                times["bf16"].append(t2 - t1)
        a, b = statistics.median(times["w8a8"]), statistics.median(times["bf16"])
        print(f"| {k} -> {n} | {a * 1e3:.2f} | {b * 1e3:.2f} | {2 * args.rows * k * n / a / 1e9:.0f} | {a / b:.2f} |")


if __name__ == "__main__":
    main()
