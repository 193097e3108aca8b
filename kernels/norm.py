"""RMSNorm with optional fused residual add (pure-torch reference)."""
from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns ``(norm(x + residual) * weight, x + residual)``; without a residual the second is None.

    Computed in float32 and cast back to ``x``'s dtype, as HF transformers does. The product is in
    the promoted dtype of ``weight`` and ``x``, or rounded once to ``out_dtype`` when given (a
    float32 weight on bf16 rows: ``out_dtype=x.dtype`` writes what ``.to(x.dtype)`` of the float32
    product would, without the copy).
    """
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(dtype)
    return (out if out_dtype is None else out.to(out_dtype)), residual
