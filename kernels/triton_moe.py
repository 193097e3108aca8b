"""Fused MoE in Triton: align pairs to experts, then two grouped GEMMs with weights of any
``kernels.quant`` format dequantized in registers (no dequantized copy in memory).

1. Alignment of (token, slot) pairs to experts (``kernels.triton_moe_align``); for fp4 ``w13``
   the same launch copies ``x`` into fp4 paired column order (``kernels.triton_quant``).
2. ``w13`` GEMM + SwiGLU: each program takes one expert block of ``BLOCK_M`` pairs and
   ``BLOCK_N`` intermediate columns and runs one K loop over the gate and the up rows of those
   columns (the activation tile is loaded once for both), applies the activation and writes
   ``act [P, I]`` (rows in pair order; columns in paired order for an fp4 ``w2``).
3. ``w2`` GEMM: ``act`` rows times the expert's ``w2``, scaled by the pair's routing weight,
   written to ``partial [P, H]`` float32.
4. A token's ``top_k`` partials are summed and cast to the activation dtype.
Four launches, no host synchronization (CUDA-graph safe once autotuned). Grid axis 0 runs over N
tiles, so the programs sharing an expert block (and its activation rows) run together.

Decode is a weight stream: each weight is read once and used by one to a few rows, so the cost
that matters is instructions per weight (fp4 decoding, ``kernels.triton_quant``), and enough
programs and warps in flight to keep memory busy. The GEMMs compute the transposed product
(``w @ a.T``): the decoded weight registers are the MMA's A operand as they are, and the
activations, shared by every weight row of a warp, are the small B operand. The autotuner keys
on a size class of the batch, since the best tile at one token per expert (few programs) is not
the best at many.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from kernels.moe import MoEWeight
from kernels.quant import QuantizedWeight
from kernels.triton_moe_align import moe_align, moe_align_and_pair
from kernels.triton_quant import (FMT_CODES, FP4_ACC_SCALE, fp4_paired_position, fp8_row_scale,
                                  load_weight_tile)
from kernels.triton_support import (INTERPRET, PORTABLE_DECODE, autotune_configs, shared_memory_per_block,
                                   staged_tile_bytes)


def _gemm_configs() -> list[triton.Config]:
    # The weight tile is the MMA's M side: two warps give each warp 16-64 weight rows and all
    # BLOCK_M activation rows (mma.sync); four or eight warps on 64+ rows make a warpgroup
    # (wgmma: best for bf16 weights, straight from shared memory). One-warp tiles of 16-32 rows
    # (twice the programs at batch-1 decode) were tried and not chosen: no faster at batch 1-64
    # (moe-h200-2026-12-03.json, kernels/NOTES.md).
    # (64, 64, 4, 4): the fastest w13 tile for an 8k-token prefill's 64-row expert blocks on the
    # H200, 6% faster than the others here (bench/results/v4-prefill-profile-h200-2026-12-06.json).
    shapes = [(32, 128, 2, 4), (32, 256, 2, 3), (64, 128, 2, 4), (64, 256, 2, 3),
              (64, 128, 4, 3), (128, 128, 4, 3), (128, 64, 8, 3), (64, 64, 4, 4)]
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
            for n, k, w, s in shapes]


#: Bytes of one weight element in shared memory, and elements per scale byte, by format code.
_WEIGHT_BYTES = {0: 2.0, 1: 1.0, 2: 0.5, 3: 0.5}
_ELEMENTS_PER_SCALE_BYTE = {0: 0, 1: 128 * 128 / 4, 2: 32, 3: 16}


def shared_memory_estimate(config: triton.Config, block_m: int, fmt: int, weight_tiles: int,
                           f32_dot: bool = False) -> int:
    """Shared memory of a config: the staged activation tile and weight tile(s) (two for w13: gate
    and up rows), with their scales."""
    n, k = config.kwargs["BLOCK_N"], config.kwargs["BLOCK_K"]
    per_scale = _ELEMENTS_PER_SCALE_BYTE[fmt]
    weights = n * k * _WEIGHT_BYTES[fmt] + (n * k / per_scale if per_scale else 0)
    return staged_tile_bytes(config, block_m * k * (4 if f32_dot else 2), weight_tiles * weights)


def _prune(configs: list[triton.Config], named_args: dict[str, Any], weight_tiles: int = 1,
           **kwargs: Any) -> list[triton.Config]:
    """fp8_block tiles must sit inside one 128-column scale block, and 256-deep bf16 tiles cost
    too much shared memory: 256-deep K tiles only for fp4. Eight warps only for M blocks of 64
    rows (prefill-sized). Configs over the device's shared memory per block (99 KB on sm_120)
    are never tried. Float32 multiplies (``F32_DOT``: correctness paths, not tuned) take the
    first config left."""
    fmt, block_m = kwargs["FMT"], kwargs["BLOCK_M"]
    limit = shared_memory_per_block()
    kept = [c for c in configs
            if not (fmt in (0, 1) and c.kwargs["BLOCK_K"] > 128)
            and not (block_m < 64 and c.num_warps > 4)
            and shared_memory_estimate(c, block_m, fmt, weight_tiles, bool(kwargs.get("F32_DOT"))) <= limit]
    if kwargs.get("F32_DOT"):
        kept = kept[:1]
    return kept or configs[:1]


_prune_w13 = functools.partial(_prune, weight_tiles=2)


def _bench_config(fn: Any, quantiles: Any) -> Any:
    """Autotuning timer: shorter than Triton's default (the kernels run for microseconds, and
    there are many configs and size classes to try within one benchmark run)."""
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


_INTERPRETED = triton.Config({"BLOCK_N": 16, "BLOCK_K": 32}, num_warps=4, num_stages=1)
_FP4 = (FMT_CODES["mxfp4"], FMT_CODES["nvfp4"])
_KEY = ["N", "K", "BLOCK_M", "FMT", "size_class"]


@triton.jit
def _load_rows(a_ptr, a_rows, stride_at, m_mask, k0, K, BLOCK_K: tl.constexpr,
               EVEN_K: tl.constexpr, UPCAST: tl.constexpr):
    """Activation rows ``a[a_rows, k0:k0 + BLOCK_K]`` (``[BLOCK_M, BLOCK_K]``)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = m_mask[:, None] if EVEN_K else m_mask[:, None] & (offs_k < K)[None, :]
    a = tl.load(a_ptr + a_rows[:, None] * stride_at + offs_k[None, :], mask=mask, other=0.0)
    if UPCAST:
        a = a.to(tl.float32)
    return a


