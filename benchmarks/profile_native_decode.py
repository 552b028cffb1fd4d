"""Where a native decode token's time goes (issue 28): torch.profiler over the decode steps of SmolLM2-135M.

    python benchmarks/profile_native_decode.py [--threads 1] [--tokens 16] [--variants fp32,bf16,fp32-gemv,bf16-gemv,int8-gemv,int4-gemv]

Per variant: prefill 128 tokens (not profiled), then profile `--tokens` decode steps (eager native engine,
batch 1). Every op's self CPU time is put in one bucket: `gemv` (matmuls: aten::mm/addmm/linear's kernels and
our infersweep::*_gemv, which the profile routes through their custom ops so the profiler sees them),
`attention` (sdpa), `other ops` (norms, RoPE, elementwise, copies, sampling); `python/framework` = wall time
- the sum of op self times (interpreter, module calls, dispatch). Reported per token in ms.
"""
from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine import quant_kernels as qk  # noqa: E402
from engine.config import (AttentionConfig, EngineConfig, KVCacheConfig, ModelConfig, QuantConfig,  # noqa: E402
                           SamplingConfig, TrialConfig, replace)
from engine.engines import make_backend  # noqa: E402
from engine.generate import stream  # noqa: E402
from engine.models import load_model  # noqa: E402

SMOL = ModelConfig(name="smollm2-135m-instruct", path="prepared://smollm2-135m-instruct")
QUANTS = {  # name -> (model dtype, quant)
    "fp32": ("float32", QuantConfig()),
    "bf16": ("bfloat16", QuantConfig()),
    "fp32-gemv": ("float32", QuantConfig(kernel="gemv-all")),
    "bf16-gemv": ("bfloat16", QuantConfig(kernel="gemv-all")),
    "int8-gemv": ("float32", QuantConfig(level="int8-weight", kernel="gemv", skip_modules=[])),
    "int4-gemv": ("float32", QuantConfig(level="int4-weight", kernel="gemv", skip_modules=[])),
}
GEMV = ("aten::mm", "aten::addmm", "aten::bmm", "infersweep::", "aten::_weight_int8pack_mm")
ATTN = ("scaled_dot_product", "flash_attention")


def bucket(name: str) -> str:
    if any(name.startswith(g) for g in GEMV):
        return "gemv" if name != "aten::bmm" else "attention"
    if any(a in name for a in ATTN):
        return "attention"
    return "other ops"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--variants", default=",".join(QUANTS))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if qk.load() is not None:  # eager calls bypass the dispatcher; here they go through it, so they are seen
        qk._entry = lambda i, device: qk._OPS[i] if device.type == "cpu" else None
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, load "
          f"{' '.join(open('/proc/loadavg').read().split()[:3])}, {a.threads} thread(s), {a.tokens} decode steps\n")
    print("| variant | wall ms/token | gemv | attention | other ops | python/framework | top other ops (ms/token) |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name in a.variants.split(","):
        dtype, quant = QUANTS[name]
        spec = replace(SMOL, "dtype", dtype)
        loaded = load_model(spec, "sdpa", quant=quant)
        trial = TrialConfig(model=spec, engine=EngineConfig(backend="native", threads=a.threads),
                            attention=AttentionConfig(impl="sdpa"), kv_cache=KVCacheConfig(mode="contiguous"),
                            quant=quant)
        backend = make_backend(loaded, trial)
        prompt = torch.randint(100, 20000, (1, 128), generator=torch.Generator().manual_seed(0))
        for rep in range(2):  # the first pass warms caches and allocators
            session = backend.new_session(1, 128 + a.tokens + 1)
            it = stream(session, prompt, a.tokens + 1, SamplingConfig(temperature=0.0),
                        torch.Generator().manual_seed(0), lambda: None)
            with torch.inference_mode():
                next(it)  # prefill + first token: not profiled
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                if rep:
                    prof.start()
                t0 = time.perf_counter()
                for _ in it:
                    pass
                wall = time.perf_counter() - t0
                if rep:
                    prof.stop()
        sums = {"gemv": 0.0, "attention": 0.0, "other ops": 0.0}
        other: dict[str, float] = {}
        for e in prof.key_averages():
            b = bucket(e.key)
            sums[b] += e.self_cpu_time_total / 1e3
            if b == "other ops":
                other[e.key] = other.get(e.key, 0.0) + e.self_cpu_time_total / 1e3
        n = a.tokens
        py = wall * 1e3 - sum(sums.values())
        top = ", ".join(f"{k} {v / n:.1f}" for k, v in sorted(other.items(), key=lambda kv: -kv[1])[:4])
        print(f"| {name} | {wall * 1e3 / n:.1f} | {sums['gemv'] / n:.1f} | {sums['attention'] / n:.1f} | "
              f"{sums['other ops'] / n:.1f} | {py / n:.1f} | {top} |", flush=True)
    print(f"\nload at end {' '.join(open('/proc/loadavg').read().split()[:3])}")


if __name__ == "__main__":
    main()
