"""KVCacheManager: slot allocation, hash-chain prefix hits, partial blocks, counters, memory report."""

import pytest

from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.memory_report import kv_memory_report
from jaxllm.request import Request
from jaxllm.sampling_params import SamplingParams


def req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams())


def run_prefill(kv, r, computed=(), num_cached=0):
    """Allocate and 'compute' the whole request, as the scheduler and runner would."""
    new = kv.allocate_slots(r, r.num_tokens - num_cached, computed)
    assert new is not None
    r.num_computed_tokens = r.num_tokens
    kv.cache_blocks(r)
    return new


def test_allocate_exact_block_counts():
    kv = KVCacheManager(block_size=4, num_blocks=10)
    r = req("a", range(10))
    new = kv.allocate_slots(r, 6)
    assert [b.block_id for b in new] == [1, 2]
    r.num_computed_tokens = 6
    assert [b.block_id for b in kv.allocate_slots(r, 2)] == []  # 8 tokens fit in 2 blocks
    r.num_computed_tokens = 8
    assert [b.block_id for b in kv.allocate_slots(r, 2)] == [3]
    assert kv.get_block_ids(r) == [1, 2, 3]
    with pytest.raises(ValueError, match="num_new_tokens"):
        kv.allocate_slots(r, 0)


def test_allocate_returns_none_and_changes_nothing_when_full():
    kv = KVCacheManager(block_size=4, num_blocks=4)  # 3 usable
    a, b = req("a", range(8)), req("b", range(100, 108))
    assert kv.allocate_slots(a, 8) is not None
    assert kv.allocate_slots(b, 8) is None
    assert kv.get_block_ids(b) == [] and kv.num_free_blocks == 1
    assert kv.allocate_slots(b, 4) is not None


def test_prefix_hit_full_blocks_only_and_never_the_last_token():
    kv = KVCacheManager(block_size=4, num_blocks=10)
    a = req("a", range(10))  # blocks [0..3] [4..7] [8 9]
    run_prefill(kv, a)
    assert kv.pool.num_cached_blocks == 2  # the partial block is not cached

    b = req("b", list(range(8)) + [50, 51, 52])
    blocks, n = kv.get_computed_blocks(b)
    assert n == 8 and [x.block_id for x in blocks] == [1, 2]
    new = kv.allocate_slots(b, b.num_tokens - n, blocks)
    assert [x.block_id for x in new] == [4]
    assert kv.get_block_ids(b) == [1, 2, 4]
    assert [x.ref_cnt for x in kv.req_to_blocks["b"]] == [2, 2, 1]

    # Exactly the cached 8 tokens: only the first block may hit (the last token must be computed).
    c = req("c", range(8))
    blocks, n = kv.get_computed_blocks(c)
    assert n == 4 and [x.block_id for x in blocks] == [1]

    # A different first block breaks the chain even when the second block's tokens match.
    d = req("d", [99, 1, 2, 3, 4, 5, 6, 7, 8])
    assert kv.get_computed_blocks(d) == ([], 0)


def test_prompt_logprobs_requests_skip_the_cache():
    kv = KVCacheManager(block_size=4, num_blocks=10)
    run_prefill(kv, req("a", range(9)))
    r = Request("b", list(range(9)), SamplingParams(prompt_logprobs=1))
    assert kv.get_computed_blocks(r) == ([], 0)
    assert kv.get_computed_blocks(req("c", range(9)))[1] == 8


def test_counters_count_each_admission_once():
    kv = KVCacheManager(block_size=4, num_blocks=10)
    a = req("a", range(9))
    run_prefill(kv, a)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (9, 0)
    b = req("b", range(9))
    blocks, n = kv.get_computed_blocks(b)
    assert n == 8
    run_prefill(kv, b, blocks, n)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (18, 8)


def test_hits_on_freed_blocks_come_back_from_the_free_queue():
    kv = KVCacheManager(block_size=4, num_blocks=6)  # 5 usable
    a = req("a", range(12))
    run_prefill(kv, a)  # blocks 1 2 3, all full and cached
    kv.free(a)
    assert kv.pool.free_block_ids() == [4, 5, 3, 2, 1]  # tail of the sequence evicted first
    b = req("b", list(range(8)) + [40])
    blocks, n = kv.get_computed_blocks(b)
    assert n == 8
    # Needs 3 blocks: 2 hits (free, ref 0) + 1 new; free = 5 of which 2 are the hits.
    new = kv.allocate_slots(b, 1, blocks)
    assert [x.block_id for x in new] == [4]
    assert kv.pool.free_block_ids() == [5, 3]
    # Allocation that needs the hits' slots too fails cleanly.
    c = req("c", list(range(8)) + list(range(60, 72)))
    blocks, n = kv.get_computed_blocks(c)
    assert n == 8
    assert kv.allocate_slots(c, 12, blocks) is None  # 3 new needed, 2 free
    assert [x.ref_cnt for x in blocks] == [1, 1]  # b holds them; the failed call took nothing


def test_caching_off():
    kv = KVCacheManager(block_size=4, num_blocks=10, enable_caching=False)
    a = req("a", range(12))
    run_prefill(kv, a)
    assert kv.get_computed_blocks(req("b", range(12))) == ([], 0)
    assert kv.pool.num_cached_blocks == 0
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)


def test_generated_tokens_extend_the_chain():
    kv = KVCacheManager(block_size=4, num_blocks=10)
    a = req("a", range(3))
    run_prefill(kv, a)
    a.output_token_ids += [7, 8]  # tokens 0 1 2 7 | 8
    assert kv.allocate_slots(a, 1) == []
    a.num_computed_tokens = 4
    kv.cache_blocks(a)
    b = req("b", [0, 1, 2, 7, 8])
    _, n = kv.get_computed_blocks(b)
    assert n == 4


def test_free_releases_everything():
    kv = KVCacheManager(block_size=4, num_blocks=10)
    rs = [req(str(i), range(i * 3 + 1)) for i in range(4)]
    for r in rs:
        run_prefill(kv, r)
    for r in rs:
        kv.free(r)
    assert kv.num_free_blocks == 9 and kv.usage == 0.0
    assert kv.req_to_blocks == {}


def test_memory_report_hand_computed():
    # seq a: 6 tokens in blocks [1, 2]; seq b shares block 1 and has 5 tokens in [1, 3].
    rep = kv_memory_report([([1, 2], 6), ([1, 3], 5)], block_size=4)
    assert rep.num_blocks == 3 and rep.allocated_slots == 12
    assert rep.used_slots == 4 + 2 + 1 and rep.logical_slots == 11
    assert rep.efficiency == pytest.approx(7 / 12)
    assert rep.sharing_ratio == pytest.approx(11 / 7)
    assert kv_memory_report([], 4).efficiency == 1.0
    with pytest.raises(ValueError, match="num_tokens"):
        kv_memory_report([([1], 5)], 4)


def test_manager_memory_report():
    kv = KVCacheManager(block_size=4, num_blocks=10)
    a = req("a", range(9))
    run_prefill(kv, a)
    rep = kv.memory_report([a])
    assert (rep.used_slots, rep.allocated_slots) == (9, 12)
