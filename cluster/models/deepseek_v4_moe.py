"""DeepSeek-V4 MoE (every layer): routed experts chosen by the learned gate (``sqrtsoftplus``,
``sigmoid`` or ``softmax`` scores, top-k over scores plus the correction bias) or, in the first
layers, by the token id through the frozen ``tid2eid`` table; the chosen experts' scores are
renormalised and scaled by ``routed_scaling_factor`` (after the gate's projection, all one op:
``Ops.v4_route``). Experts and the shared expert are SwiGLU with the configured clamp. Routed
expert weights are stacked: ``w13 [E, 2I, H]`` (gate rows, then up rows) and ``w2 [E, H, I]``,
dequantized or in their checkpoint format (``deepseek_v4_experts``); the resolved MoE kernel takes
either."""
from __future__ import annotations

import torch
from torch import nn

from cluster.models.deepseek_v4_config import DeepseekV4Args
from cluster.models.deepseek_v4_experts import Experts
from cluster.models.layers import FusedRows, Linear
from cluster.models.ops import REFERENCE_OPS, Ops


class Gate(nn.Module):
    tid2eid: torch.Tensor

    def __init__(self, args: DeepseekV4Args, hash_routed: bool, dtype: torch.dtype, ops: Ops = REFERENCE_OPS) -> None:
        super().__init__()
        self.route = ops.v4_route
        self.top_k, self.scoring = args.num_experts_per_tok, args.scoring_func
        self.routed_scaling_factor = args.routed_scaling_factor
        self.hash_routed = hash_routed
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.hidden_size, dtype=dtype),
                                   requires_grad=False)
        if hash_routed:
            self.register_buffer("tid2eid", torch.zeros(args.vocab_size, self.top_k, dtype=torch.int64))
        else:
            self.bias = nn.Parameter(torch.empty(args.n_routed_experts, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, logits: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weights ``[T, k]``, expert ids ``[T, k]``). ``logits``: the gate's projection of
        ``x`` ``[T, n_routed_experts]`` when already computed (fused with the shared expert's)."""
        if logits is None:
            logits = nn.functional.linear(x, self.weight)
        if self.hash_routed:
            return self.route(logits, self.top_k, self.scoring, self.routed_scaling_factor, tid2eid=self.tid2eid,
                              input_ids=input_ids)
        return self.route(logits, self.top_k, self.scoring, self.routed_scaling_factor, bias=self.bias)


class SharedExperts(nn.Module):
    def __init__(self, hidden: int, intermediate: int, clamp: float | None, dtype: torch.dtype,
                 ops: Ops = REFERENCE_OPS) -> None:
        super().__init__()
        self.clamp = clamp
        self.ops = ops
        self.w1 = Linear(hidden, intermediate, False, dtype)
        self.w2 = Linear(intermediate, hidden, False, dtype)
        self.w3 = Linear(hidden, intermediate, False, dtype)

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``[w1(x) | w3(x)]`` -> the expert's output."""
        return self.w2(self.ops.silu_and_mul(gate_up, self.clamp))


class DeepseekV4MoE(nn.Module):
    """Routed + shared experts. ``draft``: the MTP layer's MoE, whose kernel is resolved for the
    draft role (its weights may be in another format than the main model's). ``native_experts``:
    see :class:`Experts`."""

    def __init__(self, args: DeepseekV4Args, hash_routed: bool, dtype: torch.dtype,
                 ops: Ops = REFERENCE_OPS, draft: bool = False, native_experts: bool | None = None) -> None:
        super().__init__()
        self.clamp = args.swiglu_limit
        self.moe_kernel = ops.draft_moe if draft else ops.moe
        self.gate = Gate(args, hash_routed, dtype, ops)
        self.experts = Experts(args, dtype, native_experts)
        shared = args.moe_intermediate_size * args.n_shared_experts
        self.shared_experts = SharedExperts(args.hidden_size, shared, self.clamp, dtype, ops) if shared else None
        # The gate's projection and the shared expert's [w1; w3] read the same input: one GEMM.
        members: list[tuple[nn.Module, str]] = [(self.gate, "weight")]
        if self.shared_experts is not None:
            members += [(self.shared_experts.w1, "weight"), (self.shared_experts.w3, "weight")]
        self.x_proj = FusedRows(members)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        if self.shared_experts is None:
            weights, ids = self.gate(x, input_ids)
            return self.moe_kernel(x, self.experts.w13, self.experts.w2, weights, ids, self.clamp)
        logits, gate_up = self.x_proj(x, groups=[1, 2])
        weights, ids = self.gate(x, input_ids, logits)
        out = self.moe_kernel(x, self.experts.w13, self.experts.w2, weights, ids, self.clamp)
        return out + self.shared_experts.down(gate_up)
