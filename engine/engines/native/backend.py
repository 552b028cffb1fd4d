"""Backend `native`: the engine's Backend protocol on the native Llama-family runtime.

Switchable parts (config keys):
  attention.impl  eager | sdpa | flash      (attention.py)
  kv_cache.mode   off | contiguous | paged  (kv_cache.py; `kv_cache.block_size` tokens per paged block)
  engine.compile  torch.compile of the decode step (one new token per sequence); prefill stays eager
  engine.compile_mode  dynamic: torch.compile(dynamic=True) of the forward; static, static-autotune: a static
                  KV cache and a one-token step compiled with inductor freezing (compiled.py); cpp: the one-token
                  step in C++, one call per token (cpp_step.py)
"""
from __future__ import annotations

import torch

from ...config import KV_CACHE_MODES, EngineError, TrialConfig
from ...models import LoadedModel, weights_bytes
from .attention import make_attention
from .compiled import CompiledDecodeStep
from .cpp_step import CppDecodeStep
from .kv_cache import ContiguousKVCache, PagedKVCache
from .model import Transformer
from .support import window_exceeded


PREFILL_CHUNK = 2048  # prompt positions a prefill computes at once (NativeSession.prefill)
# rows (sequences x positions) one C++ prefill call takes (engine.prefill=cpp): its buffers grow with the rows
# (~50 KB a row on SmolLM2: activations, gate/up per thread), and past a few hundred rows the GEMMs gain nothing
CPP_PREFILL_ROWS = 512


