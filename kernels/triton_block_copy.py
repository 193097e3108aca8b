"""One-pass KV block copy in Triton (semantics of :func:`kernels.block_copy.copy_blocks_ref`):
program (i, c) copies chunk c of source row ``src_ids[i]`` into destination row ``dst_ids[i]``.
Source and destination may be different allocations (a peer's KV storage mapped through CUDA
IPC); row offsets are int64."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.block_copy import row_words

@triton.jit
def _copy_blocks_kernel(src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, row_words, CHUNK: tl.constexpr,
                        PER: tl.constexpr):
    """Program (i, c) copies words ``[c * PER * CHUNK, (c + 1) * PER * CHUNK)`` of row i, CHUNK at
    a time (streaming: the bytes are not read again, so they bypass L1 and are evicted first)."""
    i = tl.program_id(0)
    c = tl.program_id(1)
    src_row = tl.load(src_ids_ptr + i).to(tl.int64)
    dst_row = tl.load(dst_ids_ptr + i).to(tl.int64)
    for j in range(PER):
        offs = (c.to(tl.int64) * PER + j) * CHUNK + tl.arange(0, CHUNK)
        mask = offs < row_words
        x = tl.load(src_ptr + src_row * row_words + offs, mask=mask, cache_modifier=".cg")
        tl.store(dst_ptr + dst_row * row_words + offs, x, mask=mask, cache_modifier=".cs")


def _shape(num_rows: int) -> tuple[int, int]:
    """(CHUNK, PER) in words: few rows (a short request) keep more bytes in flight per program;
    many rows fill the GPU with short programs (measured on H200, bench/transfer.py)."""
    return (2048, 4) if num_rows <= 128 else (8192, 1)


def copy_blocks_triton(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """``dst[dst_ids[i]] = src[src_ids[i]]`` for contiguous ``[num_blocks, ...]`` storages with rows
    of equal size; ids are int64 tensors on the source's device."""
    if src_ids.numel() == 0:
        return
    s, d = row_words(src), row_words(dst)
    if s.shape[1] != d.shape[1] or s.dtype != d.dtype:
        raise ValueError(f"block rows differ: {tuple(s.shape)} {s.dtype} vs {tuple(d.shape)} {d.dtype}")
    words = s.shape[1]
    chunk, per = _shape(src_ids.numel())
    chunk = min(chunk, triton.next_power_of_2(words))
    _copy_blocks_kernel[(src_ids.numel(), triton.cdiv(words, chunk * per))](
        s, d, src_ids, dst_ids, words, CHUNK=chunk, PER=per, num_warps=8)
