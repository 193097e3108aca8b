"""Copy whole KV blocks between storages by block-id lists: ``dst[dst_ids[i]] = src[src_ids[i]]``
for tensors laid out ``[num_blocks, ...]`` (each block a contiguous row). The reference gathers
and scatters (two passes over the bytes); the Triton kernel reads each source row and writes its
destination row once, which is what a KV transfer between mapped memories should cost."""
from __future__ import annotations

import torch


def copy_blocks_ref(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    dst.index_copy_(0, dst_ids, src.index_select(0, src_ids))


def row_words(storage: torch.Tensor) -> torch.Tensor:
    """A contiguous ``[num_blocks, ...]`` storage as ``[num_blocks, words]`` of the widest integer
    type that divides a row (a view: writes go through)."""
    flat = storage.view(storage.shape[0], -1).view(torch.uint8)
    row_bytes = flat.shape[1]
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if row_bytes % size == 0 and flat.data_ptr() % size == 0:
            return flat.view(dtype)
    return flat
