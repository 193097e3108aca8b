"""SwiGLU ``silu(gate) * up`` with optional clamp, in Triton (float32 math, rounding the SiLU to
the input dtype before the product as :func:`kernels.activation.silu_and_mul_ref` does)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, clamp,
                         HAS_CLAMP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    if HAS_CLAMP:
        g = tl.minimum(g, clamp)
        up = tl.minimum(tl.maximum(up, -clamp), clamp)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor, clamp: float | None = None) -> torch.Tensor:
    """``x [..., 2 * I]`` holding ``[gate | up]`` -> ``[..., I]``. Same semantics as
    :func:`kernels.activation.silu_and_mul_ref`."""
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    if x2.shape[0] and inter:
        block = min(triton.next_power_of_2(inter), 2048)
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2, out, x2.stride(0), out.stride(0), inter, clamp if clamp is not None else 0.0,
            HAS_CLAMP=clamp is not None, BLOCK=block, num_warps=4,
        )
    return out.view(*x.shape[:-1], inter)
