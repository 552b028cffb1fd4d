"""Per-sequence block tables over one `BlockManager`, and the prefix cache's lookups.

`BlockSpace` is the only owner of block tables: the scheduler asks it to admit, grow and release
sequences, the model runner reads the tables it snapshots into a scheduled batch. Pure Python.

Prefix caching (vLLM's automatic prefix caching, at block granularity): once a full block of a
sequence's tokens has been computed, it is published under a key chaining its tokens with the key of
the block before it. Admitting a sequence looks up its leading full blocks in order and shares every
hit instead of recomputing it. At least the last token is always recomputed, because its logits are
what the next token is sampled from. Keys are published only after the forward that computed the block
ran, so a sequence never reads K/V that are still being written.
"""
from __future__ import annotations

from typing import Optional

from ..block_manager import BlockManager, block_key


class BlockSpace:
    def __init__(self, manager: BlockManager, prefix_caching: bool):
        self.manager = manager
        self.prefix_caching = prefix_caching
        self.block_size = manager.block_size
        self._tables: dict[int, list[int]] = {}
        self._keys: dict[int, list[int]] = {}  # seq id -> content keys of its published leading blocks
        self.peak_used = 0

    # ---------------------------------------------------------------- reads

    def table(self, seq_id: int) -> list[int]:
        return self._tables[seq_id]

    def holds(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def blocks_to_grow(self, seq_id: int, num_tokens: int) -> int:
        """Fresh blocks a held sequence needs to hold `num_tokens` tokens."""
        return max(0, self.manager.blocks_for(num_tokens) - len(self._tables[seq_id]))

    def can_grow(self, seq_id: int, num_tokens: int) -> bool:
        return self.blocks_to_grow(seq_id, num_tokens) <= self.manager.num_free

    def cached_prefix(self, tokens: list[int]) -> list[int]:
        """Blocks holding this sequence's leading full blocks, in order, as far as they are cached.
        Changes nothing. Leaves at least one token to compute."""
        if not self.prefix_caching:
            return []
        bs = self.block_size
        hits, parent = [], None
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            parent = block_key(parent, chunk)
            block = self.manager.lookup(parent, chunk)
            if block is None:
                break
            hits.append(block)
        return hits

    def can_admit(self, hits: list[int], num_tokens: int) -> bool:
        """Whether a sequence with these prefix hits fits with room for `num_tokens` tokens. A hit on an
        unowned cached block takes that block off the free list too."""
        fresh = self.manager.blocks_for(num_tokens) - len(hits)
        revived = sum(1 for b in hits if self.manager.ref_count(b) == 0)
        return fresh + revived <= self.manager.num_free

    # ---------------------------------------------------------------- changes (scheduler only)

    def admit(self, seq_id: int, tokens: list[int], hits: list[int], num_tokens: int) -> int:
        """Give a sequence its table: the prefix hits shared, fresh blocks up to `num_tokens` tokens.
        Returns the number of cached tokens (len(hits) * block_size)."""
        assert seq_id not in self._tables, seq_id
        assert self.can_admit(hits, num_tokens)
        table = [self.manager.acquire_cached(b) for b in hits]
        keys, parent = [], None
        for i in range(len(hits)):  # the keys the hits were found under (cheap: a few hashes)
            parent = block_key(parent, tuple(tokens[i * self.block_size:(i + 1) * self.block_size]))
            keys.append(parent)
        self._tables[seq_id], self._keys[seq_id] = table, keys
        self.grow(seq_id, num_tokens)
        return len(hits) * self.block_size

    def grow(self, seq_id: int, num_tokens: int) -> None:
        table = self._tables[seq_id]
        for _ in range(self.blocks_to_grow(seq_id, num_tokens)):
            table.append(self.manager.allocate())
        self.peak_used = max(self.peak_used, self.manager.num_used)

    def publish(self, seq_id: int, tokens: list[int], num_computed: int) -> None:
        """Publish the sequence's full blocks among its first `num_computed` (computed) tokens."""
        if not self.prefix_caching:
            return
        table, keys, bs = self._tables[seq_id], self._keys[seq_id], self.block_size
        parent: Optional[int] = keys[-1] if keys else None
        for i in range(len(keys), num_computed // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            parent = block_key(parent, chunk)
            self.manager.publish(table[i], parent, chunk)
            keys.append(parent)

    def release(self, seq_id: int) -> None:
        """Return every block of the sequence (finished or preempted); cached content stays reusable."""
        for b in self._tables.pop(seq_id):
            self.manager.free(b)
        self._keys.pop(seq_id)

    def check_invariants(self) -> None:
        self.manager.check_invariants()
        owners: dict[int, int] = {}
        for table in self._tables.values():
            for b in table:
                owners[b] = owners.get(b, 0) + 1
        for b, n in owners.items():
            assert self.manager.ref_count(b) == n, (b, n, self.manager.ref_count(b))
        # every block in use belongs to some table, and only to tables
        assert set(owners) == {b for b in range(self.manager.num_blocks) if self.manager.ref_count(b) > 0}
