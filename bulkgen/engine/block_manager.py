"""The paged KV cache's bookkeeping: fixed-size blocks, a free list, reference counts, a prefix cache.

Plain Python (no torch): the runner owns the tensors, this owns which block holds what. It answers
before it acts (`can_allocate` then `allocate`), so a batch is never half-built when blocks run short.

Prefix caching: once a block is full and computed, it is registered under a hash of its tokens and
of every token before it. A later sequence with the same prefix takes those blocks (reference count
+1) instead of computing them again. A freed block keeps its contents and its hash until it is
handed out again, so the free list doubles as an LRU cache: blocks are handed out from its front,
and freed blocks join its back (a sequence's tail first, since tails are the least shared).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq

from bulkgen.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks >= 1 and block_size >= 1
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # prefix hash -> block id
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def free_block_ids(self) -> list[int]:
        return list(self._free)

    @property
    def usage(self) -> float:
        """Share of blocks held by sequences (cached-but-free blocks count as free)."""
        return 1 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks already holding the longest prefix of `seq` (always leaving one token to compute,
        whose logits the sampler needs)."""
        if not self.enable_prefix_caching:
            return []
        blocks: list[int] = []
        prefix_hash: int | None = None
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            prefix_hash = hash((prefix_hash, tokens))
            block_id = self._cached.get(prefix_hash)
            if block_id is None or self._tokens[block_id] != tokens:
                break
            blocks.append(block_id)
        return blocks

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int, cached_blocks: Seq[int] = ()) -> int:
        """Blocks taken from the free list if `seq` computes `num_new_tokens` more tokens."""
        num_computed = len(cached_blocks) * self.block_size if cached_blocks else seq.num_computed_tokens
        num_held = len(cached_blocks) if cached_blocks else len(seq.block_table)
        new = max(0, self.blocks_for(num_computed + num_new_tokens) - num_held)
        return new + sum(1 for b in cached_blocks if self.ref_counts[b] == 0)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: Seq[int] = ()) -> bool:
        return self.num_blocks_needed(seq, num_new_tokens, cached_blocks) <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: Seq[int] = ()) -> None:
        """Give `seq` slots for `num_new_tokens` more tokens. With `cached_blocks` (a sequence being
        admitted, holding no block), those come first and count as computed."""
        assert self.can_allocate(seq, num_new_tokens, cached_blocks), "call can_allocate first"
        if cached_blocks:
            assert not seq.block_table, "a cached prefix is only taken at admission"
            for block_id in cached_blocks:
                if self.ref_counts[block_id] == 0:
                    del self._free[block_id]
                self.ref_counts[block_id] += 1
                seq.block_table.append(block_id)
                seq.block_hashes.append(self._hash[block_id])
            seq.num_computed_tokens = len(cached_blocks) * self.block_size
        for _ in range(self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)):
            block_id, _ = self._free.popitem(last=False)
            self._forget(block_id)
            self.ref_counts[block_id] = 1
            seq.block_table.append(block_id)

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks; full ones stay findable in the prefix cache until reused."""
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] >= 0
            if self.ref_counts[block_id] == 0:
                self._free[block_id] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that the last step filled, so later sequences can share them."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        for i in range(len(seq.block_hashes), num_full):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            prefix_hash = hash((seq.block_hashes[-1] if seq.block_hashes else None, tokens))
            block_id = seq.block_table[i]
            if self._hash[block_id] is None:
                self._hash[block_id] = prefix_hash
                self._tokens[block_id] = tokens
                self._cached.setdefault(prefix_hash, block_id)
            seq.block_hashes.append(prefix_hash)

    def _forget(self, block_id: int) -> None:
        prefix_hash = self._hash[block_id]
        if prefix_hash is not None and self._cached.get(prefix_hash) == block_id:
            del self._cached[prefix_hash]
        self._hash[block_id] = None
        self._tokens[block_id] = None
