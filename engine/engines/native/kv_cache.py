"""KV cache layouts. Both hold, per layer, the keys and values of every token of B sequences that share
one length (a static batch), and expose the same operations:

  append(n) -> start   reserve positions start..start+n-1 for the next forward (once per step, all layers)
  update(layer, k, v)  write the new k, v [B, Hkv, n, D] and return all keys/values [B, Hkv, S, D]
  rollback(n)          forget the last n positions (rejected speculative tokens)
  bytes()              exact (allocated, used) bytes

`contiguous`: one static [B, Hkv, max_len, D] tensor per layer, reserved up front (gpt-fast's KVCache);
reading is a free slice.
`paged`: one pool of fixed-size blocks [num_blocks, block_size, Hkv, D] per layer, handed out on demand
by a BlockManager and addressed through per-sequence block tables (vLLM's PagedAttention layout, which
is also flash-attn's paged KV layout). Without a paged attention kernel (CPU), `update` gathers the
blocks into a contiguous [B, Hkv, S, D] copy: O(S) extra memory traffic per layer and step, the price
of paging on this path.

allocated = bytes reserved for this batch's tokens (contiguous: the whole static tensors; paged: the
blocks currently held by the sequences, so the waste is at most one partial block per sequence);
used = bytes holding live tokens. `PagedKVCache.pool_bytes()` is the pool tensors' size.
"""
from __future__ import annotations

import torch

from ...config import EngineError
from .block_manager import BlockManager


