"""The compiled decode step (`engine.compile=true engine.compile_mode=static`), gpt-fast style.

A one-token step whose every shape is fixed for the session, so one graph serves every step:
  - the KV cache is one preallocated [L, B, Hkv, max_len, D] tensor per K and V (`StaticKVCache`); a step
    writes its new K/V with `index_copy_` at `input_pos` (a tensor, not a Python int: no guard on the
    position) and attends over all max_len slots with a mask `slot <= input_pos`;
  - the step is `torch.compile`d with inductor `freezing` (CPU): the weights become constants, so inductor
    prepacks them for its GEMM kernels once instead of reading the module per call; `static-autotune`
    adds `max_autotune`, which lets inductor pick its C++ GEMM template per shape (minutes of compile on a
    small CPU, the fastest CPU GEMV measured in issue 28); on a GPU CUDA graphs are asked for (what
    mode="reduce-overhead" sets). Cudagraph trees refuse a graph that mutates an input ("mutated inputs")
    unless the input's address is static, so on CUDA, gpt-fast style, the step owns its K/V tensors per
    session shape (reused by every session of that shape, `torch._dynamo.mark_static_address`) and its
    token/position inputs are static buffers filled before each replay. Whether graphs engaged, or the
    reason torch logged for skipping them, is kept in `cudagraphs` (a trial's `info`).
Prefill stays eager (its length varies) and writes into the same tensors through the contiguous-cache
`update` (the per-layer views of the static tensors).

Compilation happens on the first call of each session shape (batch, max_len), i.e. in the warm-up; its
wall time is kept in `compile_s` and reported as its own metric, never inside a timed step.
"""
from __future__ import annotations

import logging
import math
import time

import torch
import torch.nn.functional as F

from ...config import EngineError
from .attention import AttentionKernel
from .kv_cache import ContiguousKVCache

# the decoder layout the static step drives (model.py's Block); other families keep the dynamic path
STATIC_FAMILY = ("llama", "mistral", "qwen2")
STATIC_MODES = ("static", "static-autotune")  # the engine.compile_mode values this step implements


class StaticKVCache(ContiguousKVCache):
    """The contiguous cache the static step runs on: the compiled step takes its two [L, B, Hkv, max_len, D] tensors
    (`k_all`, `v_all`: two guards instead of 2L); on CUDA they are the step's static tensors, reused."""


class _StaticSlots:
    """The cache as the compiled step sees it: write at `input_pos`, read all max_len slots."""

    def __init__(self, k_all: torch.Tensor, v_all: torch.Tensor, input_pos: torch.Tensor):
        self.k_all, self.v_all, self.input_pos = k_all, v_all, input_pos
        # [1, 1, 1, S] True where a slot holds a token this query may see (every slot up to its own)
        self.mask = (torch.arange(k_all.shape[3], device=k_all.device) <= input_pos)[None, None, None, :]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        kc, vc = self.k_all[layer], self.v_all[layer]  # [B, Hkv, S, D]
        kc.index_copy_(2, self.input_pos, k)
        vc.index_copy_(2, self.input_pos, v)
        return kc, vc


