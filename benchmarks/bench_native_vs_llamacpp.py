"""Issues 28 and 36's goals tables: the native engine (fp32, bf16, weight-only INT8 / INT4, W8A8, INT4 x Q8_0; eager
or with the decode step in C++, the `-cpp` variants) against llama.cpp (f32, Q8_0, Q4_0), interleaved in one process
on one machine.

    python benchmarks/bench_native_vs_llamacpp.py [--rounds 5] [--threads 2] [--variants a,b,...] [--json PATH]
                                                  [--shape smollm2|gemma3|1b]

Every variant is a trial of the platform (engine.run_interleaved: each warms up, then every round runs one
timed repeat of each, ABBA order), SmolLM2-135M-Instruct (the prepared checkpoint), batch 1 (`--batch B`: B sequences decoded together), context 128,
32 new tokens, greedy, the same engine.threads for all. Reported per variant: decode tok/s (median of the
rounds, 95% interval of the median), TPOT, the share of the cost model's bandwidth roofline
(`roofline_decode_efficiency`: predicted decode time / measured), and the goals' ratios as per-round paired
ratios with their intervals (engine.measure.spread.paired_ratio). The weight-only levels quantize the LM head
too (quant.skip_modules=[]), as llama.cpp's Q8_0 / Q4_0 do; `native-int8-dequant` is the level as it ran
before (quant.kernel=dequant, LM head fp32). Prints markdown and a JSON line; machine, load and date included.

`--shape gemma3` (issue 36's model-size row): the same table on the prepared Gemma 3 270M (`model=gemma-3-270m`,
18 layers, a 262k vocabulary whose tied LM head is ~2/3 of the weights), against the GGUFs engine=llamacpp
re-exports from that checkpoint (quant.level none -> F32, gguf-q8_0, gguf-q4_0); llama.cpp's F32 re-export is the
fp32 reference of its goals (Gemma 3 270M: native fp32 >= x0.8 of it). Its default context (128) stays inside the
sliding window (512).
"""
from __future__ import annotations

import argparse
import datetime
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

from engine import run_interleaved  # noqa: E402
from engine.config import (AttentionConfig, EngineConfig, EvalConfig, KVCacheConfig, ModelConfig,  # noqa: E402
                           QuantConfig, TinyModelConfig, TrialConfig, WorkloadConfig)
from engine.measure.spread import paired_ratio, spread  # noqa: E402

SMOL = dict(name="smollm2-135m-instruct", path="prepared://smollm2-135m-instruct")
# --shape 1b: a random-weight Llama of ~1B parameters built in memory (Llama 3.2 1B's layer shape, 16 layers, a 32k
# vocabulary; issue 36's scaling row): native variants only (llama.cpp has no GGUF of it)
GEMMA = dict(name="gemma-3-270m", path="prepared://gemma-3-270m")
SHAPES = {"smollm2": SMOL,
          "gemma3": GEMMA,
          "1b": dict(name="llama-1b-random", path="tiny://llama", tiny=TinyModelConfig(
              num_layers=16, hidden_size=2048, intermediate_size=8192, num_heads=32, num_kv_heads=8, vocab_size=32000,
              max_position_embeddings=4096, tie_word_embeddings=True))}
