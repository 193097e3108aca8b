"""Attention input preparation in one Triton kernel (semantics of
:func:`kernels.qkv_prepare.qkv_prepare_ref`): each program takes one token's q or k head from
the fused QKV projection, applies the optional per-head RMSNorm and the rotary embedding, and
stores it (q into the output, k into its paged KV slot, with the matching v head). It replaces
two norms, two rotaries and the KV write per layer: five launches become one."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_support import check_last_dim_contiguous


@triton.jit
def _qkv_prepare_kernel(qkv_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, q_out_ptr, k_cache_ptr,
                        v_cache_ptr, slot_ptr, stride_t, stride_ct, stride_st, stride_qt, stride_qh,
                        stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch, eps,
                        NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK_D: tl.constexpr, HALF: tl.constexpr, PAGE_SIZE: tl.constexpr,
                        HAS_NORM: tl.constexpr, INTERLEAVED: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # 0..Hq-1: q heads; Hq..Hq+Hkv-1: k heads (with their v)
    offs = tl.arange(0, BLOCK_D)
    d_mask = offs < HEAD_DIM
    row = qkv_ptr + token * stride_t
    x = tl.load(row + head * HEAD_DIM + offs, mask=d_mask, other=0.0)
    dtype = x.dtype
    if HAS_NORM:
        xf = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / HEAD_DIM + eps)
        is_q = head < NUM_Q_HEADS
        w_q = tl.load(q_norm_ptr + offs, mask=d_mask & is_q, other=0.0)
        w_k = tl.load(k_norm_ptr + offs, mask=d_mask & (head >= NUM_Q_HEADS), other=0.0)
        w = tl.where(is_q, w_q, w_k)
        # As the reference: normalise in float32, round to the input dtype, then scale in it.
        x = (w.to(tl.float32) * (xf * inv).to(dtype).to(tl.float32)).to(dtype)
    xf = x.to(tl.float32)
    # Rotary over the first 2 * HALF features: pair feature i with its partner.
    if INTERLEAVED:
        partner = offs ^ 1
        freq = offs // 2
        sign = tl.where((offs % 2) == 0, -1.0, 1.0)
    else:
        partner = tl.where(offs < HALF, offs + HALF, offs - HALF)
        freq = tl.where(offs < HALF, offs, offs - HALF)
        sign = tl.where(offs < HALF, -1.0, 1.0)
    rot = offs < 2 * HALF
    c = tl.load(cos_ptr + token * stride_ct + freq, mask=rot, other=1.0)
    s = tl.load(sin_ptr + token * stride_st + freq, mask=rot, other=0.0)
    # the partner's value after the same normalisation (re-read and re-normalise it)
    p = tl.load(row + head * HEAD_DIM + partner, mask=rot & d_mask, other=0.0)
    if HAS_NORM:
        pf = p.to(tl.float32)
        wp_q = tl.load(q_norm_ptr + partner, mask=rot & d_mask & is_q, other=0.0)
        wp_k = tl.load(k_norm_ptr + partner, mask=rot & d_mask & (head >= NUM_Q_HEADS), other=0.0)
        wp = tl.where(is_q, wp_q, wp_k)
        p = (wp.to(tl.float32) * (pf * inv).to(dtype).to(tl.float32)).to(dtype)
    y = tl.where(rot, xf * c + sign * p.to(tl.float32) * s, xf).to(dtype)
    if head < NUM_Q_HEADS:
        tl.store(q_out_ptr + token * stride_qt + head * stride_qh + offs, y, mask=d_mask)
    else:
        kv_head = head - NUM_Q_HEADS
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:
            page = slot // PAGE_SIZE
            in_page = slot % PAGE_SIZE
            k_dst = k_cache_ptr + page * stride_kcb + in_page * stride_kct + kv_head * stride_kch
            tl.store(k_dst + offs, y.to(k_cache_ptr.dtype.element_ty), mask=d_mask)
            v = tl.load(row + (NUM_Q_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM + offs, mask=d_mask)
            v_dst = v_cache_ptr + page * stride_vcb + in_page * stride_vct + kv_head * stride_vch
            tl.store(v_dst + offs, v.to(v_cache_ptr.dtype.element_ty), mask=d_mask)


def qkv_prepare_triton(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int,
                       cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, q_norm: torch.Tensor | None = None,
                       k_norm: torch.Tensor | None = None, eps: float = 1e-6,
                       interleaved: bool = False) -> torch.Tensor:
    """Same semantics as :func:`kernels.qkv_prepare.qkv_prepare_ref`; no host synchronisation."""
    for name, t in (("qkv", qkv), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(name, t)
    num_tokens = qkv.shape[0]
    q = torch.empty((num_tokens, num_q_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    has_norm = q_norm is not None and k_norm is not None
    dummy = qkv  # never read when HAS_NORM is off
    _qkv_prepare_kernel[(num_tokens, num_q_heads + num_kv_heads)](
        qkv, cos, sin, q_norm if has_norm else dummy, k_norm if has_norm else dummy, q, k_cache, v_cache,
        slot_mapping, qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), eps,
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), HALF=cos.shape[-1], PAGE_SIZE=k_cache.shape[1],
        HAS_NORM=has_norm, INTERLEAVED=interleaved, num_warps=1,
    )
    return q