@triton.jit
def _weight_dot(acc, a, w_base, s_base, rows, n_mask, k0, K, stride_wn, stride_sn,
                FMT: tl.constexpr, SCALE_UE8M0: tl.constexpr, FAST: tl.constexpr,
                BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, F32_DOT: tl.constexpr):
    """``acc + w[rows, k0:k0 + BLOCK_K] @ a.T``: ``[BLOCK_N, BLOCK_M]`` float32 (weights as the
    MMA's A operand: the decoded registers feed it as they are, and the few activation rows are
    the small operand), every scale applied except the nvfp4 global one and the fp4 tile shift
    (:func:`_fp4_out_scale`). ``F32_DOT``: both operands in float32, multiplied in full
    precision (float32 activations; float16 ones with fp4 weights, whose tiles are scaled below
    float16's range)."""
    w = load_weight_tile(w_base, s_base, rows, n_mask, k0, K, stride_wn, stride_sn, FMT,
                         BLOCK_K, EVEN_K, FAST)
    if F32_DOT:
        d = tl.dot(w.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision="ieee")
        if FMT == 1:
            return acc + d * fp8_row_scale(s_base, rows, n_mask, k0, stride_sn, SCALE_UE8M0)[:, None]
        return acc + d
    if FMT == 1:
        scale = fp8_row_scale(s_base, rows, n_mask, k0, stride_sn, SCALE_UE8M0)
        return acc + tl.dot(w.to(a.dtype), tl.trans(a)) * scale[:, None]
    return tl.dot(w.to(a.dtype), tl.trans(a), acc)


@triton.jit
def _fp4_out_scale(gs_ptr, expert, stride_gs, FMT: tl.constexpr):
    """What an fp4 accumulator still needs: the tile shift, times the nvfp4 global scale."""
    if FMT == 3:
        return tl.load(gs_ptr + expert * stride_gs) * FP4_ACC_SCALE
    return FP4_ACC_SCALE


@triton.autotune(configs=autotune_configs(_gemm_configs(), _INTERPRETED), key=_KEY,
                 prune_configs_by={"early_config_prune": _prune_w13}, do_bench=_bench_config, cache_results=True)
