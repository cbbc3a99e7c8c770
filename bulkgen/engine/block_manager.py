# Whole (over 300 lines): the free list, the prefix cache, the partly shared blocks and the block tables share one
# set of reference counts and keys; split, each part would reach into the others' state.
"""The paged KV cache's bookkeeping: fixed-size blocks, a free list, reference counts, a prefix cache.

Plain Python (no torch): the runner owns the tensors, this owns which block holds what. It answers
before it acts (`can_allocate` then `allocate`), so a batch is never half-built when blocks run short.

Prefix caching: once a block is full and computed, it is registered under a hash of its tokens and
of every token before it. A later sequence with the same prefix takes those blocks (reference count
+1) instead of computing them again. A freed block keeps its contents and its hash until it is
handed out again, so the free list doubles as an LRU cache: blocks are handed out from its front,
and freed blocks join its back (a sequence's tail first, since tails are the least shared).

Past the last full block a prompt shares, the prefix usually goes on into a block that differs further on (a
document's last tokens, then each request's own question): where the layout has one group, a cached block that
follows the same prefix and starts with the same tokens is found (`_partial`), and the new sequence's block is a copy
of it (`take_copies`, done by the runner before the step's forward), its first tokens counted as computed. A whole
block is copied: the slots past the shared tokens are written by the sequence before anything reads them. A block
that is not yet full is such a source too ("open": a sequence's last block, its computed tokens read from the
sequence while it runs, and kept as they were once it frees the block, until the block is handed out again), so the
samples of one prompt (`--n`), or a prompt given twice, compute the prompt's last tokens once: the scheduler admits
one of them, and the others a step later (`tail_key`), when the first has computed its prompt.

Layers that attend differently hold their K/V in groups (KVLayout, after vLLM's hybrid KV cache
manager): a block of the pool holds one block of tokens for each of a group's layers, and a sequence
has a block table per group. A sliding-window group gives back the blocks that fell out of the
sequence's window as it goes (their entries then name the null block, which no kernel reads unmasked), so a
model whose layers mostly slide holds little more than its window for them. The prefix cache is per group
too: a cached prefix is taken only where every group still holds what the next token attends to.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass

from bulkgen.engine.sequence import Sequence


@dataclass(frozen=True)
class KVLayout:
    """Which layers share a block table. Layers of one kind (full attention, or one sliding window) are
    grouped `group_size` at a time, the fewest of any kind (a group of a kind with fewer layers left has
    empty places): so every block of the one pool is the same size, and a sequence has one table a group."""

    group_windows: tuple[int, ...]  # per group: its layers' sliding window (0: the whole context)
    layer_groups: tuple[int, ...]  # per layer: its group
    layer_places: tuple[int, ...]  # per layer: its place within its group's blocks
    group_size: int

    @classmethod
    def of(cls, num_layers: int, windows: tuple[int, ...] = ()) -> KVLayout:
        """windows: each layer's sliding window (0 or none given: full attention)."""
        windows = windows or (0,) * num_layers
        kinds: dict[int, list[int]] = {}
        for layer, window in enumerate(windows):
            kinds.setdefault(window, []).append(layer)
        size = min(len(layers) for layers in kinds.values())
        group_windows: list[int] = []
        layer_groups = [0] * num_layers
        layer_places = [0] * num_layers
        for window, layers in sorted(kinds.items()):  # full attention first
            first = len(group_windows)
            group_windows.extend([window] * math.ceil(len(layers) / size))
            for i, layer in enumerate(layers):
                layer_groups[layer], layer_places[layer] = first + i // size, i % size
        return cls(tuple(group_windows), tuple(layer_groups), tuple(layer_places), size)

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def num_full_groups(self) -> int:
        return sum(1 for window in self.group_windows if not window)

    @property
    def slides(self) -> bool:
        return any(self.group_windows)


FULL_LAYOUT = KVLayout((0,), (), (), 0)  # one group: every layer attends to the whole context


@dataclass(frozen=True)
class CachedPrefix:
    """The longest prefix of a sequence that the cache holds for every group: `len` full blocks of tokens."""

    tables: list[list[int]]  # per group, the blocks taken (the null block before a sliding group's window)
    hashes: list[int]
    # and the first `partial` tokens of the next block, copied from cached block `source` (one group only)
    source: int = -1
    partial: int = 0

    def __len__(self) -> int:
        return len(self.hashes)

    def __bool__(self) -> bool:
        return bool(self.hashes) or self.partial > 0

    def num_tokens(self, block_size: int) -> int:
        return len(self.hashes) * block_size + self.partial


