"""The decode step in C++ (`engine.compile=true engine.compile_mode=cpp`): one call per token, outside torch's dispatch.

At batch-1 decode on a small CPU the GEMVs are not the whole token: ~200 small torch ops per token (norms, RoPE,
residual adds, KV writes, the attention call) each pay torch's dispatcher and the Python module tree. This step runs
the whole layer loop of one token in one C++ call (csrc/decode_step.cpp) with one OpenMP parallel region, reading
the model's own weight tensors (the same objects the Python path uses: nn.Linear / DenseGemvLinear fp32 or bf16,
WeightOnlyInt8Linear, WeightOnlyInt4Linear, DynamicInt8Linear) through the kernels of engine/kernels/gemv.h, and
writing the new K/V into the session's contiguous cache (the tensors prefill, in torch by default, fills). With
`engine.prefill=cpp` the prompt runs through the same step too: its T positions as T rows (`prefill`, `step_rows`),
every row's key and value stored before any row attends, each row attending over its sequence up to its position.

It runs: the Llama family and Gemma 3; model.dtype float32 or bfloat16 (bf16 widened exactly and rounded where
torch rounds, so it needs no bf16 arithmetic from the CPU); the K/V cache in the model's dtype or bf16
(`kv_cache.dtype=bfloat16`: half the bytes a long-context token reads; with fp32 activations the new key and value
are rounded to bf16 as the cache stores them, as the torch path does); B sequences at once -- a static batch over the
contiguous or paged cache, or continuous batching's decode rows over the serving pool, each sequence at its own
position (every weight row read once for all B; `decode_varlen`); attention
eager or sdpa (whose bf16 rounding it reproduces); on a CPU with AVX2 or AVX-512. Everything else is refused before
launch (`problems`, called by the native engine's check) with the reason.

The descriptor structs and integer codes below are the C++ ones written again in ctypes; the library reports its own
sizes, offsets and codes (`isw_step_layout`) and the step refuses to load where they differ (`layout_problems`).
"""
from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import torch
from torch import nn

from ...config import EngineError
from .rope import rope_cos_sin

SOURCE = Path(__file__).resolve().parent / "csrc" / "decode_step.cpp"
# the quant levels whose modules it reads (bitsandbytes' are not ours); the dtypes of its activations
LEVELS = ("none", "int8-weight", "int4-weight", "int8-dynamic")
DTYPES = ("float32", "bfloat16")
ATTENTION = ("eager", "sdpa")
F32, BF16, I8, I4, W8A8, W4A8 = range(6)  # csrc/decode_step.cpp's Kind
PHASES = ("qkv", "attention", "o_proj", "gate_up", "down", "head", "outside")  # isw_step_profile's order


