"""Static checks of an `EngineTrial`: everything the engine can tell is impossible without loading weights.

Returns (field, message) pairs keyed by the engine dataclass path (e.g. "workload.context_len"), so a
caller can report every problem at once and map fields to its own config keys.
"""
from __future__ import annotations

import os

import torch

from .config import (
    ARRIVALS,
    ATTENTION_IMPLS,
    BACKENDS,
    BATCHING_MODES,
    DTYPES,
    INT8_KERNELS,
    KV_CACHE_DTYPES,
    KV_CACHE_MODES,
    LENGTH_DISTS,
    QUANT_LEVELS,
    EngineError,
    EngineTrial,
    LengthSpec,
    TextSource,
)
from .models import PREPARED_MODELS, PREPARED_SCHEME, TINY_SCHEME, max_positions

HF_KV_MODES = ("off", "contiguous")
TEXT_KINDS = ("pydoc", "file", "datasets")


def _choice(field: str, value, allowed) -> list[tuple[str, str]]:
    if value not in allowed:
        return [(field, f"{value!r} is not allowed; choose one of {', '.join(map(str, allowed))}")]
    return []


def _text(field: str, src: TextSource) -> list[tuple[str, str]]:
    out = _choice(f"{field}.kind", src.kind, TEXT_KINDS)
    if src.kind == "file":
        if not src.path:
            out.append((f"{field}.path", "text.kind=file needs a path"))
        elif not os.path.isfile(src.path):
            out.append((f"{field}.path", f"file {src.path!r} does not exist"))
    if src.kind == "datasets" and not src.name:
        out.append((f"{field}.name", "text.kind=datasets needs a dataset name"))
    return out


def _num_layers(m) -> int | None:
    """Decoder layers of a model, from its config without loading weights (None if not known yet)."""
    import json

    from .models import prepared_dir

    if m.path.startswith(TINY_SCHEME):
        return m.tiny.num_layers
    path = prepared_dir(m.path[len(PREPARED_SCHEME):]) if m.path.startswith(PREPARED_SCHEME) else m.path
    try:
        with open(os.path.join(path, "config.json")) as f:
            return int(json.load(f).get("num_hidden_layers") or 0) or None
    except (OSError, ValueError):
        return None  # a hub id or a model not prepared yet: checked when it loads


def _speculative(trial: EngineTrial) -> list[tuple[str, str]]:
    from .config import PROMPT_STYLES, SPECULATIVE_METHODS

    s, w = trial.speculative, trial.workload
    p = _choice("workload.prompt_style", w.prompt_style, PROMPT_STYLES)
    p += _choice("speculative.method", s.method, SPECULATIVE_METHODS)
    if s.method == "off" or s.method not in SPECULATIVE_METHODS:
        return p
    if s.k < 1:
        p.append(("speculative.k", f"must be >= 1 (tokens drafted per step), got {s.k}"))
    if w.batch_size != 1:
        p.append(("workload.batch_size", f"speculative decoding runs batch size 1 (each sequence accepts a different "
                                         f"number of drafts, and a static batch rolls back as one); got {w.batch_size}"))
    if s.method == "self-draft":
        total = _num_layers(trial.model)
        if total is not None and not 1 <= s.draft_layers < total:
            p.append(("speculative.draft_layers", f"must be in [1, {total}) for this {total}-layer model "
                                                  f"(the draft runs the first N layers), got {s.draft_layers}"))
        elif s.draft_layers < 1:
            p.append(("speculative.draft_layers", f"must be >= 1, got {s.draft_layers}"))
    if s.method == "draft":
        d = s.draft_model
        if d is None or not d.path:
            p.append(("speculative.draft_model.path", "speculative=draft needs a draft model: a local HF checkpoint, "
                                                      "hub id, prepared://NAME or tiny://NAME sharing the target's tokenizer"))
        elif d.path.startswith(PREPARED_SCHEME) and d.path[len(PREPARED_SCHEME):] not in PREPARED_MODELS:
            p.append(("speculative.draft_model.path", f"unknown prepared model {d.path[len(PREPARED_SCHEME):]!r}; "
                                                      f"known: {', '.join(sorted(PREPARED_MODELS))}"))
        elif not d.path.startswith(TINY_SCHEME) and (os.path.sep in d.path or d.path.startswith(".")) and not os.path.isdir(d.path):
            p.append(("speculative.draft_model.path", f"{d.path!r} does not exist (expected a local HF checkpoint directory or a hub id)"))
        if d is not None:
            p += _choice("speculative.draft_model.dtype", d.dtype, DTYPES)
    if s.method == "prompt-lookup":
        if s.prompt_lookup_min < 1:
            p.append(("speculative.prompt_lookup_min", f"must be >= 1, got {s.prompt_lookup_min}"))
        if s.prompt_lookup_max < s.prompt_lookup_min:
            p.append(("speculative.prompt_lookup_max", f"must be >= prompt_lookup_min ({s.prompt_lookup_min}), "
                                                       f"got {s.prompt_lookup_max}"))
    return p


