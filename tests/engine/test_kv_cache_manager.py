"""KVCacheManager and BlockPool: allocation per group, window freeing, compressed and state
groups, prefix caching with chained hashes and reference counts, LRU eviction."""
from __future__ import annotations

import pytest

from cluster.common.block_hash import hash_token_blocks
from cluster.common.kv_spec import KVGroupSpec, kv_bytes_per_token
from cluster.engine.block_pool import NULL_BLOCK, BlockPool
from cluster.engine.kv_cache_manager import KVCacheManager

BS = 4


def full(bs: int = BS) -> KVGroupSpec:
    return KVGroupSpec("full", "full", 2, (2, bs, 1, 8), "float32", bs)


def multi_group_specs() -> list[KVGroupSpec]:
    """A DeepSeek-V4-like mix: sliding window, ratio-4 and ratio-8 compressed, state checkpoints."""
    return [
        KVGroupSpec("swa", "sliding_window", 3, (BS, 16), "bfloat16", BS, sliding_window=6),
        KVGroupSpec("csa", "compressed", 2, (BS, 16), "bfloat16", BS, compress_ratio=4),
        KVGroupSpec("hca", "compressed", 1, (1, 16), "bfloat16", 1, compress_ratio=8),
        KVGroupSpec("state", "state", 2, (8, 16), "float32", BS),
    ]


def make_manager(specs=None, num_blocks=None, caching=True) -> KVCacheManager:
    specs = specs or [full()]
    return KVCacheManager(specs, num_blocks or [16] * len(specs), BS, caching)


def test_block_pool_lru_evicts_oldest_cached_and_reuses_plain_blocks_first():
    pool = BlockPool(5, enable_caching=True)
    a, b, c = pool.allocate(3)
    pool.cache(a, 111)
    pool.cache(b, 222)
    pool.free([b, a, c])  # c is plain: reused before any cached block
    assert pool.allocate(1) == [c]
    assert pool.lookup(111) == a and pool.lookup(222) == b
    # the free queue now holds: 4 (never used), b, a; two allocations evict b (freed first).
    pool.allocate(2)
    assert pool.lookup(222) is None and pool.lookup(111) == a


def test_a_pool_of_a_billion_blocks_costs_what_it_uses():
    """A small model's compressed groups on a large GPU: hundreds of millions of blocks. The pool
    is built at once and holds entries only for blocks handed out; every block is still there."""
    import time
    start = time.perf_counter()
    pool = BlockPool(1_000_000_001, enable_caching=True)
    assert time.perf_counter() - start < 0.1
    assert pool.num_free == 1_000_000_000 and pool.usage == 0.0
    blocks = pool.allocate(3)
    assert blocks == [1, 2, 3] and pool.ref_count(2) == 1 and pool.num_free == 1_000_000_000 - 3
    pool.cache(blocks[0], 7)
    pool.free(blocks[::-1])
    assert pool.num_free == 1_000_000_000 and pool.ref_count(2) == 0
    assert pool.allocate(2) == [2, 3]  # plain blocks first (the last freed first), then fresh ones
    assert pool.allocate(1) == [4] and pool.lookup(7) == 1
    pool.reset_prefix_cache()
    assert pool.lookup(7) is None and pool.allocate(1) == [1]  # no longer cached: plain again


def test_block_pool_reports_a_double_free():
    pool = BlockPool(4, enable_caching=False)
    block = pool.allocate(1)
    pool.free(block)
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free(block)


def test_full_group_allocates_and_frees_everything():
    kv = make_manager()
    assert kv.allocate("r", 9)  # 3 blocks of 4
    assert len(kv.block_tables("r")[0]) == 3
    assert kv.allocate("r", 12)  # still 3
    assert len(kv.block_tables("r")[0]) == 3
    assert kv.allocate("r", 13)
    assert len(kv.block_tables("r")[0]) == 4
    kv.free("r")
    assert kv.usage == 0.0


def test_allocation_is_all_or_nothing():
    kv = make_manager(num_blocks=[4])  # 3 usable blocks
    assert kv.allocate("a", 8)
    assert not kv.allocate("b", 8)
    assert "b" not in kv.tables
    assert kv.num_free_blocks() == [1]


def test_prefix_hit_shares_blocks_and_keeps_one_token_to_compute():
    kv = make_manager()
    tokens = list(range(100, 113))  # 13 tokens: 3 full blocks
    hashes = hash_token_blocks(tokens, BS)
    assert kv.allocate("a", len(tokens))
    kv.cache_full_blocks("a", hashes, len(tokens))
    hit = kv.find_cached_prefix(hashes, len(tokens))
    assert hit.num_tokens == 12
    assert kv.allocate("b", len(tokens), hit)
    assert kv.block_tables("b")[0][:3] == kv.block_tables("a")[0][:3]
    assert kv.block_tables("b")[0][3] != kv.block_tables("a")[0][3]
    # exactly 12 tokens: the last block must be recomputed, so only 8 are reused
    assert kv.find_cached_prefix(hashes[:3], 12).num_tokens == 8
    kv.free("a")
    kv.free("b")
    assert kv.usage == 0.0
    # freed but cached: still found
    assert kv.find_cached_prefix(hashes, len(tokens)).num_tokens == 12


