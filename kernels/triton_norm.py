"""RMSNorm with fused residual add, in Triton: one program per row, float32 math.

Rounds where the reference (:func:`kernels.norm.rms_norm_ref`) rounds: the residual sum to the
input dtype, the normalized row to the input dtype before the weight multiply."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o,
                     stride_ro, hidden, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    h = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(h * h, 0) / hidden + eps)
    normed = (h * inv).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # a narrower output: the float32 product rounded once, to nearest even (as torch casts)
    tl.store(out_ptr + row * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x [..., H]``, ``weight [H]``, optional ``residual`` like ``x``. Returns
    ``(norm(x + residual) * weight, x + residual)``; without a residual the second is None.
    Same semantics as :func:`kernels.norm.rms_norm_ref`."""
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out_dtype = out_dtype or torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)  # the float32 product rounded once
    res2 = res_out = None
    if residual is not None:
        res2 = residual.reshape(-1, hidden)
        if res2.stride(-1) != 1:
            res2 = res2.contiguous()
        res_out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows,)](
            x2, res2 if res2 is not None else x2, weight, out, res_out if res_out is not None else out,
            x2.stride(0), res2.stride(0) if res2 is not None else 0, out.stride(0),
            res_out.stride(0) if res_out is not None else 0, hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=min(max(block // 256, 1), 16),
        )
    return out.view(x.shape), (res_out.view(x.shape) if res_out is not None else None)
