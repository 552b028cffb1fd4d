"""Attention kernels, switchable by name (the same names as the hf backend's): eager | sdpa | flash.

Every kernel computes causal attention of T new queries (at positions start..start+T-1) over the
S = start + T keys of their sequence, with grouped-query attention (Hq query heads share Hkv KV heads).
Shapes: q [B, Hq, T, D]; k, v [B, Hkv, S, D]; output [B, Hq, T, D].
Two per-layer options (Gemma 3): `window` W, a sliding window (query p sees keys j with p - W < j <= p,
transformers' rule; keys no query of the call can see are sliced off first, so a window also saves work),
and `scale`, the score scaling (default 1/sqrt(D); Gemma's query_pre_attn_scalar**-0.5).

Each kernel also records `peak_bytes`: the largest transient memory one call materialized beyond its
inputs and output. That is where the O(N^2) (eager: the full scores matrix) vs O(N) (fused kernels)
difference of the seed article shows up.
"""
from __future__ import annotations

import importlib.util
import math

import torch
import torch.nn.functional as F

from ...config import ATTENTION_IMPLS, EngineError
from .varlen import VarlenBatch


def causal_mask(start: int, t: int, s: int, device: torch.device, window: int | None = None,
                key_start: int = 0) -> torch.Tensor:
    """[T, S - key_start] bool, True where query start+i may attend key j (key_start <= j <= start + i, and
    j > start + i - window under a sliding window)."""
    q_pos = torch.arange(start, start + t, device=device)[:, None]
    k_pos = torch.arange(key_start, s, device=device)[None, :]
    if window is None:
        return k_pos <= q_pos
    return (k_pos <= q_pos) & (k_pos > q_pos - window)


def window_start(start: int, window: int | None) -> int:
    """The first key any query at positions >= start can see under `window` (0 without one)."""
    return 0 if window is None else max(0, start - window + 1)


class TreeRow:
    """A row of context-shared trees (engine/engines/packing.py) passed where a static batch passes its cache:
    B = 1, T = N tokens at their own positions; every layer attends by the row's mask (under its window)."""

    def __init__(self, pack):
        self.pack = pack
        self.positions = pack.positions  # [N], read by Transformer.forward_varlen for RoPE

    def attend(self, kernel, layer: int, q, k, v, window: int | None = None, scale: float | None = None):
        return kernel.attend_masked(q, k, v, self.pack.mask(window), scale)


class AttentionKernel:
    name = "base"
    # the K/V cache's element type where it is not the activations' (kv_cache.dtype=bfloat16 under fp32): the new
    # keys and values are rounded to it before any use, so every path -- a cache of that dtype, the paged pool, the
    # cacheless scoring forward -- attends over the values a cache of that type holds
    kv_dtype: torch.dtype | None = None

    def __init__(self) -> None:
        self.peak_bytes = 0

    def reset_peak(self) -> None:
        self.peak_bytes = 0

    def _record(self, nbytes: int) -> None:
        # Skipped inside a torch.compile'd decode step (bookkeeping would break the graph); the peak is
        # set by the prefill, which always runs eagerly and materializes far more than one-token steps.
        if not torch.compiler.is_compiling():
            self.peak_bytes = max(self.peak_bytes, int(nbytes))

    def __call__(self, q, k, v, cache, layer: int, start: int, window: int | None = None,
                 scale: float | None = None) -> torch.Tensor:
        """q [B,Hq,T,D] and the new k, v [B,Hkv,T,D]; `cache` (or None when caching is off) stores the new
        keys/values and returns all S of them. Returns [B, Hq, T, D]. A `VarlenBatch` in place of the cache
        (B = 1, T = N flattened tokens of sequences at different positions) attends per sequence."""
        k, v = self.as_stored(k), self.as_stored(v)
        if isinstance(cache, (VarlenBatch, TreeRow)):
            return cache.attend(self, layer, q, k, v, window, scale)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        return self.attend(q, k, v, start, window=window, scale=scale)

    def as_stored(self, x: torch.Tensor) -> torch.Tensor:
        """`x` (new keys or values) rounded to the K/V cache's element type, in its own dtype."""
        kv = self.kv_dtype
        return x if kv is None or kv == x.dtype else x.to(kv).to(x.dtype)

    attend_masked = None  # (q [1, Hq, N, D], k, v [1, Hkv, N, D], mask [N, N] bool, scale) -> [1, Hq, N, D]

    def attend(self, q, k, v, start: int, key_mask: torch.Tensor | None = None, window: int | None = None,
               scale: float | None = None) -> torch.Tensor:
        """`key_mask` [B, S] bool (True = a key to attend) masks the padding of decode rows of different
        lengths gathered into one batch; only for one query per sequence (T == 1), and it must already
        exclude the keys outside `window` (each row has its own position)."""
        raise NotImplementedError


