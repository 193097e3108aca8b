"""RMSNorm with optional fused residual add (pure-torch reference)."""
from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns ``(norm(x + residual) * weight, x + residual)``; without a residual the second is None.

    Computed in float32 and cast back to ``x``'s dtype, as HF transformers does.
    """
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype), residual
