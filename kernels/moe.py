"""Fused mixture-of-experts: the pure-torch reference and the token-to-expert alignment contract
shared with the Triton implementation (``kernels.triton_moe``).

Weights per expert: ``w13 [E, 2 * I, H]`` (gate rows, then up rows) and ``w2 [E, H, I]``, each a
float tensor or a :class:`kernels.quant.QuantizedWeight` (any format). Each token ``t`` goes to
experts ``topk_ids[t]`` with weights ``topk_weights[t]``; the output is
``sum_j topk_weights[t, j] * w2[e_j] @ swiglu(w13[e_j] @ x[t])`` with SwiGLU as
:func:`kernels.activation.silu_and_mul_ref` (optional clamp).

Alignment: the ``P = T * top_k`` (token, slot) pairs, pair ``p = t * top_k + j``, are grouped by
expert, each expert's run padded to a multiple of ``block_m`` so that every block of ``block_m``
rows belongs to one expert:
- ``sorted_ids [max_blocks * block_m]`` int32: pair ids in expert order (within an expert, in
  increasing pair order), padding = ``P``;
- ``expert_ids [max_blocks]`` int32: each block's expert, -1 past the end;
- ``num_padded [1]`` int32: rows in use.
``max_blocks = ceil(P / block_m) + min(E, P)`` bounds the blocks without a device sync.
"""
from __future__ import annotations

import torch

from kernels.activation import silu_and_mul_ref
from kernels.quant import QuantizedWeight, dequantize

MoEWeight = torch.Tensor | QuantizedWeight


def fused_moe_ref(x: torch.Tensor, w13: MoEWeight, w2: MoEWeight, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, clamp: float | None = None) -> torch.Tensor:
    """``x [T, H]``, ``topk_weights [T, k]`` float32, ``topk_ids [T, k]`` int -> ``[T, H]`` in
    ``x``'s dtype; float32 math on each used expert's dequantized weights."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in topk_ids.unique().tolist():
        rows, slots = (topk_ids == e).nonzero(as_tuple=True)
        h = x[rows].float() @ expert_weight(w13, e).T  # [n, 2I]
        y = silu_and_mul_ref(h, clamp) @ expert_weight(w2, e).T  # [n, H]
        out.index_add_(0, rows, y * topk_weights[rows, slots].float()[:, None])
    return out.to(x.dtype)


def expert_weight(w: MoEWeight, expert: int) -> torch.Tensor:
    """Expert ``expert``'s weight ``[N, K]`` in float32."""
    if isinstance(w, torch.Tensor):
        return w[expert].float()
    return dequantize(w.expert(expert))


def max_aligned_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    return -(-num_pairs // block_m) + min(num_experts, num_pairs)


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int,
                  block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group pairs by expert (module docstring); sort-based, for any batch size, no host sync."""
    device = topk_ids.device
    flat = topk_ids.flatten().long()  # [P]
    num_pairs = flat.numel()
    max_blocks = max_aligned_blocks(num_pairs, num_experts, block_m)
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    starts = ends - padded
    order = torch.sort(flat, stable=True).indices  # pairs in expert order
    sorted_experts = flat[order]
    first_of_expert = (counts.cumsum(0) - counts)[sorted_experts]
    rank = torch.arange(num_pairs, device=device) - first_of_expert
    sorted_ids = torch.full((max_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[starts[sorted_experts] + rank] = order.to(torch.int32)
    block_start = torch.arange(max_blocks, device=device) * block_m
    expert_ids = torch.searchsorted(ends, block_start, right=True)
    num_padded = ends[-1:]
    expert_ids = torch.where(block_start < num_padded, expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids, num_padded.to(torch.int32)