ALL = {  # name -> (backend, model dtype, attention, quant[, engine.compile_mode with engine.compile=true])
    "native-fp32": ("native", "float32", "sdpa", QuantConfig()),
    "native-bf16": ("native", "bfloat16", "sdpa", QuantConfig()),
    "native-fp32-gemv": ("native", "float32", "sdpa", QuantConfig(kernel="gemv-all")),
    "native-bf16-gemv": ("native", "bfloat16", "sdpa", QuantConfig(kernel="gemv-all")),
    "native-int8-dequant": ("native", "float32", "sdpa", QuantConfig(level="int8-weight", kernel="dequant")),
    "native-int8-gemv": ("native", "float32", "sdpa", QuantConfig(level="int8-weight", kernel="gemv", skip_modules=[])),
    "native-int4-gemv": ("native", "float32", "sdpa", QuantConfig(level="int4-weight", kernel="gemv", skip_modules=[])),
    "native-w8a8": ("native", "float32", "sdpa", QuantConfig(level="int8-dynamic", skip_modules=[])),
    "native-int4q8-gemv": ("native", "float32", "sdpa", QuantConfig(level="int4-weight", kernel="gemv-q8", skip_modules=[])),
    # issue 36: the same levels with the decode step in C++ (engine.compile=true engine.compile_mode=cpp)
    "native-fp32-cpp": ("native", "float32", "sdpa", QuantConfig(kernel="gemv-all"), "cpp"),
    "native-bf16-cpp": ("native", "bfloat16", "sdpa", QuantConfig(kernel="gemv-all"), "cpp"),
    "native-int8-cpp": ("native", "float32", "sdpa", QuantConfig(level="int8-weight", kernel="gemv", skip_modules=[]), "cpp"),
    "native-w8a8-cpp": ("native", "float32", "sdpa", QuantConfig(level="int8-dynamic", skip_modules=[]), "cpp"),
    "native-int4-cpp": ("native", "float32", "sdpa", QuantConfig(level="int4-weight", kernel="gemv", skip_modules=[]), "cpp"),
    "native-int4q8-cpp": ("native", "float32", "sdpa", QuantConfig(level="int4-weight", kernel="gemv-q8", skip_modules=[]), "cpp"),
    # issue 42 item 2: the C++ step over a bf16 K/V cache (kv_cache.dtype=bfloat16; llama.cpp's default K/V is f16)
    "native-fp32-cpp-kvbf16": ("native", "float32", "sdpa", QuantConfig(kernel="gemv-all"), "cpp"),
    "native-w8a8-cpp-kvbf16": ("native", "float32", "sdpa", QuantConfig(level="int8-dynamic", skip_modules=[]), "cpp"),
    # issue 42 item 1: the prompt through the C++ step as well (engine.prefill=cpp)
    "native-fp32-cpp-pf": ("native", "float32", "sdpa", QuantConfig(kernel="gemv-all"), "cpp"),
    "native-bf16-cpp-pf": ("native", "bfloat16", "sdpa", QuantConfig(kernel="gemv-all"), "cpp"),
    "native-w8a8-cpp-pf": ("native", "float32", "sdpa", QuantConfig(level="int8-dynamic", skip_modules=[]), "cpp"),
    "llamacpp-f32": ("llamacpp", "float32", "flash", QuantConfig()),
    "llamacpp-q8_0": ("llamacpp", "float32", "flash", QuantConfig(level="gguf-q8_0")),
    "llamacpp-q4_0": ("llamacpp", "float32", "flash", QuantConfig(level="gguf-q4_0")),
}
KV_DTYPE = {"native-fp32-cpp-kvbf16": "bfloat16", "native-w8a8-cpp-kvbf16": "bfloat16"}  # kv_cache.dtype, else auto
PREFILL = {n: "cpp" for n in ALL if n.endswith("-cpp-pf")}  # engine.prefill, else default (torch's GEMMs)
# (label, new, base, goal): the prefill goals, as ratios of prefill tok/s (one interleaved group)
PREFILL_GOALS = [
    ("native fp32 (torch's GEMMs) vs llama.cpp f32", "native-fp32", "llamacpp-f32", ">= x1.0"),
    ("native fp32, C++ prefill vs llama.cpp f32", "native-fp32-cpp-pf", "llamacpp-f32", ">= x1.0"),
    ("native fp32, C++ prefill vs torch's", "native-fp32-cpp-pf", "native-fp32", "-"),
    ("native bf16 vs native fp32 (torch's GEMMs)", "native-bf16", "native-fp32", ">= x1.6"),
    ("native bf16 vs fp32, both C++ prefill", "native-bf16-cpp-pf", "native-fp32-cpp-pf", ">= x1.6"),
    ("native W8A8, C++ prefill vs llama.cpp Q8_0", "native-w8a8-cpp-pf", "llamacpp-q8_0", ">= x1.0"),
    ("native W8A8, torch-side prefill vs llama.cpp Q8_0", "native-w8a8-cpp", "llamacpp-q8_0", ">= x1.0"),
    ("native W8A8, C++ prefill vs torch-side", "native-w8a8-cpp-pf", "native-w8a8-cpp", "-"),
]
# (label, new, base, goal): the issue's goals table, as ratios of decode tok/s
GOALS = [
    ("native fp32 vs llama.cpp f32", "native-fp32", "llamacpp-f32", ">= x0.8"),
    ("native fp32, our dense GEMV (gemv-all) vs llama.cpp f32", "native-fp32-gemv", "llamacpp-f32", ">= x0.8"),
    ("native fp32, our dense GEMV vs torch's", "native-fp32-gemv", "native-fp32", "-"),
    ("native INT8 (gemv) vs native fp32", "native-int8-gemv", "native-fp32", ">= x1.8"),
    ("native INT8 (gemv) vs llama.cpp Q8_0", "native-int8-gemv", "llamacpp-q8_0", ">= x0.8"),
    ("native INT8 before (dequant) vs native fp32", "native-int8-dequant", "native-fp32", "-"),
    ("native INT4 (gemv) vs native fp32", "native-int4-gemv", "native-fp32", ">= x2.5"),
    ("native INT4 (gemv) vs llama.cpp Q4_0", "native-int4-gemv", "llamacpp-q4_0", ">= x0.7"),
    ("native bf16 vs native fp32", "native-bf16", "native-fp32", ">= x1.8"),
    ("native bf16 vs fp32, both our dense GEMV", "native-bf16-gemv", "native-fp32-gemv", ">= x1.8"),
    ("native bf16, our dense GEMV vs native fp32 (torch's)", "native-bf16-gemv", "native-fp32", "-"),
    # issue 36: the C++ decode step
    ("native fp32, C++ step vs llama.cpp f32", "native-fp32-cpp", "llamacpp-f32", ">= x0.9"),
    ("native INT8 weight-only, C++ step vs llama.cpp Q8_0", "native-int8-cpp", "llamacpp-q8_0", ">= x0.9"),
    ("native W8A8, C++ step vs llama.cpp Q8_0", "native-w8a8-cpp", "llamacpp-q8_0", ">= x0.9"),
    ("native INT4, C++ step vs llama.cpp Q4_0", "native-int4-cpp", "llamacpp-q4_0", ">= x0.8"),
    ("native INT4 x Q8_0, C++ step vs llama.cpp Q4_0", "native-int4q8-cpp", "llamacpp-q4_0", ">= x0.8"),
    ("native bf16 vs fp32, both C++ step", "native-bf16-cpp", "native-fp32-cpp", ">= x1.6"),
    ("C++ step vs eager, fp32 (both gemv-all)", "native-fp32-cpp", "native-fp32-gemv", "-"),
    ("C++ step vs eager, bf16 (both gemv-all)", "native-bf16-cpp", "native-bf16-gemv", "-"),
    ("C++ step vs eager, INT8 weight-only", "native-int8-cpp", "native-int8-gemv", "-"),
    ("C++ step vs eager, W8A8", "native-w8a8-cpp", "native-w8a8", "-"),
    ("C++ step vs eager, INT4", "native-int4-cpp", "native-int4-gemv", "-"),
    ("C++ step vs eager, INT4 x Q8_0", "native-int4q8-cpp", "native-int4q8-gemv", "-"),
    ("native W8A8 vs INT8 weight-only, both C++ step", "native-w8a8-cpp", "native-int8-cpp", "-"),
    # issue 42 item 2: long context with the K/V cache in bf16 (2 bytes an element, as llama.cpp's f16 K/V)
    ("native fp32 + bf16 K/V, C++ step vs llama.cpp f32 (f16 K/V)", "native-fp32-cpp-kvbf16", "llamacpp-f32", ">= x1.0"),
    ("native W8A8 + bf16 K/V, C++ step vs llama.cpp Q8_0 (f16 K/V)", "native-w8a8-cpp-kvbf16", "llamacpp-q8_0", ">= x1.0"),
    ("bf16 K/V vs fp32 K/V, C++ step fp32", "native-fp32-cpp-kvbf16", "native-fp32-cpp", "-"),
    ("bf16 K/V vs fp32 K/V, C++ step W8A8", "native-w8a8-cpp-kvbf16", "native-w8a8-cpp", "-"),
    ("native INT4 x Q8_0 vs INT4 weight-only, both C++ step", "native-int4q8-cpp", "native-int4-cpp", "-"),
]

