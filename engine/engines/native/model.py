"""One decoder for the Llama family (Llama 2/3, Mistral, Qwen2 (QKV bias), SmolLM) and Gemma 3.

    x = embed(tokens)
    for each block:  x = x + attn(rms_norm(x));  x = x + swiglu_mlp(rms_norm(x))
    logits = lm_head(rms_norm(x))          # lm_head may share the embedding matrix (tied)

Gemma 3 differs in: embeddings scaled by sqrt(hidden); RMSNorm weights as (1 + w); each sublayer both
pre- and post-normed (x = x + post_norm(attn(pre_norm(x)))); q and k RMS-normed per head before RoPE;
scores scaled by query_pre_attn_scalar**-0.5; a gated GELU (tanh) MLP; per-layer attention types
(`layer_types`): sliding-window layers with the local RoPE base, global layers with the global base;
optionally tanh-softcapped final logits.

The weights are the loaded transformers model's own tensors (shared, not copied), wrapped in plain
`nn.Linear` modules so a quantization pass can swap them later without this file knowing.
The model takes positions and a KV cache explicitly and knows nothing of batching or sessions:
`forward` runs a static batch sharing positions, `forward_varlen` a flattened batch of sequences of
different lengths and positions over a paged pool (varlen.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...config import EngineError
from .attention import AttentionKernel
from .rope import apply_rope, inv_frequencies, layer_rope_types, rope_cos_sin
from .support import GEMMA3, LLAMA_FAMILY, layer_windows, sliding_window, unsupported  # noqa: F401  (LLAMA_FAMILY re-exported)
from .varlen import VarlenBatch


@dataclass(frozen=True)
class ModelArgs:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    sliding_window: int | None  # a window the runtime does not implement (refused beyond it), see support.py
    gemma: bool = False  # Gemma 3's block, norms, embedding scale and activation (see the module doc)
    layer_windows: tuple = ()  # per layer: the sliding window applied (None: global attention)
    layer_rope: tuple = ()  # per layer: the key of its RoPE parameters (None: the one shared set)
    attn_scale: float | None = None  # score scaling; None = 1/sqrt(head_dim)
    final_softcap: float | None = None

    @classmethod
    def from_hf(cls, config) -> "ModelArgs":
        why = unsupported(config)
        if why is not None:
            raise EngineError(f"backend native cannot run this model: {why}; use backend hf")
        heads = config.num_attention_heads
        gemma = config.model_type in GEMMA3
        windows = layer_windows(config)
        rope_keys = layer_rope_types(config)
        if rope_keys == (None,):
            rope = (None,) * config.num_hidden_layers
        else:  # Gemma 3: the layer's attention type names its RoPE parameters
            rope = tuple(config.layer_types[: config.num_hidden_layers])
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        scalar = getattr(config, "query_pre_attn_scalar", None) if gemma else None
        return cls(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab_size=config.vocab_size,
            rms_norm_eps=float(config.rms_norm_eps),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            sliding_window=sliding_window(config),
            gemma=gemma,
            layer_windows=windows,
            layer_rope=rope,
            attn_scale=float(scalar) ** -0.5 if scalar else None,
            final_softcap=getattr(config, "final_logit_softcapping", None) if gemma else None,
        )


class RMSNorm(nn.Module):
    def __init__(self, weight: nn.Parameter, eps: float):
        super().__init__()
        self.weight = weight
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused kernel instead of six (same arithmetic)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Statistics in float32 for half-precision activations, then cast back, as the reference does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from 1, and the product is taken in float32 before
    the cast back (Llama casts first), exactly as transformers' Gemma3RMSNorm."""

    def __init__(self, weight: nn.Parameter, eps: float):
        super().__init__()
        self.weight = weight
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).type_as(x)


def _norm(args: "ModelArgs", weight: nn.Parameter) -> nn.Module:
    return (GemmaRMSNorm if args.gemma else RMSNorm)(weight, args.rms_norm_eps)


def _projection(p: dict, name: str) -> nn.Module:
    """The loaded model's own projection module when there is one: a plain nn.Linear, or whatever a
    quantization pass put there (bitsandbytes Linear8bitLt/Linear4bit, our INT8 modules), so the native
    backend inherits every quantization level without knowing about any. `p` also maps module names to
    modules under the key "<name>#module"."""
    mod = p.get(name + "#module")
    if mod is not None:
        return mod
    return _linear(p[name + ".weight"], p.get(name + ".bias"))


