"""Token-to-expert alignment for the fused MoE in Triton (contract: ``kernels.moe`` docstring).

One kernel, no sort and no host synchronization, for up to ``ALIGN_MAX_PAIRS`` (token, slot)
pairs (decode and small prefill chunks). Program 0 aligns: per-expert counts by comparison
against every expert id, padded offsets by a cumulative sum, then each pair's rank among the
earlier pairs of its expert. Larger batches take the sort-based
:func:`kernels.moe.moe_align_ref`.

The same launch can also write the activations' copy in fp4 paired column order
(``kernels.triton_quant``) that fp4 expert GEMMs read: programs ``1 + t`` copy token ``t``. At
decode a launch costs about as much as either job, so they share one.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe import max_aligned_blocks, moe_align_ref
from kernels.triton_quant import fp4_paired_source

ALIGN_MAX_PAIRS = 4096


def paired_columns(x: torch.Tensor) -> torch.Tensor:
    """``x [T, H]`` (H a multiple of 8) with its columns in fp4 paired order, contiguous."""
    num_tokens, hidden = x.shape
    return x.reshape(num_tokens, hidden // 8, 2, 4).transpose(-1, -2).reshape(num_tokens, hidden)


@triton.jit
def _pair_row(x_ptr, out_ptr, row, hidden, stride_x, BLOCK: tl.constexpr):
    """``out[row] = x[row]`` in fp4 paired column order (``out`` contiguous)."""
    row = row.to(tl.int64)
    for c0 in range(0, hidden, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mask = cols < hidden  # whole groups of 8: hidden is a multiple of 8
        v = tl.load(x_ptr + row * stride_x + fp4_paired_source(cols), mask=mask)
        tl.store(out_ptr + row * hidden + cols, v, mask=mask)


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr, starts_ptr, num_pairs,
                  max_blocks, x_ptr, x_paired_ptr, hidden, stride_x,
                  NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    if tl.program_id(0) > 0:
        _pair_row(x_ptr, x_paired_ptr, tl.program_id(0) - 1, hidden, stride_x, BLOCK_H)
        return
    offs_e = tl.arange(0, BLOCK_E)
    e_mask = offs_e < NUM_EXPERTS
    offs_p = tl.arange(0, BLOCK_P)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for p0 in range(0, num_pairs, BLOCK_P):
        ids = tl.load(ids_ptr + p0 + offs_p, mask=p0 + offs_p < num_pairs, other=-1)
        counts += tl.sum((ids[None, :] == offs_e[:, None]).to(tl.int32), 1)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    total = tl.sum(padded, 0)
    tl.store(num_padded_ptr, total)
    tl.store(starts_ptr + offs_e, ends - padded, mask=e_mask)
    for b0 in range(0, max_blocks, BLOCK_P):
        blocks = b0 + offs_p
        row = blocks * BLOCK_M
        expert = tl.sum(((ends[None, :] <= row[:, None]) & e_mask[None, :]).to(tl.int32), 1)
        tl.store(expert_ids_ptr + blocks, tl.where(row < total, expert, -1), mask=blocks < max_blocks)
        padding = tl.full([BLOCK_P, BLOCK_M], num_pairs, tl.int32)
        tl.store(sorted_ptr + row[:, None] + tl.arange(0, BLOCK_M)[None, :], padding,
                 mask=(blocks < max_blocks)[:, None])
    tl.debug_barrier()  # starts and padding are visible to every thread before the scatter
    for p0 in range(0, num_pairs, BLOCK_P):
        pairs = p0 + offs_p
        ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
        rank = tl.zeros([BLOCK_P], tl.int32)
        for q0 in range(0, p0 + BLOCK_P, BLOCK_P):
            others = q0 + offs_p
            ids_q = tl.load(ids_ptr + others, mask=others < num_pairs, other=-2)
            before = (ids[:, None] == ids_q[None, :]) & (others[None, :] < pairs[:, None])
            rank += tl.sum(before.to(tl.int32), 1)
        start = tl.load(starts_ptr + ids, mask=pairs < num_pairs, other=0)
        tl.store(sorted_ptr + start + rank, pairs, mask=pairs < num_pairs)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract and result as :func:`kernels.moe.moe_align_ref`."""
    sorted_ids, expert_ids, num_padded, _ = moe_align_and_pair(topk_ids, num_experts, block_m)
    return sorted_ids, expert_ids, num_padded


def moe_align_and_pair(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                       x: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`moe_align`'s three tensors, and ``x [T, H]`` in fp4 paired column order
    (:func:`paired_columns`) when given (else None), from one launch."""
    num_pairs = topk_ids.numel()
    if num_pairs > ALIGN_MAX_PAIRS:
        return (*moe_align_ref(topk_ids, num_experts, block_m),
                None if x is None else paired_columns(x))
    device = topk_ids.device
    max_blocks = max_aligned_blocks(num_pairs, num_experts, block_m)
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    starts = torch.empty(num_experts, dtype=torch.int32, device=device)
    ids = topk_ids.reshape(-1)  # any integer dtype
    if x is None:
        x_paired, rows, hidden, stride_x, block_h = ids, 0, 0, 0, 16  # x unused
    else:
        x_paired = torch.empty((x.shape[0], x.shape[1]), dtype=x.dtype, device=device)
        rows, hidden, stride_x = x.shape[0], x.shape[1], x.stride(0)
        block_h = min(triton.next_power_of_2(hidden), 2048)
    _align_kernel[(1 + rows,)](
        ids, sorted_ids, expert_ids, num_padded, starts, num_pairs, max_blocks,
        ids if x is None else x, x_paired, hidden, stride_x,
        NUM_EXPERTS=num_experts, BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_P=64,
        BLOCK_M=block_m, BLOCK_H=block_h, num_warps=8)
    return sorted_ids, expert_ids, num_padded, None if x is None else x_paired
