"""DeepSeek-V4 MoE router in Triton: one kernel for what the gate did in about ten torch kernels
per layer after its projection (the score function and its casts, the biased top-k, the gather,
the sum, the division and the scaling). Same semantics as :func:`kernels.deepseek_v4_ref.route_ref`,
rounding each step to the logits' dtype where the torch ops do.

One program per token holds the token's ``E`` scores in registers (256 at V4-Flash width); the
top-k is ``k`` rounds of an arg-max (equal values: the lowest expert first) that retire their
winner, so no sort and no second pass over memory.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.deepseek_v4_ref import SCORING_FUNCS

_SCORING_CODES = {name: code for code, name in enumerate(SCORING_FUNCS)}


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, tid2eid_ptr, input_ids_ptr, weights_ptr, ids_ptr,
                  num_experts, stride_lt, stride_tid, scaling,
                  TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                  SCORING: tl.constexpr, HASH: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    dtype = weights_ptr.dtype.element_ty
    experts = tl.arange(0, BLOCK_E)
    e_mask = experts < num_experts
    x = tl.load(logits_ptr + token * stride_lt + experts, mask=e_mask, other=0.0).to(tl.float32)
    if SCORING == 0:  # sqrt(softplus(x)), torch's threshold 20, each op rounded
        e = tl.exp(tl.minimum(x, 20.0))
        u = 1.0 + e
        log1p = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))  # float32-accurate
        soft = tl.where(x > 20.0, x, log1p)
        scores = tl.sqrt(soft.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    elif SCORING == 1:
        scores = (1.0 / (1.0 + tl.exp(-x))).to(dtype).to(tl.float32)
    else:
        z = tl.where(e_mask, x, float("-inf"))
        z = tl.exp(z - tl.max(z, 0))
        scores = (z / tl.sum(z, 0)).to(dtype).to(tl.float32)
    slots = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], tl.int64)
    picked = tl.zeros([BLOCK_K], tl.float32)
    if HASH:
        token_id = tl.load(input_ids_ptr + token).to(tl.int64)
        ids = tl.load(tid2eid_ptr + token_id * stride_tid + slots, mask=slots < TOP_K, other=0).to(tl.int64)
        for j in tl.static_range(TOP_K):
            chosen = tl.sum(tl.where(slots == j, ids, 0), 0)
            value = tl.sum(tl.where(experts == chosen, scores, 0.0), 0)
            picked = tl.where(slots == j, value, picked)
    else:
        rank = scores + tl.load(bias_ptr + experts, mask=e_mask, other=0.0)
        rank = tl.where(e_mask, rank, float("-inf"))
        for j in tl.static_range(TOP_K):
            best = tl.max(rank, 0)
            chosen = tl.min(tl.where(rank == best, experts, BLOCK_E), 0)
            value = tl.sum(tl.where(experts == chosen, scores, 0.0), 0)
            ids = tl.where(slots == j, chosen.to(tl.int64), ids)
            picked = tl.where(slots == j, value, picked)
            rank = tl.where(experts == chosen, float("-inf"), rank)
    total = (tl.sum(tl.where(slots < TOP_K, picked, 0.0), 0)).to(dtype).to(tl.float32)
    total = (total + 1e-20).to(dtype).to(tl.float32)
    weights = (picked / total).to(dtype).to(tl.float32) * scaling
    k_mask = slots < TOP_K
    tl.store(weights_ptr + token * TOP_K + slots, weights.to(dtype), mask=k_mask)
    tl.store(ids_ptr + token * TOP_K + slots, ids, mask=k_mask)


def route_triton(logits: torch.Tensor, top_k: int, scoring: str, scaling: float, bias: torch.Tensor | None = None,
                 tid2eid: torch.Tensor | None = None, input_ids: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`kernels.deepseek_v4_ref.route_ref` (ids in descending order of
    ``scores + bias``)."""
    if scoring not in _SCORING_CODES:
        raise ValueError(f"unknown scoring function {scoring!r} ({', '.join(SCORING_FUNCS)})")
    if tid2eid is not None and input_ids is None:
        raise ValueError("hash routing needs the input ids")
    if tid2eid is None and bias is None:
        raise ValueError("a learned router needs its correction bias")
    num_tokens, num_experts = logits.shape
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    weights = torch.empty((num_tokens, top_k), dtype=logits.dtype, device=logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    if tid2eid is not None and tid2eid.stride(-1) != 1:
        tid2eid = tid2eid.contiguous()
    block_e = triton.next_power_of_2(num_experts)
    _route_kernel[(num_tokens,)](
        logits, bias if bias is not None else logits, tid2eid if tid2eid is not None else logits,
        input_ids if input_ids is not None else logits, weights, ids, num_experts, logits.stride(0),
        tid2eid.stride(0) if tid2eid is not None else 0, scaling,
        TOP_K=top_k, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k), SCORING=_SCORING_CODES[scoring],
        HASH=tid2eid is not None, num_warps=1 if block_e <= 256 else 4,
    )
    return weights, ids
