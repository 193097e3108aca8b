"""DeepSeek-V4 hyper-connections in Triton: ``hc_pre`` in two kernels and ``hc_post`` in one,
where the torch reference (:func:`kernels.deepseek_v4_ref.hc_pre_ref`) launches about 146 small
kernels per call (the 20 Sinkhorn normalisations of a 4 x 4 matrix are three kernels each), which
made the hyper-connections 1,169 of the 1,735 kernels of a batch-1 V4 decode step in graphs
(bench/results/v4-decode-profile-h200-2026-12-03.json).

- ``_hc_mix_kernel``: the mixes ``flat @ fn.T`` (``(2 + N) * N`` outputs over ``K = N * H``) and
  the sum of squares of ``flat``, split over fixed K chunks (``CHUNK``) so that a batch-1 step
  still spreads the weight read over many programs; each program writes its chunk's partial sums.
- ``_hc_pre_finish_kernel``: per token and slice of H, sums the partials (a fixed order), applies
  the RMS scale, the sigmoids, the softmax and the Sinkhorn iterations in registers, and collapses
  the streams with the "pre" weights for its slice; the first slice's program writes ``post`` and
  ``comb``.
- ``_hc_post_kernel``: stream k = post[k] * block output + sum_j comb[j, k] * stream j.

Everything is computed in float32 from the same inputs as the reference; a token's result does not
depend on the other tokens of the batch (fixed chunks and order), so decode, verify and prefill
rows of one token agree. The reference normalises ``flat`` before the product, here the RMS scale
multiplies the product (float32 rounding apart, the same), and ``hc_post`` rounds once where the
reference rounds ``post``/``comb`` to the model's dtype and then each product (one bf16 ulp)."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.triton_support import INTERPRET, exact_dot

#: bf16 streams: the mixes' products as three bf16 tensor-core products of ``fn``'s exact bf16
#: split (``_hc_mix_kernel``'s ``SPLIT_W``) instead of a float32 FMA product (``input_precision=
#: "ieee"``): the same products, summed in another order; 1.12-1.23x a V4-Flash prefill layer on
#: an H100. On by default since the GPU gate ran it (``PD_HC_MIX_BF16X3=0`` turns it off;
#: kernels/NOTES.md, "DeepSeek-V4 prefill").
SPLIT_BF16: bool = os.environ.get("PD_HC_MIX_BF16X3", "1") == "1"

#: Columns of ``flat`` per program of the mixes kernel (a multiple of ``BLOCK_K``): 128 programs
#: a token at V4-Flash width (K = 4 x 4096), each one load of its slice of ``fn`` (at 256 columns
#: and 64 programs the batch-1 call took 11 us: four dependent loads a program).
CHUNK = 128
BLOCK_K = 128


@triton.jit
def _hc_mix_kernel(x_ptr, fn_ptr, part_ptr, sq_ptr, T, K, stride_x, SPLITS,
                   M: tl.constexpr, M_PAD: tl.constexpr, CHUNK_K: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_K: tl.constexpr, SPLIT_W: tl.constexpr = False, UPCAST: tl.constexpr = False):
    pid_t = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    ms = tl.arange(0, M_PAD)
    m_ok = ms < M
    acc = tl.zeros([BLOCK_T, M_PAD], dtype=tl.float32)
    sq = tl.zeros([BLOCK_T], dtype=tl.float32)
    rows64 = rows.to(tl.int64)
    for k0 in range(0, CHUNK_K, BLOCK_K):
        ks = split * CHUNK_K + k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        xs = tl.load(x_ptr + rows64[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                     other=0.0)
        xt = xs.to(tl.float32)
        w = tl.load(fn_ptr + ms[None, :] * K + ks[:, None], mask=k_ok[:, None] & m_ok[None, :], other=0.0)
        w = w.to(tl.float32)
        if SPLIT_W:  # bf16 streams: fn as three bf16 pieces (hi + mid + lo == fn exactly), each
            # product of bf16 values exact in float32, on the tensor cores
            w_hi = w.to(tl.bfloat16)
            rest = w - w_hi.to(tl.float32)
            w_mid = rest.to(tl.bfloat16)
            w_lo = (rest - w_mid.to(tl.float32)).to(tl.bfloat16)
            if UPCAST:  # the interpreter's bf16 dot is unreliable: the same pieces in float32
                acc = exact_dot(xt, w_hi.to(tl.float32), acc)
                acc = exact_dot(xt, w_mid.to(tl.float32), acc)
                acc = exact_dot(xt, w_lo.to(tl.float32), acc)
            else:
                acc = tl.dot(xs, w_hi, acc)
                acc = tl.dot(xs, w_mid, acc)
                acc = tl.dot(xs, w_lo, acc)
        else:
            acc = exact_dot(xt, w, acc)
        sq += tl.sum(xt * xt, 1)
    out = (rows64[:, None] * SPLITS + split) * M_PAD + ms[None, :]
    tl.store(part_ptr + out, acc, mask=row_ok[:, None])
    tl.store(sq_ptr + rows64 * SPLITS + split, sq, mask=row_ok)


@triton.jit
def _hc_pre_finish_kernel(part_ptr, sq_ptr, x_ptr, base_ptr, scale_ptr, out_ptr, post_ptr, comb_ptr,
                          K, H, SPLITS, stride_x, stride_xn, stride_o, eps, norm_eps, ITERS: tl.constexpr,
                          N: tl.constexpr, N_PAD: tl.constexpr, M_PAD: tl.constexpr, S_PAD: tl.constexpr,
                          BLOCK_H: tl.constexpr):
    # the slices of one token are adjacent programs: its partial sums are read from HBM once
    slices = tl.cdiv(H, BLOCK_H)
    t = (tl.program_id(0) // slices).to(tl.int64)
    hb = tl.program_id(0) % slices
    i = tl.arange(0, N_PAD)
    s = tl.arange(0, S_PAD)
    i_ok = i < N
    s_ok = s < SPLITS
    ok2 = i_ok[:, None] & i_ok[None, :]
    # the partial sums of this token, in a fixed order
    rows = (t * SPLITS + s) * M_PAD
    pre_w = tl.sum(tl.load(part_ptr + rows[:, None] + i[None, :], mask=s_ok[:, None] & i_ok[None, :], other=0.0), 0)
    sq = tl.sum(tl.load(sq_ptr + t * SPLITS + s, mask=s_ok, other=0.0), 0)
    r = tl.rsqrt(sq / K + norm_eps)
    pre_s = tl.load(scale_ptr)
    post_s = tl.load(scale_ptr + 1)
    comb_s = tl.load(scale_ptr + 2)
    pre = tl.sigmoid(pre_w * r * pre_s + tl.load(base_ptr + i, mask=i_ok, other=0.0)) + eps
    pre = tl.where(i_ok, pre, 0.0)
    if hb == 0:  # post and comb: the first slice's program only
        post_w = tl.sum(tl.load(part_ptr + rows[:, None] + N + i[None, :], mask=s_ok[:, None] & i_ok[None, :],
                                other=0.0), 0)
        nn = i[:, None] * N + i[None, :]
        comb_w = tl.sum(tl.load(part_ptr + rows[:, None, None] + 2 * N + nn[None, :, :],
                                mask=s_ok[:, None, None] & ok2[None, :, :], other=0.0), 0)
        post = 2.0 * tl.sigmoid(post_w * r * post_s + tl.load(base_ptr + N + i, mask=i_ok, other=0.0))
        logits = comb_w * r * comb_s + tl.load(base_ptr + 2 * N + nn, mask=ok2, other=0.0)
        logits = tl.where(ok2, logits, -1e30)
        e = tl.where(ok2, tl.exp(logits - tl.max(logits, 1)[:, None]), 0.0)
        den = tl.where(i_ok, tl.sum(e, 1), 1.0)
        comb = tl.where(ok2, e / den[:, None] + eps, 0.0)
        comb = comb / (tl.sum(comb, 0)[None, :] + eps)
        for _ in range(ITERS - 1):
            comb = comb / (tl.sum(comb, 1)[:, None] + eps)
            comb = comb / (tl.sum(comb, 0)[None, :] + eps)
        tl.store(post_ptr + t * N + i, post, mask=i_ok)
        tl.store(comb_ptr + t * N * N + nn, comb, mask=ok2)
    hs = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = hs < H
    xt = tl.load(x_ptr + t * stride_x + i[:, None] * stride_xn + hs[None, :], mask=i_ok[:, None] & h_ok[None, :],
                 other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + hs, tl.sum(pre[:, None] * xt, 0).to(out_ptr.dtype.element_ty), mask=h_ok)


@triton.jit
def _hc_post_kernel(o_ptr, x_ptr, post_ptr, comb_ptr, y_ptr, H, stride_o, stride_x, stride_xn, stride_y,
                    stride_yn, N: tl.constexpr, N_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    i = tl.arange(0, N_PAD)
    i_ok = i < N
    hs = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = hs < H
    post = tl.load(post_ptr + t * N + i, mask=i_ok, other=0.0).to(tl.float32)
    # comb[j, k]: j (source stream) on axis 0, k (new stream) on axis 1
    comb = tl.load(comb_ptr + t * N * N + i[:, None] * N + i[None, :], mask=i_ok[:, None] & i_ok[None, :],
                   other=0.0).to(tl.float32)
    o = tl.load(o_ptr + t * stride_o + hs, mask=h_ok, other=0.0).to(tl.float32)
    xt = tl.load(x_ptr + t * stride_x + i[:, None] * stride_xn + hs[None, :], mask=i_ok[:, None] & h_ok[None, :],
                 other=0.0).to(tl.float32)
    mixed = tl.sum(comb[:, :, None] * xt[:, None, :], 0)  # [N_PAD (k), BLOCK_H]
    y = post[:, None] * o[None, :] + mixed
    tl.store(y_ptr + t * stride_y + i[:, None] * stride_yn + hs[None, :], y.to(y_ptr.dtype.element_ty),
             mask=i_ok[:, None] & h_ok[None, :])


def _streams(x: torch.Tensor) -> torch.Tensor:
    """``x [T, N, H]`` with unit stride along H and along the flattened ``N * H``."""
    if x.stride(-1) != 1 or x.stride(1) != x.shape[2]:
        x = x.contiguous()
    return x


def hc_pre_triton(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
                  eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same signature and results as :func:`kernels.deepseek_v4_ref.hc_pre_ref`."""
    x = _streams(x)
    t, n, h = x.shape
    k = n * h
    m = (2 + n) * n
    assert fn.shape == (m, k) and base.shape == (m,) and scale.shape == (3,), (fn.shape, base.shape, scale.shape)
    fn, base, scale = fn.float().contiguous(), base.float().contiguous(), scale.float().contiguous()
    dev = x.device
    out = torch.empty(t, h, dtype=x.dtype, device=dev)
    post = torch.empty(t, n, dtype=torch.float32, device=dev)
    comb = torch.empty(t, n, n, dtype=torch.float32, device=dev)
    if t == 0:
        return out, post, comb
    splits = triton.cdiv(k, CHUNK)
    m_pad = max(16, triton.next_power_of_2(m))
    part = torch.empty(t, splits, m_pad, dtype=torch.float32, device=dev)
    sq = torch.empty(t, splits, dtype=torch.float32, device=dev)
    block_t = 16 if t <= 512 else 64
    _hc_mix_kernel[(triton.cdiv(t, block_t), splits)](
        x, fn, part, sq, t, k, x.stride(0), splits, M=m, M_PAD=m_pad, CHUNK_K=CHUNK, BLOCK_T=block_t,
        BLOCK_K=BLOCK_K, SPLIT_W=SPLIT_BF16 and x.dtype == torch.bfloat16, UPCAST=INTERPRET,
        num_warps=4 if block_t == 16 else 8)
    block_h = min(512, triton.next_power_of_2(h))
    _hc_pre_finish_kernel[(t * triton.cdiv(h, block_h),)](
        part, sq, x, base, scale, out, post, comb, k, h, splits, x.stride(0), x.stride(1), out.stride(0),
        eps, norm_eps, ITERS=iters, N=n, N_PAD=max(2, triton.next_power_of_2(n)), M_PAD=m_pad,
        S_PAD=triton.next_power_of_2(splits), BLOCK_H=block_h, num_warps=1)  # one warp: the Sinkhorn
    # iterations' 40 reductions of a 4 x 4 matrix stay in warp shuffles (no shared-memory barriers)
    return out, post, comb


def hc_post_triton(out: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Same signature and results as :func:`kernels.deepseek_v4_ref.hc_post_ref` (one rounding)."""
    t, n, h = x.shape
    if out.stride(-1) != 1:
        out = out.contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    post, comb = post.contiguous(), comb.contiguous()
    y = torch.empty(t, n, h, dtype=x.dtype, device=x.device)
    if t == 0:
        return y
    block_h = min(256, triton.next_power_of_2(h))
    _hc_post_kernel[(t, triton.cdiv(h, block_h))](
        out, x, post, comb, y, h, out.stride(0), x.stride(0), x.stride(1), y.stride(0), y.stride(1), N=n,
        N_PAD=max(2, triton.next_power_of_2(n)), BLOCK_H=block_h, num_warps=4)
    return y
