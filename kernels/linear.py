"""Linear layers (pure-torch reference): ``y = x @ W.T (+ b)``, and the gated form of a SwiGLU
MLP's fused ``[gate; up]`` projection, ``silu(x @ Wg.T) * (x @ Wu.T)``."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.activation import silu_and_mul_ref


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               gated: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; gated (``weight = [gate; up]``): then ``silu_and_mul``."""
    y = F.linear(x, weight, bias)
    return silu_and_mul_ref(y) if gated else y
