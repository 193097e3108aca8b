"""Gated activations (pure-torch reference)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor, clamp: float | None = None) -> torch.Tensor:
    """``x [..., 2 * I]`` holding ``[gate | up]`` -> ``silu(gate) * up`` of shape ``[..., I]``.

    With ``clamp``, the gate is clamped from above and the up projection to ``[-clamp, clamp]``
    before the product (DeepSeek-V4's SwiGLU limit).
    """
    gate, up = x.chunk(2, dim=-1)
    if clamp is not None:
        gate = gate.clamp(max=clamp)
        up = up.clamp(min=-clamp, max=clamp)
    return F.silu(gate) * up
