"""Skinny linear layers for decode in Triton: ``y = x @ W.T (+ b)`` for a few rows of ``x`` (a
decode batch), where the step is bound by reading ``W`` once, and the gated form
``y = silu(x @ Wg.T) * (x @ Wu.T)`` for a SwiGLU MLP's fused ``[gate; up]`` projection.

Grid ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M))``: a program streams ``BLOCK_N`` rows of ``W`` along
``K`` (``tl.dot`` on tiles staged through shared memory by the software pipeline; the row tile is
at least 16, so one decode row costs the same as 16) and writes whole outputs: no split-K and no
reduction pass, unlike cuBLAS's decode GEMVs, which add a reduce kernel after the smaller
projections. ``K`` is a compile-time constant (a layer's width).

Gated (``gated=True``, ``W = [Wg; Wu]`` of ``2N`` rows): a program reads the gate rows and the
matching up rows, and its epilogue writes ``silu(gate) * up``, each rounded to the output dtype
the way the unfused pair (projection, then :func:`kernels.activation.silu_and_mul_ref`) rounds
them. The ``2N``-wide projection output never goes to memory and the SwiGLU kernel is gone.

Above :data:`MAX_ROWS` rows the product is compute-shaped and :func:`linear_triton` hands it to
``torch.nn.functional.linear`` (cuBLAS), with the Triton SwiGLU kernel after it when gated.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.triton_activation import silu_and_mul_triton
from kernels.triton_support import INTERPRET, exact_dot, autotune_configs, shared_memory_per_block, staged_tile_bytes

#: Rows of ``x`` up to which the Triton kernel runs (decode batches); larger ones go to cuBLAS
#: (on an H200 cuBLAS is as fast or faster from 32 rows: bench/results/linear-h200-*.json).
MAX_ROWS = 16


def _configs() -> list[triton.Config]:
    # the fastest configs of a sweep over Qwen3-8B's four projections at 1 and 32 rows on an H200
    # (bench/linear_gpu.py), each the best for at least one of them
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
            for bn, bk, w, s in [(64, 256, 4, 4), (32, 512, 4, 4), (32, 128, 4, 3), (64, 128, 4, 3),
                                 (32, 256, 4, 4), (64, 512, 4, 3), (32, 512, 4, 3)]]


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Configs whose staged tiles (``x`` and one or two ``W`` tiles per pipelined stage) fit the
    device's shared memory."""
    bm = kwargs.get("BLOCK_M", named_args.get("BLOCK_M", 16))
    w_tiles = 2 if kwargs.get("GATED", named_args.get("GATED", False)) else 1
    def fits(c: triton.Config) -> bool:
        n, k = c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]
        return staged_tile_bytes(c, bm * k * 2, w_tiles * n * k * 2) <= shared_memory_per_block()
    kept = [c for c in configs if fits(c)]
    return kept or configs[:1]


@triton.jit
def _skinny_linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K: tl.constexpr, stride_xm, stride_wn, stride_ym,
                          HAS_BIAS: tl.constexpr, GATED: tl.constexpr, UPCAST: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    rows = offs_n.to(tl.int64)
    w_rows = w_ptr + rows[:, None] * stride_wn
    u_rows = w_ptr + (rows + N)[:, None] * stride_wn  # gated: the up rows follow the N gate rows
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w_mask = n_mask[:, None] & k_mask[None, :]
        x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + offs_k[None, :], mask=w_mask, other=0.0)
        if UPCAST:
            acc = exact_dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
        else:
            acc = exact_dot(x, tl.trans(w), acc)
        if GATED:
            u = tl.load(u_rows + offs_k[None, :], mask=w_mask, other=0.0)
            if UPCAST:
                acc_u = exact_dot(x.to(tl.float32), tl.trans(u.to(tl.float32)), acc_u)
            else:
                acc_u = exact_dot(x, tl.trans(u), acc_u)
    out_ty = y_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_u += tl.load(b_ptr + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if GATED:  # round as the unfused pair does: projection, SiLU, product, each to the dtype
        g = acc.to(out_ty).to(tl.float32)
        up = acc_u.to(out_ty).to(tl.float32)
        acc = (g / (1.0 + tl.exp(-g))).to(out_ty).to(tl.float32) * up
    y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(out_ty), mask=m_mask[:, None] & n_mask[None, :])


_autotuned = triton.autotune(
    configs=autotune_configs(_configs(), triton.Config({"BLOCK_N": 16, "BLOCK_K": 32}, num_warps=4)),
    key=["N", "K", "BLOCK_M", "GATED"],
    prune_configs_by={"early_config_prune": _prune}, cache_results=True,
)(_skinny_linear_kernel)


def block_m(rows: int) -> int:
    """The kernel's row tile for ``rows`` rows (a ``tl.dot`` tile: at least 16)."""
    return max(16, triton.next_power_of_2(rows))


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  gated: bool = False, config: dict | None = None) -> torch.Tensor:
    """The Triton kernel for ``x [M, K]`` and ``weight [N, K]`` (``[2N, K]`` = ``[gate; up]`` when
    ``gated``), any ``M`` (the caller decides when it pays). ``config`` (``BLOCK_N``, ``BLOCK_K``,
    ``num_warps``, ``num_stages``) skips the autotuner (benchmarks sweep configs with it)."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x has {k} columns but weight {tuple(weight.shape)} has {weight.shape[1]}")
    if gated:
        if n % 2:
            raise ValueError(f"gated weight needs [gate; up] rows, got an odd {n}")
        n //= 2
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
    flags = dict(HAS_BIAS=bias is not None, GATED=gated, UPCAST=INTERPRET, BLOCK_M=bm)
    if config is not None:
        c = dict(config)
        warps, stages = c.pop("num_warps", 4), c.pop("num_stages", 3)
        _skinny_linear_kernel[(triton.cdiv(n, c["BLOCK_N"]), triton.cdiv(m, bm))](
            *args, **flags, **c, num_warps=warps, num_stages=stages)
    else:
        def grid(meta):
            return (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, bm))
        _autotuned[grid](*args, **flags)
    return y


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  gated: bool = False) -> torch.Tensor:
    """:func:`kernels.linear.linear_ref` semantics for ``x [..., K]``: the Triton kernel for up to
    :data:`MAX_ROWS` rows of a 16-bit dtype, cuBLAS (and the Triton SwiGLU when gated) otherwise."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype:
        y = skinny_linear(x2, weight, bias, gated=gated)
    else:
        y = F.linear(x2, weight, bias)
        if gated:
            y = silu_and_mul_triton(y)
    return y.view(*lead, y.shape[-1])
