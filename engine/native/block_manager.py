"""A ref-counted allocator of fixed-size KV-cache blocks. Pure Python: it hands out block ids, the paged
KV cache (kv_cache.py) owns the tensors those ids index.

Ref counts exist so one block can back several sequences: prefix caching shares the blocks of a common
prompt, and continuous batching frees a finished sequence's blocks while others keep theirs. A block is
on the free list exactly when its ref count is 0 (asserted by `check_invariants`).
"""
from __future__ import annotations

from collections import deque

from ..config import EngineError


class OutOfBlocks(EngineError):
    """The pool has no free block left (a scheduler would preempt or wait; a static batch cannot)."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise EngineError(f"need num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        # FIFO so a freed block is reused last: keeps recently freed (possibly prefix-cached) data longest.
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens (ceil division)."""
        return -(-num_tokens // self.block_size)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def allocate(self) -> int:
        """A fresh block with ref count 1."""
        if not self._free:
            raise OutOfBlocks(f"KV cache out of blocks: all {self.num_blocks} blocks of {self.block_size} tokens in use")
        block = self._free.popleft()
        assert self._ref[block] == 0, (block, self._ref[block])
        self._ref[block] = 1
        return block

    def share(self, block: int) -> int:
        """One more owner of an allocated block (prefix sharing); returns the block."""
        if self._ref[block] <= 0:
            raise EngineError(f"cannot share block {block}: it is not allocated")
        self._ref[block] += 1
        return block

    def free(self, block: int) -> None:
        """Drop one owner; the block returns to the free list when none is left."""
        if self._ref[block] <= 0:
            raise EngineError(f"double free of KV cache block {block}")
        self._ref[block] -= 1
        if self._ref[block] == 0:
            self._free.append(block)

    def check_invariants(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for b, r in enumerate(self._ref):
            assert r >= 0, (b, r)
            assert (r == 0) == (b in free), f"block {b}: ref count {r} but free={b in free}"