def check_trial(trial: EngineTrial, gpu_available: bool) -> list[tuple[str, str]]:
    p: list[tuple[str, str]] = []
    m, o, w = trial.model, trial.optimization, trial.workload
    p += _choice("model.dtype", m.dtype, DTYPES)
    p += _choice("optimization.backend", o.backend, BACKENDS)
    p += _choice("optimization.attention", o.attention, ATTENTION_IMPLS)
    p += _choice("optimization.kv_cache", o.kv_cache, KV_CACHE_MODES)
    p += _choice("optimization.kv_cache_dtype", o.kv_cache_dtype, KV_CACHE_DTYPES)
    if o.kv_cache_dtype != "auto" and o.backend != "vllm":
        p.append(("optimization.kv_cache_dtype", f"kv_cache.dtype={o.kv_cache_dtype} runs on engine=vllm only; "
                                                 f"engine={o.backend} stores K/V in the model dtype (auto)"))
    if o.backend == "vllm":
        from .backends.vllm_runner import unsupported

        p += unsupported(trial)
    if o.backend == "hf" and o.kv_cache not in HF_KV_MODES:
        p.append(("optimization.kv_cache", f"backend hf supports {', '.join(HF_KV_MODES)}; paged needs backend native"))
    q = trial.quant
    p += _choice("quant.level", q.level, QUANT_LEVELS)
    p += _choice("quant.compute_dtype", q.compute_dtype, DTYPES)
    p += _choice("quant.kernel", q.kernel, INT8_KERNELS)
    if q.level == "int8-weight" and q.kernel == "int8pack":
        if not hasattr(torch, "_weight_int8pack_mm"):
            p.append(("quant.kernel", f"int8pack needs torch._weight_int8pack_mm, missing in torch {torch.__version__}"))
    if q.keep_last_layers < 0:
        p.append(("quant.keep_last_layers", f"must be >= 0, got {q.keep_last_layers}"))
    if q.level.startswith("bnb-") and m.dtype != "float32" and not gpu_available:
        p.append(("quant.level", f"{q.level} on CPU needs model.dtype=float32 (no fast half precision here)"))
    if o.kv_block_size < 1:
        p.append(("optimization.kv_block_size", f"must be >= 1, got {o.kv_block_size}"))
    if o.attention == "flash" and not gpu_available:
        p.append(("optimization.attention", "flash needs a CUDA GPU (none requested/available); use sdpa or eager"))
    if m.path.startswith(PREPARED_SCHEME):
        name = m.path[len(PREPARED_SCHEME):]
        if name not in PREPARED_MODELS:
            p.append(("model.path", f"unknown prepared model {name!r}; known: {', '.join(sorted(PREPARED_MODELS))}"))
    elif m.path.startswith(TINY_SCHEME):
        t = m.tiny
        if t.num_heads < 1 or t.hidden_size % t.num_heads:
            p.append(("model.tiny.num_heads", f"hidden_size {t.hidden_size} must be divisible by num_heads {t.num_heads}"))
        elif t.num_kv_heads < 1 or t.num_heads % t.num_kv_heads:
            p.append(("model.tiny.num_kv_heads", f"num_heads {t.num_heads} must be divisible by num_kv_heads {t.num_kv_heads}"))
        if t.vocab_size < 259:
            p.append(("model.tiny.vocab_size", "must be >= 259 (byte tokenizer)"))
    elif (os.path.sep in m.path or m.path.startswith(".")) and not os.path.isdir(m.path):
        p.append(("model.path", f"{m.path!r} does not exist (expected a local HF checkpoint directory or a hub id)"))
    for field, value, lo in (
        ("workload.context_len", w.context_len, 1),
        ("workload.max_new_tokens", w.max_new_tokens, 1),
        ("workload.batch_size", w.batch_size, 1),
        ("workload.repeats", w.repeats, 1),
        ("workload.warmup", w.warmup, 0),
        ("eval.num_windows", trial.eval.num_windows, 0),
        ("eval.topk", trial.eval.topk, 1),
        ("threads", trial.threads, 0),
    ):
        if value < lo:
            p.append((field, f"must be >= {lo}, got {value}"))
    s = w.sampling
    if s.temperature < 0:
        p.append(("workload.sampling.temperature", f"must be >= 0 (0 = greedy), got {s.temperature}"))
    if not 0 < s.top_p <= 1:
        p.append(("workload.sampling.top_p", f"must be in (0, 1], got {s.top_p}"))
    if s.top_k < 0:
        p.append(("workload.sampling.top_k", f"must be >= 0, got {s.top_k}"))
    p += _text("workload.text", w.text)
    if trial.eval.enabled:
        p += _text("eval.text", trial.eval.text)
    if not any(f.startswith("model.path") for f, _ in p):
        limit = max_positions(m)
        need = w.context_len + w.max_new_tokens
        if limit and need > limit:
            p.append(("workload.context_len", f"context_len + max_new_tokens = {need} exceeds the model's maximum of {limit} positions"))
    p += _speculative(trial)
    p += _batching(trial)
    return p


