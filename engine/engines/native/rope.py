"""Rotary position embedding (RoPE), as the Llama family (and Gemma 3) applies it.

The inverse frequencies follow the checkpoint's rope parameters (transformers 5 stores them in
`config.rope_parameters`; older configs in `rope_theta` + `rope_scaling`). Supported types: `default`,
`linear` (position interpolation) and `llama3` (Llama 3.1's frequency-dependent smoothing). Others
(yarn, dynamic, longrope, ...) change more than the frequencies, so they raise instead of silently
producing different logits. Gemma 3 gives parameters per layer type (a local base of 10k for its
sliding-window layers, a global 1M for the full-attention ones): one frequency table per layer type.

cos/sin are computed per call from the positions (a [T, D/2] outer product) rather than from a table
sized by max_position_embeddings: a 128k-position Llama 3 table would cost more memory than the cache
of a short run, and the product is elementwise-identical to transformers' (one multiply per entry).
"""
from __future__ import annotations

import math

import torch

from ...config import EngineError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def _raw_parameters(config) -> dict:
    return dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})


def layer_rope_types(config) -> tuple[str | None, ...]:
    """The rope-parameter keys the config holds per layer type (Gemma 3: sliding_attention with the local
    base, full_attention with the global one); (None,) where one set serves every layer."""
    raw = _raw_parameters(config)
    if raw and all(isinstance(v, dict) for v in raw.values()):
        return tuple(sorted(raw))
    return (None,)


def rope_problem(config) -> str | None:
    """Why these rope parameters cannot be reproduced here, or None (part of support.unsupported)."""
    raw = _raw_parameters(config)
    nested = [isinstance(v, dict) for v in raw.values()]
    if any(nested) and not all(nested):
        return "rope parameters mixing per-layer-type and shared entries are not supported"
    for layer_type in layer_rope_types(config):
        p = rope_parameters(config, layer_type)
        if p["rope_type"] not in SUPPORTED_ROPE_TYPES:
            return f"rope type {p['rope_type']!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        if float(p.get("partial_rotary_factor", 1.0)) != 1.0:
            return "partial rotary embeddings are not supported"
    return None


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """The config's rope parameters (of `layer_type`, where they are given per layer type) as one flat dict
    with at least `rope_type` and `rope_theta`."""
    params = _raw_parameters(config)
    if layer_type is not None:
        params = dict(params[layer_type])
    elif any(isinstance(v, dict) for v in params.values()):
        raise EngineError("per-layer-type rope parameters need a layer type")
    params.setdefault("rope_type", params.get("type", "default"))
    if "rope_theta" not in params:
        params["rope_theta"] = float(getattr(config, "rope_theta", 10000.0))
    return params


def inv_frequencies(config, head_dim: int, layer_type: str | None = None) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies (of `layer_type`'s parameters), scaled as the config asks."""
    why = rope_problem(config)
    if why is not None:
        raise EngineError(f"backend native: {why}; use backend hf")
    p = rope_parameters(config, layer_type)
    kind = p["rope_type"]
    base = float(p["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if kind == "linear":
        inv_freq = inv_freq / float(p["factor"])
    elif kind == "llama3":
        inv_freq = _llama3_scaling(inv_freq, p, config)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, p: dict, config) -> torch.Tensor:
    # Llama 3.1: long wavelengths (low frequencies) are divided by `factor`, short ones kept, and the band
    # in between interpolated smoothly, so the model keeps local resolution while reaching longer contexts.
    factor = float(p["factor"])
    low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_ctx = float(p.get("original_max_position_embeddings") or config.max_position_embeddings)
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> cos [T, D], signed sin [T, D] (float32 math, then cast, as transformers does).

    Llama's rotate-half layout pairs dimension i with i + D/2: out = x*cos + rotate_half(x)*sin with
    rotate_half(x) = [-x2, x1]. We fold the minus sign into the sin table ([-sin, sin]) so that
    rotate_half becomes a plain roll by D/2 and the whole rotation is mul + roll + addcmul (3 kernels
    instead of 6: decode at batch 1 is dominated by per-op overhead, not FLOPs)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    sin = freqs.sin()
    return emb.cos().to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D], cos/signed_sin [T, D] -> x rotated by its position."""
    if x.dtype != torch.float32:
        # 16-bit: round after each product and after the sum, as transformers does (addcmul rounds once,
        # which moves bf16 logits by an ulp or two against the reference)
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)
