"""Skinny linear layers for decode in Triton: ``y = a(x) @ W.T (+ b)`` for a few rows of ``x``
(a decode batch), where the step is bound by reading ``W`` once.

Grid ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M))``: a program streams ``BLOCK_N`` rows of ``W`` along
``K`` and multiplies them with every row of its ``BLOCK_M`` rows of ``x``. One row (``BLOCK_M =
1``) is a GEMV in registers (products summed along ``K``, no shared memory); more rows use
``tl.dot``. Every program reads whole rows of ``W`` (no split-K), so there is no reduction pass;
``BLOCK_N`` is small enough that every SM holds several programs. ``K`` is a compile-time constant
(a layer's width), so full tiles need no ``K`` mask.

``a`` is the identity, or with ``swiglu`` the gated activation of
:func:`kernels.activation.silu_and_mul_ref` computed on the fly from ``x = [gate | up]`` (the
activation never goes to memory: one launch instead of two), rounded to ``x``'s dtype before the
product as the unfused pair rounds it. Accumulation is in float32.

Above :data:`MAX_ROWS` rows the matrix product is compute-shaped and :func:`linear_triton` hands it
to ``torch.nn.functional.linear`` (cuBLAS).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.activation import silu_and_mul_ref
from kernels.triton_support import INTERPRET, autotune_configs

#: Rows of ``x`` up to which the Triton kernel runs (decode batches); larger ones go to cuBLAS.
MAX_ROWS = 32


def _configs() -> list[triton.Config]:
    out = []
    for bn, bk, warps, stages in [(16, 256, 4, 3), (16, 512, 4, 2), (32, 256, 4, 3), (32, 128, 4, 4),
                                  (8, 512, 4, 3), (64, 128, 8, 3)]:
        out.append(triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=warps, num_stages=stages))
    return out


#: Shared memory one program may use on every target (sm_120 has 99 KB per block).
SHARED_LIMIT = 99 * 1024


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """For ``tl.dot`` tiles (``BLOCK_M > 1``): at least 16 columns, and staged tiles that fit
    :data:`SHARED_LIMIT`."""
    bm = kwargs.get("BLOCK_M", named_args.get("BLOCK_M", 1))
    if bm == 1:
        return configs
    kept = [c for c in configs if c.kwargs["BLOCK_N"] >= 16
            and c.num_stages * (bm + c.kwargs["BLOCK_N"]) * c.kwargs["BLOCK_K"] * 2 <= SHARED_LIMIT]
    return kept or configs[:1]


@triton.jit
def _skinny_linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K: tl.constexpr, stride_xm, stride_wn, stride_ym,
                          HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, UPCAST: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        xm = m_mask[:, None] & k_mask[None, :]
        x = tl.load(x_rows + offs_k[None, :], mask=xm, other=0.0)
        if SWIGLU:
            up = tl.load(x_rows + K + offs_k[None, :], mask=xm, other=0.0).to(tl.float32)
            g = x.to(tl.float32)
            x = (g / (1.0 + tl.exp(-g))).to(x.dtype).to(tl.float32) * up
            x = x.to(w.dtype)
        if BLOCK_M == 1:
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)[None, :]
        elif UPCAST:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


_autotuned = triton.autotune(
    configs=autotune_configs(_configs(), triton.Config({"BLOCK_N": 16, "BLOCK_K": 32}, num_warps=4)),
    key=["N", "K", "BLOCK_M", "SWIGLU"],
    prune_configs_by={"early_config_prune": _prune},
)(_skinny_linear_kernel)


def block_m(rows: int) -> int:
    """The kernel's row tile for ``rows`` rows: 1 (GEMV) or a ``tl.dot`` tile of at least 16."""
    return 1 if rows == 1 else max(16, triton.next_power_of_2(rows))


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  swiglu: bool = False, config: dict | None = None) -> torch.Tensor:
    """The Triton kernel for ``x [M, K]`` (``[M, 2K]`` with ``swiglu``), ``weight [N, K]``; any
    ``M`` (the caller decides when it pays). ``config`` (``BLOCK_N``, ``BLOCK_K``, ``num_warps``,
    ``num_stages``) skips the autotuner (benchmarks sweep configs with it)."""
    m = x.shape[0]
    n, k = weight.shape
    if x.shape[-1] != (2 * k if swiglu else k):
        raise ValueError(f"x has {x.shape[-1]} columns; weight {tuple(weight.shape)} needs "
                         f"{2 * k if swiglu else k}{' (swiglu: [gate | up])' if swiglu else ''}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        raise ValueError("weight must be contiguous in its last dim")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    bm = block_m(m)
    args = (x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0),
            y.stride(0))
    flags = dict(HAS_BIAS=bias is not None, SWIGLU=swiglu, UPCAST=INTERPRET, BLOCK_M=bm)
    if config is not None:
        c = dict(config)
        warps, stages = c.pop("num_warps", 4), c.pop("num_stages", 2)
        grid = (triton.cdiv(n, c["BLOCK_N"]), triton.cdiv(m, bm))
        _skinny_linear_kernel[grid](*args, **flags, **c, num_warps=warps, num_stages=stages)
    else:
        def grid(meta):
            return (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, bm))
        _autotuned[grid](*args, **flags)
    return y


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               swiglu: bool = False) -> torch.Tensor:
    """Reference semantics: ``F.linear(silu_and_mul(x) if swiglu else x, weight, bias)``."""
    return F.linear(silu_and_mul_ref(x) if swiglu else x, weight, bias)


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  swiglu: bool = False) -> torch.Tensor:
    """``linear_ref`` semantics for ``x [..., K]``: the Triton kernel for up to :data:`MAX_ROWS`
    rows of a 16-bit dtype, cuBLAS (after the Triton SwiGLU) otherwise."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype:
        y = skinny_linear(x2, weight, bias, swiglu=swiglu)
    else:
        if swiglu:
            from kernels.triton_activation import silu_and_mul_triton
            x2 = silu_and_mul_triton(x2)
        y = F.linear(x2, weight, bias)
    return y.view(*lead, weight.shape[0])