class _StaticAttention(AttentionKernel):
    """One query per sequence over the masked static cache, with the trial's kernel (eager | sdpa)."""

    def __init__(self, impl: str):
        super().__init__()
        self.name = impl

    def __call__(self, q, k, v, cache: _StaticSlots, layer: int, start: int, window: int | None = None,
                 scale: float | None = None) -> torch.Tensor:
        # the static step runs the Llama family only (validation refuses the rest): no sliding window here
        assert window is None, "the static decode step has no sliding window"
        k, v = cache.update(layer, k, v)
        if self.name == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=cache.mask, enable_gqa=True, scale=scale)
        b, hq, t, d = q.shape  # eager: the textbook form, as EagerAttention computes it
        hkv, s = k.shape[1], k.shape[2]
        scale = (1.0 / math.sqrt(d)) if scale is None else scale
        scores = torch.matmul(q.reshape(b, hkv, (hq // hkv) * t, d), k.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~cache.mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v).view(b, hq, t, d)


class StaticStep(torch.nn.Module):
    """tokens [B, 1], input_pos [1] long, the static K/V tensors -> logits [B, 1, V] float32. Runs the
    model's own blocks (weights shared), only the cache and attention are the static ones."""

    def __init__(self, model, attention_impl: str):
        super().__init__()
        self.model = model
        self.kernel = _StaticAttention(attention_impl)

    def forward(self, tokens, input_pos, k_all, v_all):
        # the model's own forward (one layer loop), with the position as a tensor and the static slots as cache
        return self.model(tokens, 0, self.kernel, _StaticSlots(k_all, v_all, input_pos), positions=input_pos)


# where torch's inductor logs "skipping cudagraphs due to ..." (torch._inductor.cudagraph_utils' artifact logger)
_CUDAGRAPH_LOG = "torch._inductor.cudagraph_utils.__cudagraphs"
_CUDAGRAPH_PROBE_CALLS = 3  # cudagraph trees: warm-up run, record, first replay; a skip shows within these


class _SkipCapture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


class CompiledDecodeStep:
    """The backend's `decode_step` (same call as the model: tokens, start, kernel, cache) for a
    `StaticKVCache`. `compile_s`: wall time of the calls that compiled (first call per session shape).
    `cudagraphs`: "off (cpu)" | "engaged" | "skipped: <torch's reason>" once the first steps ran on CUDA."""

    def __init__(self, model, attention_impl: str, device: torch.device, mode: str = "static", compile: bool = True):
        if mode not in STATIC_MODES:
            raise EngineError(f"engine.compile_mode {mode!r} is not a static mode; choose one of {STATIC_MODES}")
        if attention_impl not in ("eager", "sdpa"):
            raise EngineError(f"engine.compile_mode={mode} runs attention eager or sdpa, not {attention_impl!r}")
        self.step = StaticStep(model, attention_impl).eval()
        self.device = torch.device(device)
        self.compile_s = 0.0
        self._seen: set = set()
        self._cuda_graphs = compile and self.device.type == "cuda"
        self.cudagraphs = "pending" if self._cuda_graphs else f"off ({self.device.type if compile else 'not compiled'})"
        self._static: dict = {}  # session shape -> (k_all, v_all, tokens, pos): the CUDA-graph static tensors
        self._probe_calls = 0
        self._skips: list[str] = []
        self._fn = self.step
        if compile:
            # freezing: weights as constants, prepacked once for inductor's GEMMs; emulate_precision_casts:
            # fused kernels round 16-bit intermediates where eager does (else greedy tokens drift in bf16)
            options = {"freezing": True, "emulate_precision_casts": True}
            if mode == "static-autotune":
                options["max_autotune"] = True
            if self.device.type == "cuda":
                options["triton.cudagraphs"] = True  # as mode="reduce-overhead"; static inputs: new_cache
                # no freezing on CUDA (its prepacking is a CPU GEMM thing): torch 2.11's freezing path drops the
                # weights from the inputs without shifting the static-input indices, so the static K/V are
                # not seen as static and graphs are skipped ("mutated inputs", seen on an H200 2026-12-04)
                del options["freezing"]
            try:
                self._fn = torch.compile(self.step, dynamic=False, fullgraph=True, options=options)
            except Exception as e:  # pragma: no cover - depends on the toolchain
                raise EngineError(f"engine.compile_mode={mode} failed to set up torch.compile on {device}: {e}") from e

    def new_cache(self, num_layers: int, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype, device: torch.device) -> StaticKVCache:
        """The session's cache. On CUDA with graphs its K/V tensors are this step's static ones for the shape
        (one live session per shape, as a trial runs them), zeroed; elsewhere fresh tensors, as before."""
        dims = (num_layers, batch_size, max_len, num_kv_heads, head_dim)
        if not self._cuda_graphs:
            return StaticKVCache(*dims, dtype=dtype, device=device)
        key = (dims, dtype)
        if key not in self._static:
            shape = (num_layers, batch_size, num_kv_heads, max_len, head_dim)
            bufs = (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                    torch.zeros((batch_size, 1), dtype=torch.long, device=device),
                    torch.zeros((1,), dtype=torch.long, device=device))
            for t in bufs:  # a fixed address: dynamo guards on it, cudagraph trees then accept its mutation
                torch._dynamo.mark_static_address(t)
            self._static[key] = bufs
        k_all, v_all = self._static[key][:2]
        k_all.zero_()
        v_all.zero_()
        return StaticKVCache(*dims, dtype=dtype, device=device, buffers=(k_all, v_all))

    def _inputs(self, tokens: torch.Tensor, start: int, cache: StaticKVCache):
        if not self._cuda_graphs:
            return tokens, torch.tensor([start], dtype=torch.long, device=tokens.device)
        for bufs in self._static.values():
            if bufs[0] is cache.k_all:
                tok, pos = bufs[2], bufs[3]
                tok.copy_(tokens)  # into the static inputs the graph was recorded with (device-side, no sync)
                pos.fill_(start)
                return tok, pos
        raise EngineError("the static compiled decode step on CUDA needs a cache from its own new_cache()")

    def _run(self, tokens, pos, cache):
        if self._cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()  # the previous replay's output was cloned: reuse its memory
        return self._fn(tokens, pos, cache.k_all, cache.v_all)

    def __call__(self, tokens: torch.Tensor, start: int, kernel, cache) -> torch.Tensor:
        if not isinstance(cache, StaticKVCache):
            raise EngineError("the static compiled decode step needs the static KV cache (kv_cache.mode=contiguous)")
        tokens, pos = self._inputs(tokens, start, cache)
        key = (tuple(tokens.shape), tuple(cache.k_all.shape), cache.k_all.dtype)
        probe = self._cuda_graphs and self._probe_calls < _CUDAGRAPH_PROBE_CALLS
        if probe:  # listen for torch's "skipping cudagraphs due to ..." over the first steps
            from torch._dynamo.utils import counters

            capture, log = _SkipCapture(), logging.getLogger(_CUDAGRAPH_LOG)
            log.addHandler(capture)
            skips_before = counters["inductor"]["cudagraph_skips"]
        try:
            if key in self._seen:
                out = self._run(tokens, pos, cache)
            else:  # this call compiles: time it apart from every timed step
                t0 = time.perf_counter()
                out = self._run(tokens, pos, cache)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                self.compile_s += time.perf_counter() - t0
                self._seen.add(key)
        finally:
            if probe:
                log.removeHandler(capture)
        if probe:
            self._probe_calls += 1
            self._skips += capture.messages
            if counters["inductor"]["cudagraph_skips"] > skips_before and not capture.messages:
                self._skips.append("skipped (reason not logged)")
            if self._skips:
                # torch's first line names the reason; the stack trace after it points into this file
                self.cudagraphs = "skipped: " + " | ".join(dict.fromkeys(m.strip().splitlines()[0] for m in self._skips))
            elif self._probe_calls == _CUDAGRAPH_PROBE_CALLS:
                self.cudagraphs = "engaged"
        # CUDA graphs reuse their output buffer at the next replay
        return out.clone() if self.device.type == "cuda" else out
