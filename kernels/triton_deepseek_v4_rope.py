"""DeepSeek-V4 norm + RoPE (+ KV write) in Triton: one kernel for what every attention layer did
in four to eight torch kernels per tensor (an RMS norm in float32 and its casts, the rotation of
the trailing RoPE channels, the concatenation with the untouched channels, and for the window's KV
entry the cache write with its slot arithmetic). Same semantics as
:func:`kernels.deepseek_v4_ref.norm_rope_ref`, including where it rounds to the model's dtype.

One program per (token, block of ``BLOCK_H`` heads) holds whole rows (``D`` channels): the norm's
sum of squares, the scaled row, then the row viewed as ``D / 2`` (even, odd) pairs of which the
last ``rot / 2`` are rotated by the token's cos/sin. At V4-Flash width a row is 512 channels (128
for the indexer); a program's tile is at most 4,096 elements, in registers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_support import check_last_dim_contiguous

#: Elements of one program's tile (heads x channels).
_TILE = 4096


@triton.jit
def _norm_rope_kernel(x_ptr, cos_ptr, sin_ptr, w_ptr, out_ptr, cache_ptr, slots_ptr,
                      stride_xt, stride_xh, stride_ot, stride_oh, stride_ct, stride_st,
                      stride_cb, stride_cs, block_size, num_heads, eps,
                      D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                      NORM: tl.constexpr, WEIGHTED: tl.constexpr, INVERSE: tl.constexpr,
                      WRITE_CACHE: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    cols = tl.arange(0, BLOCK_D)
    c_mask = cols < D
    mask = h_mask[:, None] & c_mask[None, :]
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + token * stride_xt + heads[:, None] * stride_xh + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    if NORM:
        r = tl.rsqrt(tl.sum(x * x, 1) / D + eps)  # [BLOCK_H]
        if WEIGHTED:  # V4RMSNorm: the scaled row in the model's dtype, times the float32 weight
            w = tl.load(w_ptr + cols, mask=c_mask, other=0.0)
            x = (x * r[:, None]).to(dtype).to(tl.float32) * w[None, :]
        else:  # unweighted_rms_norm: the scale in the model's dtype, times the row
            x = x * r.to(dtype).to(tl.float32)[:, None]
    x = x.to(dtype).to(tl.float32)
    even, odd = tl.split(tl.reshape(x, [BLOCK_H, BLOCK_D // 2, 2]))
    pairs = tl.arange(0, BLOCK_D // 2)
    first = D // 2 - HALF  # the first rotated pair
    rotated = (pairs >= first) & (pairs < D // 2)
    c = tl.load(cos_ptr + token * stride_ct + (pairs - first), mask=rotated, other=1.0)[None, :]
    s = tl.load(sin_ptr + token * stride_st + (pairs - first), mask=rotated, other=0.0)[None, :]
    if INVERSE:
        s = -s
    keep = rotated[None, :]
    new_even = tl.where(keep, even * c - odd * s, even)
    new_odd = tl.where(keep, odd * c + even * s, odd)
    y = tl.reshape(tl.join(new_even, new_odd), [BLOCK_H, BLOCK_D]).to(dtype)
    tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + cols[None, :], y, mask=mask)
    if WRITE_CACHE:
        slot = tl.maximum(tl.load(slots_ptr + token).to(tl.int64), 0)
        row = cache_ptr + (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
        tl.store(row + heads[:, None] * 0 + cols[None, :], y.to(cache_ptr.dtype.element_ty), mask=mask)


def norm_rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None = None,
                     eps: float | None = None, inverse: bool = False, cache: torch.Tensor | None = None,
                     slots: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as :func:`kernels.deepseek_v4_ref.norm_rope_ref`."""
    check_last_dim_contiguous("x", x)
    num_tokens, num_heads, head_dim = x.shape
    half = cos.shape[-1]
    if head_dim % 2 or 2 * half > head_dim:
        raise ValueError(f"rotating {2 * half} channels of rows of {head_dim}")
    if cache is not None:
        if slots is None or num_heads != 1:
            raise ValueError("a cache write needs slots and one head per row")
        check_last_dim_contiguous("cache", cache)
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block_d = triton.next_power_of_2(head_dim)
    block_h = max(1, min(triton.next_power_of_2(num_heads), _TILE // block_d))
    target = out if cache is None else cache
    _norm_rope_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        x, cos, sin, weight if weight is not None else cos, out, target, slots if slots is not None else cos,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0), sin.stride(0),
        target.stride(0) if cache is not None else 0, target.stride(1) if cache is not None else 0,
        cache.shape[1] if cache is not None else 1, num_heads, eps if eps is not None else 0.0,
        D=head_dim, HALF=half, BLOCK_D=block_d, BLOCK_H=block_h, NORM=eps is not None,
        WEIGHTED=weight is not None and eps is not None, INVERSE=inverse, WRITE_CACHE=cache is not None,
        num_warps=4 if block_h * block_d >= 2048 else 2,
    )
    return out