def _length(field: str, s: LengthSpec) -> list[tuple[str, str]]:
    out = _choice(f"{field}.dist", s.dist, LENGTH_DISTS)
    if s.dist == "fixed" and s.value < 1:
        out.append((f"{field}.value", f"must be >= 1, got {s.value}"))
    if s.dist == "uniform":
        if s.min < 1:
            out.append((f"{field}.min", f"must be >= 1, got {s.min}"))
        if s.max < s.min:
            out.append((f"{field}.max", f"must be >= its min ({s.min}), got {s.max}"))
    return out


def _batching(trial: EngineTrial) -> list[tuple[str, str]]:
    """Batching, SLO, prefix-caching and serving-workload checks."""
    from .serving.workload import max_prompt_tokens, max_request_tokens, read_length_trace

    p: list[tuple[str, str]] = []
    b, o, s = trial.batching, trial.optimization, trial.serving
    p += _choice("batching.mode", b.mode, BATCHING_MODES)
    for field, value, lo in (("batching.max_batch_size", b.max_batch_size, 1),
                             ("batching.max_batch_tokens", b.max_batch_tokens, 1),
                             ("optimization.kv_num_blocks", o.kv_num_blocks, 0)):
        if value < lo:
            p.append((field, f"must be >= {lo}, got {value}"))
    for field, value in (("slo.ttft_ms", trial.slo.ttft_ms), ("slo.tpot_ms", trial.slo.tpot_ms)):
        if not value > 0:
            p.append((field, f"must be > 0, got {value}"))
    if (b.mode == "continuous" or s is not None) and o.backend not in ("native", "vllm"):
        what = "serving workloads run" if s is not None else "batching=continuous runs"
        p.append(("optimization.backend", f"{what} on engine=native (varlen batches over a paged KV pool) or "
                                          "engine=vllm; backend hf runs one static batch only"))
    if s is None:
        if b.mode == "continuous":
            p.append(("batching.mode", "continuous batching schedules requests arriving over time: use a serving "
                                       "workload (workload=serving-mixed, or workload.kind=serving)"))
        if o.prefix_caching:
            p.append(("optimization.prefix_caching", "prefix caching applies to serving workloads (workload.kind=serving)"))
        return p
    native = o.backend != "vllm"  # vLLM's own scheduler has none of these limits (its own: vllm_runner.unsupported)
    if native and o.kv_cache != "paged":
        p.append(("optimization.kv_cache", "serving workloads need kv_cache=paged: the scheduler admits requests by free KV blocks"))
    if native and o.attention == "flash":
        p.append(("optimization.attention", "flash has no varlen (continuous batching) path yet; use sdpa or eager"))
    if native and o.compile:
        p.append(("engine.compile", "torch.compile is not supported with serving workloads (shapes change every step)"))
    spec = getattr(trial, "speculative", None)
    if native and spec is not None and getattr(spec, "method", "off") not in ("off", "none"):
        p.append(("speculative", "speculative decoding is not implemented for serving workloads"))
    for field, value, lo in (("serving.num_requests", s.num_requests, 1), ("serving.prefix_len", s.prefix_len, 0),
                             ("serving.max_concurrency", s.max_concurrency, 0)):
        if value < lo:
            p.append((field, f"must be >= {lo}, got {value}"))
    p += _choice("serving.arrival", s.arrival, ARRIVALS)
    if s.arrival != "all-at-once" and not s.rate > 0:
        p.append(("serving.rate", f"must be > 0 requests/s for arrival={s.arrival}, got {s.rate}"))
    if not s.burstiness > 0:
        p.append(("serving.burstiness", f"must be > 0 (1 = Poisson), got {s.burstiness}"))
    lengths_ok = True
    if s.length_trace:
        try:
            read_length_trace(s.length_trace)
        except EngineError as e:
            p.append(("serving.length_trace", str(e)))
            lengths_ok = False
    else:
        bad = _length("serving.input_len", s.input_len) + _length("serving.output_len", s.output_len)
        p += bad
        lengths_ok = not bad
    if not lengths_ok or s.prefix_len < 0:
        return p
    total, prompt = max_request_tokens(s), max_prompt_tokens(s)
    if not any(f.startswith("model.path") for f, _ in p):
        limit = max_positions(trial.model)
        if limit and total > limit:
            p.append(("serving.input_len", f"the longest request (prefix + input + output = {total} tokens) exceeds "
                                           f"the model's maximum of {limit} positions"))
    blocks = -(-total // max(1, o.kv_block_size))
    if o.kv_num_blocks and o.kv_num_blocks < blocks:
        p.append(("optimization.kv_num_blocks", f"{o.kv_num_blocks} blocks of {o.kv_block_size} tokens cannot hold the "
                                                f"longest request ({total} tokens needs {blocks}); 0 sizes the pool automatically"))
    if native and b.mode == "continuous" and not b.chunked_prefill:
        # a preempted request is re-prefilled with its generated tokens in one step
        need = total - 1 if o.kv_num_blocks else prompt
        if b.max_batch_tokens < need:
            p.append(("batching.max_batch_tokens", f"must be >= {need} (the longest {'prompt + output - 1' if o.kv_num_blocks else 'prompt'}) "
                                                   f"unless batching.chunked_prefill=true, got {b.max_batch_tokens}"))
    return p
