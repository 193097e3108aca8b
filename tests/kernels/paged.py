"""Factories for paged-attention tests: a multi-layer KV storage whose per-layer caches are strided
views, block tables with shuffled (non-contiguous, out-of-order) blocks, and the metadata of a
varlen batch mixing cached prefixes, prefill chunks and decode rows."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention import PagedAttentionMetadata


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D], a strided view
    v_cache: torch.Tensor
    meta: PagedAttentionMetadata


def make_kv_storage(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype, device: str, num_layers: int = 2,
                    layer: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random ``[num_blocks, num_layers, 2, block_size, Hkv, D]`` storage and layer ``layer``'s
    K and V views ``storage[:, layer, 0]`` and ``storage[:, layer, 1]``."""
    storage = torch.randn(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim,
                          device=device).to(dtype)
    return storage, storage[:, layer, 0], storage[:, layer, 1]


def make_paged_batch(seqs: list[tuple[int, int]], num_q_heads: int, num_kv_heads: int,
                     head_dim: int, block_size: int, dtype: torch.dtype = torch.float32,
                     device: str = "cpu", seed: int = 0, spare_blocks: int = 5) -> PagedBatch:
    """``seqs``: per sequence ``(seq_len, q_len)``: the context after this step and how many of
    its last positions are queries. Blocks are handed out in a shuffled order."""
    torch.manual_seed(seed)
    blocks_per_seq = [(s + block_size - 1) // block_size for s, _ in seqs]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    _, k_cache, v_cache = make_kv_storage(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    order = torch.randperm(num_blocks)
    max_blocks = max(blocks_per_seq)
    # Padding entries are block 0 (the references gather them); one more column of junk that no
    # kernel may read.
    block_tables = torch.zeros((len(seqs), max_blocks + 1), dtype=torch.int32)
    block_tables[:, -1] = 10**6
    used = 0
    slots: list[torch.Tensor] = []
    for i, ((seq_len, q_len), n) in enumerate(zip(seqs, blocks_per_seq)):
        table = order[used:used + n]
        used += n
        block_tables[i, :n] = table.to(torch.int32)
        pos = torch.arange(seq_len - q_len, seq_len)
        slots.append(table[pos // block_size].long() * block_size + pos % block_size)
    q_lens = [q for _, q in seqs]
    qsl = [0]
    for q_len in q_lens:
        qsl.append(qsl[-1] + q_len)
    meta = PagedAttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([s for s, _ in seqs], dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        slot_mapping=torch.cat(slots).to(device),
        query_start_loc_cpu=qsl, seq_lens_cpu=[s for s, _ in seqs],
        max_query_len=max(q_lens), max_seq_len=max(s for s, _ in seqs))
    q = torch.randn(qsl[-1], num_q_heads, head_dim, device=device).to(dtype)
    return PagedBatch(q, k_cache, v_cache, meta)


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))
