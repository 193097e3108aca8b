"""Chained block hashes of a token stream: the names of KV blocks in prefix caches, and the keys the
router uses for prefix-cache affinity. Stable across processes and machines."""
from __future__ import annotations

import hashlib
import struct


def hash_token_blocks(token_ids: list[int], block_size: int, parent: list[int] | None = None,
                      extra: int = 0) -> list[int]:
    """Chained hashes of each full block of ``token_ids``. ``parent`` holds hashes already computed
    for the leading blocks (they are extended, not recomputed). Stable across processes."""
    hashes = list(parent or [])
    prev = hashes[-1] if hashes else extra
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        data = struct.pack(f"<q{block_size}q", prev, *token_ids[start:start + block_size])
        prev = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1
        hashes.append(prev)
    return hashes
