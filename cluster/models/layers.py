"""Building blocks shared by model families. Parameters are created uninitialised (weights always
come from a checkpoint), and every op calls into ``kernels``."""
from __future__ import annotations

import torch
from torch import nn

from cluster.models.ops import REFERENCE_OPS, Ops
from kernels.cpu_quant import Q4Weight, linear_q4


class Linear(nn.Module):
    """``y = x @ W.T (+ b)``; ``W [out_features, in_features]``, through ``ops.linear``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype | None = None, ops: Ops = REFERENCE_OPS) -> None:
        super().__init__()
        self.ops = ops
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        #: CPU only: the weight as 4-bit codes (cluster.models.cpu_quant); ``weight`` is then empty.
        self.quantized: Q4Weight | None = None

    def quantize(self, weight: Q4Weight) -> None:
        """Run on ``weight`` (the CPU int4 kernel) from now on, and free the float weight."""
        self.quantized = weight
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, gated: bool = False, dense: bool | None = None) -> torch.Tensor:
        """``gated``: the weight is ``[gate; up]`` and the result ``silu(gate) * up``. ``dense``
        (quantized CPU weights): see ``linear_q4``."""
        if self.quantized is not None:
            return linear_q4(x, self.quantized, self.bias, gated=gated, dense=dense)
        return self.ops.linear(x, self.weight, self.bias, gated=gated)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None, ops: Ops = REFERENCE_OPS) -> None:
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight)


class GatedMLP(nn.Module):
    """SwiGLU MLP with fused ``gate_up_proj [2 * I, H]``; the projection and the activation are
    one gated ``ops.linear`` call (one kernel for decode batches on the GPU)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False,
                 dtype: torch.dtype | None = None, ops: Ops = REFERENCE_OPS) -> None:
        super().__init__()
        self.ops = ops
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias, dtype, ops)
        self.down_proj = Linear(intermediate, hidden, bias, dtype, ops)

    def forward(self, x: torch.Tensor, dense: bool | None = None) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x, gated=True, dense=dense), dense=dense)
