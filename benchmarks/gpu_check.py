"""One-command GPU check of the engine on a random-weight Llama of 7B shape (an NVIDIA H200 lent for minutes).

    python benchmarks/gpu_check.py                 # CUDA: the whole check, under 8 minutes
    python benchmarks/gpu_check.py --dry-run       # CPU, tiny shapes, seconds: the same code paths
    python benchmarks/gpu_check.py --layers 16     # fewer decoder layers (said so in the output)

Sections, each measured through the engine's own parts (native model, KV caches, quant, speculative
verify, serving scheduler) with device-synchronized clocks (CUDA events around single forwards,
torch.cuda.synchronize inside the decode loop):

  kv_cache     decode with the KV cache vs recomputing the whole sequence, at 2k context
  attention    sdpa (fused / flash kernels) vs eager prefill at 1k-16k context, time and peak memory
  speculative  the verification cost: one target forward of 1 token vs k+1 tokens (+ the accept rule)
  batching     static vs continuous batching throughput of one seeded serving workload
  paged_kv     the native paged KV cache vs the contiguous one, decode at 2k context, batch 1 and 8
  int8         weight-only int8 (engine/quant.py int8-weight) vs bf16 decode; last, it quantizes the model

Every section has a time budget and the whole run a deadline; a section that fails (or runs out of
time) is recorded as skipped with the reason, and the rest still run. Results go to $OUT (default
./gpu-check-out): gpu_check.json and gpu_check.md, rewritten after every section so a killed run keeps
what it measured. Imports: the stdlib, torch, transformers and engine/ only (no Ray, MLflow, Hydra,
bitsandbytes or flash-attn), so it runs on a bare device image.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.config import (  # noqa: E402
    AttentionConfig,
    BatchingConfig,
    EngineConfig,
    KVCacheConfig,
    LengthConfig,
    ModelConfig,
    QuantConfig,
    SamplingConfig,
    TextConfig,
    TimingConfig,
    TrialConfig,
    WorkloadConfig,
)
from engine.measure.costmodel import ModelShape, Precision, forward_cost  # noqa: E402
from engine.generate import device_synchronizer, generate  # noqa: E402
from engine.measure.hardware import device_name, gpu_spec, preferred_dtype  # noqa: E402
from engine.measure.memory import PeakMemory  # noqa: E402
from engine.measure.metrics import static_batch_metrics  # noqa: E402
from engine.models import TORCH_DTYPES, LoadedModel, weights_bytes  # noqa: E402
from engine.engines.native.backend import NativeBackend  # noqa: E402
from engine.quant import quantize_model  # noqa: E402
from engine.pipeline import run_engine_trial  # noqa: E402
from engine.speculative.verify import verify  # noqa: E402
from engine.tokenizer import ByteTokenizer  # noqa: E402

DEFAULT_BUDGET_S = 420.0  # the whole run, model build included: under 8 minutes with margin


# ---------------------------------------------------------------------------------------------- sizes
@dataclass(frozen=True)
class Shape:
    """The decoder's dimensions (Llama-2-7B by default: MHA, untied embeddings)."""

    hidden: int = 4096
    intermediate: int = 11008
    heads: int = 32
    kv_heads: int = 32
    layers: int = 32
    vocab: int = 32000
    max_positions: int = 32768


@dataclass(frozen=True)
class Sizes:
    """Every workload size of the check; `DRY` shrinks them all for the CPU dry run."""

    shape: Shape = field(default_factory=Shape)
    kv_context: int = 2048
    kv_on_tokens: int = 32
    kv_off_tokens: int = 8
    attn_contexts: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384)
    attn_repeats: int = 2
    spec_context: int = 2048
    spec_ks: tuple[int, ...] = (1, 2, 4, 8)
    spec_repeats: int = 10
    serve_requests: int = 48
    serve_input: tuple[int, int] = (64, 512)
    serve_output: tuple[int, int] = (16, 128)
    serve_batch: int = 16
    serve_batch_tokens: int = 4096
    paged_context: int = 2048
    paged_batches: tuple[int, ...] = (1, 8)
    paged_tokens: int = 16
    int8_context: int = 512
    int8_tokens: int = 32


