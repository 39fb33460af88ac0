"""BlockPool: exact block ids, ref counts, LRU eviction of cached blocks (hand-computed cases)."""

import pytest

from jaxllm.core.block_pool import NULL_BLOCK_ID, BlockPool, hash_block_tokens


def test_block_zero_is_reserved_and_allocation_takes_the_head():
    pool = BlockPool(num_blocks=10)
    assert pool.num_usable_blocks == 9
    assert pool.free_block_ids() == list(range(1, 10))
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [1, 2, 3]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert NULL_BLOCK_ID not in pool.free_block_ids()
    assert pool.num_free_blocks == 6
    assert pool.usage == pytest.approx(3 / 9)


def test_too_many_blocks_raises():
    pool = BlockPool(num_blocks=4)
    with pytest.raises(ValueError, match="only 3 are free"):
        pool.get_new_blocks(4)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks=1)


def test_freed_blocks_go_to_the_tail_in_the_given_order():
    pool = BlockPool(num_blocks=10)
    a = pool.get_new_blocks(3)  # 1 2 3
    b = pool.get_new_blocks(2)  # 4 5
    pool.free_blocks(reversed(a))
    assert pool.free_block_ids() == [6, 7, 8, 9, 3, 2, 1]
    pool.free_blocks(reversed(b))
    assert pool.free_block_ids() == [6, 7, 8, 9, 3, 2, 1, 5, 4]
    assert [x.block_id for x in pool.get_new_blocks(6)] == [6, 7, 8, 9, 3, 2]
    assert pool.usage == pytest.approx(6 / 9)


def test_ref_counts_and_touch():
    pool = BlockPool(num_blocks=6)
    (blk,) = pool.get_new_blocks(1)
    pool.touch([blk])
    assert blk.ref_cnt == 2
    pool.free_blocks([blk])
    assert blk.ref_cnt == 1 and blk.block_id not in pool.free_block_ids()
    pool.free_blocks([blk])
    assert blk.ref_cnt == 0 and pool.free_block_ids()[-1] == blk.block_id
    # Touching a free block takes it out of the queue.
    pool.touch([blk])
    assert blk.ref_cnt == 1 and blk.block_id not in pool.free_block_ids()


def test_cached_blocks_survive_free_and_are_evicted_lru():
    pool = BlockPool(num_blocks=5)  # usable: 1..4
    blocks = pool.get_new_blocks(4)
    h = []
    parent = None
    for i in range(4):
        parent = hash_block_tokens(parent, [i] * 4)
        h.append(parent)
    pool.cache_full_blocks(blocks, h, num_cached_blocks=0, num_full_blocks=3)  # block 4 not full
    assert pool.num_cached_blocks == 3
    assert pool.get_cached_block(h[0]) is blocks[0]
    assert pool.get_cached_block(h[3]) is None
    pool.free_blocks(reversed(blocks))  # queue: 4 3 2 1
    assert pool.free_block_ids() == [4, 3, 2, 1]
    # A hit on block 2 revives it without eviction.
    pool.touch([pool.get_cached_block(h[1])])
    assert pool.free_block_ids() == [4, 3, 1]
    # New allocations take 4 (uncached) then 3 (evicts h[2]), leaving 1 cached.
    new = pool.get_new_blocks(2)
    assert [b.block_id for b in new] == [4, 3]
    assert pool.get_cached_block(h[2]) is None
    assert new[1].block_hash is None
    assert pool.get_cached_block(h[0]) is blocks[0]
    assert pool.num_cached_blocks == 2


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(num_blocks=5)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [7, 7])
    pool.cache_full_blocks([a], [h], 0, 1)
    pool.cache_full_blocks([b], [h], 0, 1)
    assert pool.get_cached_block(h) is a and b.block_hash is None
    # Evicting b must not drop a's entry.
    pool.free_blocks([b])
    pool.get_new_blocks(pool.num_free_blocks)
    assert pool.get_cached_block(h) is a


def test_caching_off_never_caches():
    pool = BlockPool(num_blocks=5, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    h = [hash_block_tokens(None, [1]), hash_block_tokens(hash_block_tokens(None, [1]), [2])]
    pool.cache_full_blocks(blocks, h, 0, 2)
    assert pool.get_cached_block(h[0]) is None and pool.num_cached_blocks == 0


def test_hash_chain_depends_on_parent_and_tokens():
    a = hash_block_tokens(None, [1, 2])
    assert a == hash_block_tokens(None, (1, 2))
    assert hash_block_tokens(a, [3, 4]) != hash_block_tokens(None, [3, 4])
    assert hash_block_tokens(a, [3, 4]) != hash_block_tokens(a, [3, 5])


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(num_blocks=4)
    blocks = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1])
    pool.cache_full_blocks(blocks, [h], 0, 1)
    assert not pool.reset_prefix_cache()
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(h) is None and blocks[0].block_hash is None