# per shape: how the goals' labels name the model and llama.cpp's references (the GGUFs engine=llamacpp re-exports
# from the prepared Gemma 3 checkpoint: F32 is the fp32 reference)
LABELS = {"gemma3": ("Gemma 3 270M: ", {"llama.cpp f32": "llama.cpp F32 re-export", "llama.cpp Q8_0": "llama.cpp Q8_0 re-export",
                                        "llama.cpp Q4_0": "llama.cpp Q4_0 re-export"})}


def goal_label(label: str, shape: str) -> str:
    """`label` as --shape names its model and llama.cpp references (unchanged for smollm2 and 1b)."""
    if shape not in LABELS:
        return label
    prefix, names = LABELS[shape]
    for old, new in names.items():
        label = label.replace(old, new)
    return prefix + label


# each C++-step variant and the eager variant with the same weights and kernels
EAGER_TWIN = {"native-fp32-cpp": "native-fp32-gemv", "native-bf16-cpp": "native-bf16-gemv", "native-int8-cpp": "native-int8-gemv",
              "native-w8a8-cpp": "native-w8a8", "native-int4-cpp": "native-int4-gemv", "native-int4q8-cpp": "native-int4q8-gemv"}


def cpu_model() -> str:
    try:
        return next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    try:
        return set(next(ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return set()


def ppl_cell(ppl) -> str:
    return "-" if ppl is None else f"{ppl:.2f}"


def load() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def runnable(names: list[str], flags: set[str]) -> list[str]:
    """`names` without the bf16 variants on a CPU without bf16 units (torch would emulate bf16), saying so."""
    if "avx512_bf16" in flags or "amx_bf16" in flags:
        return names
    for n in names:
        if ALL[n][1] == "bfloat16":
            print(f"no avx512_bf16 on this CPU: {n} left out (torch would emulate bf16)")
    return [n for n in names if ALL[n][1] != "bfloat16"]


MODEL = SMOL  # what --shape picked
PPL = True  # the ppl column (--ppl-up-to): 2 windows of the context, their logits [context, vocab] at once


def trial(name: str, threads: int, wl: WorkloadConfig) -> TrialConfig:
    backend, dtype, attn, quant, *mode = ALL[name]
    engine = EngineConfig(backend=backend, threads=threads)
    if mode:  # a compiled decode step (issue 36: cpp)
        engine = EngineConfig(backend=backend, threads=threads, compile=True, compile_mode=mode[0],
                              prefill=PREFILL.get(name, "default"))
    kv = KVCacheConfig(dtype=KV_DTYPE.get(name, "auto"))
    return TrialConfig(model=ModelConfig(**MODEL, dtype=dtype), engine=engine, kv_cache=kv,
                       attention=AttentionConfig(impl=attn), quant=quant, workload=wl, eval=EvalConfig(enabled=PPL))


def goal_row(label: str, base: list[float], new: list[float], goal: str):
    """One goals-table row: the paired ratio new / base (median of per-round ratios, its 95% interval) against
    `goal` (">= xR", or "-" for none), printed; its record, or None where the samples do not pair."""
    pr = paired_ratio(base, new)
    if pr is None:
        return None
    met = "-" if goal == "-" else ("yes" if pr.value >= float(goal.split("x")[1]) else "no")
    print(f"| {label} | x{pr.value:.2f} [{pr.lo:.2f}, {pr.hi:.2f}] | {goal} | {met} |")
    return dict(label=label, ratio=pr.value, lo=pr.lo, hi=pr.hi, goal=goal)


def prefill_table(a, flags: set[str]) -> dict:
    """The prefill goal: native prefill of `--prefill-context` tokens (batch 1) as a share of the probe's FLOP peak
    (the cost model's FLOPs of that prefill / measured prefill time / hw_flops: `prefill_compute_util`), with
    llama.cpp f32 beside it as the anchor; one interleaved group, 1 new token per run."""
    names = runnable([n for n in a.prefill_variants.split(",") if n in ALL], flags)
    wl = WorkloadConfig(context_len=a.prefill_context, max_new_tokens=1, batch_size=1, warmup=1, repeats=1)
    load0 = load()
    res = dict(zip(names, run_interleaved([trial(n, a.threads, wl) for n in names], a.rounds,
                                          progress=lambda m: print(f"  {m}", file=sys.stderr, flush=True))))
    print(f"\nPrefill, context {a.prefill_context}, batch 1, {a.rounds} interleaved rounds, load {load0} -> {load()}; "
          f"FLOP peak (probe): {next(iter(res.values())).metrics.get('hw_flops', float('nan')) / 1e9:.0f} GFLOP/s\n")
    print("| variant | prefill tok/s median [95% CI] | TTFT ms | GFLOP/s attained | share of FLOP peak | goal |")
    print("|---|---|---:|---:|---:|---|")
    out = {}
    for n, r in res.items():
        s = r.samples.get("prefill_tok_s") or [r.metrics.get("prefill_tok_s", float("nan"))]
        sp = spread(s)
        util = r.metrics.get("prefill_compute_util")
        flops = r.metrics.get("cost_prefill_flops", float("nan"))
        gfs = flops / (a.prefill_context / sp.median) / 1e9
        goal = ">= 60%" if n.startswith("native") else "(anchor)"
        print(f"| {n} | {sp.median:.0f} [{sp.ci_lo:.0f}, {sp.ci_hi:.0f}] | {r.metrics.get('ttft_ms_p50', float('nan')):.0f} | "
              f"{gfs:.0f} | {'-' if util is None else f'{100 * util:.0f}%'} | {goal} |")
        out[n] = dict(prefill_tok_s=s, compute_util=util, flops=flops)
    goals = [(label, new, base, goal) for label, new, base, goal in PREFILL_GOALS if new in res and base in res]
    if goals:
        print("\n| prefill goal | ratio (median of per-round ratios) [95% CI] | goal | met |")
        print("|---|---|---|---|")
    for label, new, base, goal in goals:
        row = goal_row(label, res[base].samples["prefill_tok_s"], res[new].samples["prefill_tok_s"], goal)
        if row is not None:
            out.setdefault("goals", []).append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1,
                    help="sequences decoded together (a static batch: native's C++ step takes all B rows in one call, "
                         "llama.cpp B parallel sequences in one llama_decode); tok/s are the batch's")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--variants", default=",".join(ALL))
    ap.add_argument("--prefill-context", type=int, default=512,
                    help="then a second interleaved group: prefill of this many tokens (1 new token) for the prefill "
                         "goal, as a share of the probe's FLOP peak (0: skip)")
    ap.add_argument("--prefill-variants", default="native-fp32,native-bf16,native-int8-gemv,llamacpp-f32")
    ap.add_argument("--json", default="")
    ap.add_argument("--shape", default="smollm2", choices=sorted(SHAPES),
                    help="the model: SmolLM2-135M, Gemma 3 270M (against llama.cpp's re-exports of it), or a random 1B Llama")
    ap.add_argument("--prefill-only", action="store_true", help="only the prefill group")
    ap.add_argument("--ppl-up-to", type=int, default=2048,
                    help="the ppl column only up to this context (its windows' logits are context x vocab floats at "
                         "once: Gemma 3's 262k vocabulary at 8k is 8.4 GB a copy); beyond, '-' and no evaluation")
    a = ap.parse_args()
    global MODEL, PPL
    MODEL = SHAPES[a.shape]
    PPL = a.context <= a.ppl_up_to
    if a.prefill_only:
        torch.set_num_threads(a.threads)
        print(f"Machine: {cpu_model()}, {os.cpu_count()} CPUs, avx512_bf16={'avx512_bf16' in cpu_flags()}; "
              f"torch {torch.__version__}; {a.threads} threads; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
        print(json.dumps({"prefill": prefill_table(a, cpu_flags())}))
        return
    flags = cpu_flags()
    names = runnable(a.variants.split(","), flags)
    torch.set_num_threads(a.threads)
    wl = WorkloadConfig(context_len=a.context, max_new_tokens=a.new_tokens, batch_size=a.batch, warmup=1, repeats=1)
    trials = [trial(n, a.threads, wl) for n in names]
    start = datetime.datetime.now(datetime.timezone.utc)
    load0 = load()
    t0 = time.perf_counter()
    results = run_interleaved(trials, a.rounds, progress=lambda m: print(f"  {m}", file=sys.stderr, flush=True))
    wall = time.perf_counter() - t0
    load1 = load()
    res = dict(zip(names, results))

    print(f"Machine: {cpu_model()}, {os.cpu_count()} CPUs, avx512f={'avx512f' in flags}, avx512_bf16={'avx512_bf16' in flags}; "
          f"torch {torch.__version__}; {a.threads} threads for every engine.  ")
    print(f"Run: {start:%Y-%m-%d %H:%M} UTC, {wall:.0f} s, load average {load0} at start, {load1} at end; "
          f"{MODEL['name']}, batch {a.batch}, context {a.context}, {a.new_tokens} new tokens, greedy, {a.rounds} interleaved rounds.\n")
    print("| variant | decode tok/s median [95% CI] | TPOT ms | weights MB | weights GB/s | roofline % (decode) | ppl (2 windows) | kernels |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    out = {"machine": cpu_model(), "threads": a.threads, "date": f"{start:%Y-%m-%d %H:%M}", "load": [load0, load1],
           "batch": a.batch, "context": a.context,
           "rounds": a.rounds, "model": MODEL["name"], "variants": {}, "goals": []}
    for n, r in res.items():
        s = r.samples["decode_tok_s"]
        sp = spread(s)
        tpot = r.metrics.get("tpot_ms_p50", float("nan"))
        wb = r.metrics["weights_bytes"]
        eff = r.metrics.get("roofline_decode_efficiency")
        kern = r.info.get("quant_kernels", "")
        gbs = wb / (1e6 / statistics.median(s)) / 1e3  # bytes per token x tokens per second
        print(f"| {n} | {sp.median:.1f} [{sp.ci_lo:.1f}, {sp.ci_hi:.1f}] | {tpot:.1f} | {wb / 1e6:.0f} | {gbs:.1f} | "
              f"{'-' if eff is None else f'{100 * eff:.0f}%'} | {ppl_cell(r.metrics.get('ppl'))} | {kern} |")
        out["variants"][n] = dict(decode_tok_s=s, tpot_ms=tpot, weights_bytes=wb, roofline_decode_efficiency=eff, ppl=r.metrics.get("ppl"),
                                  kernels=kern, isa=r.info.get("quant_kernel_isa", ""))
    print("\n| goal | ratio (median of per-round ratios) [95% CI] | goal | met |")
    print("|---|---|---|---|")
    for label, new, base, goal in GOALS:
        if new not in res or base not in res:
            continue
        row = goal_row(goal_label(label, a.shape), res[base].samples["decode_tok_s"], res[new].samples["decode_tok_s"], goal)
        if row is not None:
            out["goals"].append(row)
    ref = res.get("native-fp32")
    if ref is not None:
        print("\nGreedy tokens equal native fp32's: " + ", ".join(
            f"{n} {'yes' if r.token_ids == ref.token_ids else 'no'}" for n, r in res.items() if n != "native-fp32"))
    twins = {n: EAGER_TWIN[n] for n in res if n in EAGER_TWIN and EAGER_TWIN[n] in res}
    if twins:
        print("Greedy tokens of the C++ step equal its eager twin's: " + ", ".join(
            f"{n} {'yes' if res[n].token_ids == res[e].token_ids else 'no'}" for n, e in twins.items()))
    if a.prefill_context:
        out["prefill"] = prefill_table(a, flags)
    line = json.dumps(out)
    print("\n" + line)
    if a.json:
        Path(a.json).write_text(line + "\n")


if __name__ == "__main__":
    main()