class NativeSession:
    """One static batch of B sequences; the KV cache (if any) is the single owner of their length."""

    def __init__(self, backend: "NativeBackend", batch_size: int, max_len: int):
        self._backend = backend
        self._batch_size = batch_size
        self._max_len = max_len
        self._tokens: torch.Tensor | None = None  # [B, L] kept only when caching is off (full recompute)
        args, mode = backend.model.args, backend.trial.kv_cache.mode
        dims = (args.num_layers, batch_size, max_len, args.num_kv_heads, args.head_dim)
        dtype, device = backend.kv_dtype, backend.device
        if mode == "contiguous" and backend.static_step:
            self.cache = backend.decode_step.new_cache(*dims, dtype=dtype, device=device)
        elif mode == "contiguous":
            self.cache = ContiguousKVCache(*dims, dtype=dtype, device=device)
        elif mode == "paged":
            self.cache = PagedKVCache(*dims, block_size=backend.trial.kv_cache.block_size, dtype=dtype, device=device)
        else:
            self.cache = None

    @property
    def length(self) -> int:
        if self.cache is not None:
            return self.cache.length
        return 0 if self._tokens is None else int(self._tokens.shape[1])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, V] float32; the tokens are appended to the sequences."""
        assert tokens.dim() == 2 and tokens.shape[0] == self._batch_size, tokens.shape
        n = tokens.shape[1]
        self._check_room(n)
        be = self._backend
        with torch.inference_mode():
            if self.cache is None:
                self._tokens = tokens if self._tokens is None else torch.cat([self._tokens, tokens], dim=1)
                return be.model(self._tokens, 0, be.kernel, None, num_logits=n)
            if n > 1 and be.cpp_prefill:
                return torch.cat([be.decode_step.prefill(part, self.cache.append(part.shape[1]), self.cache, last_only=False)
                                  for part in self._cpp_parts(tokens)], dim=1)
            start = self.cache.append(n)
            step = be.decode_step if n == 1 else be.model
            return step(tokens, start, be.kernel, self.cache)

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """`forward` for a prompt whose next token is all the caller needs: the last position's logits [B, V] only
        (a long prompt's [B, T, V] is never materialized: Gemma 3's 262k vocabulary at 16k tokens would be 17 GB),
        computed PREFILL_CHUNK positions at a time through the cache (attention's transient memory is chunk x
        context, not context^2: sdpa under Gemma 3's window mask materializes its scores, 4 GB a layer at 16k)."""
        n = tokens.shape[1]
        if n == 1 or self.cache is None:
            return self.forward(tokens)[:, -1]
        self._check_room(n)
        be = self._backend
        with torch.inference_mode():
            if be.cpp_prefill:
                for part in self._cpp_parts(tokens):
                    last = be.decode_step.prefill(part, self.cache.append(part.shape[1]), self.cache)
                return last
            for i in range(0, n, PREFILL_CHUNK):
                part = tokens[:, i:i + PREFILL_CHUNK]
                start = self.cache.append(part.shape[1])
                logits = be.model(part, start, be.kernel, self.cache, num_logits=1)
            return logits[:, -1]

    def _cpp_parts(self, tokens: torch.Tensor) -> list[torch.Tensor]:
        """tokens [B, T] cut along T so that one C++ call takes at most CPP_PREFILL_ROWS rows (B x its positions)."""
        step = max(1, CPP_PREFILL_ROWS // self._batch_size)
        return [tokens[:, i:i + step] for i in range(0, tokens.shape[1], step)]

    def _check_room(self, n: int) -> None:
        if self.length + n > self._max_len:
            raise EngineError(f"sequence would exceed the session's max_len {self._max_len}")

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        if num_tokens > self.length:
            raise EngineError(f"cannot roll back {num_tokens} tokens of a {self.length}-token sequence")
        if self.cache is not None:
            self.cache.rollback(num_tokens)
        else:
            self._tokens = self._tokens[:, : self.length - num_tokens]

    def kv_cache_bytes(self) -> tuple[int, int]:
        return (0, 0) if self.cache is None else self.cache.bytes()


class NativeBackend:
    name = "native"

    def __init__(self, loaded: LoadedModel, trial: TrialConfig, num_layers: int | None = None,
                 instead: str = "use backend hf"):
        """`num_layers`: run only the first blocks + final norm + LM head (weights shared with `loaded`;
        sessions get their own, smaller KV caches): the self-speculative draft. `instead`: what an error
        about a model this runtime cannot run advises (the draft's user may be on backend hf already)."""
        mode = trial.kv_cache.mode
        if mode not in KV_CACHE_MODES:
            raise EngineError(f"kv_cache.mode {mode!r} unknown; choose one of {KV_CACHE_MODES}")
        self.loaded, self.trial, self.instead = loaded, trial, instead
        self.device = loaded.device
        self.model = Transformer.from_hf(loaded.model, num_layers=num_layers).eval()
        self.dtype = self.model.embed_tokens.weight.dtype
        self.kernel = make_attention(trial, self.device)
        # the K/V cache's element type: the model's, or bf16 where the trial asks (kv_cache.dtype=bfloat16)
        self.kv_dtype = kv_dtype_of(trial.kv_cache.dtype, self.dtype)
        if self.kv_dtype != self.dtype:
            self.kernel.kv_dtype = self.kv_dtype
        self.decode_step = self.model
        mode = trial.engine.compile_mode
        self.cpp_step = trial.engine.compile and mode == "cpp"
        self.cpp_prefill = self.cpp_step and trial.engine.prefill == "cpp"  # prompts through the C++ step too
        self.static_step = trial.engine.compile and mode not in ("dynamic", "cpp")
        if self.cpp_step:
            self.decode_step = CppDecodeStep(self.model, trial.attention.impl)
        elif self.static_step:
            self.decode_step = CompiledDecodeStep(self.model, trial.attention.impl, self.device,
                                                  mode=trial.engine.compile_mode)
        elif trial.engine.compile:
            self.decode_step = compile_decode_step(self.model, self.device)
        self._sessions = 0

    def _check_len(self, n: int) -> None:
        why = window_exceeded(self.model.args.sliding_window, n)
        if why is not None:
            raise EngineError(f"{why}; {self.instead}")

    def new_session(self, batch_size: int, max_len: int) -> NativeSession:
        self._check_len(max_len)
        self.kernel.reset_peak()  # attn_peak_bytes describes the latest session
        return NativeSession(self, batch_size, max_len)

    def score(self, input_ids: torch.Tensor) -> torch.Tensor:
        self._check_len(int(input_ids.shape[1]))
        with torch.inference_mode():
            return self.model(input_ids, 0, self.kernel, None)

    @property
    def scores_trees(self) -> bool:
        return self.kernel.attend_masked is not None  # eager, sdpa (the flash kernel takes no mask)

    def score_tree(self, pack) -> torch.Tensor:
        """One row of context-shared trees (engine/engines/packing.py): its tokens flattened at their own
        positions (forward_varlen), attention by the row's mask, logits only at `pack.rows`."""
        from .attention import TreeRow

        self._check_len(pack.longest_span())
        with torch.inference_mode():
            return self.model.forward_varlen(pack.ids, TreeRow(pack), self.kernel, pack.rows)

    def weights_bytes(self) -> int:
        return weights_bytes(self.model)

    def extra_metrics(self) -> dict[str, float]:
        out = {"attn_peak_bytes": float(self.kernel.peak_bytes)}
        if self.static_step:  # wall time of compiling the step (warm-up), never inside a timed step
            out["compile_s"] = float(self.decode_step.compile_s)
        return out

    def extra_info(self) -> dict[str, str]:
        """The static step's CUDA graphs: "engaged", "skipped: <torch's reason>", or "off (cpu)"; the C++ step's ISA."""
        if self.cpp_step:
            return {"cpp_step_isa": self.decode_step.isa}
        return {"cudagraphs": self.decode_step.cudagraphs} if self.static_step else {}


def kv_dtype_of(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of engine=native's K/V cache at `kv_cache.dtype` (auto: the model's)."""
    return model_dtype if name == "auto" else getattr(torch, name)


def compile_decode_step(model: Transformer, device: torch.device):
    """torch.compile of the model's forward for one-token steps. `dynamic=True` keeps one graph as the
    sequence (and so the key length S) grows, instead of recompiling at every step."""
    try:
        return torch.compile(model, dynamic=True)
    except Exception as e:  # pragma: no cover - depends on the toolchain
        raise EngineError(f"compile: true failed to set up torch.compile on {device}: {e}") from e
