"""One-pass KV block copy in Triton (semantics of :func:`kernels.block_copy.copy_blocks_ref`):
program (i, c) copies chunk c of source row ``src_ids[i]`` into destination row ``dst_ids[i]``.
Source and destination may be different allocations (a peer's KV storage mapped through CUDA
IPC); row offsets are int64."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.block_copy import row_words

CHUNK = 4096  # words per program (32 KB of int64)


@triton.jit
def _copy_blocks_kernel(src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, row_words, CHUNK: tl.constexpr):
    i = tl.program_id(0)
    c = tl.program_id(1)
    src_row = tl.load(src_ids_ptr + i).to(tl.int64)
    dst_row = tl.load(dst_ids_ptr + i).to(tl.int64)
    offs = c.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < row_words
    x = tl.load(src_ptr + src_row * row_words + offs, mask=mask)
    tl.store(dst_ptr + dst_row * row_words + offs, x, mask=mask)


def copy_blocks_triton(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """``dst[dst_ids[i]] = src[src_ids[i]]`` for contiguous ``[num_blocks, ...]`` storages with rows
    of equal size; ids are int64 tensors on the source's device."""
    if src_ids.numel() == 0:
        return
    s, d = row_words(src), row_words(dst)
    if s.shape[1] != d.shape[1] or s.dtype != d.dtype:
        raise ValueError(f"block rows differ: {tuple(s.shape)} {s.dtype} vs {tuple(d.shape)} {d.dtype}")
    words = s.shape[1]
    _copy_blocks_kernel[(src_ids.numel(), triton.cdiv(words, CHUNK))](
        s, d, src_ids, dst_ids, words, CHUNK=CHUNK, num_warps=8)