GPU_SIZES = Sizes()
DRY_SIZES = Sizes(
    shape=Shape(hidden=64, intermediate=128, heads=4, kv_heads=2, layers=2, vocab=384, max_positions=512),
    kv_context=64, kv_on_tokens=6, kv_off_tokens=4,
    attn_contexts=(32, 64), attn_repeats=1,
    spec_context=48, spec_ks=(2, 4), spec_repeats=2,
    serve_requests=6, serve_input=(8, 24), serve_output=(2, 8), serve_batch=3, serve_batch_tokens=256,
    paged_context=48, paged_batches=(1, 2), paged_tokens=4,
    int8_context=32, int8_tokens=4,
)

# section -> share of the remaining budget it may use (the rest stays for the sections after it)
SECTION_BUDGETS = {"kv_cache": 45.0, "attention": 100.0, "speculative": 35.0, "batching": 110.0,
                   "paged_kv": 45.0, "int8": 70.0}


# ------------------------------------------------------------------------------ engine configuration
def engine_config(dtype: str, *, attention: str = "sdpa", kv_cache: str = "contiguous", kv_block_size: int = 16,
                  compile: bool = False, quant: str = "none", batching: str = "static", sizes: Sizes = GPU_SIZES,
                  serving: bool = False) -> TrialConfig:
    """The only place this script builds engine config objects (one TrialConfig per variant)."""
    workload = WorkloadConfig(warmup=1, repeats=1, sampling=SamplingConfig(temperature=0.0),
                              # prompts: this repo's README (present wherever the tree is; pydoc_data may be
                              # missing on an image)
                              text=TextConfig(kind="file", path=str(ROOT / "README.md")))
    if serving:
        workload = dataclasses.replace(
            workload, kind="serving", num_requests=sizes.serve_requests, arrival="all-at-once",
            input_len=LengthConfig(dist="uniform", min=sizes.serve_input[0], max=sizes.serve_input[1]),
            output_len=LengthConfig(dist="uniform", min=sizes.serve_output[0], max=sizes.serve_output[1]))
    return TrialConfig(
        model=ModelConfig(name="random-llama", path="tiny://gpu-check", dtype=dtype),
        engine=EngineConfig(backend="native", compile=compile),
        attention=AttentionConfig(impl=attention),
        kv_cache=KVCacheConfig(mode=kv_cache, block_size=kv_block_size),
        quant=QuantConfig(level=quant, compute_dtype=dtype),
        workload=workload,
        batching=BatchingConfig(mode=batching, max_batch_size=sizes.serve_batch, max_batch_tokens=sizes.serve_batch_tokens),
        timing=TimingConfig(max_repeats=0),  # one timed run per variant: each section repeats what it compares
    )


# ------------------------------------------------------------------------------------------- model
def build_model(shape: Shape, dtype: str, device: torch.device, seed: int = 0) -> LoadedModel:
    """A random-weight transformers Llama built directly on `device` in `dtype` (no checkpoint on disk)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                      num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                      num_key_value_heads=shape.kv_heads, max_position_embeddings=shape.max_positions,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    t0 = time.perf_counter()
    prev = torch.get_default_dtype()
    torch.set_default_dtype(TORCH_DTYPES[dtype])  # parameters are created in dtype: no fp32 copy of 7B
    try:
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if device.type == "cuda" else []), \
                torch.device(device):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    model.eval().requires_grad_(False)
    sync(device)
    return LoadedModel(model=model, tokenizer=ByteTokenizer(), spec=engine_config(dtype).model,
                       load_s=time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------- plumbing
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call: CUDA events around it on a GPU (queued work included), the wall clock on CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median_time(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    return statistics.median(time_call(fn, device) for _ in range(max(1, repeats)))


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class OutOfTime(Exception):
    """A section's time budget ran out before its next measurement point."""


