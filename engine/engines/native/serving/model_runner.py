"""The only place that turns a scheduled batch into tensors: it owns the KV pool and runs the native
model's varlen forward (engine/engines/native/varlen.py) over the flattened chunks of every scheduled sequence --
or, with the C++ decode step (engine.compile_mode=cpp), a step whose every chunk is one decode token in one C++ call
(cpp_step.py `decode_varlen`: each sequence at its own position, through its block table); prefill stays in torch
unless engine.prefill=cpp, which makes every step one C++ call: prompt chunks beside decode rows (`step_rows`).
"""
from __future__ import annotations

import torch

from ....config import EngineError
from ..backend import NativeBackend
from ..kv_cache import KVPool
from ..varlen import VarlenBatch
from .scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, backend: NativeBackend, num_blocks: int, block_size: int):
        if backend.trial.engine.compile and not backend.cpp_step:
            raise EngineError("engine.compile is not supported with serving workloads (shapes change every step)")
        self.backend = backend
        args = backend.model.args
        self.pool = KVPool(args.num_layers, num_blocks, block_size, args.num_kv_heads, args.head_dim,
                           backend.kv_dtype, backend.device)

    @staticmethod
    def _tables(chunks) -> list[list[int]]:
        """Each chunk's block table, zero-padded to the widest (the C++ step's [rows, width] int32 tables)."""
        width = max(len(c.block_table) for c in chunks)
        return [list(c.block_table) + [0] * (width - len(c.block_table)) for c in chunks]

    @staticmethod
    def _sample_rows(chunks) -> list[int]:
        """The flattened row of each sampling chunk's last token (it predicts the next one)."""
        rows, row = [], 0
        for c in chunks:
            row += len(c.tokens)
            if c.sample:
                rows.append(row - 1)
        return rows

    def _cpp_rows(self, chunks, tokens: torch.Tensor) -> torch.Tensor:
        """Every chunk's tokens as rows of one C++ step (cpp_step.py `step_rows`): row i of a chunk at its own
        position, through its sequence's block table; logits of each sampling chunk's last row."""
        tables = [t for c, t in zip(chunks, self._tables(chunks)) for _ in c.tokens]
        positions = [p for c in chunks for p in range(c.end - len(c.tokens), c.end)]
        with torch.inference_mode():
            return self.backend.decode_step.step_rows(tokens, torch.tensor(positions, dtype=torch.long),
                                                      torch.tensor(tables, dtype=torch.int32),
                                                      torch.tensor(self._sample_rows(chunks), dtype=torch.long),
                                                      self.pool)

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """One forward pass over every chunk -> logits [R, V] float32, one row per sampling chunk in order."""
        chunks = batch.chunks
        assert chunks, "an empty batch"
        dev = self.backend.device
        tokens = torch.tensor([t for c in chunks for t in c.tokens], dtype=torch.long, device=dev)  # [N]
        be = self.backend
        if be.cpp_step and all(len(c.tokens) == 1 and c.sample for c in chunks):
            tables = torch.tensor(self._tables(chunks), dtype=torch.int32)
            positions = torch.tensor([c.end - 1 for c in chunks], dtype=torch.long)
            with torch.inference_mode():
                return be.decode_step.decode_varlen(tokens, positions, tables, self.pool)
        if be.cpp_prefill:  # engine.prefill=cpp: prefill chunks and decode rows in one C++ call
            return self._cpp_rows(chunks, tokens)
        meta = VarlenBatch(self.pool, [len(c.tokens) for c in chunks], [c.end for c in chunks],
                           [list(c.block_table) for c in chunks])
        rows = torch.tensor(self._sample_rows(chunks), dtype=torch.long, device=dev)
        with torch.inference_mode():
            return be.model.forward_varlen(tokens, meta, be.kernel, rows)
