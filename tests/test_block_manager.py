"""Block manager: exact block ids and free-list order (block size 4, 8 blocks)."""

from __future__ import annotations

from bulkgen.config import SamplingParams
from bulkgen.engine.block_manager import BlockManager, KVLayout
from bulkgen.engine.sequence import Sequence


def seq(n: int, first: int = 100, request_id: int = 0) -> Sequence:
    return Sequence(request_id, list(range(first, first + n)), SamplingParams())


def test_allocate_takes_blocks_from_the_front_of_the_free_list() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(6)
    assert bm.num_blocks_needed(a, 6) == 2 and bm.can_allocate(a, 6)
    bm.allocate(a, 6)
    assert a.block_table == [0, 1]
    assert bm.free_block_ids == [2, 3, 4, 5, 6, 7]
    a.num_computed_tokens = 6
    assert bm.num_blocks_needed(a, 2) == 0  # slots 6 and 7 are in block 1
    assert bm.num_blocks_needed(a, 3) == 1
    bm.allocate(a, 3)
    assert a.block_table == [0, 1, 2]
    assert bm.usage == 3 / 8


def test_can_allocate_answers_before_acting() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    big = seq(33)  # 9 blocks: more than there are
    assert not bm.can_allocate(big, 33)
    assert bm.free_block_ids == list(range(8)) and big.block_table == []
    assert bm.can_allocate(big, 32)


def test_free_returns_blocks_tail_first_to_the_back() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = seq(8, request_id=1), seq(4, first=500, request_id=2)
    bm.allocate(a, 8)
    bm.allocate(b, 4)
    assert (a.block_table, b.block_table) == ([0, 1], [2])
    bm.free(a)
    assert bm.free_block_ids == [3, 4, 5, 6, 7, 1, 0]
    assert a.block_table == [] and a.num_computed_tokens == 0
    c = seq(20, first=900, request_id=3)
    bm.allocate(c, 20)
    assert c.block_table == [3, 4, 5, 6, 7]
    assert bm.free_block_ids == [1, 0]


def test_prefix_cache_shares_full_blocks_with_reference_counts() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(10)
    bm.allocate(a, 10)
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)
    assert len(a.block_hashes) == 2  # blocks 0 and 1 are full; block 2 holds 2 tokens
    b = Sequence(2, list(range(100, 108)) + [7, 7, 7], SamplingParams())  # same first 8 tokens
    cached = bm.find_cached_prefix(b)
    assert cached.tables == [[0, 1]]
    assert bm.num_blocks_needed(b, 3, cached) == 1
    bm.allocate(b, 3, cached)
    assert b.block_table == [0, 1, 3] and b.num_computed_tokens == 8
    assert bm.ref_counts[:4] == [2, 2, 1, 1]
    bm.free(a)
    assert bm.ref_counts[:4] == [1, 1, 0, 1]
    assert bm.free_block_ids == [4, 5, 6, 7, 2]
    bm.free(b)
    # Freed full blocks stay findable until they are handed out again.
    c = seq(9)
    cached = bm.find_cached_prefix(c)
    assert cached.tables == [[0, 1]]
    # A cached block that is free counts against the free list when taken.
    assert bm.num_blocks_needed(c, 1, cached) == 3


def test_a_cached_block_is_forgotten_when_reused() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    a = seq(5)
    bm.allocate(a, 5)
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)
    bm.free(a)
    assert bm.free_block_ids == [1, 0]
    other = seq(8, first=900)
    bm.allocate(other, 8)  # takes 1 then 0: block 0's old contents are gone
    assert other.block_table == [1, 0]
    assert not bm.find_cached_prefix(seq(5))


def test_cached_prefix_always_leaves_a_token_to_compute() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(8)
    bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    assert bm.find_cached_prefix(seq(8)).tables == [[0]]  # not both: the last token's logits are needed
    assert bm.find_cached_prefix(seq(9)).tables == [[0, 1]]


def test_prefix_caching_off() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = seq(8)
    bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    assert not bm.find_cached_prefix(seq(9))


def test_layers_are_grouped_by_how_they_attend() -> None:
    """Gemma 3 1B's pattern (a full layer after five sliding ones, 26 layers): groups of the fewest of a kind (4
    full layers), the sliding kind in six groups of four (the last with two empty places)."""
    windows = tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(26))
    layout = KVLayout.of(26, windows)
    assert layout.group_size == 4 and layout.group_windows == (0,) + (512,) * 6
    assert [layout.layer_groups[i] for i in (5, 11, 17, 23)] == [0] * 4
    assert [layout.layer_places[i] for i in (5, 11, 17, 23)] == [0, 1, 2, 3]
    assert layout.layer_groups[:5] == (1, 1, 1, 1, 2) and layout.layer_groups[24:] == (6, 6)
    assert len({(g, p) for g, p in zip(layout.layer_groups, layout.layer_places, strict=True)}) == 26
    assert KVLayout.of(4, (8, 8, 8, 8)).group_windows == (8,)  # all alike: one group, as without windows
    assert KVLayout.of(4).group_windows == (0,) and KVLayout.of(4).group_size == 4
    assert KVLayout.of(4, (128, 0, 128, 0)).group_windows == (0, 128)  # gpt-oss: every other layer slides


def sliding_manager(num_blocks: int = 16) -> BlockManager:
    """One full group and one sliding over a window of 8 tokens, in blocks of 4."""
    return BlockManager(num_blocks, block_size=4, layout=KVLayout.of(2, (0, 8)), null_block=num_blocks)