class EagerAttention(AttentionKernel):
    """Textbook attention: materialize scores = q k^T / sqrt(D) [.., T, S], mask, softmax, weighted sum."""

    name = "eager"

    def attend(self, q, k, v, start, key_mask=None, window=None, scale=None):
        b, hq, t, d = q.shape
        lo = 0 if key_mask is not None else window_start(start, window)
        k, v = k[:, :, lo:], v[:, :, lo:]  # keys outside every query's window never enter the scores
        hkv, s = k.shape[1], k.shape[2]
        g = hq // hkv
        # GQA without copying K/V: the g query heads of one KV head become g*T query rows of it.
        qg = q.reshape(b, hkv, g * t, d)
        scores = torch.matmul(qg, k.transpose(-1, -2))  # [B, Hkv, g*T, S]
        scores.mul_(1.0 / math.sqrt(d) if scale is None else scale)
        transient = scores.numel() * scores.element_size()
        if key_mask is not None:
            assert t == 1, "key_mask is for one query per sequence"
            scores.masked_fill_(~key_mask[:, None, None, :], float("-inf"))
        if t > 1:  # a single new query is the newest position: it may see every (windowed) key
            mask = causal_mask(start, t, lo + s, q.device, window, lo)  # [T, S]
            scores.view(b, hkv, g, t, s).masked_fill_(~mask, float("-inf"))
            transient += 2 * mask.numel()  # the mask and its negation (bool)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # [B, Hkv, g*T, S]
        transient += probs.numel() * probs.element_size()  # scores and probs are alive together
        self._record(transient)
        out = torch.matmul(probs, v)  # [B, Hkv, g*T, D]
        return out.view(b, hq, t, d)


    def attend_masked(self, q, k, v, mask, scale=None):
        b, hq, t, d = q.shape
        hkv = k.shape[1]
        g = hq // hkv
        scores = torch.matmul(q.reshape(b, hkv, g * t, d), k.transpose(-1, -2))  # [B, Hkv, g*T, N]
        scores.mul_(1.0 / math.sqrt(d) if scale is None else scale)
        scores.view(b, hkv, g, t, -1).masked_fill_(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        self._record(scores.numel() * scores.element_size() + probs.numel() * probs.element_size() + 2 * mask.numel())
        return torch.matmul(probs, v).view(b, hq, t, d)


class SdpaAttention(AttentionKernel):
    """torch.nn.functional.scaled_dot_product_attention (fused; on CPU the flash-style tiled kernel)."""

    name = "sdpa"

    def attend(self, q, k, v, start, key_mask=None, window=None, scale=None):
        b, hq, t, d = q.shape
        lo = 0 if key_mask is not None else window_start(start, window)
        k, v = k[:, :, lo:], v[:, :, lo:]  # keys outside every query's window are never read
        s = k.shape[2]
        if key_mask is not None:  # decode rows of different lengths, padded to one S
            assert t == 1, "key_mask is for one query per sequence"
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask[:, None, None, :], enable_gqa=True,
                                                 scale=scale)
            mask_bytes = key_mask.numel()
        elif t == s and start == 0 and (window is None or s <= window):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=scale)
            mask_bytes = 0
        elif t == 1:
            # One new query is the newest position of its sequence: it sees every (windowed) key, no mask.
            out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, scale=scale)
            mask_bytes = 0
        else:  # a chunk appended to a cached prefix (speculative verification, chunked prefill), or a window
            mask = causal_mask(start, t, lo + s, q.device, window, lo)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=scale)
            mask_bytes = mask.numel()
        if not torch.compiler.is_compiling():
            self._record(sdpa_transient_bytes(b, hq, t, s, d, q.element_size(), q.device) + mask_bytes)
        return out

    def attend_masked(self, q, k, v, mask, scale=None):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=scale)
        self._record(sdpa_transient_bytes(q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3],
                                          q.element_size(), q.device) + mask.numel())
        return out


