"""Eager vs compiled-static native decode (issue 28, first slice): TPOT at batch 1, side by side.

For each dtype, one backend per compile mode (engine.compile_mode: eager = compile off, static,
static-autotune) on the same loaded weights; each backend's warm-up run pays its compile (reported as
compile_s, outside every timed run); then `--rounds` rounds, each running every mode once in turn
(interleaved, so load drift hits them alike). Per round the ratio eager TPOT / mode TPOT; the median and the
min-max of those ratios are reported, with each mode's median TPOT, the weight bytes it streams per token
and the GB/s that makes. Greedy tokens of every mode are compared with eager's.

    python benchmarks/bench_native_compiled.py                                   # SmolLM2 (prepared), fp32 + bf16
    python benchmarks/bench_native_compiled.py --random-from config.json         # same shapes, random weights
    python benchmarks/bench_native_compiled.py --device cuda --modes eager,static # CUDA graphs path
Prints a markdown table and a JSON line (`--json PATH` writes it too).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.config import AttentionConfig, EngineConfig, KVCacheConfig, ModelConfig, SamplingConfig, TrialConfig  # noqa: E402
from engine.engines import make_backend  # noqa: E402
from engine.generate import device_synchronizer, generate  # noqa: E402
from engine.models import LoadedModel, load_model, weights_bytes  # noqa: E402
from engine.tokenizer import ByteTokenizer  # noqa: E402


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def cpu_has(flag: str) -> bool:
    try:
        return any(flag in line.split() for line in open("/proc/cpuinfo") if line.startswith("flags"))
    except OSError:
        return False


def load(args, dtype: str, device: str) -> LoadedModel:
    if args.random_from:
        import transformers as tf

        d = json.loads(Path(args.random_from).read_text())
        cfg = tf.AutoConfig.for_model(d.pop("model_type"), **d)
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(cfg).to(getattr(torch, dtype)).to(device).eval()
        return LoadedModel(model=model, tokenizer=ByteTokenizer(), spec=ModelConfig(name="random", path="random", dtype=dtype),
                           load_s=0.0)
    return load_model(ModelConfig(name="m", path=args.model, dtype=dtype), attention="sdpa", device=device,
                      quant=quant_of(args))


def quant_of(args):
    """--quant LEVEL[:KERNEL] (e.g. none:gemv-all, int8-weight:gemv): our linears' level and decode kernel; the LM
    head is quantized too for the int levels (skip_modules=[]), as in bench_native_vs_llamacpp.py."""
    from engine.config import QuantConfig

    level, _, kernel = (args.quant or "none").partition(":")
    return QuantConfig(level=level, kernel=kernel or "dequant", skip_modules=[] if level != "none" else ["lm_head"])


def trial_for(loaded, mode: str):
    return TrialConfig(model=loaded.spec, attention=AttentionConfig(impl="sdpa"), kv_cache=KVCacheConfig(mode="contiguous"),
                       quant=loaded.quant,
                       engine=EngineConfig(backend="native", compile=mode != "eager",
                                           compile_mode="dynamic" if mode == "eager" else mode))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="prepared://smollm2-135m-instruct")
    ap.add_argument("--random-from", default="", help="a config.json: random weights of that shape (no checkpoint)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--modes", default="eager,static")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quant", default="", help="LEVEL[:KERNEL], e.g. none:gemv-all or int8-weight:gemv (default: none)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    modes = args.modes.split(",")
    assert modes[0] == "eager", "ratios are against eager: list it first"
    info = dict(cpu=cpu_model(), avx512_bf16=cpu_has("avx512_bf16"), amx_bf16=cpu_has("amx_bf16"), threads=args.threads,
                nproc=os.cpu_count(), loadavg=os.getloadavg(), torch=torch.__version__, device=args.device,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                model=args.random_from and f"random weights, shape of {args.random_from}" or args.model,
                context=args.context, new=args.new, rounds=args.rounds)
    if args.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    print(json.dumps(info), flush=True)
    results = {}
    for dtype in args.dtypes.split(","):
        loaded = load(args, dtype, args.device)
        sync = device_synchronizer(torch.device(args.device))
        wbytes = weights_bytes(loaded.model)
        prompt = torch.randint(3, 300, (1, args.context), generator=torch.Generator().manual_seed(0)).to(args.device)
        backends = {m: make_backend(loaded, trial_for(loaded, m)) for m in modes}

        def run(m):
            be = backends[m]
            s = be.new_session(1, args.context + args.new)
            return generate(s, prompt, args.new, SamplingConfig(), 0, sync)

        tokens, compile_s = {}, {}
        for m in modes:  # warm-up: compiles here, outside the timed rounds
            t0 = time.perf_counter()
            tokens[m] = run(m).tokens.cpu()
            compile_s[m] = round(time.perf_counter() - t0, 1)
            print(f"{dtype} {m}: warm-up {compile_s[m]} s", flush=True)
        tpot = {m: [] for m in modes}
        for r in range(args.rounds):
            for m in modes:
                tr = run(m)
                tpot[m].append(tr.decode_s / (args.new - 1) * 1e3)
            print(f"{dtype} round {r + 1}: " + ", ".join(f"{m} {tpot[m][-1]:.2f} ms" for m in modes), flush=True)
        row = {}
        for m in modes:
            ratios = [e / x for e, x in zip(tpot["eager"], tpot[m])]
            med = statistics.median(tpot[m])
            row[m] = dict(tpot_ms=round(med, 2), tpot_min_max=[round(min(tpot[m]), 2), round(max(tpot[m]), 2)],
                          speedup_vs_eager=round(statistics.median(ratios), 2),
                          speedup_min_max=[round(min(ratios), 2), round(max(ratios), 2)],
                          weight_gbs=round(wbytes / (med / 1e3) / 1e9, 2), warmup_s=compile_s[m],
                          compile_s=round(backends[m].extra_metrics().get("compile_s", 0.0), 1),
                          tokens_equal_eager=bool(torch.equal(tokens[m], tokens["eager"])),
                          cudagraphs=backends[m].extra_info().get("cudagraphs", "-"))
        results[dtype] = dict(weights_bytes=wbytes, modes=row)
    print("\n| dtype | mode | TPOT ms median (min-max) | x eager median (min-max) | weight GB/s | compile s | tokens = eager "
          "| CUDA graphs |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype, res in results.items():
        for m, r in res["modes"].items():
            print(f"| {dtype} | {m} | {r['tpot_ms']} ({r['tpot_min_max'][0]}-{r['tpot_min_max'][1]}) | "
                  f"x{r['speedup_vs_eager']} ({r['speedup_min_max'][0]}-{r['speedup_min_max'][1]}) | {r['weight_gbs']} | "
                  f"{r['compile_s']} | {r['tokens_equal_eager']} | {r['cudagraphs']} |")
    out = dict(info, end_loadavg=os.getloadavg(), results=results)
    print(json.dumps(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