class _Lin(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int64), ("N", ctypes.c_int64), ("K", ctypes.c_int64), ("G", ctypes.c_int64),
                ("w", ctypes.c_void_p), ("s", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


_PROJ = ("q", "k", "v", "o", "gate", "up", "down")
_NORMS = ("in_norm", "post_attn_norm", "pre_ff_norm", "post_ff_norm", "q_norm", "k_norm")


class _Layer(ctypes.Structure):
    _fields_ = ([(p, _Lin) for p in _PROJ] + [(n, ctypes.c_void_p) for n in _NORMS]
                + [("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p), ("window", ctypes.c_int64),
                   ("rope", ctypes.c_int64)])


class _Model(ctypes.Structure):
    _fields_ = ([(n, ctypes.c_int64) for n in ("num_layers", "hidden", "inter", "hq", "hkv", "head_dim", "vocab",
                                               "max_len", "bf16", "gemma", "eager_attention", "kv_bf16")]
                + [(n, ctypes.c_double) for n in ("eps", "attn_scale", "softcap", "embed_scale")]
                + [("embed", ctypes.c_void_p), ("final_norm", ctypes.c_void_p), ("head", _Lin),
                   ("cos", ctypes.c_void_p * 2), ("sin", ctypes.c_void_p * 2), ("layers", ctypes.POINTER(_Layer))])


class _KVLayout(ctypes.Structure):  # where (sequence, KV group, position) sit in a layer's cache (csrc KVLayout)
    _fields_ = [("blocks", ctypes.c_void_p)] + [(n, ctypes.c_int64) for n in (
        "max_blocks", "block_size", "blk_stride", "tok_stride", "head_stride")]


def _layout() -> dict[str, int | str]:
    """What this binding assumes of csrc/decode_step.cpp, named as its `isw_step_layout` names it (read at call time:
    the structs and codes as this module holds them now)."""
    sizes = {f"sizeof({n})": ctypes.sizeof(c) for n, c in (("Lin", _Lin), ("Layer", _Layer), ("Model", _Model),
                                                            ("KVLayout", _KVLayout))}
    offsets = {f"{n}.{f}": getattr(c, f).offset if hasattr(c, f) else "(no such field)" for n, c, fs in (
        ("Lin", _Lin, ("w", "bias")), ("Layer", _Layer, ("in_norm", "k_cache", "window", "rope")),
        ("Model", _Model, ("eager_attention", "kv_bf16", "eps", "embed", "head", "cos", "sin", "layers")),
        ("KVLayout", _KVLayout, ("max_blocks", "head_stride"))) for f in fs}
    codes = {"F32": F32, "BF16": BF16, "I8": I8, "I4": I4, "W8A8": W8A8, "W4A8": W4A8, "PHASES": len(PHASES)}
    return {**sizes, **offsets, **codes}


def layout_problems(reported: str) -> list[str]:
    """Where the library's own layout (`isw_step_layout`: "name=value ...") and this binding's differ: a struct or a
    code changed on one side only would make the step read the wrong memory, silently."""
    theirs = dict(kv.split("=", 1) for kv in reported.split())
    ours = _layout()
    out = [f"{k}: C++ {theirs.get(k, '(not reported)')}, ctypes {v}" for k, v in ours.items() if theirs.get(k) != str(v)]
    return out + [f"{k}: C++ {v}, the binding does not check it" for k, v in theirs.items() if k not in ours]


def problems(trial, model_type: str | None) -> list[tuple[str, str]]:
    """Why `trial` cannot run the C++ step, as (config key, reason) pairs; [] when it can (as far as a config and
    this machine tell: the build itself is tried at load, and its failure named there)."""
    from . import support
    from ...quant_kernels import cpu_tiers

    p = []
    if trial.model.dtype not in DTYPES:
        p.append(("model.dtype", f"engine.compile_mode=cpp runs {' or '.join(DTYPES)}, not {trial.model.dtype}"))
    if trial.quant.level not in LEVELS:
        p.append(("quant.level", f"engine.compile_mode=cpp reads the weights of quant levels {', '.join(LEVELS)}, "
                                 f"not {trial.quant.level}"))
    if model_type is not None and model_type not in support.FAMILIES:
        p.append(("engine.compile_mode", f"cpp runs the Llama family and Gemma 3, not model_type {model_type!r}"))
    if cpu_tiers()[0] == "scalar":
        p.append(("engine.compile_mode", "cpp needs a CPU with AVX2 (or AVX-512); this one has neither"))
    from ...quant_kernels import _compiler

    if shutil.which(_compiler()[0]) is None:
        p.append(("engine.compile_mode", f"cpp is compiled on this machine and needs a C++ compiler "
                                         f"({_compiler()[0]}; set CXX), none found"))
    return p


def _kind_of(mod: nn.Module, name: str, act: torch.dtype) -> tuple[_Lin, list]:
    """The C++ descriptor of one linear module, and the tensors it points into (kept alive by the step)."""
    from ...quant import DenseGemvLinear, DynamicInt8Linear, WeightOnlyInt4Linear, WeightOnlyInt8Linear

    keep: list = []
    bias = getattr(mod, "bias", None)
    b = None
    if bias is not None:
        b = bias.detach().float().contiguous()
        keep.append(b)
    if isinstance(mod, WeightOnlyInt4Linear):
        w, s = mod.weight, mod.scales
        kind = W4A8 if getattr(mod, "chosen", None) == "gemv-q8" else I4
        lin = _Lin(kind, mod.out_features, mod.in_features, s.shape[1], w.data_ptr(), s.data_ptr(), None)
    elif isinstance(mod, WeightOnlyInt8Linear):
        w, s = mod.weight, mod.scales
        lin = _Lin(I8, mod.out_features, mod.in_features, 0, w.data_ptr(), s.data_ptr(), None)
    elif isinstance(mod, DynamicInt8Linear):
        w, s = mod.weight, mod.scales
        lin = _Lin(W8A8, mod.out_features, mod.in_features, 0, w.data_ptr(), s.data_ptr(), None)
    elif type(mod) in (nn.Linear, DenseGemvLinear):
        w = mod.weight
        if w.dtype not in (torch.float32, torch.bfloat16):
            raise EngineError(f"engine.compile_mode=cpp: {name} has {w.dtype} weights (it runs fp32 and bf16)")
        lin = _Lin(F32 if w.dtype == torch.float32 else BF16, w.shape[0], w.shape[1], 0, w.data_ptr(), None, None)
        s = None
    else:
        raise EngineError(f"engine.compile_mode=cpp has no kernel for {name} ({type(mod).__name__}); it reads nn.Linear "
                          f"and our int8/int4 modules (quant levels {', '.join(LEVELS)})")
    for t in (w, s):
        if t is not None and (not t.is_contiguous() or t.device.type != "cpu"):
            raise EngineError(f"engine.compile_mode=cpp: {name}'s weights must be contiguous CPU tensors")
    lin.bias = None if b is None else b.data_ptr()
    return lin, keep + [w, s]


class CppDecodeStep:
    """The backend's `decode_step` (same call as the model: tokens [1, 1], start, kernel, cache -> logits [1, 1, V]
    float32) for a ContiguousKVCache of one sequence. Builds (or loads) the library at construction: an EngineError
    names a build that failed."""

    def __init__(self, model, attention_impl: str):
        from ...quant_kernels import build

        if attention_impl not in ATTENTION:
            raise EngineError(f"engine.compile_mode=cpp runs attention {' or '.join(ATTENTION)}, not {attention_impl!r}")
        lib = build("infersweep_decode_step", [SOURCE])
        if lib.error:
            raise EngineError(f"engine.compile_mode=cpp: the C++ decode step did not build on this machine: {lib.error}")
        bad = layout_problems(lib.isw_step_layout().decode())
        if bad:
            raise EngineError(f"engine.compile_mode=cpp: the binding (cpp_step.py) and the C++ step ({SOURCE.name}) "
                              f"disagree: {'; '.join(bad)}; change both together")
        self.lib, self.isa = lib, lib.isa
        self.model = model
        args = model.args
        self.dtype = model.embed_tokens.weight.dtype
        if self.dtype not in (torch.float32, torch.bfloat16):
            raise EngineError(f"engine.compile_mode=cpp runs float32 or bfloat16, not {self.dtype}")
        self._keep: list = []
        layers = (_Layer * args.num_layers)()
        for i, block in enumerate(model.layers):
            at, mlp, L = block.self_attn, block.mlp, layers[i]
            for p, mod in zip(_PROJ, (at.q_proj, at.k_proj, at.v_proj, at.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
                lin, keep = _kind_of(mod, f"model.layers.{i}.{p}", self.dtype)
                setattr(L, p, lin)
                self._keep += keep
            L.in_norm = self._norm(block.input_layernorm)
            L.post_attn_norm = self._norm(block.post_attention_layernorm)
            if args.gemma:
                L.pre_ff_norm = self._norm(block.pre_feedforward_layernorm)
                L.post_ff_norm = self._norm(block.post_feedforward_layernorm)
                L.q_norm, L.k_norm = self._norm(at.q_norm), self._norm(at.k_norm)
            L.window = at.window or 0
            L.rope = model.layer_rope[i]
        self._layers = layers
        head, keep = _kind_of(model.lm_head, "lm_head", self.dtype)
        self._keep += keep
        m = _Model()
        m.num_layers, m.hidden, m.inter = args.num_layers, args.hidden_size, args.intermediate_size
        m.hq, m.hkv, m.head_dim, m.vocab = args.num_heads, args.num_kv_heads, args.head_dim, head.N
        m.bf16, m.gemma, m.eager_attention = int(self.dtype == torch.bfloat16), int(args.gemma), int(attention_impl == "eager")
        m.eps = args.rms_norm_eps
        m.attn_scale = args.attn_scale if args.attn_scale is not None else args.head_dim ** -0.5
        m.softcap = float(args.final_softcap or 0.0)
        # Gemma's embedding scale, rounded to the weights' dtype as transformers (and model.py) do
        m.embed_scale = float(torch.tensor(model.embed_scale).to(self.dtype).item()) if model.embed_scale else 0.0
        m.embed, m.final_norm, m.head = self._tensor(model.embed_tokens.weight), self._norm(model.norm), head
        m.layers = layers
        self._m = m
        self._cache = None  # the cache (or serving pool) the descriptor points into
        self._tables: list = []  # RoPE cos/sin per table for every position of that cache

    def _tensor(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> int:
        dtype = dtype or self.dtype
        if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
            raise EngineError(f"engine.compile_mode=cpp: a {tuple(t.shape)} {t.dtype} tensor is not a contiguous CPU "
                              f"{dtype} tensor")
        return t.data_ptr()  # the model (or the session's cache) owns it

    def _norm(self, norm) -> int:
        return self._tensor(norm.weight)

    def _bind(self, cache) -> None:
        """Point the descriptor at a cache's per-layer K/V tensors -- a static batch's contiguous [B, Hkv, max_len, D]
        or paged cache, or the serving pool ([blocks, block_size, Hkv, D]) -- and RoPE tables for every position it
        can hold; then the layout that addresses it."""
        from .kv_cache import ContiguousKVCache, KVPool, PagedKVCache

        pool = cache.pool if isinstance(cache, PagedKVCache) else cache
        if isinstance(cache, ContiguousKVCache):
            ks, vs, capacity = cache.k, cache.v, cache.max_len
        elif isinstance(pool, KVPool):
            ks, vs, capacity = pool.k, pool.v, pool.num_blocks * pool.block_size
        else:
            raise EngineError(f"engine.compile_mode=cpp decodes over the native engine's caches, not {type(cache).__name__}")
        model, m = self.model, self._m
        kv = ks[0].dtype  # the model's dtype, or bf16 under fp32 activations (kv_cache.dtype=bfloat16)
        if kv not in (self.dtype, torch.bfloat16):
            raise EngineError(f"engine.compile_mode=cpp reads a K/V cache in {self.dtype} or bfloat16, not {kv}")
        m.kv_bf16 = int(kv == torch.bfloat16)
        for i, L in enumerate(self._layers):
            L.k_cache, L.v_cache = self._tensor(ks[i], kv), self._tensor(vs[i], kv)
        if capacity != m.max_len or not self._tables:
            pos = torch.arange(capacity)
            self._tables = []
            for j in range(len(model.rope_keys)):  # the tables the Python path computes per step, for every position
                cos, sin = rope_cos_sin(getattr(model, f"inv_freq{j}"), pos, torch.float32)
                self._tables += [cos.contiguous(), sin.contiguous()]
                m.cos[j], m.sin[j] = self._tables[-2].data_ptr(), self._tables[-1].data_ptr()
            m.max_len = capacity
        args = model.args
        hkv, d = args.num_kv_heads, args.head_dim
        if isinstance(cache, ContiguousKVCache):  # block b = sequence b's whole row [Hkv, max_len, D], head-major
            self._kv = _KVLayout(0, 1, capacity, hkv * capacity * d, d, capacity * d)
        else:  # pool blocks [block_size, Hkv, D], token-major, through each sequence's block table
            bs = pool.block_size
            self._kv = _KVLayout(0, 0, bs, bs * hkv * d, hkv * d, d)
        self._cache = cache

    def _run(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens, positions int64 [B] -> logits float32 [B, V] (a new tensor)."""
        b = int(tokens.shape[0])
        logits = torch.empty(b, self._m.vocab, dtype=torch.float32)
        tokens, positions = tokens.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous()
        self.lib.isw_decode_batch(ctypes.addressof(self._m), b, tokens.data_ptr(), positions.data_ptr(),
                                  ctypes.addressof(self._kv), logits.data_ptr(), torch.get_num_threads())
        return logits

    def __call__(self, tokens: torch.Tensor, start: int, kernel, cache) -> torch.Tensor:
        """A static batch's step: tokens [B, 1] at position `start` of every sequence -> logits [B, 1, V]."""
        if cache is not self._cache:
            self._bind(cache)
        assert tokens.dim() == 2 and tokens.shape[1] == 1, tokens.shape
        b = int(tokens.shape[0])
        self._use_tables(self._tables_of(cache, b))
        return self._run(tokens[:, 0], torch.full((b,), start, dtype=torch.int64)).view(b, 1, -1)

    def prefill(self, tokens: torch.Tensor, start: int, cache, last_only: bool = True) -> torch.Tensor:
        """A static batch's prompt chunk in C++ (`engine.prefill=cpp`): tokens [B, T] at positions [start, start + T)
        of every sequence, their K/V written into `cache` (already grown by T) -> the last position's logits [B, V]
        (`last_only`), else every position's [B, T, V] (speculative verification).
        One call for all B x T rows: every weight row read once for all of them (the kernels' row tiles), each row's
        attention over its own sequence's cache up to its position (causal: the rows' keys are stored first)."""
        b, t = int(tokens.shape[0]), int(tokens.shape[1])
        tables = self._tables_of(cache, b)
        positions = (start + torch.arange(t, dtype=torch.int64)).repeat(b)
        out = torch.arange(1, b + 1, dtype=torch.int64) * t - 1 if last_only else torch.arange(b * t, dtype=torch.int64)
        logits = self.step_rows(tokens.reshape(-1), positions, tables.repeat_interleave(t, dim=0), out, cache)
        return logits if last_only else logits.view(b, t, -1)

    @staticmethod
    def _tables_of(cache, b: int) -> torch.Tensor:
        """The block table of each of a static batch's b sequences: the paged cache's (they grow as the sequences
        do), or the contiguous cache's one block per sequence (sequence i is block i)."""
        from .kv_cache import PagedKVCache

        if isinstance(cache, PagedKVCache):
            return cache.block_table_tensor(torch.int32)
        return torch.arange(b, dtype=torch.int32).view(b, 1)

    def step_rows(self, tokens: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor,
                  out_rows: torch.Tensor, cache) -> torch.Tensor:
        """R rows that may share sequences: row r is token tokens[r] at positions[r] of the sequence whose block table
        is tables[r] (int32 [R, width]) in `cache` (a static batch's cache, or the serving pool); every row's K/V
        stored before any row attends -> logits [len(out_rows), V] float32 of the rows out_rows (int64)."""
        if cache is not self._cache:
            self._bind(cache)
        self._use_tables(tables)
        tokens, positions = tokens.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous()
        out_rows = out_rows.to(torch.int64).contiguous()
        logits = torch.empty(int(out_rows.shape[0]), self._m.vocab, dtype=torch.float32)
        self.lib.isw_step_rows(ctypes.addressof(self._m), int(tokens.shape[0]), tokens.data_ptr(), positions.data_ptr(),
                               ctypes.addressof(self._kv), int(out_rows.shape[0]), out_rows.data_ptr(),
                               logits.data_ptr(), torch.get_num_threads())
        return logits

    def decode_varlen(self, tokens: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, pool) -> torch.Tensor:
        """Continuous batching's decode rows: sequence i's token tokens[i] at positions[i], its K/V in the pool's
        blocks tables[i] (int32 [B, width]) -> logits [B, V]."""
        if pool is not self._cache:
            self._bind(pool)
        self._use_tables(tables)
        return self._run(tokens, positions)

    def _use_tables(self, tables: torch.Tensor) -> None:
        """The pool's block tables [B, width] the next step reads (kept alive here while the layout points at them)."""
        self._blocks = tables.to(torch.int32).contiguous()
        self._kv.blocks, self._kv.max_blocks = self._blocks.data_ptr(), int(self._blocks.shape[1])

    def profile(self) -> dict[str, float]:
        """Milliseconds per step in each phase (thread 0's wall time between the region's barriers, so a phase's
        wait for the slowest thread counts in it) since the last call, plus `steps`; then reset. Every CppDecodeStep
        of the process shares one counter (the library's)."""
        out = (ctypes.c_double * len(PHASES))()
        steps = self.lib.isw_step_profile(ctypes.addressof(out))
        return dict({p: 1e3 * out[i] / max(1, steps) for i, p in enumerate(PHASES)}, steps=float(steps))
