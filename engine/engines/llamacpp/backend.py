"""The llama.cpp backend: the logits-level Backend protocol (engine/engines/logits.py) on llama.cpp's low-level C API (llama-cpp-python).

A static batch of B sequences is B parallel llama.cpp sequences (seq id = row) in one `llama_decode`;
each sequence gets its own KV stream (`kv_unified=false`: no attention across rows). Logits of every
token come back as a float32 tensor [B, T, V], so the generate loop, prompt-lookup speculative decoding
(rollback = `llama_memory_seq_rm`), perplexity and fidelity run unchanged on top of it.

Knobs (config key -> llama.cpp):
  attention=flash            flash_attn on (CPU kernels too); eager / sdpa -> off
  kv_cache.dtype             type_k and type_v: f32 | f16 | q8_0 | q4_0 (auto = llama.cpp's f16);
                             a quantized V cache needs flash attention
  quant                      the GGUF weight type (engine/engines/llamacpp/gguf_export.py): none = model.dtype, gguf-*
  engine.threads             n_threads and n_threads_batch
  batching.max_batch_tokens  n_batch (tokens per llama_decode call; longer inputs are split)
  workload.batch_size        parallel sequences (n_seq_max)

No HF model is held: the trial loads the tokenizer and the GGUF. What this engine honours and its own
checks are declared in engine/engines/llamacpp/__init__.py.
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from ...config import EngineError, ModelConfig, QuantConfig, TrialConfig
from ...tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from .library import last_problem, lib, loaded_library
from .kv_types import KV_CACHE_DTYPES, KV_GGML_TYPES, KV_TYPE_BYTES, QUANTIZED_KV, kv_type

log = logging.getLogger(__name__)

LABEL = "engine=llamacpp"

# --- the loaded model ----------------------------------------------------------------------------------

@dataclass
class GGUFModel:
    """What engine=llamacpp loads in place of an HF model (the runner's `loaded`)."""

    handle: Any  # llama_model *
    path: Path
    tokenizer: Tokenizer
    spec: ModelConfig
    load_s: float
    quant: QuantConfig = field(default_factory=QuantConfig)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def weights_bytes(self) -> int:
        return int(lib().llama_model_size(self.handle))

    def __del__(self):
        if getattr(self, "handle", None) and loaded_library() is not None:
            loaded_library().llama_model_free(self.handle)
            self.handle = None


def load_gguf_model(spec: ModelConfig, quant: QuantConfig, threads: int = 0,
                    progress: Optional[Callable[[str], None]] = None,
                    tokenizer: Optional[Tokenizer] = None) -> GGUFModel:
    """Tokenizer + the GGUF at `quant.level` (converted / quantized once, then cached). `tokenizer`: use this
    one instead of the checkpoint's (a test's random checkpoint directory has none)."""
    from transformers import AutoTokenizer

    from .gguf_export import gguf_file, source_of
    from ...models import TINY_SCHEME

    say = progress or (lambda msg: log.info(msg))
    cpp = lib()
    t0 = time.perf_counter()
    src = source_of(spec, say)
    path = gguf_file(spec, quant.level, threads, say, src=src)
    if tokenizer is not None:
        pass
    elif spec.path.startswith(TINY_SCHEME):
        tokenizer = ByteTokenizer()
    else:
        tokenizer = HFTokenizer(AutoTokenizer.from_pretrained(str(src.path)))
    params = cpp.llama_model_default_params()
    params.n_gpu_layers = 0  # the wheel built here is CPU-only
    if amx_cpu():
        # llama.cpp's AMX weight buffers crash in ggml_backend_amx_mul_mat (segfault on a Sapphire Rapids here,
        # in Q8_0/Q4_0 scoring; upstream ggml-org/llama.cpp#20824, open): on a CPU with AMX the weights stay
        # in plain CPU buffers (no extra buffer types: no AMX and no repacked layouts)
        params.use_extra_bufts = False
    handle = cpp.llama_model_load_from_file(str(path).encode(), params)
    if not handle:
        raise EngineError(f"llama.cpp could not load {path}")
    return GGUFModel(handle=handle, path=path, tokenizer=tokenizer, spec=spec,
                     load_s=time.perf_counter() - t0, quant=quant)


def amx_cpu() -> bool:
    """Whether this CPU has AMX int8 tiles (llama.cpp's native build then places quantized weights in AMX
    buffers)."""
    from ...measure.hardware import cpu_flags, cpuinfo_text

    return "amx_int8" in cpu_flags(cpuinfo_text())


# --- sessions ------------------------------------------------------------------------------------------

class LlamaCppSession:
    """B sequences in one llama.cpp context; its KV cells are the single owner of their length."""

    def __init__(self, backend: "LlamaCppBackend", batch_size: int, max_len: int, epoch: int):
        self._backend, self._batch_size, self._max_len, self._epoch = backend, batch_size, max_len, epoch
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, V] float32; the tokens are appended to the sequences."""
        return self._append(tokens, last_only=False)

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """`forward` keeping only each row's last logits [B, V] (generate's prefill: a 16k-token Gemma 3 prompt's
        [T, V] would be 17 GB)."""
        return self._append(tokens, last_only=True)

    def _append(self, tokens: torch.Tensor, last_only: bool) -> torch.Tensor:
        assert tokens.dim() == 2 and tokens.shape[0] == self._batch_size, tokens.shape
        self._backend._check_epoch(self._epoch)
        n = int(tokens.shape[1])
        if self._length + n > self._max_len:
            raise EngineError(f"sequence would exceed the session's max_len {self._max_len}")
        logits = self._backend._decode(tokens, self._length, last_only=last_only)
        self._length += n
        return logits

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        if num_tokens > self._length:
            raise EngineError(f"cannot roll back {num_tokens} tokens of a {self._length}-token sequence")
        self._backend._check_epoch(self._epoch)
        self._backend._forget_from(self._length - num_tokens)
        self._length -= num_tokens

    def kv_cache_bytes(self) -> tuple[int, int]:
        per_token = self._backend.kv_bytes_per_token
        cells = self._backend._cells_per_seq
        return (int(self._batch_size * cells * per_token), int(self._batch_size * self._length * per_token))


class _Batch:
    """A llama_batch over numpy arrays (filled vectorized; the C struct points into them)."""

    def __init__(self, cpp, capacity: int):
        self.cap = capacity
        self.token = np.zeros(capacity, np.int32)
        self.pos = np.zeros(capacity, np.int32)
        self.n_seq_id = np.ones(capacity, np.int32)
        self.seq = np.zeros(capacity, np.int32)
        self.output = np.ones(capacity, np.int8)  # logits for every token: the protocol returns them all
        i32 = ctypes.POINTER(ctypes.c_int32)
        base = self.seq.ctypes.data
        self._seq_ptrs = (i32 * capacity)(*[ctypes.cast(base + 4 * i, i32) for i in range(capacity)])
        self.struct = cpp.llama_batch(
            n_tokens=0,
            token=self.token.ctypes.data_as(i32),
            embd=None,
            pos=self.pos.ctypes.data_as(i32),
            n_seq_id=self.n_seq_id.ctypes.data_as(i32),
            seq_id=ctypes.cast(self._seq_ptrs, ctypes.POINTER(i32)),
            logits=self.output.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )


class LlamaCppBackend:
    name = "llamacpp"

    def __init__(self, loaded: GGUFModel, trial: TrialConfig):
        """Threads: engine.threads (0: torch's); tokens per llama_decode call (n_batch):
        batching.max_batch_tokens; flash attention: attention=flash; K/V type: kv_cache.dtype."""
        if not isinstance(loaded, GGUFModel):
            raise EngineError(f"{LABEL} runs a GGUF model: load it with engine.pipeline.load_trial_model "
                              "(engine.engines.llamacpp.backend.load_gguf_model), not load_model")
        kv_dtype, threads, batch_tokens = trial.kv_cache.dtype, trial.engine.threads, trial.batching.max_batch_tokens
        if kv_dtype not in KV_CACHE_DTYPES:
            raise EngineError(f"kv_cache.dtype {kv_dtype!r} unknown; choose one of {KV_CACHE_DTYPES}")
        self.cpp = lib()
        self.loaded, self.trial = loaded, trial
        self.flash = trial.attention.impl == "flash"
        self.threads = threads if threads > 0 else torch.get_num_threads()
        self.n_batch = max(1, batch_tokens)
        self.kv_type = kv_type(kv_dtype)
        if self.kv_type in QUANTIZED_KV and not self.flash:
            raise EngineError(f"{LABEL}: kv_cache.dtype={self.kv_type} (a quantized V cache) needs attention=flash")
        from ...model_facts import inspect

        self.kv_bytes_per_token = inspect(loaded.spec).kv_bytes_per_token(KV_TYPE_BYTES[self.kv_type])
        self.n_vocab = int(self.cpp.llama_vocab_n_tokens(self.cpp.llama_model_get_vocab(loaded.handle)))
        self._batch = _Batch(self.cpp, self.n_batch)
        self._ctx = None
        self._ctx_shape = (0, 0)  # (sequences, cells per sequence)
        self._cells_per_seq = 0
        self._epoch = 0  # bumped by every new session / score: an older session must not touch the context

    # one llama.cpp context at a time, reused while its shape fits (KV memory is allocated at creation)
    def _context(self, n_seq: int, cells_per_seq: int):
        if n_seq > self.cpp.llama_max_parallel_sequences():
            raise EngineError(f"{LABEL}: batch size {n_seq} exceeds llama.cpp's "
                              f"{self.cpp.llama_max_parallel_sequences()} parallel sequences")
        have_seq, have_cells = self._ctx_shape
        if self._ctx is not None and have_seq == n_seq and have_cells >= cells_per_seq:
            self.cpp.llama_memory_clear(self.cpp.llama_get_memory(self._ctx), True)
            return self._ctx
        self._free_context()
        cpp = self.cpp
        p = cpp.llama_context_default_params()
        p.n_ctx = n_seq * cells_per_seq
        p.n_batch = self.n_batch
        p.n_ubatch = min(int(p.n_ubatch), self.n_batch)
        p.n_seq_max = n_seq
        p.n_threads = p.n_threads_batch = self.threads
        p.flash_attn_type = cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if self.flash else \
            cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        p.type_k = p.type_v = getattr(cpp, KV_GGML_TYPES[self.kv_type])
        p.kv_unified = False  # a KV stream per sequence: rows never attend to each other
        p.no_perf = True
        ctx = cpp.llama_init_from_model(self.loaded.handle, p)
        if not ctx:
            raise EngineError(f"llama.cpp could not create a context for {n_seq} sequences x {cells_per_seq} tokens "
                              f"(kv {self.kv_type}, attention {self.trial.attention.impl}){last_problem()}")
        self._ctx = ctx
        self._cells_per_seq = int(cpp.llama_n_ctx_seq(ctx))
        if self._cells_per_seq < cells_per_seq:
            raise EngineError(f"llama.cpp gave {self._cells_per_seq} KV cells per sequence, {cells_per_seq} needed")
        self._ctx_shape = (n_seq, self._cells_per_seq)
        return ctx

    def _free_context(self) -> None:
        if self._ctx is not None:
            self.cpp.llama_free(self._ctx)
            self._ctx = None
            self._ctx_shape = (0, 0)

    def __del__(self):
        if getattr(self, "_ctx", None) is not None and loaded_library() is not None:
            self._free_context()

    def _check_epoch(self, epoch: int) -> None:
        if epoch != self._epoch:
            raise EngineError(f"{LABEL}: this session's context was taken by a newer session or score call")

    def _decode(self, tokens: torch.Tensor, start: int, last_only: bool = False) -> torch.Tensor:
        """tokens [B, T] at positions start.. of every row -> logits [B, T, V] (split into n_batch calls); with
        `last_only`, each row's last position's [B, V] (the others are read from llama.cpp's buffer, never kept)."""
        cpp, b = self.cpp, self._batch
        rows, t = int(tokens.shape[0]), int(tokens.shape[1])
        n = rows * t
        flat = tokens.reshape(-1).to(torch.int32).cpu().numpy()
        pos = np.tile(np.arange(start, start + t, dtype=np.int32), rows)
        seq = np.repeat(np.arange(rows, dtype=np.int32), t)
        out = torch.empty(rows if last_only else n, self.n_vocab, dtype=torch.float32)
        # llama.cpp clamps a context's n_batch to the n_ctx asked for (before padding it), so a reused context
        # made for shorter rows takes fewer tokens per call than n_batch (more aborts the process)
        cap = min(b.cap, int(cpp.llama_n_batch(self._ctx)))
        for c0 in range(0, n, cap):  # row-major chunks keep each sequence's tokens in order
            c1 = min(n, c0 + cap)
            m = c1 - c0
            b.token[:m], b.pos[:m], b.seq[:m] = flat[c0:c1], pos[c0:c1], seq[c0:c1]
            b.struct.n_tokens = m
            rc = cpp.llama_decode(self._ctx, b.struct)
            if rc != 0:
                raise EngineError(f"llama_decode failed (code {rc}) on {m} tokens at position {start}{last_problem()}")
            logits = np.ctypeslib.as_array(cpp.llama_get_logits(self._ctx), shape=(m, self.n_vocab))
            if last_only:  # the flat positions in this call that end a row
                ends = np.arange(c0 + (t - 1 - c0 % t) % t, c1, t)
                out[ends // t] = torch.from_numpy(logits[ends - c0])
            else:
                out[c0:c1] = torch.from_numpy(logits)
        return out if last_only else out.view(rows, t, self.n_vocab)

    def _forget_from(self, position: int) -> None:
        if not self.cpp.llama_memory_seq_rm(self.cpp.llama_get_memory(self._ctx), -1, position, -1):
            raise EngineError(f"llama.cpp could not remove positions >= {position} from the KV cache")

    def new_session(self, batch_size: int, max_len: int) -> LlamaCppSession:
        self._epoch += 1
        self._context(batch_size, max_len)
        return LlamaCppSession(self, batch_size, max_len, self._epoch)

    def score(self, input_ids: torch.Tensor) -> torch.Tensor:
        self._epoch += 1
        self._context(int(input_ids.shape[0]), int(input_ids.shape[1]))
        return self._decode(input_ids, 0)

    def weights_bytes(self) -> int:
        return self.loaded.weights_bytes()
