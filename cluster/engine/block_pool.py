"""BlockPool: the blocks of one KV group. Owns reference counts, the free queue (LRU order, so
unreferenced blocks that still hold cached prefixes are evicted oldest first) and the prefix-cache
map from block hash to block id. Block 0 is the null block: block tables point freed or skipped
entries (sliding-window blocks behind the window) at it, and it is never allocated."""
from __future__ import annotations

from collections import OrderedDict

NULL_BLOCK = 0


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # block hash -> block id
        # Free blocks in eviction order (front evicted first). Never-used blocks come first.
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of allocatable blocks that some request references."""
        return 1.0 - self.num_free / (self.num_blocks - 1)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} blocks with {self.num_free} free")
        blocks = []
        for _ in range(n):
            block, _ = self.free_queue.popitem(last=False)
            self._evict(block)
            self.ref_cnt[block] = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on cached blocks found by a prefix hit."""
        for block in blocks:
            if self.ref_cnt[block] == 0:
                del self.free_queue[block]
            self.ref_cnt[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference on each block. ``blocks`` is given in eviction order: callers pass a
        request's blocks tail first so that a prefix's head outlives its tail in the cache."""
        for block in blocks:
            if block == NULL_BLOCK:
                continue
            self.ref_cnt[block] -= 1
            assert self.ref_cnt[block] >= 0, f"block {block} freed twice"
            if self.ref_cnt[block] == 0:
                if self.block_hash[block] is None:
                    self.free_queue[block] = None
                    self.free_queue.move_to_end(block, last=False)  # plain blocks are reused first
                else:
                    self.free_queue[block] = None

    def lookup(self, block_hash: int) -> int | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def cache(self, block: int, block_hash: int) -> None:
        """Record that ``block`` is full and holds the content named by ``block_hash``."""
        if not self.enable_caching or self.block_hash[block] is not None:
            return
        self.block_hash[block] = block_hash
        self.cached.setdefault(block_hash, block)

    def _evict(self, block: int) -> None:
        block_hash = self.block_hash[block]
        if block_hash is not None:
            if self.cached.get(block_hash) == block:
                del self.cached[block_hash]
            self.block_hash[block] = None

    def reset_prefix_cache(self) -> None:
        for block in list(self.free_queue):
            self._evict(block)