def _linear(weight: nn.Parameter, bias: nn.Parameter | None) -> nn.Linear:
    # Built on the meta device so no memory is allocated, then pointed at the checkpoint's tensors.
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    lin.weight = weight
    if bias is not None:
        lin.bias = bias
    return lin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, p: dict, prefix: str, layer: int):
        super().__init__()
        self.q_proj = _projection(p, prefix + "q_proj")
        self.k_proj = _projection(p, prefix + "k_proj")
        self.v_proj = _projection(p, prefix + "v_proj")
        self.o_proj = _projection(p, prefix + "o_proj")
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        # Gemma 3: per-head RMSNorm of q and k before RoPE
        self.q_norm = _norm(args, p[prefix + "q_norm.weight"]) if args.gemma else None
        self.k_norm = _norm(args, p[prefix + "k_norm.weight"]) if args.gemma else None
        self.window = args.layer_windows[layer] if args.layer_windows else None
        self.scale = args.attn_scale

    def forward(self, x, b: int, cos, sin, kernel: AttentionKernel, cache, layer: int, start: int) -> torch.Tensor:
        t = x.shape[0] // b  # x [B*T, hidden]
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # [B, Hq, T, D]
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = kernel(q, k, v, cache, layer, start, window=self.window, scale=self.scale)  # [B, Hq, T, D]
        return self.o_proj(y.transpose(1, 2).reshape(b * t, self.num_heads * self.head_dim))  # [B*T, hidden]


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); act = silu (SwiGLU, Llama) or tanh-GELU (GeGLU, Gemma)."""

    def __init__(self, p: dict, prefix: str, gelu: bool = False):
        super().__init__()
        self.gate_proj = _projection(p, prefix + "gate_proj")
        self.up_proj = _projection(p, prefix + "up_proj")
        self.down_proj = _projection(p, prefix + "down_proj")
        self.act = _gelu_tanh if gelu else F.silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, p: dict, i: int):
        super().__init__()
        pre = f"model.layers.{i}."
        self.input_layernorm = RMSNorm(p[pre + "input_layernorm.weight"], args.rms_norm_eps)
        self.self_attn = Attention(args, p, pre + "self_attn.", i)
        self.post_attention_layernorm = RMSNorm(p[pre + "post_attention_layernorm.weight"], args.rms_norm_eps)
        self.mlp = MLP(p, pre + "mlp.")

    def forward(self, x, b, cos, sin, kernel, cache, layer, start):
        x = x + self.self_attn(self.input_layernorm(x), b, cos, sin, kernel, cache, layer, start)
        return x + self.mlp(self.post_attention_layernorm(x))


class GemmaBlock(nn.Module):
    """Gemma 3: both sublayers normed before and after (post_attention_layernorm norms the attention's
    output here, where in Llama it is the MLP's input norm)."""

    def __init__(self, args: ModelArgs, p: dict, i: int):
        super().__init__()
        pre = f"model.layers.{i}."
        self.input_layernorm = _norm(args, p[pre + "input_layernorm.weight"])
        self.self_attn = Attention(args, p, pre + "self_attn.", i)
        self.post_attention_layernorm = _norm(args, p[pre + "post_attention_layernorm.weight"])
        self.pre_feedforward_layernorm = _norm(args, p[pre + "pre_feedforward_layernorm.weight"])
        self.mlp = MLP(p, pre + "mlp.", gelu=True)
        self.post_feedforward_layernorm = _norm(args, p[pre + "post_feedforward_layernorm.weight"])

    def forward(self, x, b, cos, sin, kernel, cache, layer, start):
        y = self.self_attn(self.input_layernorm(x), b, cos, sin, kernel, cache, layer, start)
        x = x + self.post_attention_layernorm(y)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, params: dict[str, nn.Parameter], inv_freqs: dict):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, device="meta")
        self.embed_tokens.weight = params["model.embed_tokens.weight"]
        # Gemma scales the embedding by sqrt(hidden), rounded to the weights' dtype (as transformers does)
        self.embed_scale = args.hidden_size ** 0.5 if args.gemma else None
        block = GemmaBlock if args.gemma else Block
        self.layers = nn.ModuleList(block(args, params, i) for i in range(args.num_layers))
        self.norm = _norm(args, params["model.norm.weight"])
        if "lm_head#module" in params:
            self.lm_head = params["lm_head#module"]
        else:
            head = params["model.embed_tokens.weight"] if args.tie_word_embeddings else params["lm_head.weight"]
            self.lm_head = _linear(head, None)
        # one [D/2] float32 frequency table per RoPE parameter set (Gemma 3: local and global bases)
        self.rope_keys = sorted(inv_freqs, key=str)
        for j, key in enumerate(self.rope_keys):
            self.register_buffer(f"inv_freq{j}", inv_freqs[key], persistent=False)
        self.layer_rope = [self.rope_keys.index(key) for key in args.layer_rope[: args.num_layers]]

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> list:
        """(cos, sin) [T, D] per RoPE parameter set, computed once per forward for all layers."""
        return [rope_cos_sin(getattr(self, f"inv_freq{j}"), positions, dtype) for j in range(len(self.rope_keys))]

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale).to(x.dtype)
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(x)).float()
        cap = self.args.final_softcap
        if cap is not None:  # tanh softcapping of the final logits (Gemma 2 style, when configured)
            logits = torch.tanh(logits / cap) * cap
        return logits

    @classmethod
    def from_hf(cls, hf_model, num_layers: int | None = None) -> "Transformer":
        """Wrap a loaded transformers Llama-family or Gemma 3 model; every weight is the HF model's own tensor.
        `num_layers` keeps only the first blocks (then the final norm and LM head): an early-exit model
        sharing all its weights with the full one, e.g. a self-speculative draft."""
        config = hf_model.config
        args = ModelArgs.from_hf(config)
        if num_layers is not None:
            if not 1 <= num_layers <= args.num_layers:
                raise EngineError(f"num_layers must be in [1, {args.num_layers}], got {num_layers}")
            args = dataclasses.replace(args, num_layers=num_layers)
        params: dict = {name: p for name, p in hf_model.named_parameters(remove_duplicate=False)}
        projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
        params.update({f"{name}#module": m for name, m in hf_model.named_modules() if name.split(".")[-1] in projections})
        missing = [n for n in ("model.embed_tokens.weight", "model.norm.weight") if n not in params]
        if missing:
            raise EngineError(f"checkpoint layout not recognised by backend native (missing {missing}); use backend hf")
        device = params["model.norm.weight"].device
        inv_freqs = {key: inv_frequencies(config, args.head_dim, key).to(device) for key in set(args.layer_rope)}
        return cls(args, params, inv_freqs)

    def forward(self, tokens: torch.Tensor, start: int, kernel: AttentionKernel, cache=None,
                num_logits: int | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T] at positions start..start+T-1 (a static batch shares positions) -> logits
        [B, T', V] float32 of the last T' = num_logits (default all) positions. `cache` is None when
        caching is off; then `tokens` must be the whole sequence (start == 0). `positions` [T]: the positions as a
        tensor instead (the compiled static step: no guard on a Python int; its cache knows where to write)."""
        assert cache is not None or start == 0, "without a cache the whole sequence is recomputed"
        b, t = tokens.shape
        # The residual stream is kept 2-D [B*T, hidden]: nn.Linear then maps straight onto one GEMM
        # (a 3-D input costs reshape/view wrappers around every one of the 7 * layers projections).
        x = self._embed(tokens.reshape(-1))  # [B*T, hidden]
        if positions is None:
            positions = torch.arange(start, start + t, device=tokens.device)  # [T]
        rope = self._rope(positions, x.dtype)  # per parameter set: cos, sin [T, D]
        for i, block in enumerate(self.layers):
            cos, sin = rope[self.layer_rope[i]]
            x = block(x, b, cos, sin, kernel, cache, i, start)
        n = t if num_logits is None else num_logits
        if n != t:
            x = x.view(b, t, -1)[:, -n:].reshape(b * n, -1)
        return self._logits(x).view(b, n, -1)  # [B, n, V]

    def forward_varlen(self, tokens: torch.Tensor, batch: VarlenBatch, kernel: AttentionKernel,
                       logits_rows: torch.Tensor) -> torch.Tensor:
        """A flattened batch of sequences at different positions (continuous batching): tokens [N] at
        `batch.positions` [N], K/V in the paged pool through the batch's block tables -> logits [R, V]
        float32 of the rows `logits_rows` [R] (the last token of each sequence that samples)."""
        x = self._embed(tokens)  # [N, hidden]; a batch of one "sequence" of N rows for the blocks
        rope = self._rope(batch.positions, x.dtype)  # per parameter set: cos, sin [N, D] per-token positions
        for i, block in enumerate(self.layers):
            cos, sin = rope[self.layer_rope[i]]
            x = block(x, 1, cos, sin, kernel, batch, i, 0)
        x = x.index_select(0, logits_rows)  # norm + lm_head only where a token is sampled
        return self._logits(x)  # [R, V]