class ContiguousKVCache:
    """Per layer a [B, Hkv, max_len, D] view of one [L, B, Hkv, max_len, D] tensor for K (`k_all`) and one for V:
    the eager path reads a layer's view, the compiled static step and the C++ step the same memory. `buffers`:
    those two tensors when the caller owns them (the CUDA-graph step's static tensors), else allocated here."""

    def __init__(self, num_layers: int, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, buffers: tuple | None = None):
        shape = (num_layers, batch_size, num_kv_heads, max_len, head_dim)
        if buffers is None:
            buffers = (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        self.k_all, self.v_all = buffers
        self.k, self.v = list(self.k_all.unbind(0)), list(self.v_all.unbind(0))
        self.batch_size, self.max_len = batch_size, max_len
        self.length = 0  # tokens held per sequence; the cache is the one owner of this count
        self._start = 0
        self._token_bytes = 2 * num_layers * num_kv_heads * head_dim * self.k[0].element_size()

    def append(self, n: int) -> int:
        start = self.length
        if start + n > self.max_len:
            raise EngineError(f"KV cache full: {start} + {n} tokens exceed max_len {self.max_len}")
        self._start, self.length = start, start + n
        return start

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s, e = self._start, self.length
        assert k.shape[2] == e - s, (k.shape, s, e)
        self.k[layer][:, :, s:e] = k  # cast to the cache's dtype (kv_cache.dtype) where it differs
        self.v[layer][:, :, s:e] = v
        kc, vc = self.k[layer][:, :, :e], self.v[layer][:, :, :e]
        return (kc, vc) if kc.dtype == k.dtype else (kc.to(k.dtype), vc.to(k.dtype))

    def rollback(self, n: int) -> None:
        assert 0 <= n <= self.length, (n, self.length)
        self.length -= n  # stale entries beyond `length` are overwritten before they are read again

    def flash_kwargs(self, layer: int) -> dict:
        # flash_attn_with_kvcache wants [B, S_max, H, D]; our [B, H, S_max, D] transposed is such a view.
        seqlens = torch.full((self.batch_size,), self._start, dtype=torch.int32, device=self.k[0].device)
        return dict(k_cache=self.k[layer].transpose(1, 2), v_cache=self.v[layer].transpose(1, 2), cache_seqlens=seqlens)

    def bytes(self) -> tuple[int, int]:
        return (self.batch_size * self.max_len * self._token_bytes, self.batch_size * self.length * self._token_bytes)


class KVPool:
    """The one paged pool of the engine: per layer [num_blocks, block_size, Hkv, D] keys and values, indexed
    by block ids that a BlockManager hands out. A static batch's `PagedKVCache` and the serving
    `ModelRunner` (continuous batching) both keep their K/V here."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_blocks, self.block_size, self.device = num_blocks, block_size, device
        self.token_bytes = 2 * num_layers * num_kv_heads * head_dim * self.k[0].element_size()

    def bytes(self) -> int:
        return self.num_blocks * self.block_size * self.token_bytes


class PagedKVCache:
    def __init__(self, num_layers: int, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int,
                 block_size: int, dtype: torch.dtype, device: torch.device, num_blocks: int | None = None):
        if block_size <= 0:
            raise EngineError(f"kv_block_size must be positive, got {block_size}")
        # A static batch never needs more than this; a shared serving pool would be sized by memory instead.
        num_blocks = num_blocks or batch_size * -(-max_len // block_size)
        self.manager = BlockManager(num_blocks, block_size)
        self.block_size, self.batch_size, self.max_len = block_size, batch_size, max_len
        self.pool = KVPool(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
        self.block_tables: list[list[int]] = [[] for _ in range(batch_size)]  # block ids per sequence
        self.length = 0  # tokens held per sequence; the cache is the one owner of this count
        self._token_bytes = self.pool.token_bytes
        self._device = device
        self._start = 0
        self._write_slots = torch.empty(0, dtype=torch.long)  # [B*n] flat pool slots of the new tokens
        self._read_blocks = torch.empty(0, dtype=torch.long)  # [B*blocks] blocks to gather for reading

    def append(self, n: int) -> int:
        start = self.length
        if start + n > self.max_len:
            raise EngineError(f"KV cache full: {start} + {n} tokens exceed max_len {self.max_len}")
        need = self.manager.blocks_for(start + n)
        for table in self.block_tables:
            while len(table) < need:
                table.append(self.manager.allocate())
        self._start, self.length = start, start + n
        # Indices are computed once per step and shared by all layers (one block table for all layers).
        bt = self.block_table_tensor(torch.long)  # [B, blocks]
        pos = torch.arange(start, start + n, device=self._device)  # positions of the new tokens
        slots = bt[:, pos // self.block_size] * self.block_size + pos % self.block_size  # [B, n]
        self._write_slots = slots.reshape(-1)
        self._read_blocks = bt.reshape(-1)
        return start

    def block_table_tensor(self, dtype=torch.int32) -> torch.Tensor:
        """[B, blocks per sequence] block ids (all sequences of a static batch hold equally many)."""
        return torch.tensor(self.block_tables, dtype=dtype, device=self._device)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, n, d = k.shape
        kp = self.pool.k[layer].view(-1, h, d)  # [num_blocks * block_size, Hkv, D]
        vp = self.pool.v[layer].view(-1, h, d)
        kp.index_copy_(0, self._write_slots, k.transpose(1, 2).reshape(b * n, h, d).to(kp.dtype))
        vp.index_copy_(0, self._write_slots, v.transpose(1, 2).reshape(b * n, h, d).to(vp.dtype))
        # Gather whole blocks through the block table (contiguous runs of block_size*Hkv*D, cheaper than
        # per-token indexing): [B*blocks, block_size, Hkv, D] -> [B, S, Hkv, D] -> [B, Hkv, S, D] (a view).
        s = self.length
        kg = self.pool.k[layer].index_select(0, self._read_blocks).view(b, -1, h, d)[:, :s]
        vg = self.pool.v[layer].index_select(0, self._read_blocks).view(b, -1, h, d)[:, :s]
        return kg.transpose(1, 2).to(k.dtype), vg.transpose(1, 2).to(k.dtype)

    def rollback(self, n: int) -> None:
        assert 0 <= n <= self.length, (n, self.length)
        self.length -= n
        need = self.manager.blocks_for(self.length)
        for table in self.block_tables:
            while len(table) > need:
                self.manager.free(table.pop())

    def release(self) -> None:
        """Return every block to the manager (end of the batch)."""
        self.rollback(self.length)

    def flash_kwargs(self, layer: int) -> dict:
        if self.block_size % 256:
            raise EngineError(f"flash-attn's paged KV cache needs kv_block_size divisible by 256, got {self.block_size}")
        seqlens = torch.full((self.batch_size,), self._start, dtype=torch.int32, device=self._device)
        return dict(k_cache=self.pool.k[layer], v_cache=self.pool.v[layer], cache_seqlens=seqlens,
                    block_table=self.block_table_tensor(torch.int32))

    def pool_bytes(self) -> int:
        return self.pool.bytes()

    def bytes(self) -> tuple[int, int]:
        held = self.manager.num_used * self.block_size * self._token_bytes
        return (held, self.batch_size * self.length * self._token_bytes)
