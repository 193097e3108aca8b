"""KV group specifications: what a model declares about its KV state, and the block arithmetic
each group kind implies. Pure Python (no torch), shared by the cache manager, the model runner
(which allocates storage from these specs) and the KV transfer layout.

Group kinds:
- ``full``: one entry per token, every block kept (Llama K/V, a shared latent).
- ``sliding_window``: one entry per token; only the last ``sliding_window`` positions are read, so
  blocks that fall wholly before the window are freed as the request advances.
- ``compressed``: one entry per ``compress_ratio`` tokens (DeepSeek-V4 CSA/HCA, indexer keys); a
  block holds ``block_size`` entries, so it spans ``block_size * compress_ratio`` tokens.
- ``state``: a fixed-size per-request state checkpointed at the end of every token block (the
  compressors' partial windows); only the checkpoint before the next token is needed, so older
  blocks are freed like a window of one position, and cached checkpoints make prefix hits possible.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

GroupKind = Literal["full", "sliding_window", "compressed", "state"]


@dataclass(frozen=True)
class KVGroupSpec:
    name: str
    kind: GroupKind
    #: Layers whose KV lives in this group (one storage tensor per group, layer-indexed).
    num_layers: int
    #: Per-layer, per-block element shape, e.g. ``(2, block_size, num_kv_heads, head_dim)``.
    block_shape: tuple[int, ...]
    #: torch dtype name, e.g. "float32", "bfloat16".
    dtype: str
    #: Entries per block (tokens for full/sliding/state, compressed entries for compressed).
    block_size: int
    sliding_window: int | None = None
    compress_ratio: int = 1

    def __post_init__(self) -> None:
        if self.kind == "sliding_window" and not self.sliding_window:
            raise ValueError(f"group {self.name}: sliding_window groups need a window")
        if self.kind == "compressed" and self.compress_ratio < 1:
            raise ValueError(f"group {self.name}: compress_ratio must be >= 1")

    @property
    def tokens_per_block(self) -> int:
        return self.block_size * (self.compress_ratio if self.kind == "compressed" else 1)

    @property
    def bytes_per_block(self) -> int:
        return self.num_layers * math.prod(self.block_shape) * dtype_size(self.dtype)

    def num_entries(self, num_tokens: int) -> int:
        """Entries that ``num_tokens`` tokens produce in this group."""
        return num_tokens // self.compress_ratio if self.kind == "compressed" else num_tokens

    def blocks_needed(self, num_tokens: int) -> int:
        """Length of the block table that covers ``num_tokens`` tokens."""
        return -(-self.num_entries(num_tokens) // self.block_size)

    def peak_blocks(self, num_tokens: int, chunk_tokens: int) -> int:
        """Most blocks a request of ``num_tokens`` tokens holds at once when prefilled in chunks
        of at most ``chunk_tokens`` (window and state groups free blocks behind them as it goes)."""
        total = self.blocks_needed(num_tokens)
        if self.kind not in ("sliding_window", "state"):
            return total
        reach = (self.sliding_window or 1) - 1 + min(chunk_tokens, num_tokens)
        return min(total, -(-reach // self.block_size) + 1)

    def first_needed_block(self, num_computed_tokens: int) -> int:
        """Blocks before this index are never read again once ``num_computed_tokens`` are computed."""
        if self.kind == "sliding_window":
            assert self.sliding_window is not None
            first_pos = max(0, num_computed_tokens - self.sliding_window + 1)
            return first_pos // self.block_size
        if self.kind == "state":
            return max(0, num_computed_tokens - 1) // self.block_size
        return 0


def dtype_size(dtype: str) -> int:
    sizes = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "uint8": 1, "int8": 1,
             "int32": 4, "int64": 8, "float64": 8}
    try:
        return sizes[dtype]
    except KeyError:
        raise ValueError(f"unknown KV dtype {dtype!r}") from None


def kv_bytes_per_token(specs: list[KVGroupSpec], context_len: int) -> float:
    """Average KV bytes per token of context for a request of ``context_len`` tokens (what it holds
    at that point: window groups only their window, state groups a checkpoint or two)."""
    total = 0
    for spec in specs:
        needed = spec.blocks_needed(context_len) - spec.first_needed_block(context_len)
        total += needed * spec.bytes_per_block
    return total / max(1, context_len)


def checkpoint_positions(start: int, end: int, block_size: int) -> list[int]:
    """Positions in ``[start, end)`` whose state a ``state`` group checkpoints when they are
    computed together (a chunk, a verify step's accepted positions): every block's last token, and
    the last one."""
    first_block_end = (start // block_size + 1) * block_size - 1
    positions = list(range(first_block_end, end, block_size))
    if not positions or positions[-1] != end - 1:
        positions.append(end - 1)
    return positions
