"""BlockPool: the blocks of one KV group. Owns reference counts, the free blocks (unreferenced
blocks that still hold cached prefixes are evicted oldest first, after every block that holds
nothing) and the prefix-cache map from block hash to block id. Block 0 is the null block: block
tables point freed or skipped entries (sliding-window blocks behind the window) at it, and it is
never allocated.

Its cost grows with the blocks in use, not with the pool: a pool of a small model on a large GPU
holds hundreds of millions of blocks (DeepSeek-V4's compressed groups: tens of bytes a token), and
a list entry per block took minutes to build at start-up. Blocks never handed out are a counter;
reference counts and hashes are kept for the blocks that have been."""
from __future__ import annotations

from collections import OrderedDict

NULL_BLOCK = 0


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._ref_cnt: dict[int, int] = {}  # referenced blocks only
        self._block_hash: dict[int, int] = {}  # block id -> hash of the content it holds
        self.cached: dict[int, int] = {}  # block hash -> block id
        # Free blocks, taken in this order: freed blocks holding nothing (the last freed first),
        # blocks never handed out (ascending from _next_fresh), then freed blocks holding a cached
        # prefix (least recently freed first).
        self._plain: list[int] = []
        self._next_fresh = 1
        self._cached_free: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free(self) -> int:
        return len(self._plain) + (self.num_blocks - self._next_fresh) + len(self._cached_free)

    @property
    def usage(self) -> float:
        """Fraction of allocatable blocks that some request references."""
        return 1.0 - self.num_free / (self.num_blocks - 1)

    def ref_count(self, block: int) -> int:
        return self._ref_cnt.get(block, 0)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} blocks with {self.num_free} free")
        blocks = []
        for _ in range(n):
            if self._plain:
                block = self._plain.pop()
            elif self._next_fresh < self.num_blocks:
                block = self._next_fresh
                self._next_fresh += 1
            else:
                block, _ = self._cached_free.popitem(last=False)
                self._evict(block)
            self._ref_cnt[block] = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on cached blocks found by a prefix hit."""
        for block in blocks:
            count = self._ref_cnt.get(block, 0)
            if count == 0:
                del self._cached_free[block]  # a free block a prefix hit finds holds a cached prefix
            self._ref_cnt[block] = count + 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference on each block. ``blocks`` is given in eviction order: callers pass a
        request's blocks tail first so that a prefix's head outlives its tail in the cache."""
        for block in blocks:
            if block == NULL_BLOCK:
                continue
            count = self._ref_cnt.get(block, 0) - 1
            assert count >= 0, f"block {block} freed twice"
            if count:
                self._ref_cnt[block] = count
                continue
            del self._ref_cnt[block]
            if block in self._block_hash:
                self._cached_free[block] = None
            else:
                self._plain.append(block)  # plain blocks are reused first

    def lookup(self, block_hash: int) -> int | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def cache(self, block: int, block_hash: int) -> None:
        """Record that ``block`` is full and holds the content named by ``block_hash``."""
        if not self.enable_caching or block in self._block_hash:
            return
        self._block_hash[block] = block_hash
        self.cached.setdefault(block_hash, block)

    def _evict(self, block: int) -> None:
        block_hash = self._block_hash.pop(block, None)
        if block_hash is not None and self.cached.get(block_hash) == block:
            del self.cached[block_hash]

    def reset_prefix_cache(self) -> None:
        """Forget every free block's cached prefix: those blocks hold nothing from now on."""
        evicted = list(self._cached_free)
        self._cached_free.clear()
        for block in evicted:
            self._evict(block)
        self._plain[:0] = evicted[::-1]  # taken after the blocks that were already plain, oldest first
