"""DeepSeek-V4 building blocks shared by its attention, MoE and model: RMSNorm with float32
weights, the unweighted RMSNorm, the two RoPE flavours applied to each head's trailing (interleaved)
rope slice, and the manifold-constrained hyper-connections (mHC) that mix ``hc_mult`` residual
streams in and out of every block: here ``hc_head``, the final collapse; the per-block collapse and
spread are the ops ``Ops.v4_hc_pre`` / ``Ops.v4_hc_post`` (references in ``kernels.deepseek_v4_ref``).

The norm and the rotation run the resolved kernels (``Ops.rms_norm``, ``Ops.rotary``). Both compute
in float32; in a float32 model they equal transformers' bit for bit. In a bf16 model the norm
kernels round the normalized row to bf16 before the float32 weight multiply (transformers rounds
once, after it): at most one bf16 ulp apart."""
from __future__ import annotations

import torch
from torch import nn

from collections.abc import Callable

from cluster.models.deepseek_v4_config import DeepseekV4Args
from cluster.models.ops import REFERENCE_OPS, Ops
from kernels.deepseek_v4_ref import unweighted_rms_norm
from kernels.rotary import apply_rotary_ref, rope_cos_sin


class V4RMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in float32 with a float32 weight, in ``x``'s dtype."""

    def __init__(self, dim: int, eps: float, ops: Ops = REFERENCE_OPS) -> None:
        super().__init__()
        self.eps = eps
        self.kernel = ops.rms_norm
        self.weight = nn.Parameter(torch.empty(dim, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.eps)[0].to(x.dtype)


class V4Rope(nn.Module):
    """cos/sin tables of the ``main`` RoPE (sliding-only layers) and the ``compress`` RoPE
    (compressed layers, their compressors and indexer; YaRN applies to it only)."""

    main_inv_freq: torch.Tensor
    compress_inv_freq: torch.Tensor

    def __init__(self, args: DeepseekV4Args) -> None:
        super().__init__()
        self.register_buffer("main_inv_freq", args.main_rope.inv_freq(args.rope_dim), persistent=False)
        self.register_buffer("compress_inv_freq", args.compress_rope.inv_freq(args.rope_dim), persistent=False)
        self.scaling = {"main": args.main_rope.attention_factor, "compress": args.compress_rope.attention_factor}

    def cos_sin(self, kind: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [N]`` -> ``cos, sin [N, rope_dim // 2]`` float32."""
        inv_freq = self.main_inv_freq if kind == "main" else self.compress_inv_freq
        return rope_cos_sin(inv_freq, positions, self.scaling[kind])


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              rotary: Callable[..., torch.Tensor] = apply_rotary_ref) -> torch.Tensor:
    """Rotate the trailing ``2 * cos.shape[-1]`` features of ``x [N, H, D]`` (interleaved pairs)
    with the ``rotary`` kernel; heads are laid out ``[nope | rope]``."""
    rot = 2 * cos.shape[-1]
    return torch.cat([x[..., :-rot], rotary(x[..., -rot:], cos, sin, True)], dim=-1)


def hc_head(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float,
            norm_eps: float) -> torch.Tensor:
    """Final collapse of the streams ``[T, N, H] -> [T, H]``."""
    flat = unweighted_rms_norm(x.flatten(1).float(), norm_eps)
    mixes = nn.functional.linear(flat, fn.float())
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + eps
    return (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)