@dataclass
class Ctx:
    device: torch.device
    dtype: str
    sizes: Sizes
    loaded: LoadedModel
    with_compile: bool = False
    deadline: float = 0.0  # perf_counter time after which the current section starts no new point
    say: Callable[[str], None] = print

    def out_of_time(self) -> bool:
        return time.perf_counter() > self.deadline

    def check_time(self, what: str) -> None:
        if self.out_of_time():
            raise OutOfTime(f"time budget reached before {what}")

    def backend(self, **kw) -> NativeBackend:
        trial = engine_config(self.dtype, sizes=self.sizes, **kw)
        return NativeBackend(self.loaded, trial)

    def prompt(self, batch: int, length: int, seed: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(3, min(self.sizes.shape.vocab, 259), (batch, length), generator=g).to(self.device)


def decode_run(ctx: Ctx, backend: NativeBackend, batch: int, context: int, new_tokens: int) -> dict:
    """Warm-up, then one greedy generation through the engine's decode loop: its static-batch metrics."""
    prompt = ctx.prompt(batch, context)
    sampling = engine_config(ctx.dtype).workload.sampling
    clock = device_synchronizer(ctx.device)  # torch.cuda.synchronize before every token's clock reading
    generate(backend.new_session(batch, context + 2), prompt, 2, sampling, 0, clock)  # kernels, allocations
    trace = generate(backend.new_session(batch, context + new_tokens), prompt, new_tokens, sampling, 0, clock)
    m = static_batch_metrics(trace)
    return {"decode_tok_s": m["decode_tok_s"], "tpot_ms": m["tpot_ms_mean"], "prefill_tok_s": m["prefill_tok_s"],
            "ttft_ms": m["ttft_ms_mean"], "kv_cache_bytes": int(m["kv_cache_bytes"])}


def add_roofline(ctx: Ctx, row: dict, batch: int, context: int, quant: str = "none") -> None:
    """The bytes one decode step must move (the cost model's count: every matmul weight once + the KV
    cache) and, on a GPU of the datasheet table, the share of its bandwidth the measured step reached."""
    shape = ModelShape.from_hf_config(ctx.loaded.config)
    step = forward_cost(shape, Precision.of(ctx.dtype, quant), batch, 1, context, cached=True, materialize_scores=False)
    row["step_bytes"] = int(step.bytes)
    spec = gpu_spec(device_name(ctx.device)) if ctx.device.type == "cuda" else None
    row["hbm_util"] = step.bytes / (row["tpot_ms"] / 1e3) / spec.mem_bw if spec and row["tpot_ms"] > 0 else None


# ---------------------------------------------------------------------------------------- sections
# Each section appends its measurements to sec["rows"] as it goes (a section stopped by its time budget
# or an error keeps them), names what it could not measure in sec["not_measured"], and adds ratios to
# sec["summary"] once the rows they need exist.
def section_kv_cache(ctx: Ctx, sec: dict) -> None:
    s = ctx.sizes
    for kv, n in (("contiguous", s.kv_on_tokens), ("off", s.kv_off_tokens)):
        ctx.check_time(f"kv_cache={kv}")
        ctx.say(f"  kv_cache={kv}: context {s.kv_context}, {n} tokens")
        be = ctx.backend(kv_cache=kv)
        r = {"kv_cache": kv, "context": s.kv_context, "new_tokens": n, **decode_run(ctx, be, 1, s.kv_context, n)}
        if kv != "off":
            add_roofline(ctx, r, 1, s.kv_context)
        sec["rows"].append(r)
        del be
        free(ctx.device)
    on, off = sec["rows"]
    sec["summary"]["decode_speedup_kv_on_vs_off"] = on["decode_tok_s"] / off["decode_tok_s"]


def section_attention(ctx: Ctx, sec: dict) -> None:
    s = ctx.sizes
    rows = sec["rows"]
    backends = {impl: ctx.backend(attention=impl, kv_cache="off") for impl in ("sdpa", "eager")}
    for n in s.attn_contexts:
        for impl, be in backends.items():
            if ctx.out_of_time():
                sec["not_measured"].append(f"{impl}@{n}: time budget")
                continue
            ctx.say(f"  attention={impl}: prefill {n} tokens")
            tokens = ctx.prompt(1, n)
            be.kernel.reset_peak()
            free(ctx.device)
            base = torch.cuda.memory_allocated(ctx.device) if ctx.device.type == "cuda" else 0

            def prefill(be=be, tokens=tokens):
                with torch.inference_mode():
                    return be.model(tokens, 0, be.kernel, None, num_logits=1)

            try:
                with PeakMemory(ctx.device) as mem:
                    t = median_time(prefill, ctx.device, s.attn_repeats)
            except torch.cuda.OutOfMemoryError as e:  # a result in itself: eager's O(N^2) scores do not fit
                rows.append({"attention": impl, "context": n, "oom": str(e).splitlines()[0][:160]})
                free(ctx.device)
                continue
            row = {"attention": impl, "context": n, "prefill_ms": t * 1e3, "prefill_tok_s": n / t,
                   "peak_mem_bytes": mem.peak_bytes, "attn_peak_bytes": be.kernel.peak_bytes}
            if ctx.device.type == "cuda":
                row["transient_bytes"] = mem.peak_bytes - base  # above the weights and whatever was held before
            rows.append(row)
    del backends
    free(ctx.device)
    by = {(r["attention"], r["context"]): r for r in rows if "prefill_ms" in r}
    for n in s.attn_contexts:
        if ("sdpa", n) in by and ("eager", n) in by:
            sec["summary"][f"eager_over_sdpa_time@{n}"] = by["eager", n]["prefill_ms"] / by["sdpa", n]["prefill_ms"]
            sec["summary"][f"eager_over_sdpa_peak_mem@{n}"] = by["eager", n]["peak_mem_bytes"] / by["sdpa", n]["peak_mem_bytes"]
    if ctx.device.type == "cuda":
        sec["summary"]["flash_sdp_enabled"] = bool(torch.backends.cuda.flash_sdp_enabled())


def section_speculative(ctx: Ctx, sec: dict) -> None:
    s = ctx.sizes
    be = ctx.backend()
    sampling = engine_config(ctx.dtype).workload.sampling
    session = be.new_session(1, s.spec_context + max(s.spec_ks) + 1)
    session.forward(ctx.prompt(1, s.spec_context))  # the committed context

    def step(k: int) -> Callable[[], None]:
        draft = ctx.prompt(1, k + 1, seed=k)  # the committed last token + k drafted ones

        def run() -> None:
            logits = session.forward(draft)  # [1, k+1, V]
            if k:
                verify(draft[0, 1:], None, logits[0], sampling, None)
            session.rollback(k + 1)

        return run

    ctx.say(f"  speculative: 1-token forward at context {s.spec_context}")
    one = median_time(step(0), ctx.device, s.spec_repeats)
    sec["rows"].append({"verify_tokens": 1, "forward_ms": one * 1e3, "cost_vs_1_token": 1.0})
    for k in s.spec_ks:
        if ctx.out_of_time():
            sec["not_measured"].append(f"k={k}: time budget")
            continue
        ctx.say(f"  speculative: verify k={k} drafts at context {s.spec_context}")
        t = median_time(step(k), ctx.device, s.spec_repeats)
        sec["rows"].append({"verify_tokens": k + 1, "forward_ms": t * 1e3, "cost_vs_1_token": t / one})
    assert session.length == s.spec_context  # every rollback undid its forward
    sec["summary"]["context"] = s.spec_context
    # speculation pays when tokens per target step exceed this cost ratio (plus the drafter's cost)
    sec["summary"]["verify_cost_ratio_by_k"] = {r["verify_tokens"] - 1: r["cost_vs_1_token"] for r in sec["rows"][1:]}


def section_batching(ctx: Ctx, sec: dict) -> None:
    rows = sec["rows"]
    for mode in ("static", "continuous"):
        ctx.check_time(f"batching={mode}")
        trial = engine_config(ctx.dtype, batching=mode, sizes=ctx.sizes, serving=True)
        s = trial.workload
        ctx.say(f"  batching={mode}: {s.num_requests} requests, max batch {trial.batching.max_batch_size}")
        trial.eval.enabled = False  # the serving run alone: accuracy has its own section
        m = run_engine_trial(trial, loaded=ctx.loaded, progress=lambda msg: ctx.say(f"    {msg}")).metrics
        rows.append({"batching": mode, "requests": s.num_requests, "output_tok_s": m["output_tok_s"],
                     "request_s": m["request_s"], "mean_batch_size": m["mean_batch_size"],
                     "ttft_ms_p50": m["ttft_ms_p50"], "tpot_ms_p50": m["tpot_ms_p50"],
                     "duration_s": m["duration_s"], "kv_peak_bytes": int(m["kv_peak_bytes"]),
                     "peak_mem_bytes": int(m["peak_mem_bytes"])})
        free(ctx.device)
    static, cont = rows
    sec["summary"]["continuous_over_static_throughput"] = cont["output_tok_s"] / static["output_tok_s"]


def section_paged_kv(ctx: Ctx, sec: dict) -> None:
    s = ctx.sizes
    rows = sec["rows"]
    for b in s.paged_batches:
        for kv in ("contiguous", "paged"):
            if ctx.out_of_time():
                sec["not_measured"].append(f"{kv}@batch{b}: time budget")
                continue
            ctx.say(f"  kv_cache={kv}: batch {b}, context {s.paged_context}")
            be = ctx.backend(kv_cache=kv)
            r = {"kv_cache": kv, "batch": b, "context": s.paged_context, **decode_run(ctx, be, b, s.paged_context, s.paged_tokens)}
            add_roofline(ctx, r, b, s.paged_context)
            rows.append(r)
            del be
            free(ctx.device)
    by = {(r["kv_cache"], r["batch"]): r for r in rows}
    for b in s.paged_batches:
        if ("paged", b) in by and ("contiguous", b) in by:
            sec["summary"][f"paged_over_contiguous_decode@batch{b}"] = (
                by["paged", b]["decode_tok_s"] / by["contiguous", b]["decode_tok_s"])


def section_int8(ctx: Ctx, sec: dict) -> None:
    """Runs last: quantizing swaps the model's projections in place (the full-width weights are released)."""
    s = ctx.sizes
    rows = sec["rows"]
    ctx.say(f"  {ctx.dtype} decode: context {s.int8_context}")
    be = ctx.backend()
    full_bytes = weights_bytes(be.model)
    r = {"weights": ctx.dtype, "weights_bytes": full_bytes, **decode_run(ctx, be, 1, s.int8_context, s.int8_tokens)}
    add_roofline(ctx, r, 1, s.int8_context)
    rows.append(r)
    del be
    free(ctx.device)
    ctx.check_time("int8 quantization")
    trial = engine_config(ctx.dtype, quant="int8-weight", sizes=s)
    t0 = time.perf_counter()
    swapped = quantize_model(ctx.loaded.model, trial.quant, s.shape.layers)
    sync(ctx.device)
    sec["summary"].update(linears_swapped=swapped, quantize_s=time.perf_counter() - t0, kernel=trial.quant.kernel)
    free(ctx.device)
    for comp in (False, True) if ctx.with_compile else (False,):
        name = "int8-weight" + (" +compile" if comp else "")
        if ctx.out_of_time():
            sec["not_measured"].append(f"{name}: time budget")
            continue
        ctx.say(f"  {name} decode: context {s.int8_context}")
        be = ctx.backend(compile=comp)
        qbytes = weights_bytes(be.model)
        r = {"weights": name, "weights_bytes": qbytes, **decode_run(ctx, be, 1, s.int8_context, s.int8_tokens)}
        add_roofline(ctx, r, 1, s.int8_context, quant=trial.quant.level)
        rows.append(r)
        del be
        free(ctx.device)
    if len(rows) > 1:
        sec["summary"]["int8_over_full_decode"] = rows[1]["decode_tok_s"] / rows[0]["decode_tok_s"]
        sec["summary"]["weights_ratio"] = rows[1]["weights_bytes"] / full_bytes


SECTIONS: dict[str, Callable[[Ctx, dict], None]] = {
    "kv_cache": section_kv_cache,
    "attention": section_attention,
    "speculative": section_speculative,
    "batching": section_batching,
    "paged_kv": section_paged_kv,
    "int8": section_int8,
}


def run_section(name: str, ctx: Ctx) -> dict:
    """One section under its deadline; never raises: failures become status skipped (no rows) or partial."""
    sec: dict = {"rows": [], "summary": {}, "not_measured": []}
    try:
        SECTIONS[name](ctx, sec)
        sec["status"] = "partial" if sec["not_measured"] else "ok"
    except OutOfTime as e:
        sec["status"], sec["reason"] = ("partial" if sec["rows"] else "skipped"), str(e)
    except Exception as e:  # one broken section must not cost the others their numbers
        first = str(e).splitlines()[0][:300] if str(e) else ""
        sec["status"], sec["reason"] = ("partial" if sec["rows"] else "skipped"), f"{type(e).__name__}: {first}"
        traceback.print_exc()
    free(ctx.device)
    return sec


# ----------------------------------------------------------------------------------------- reports
def _fmt(key: str, v) -> str:
    if v is None:
        return "-"
    if key.endswith("_bytes") and isinstance(v, (int, float)):
        return f"{v / 2**30:.3f} GiB" if v >= 2**20 else f"{v / 2**10:.1f} KiB"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = ["# GPU check", "",
             f"{meta['device_name']} · torch {meta['torch']} · transformers {meta['transformers']} · "
             f"{meta['dtype']} · random-weight Llama {meta['shape']['hidden']}h x {meta['shape']['layers']} layers"
             f"{' (fewer layers than 7B: ' + meta['layers_note'] + ')' if meta.get('layers_note') else ''}"
             f"{' · DRY RUN (CPU, tiny shapes)' if meta['dry_run'] else ''} · {meta['elapsed_s']:.0f} s", ""]
    for name, sec in report["sections"].items():
        lines.append(f"## {name} ({sec['status']}, {sec.get('elapsed_s', 0):.1f} s)")
        lines.append("")
        if sec.get("reason"):
            lines += [f"skipped: {sec['reason']}", ""]
        rows = sec.get("rows") or []
        if rows:
            cols = list(dict.fromkeys(k for r in rows for k in r))
            lines.append("| " + " | ".join(cols) + " |")
            lines.append("|" + "---|" * len(cols))
            for r in rows:
                lines.append("| " + " | ".join(_fmt(c, r.get(c)) for c in cols) + " |")
            lines.append("")
        for k, v in (sec.get("summary") or {}).items():
            lines.append(f"- {k}: {json.dumps(v) if isinstance(v, dict) else _fmt(k, v)}")
        if sec.get("not_measured"):
            lines.append(f"- not measured: {', '.join(sec['not_measured'])}")
        lines.append("")
    return "\n".join(lines)


def write(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "gpu_check.md").write_text(markdown(report))


# -------------------------------------------------------------------------------------------- main
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, seconds: every code path, no GPU")
    p.add_argument("--layers", type=int, default=0, help="decoder layers (default: 32, the 7B shape)")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="deadline of the whole run (s)")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma list of sections to run, in order")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA where supported, else the CPU's preferred")
    p.add_argument("--compile", action="store_true", help="int8: also torch.compile the decode step (adds minutes)")
    p.add_argument("--out", default=None, help="output folder (default: $OUT, else ./gpu-check-out)")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    deadline = t_start + args.budget_s
    out = Path(args.out or os.environ.get("OUT") or "gpu-check-out")
    names = [n.strip() for n in args.sections.split(",") if n.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        print(f"unknown sections {unknown}; known: {list(SECTIONS)}", file=sys.stderr)
        return 2
    names = list(dict.fromkeys(n for n in names if n != "int8")) + (["int8"] if "int8" in names else [])  # int8 quantizes in place: last
    if args.dry_run:
        device, sizes = torch.device("cpu"), DRY_SIZES
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --dry-run to exercise the code paths on CPU", file=sys.stderr)
            return 2
        device, sizes = torch.device("cuda"), GPU_SIZES
    if args.layers:
        sizes = replace(sizes, shape=replace(sizes.shape, layers=args.layers))
    dtype = args.dtype or preferred_dtype(device)
    if dtype not in TORCH_DTYPES:
        print(f"--dtype {dtype!r} unknown; choose one of {sorted(TORCH_DTYPES)}", file=sys.stderr)
        return 2
    import transformers

    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    name = device_name(device)
    meta = {"device": str(device), "device_name": name, "torch": torch.__version__, "cuda": str(torch.version.cuda),
            "transformers": transformers.__version__, "python": platform.python_version(), "dtype": dtype,
            "dry_run": args.dry_run, "shape": asdict(sizes.shape), "sizes": asdict(sizes), "budget_s": args.budget_s,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "elapsed_s": 0.0}
    if sizes.shape.layers != Shape().layers and not args.dry_run:
        meta["layers_note"] = f"{sizes.shape.layers} of 7B's 32 layers; per-token costs scale ~linearly with layers"
    if device.type == "cuda":
        meta["gpu_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    report = {"meta": meta, "sections": {n: {"status": "pending"} for n in names}}
    write(report, out)
    say(f"{name}: building a random-weight Llama ({sizes.shape.layers} layers, hidden {sizes.shape.hidden}) in {dtype}")
    try:
        loaded = build_model(sizes.shape, dtype, device)
    except Exception as e:  # nothing can run without the model: record why, and stop
        for n in names:
            report["sections"][n] = {"status": "skipped", "reason": f"model build failed: {type(e).__name__}: {e}"}
        meta["elapsed_s"] = time.perf_counter() - t_start
        write(report, out)
        traceback.print_exc()
        return 1
    meta["model_build_s"] = loaded.load_s
    meta["weights_bytes"] = weights_bytes(loaded.model)
    say(f"model ready in {loaded.load_s:.1f}s ({meta['weights_bytes'] / 2**30:.2f} GiB of weights)")
    ctx = Ctx(device=device, dtype=dtype, sizes=sizes, loaded=loaded, with_compile=args.compile, say=say)
    for i, n in enumerate(names):
        left = deadline - time.perf_counter()
        later = sum(SECTION_BUDGETS[m] for m in names[i + 1:])
        # a section may use its share, scaled down when the run is behind, and never eat the later ones' time
        share = SECTION_BUDGETS[n] * min(1.0, left / (SECTION_BUDGETS[n] + later)) if left > 0 else 0.0
        t0 = time.perf_counter()
        if share < 3.0:
            sec = {"status": "skipped", "reason": f"the run's {args.budget_s:.0f}s budget is spent"}
        else:
            ctx.deadline = t0 + share
            say(f"section {n} (budget {share:.0f}s)")
            sec = run_section(n, ctx)
        sec["elapsed_s"] = time.perf_counter() - t0
        report["sections"][n] = sec
        meta["elapsed_s"] = time.perf_counter() - t_start
        write(report, out)
        say(f"section {n}: {sec['status']}{' (' + sec['reason'] + ')' if sec.get('reason') else ''}")
    print(markdown(report), flush=True)
    say(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