def test_chained_hash_depends_on_the_whole_prefix():
    a = hash_token_blocks([1, 2, 3, 4, 5, 6, 7, 8], BS)
    b = hash_token_blocks([9, 2, 3, 4, 5, 6, 7, 8], BS)
    assert a[1] != b[1]
    assert hash_token_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], BS, parent=a[:1]) == a
    kv = make_manager()
    assert kv.allocate("a", 8)
    kv.cache_full_blocks("a", a, 8)
    assert kv.find_cached_prefix(b + [0], 12).num_tokens == 0


def test_no_caching_finds_nothing():
    kv = make_manager(caching=False)
    hashes = hash_token_blocks(list(range(20)), BS)
    kv.allocate("a", 20)
    kv.cache_full_blocks("a", hashes, 20)
    assert kv.find_cached_prefix(hashes, 21).num_tokens == 0


def test_multi_group_block_counts():
    kv = make_manager(multi_group_specs(), [64, 64, 64, 64])
    assert kv.allocate("r", 37)
    swa, csa, hca, state = (len(t) for t in kv.block_tables("r"))
    assert swa == 10  # ceil(37 / 4)
    assert csa == 3  # 9 entries of ratio 4, 4 per block
    assert hca == 4  # 4 entries of ratio 8, 1 per block
    assert state == 10  # one checkpoint per token block


def test_sliding_window_and_state_blocks_are_freed_behind_the_window():
    kv = make_manager(multi_group_specs(), [64, 64, 64, 64])
    assert kv.allocate("r", 40)
    before = kv.num_free_blocks()
    kv.free_skipped("r", 40)
    swa, csa, hca, state = kv.block_tables("r")
    # window 6 at 40 computed tokens: positions >= 35 are needed -> blocks 8, 9 stay
    assert swa[:8] == [NULL_BLOCK] * 8 and NULL_BLOCK not in swa[8:]
    # state: only the checkpoint at position 39 (block 9) is needed
    assert state[:9] == [NULL_BLOCK] * 9 and state[9] != NULL_BLOCK
    assert NULL_BLOCK not in csa and NULL_BLOCK not in hca
    after = kv.num_free_blocks()
    assert after[0] - before[0] == 8 and after[3] - before[3] == 9
    kv.free("r")
    assert kv.usage == 0.0


def test_multi_group_prefix_hit_needs_every_group():
    specs = multi_group_specs()
    kv = make_manager(specs, [64, 64, 64, 64])
    tokens = list(range(50))
    hashes = hash_token_blocks(tokens, BS)
    assert kv.allocate("a", 50)
    kv.cache_full_blocks("a", hashes, 50)
    hit = kv.find_cached_prefix(hashes, 50)
    # the step is lcm(4, 16, 8, 4) = 16 tokens; 48 leaves tokens to compute
    assert hit.num_tokens == 48
    swa, csa, hca, state = hit.blocks
    assert swa[:10] == [NULL_BLOCK] * 10 and NULL_BLOCK not in swa[10:]
    assert len(csa) == 3 and len(hca) == 6 and state[-1] != NULL_BLOCK
    # once the window's blocks are gone from the cache, the hit shrinks to what is still whole
    kv.free_skipped("a", 50)
    kv.free("a")
    kv.pools[0].allocate(kv.pools[0].num_free)  # evict every cached sliding-window block
    assert kv.find_cached_prefix(hashes, 50).num_tokens == 0


def test_kv_bytes_per_token_counts_only_live_blocks():
    specs = multi_group_specs()
    ctx = 64
    # swa: window 6 -> blocks 14, 15 live; csa: 16 entries = 4 blocks; hca: 8 blocks; state: 1 block
    expected = (2 * specs[0].bytes_per_block + 4 * specs[1].bytes_per_block
                + 8 * specs[2].bytes_per_block + 1 * specs[3].bytes_per_block) / ctx
    assert kv_bytes_per_token(specs, ctx) == expected


def test_window_groups_need_only_their_window_plus_a_chunk():
    specs = multi_group_specs()
    kv = make_manager(specs, [64, 64, 64, 64])
    # 1000 tokens would take 250 sliding-window blocks, but chunks of 16 hold at most 7 of them
    assert specs[0].peak_blocks(1000, 16) == 7 and specs[3].peak_blocks(1000, 16) == 5
    assert not kv.can_fit(1000, 16)  # the compressed groups grow: 63 csa blocks fit, 125 hca do not
    sliding_only = make_manager([specs[0]], [10])
    assert sliding_only.can_fit(1000, 16) and not sliding_only.can_fit(1000, 64)


def test_allocate_tail_reserves_only_what_the_next_token_reads():
    kv = make_manager(multi_group_specs(), [64, 64, 64, 64])
    assert kv.allocate_tail("d", 40)
    swa, csa, hca, state = kv.block_tables("d")
    assert swa[:8] == [NULL_BLOCK] * 8 and NULL_BLOCK not in swa[8:] and len(swa) == 10
    assert state[:9] == [NULL_BLOCK] * 9 and state[9] != NULL_BLOCK
    assert NULL_BLOCK not in csa + hca and len(csa) == 3 and len(hca) == 5
    kv.free("d")
    assert kv.usage == 0.0