@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def _w13_swiglu_kernel(
    x_ptr, w_ptr, s_ptr, gs_ptr, out_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr,
    N, K, num_pairs, top_k, stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_gs,
    stride_ot, clamp, size_class, FMT: tl.constexpr, SCALE_UE8M0: tl.constexpr,
    HAS_CLAMP: tl.constexpr, PAIRED_OUT: tl.constexpr, UPCAST: tl.constexpr, FAST: tl.constexpr,
    F32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """``out[p, n] = swiglu(x[p // top_k] @ w13[e].T)[n]`` for ``N = I`` columns (column ``n``
    stored at its fp4 paired position if ``PAIRED_OUT``); ``x`` in paired order for fp4."""
    pid_m = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = pairs < num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rows < N
    w_base = w_ptr + expert * stride_we
    s_base = s_ptr + expert * stride_se
    gate = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = _load_rows(x_ptr, tokens, stride_xt, m_mask, k0, K, BLOCK_K, EVEN_K, UPCAST)
        gate = _weight_dot(gate, a, w_base, s_base, rows, n_mask, k0, K, stride_wn, stride_sn,
                           FMT, SCALE_UE8M0, FAST, BLOCK_K, EVEN_K, F32_DOT)
        up = _weight_dot(up, a, w_base, s_base, rows + N, n_mask, k0, K, stride_wn, stride_sn,
                         FMT, SCALE_UE8M0, FAST, BLOCK_K, EVEN_K, F32_DOT)
    if FMT >= 2:
        out_scale = _fp4_out_scale(gs_ptr, expert, stride_gs, FMT)
        gate *= out_scale
        up *= out_scale
    if HAS_CLAMP:
        gate = tl.minimum(gate, clamp)
        up = tl.minimum(tl.maximum(up, -clamp), clamp)
    act = gate / (1.0 + tl.exp(-gate)) * up
    cols = fp4_paired_position(rows) if PAIRED_OUT else rows
    tl.store(out_ptr + pairs.to(tl.int64)[None, :] * stride_ot + cols[:, None],
             act.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


@triton.autotune(configs=autotune_configs(_gemm_configs(), _INTERPRETED), key=_KEY,
                 prune_configs_by={"early_config_prune": _prune}, do_bench=_bench_config, cache_results=True)
@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def _w2_kernel(
    a_ptr, w_ptr, s_ptr, gs_ptr, out_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr,
    topk_weights_ptr, N, K, num_pairs, stride_at, stride_we, stride_wn, stride_se, stride_sn,
    stride_gs, stride_ot, size_class, FMT: tl.constexpr, SCALE_UE8M0: tl.constexpr,
    UPCAST: tl.constexpr, FAST: tl.constexpr, F32_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):
    """``out[p, n] = topk_weight[p] * (act[p] @ w2[e].T)[n]`` for ``N = H`` columns."""
    pid_m = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = pairs < num_pairs
    pairs64 = pairs.to(tl.int64)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rows < N
    w_base = w_ptr + expert * stride_we
    s_base = s_ptr + expert * stride_se
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = _load_rows(a_ptr, pairs64, stride_at, m_mask, k0, K, BLOCK_K, EVEN_K, UPCAST)
        acc = _weight_dot(acc, a, w_base, s_base, rows, n_mask, k0, K, stride_wn, stride_sn, FMT,
                          SCALE_UE8M0, FAST, BLOCK_K, EVEN_K, F32_DOT)
    if FMT >= 2:
        acc *= _fp4_out_scale(gs_ptr, expert, stride_gs, FMT)
    route = tl.load(topk_weights_ptr + pairs64, mask=m_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + pairs64[None, :] * stride_ot + rows[:, None], acc * route[None, :],
             mask=n_mask[:, None] & m_mask[None, :])


@triton.jit
def _sum_top_k_kernel(partial_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < hidden
    acc = tl.zeros([BLOCK], tl.float32)
    for j in range(TOP_K):
        acc += tl.load(partial_ptr + (token * TOP_K + j) * hidden + offs, mask=mask, other=0.0)
    tl.store(out_ptr + token * hidden + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _weight_args(w: MoEWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, bool]:
    """(data, scale, global scale, its expert stride, format code, ue8m0?) for the kernels; fp8
    tensors viewed as bytes, absent tensors replaced by the data (never read)."""
    if isinstance(w, torch.Tensor):
        w = QuantizedWeight("bf16", w)
    data = w.data.view(torch.uint8) if w.data.dtype == torch.float8_e4m3fn else w.data
    if data.stride(-1) != 1:
        raise ValueError("expert weights must be contiguous along K")
    scale = data if w.scale is None else w.scale
    scale = scale.view(torch.uint8) if scale.dtype == torch.float8_e4m3fn else scale
    g = data if w.global_scale is None else w.global_scale
    g_stride = g.stride(0) if w.global_scale is not None and g.dim() > 0 else 0
    return data, scale, g, g_stride, FMT_CODES[w.fmt], w.fmt == "fp8_block" and scale.dtype == torch.uint8


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _fast_decode(fmt: int, x: torch.Tensor) -> bool:
    """Hardware/PTX decoders (``kernels.triton_quant``): on CUDA, for bfloat16 activations (the
    tuned path; other dtypes take the portable decoder and ``_f32_dot``); formats with e4m3
    bytes (fp8 weights, nvfp4 scales) need sm_89+."""
    device = x.device
    if INTERPRET or PORTABLE_DECODE or device.type != "cuda" or x.dtype != torch.bfloat16:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return fmt == FMT_CODES["mxfp4"] or _capability(index) >= (8, 9)


def _f32_dot(fmt: int, x: torch.Tensor) -> bool:
    """Multiply in float32 (no tensor-float32 rounding): float32 activations, and float16 ones
    against fp4 tiles (scaled by ``2**-FP4_SHIFT``, below float16's range)."""
    return x.dtype == torch.float32 or (x.dtype == torch.float16 and fmt in _FP4)


def _size_class(num_pairs: int) -> int:
    """Autotuning bucket of the batch: the pair count rounded up to 16 (a couple of tokens: few
    programs), 128, 1024 or 4096 (beyond). Multiples of 16, so every class shares one compiled
    kernel (Triton specializes integer arguments on divisibility by 16 and on equality to 1)."""
    return next((cap for cap in (16, 128, 1024) if num_pairs <= cap), 4096)


def _block_m(num_pairs: int, num_experts: int) -> int:
    per_expert = num_pairs / max(num_experts, 1)
    return 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64


def fused_moe_triton(x: torch.Tensor, w13: MoEWeight, w2: MoEWeight, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, clamp: float | None = None) -> torch.Tensor:
    """``x [T, H]``, ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` (float tensors or QuantizedWeight of
    any format), ``topk_weights [T, k]``, ``topk_ids [T, k]`` -> ``[T, H]`` in ``x``'s dtype.
    Same semantics as :func:`kernels.moe.fused_moe_ref`; no host synchronization."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, two_inter = w13.shape[0], w13.shape[1]
    inter = two_inter // 2
    if tuple(w13.shape) != (num_experts, 2 * inter, hidden) or tuple(w2.shape) != (
            num_experts, hidden, inter):
        raise ValueError(f"expected w13 [E, 2I, H] and w2 [E, H, I], got {tuple(w13.shape)} and "
                         f"{tuple(w2.shape)} for x {tuple(x.shape)}")
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    x = x if x.stride(-1) == 1 else x.contiguous()
    block_m = _block_m(num_pairs, num_experts)
    d13, s13, g13, gs13, fmt13, ue13 = _weight_args(w13)
    d2, s2, g2, gs2, fmt2, ue2 = _weight_args(w2)
    # fp4 GEMMs read their activations in paired column order (kernels.triton_quant): x is
    # copied so by the alignment launch, act is written so by the w13 kernel.
    sorted_ids, expert_ids, num_padded, x_paired = moe_align_and_pair(
        topk_ids, num_experts, block_m, x if fmt13 in _FP4 else None)
    x13 = x if x_paired is None else x_paired
    num_blocks = expert_ids.shape[0]
    weights = topk_weights.reshape(-1).float()  # [P]
    size_class = _size_class(num_pairs)

    act = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)  # [P, I]
    _w13_swiglu_kernel[lambda m: (triton.cdiv(inter, m["BLOCK_N"]), num_blocks)](
        x13, d13, s13, g13, act, sorted_ids, expert_ids, num_padded,
        inter, hidden, num_pairs, top_k, x13.stride(0), d13.stride(0), d13.stride(1),
        s13.stride(0), s13.stride(1) if s13.dim() > 1 else 0, gs13, act.stride(0),
        clamp if clamp is not None else 0.0, size_class,
        FMT=fmt13, SCALE_UE8M0=ue13, HAS_CLAMP=clamp is not None, PAIRED_OUT=fmt2 in _FP4,
        UPCAST=INTERPRET, FAST=_fast_decode(fmt13, x), F32_DOT=_f32_dot(fmt13, x), BLOCK_M=block_m,
    )
    partial = torch.empty((num_pairs, hidden), dtype=torch.float32, device=x.device)  # [P, H]
    _w2_kernel[lambda m: (triton.cdiv(hidden, m["BLOCK_N"]), num_blocks)](
        act, d2, s2, g2, partial, sorted_ids, expert_ids, num_padded, weights,
        hidden, inter, num_pairs, act.stride(0), d2.stride(0), d2.stride(1),
        s2.stride(0), s2.stride(1) if s2.dim() > 1 else 0, gs2, partial.stride(0), size_class,
        FMT=fmt2, SCALE_UE8M0=ue2, UPCAST=INTERPRET, FAST=_fast_decode(fmt2, x),
        F32_DOT=_f32_dot(fmt2, x), BLOCK_M=block_m,
    )
    out = torch.empty_like(x)
    block = min(triton.next_power_of_2(hidden), 1024)
    _sum_top_k_kernel[(num_tokens, triton.cdiv(hidden, block))](partial, out, hidden, TOP_K=top_k,
                                                               BLOCK=block, num_warps=4)
    return out
