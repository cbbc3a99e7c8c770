"""Block manager: exact block ids and free-list order (block size 4, 8 blocks)."""

from __future__ import annotations

from bulkgen.config import SamplingParams
from bulkgen.engine.block_manager import BlockManager
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
    assert cached == [0, 1]
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
    assert bm.find_cached_prefix(c) == [0, 1]
    # A cached block that is free counts against the free list when taken.
    assert bm.num_blocks_needed(c, 1, [0, 1]) == 3


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
    assert bm.find_cached_prefix(seq(5)) == []


def test_cached_prefix_always_leaves_a_token_to_compute() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(8)
    bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    assert bm.find_cached_prefix(seq(8)) == [0]  # not both: the last token's logits are needed
    assert bm.find_cached_prefix(seq(9)) == [0, 1]


def test_prefix_caching_off() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = seq(8)
    bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    assert bm.find_cached_prefix(seq(9)) == []
