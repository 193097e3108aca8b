"""Random weights for a model built from its config.json alone (``load_format="dummy"``, as other
serving engines offer it): serving and benchmarks at real widths without multi-gigabyte
checkpoints, in every process that loads the model.

Matrices are drawn from N(0, 1/fan_in) (activations keep their scale through the layers), norm
and hyper-connection scales are 1, other vectors (biases, attention sinks) 0. DeepSeek-V4: the
hash-routing tables draw distinct experts per token, and routed experts are drawn in the format
config.json declares for them (MXFP4, NVFP4, FP8 128x128 blocks, or plain), quantized a few
experts at a time on the model's device where the model keeps them native (CUDA); elsewhere they
are plain parameters like any matrix. Deterministic for a seed.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from cluster.models.deepseek_v4_experts import Experts
from cluster.models.deepseek_v4_quant import expert_kernel_format
from kernels.quant import QuantizedWeight, quantize

_SCALES = ("norm.weight", "hc_attn_scale", "hc_ffn_scale", "hc_head_scale")


@torch.no_grad()
def init_dummy_weights(model: nn.Module, config: dict[str, Any], seed: int = 0) -> None:
    """Fill every parameter (and DeepSeek-V4's routing tables and native experts) of ``model``."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith(_SCALES):
            p.fill_(1.0)
        elif p.dim() >= 2:
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=gen)
        else:
            p.zero_()
    experts = int(config.get("n_routed_experts") or 0)
    for name, b in model.named_buffers():
        if name.endswith("tid2eid") and experts:
            b.copy_(torch.rand(b.shape[0], experts, generator=gen, device=device).argsort(-1)[:, :b.shape[1]])
    for name, module in model.named_modules():
        if isinstance(module, Experts) and module.native:
            fmt = expert_kernel_format(config, "draft" if name.startswith("mtp.") else "main")
            module.w13 = random_experts(module.shapes["w13"], fmt, module.dtype, device, gen)
            module.w2 = random_experts(module.shapes["w2"], fmt, module.dtype, device, gen)


def random_experts(shape: tuple[int, int, int], fmt: str, dtype: torch.dtype, device: torch.device,
                   gen: torch.Generator, chunk: int = 16) -> QuantizedWeight | torch.Tensor:
    """``[E, N, K]`` experts ~ N(0, 1/K) in ``fmt`` (``"bf16"``: a plain tensor in ``dtype``),
    quantized ``chunk`` experts at a time."""
    e, n, k = shape
    if fmt == "bf16":
        return (torch.randn(e, n, k, generator=gen, device=device) / math.sqrt(k)).to(dtype)
    parts = [quantize(torch.randn(min(chunk, e - lo), n, k, generator=gen, device=device) / math.sqrt(k), fmt)
             for lo in range(0, e, chunk)]

    def cat(field: str) -> torch.Tensor | None:
        tensors = [getattr(p, field) for p in parts]
        return None if tensors[0] is None else torch.cat(tensors)
    data = cat("data")
    assert data is not None
    return QuantizedWeight(fmt, data, cat("scale"), cat("global_scale"))
