"""A flattened batch of sequences of different lengths over one shared paged KV pool (continuous batching).

B sequences contribute N new tokens in all, concatenated: sequence i appends q_len[i] tokens (a prompt,
a prefill chunk or one decode token) at positions ctx_len[i] - q_len[i] .. ctx_len[i] - 1, and its keys
and values live in the pool blocks of its block table (vLLM's layout: block j of the table holds positions
j*block_size .. (j+1)*block_size - 1). The model runs every projection on the flattened [N, hidden]
tokens (one GEMM for the whole batch, whatever the lengths); only attention needs the sequence
structure, and gets it from the `VarlenBatch` passed where a static batch passes its cache (explicitly,
not through module-global state, so a second model -- a draft -- can run its own batch).

Per layer, `VarlenBatch.attend` writes the new K/V into their pool slots, then attends:
  decode rows (q_len == 1) together: their blocks gathered through a padded [Bd, max_blocks] block table
    into [Bd, Hkv, S_max, D], the padding keys masked out -- one kernel call for all decodes;
  every other row alone: its blocks gathered into [1, Hkv, ctx_len, D], causal with offset
    ctx_len - q_len (a whole prompt, or a chunk appended to its cached prefix).
Without a paged attention kernel (CPU) the gather is an O(S) copy per layer, the price of paging here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_cache import KVPool


@dataclass
class _Prefill:
    q_start: int  # first row of this sequence in the flattened batch
    q_len: int
    ctx_len: int
    blocks: torch.Tensor  # [blocks] long


class VarlenBatch:
    """Per-step metadata shared by all layers (built once per forward from plain lists)."""

    def __init__(self, pool: KVPool, q_lens: list[int], ctx_lens: list[int], block_tables: list[list[int]]):
        assert len(q_lens) == len(ctx_lens) == len(block_tables) > 0
        bs, dev = pool.block_size, pool.device
        self.pool = pool
        positions, slots = [], []
        dec_rows, dec_tables, dec_lens = [], [], []
        self.prefills: list[_Prefill] = []
        row = 0
        for q, ctx, table in zip(q_lens, ctx_lens, block_tables):
            assert 0 < q <= ctx <= len(table) * bs, (q, ctx, len(table), bs)
            pos = range(ctx - q, ctx)
            positions.extend(pos)
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            nblk = -(-ctx // bs)
            if q == 1:
                dec_rows.append(row)
                dec_tables.append(table[:nblk])
                dec_lens.append(ctx)
            else:
                self.prefills.append(_Prefill(row, q, ctx, torch.tensor(table[:nblk], dtype=torch.long, device=dev)))
            row += q
        self.num_tokens = row
        self.positions = torch.tensor(positions, dtype=torch.long, device=dev)  # [N]
        self.slots = torch.tensor(slots, dtype=torch.long, device=dev)  # [N] flat pool slot of each new token
        self.num_decodes = len(dec_rows)
        if dec_rows:
            width = max(len(t) for t in dec_tables)
            padded = [t + [t[-1]] * (width - len(t)) for t in dec_tables]  # padding gathers a real block, masked
            self.dec_rows = torch.tensor(dec_rows, dtype=torch.long, device=dev)  # [Bd]
            self.dec_blocks = torch.tensor(padded, dtype=torch.long, device=dev).reshape(-1)  # [Bd * width]
            self._dec_lens = torch.tensor(dec_lens, device=dev)[:, None]  # [Bd, 1]
            self._dec_keys = torch.arange(width * bs, device=dev)[None, :]  # [1, S_max]
            self.dec_mask = self._dec_keys < self._dec_lens  # [Bd, S_max]
            self._window_masks: dict[int, torch.Tensor] = {}
        self.all_decode = not self.prefills

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """[Bd, S_max] the keys each decode row attends: its real keys, and under a sliding window only the
        last `window` of them (a row's query is its newest position, ctx_len - 1); shared by all layers."""
        if window is None:
            return self.dec_mask
        if window not in self._window_masks:
            self._window_masks[window] = self.dec_mask & (self._dec_keys >= self._dec_lens - window)
        return self._window_masks[window]

    def attend(self, kernel, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None = None, scale: float | None = None) -> torch.Tensor:
        """q [1, Hq, N, D], the new k, v [1, Hkv, N, D] -> attention output [1, Hq, N, D]."""
        pool = self.pool
        _, hkv, n, d = k.shape
        kp, vp = pool.k[layer], pool.v[layer]  # [num_blocks, block_size, Hkv, D]
        kp.view(-1, hkv, d).index_copy_(0, self.slots, k[0].transpose(0, 1).to(kp.dtype))  # the pool's kv dtype
        vp.view(-1, hkv, d).index_copy_(0, self.slots, v[0].transpose(0, 1).to(vp.dtype))
        out = torch.empty_like(q)
        if self.num_decodes:
            bd = self.num_decodes
            kg = kp.index_select(0, self.dec_blocks).view(bd, -1, hkv, d).transpose(1, 2).to(q.dtype)  # [Bd, Hkv, S_max, D]
            vg = vp.index_select(0, self.dec_blocks).view(bd, -1, hkv, d).transpose(1, 2).to(q.dtype)
            qd = q[0].index_select(1, self.dec_rows).transpose(0, 1).unsqueeze(2)  # [Bd, Hq, 1, D]
            od = kernel.attend(qd, kg, vg, 0, key_mask=self.decode_mask(window), scale=scale)  # [Bd, Hq, 1, D]
            if self.all_decode:
                return od.squeeze(2).transpose(0, 1).unsqueeze(0)  # rows are in order: [1, Hq, N, D]
            out[0].index_copy_(1, self.dec_rows, od.squeeze(2).transpose(0, 1))
        for p in self.prefills:
            kg = kp.index_select(0, p.blocks).view(1, -1, hkv, d)[:, : p.ctx_len].transpose(1, 2).to(q.dtype)  # [1, Hkv, ctx, D]
            vg = vp.index_select(0, p.blocks).view(1, -1, hkv, d)[:, : p.ctx_len].transpose(1, 2).to(q.dtype)
            rows = slice(p.q_start, p.q_start + p.q_len)
            out[:, :, rows] = kernel.attend(q[:, :, rows], kg, vg, p.ctx_len - p.q_len, window=window, scale=scale)
        return out