def test_a_sliding_group_gives_back_the_blocks_its_window_has_passed() -> None:
    bm = sliding_manager()
    a = seq(20)
    bm.allocate(a, 20)
    assert [len(t) for t in a.block_tables] == [5, 5] and bm.num_free_blocks == 6
    a.num_computed_tokens = 20
    bm.free_outside_windows(a)
    # the token at position 20 sees 13..20: blocks 0-2 (positions 0..11) are out of its window, block 3 (12..15) not
    assert a.block_tables[1][:4] == [16, 16, 16, a.block_tables[1][3]] and a.block_tables[0] == [0, 1, 2, 3, 4]
    assert bm.num_free_blocks == 9
    a.num_computed_tokens = 23  # sees 16..23: block 3 goes too
    bm.free_outside_windows(a)
    assert a.block_tables[1][3] == 16 and bm.num_free_blocks == 10
    bm.free(a)
    assert bm.num_free_blocks == 16 and bm.ref_counts == [0] * 16


def test_a_cached_prefix_needs_only_the_window_of_a_sliding_group() -> None:
    bm = sliding_manager()
    a = seq(16)
    bm.allocate(a, 16)
    a.num_computed_tokens = 16
    bm.cache_full_blocks(a)
    full, sliding = (list(t) for t in a.block_tables)
    bm.free_outside_windows(a)  # position 16 sees 9..16: sliding blocks 0 and 1 are given back (still cached)
    b = seq(17)  # the same 16 tokens and one more
    cached = bm.find_cached_prefix(b)
    assert len(cached) == 4 and cached.tables == [full, [16, 16] + sliding[2:]]
    assert bm.num_blocks_needed(b, 1, cached) == 2  # one more block a group
    # once a sliding block inside the window is reused, that prefix is gone; a shorter one may still be whole
    bm.free(a)
    other = seq(4, first=900)
    while sliding[3] not in other.block_table:
        bm.free(other)
        bm._free.move_to_end(sliding[3], last=False)
        bm.allocate(other, 4)
    cached = bm.find_cached_prefix(b)
    assert len(cached) == 3 and cached.tables == [full[:3], [16] + sliding[1:3]]  # position 12 sees 5..12


def test_partly_shared_blocks_are_found_copied_and_forgotten() -> None:
    """After a full prefix, the longest start of a cached block that follows it is copied (at least
    PARTIAL_MIN_TOKENS, at most all but the last token); the index of such blocks stays bounded and forgets the
    blocks handed out again, however many were registered under one key."""
    from bulkgen.engine.block_manager import CHILDREN_KEPT

    bm = BlockManager(num_blocks=40, block_size=8)

    def run(tokens: list[int]) -> Sequence:
        s = Sequence(len(tokens), tokens, SamplingParams(max_new_tokens=1))
        cached = bm.find_cached_prefix(s)
        bm.allocate(s, len(tokens) - cached.num_tokens(8), cached)
        s.num_computed_tokens = len(tokens)
        bm.cache_full_blocks(s)
        return s

    first = run(list(range(1, 18)))  # two full blocks cached
    assert bm.take_copies() == []
    b = Sequence(2, [*range(1, 14), 0, 0], SamplingParams(max_new_tokens=1))
    cached = bm.find_cached_prefix(b)
    assert (len(cached), cached.partial, cached.source) == (1, 5, first.block_table[1])
    short = Sequence(3, [*range(1, 12), 0], SamplingParams(max_new_tokens=1))  # 3 tokens shared: computed again
    assert (len(bm.find_cached_prefix(short)), bm.find_cached_prefix(short).partial) == (1, 0)
    c = Sequence(4, list(range(1, 17)), SamplingParams(max_new_tokens=1))  # all of block 1: its last token computed
    cached = bm.find_cached_prefix(c)
    assert (len(cached), cached.partial, cached.source) == (1, 7, first.block_table[1])
    bm.allocate(c, 1, cached)
    assert c.num_computed_tokens == 15 and bm.take_copies() == [(first.block_table[1], c.block_table[1])]
    bm.free(c)
    bm.free(first)
    for i in range(3 * CHILDREN_KEPT):  # many blocks after one prefix, all starting alike: the index keeps the latest
        bm.free(run([*range(1, 13), 100 + i, 0, 0, 0, 9]))
    assert all(len(kept) <= CHILDREN_KEPT for kept in bm._children.values())
    for round_ in range(3):  # hand every block out again: all forgotten, nothing stale left in the index
        bm.free(run(list(range(1000 * (round_ + 1), 1000 * (round_ + 1) + 8 * 40 - 1))))
    assert all(bm._key[b] is not None for kept in bm._children.values() for b, _ in kept)


def test_an_open_block_is_copied_from_while_it_fills_then_cached_whole() -> None:
    """A running sequence's last block, not yet full, is a source of partly shared copies: its computed tokens
    (and no more) are shared; once full it is cached as a whole block, nothing of it left open."""
    bm = BlockManager(num_blocks=16, block_size=8)
    a = Sequence(1, list(range(1, 14)), SamplingParams(max_new_tokens=8))  # a full block and 5 tokens
    bm.allocate(a, 13)
    a.num_computed_tokens = 13
    bm.cache_full_blocks(a)
    b = Sequence(2, [*range(1, 14), 50, 51], SamplingParams(max_new_tokens=1))
    cached = bm.find_cached_prefix(b)
    assert (len(cached), cached.partial, cached.source) == (1, 5, a.block_table[1])  # not the 6 b could take
    for token in (14, 15, 16):  # a decodes to the end of its block
        a.append_token(token)
        bm.allocate(a, 1)
        a.num_computed_tokens += 1
        bm.cache_full_blocks(a)
    c = Sequence(3, [*range(1, 17), 99], SamplingParams(max_new_tokens=1))
    assert len(bm.find_cached_prefix(c)) == 2 and not bm._open
    bm.free(a)
    assert not bm._open
