"""Where a token's time goes in the native engine's C++ decode step (engine.compile_mode=cpp, issue 36).

    python benchmarks/bench_native_cpp_profile.py [--threads 2] [--tokens 64] [--variants fp32,bf16,int8,w8a8,int4,int4q8]

SmolLM2-135M-Instruct (prepared), batch 1, a 128-token prompt, then `--tokens` greedy decode steps per variant, after
one untimed warm-up pass. The step's own profile (thread 0's wall time between the OpenMP region's barriers, so a
phase includes its wait for the slowest thread): qkv, attention (RoPE, scores, softmax, values, the KV write),
o_proj, gate_up (incl. the activation), down, head (final norm + LM head), outside (embedding, buffers, the
region's start). Per phase: ms per token, the weight bytes it streams and the GB/s that makes. Prints markdown.
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

from engine.config import (AttentionConfig, EngineConfig, KVCacheConfig, ModelConfig, QuantConfig,  # noqa: E402
                           TrialConfig)
from engine.engines import make_backend  # noqa: E402
from engine.models import load_model, weights_bytes  # noqa: E402

SMOL = dict(name="smollm2-135m-instruct", path="prepared://smollm2-135m-instruct")
VARIANTS = {  # name -> (dtype, quant)
    "fp32": ("float32", QuantConfig(kernel="gemv-all")),
    "bf16": ("bfloat16", QuantConfig(kernel="gemv-all")),
    "int8": ("float32", QuantConfig(level="int8-weight", kernel="gemv", skip_modules=[])),
    "w8a8": ("float32", QuantConfig(level="int8-dynamic", skip_modules=[])),
    "int4": ("float32", QuantConfig(level="int4-weight", kernel="gemv", skip_modules=[])),
    "int4q8": ("float32", QuantConfig(level="int4-weight", kernel="gemv-q8", skip_modules=[])),
}
PHASE_WEIGHTS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
                 "down": ("down_proj",), "head": ("lm_head",)}


def cpp_backend(model_kw: dict, dtype: str, quant: QuantConfig, threads: int):
    """The native engine with its C++ decode step (sdpa, contiguous KV cache) on a prepared model; also used by
    bench_cpp_step_load.py and bench_cpp_long_context.py."""
    model = ModelConfig(**model_kw, dtype=dtype)
    loaded = load_model(model, attention="sdpa", quant=quant)
    trial = TrialConfig(model=model, engine=EngineConfig(backend="native", compile=True, compile_mode="cpp",
                                                         threads=threads),
                        attention=AttentionConfig(impl="sdpa"), kv_cache=KVCacheConfig(mode="contiguous"), quant=quant)
    return make_backend(loaded, trial)


def phase_bytes(model: torch.nn.Module) -> dict[str, int]:
    out = {p: 0 for p in PHASE_WEIGHTS}
    for name, mod in model.named_modules():
        leaf = name.split(".")[-1]
        for p, leaves in PHASE_WEIGHTS.items():
            if leaf in leaves:
                out[p] += sum(b.numel() * b.element_size() for b in list(mod.parameters()) + list(mod.buffers()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    ids = torch.randint(3, 1000, (1, 128), generator=torch.Generator().manual_seed(0))
    load0 = open("/proc/loadavg").read().split()[:3]
    print(f"C++ step profile, SmolLM2-135M-Instruct, batch 1, context 128 + {a.tokens} tokens, {a.threads} threads, "
          f"load {' '.join(load0)}, {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, {os.cpu_count()} CPUs\n")
    phases = ("qkv", "attention", "o_proj", "gate_up", "down", "head", "outside")
    print("| variant | tok/s | " + " | ".join(f"{p} ms" for p in phases) + " | GEMV GB/s (qkv, o, gate_up, down, head) |")
    print("|---|---:|" + "---:|" * len(phases) + "---|")
    for name in a.variants.split(","):
        dtype, quant = VARIANTS[name]
        backend = cpp_backend(SMOL, dtype, quant, a.threads)
        step = backend.decode_step
        for timed in (False, True):
            session = backend.new_session(1, 128 + a.tokens + 1)
            with torch.inference_mode():
                tok = session.forward(ids)[:, -1:].argmax(-1)
                step.profile()  # reset
                t0 = time.perf_counter()
                for _ in range(a.tokens):
                    tok = session.forward(tok)[:, -1:].argmax(-1)
                wall = time.perf_counter() - t0
            prof = step.profile()
        nbytes = phase_bytes(backend.model)
        gbs = ", ".join(f"{nbytes[p] / (prof[p] / 1e3) / 1e9:.1f}" for p in PHASE_WEIGHTS)
        print(f"| {name} ({dtype}, {quant.level}{'' if quant.level == 'none' else ' ' + quant.kernel}) | "
              f"{a.tokens / wall:.1f} | " + " | ".join(f"{prof[p]:.2f}" for p in phases) + f" | {gbs} |")
        del backend
    print(f"\nload {' '.join(load0)} -> {' '.join(open('/proc/loadavg').read().split()[:3])}; weights bytes per phase "
          "from the modules' parameters and buffers (scales included)")


if __name__ == "__main__":
    main()
