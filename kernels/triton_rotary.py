"""Rotary position embedding in Triton: ``neox`` (rotate halves) and ``interleaved`` (rotate
even/odd pairs) layouts, partial rotary dims (features past ``2 * cos.shape[-1]`` pass through).
Float32 math, result in the input dtype, as :func:`kernels.rotary.apply_rotary_ref`."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_support import check_last_dim_contiguous


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, stride_xt, stride_xh, stride_ot, stride_oh,
                   stride_ct, stride_st, num_heads, head_dim,
                   HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                   INTERLEAVED: tl.constexpr, HAS_REST: tl.constexpr, BLOCK_REST: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    offs = tl.arange(0, BLOCK_HALF)
    f_mask = offs < HALF
    c = tl.load(cos_ptr + token * stride_ct + offs, mask=f_mask, other=0.0)[None, :]
    s = tl.load(sin_ptr + token * stride_st + offs, mask=f_mask, other=0.0)[None, :]
    if INTERLEAVED:
        i1 = 2 * offs
        i2 = 2 * offs + 1
    else:
        i1 = offs
        i2 = offs + HALF
    mask = h_mask[:, None] & f_mask[None, :]
    x_row = x_ptr + token * stride_xt + heads[:, None] * stride_xh
    o_row = out_ptr + token * stride_ot + heads[:, None] * stride_oh
    x1 = tl.load(x_row + i1[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + i2[None, :], mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(o_row + i1[None, :], (x1 * c - x2 * s).to(dtype), mask=mask)
    tl.store(o_row + i2[None, :], (x2 * c + x1 * s).to(dtype), mask=mask)
    if HAS_REST:
        rest = 2 * HALF + tl.arange(0, BLOCK_REST)
        r_mask = h_mask[:, None] & (rest < head_dim)[None, :]
        tl.store(o_row + rest[None, :], tl.load(x_row + rest[None, :], mask=r_mask), mask=r_mask)


def apply_rotary_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        interleaved: bool = False) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` features of ``x [T, H, D]`` (may be a strided view,
    e.g. a slice of a fused QKV projection) by ``cos/sin [T, rotary_dim // 2]`` float32; returns a
    new contiguous ``[T, H, D]`` tensor. Same semantics as :func:`kernels.rotary.apply_rotary_ref`."""
    check_last_dim_contiguous("x", x)
    num_tokens, num_heads, head_dim = x.shape
    half = cos.shape[-1]
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block_half = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(num_heads), 2048 // block_half))
    rest = head_dim - 2 * half
    _rotary_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        x, cos, sin, out, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        cos.stride(0), sin.stride(0), num_heads, head_dim,
        HALF=half, BLOCK_HALF=block_half, BLOCK_H=block_h, INTERLEAVED=interleaved,
        HAS_REST=rest > 0, BLOCK_REST=triton.next_power_of_2(max(rest, 1)), num_warps=4,
    )
    return out
