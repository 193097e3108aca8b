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


class FusedRows:
    """Weights that multiply the same input, run as one GEMM: at batch 1 a step of small
    projections is bound by each GEMM's launch and split-K reduction, not its bytes.

    Each member, a module's 2-D weight ``[out_i, in]`` (``(module, "weight")``), becomes a row
    slice of one ``[sum(out_i), in]`` tensor. Loading copies into the members' weights, so it lands
    in the fused tensor. ``__call__(x)`` returns each member's product as a column slice of the one
    product, with row stride ``sum(out_i)`` (the same values as the member's own product; the
    consumers take row strides). Biased or quantized ``Linear`` members, or weights of different
    dtypes, devices or input widths, keep their own products. If a member's weight stops aliasing
    the fused tensor (a parameter replaced, the module moved to another device), the next call
    fuses again."""

    def __init__(self, members: list[tuple[nn.Module, str]]) -> None:
        self.members = members
        self.sizes = [self._weight(i).shape[0] for i in range(len(members))]
        self.fused: torch.Tensor | None = None
        self._ptrs: tuple[int, ...] = ()
        self._fuse()

    def _weight(self, i: int) -> torch.Tensor:
        module, name = self.members[i]
        return getattr(module, name)

    def _fusable(self) -> bool:
        if len(self.members) < 2:
            return False
        for module, _ in self.members:
            if isinstance(module, Linear) and (module.quantized is not None or module.bias is not None):
                return False
        weights = [self._weight(i) for i in range(len(self.members))]
        first = weights[0]
        return all(w.dim() == 2 and w.dtype == first.dtype and w.device == first.device
                   and w.shape[1] == first.shape[1] for w in weights)

    def _fuse(self) -> None:
        self.fused, self._ptrs = None, ()
        if not self._fusable():
            return
        fused = torch.cat([self._weight(i).detach() for i in range(len(self.members))])
        offset = 0
        for (module, name), rows in zip(self.members, self.sizes):
            setattr(module, name, nn.Parameter(fused[offset:offset + rows], requires_grad=False))
            offset += rows
        self.fused = fused
        self._ptrs = self._pointers()

    def _pointers(self) -> tuple[int, ...]:
        return tuple(self._weight(i).data_ptr() for i in range(len(self.members)))

    @property
    def active(self) -> bool:
        """Whether the members run as one GEMM (re-fusing first if they no longer alias it)."""
        if self.fused is None or self._pointers() != self._ptrs:
            self._fuse()
        return self.fused is not None

    def __call__(self, x: torch.Tensor, groups: list[int] | None = None) -> list[torch.Tensor]:
        return self.forward(x, groups)

    def forward(self, x: torch.Tensor, groups: list[int] | None = None) -> list[torch.Tensor]:
        """Each member's product of ``x``; ``groups`` (counts of consecutive members, summing to
        their number): one product per group, its members' side by side (``[w1; w3]`` -> the
        ``[gate | up]`` that ``silu_and_mul`` takes)."""
        groups = groups or [1] * len(self.members)
        assert sum(groups) == len(self.members), (groups, len(self.members))
        bounds = [sum(groups[:g]) for g in range(len(groups) + 1)]
        if self.active:
            assert self.fused is not None
            widths = [sum(self.sizes[bounds[g]:bounds[g + 1]]) for g in range(len(groups))]
            return list(torch.split(nn.functional.linear(x, self.fused), widths, dim=-1))
        each = [module(x) if isinstance(module, Linear) else nn.functional.linear(x, self._weight(i))
                for i, (module, _) in enumerate(self.members)]
        return [each[a] if b - a == 1 else torch.cat(each[a:b], dim=-1) for a, b in zip(bounds, bounds[1:])]


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