def sdpa_transient_bytes(b: int, h: int, t: int, s: int, d: int, elsize: int, device: torch.device) -> int:
    """Analytical transient memory of PyTorch's fused attention (not measured: the CPU allocator keeps no
    statistics). On CPU, ATen's FlashAttentionKernel.cpp tiles queries in blocks of qSplit (32/64/256
    by T) and keys in blocks of kvSplit=512, with one float32 scratch buffer per thread of
    qSplit*kvSplit (scores tile) + 2*qSplit (running max, sum) + qSplit*D (accumulator), plus a float32
    logsumexp [B, H, T]. On CUDA the flash/mem-efficient kernels keep tiles in SRAM; only the logsumexp
    is global memory. Either way it grows with T + S, not T * S."""
    lse = b * h * t * 4
    if device.type == "cuda":
        return lse
    q_split = 256 if t >= 768 else (64 if t >= 192 else 32)
    q_split, kv_split = min(q_split, t), min(512, s)
    per_thread = q_split * kv_split + 2 * q_split + q_split * d
    return torch.get_num_threads() * per_thread * 4 + lse


class FlashAttention(AttentionKernel):
    """The flash-attn package (CUDA only). With a cache it uses `flash_attn_with_kvcache`, which appends
    the new K/V into the cache itself (contiguous or paged via the block table) and attends in one kernel."""

    name = "flash"

    def __init__(self, device: torch.device):
        super().__init__()
        check_flash(device)
        from flash_attn import flash_attn_func, flash_attn_with_kvcache  # guarded: CUDA + package present

        self._func = flash_attn_func
        self._with_kvcache = flash_attn_with_kvcache

    def __call__(self, q, k, v, cache, layer, start, window=None, scale=None):
        if isinstance(cache, VarlenBatch):
            raise EngineError("attention=flash has no varlen (continuous batching) path yet; use sdpa")
        b, hq, t, d = q.shape
        # flash-attn's layout is [B, T, H, D]; a transpose of ours is a view with unit last-dim stride.
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        # flash-attn's window (left, right): query i sees keys i-left..i+right; (-1, -1) is unlimited
        opts = dict(causal=True, softmax_scale=scale, window_size=(-1, -1) if window is None else (window - 1, 0))
        if cache is None:
            out = self._func(qt, kt, vt, **opts)
        else:
            out = self._with_kvcache(qt, k=kt, v=vt, **opts, **cache.flash_kwargs(layer))
        self._record(b * hq * t * 4)  # logsumexp; tiles live in SRAM
        return out.transpose(1, 2)


def check_flash(device: torch.device) -> None:
    if torch.device(device).type != "cuda":
        raise EngineError("attention=flash needs a CUDA GPU (FlashAttention has no CPU kernels); use sdpa")
    if importlib.util.find_spec("flash_attn") is None:
        raise EngineError("attention=flash needs the flash-attn package (pip install flash-attn); or use sdpa")


def make_attention(trial, device: torch.device) -> AttentionKernel:
    """The attention kernel of `trial` (a TrialConfig: `attention.impl`, and any attention knob a kernel
    reads) on `device`."""
    name = trial.attention.impl
    if name == "eager":
        return EagerAttention()
    if name == "sdpa":
        return SdpaAttention()
    if name == "flash":
        return FlashAttention(device)
    raise EngineError(f"attention {name!r} unknown; choose one of {ATTENTION_IMPLS}")
