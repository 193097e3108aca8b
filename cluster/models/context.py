"""ForwardContext: everything a model's forward needs about the batch besides token ids, passed
explicitly (never a module global): positions, per-sequence lengths, and per KV group the block
tables, slot mappings and storage tensors."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention import PagedAttentionMetadata


@dataclass
class ForwardContext:
    positions: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    #: Per KV group: storage ``[num_blocks, num_layers, *block_shape]``.
    kv_caches: list[torch.Tensor]
    #: Per KV group: ``[B, max_blocks]`` int32.
    block_tables: list[torch.Tensor]
    #: Per KV group whose entries are per token (full, sliding window): ``[T]`` int64 slots.
    slot_mappings: list[torch.Tensor | None]
    #: Block size (entries per block) of each group.
    block_sizes: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def max_query_len(self) -> int:
        q = self.query_start_loc_cpu
        return max((q[i + 1] - q[i] for i in range(len(q) - 1)), default=0)

    def attention_metadata(self, group: int) -> PagedAttentionMetadata:
        slots = self.slot_mappings[group]
        assert slots is not None, f"group {group} has no per-token slots"
        return PagedAttentionMetadata(
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables[group],
            slot_mapping=slots,
            query_start_loc_cpu=self.query_start_loc_cpu,
            seq_lens_cpu=self.seq_lens_cpu,
            max_query_len=self.max_query_len,
            max_seq_len=max(self.seq_lens_cpu, default=0),
        )
