"""Token-to-expert alignment for the fused MoE in Triton (contract: ``kernels.moe`` docstring).

One single-program kernel, no sort and no host synchronization, for up to ``ALIGN_MAX_PAIRS``
(token, slot) pairs (decode and small prefill chunks): per-expert counts by comparison against
every expert id, padded offsets by a cumulative sum, then each pair's rank among the earlier
pairs of its expert. Larger batches take the sort-based :func:`kernels.moe.moe_align_ref`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe import max_aligned_blocks, moe_align_ref

ALIGN_MAX_PAIRS = 4096


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr, starts_ptr, num_pairs,
                  max_blocks, NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr):
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


def moe_align(topk_ids: torch.Tensor, num_experts: int,
              block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract and result as :func:`kernels.moe.moe_align_ref`."""
    num_pairs = topk_ids.numel()
    if num_pairs > ALIGN_MAX_PAIRS:
        return moe_align_ref(topk_ids, num_experts, block_m)
    device = topk_ids.device
    max_blocks = max_aligned_blocks(num_pairs, num_experts, block_m)
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    starts = torch.empty(num_experts, dtype=torch.int32, device=device)
    ids = topk_ids.reshape(-1)  # any integer dtype
    _align_kernel[(1,)](ids, sorted_ids, expert_ids, num_padded, starts, num_pairs, max_blocks,
                        NUM_EXPERTS=num_experts, BLOCK_E=triton.next_power_of_2(num_experts),
                        BLOCK_P=64, BLOCK_M=block_m, num_warps=8)
    return sorted_ids, expert_ids, num_padded
