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
    #: The step computes prompt rows (a prefill chunk, a prompt's last token): CPU projections
    #: kept quantized then take one kernel whatever the rows' count, so that a prompt's numbers
    #: do not depend on its chunking or on how much of it a prefix hit supplied.
    prefill: bool = False
    #: A verify step (speculative decoding) for a model whose state is updated in place
    #: (DeepSeek-V4's compressors): per row, the row of ``verify_states`` its state goes to if it
    #: is a verified position (-1: it is not; the state groups are not written for verified
    #: positions: the engine keeps the accepted one's), and the row of the same request's
    #: previous verified position (-1: the request's first, whose state before it is in the state
    #: groups); ``*_cpu`` the same on the host; ``verify_depth`` bounds how many verified positions
    #: of one request follow each other.
    verify_slot: torch.Tensor | None = None  # [T] int64
    verify_prev: torch.Tensor | None = None  # [T] int64
    verify_slot_cpu: list[int] | None = None
    verify_prev_cpu: list[int] | None = None
    verify_depth: int = 1
    #: Per KV group, for ``state`` groups: ``[V + 1, num_layers, *block_shape]``, row v the state
    #: after a step's v-th verified position (the last row takes other rows' writes); None for
    #: other groups.
    verify_states: list[torch.Tensor | None] | None = None

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
