"""A ref-counted allocator of fixed-size KV-cache blocks. Pure Python: it hands out block ids, the paged
KV cache (kv_cache.py, varlen.py) owns the tensors those ids index.

Ref counts exist so one block can back several sequences: prefix caching shares the blocks of a common
prompt, and continuous batching frees a finished sequence's blocks while others keep theirs. A block is
on the free list exactly when its ref count is 0 (asserted by `check_invariants`).

Prefix caching: a computed full block can be published under a content key (a hash of its tokens chained
with the key of the block before it, so equal keys mean equal prefixes). A freed block keeps its content
and key until `allocate` hands it out again, so a later request with the same prefix can take it back
(`acquire_cached`) instead of recomputing it. The free list is FIFO, so the blocks freed longest ago are
overwritten first: an LRU eviction of cached content.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

from ...config import EngineError


class OutOfBlocks(EngineError):
    """The pool has no free block left (a scheduler would preempt or wait; a static batch cannot)."""


def block_key(parent: Optional[int], tokens: tuple[int, ...]) -> int:
    """Content key of a full block: its tokens chained with the key of the block before it (None: first)."""
    return hash((parent, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise EngineError(f"need num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        # FIFO so a freed block is reused last: keeps recently freed (possibly prefix-cached) data longest.
        # An ordered dict rather than a deque: a cached block is taken back out of the middle in O(1).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._block_of: dict[int, int] = {}  # content key -> block holding it
        self._content: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> (key, tokens), verified on a hit

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks holding published content (in use or free but not yet overwritten)."""
        return len(self._content)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens (ceil division)."""
        return -(-num_tokens // self.block_size)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def allocate(self) -> int:
        """A fresh block with ref count 1 (its cached content, if any, is forgotten: it will be overwritten)."""
        if not self._free:
            raise OutOfBlocks(f"KV cache out of blocks: all {self.num_blocks} blocks of {self.block_size} tokens in use")
        block, _ = self._free.popitem(last=False)
        assert self._ref[block] == 0, (block, self._ref[block])
        self._forget(block)
        self._ref[block] = 1
        return block

    def share(self, block: int) -> int:
        """One more owner of an allocated block (prefix sharing); returns the block."""
        if self._ref[block] <= 0:
            raise EngineError(f"cannot share block {block}: it is not allocated")
        self._ref[block] += 1
        return block

    def free(self, block: int) -> None:
        """Drop one owner; the block returns to the free list when none is left (keeping its content)."""
        if self._ref[block] <= 0:
            raise EngineError(f"double free of KV cache block {block}")
        self._ref[block] -= 1
        if self._ref[block] == 0:
            self._free[block] = None

    # ---------------------------------------------------------------- prefix caching

    def publish(self, block: int, key: int, tokens: tuple[int, ...]) -> None:
        """Record that allocated `block` holds the K/V of the full block `tokens` under content `key`.
        When another block already holds that content, the first one stays the cached copy."""
        if self._ref[block] <= 0:
            raise EngineError(f"cannot publish block {block}: it is not allocated")
        assert len(tokens) == self.block_size, (len(tokens), self.block_size)
        if key in self._block_of or block in self._content:
            return
        self._block_of[key] = block
        self._content[block] = (key, tokens)

    def lookup(self, key: int, tokens: tuple[int, ...]) -> Optional[int]:
        """The block holding this content, or None. Changes nothing (see `acquire_cached`)."""
        block = self._block_of.get(key)
        if block is None or self._content[block][1] != tokens:  # a hash collision is a miss
            return None
        return block

    def acquire_cached(self, block: int) -> int:
        """Take one more reference to a published block, reviving it from the free list if unowned."""
        if block not in self._content:
            raise EngineError(f"block {block} holds no cached content")
        if self._ref[block] == 0:
            del self._free[block]
        self._ref[block] += 1
        return block

    def _forget(self, block: int) -> None:
        entry = self._content.pop(block, None)
        if entry is not None:
            del self._block_of[entry[0]]

    def check_invariants(self) -> None:
        assert len(self._free) <= self.num_blocks
        for b, r in enumerate(self._ref):
            assert r >= 0, (b, r)
            assert (r == 0) == (b in self._free), f"block {b}: ref count {r} but free={b in self._free}"
        assert len(self._block_of) == len(self._content)
        for key, b in self._block_of.items():
            assert self._content[b][0] == key, (key, b)
