"""One decoder for the Llama family: Llama 2/3, Mistral, Qwen2 (QKV bias), SmolLM.

    x = embed(tokens)
    for each block:  x = x + attn(rms_norm(x));  x = x + swiglu_mlp(rms_norm(x))
    logits = lm_head(rms_norm(x))          # lm_head may share the embedding matrix (tied)

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
from .rope import apply_rope, inv_frequencies, rope_cos_sin
from .support import LLAMA_FAMILY, sliding_window, unsupported  # noqa: F401  (LLAMA_FAMILY re-exported)
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
    sliding_window: int | None

    @classmethod
    def from_hf(cls, config) -> "ModelArgs":
        why = unsupported(config)
        if why is not None:
            raise EngineError(f"backend native cannot run this model: {why}; use backend hf")
        heads = config.num_attention_heads
        return cls(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab_size=config.vocab_size,
            rms_norm_eps=float(config.rms_norm_eps),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            sliding_window=sliding_window(config),
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
    def __init__(self, args: ModelArgs, p: dict, prefix: str):
        super().__init__()
        self.q_proj = _projection(p, prefix + "q_proj")
        self.k_proj = _projection(p, prefix + "k_proj")
        self.v_proj = _projection(p, prefix + "v_proj")
        self.o_proj = _projection(p, prefix + "o_proj")
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim

    def forward(self, x, b: int, cos, sin, kernel: AttentionKernel, cache, layer: int, start: int) -> torch.Tensor:
        t = x.shape[0] // b  # x [B*T, hidden]
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # [B, Hq, T, D]
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = kernel(q, k, v, cache, layer, start)  # [B, Hq, T, D]
        return self.o_proj(y.transpose(1, 2).reshape(b * t, self.num_heads * self.head_dim))  # [B*T, hidden]


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, p: dict, prefix: str):
        super().__init__()
        self.gate_proj = _projection(p, prefix + "gate_proj")
        self.up_proj = _projection(p, prefix + "up_proj")
        self.down_proj = _projection(p, prefix + "down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, p: dict, i: int):
        super().__init__()
        pre = f"model.layers.{i}."
        self.input_layernorm = RMSNorm(p[pre + "input_layernorm.weight"], args.rms_norm_eps)
        self.self_attn = Attention(args, p, pre + "self_attn.")
        self.post_attention_layernorm = RMSNorm(p[pre + "post_attention_layernorm.weight"], args.rms_norm_eps)
        self.mlp = MLP(p, pre + "mlp.")

    def forward(self, x, b, cos, sin, kernel, cache, layer, start):
        x = x + self.self_attn(self.input_layernorm(x), b, cos, sin, kernel, cache, layer, start)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, params: dict[str, nn.Parameter], inv_freq: torch.Tensor):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, device="meta")
        self.embed_tokens.weight = params["model.embed_tokens.weight"]
        self.layers = nn.ModuleList(Block(args, params, i) for i in range(args.num_layers))
        self.norm = RMSNorm(params["model.norm.weight"], args.rms_norm_eps)
        if "lm_head#module" in params:
            self.lm_head = params["lm_head#module"]
        else:
            head = params["model.embed_tokens.weight"] if args.tie_word_embeddings else params["lm_head.weight"]
            self.lm_head = _linear(head, None)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [D/2] float32

    @classmethod
    def from_hf(cls, hf_model, num_layers: int | None = None) -> "Transformer":
        """Wrap a loaded transformers Llama-family model; every weight is the HF model's own tensor.
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
        inv_freq = inv_frequencies(config, args.head_dim).to(params["model.norm.weight"].device)
        return cls(args, params, inv_freq)

    def forward(self, tokens: torch.Tensor, start: int, kernel: AttentionKernel, cache=None,
                num_logits: int | None = None) -> torch.Tensor:
        """tokens [B, T] at positions start..start+T-1 (a static batch shares positions) -> logits
        [B, T', V] float32 of the last T' = num_logits (default all) positions. `cache` is None when
        caching is off; then `tokens` must be the whole sequence (start == 0)."""
        assert cache is not None or start == 0, "without a cache the whole sequence is recomputed"
        b, t = tokens.shape
        # The residual stream is kept 2-D [B*T, hidden]: nn.Linear then maps straight onto one GEMM
        # (a 3-D input costs reshape/view wrappers around every one of the 7 * layers projections).
        x = self.embed_tokens(tokens.reshape(-1))  # [B*T, hidden]
        positions = torch.arange(start, start + t, device=tokens.device)  # [T]
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)  # [T, D]
        for i, block in enumerate(self.layers):
            x = block(x, b, cos, sin, kernel, cache, i, start)
        n = t if num_logits is None else num_logits
        if n != t:
            x = x.view(b, t, -1)[:, -n:].reshape(b * n, -1)
        return self.lm_head(self.norm(x)).float().view(b, n, -1)  # [B, n, V]

    def forward_varlen(self, tokens: torch.Tensor, batch: VarlenBatch, kernel: AttentionKernel,
                       logits_rows: torch.Tensor) -> torch.Tensor:
        """A flattened batch of sequences at different positions (continuous batching): tokens [N] at
        `batch.positions` [N], K/V in the paged pool through the batch's block tables -> logits [R, V]
        float32 of the rows `logits_rows` [R] (the last token of each sequence that samples)."""
        x = self.embed_tokens(tokens)  # [N, hidden]; a batch of one "sequence" of N rows for the blocks
        cos, sin = rope_cos_sin(self.inv_freq, batch.positions, x.dtype)  # [N, D] per-token positions
        for i, block in enumerate(self.layers):
            x = block(x, 1, cos, sin, kernel, batch, i, 0)
        x = x.index_select(0, logits_rows)  # norm + lm_head only where a token is sampled
        return self.lm_head(self.norm(x)).float()  # [R, V]
