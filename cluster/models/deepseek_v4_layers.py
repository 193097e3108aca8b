"""DeepSeek-V4 building blocks shared by its attention, MoE and model: RMSNorm with float32
weights, the unweighted RMSNorm, the two RoPE flavours' tables (applied to each head's trailing,
interleaved rope slice by ``Ops.v4_norm_rope``, after the norm), and the manifold-constrained
hyper-connections (mHC) that mix ``hc_mult`` residual streams in and out of every block: here
``hc_head``, the final collapse; the per-block collapse and spread are the ops ``Ops.v4_hc_pre`` /
``Ops.v4_hc_post`` (references in ``kernels.deepseek_v4_ref``).

The norms and the rotation run the resolved kernels (``Ops.rms_norm``, ``Ops.v4_norm_rope``). They
compute in float32; in a float32 model they equal transformers' bit for bit. In a bf16 model the norm
kernels round the normalized row to bf16 before the float32 weight multiply (transformers rounds
once, after it): at most one bf16 ulp apart."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from cluster.models.deepseek_v4_config import DeepseekV4Args
from cluster.models.ops import REFERENCE_OPS, Ops
from kernels.deepseek_v4_ref import unweighted_rms_norm
from kernels.rotary import rope_cos_sin


class V4RMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in float32 with a float32 weight, in ``x``'s dtype."""

    def __init__(self, dim: int, eps: float, ops: Ops = REFERENCE_OPS) -> None:
        super().__init__()
        self.eps = eps
        self.kernel = ops.rms_norm
        self.weight = nn.Parameter(torch.empty(dim, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the float32 product rounded to x's dtype by the norm itself (no copy kernel after it)
        return self.kernel(x, self.weight, self.eps, out_dtype=x.dtype)[0]


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
        self._shared: dict[str, tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] | None = None

    def cos_sin(self, kind: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [N]`` -> ``cos, sin [N, rope_dim // 2]`` float32. Inside :meth:`shared`, the
        tables of a ``positions`` tensor already seen there are returned again."""
        if self._shared is not None:
            seen = self._shared.get(kind)
            if seen is not None and seen[0] is positions:
                return seen[1]
        inv_freq = self.main_inv_freq if kind == "main" else self.compress_inv_freq
        tables = rope_cos_sin(inv_freq, positions, self.scaling[kind])
        if self._shared is not None:
            self._shared[kind] = (positions, tables)
        return tables

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        """One forward pass: its layers compute the tables of the step's positions once (about six
        kernels a layer fewer). Only within the pass, never across passes: a graph's buffers keep
        their identity while their values change."""
        outer = self._shared
        self._shared = {} if outer is None else outer
        try:
            yield
        finally:
            self._shared = outer


def hc_head(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float,
            norm_eps: float) -> torch.Tensor:
    """Final collapse of the streams ``[T, N, H] -> [T, H]``."""
    flat = unweighted_rms_norm(x.flatten(1).float(), norm_eps)
    mixes = nn.functional.linear(flat, fn.float())
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + eps
    return (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)