NO_PREFIX = CachedPrefix([], [])


PARTIAL_MIN_TOKENS = 4  # the least a partly shared block must share to be copied (and its index's key)
CHILDREN_KEPT = 64  # blocks remembered for each (prefix, first tokens): the latest (a prompt's samples find theirs)


def window_blocks(window: int, block_size: int) -> int:
    """The most blocks that `window` consecutive positions can touch."""
    return -(-(window - 1) // block_size) + 1


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 layout: KVLayout = FULL_LAYOUT, null_block: int | None = None) -> None:
        """null_block: what a sliding group's table names for a block given back (past the blocks sequences may
        hold: the cache keeps it zero); needed where the layout slides."""
        assert num_blocks >= 1 and block_size >= 1
        assert null_block is not None or not layout.slides, "a sliding layout needs a null block"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.layout = layout
        self.null_block = num_blocks if null_block is None else null_block
        self.ref_counts = [0] * num_blocks
        self._key: list[tuple[int, int] | None] = [None] * num_blocks  # (group, prefix hash) a block is cached by
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._cached: dict[tuple[int, int], int] = {}  # (group, prefix hash) -> block id
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # (parent prefix hash, first tokens) -> the latest cached blocks after that prefix: (block id, prefix hash)
        self._children: dict[tuple[int | None, tuple[int, ...]], deque[tuple[int, int]]] = {}
        self._child_key: dict[int, tuple[int | None, tuple[int, ...]]] = {}  # a cached block's key there
        self._copies: list[tuple[int, int]] = []  # (source, destination) blocks the runner copies before a step
        # open blocks (a sequence's last, not yet full) in the index of partly shared blocks: block -> (its
        # sequence, the block's place in it); their tokens are the sequence's computed ones there
        self._open: dict[int, tuple[Sequence, int]] = {}

    @property
    def num_groups(self) -> int:
        return self.layout.num_groups

    @property
    def copies_partly_shared(self) -> bool:
        """Whether a partly shared block is copied (`_partial`): where the layout has one group, none sliding."""
        return self.num_groups == 1 and not self.layout.slides

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

    def most_blocks(self, num_tokens: int, chunk: int) -> int:
        """The most blocks one sequence of up to `num_tokens` tokens holds at once, computing at most `chunk`
        tokens a step (a sliding group holds its window and the chunk)."""
        full = self.blocks_for(num_tokens)
        return sum(full if not window else min(full, window_blocks(window + min(chunk, num_tokens), self.block_size))
                   for window in self.layout.group_windows)

    def find_cached_prefix(self, seq: Sequence) -> CachedPrefix:
        """Blocks already holding the longest prefix of `seq` (always leaving one token to compute, whose
        logits the sampler needs): every block of it for full-attention groups, and for sliding groups those
        the first token computed attends to."""
        if not self.enable_prefix_caching:
            return NO_PREFIX
        bs, windows = self.block_size, self.layout.group_windows
        hashes: list[int] = []
        prefix_hash: int | None = None
        for i in range((seq.num_tokens - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            prefix_hash = hash((prefix_hash, tokens))
            if any(not window and self._lookup(g, prefix_hash, tokens) is None for g, window in enumerate(windows)):
                break
            hashes.append(prefix_hash)
        for length in range(len(hashes), 0, -1):
            tables = self._prefix_tables(seq, hashes, length)
            if tables is not None:
                return self._partial(seq, CachedPrefix(tables, hashes[:length]))
        return self._partial(seq, NO_PREFIX)

    def _partial(self, seq: Sequence, full: CachedPrefix) -> CachedPrefix:
        """`full`, and the longest start of the block after it that a cached block following the same prefix
        holds (at most the tokens before the last: its logits are needed), where the layout has one group."""
        if not self.copies_partly_shared:
            return full
        bs, start = self.block_size, len(full) * self.block_size
        most = min(bs - 1, seq.num_tokens - 1 - start)
        if most < PARTIAL_MIN_TOKENS:
            return full
        parent = full.hashes[-1] if full else None
        tokens = tuple(seq.token_ids[start:start + most])
        best, source = 0, -1
        for block_id, prefix_hash in self._children.get((parent, tokens[:PARTIAL_MIN_TOKENS]), ()):
            held = self._held(block_id)
            if self._key[block_id] != (0, prefix_hash) or held is None:
                continue  # handed out since
            common, end = PARTIAL_MIN_TOKENS, min(most, len(held))
            while common < end and held[common] == tokens[common]:
                common += 1
            if common > best:
                best, source = common, block_id
        if not best:
            return full
        return CachedPrefix(full.tables or [[]], full.hashes, source, best)

    def prompt_hashes(self, seq: Sequence) -> list[int]:
        """The prefix cache's keys of the prompt's full blocks (computed once a sequence)."""
        if seq.prompt_hashes is None:
            bs, ids, prefix_hash = self.block_size, seq.prompt_token_ids, None
            seq.prompt_hashes = []
            for i in range(len(ids) // bs):
                prefix_hash = hash((prefix_hash, tuple(ids[i * bs:(i + 1) * bs])))
                seq.prompt_hashes.append(prefix_hash)
        return seq.prompt_hashes

    def blocks_in_flight(self, seq: Sequence) -> list[int]:
        """Keys of the prompt blocks `seq` holds or will compute but has not yet entered in the prefix cache (a
        later sequence sharing them would compute them a second time)."""
        if not self.enable_prefix_caching or seq.num_computed_tokens >= seq.num_prompt_tokens:
            return []
        return self.prompt_hashes(seq)[len(seq.block_hashes):]

    def tail_key(self, seq: Sequence) -> tuple | None:
        """The prompt's tokens after its last full block but its last token, as a key: a sequence computing them
        holds it while its prompt is in flight, and a sequence with the same prompt waits for them to be computed
        and copies them (`_partial`, from an open block). None where there is nothing to copy."""
        place = (seq.num_prompt_tokens - 1) // self.block_size
        part = self.part_key(seq, place)
        return None if part is None else ("tail", part, tuple(seq.prompt_token_ids[place * self.block_size:-1]))

    def part_key(self, seq: Sequence, place: int) -> tuple | None:
        """The prompt's block at `place` as the index of partly shared blocks finds it (the prefix before it, its
        first PARTIAL_MIN_TOKENS tokens), for the scheduler's prompts in flight; None where no copy could be taken
        from it (fewer tokens before the prompt's last, or a layout of several groups)."""
        if not self.enable_prefix_caching or not self.copies_partly_shared:
            return None
        start, ids = place * self.block_size, seq.prompt_token_ids
        if len(ids) - 1 - start < PARTIAL_MIN_TOKENS:
            return None
        parent = self.prompt_hashes(seq)[place - 1] if place else None
        return ("part", parent, tuple(ids[start:start + PARTIAL_MIN_TOKENS]))

    def _held(self, block_id: int) -> tuple[int, ...] | list[int] | None:
        """The computed tokens a block of the partly shared index holds."""
        if block_id in self._open:
            seq, place = self._open[block_id]
            return seq.token_ids[place * self.block_size:seq.num_computed_tokens]
        return self._tokens[block_id]

    def _prefix_tables(self, seq: Sequence, hashes: list[int], length: int) -> list[list[int]] | None:
        bs = self.block_size
        tables = []
        for g, window in enumerate(self.layout.group_windows):
            first = max(0, length * bs - window + 1) // bs if window else 0  # the first block position length*bs sees
            table = [self.null_block] * first
            for i in range(first, length):
                block_id = self._lookup(g, hashes[i], tuple(seq.token_ids[i * bs:(i + 1) * bs]))
                if block_id is None:
                    return None
                table.append(block_id)
            tables.append(table)
        return tables

    def _lookup(self, group: int, prefix_hash: int, tokens: tuple[int, ...]) -> int | None:
        block_id = self._cached.get((group, prefix_hash))
        return None if block_id is None or self._tokens[block_id] != tokens else block_id

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int, cached: CachedPrefix = NO_PREFIX) -> int:
        """Blocks taken from the free list if `seq` computes `num_new_tokens` more tokens."""
        num_computed = cached.num_tokens(self.block_size) if cached else seq.num_computed_tokens
        num_held = len(cached) if cached else len(seq.block_table)
        new = max(0, self.blocks_for(num_computed + num_new_tokens) - num_held) * self.num_groups
        revived = sum(1 for table in cached.tables for b in table if b != self.null_block and self.ref_counts[b] == 0)
        return new + revived

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached: CachedPrefix = NO_PREFIX) -> bool:
        return self.num_blocks_needed(seq, num_new_tokens, cached) <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: CachedPrefix = NO_PREFIX) -> None:
        """Give `seq` slots for `num_new_tokens` more tokens. With `cached` (a sequence being admitted, holding no
        block), those come first and count as computed."""
        assert self.can_allocate(seq, num_new_tokens, cached), "call can_allocate first"
        if len(seq.block_tables) != self.num_groups:
            assert not seq.block_table, "a sequence's tables are laid out at its first allocation"
            seq.block_tables = [[] for _ in range(self.num_groups)]
        if cached:
            assert not seq.block_table, "a cached prefix is only taken at admission"
            for table, blocks in zip(seq.block_tables, cached.tables, strict=True):
                for block_id in blocks:
                    if block_id != self.null_block:
                        if self.ref_counts[block_id] == 0:
                            del self._free[block_id]
                        self.ref_counts[block_id] += 1
                    table.append(block_id)
            seq.block_hashes = list(cached.hashes)
            seq.num_computed_tokens = cached.num_tokens(self.block_size)
        for table in seq.block_tables:
            for _ in range(self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(table)):
                block_id, _ = self._free.popitem(last=False)
                self._forget(block_id)
                self.ref_counts[block_id] = 1
                table.append(block_id)
        if cached.partial:
            self._copies.append((cached.source, seq.block_table[len(cached)]))

    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) blocks to copy before the next forward (partly shared blocks, `_partial`)."""
        copies, self._copies = self._copies, []
        return copies

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks; full ones stay findable in the prefix cache until reused, and so does the
        start of an open one."""
        for table in seq.block_tables:
            for block_id in reversed(table):
                if block_id in self._open:  # (a sequence's own: an open block is never shared)
                    self._tokens[block_id] = tuple(self._held(block_id))
                    del self._open[block_id]
                if block_id != self.null_block:
                    self._release(block_id)
        seq.block_tables = [[] for _ in range(self.num_groups)]
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def free_outside_windows(self, seq: Sequence) -> None:
        """Give back the blocks of each sliding group that the sequence's next token no longer attends to (the
        query at position p sees p - window < k <= p)."""
        for table, window in zip(seq.block_tables, self.layout.group_windows, strict=True):
            if window:
                i = max(0, seq.num_computed_tokens - window + 1) // self.block_size - 1
                while i >= 0 and table[i] != self.null_block:  # those before were given back already
                    self._release(table[i])
                    table[i] = self.null_block
                    i -= 1

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that the last step filled, so later sequences can share them."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        for i in range(len(seq.block_hashes), num_full):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            prefix_hash = hash((seq.block_hashes[-1] if seq.block_hashes else None, tokens))
            for g, table in enumerate(seq.block_tables):
                block_id = table[i]
                if block_id in self._open:  # open until now: filled, it is cached as a full one
                    self._forget(block_id)
                if block_id != self.null_block and self._key[block_id] is None:
                    self._key[block_id] = (g, prefix_hash)
                    self._tokens[block_id] = tokens
                    self._cached.setdefault((g, prefix_hash), block_id)
                    if self.copies_partly_shared:
                        parent = seq.block_hashes[-1] if seq.block_hashes else None
                        child_key = (parent, tokens[:PARTIAL_MIN_TOKENS])
                        kept = self._children.setdefault(child_key, deque(maxlen=CHILDREN_KEPT))
                        kept.append((block_id, prefix_hash))
                        self._child_key[block_id] = child_key
            seq.block_hashes.append(prefix_hash)
        self._open_last(seq, num_full)

    def _open_last(self, seq: Sequence, place: int) -> None:
        """Enter a sequence's last block, holding some computed tokens but not full, in the partly shared index."""
        filled = seq.num_computed_tokens - place * self.block_size
        if filled < PARTIAL_MIN_TOKENS or not self.copies_partly_shared:
            return
        block_id = seq.block_table[place]
        if block_id in self._open or self._key[block_id] is not None:
            return  # entered already (or cached: a block copied whole from another)
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        start = place * self.block_size
        child_key = (parent, tuple(seq.token_ids[start:start + PARTIAL_MIN_TOKENS]))
        open_hash = hash(("open", parent, block_id))  # in no other index: the key says the block is still this one
        self._open[block_id] = (seq, place)
        self._key[block_id] = (0, open_hash)
        kept = self._children.setdefault(child_key, deque(maxlen=CHILDREN_KEPT))
        kept.append((block_id, open_hash))
        self._child_key[block_id] = child_key

    def _release(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        assert self.ref_counts[block_id] >= 0
        if self.ref_counts[block_id] == 0:
            self._free[block_id] = None

    def _forget(self, block_id: int) -> None:
        self._open.pop(block_id, None)
        key = self._key[block_id]
        if key is not None and self._cached.get(key) == block_id:
            del self._cached[key]
        self._key[block_id] = None
        self._tokens[block_id] = None
        kept = self._children.get(child_key := self._child_key.pop(block_id, None))  # (a full deque drops its oldest)
        if kept is not None:
            for entry in [e for e in kept if e[0] == block_id]:
                kept.remove(entry)
            if not kept:
                del self._children[child_key]
