"""KVCacheManager: every request's block tables, one per KV group, over one BlockPool per group.

It answers four questions for the scheduler: how much of a new request's prefix is already cached
(``find_cached_prefix``), can the request's next tokens get blocks (``allocate``), which blocks can
go because they fell out of a window (``free_skipped``), and which blocks are now full and may be
shared (``cache_full_blocks``). ``free`` returns a finished or preempted request's blocks.

Prefix caching hashes the token stream in blocks of ``hash_block_size`` tokens with chained hashes
(see ``hash_token_blocks``); a group whose blocks span several hash blocks (compressed groups) names
each of its blocks by the hash of the last token block it covers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.engine.block_pool import NULL_BLOCK, BlockPool
from cluster.common.kv_spec import KVGroupSpec


@dataclass
class CachedPrefix:
    num_tokens: int
    #: Per group, the block table that covers ``num_tokens`` (null blocks behind windows).
    blocks: list[list[int]]


class KVCacheManager:
    def __init__(self, specs: list[KVGroupSpec], num_blocks: list[int], hash_block_size: int,
                 enable_caching: bool = True) -> None:
        assert len(specs) == len(num_blocks) and specs
        for spec in specs:
            if spec.tokens_per_block % hash_block_size:
                raise ValueError(f"group {spec.name}: {spec.tokens_per_block} tokens per block is not a "
                                 f"multiple of the hash block size {hash_block_size}")
        self.specs = specs
        self.hash_block_size = hash_block_size
        self.enable_caching = enable_caching
        self.pools = [BlockPool(n, enable_caching) for n in num_blocks]
        self.tables: dict[str, list[list[int]]] = {}
        self._num_cached_blocks: dict[str, list[int]] = {}
        self._prefix_step = math.lcm(*(s.tokens_per_block for s in specs))

    # --- queries --------------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        return max(pool.usage for pool in self.pools)

    def num_free_blocks(self) -> list[int]:
        return [pool.num_free for pool in self.pools]

    def block_tables(self, request_id: str) -> list[list[int]]:
        return self.tables[request_id]

    def blocks_to_allocate(self, request_id: str, num_tokens: int) -> list[int]:
        """Per group, how many new blocks covering ``num_tokens`` would take."""
        tables = self.tables.get(request_id)
        return [max(0, spec.blocks_needed(num_tokens) - (len(tables[g]) if tables else 0))
                for g, spec in enumerate(self.specs)]

    def can_fit(self, num_tokens: int, chunk_tokens: int) -> bool:
        """Could a request of ``num_tokens`` tokens, prefilled in chunks of ``chunk_tokens``, get
        its blocks with nothing else running?"""
        return all(spec.peak_blocks(num_tokens, chunk_tokens) <= pool.num_blocks - 1
                   for spec, pool in zip(self.specs, self.pools))

    # --- prefix caching --------------------------------------------------------------------------

    def find_cached_prefix(self, block_hashes: list[int], num_tokens: int) -> CachedPrefix:
        """The longest cached prefix of a ``num_tokens``-token request, leaving at least one token
        to compute (the model must run on something to produce logits)."""
        empty = CachedPrefix(0, [[] for _ in self.specs])
        if not self.enable_caching:
            return empty
        step = self._prefix_step
        limit = min(len(block_hashes) * self.hash_block_size, num_tokens - 1)
        for g, spec in enumerate(self.specs):
            if spec.kind in ("full", "compressed"):
                limit = min(limit, self._leading_hits(g, block_hashes) * spec.tokens_per_block)
        length = (limit // step) * step
        while length > 0:
            found = [self._group_prefix(g, block_hashes, length) for g in range(len(self.specs))]
            if all(blocks is not None for blocks in found):
                return CachedPrefix(length, [b for b in found if b is not None])
            length -= step
        return empty

    def _hash_index(self, g: int, block: int) -> int:
        return (block + 1) * self.specs[g].tokens_per_block // self.hash_block_size - 1

    def _leading_hits(self, g: int, block_hashes: list[int]) -> int:
        count = 0
        while True:
            index = self._hash_index(g, count)
            if index >= len(block_hashes) or self.pools[g].lookup(block_hashes[index]) is None:
                return count
            count += 1

    def _group_prefix(self, g: int, block_hashes: list[int], length: int) -> list[int] | None:
        spec, pool = self.specs[g], self.pools[g]
        blocks = [NULL_BLOCK] * spec.blocks_needed(length)
        for j in range(spec.first_needed_block(length), len(blocks)):
            block = pool.lookup(block_hashes[self._hash_index(g, j)])
            if block is None:
                return None
            blocks[j] = block
        return blocks

    # --- allocation --------------------------------------------------------------------------------

    def allocate(self, request_id: str, num_tokens: int, prefix: CachedPrefix | None = None) -> bool:
        """Make the request's tables cover ``num_tokens`` tokens, adopting ``prefix`` on its first
        allocation. All or nothing: returns False, changing nothing, if some group lacks blocks."""
        tables = self.tables.get(request_id)
        new_request = tables is None
        adopt = prefix.blocks if (new_request and prefix and prefix.num_tokens) else [[] for _ in self.specs]
        needs = []
        for g, spec in enumerate(self.specs):
            have = len(tables[g]) if tables is not None else len(adopt[g])
            new = max(0, spec.blocks_needed(num_tokens) - have)
            reclaimed = sum(1 for b in set(adopt[g]) if b != NULL_BLOCK and self.pools[g].ref_count(b) == 0)
            if new + reclaimed > self.pools[g].num_free:
                return False
            needs.append(new)
        if tables is None:
            tables = [list(blocks) for blocks in adopt]
            for g, blocks in enumerate(tables):
                self.pools[g].touch([b for b in blocks if b != NULL_BLOCK])
            self.tables[request_id] = tables
            self._num_cached_blocks[request_id] = [len(b) for b in tables]
        for g, new in enumerate(needs):
            if new:
                tables[g].extend(self.pools[g].allocate(new))
        return True

    def allocate_tail(self, request_id: str, num_tokens: int) -> bool:
        """For a new request whose first ``num_tokens`` tokens are computed elsewhere: blocks for
        what the next token will read (window and state groups skip what is already behind them;
        those entries point at the null block). All or nothing."""
        assert request_id not in self.tables
        firsts = [spec.first_needed_block(num_tokens) for spec in self.specs]
        needs = [spec.blocks_needed(num_tokens) - first for spec, first in zip(self.specs, firsts)]
        if any(n > pool.num_free for n, pool in zip(needs, self.pools)):
            return False
        tables = [[NULL_BLOCK] * first + pool.allocate(n) for first, n, pool in zip(firsts, needs, self.pools)]
        self.tables[request_id] = tables
        self._num_cached_blocks[request_id] = [0] * len(tables)
        return True

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> list[list[tuple[int, int]]] | None:
        """Give ``child_id`` the KV of ``parent_id``'s first ``num_tokens`` tokens (a request's n
        samples after the prompt): per group, the full blocks are shared (one more reference) and
        the last partial block, which both will go on writing, is copied into a new block of the
        child's. Returns per group the (source, destination) blocks the caller must copy on the
        device, or None (nothing changed) when a group has no free block for its copy."""
        assert child_id not in self.tables
        parent = self.tables[parent_id]
        plans = []
        for g, spec in enumerate(self.specs):
            entries = spec.num_entries(num_tokens)
            full = min(entries // spec.block_size, len(parent[g]))
            partial = full < len(parent[g]) and entries % spec.block_size != 0
            plans.append((full, partial))
        if any(partial and self.pools[g].num_free < 1 for g, (_, partial) in enumerate(plans)):
            return None
        tables, copies = [], []
        for g, (full, partial) in enumerate(plans):
            shared = parent[g][:full]
            self.pools[g].touch([b for b in shared if b != NULL_BLOCK])
            table = list(shared)
            pairs = []
            if partial:
                block = self.pools[g].allocate(1)[0]
                pairs.append((parent[g][full], block))
                table.append(block)
            tables.append(table)
            copies.append(pairs)
        self.tables[child_id] = tables
        self._num_cached_blocks[child_id] = [plan[0] for plan in plans]
        return copies

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Free the blocks past those that cover ``num_tokens`` tokens (speculative decoding: the
        blocks only rejected draft tokens wrote). Full and window groups only."""
        tables = self.tables.get(request_id)
        if tables is None:
            return
        cached = self._num_cached_blocks.get(request_id)
        for g, spec in enumerate(self.specs):
            keep = spec.blocks_needed(num_tokens)
            if len(tables[g]) > keep:
                self.pools[g].free(tables[g][keep:][::-1])
                del tables[g][keep:]
                if cached is not None:
                    cached[g] = min(cached[g], keep)

    def free_skipped(self, request_id: str, num_computed_tokens: int) -> None:
        """Release blocks no future token will read (behind a sliding window, old state checkpoints)."""
        tables = self.tables.get(request_id)
        if tables is None:
            return
        for g, spec in enumerate(self.specs):
            first = min(spec.first_needed_block(num_computed_tokens), len(tables[g]))
            stale = [b for b in tables[g][:first] if b != NULL_BLOCK]
            if stale:
                self.pools[g].free(stale[::-1])
                tables[g][:first] = [NULL_BLOCK] * first

    def cache_full_blocks(self, request_id: str, block_hashes: list[int], num_computed_tokens: int) -> None:
        """Register blocks that became full (every entry computed) under their hashes."""
        if not self.enable_caching or request_id not in self.tables:
            return
        tables, done = self.tables[request_id], self._num_cached_blocks[request_id]
        for g, spec in enumerate(self.specs):
            full = min(spec.num_entries(num_computed_tokens) // spec.block_size, len(tables[g]))
            for j in range(done[g], full):
                index = self._hash_index(g, j)
                if index >= len(block_hashes):
                    full = j
                    break
                if tables[g][j] != NULL_BLOCK:
                    self.pools[g].cache(tables[g][j], block_hashes[index])
            done[g] = max(done[g], full)

    def detach(self, request_id: str) -> list[list[int]]:
        """Take a request's blocks away from it without freeing them (see ``free_blocks``)."""
        self._num_cached_blocks.pop(request_id, None)
        return self.tables.pop(request_id, None) or []

    def pin(self, request_id: str) -> list[list[int]]:
        """The request's block tables now (null entries included), with a reference on every
        block kept until ``free_blocks`` of the returned tables: the blocks can be read (a KV send off the engine
        thread) after the request frees them, skips them behind a window, or is preempted."""
        tables = [list(blocks) for blocks in self.tables.get(request_id, ())]
        for g, blocks in enumerate(tables):
            self.pools[g].touch([b for b in blocks if b != NULL_BLOCK])
        return tables

    def free_blocks(self, tables: list[list[int]]) -> None:
        for g, blocks in enumerate(tables):
            self.pools[g].free(blocks[::-1])

    def free(self, request_id: str) -> None:
        tables = self.tables.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        if tables is None:
            return
        for g, blocks in enumerate(tables):
            self.pools[g].free(blocks[::-1])

    def reset_prefix_cache(self) -> None:
        for pool in self.pools:
            pool.reset_prefix_cache()
