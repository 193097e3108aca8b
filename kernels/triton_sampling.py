"""Top-k / top-p / min-p logit filtering in Triton, without sorting the vocabulary.

One program per row. Logits map to order-preserving int32 keys, and each filter becomes a
threshold found by bisection over the keys (32 passes over the row each): top-k keeps keys >= the
k-th largest; top-p keeps keys >= the smallest t whose strictly-larger mass is <= p (so the most
likely token always stays); min-p keeps ``x >= max + log(min_p)``. Filters apply in the
reference's order (min-p, then top-k, then top-p over the survivors).

Difference from :func:`kernels.sampling.apply_top_k_top_p_min_p_ref`: tokens tied exactly at a
threshold are all kept (the reference's sort keeps an arbitrary subset of them)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_INT32_MIN = tl.constexpr(-2147483648)
_INT32_MAX = tl.constexpr(2147483647)


@triton.jit
def _order_key(x):
    """float32 -> int32 with the same order (negative floats flip their magnitude bits)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _filter_kernel(logits_ptr, out_ptr, top_k_ptr, top_p_ptr, min_p_ptr, stride_l, stride_o, vocab,
                   HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr,
                   BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    src = logits_ptr + row * stride_l
    offs = tl.arange(0, BLOCK)
    m = tl.max(tl.load(src + offs, mask=offs < vocab, other=float("-inf")), 0)
    for v0 in range(BLOCK, vocab, BLOCK):
        x = tl.load(src + v0 + offs, mask=v0 + offs < vocab, other=float("-inf"))
        m = tl.maximum(m, tl.max(x, 0))
    floor = float("-inf")  # keep x >= floor (min-p)
    if HAS_MIN_P:
        min_p = tl.load(min_p_ptr + row).to(tl.float32)
        floor = tl.where(min_p > 0.0, m + tl.log(tl.maximum(min_p, 1e-30)), float("-inf"))
    key_floor = tl.cast(_INT32_MIN, tl.int64)  # keep key >= key_floor (top-k, top-p)
    if HAS_TOP_K:
        k = tl.load(top_k_ptr + row).to(tl.int64)
        if (k > 0) & (k < vocab):
            lo = tl.cast(_INT32_MIN, tl.int64)  # count(key >= lo) >= k holds throughout
            hi = tl.cast(_INT32_MAX, tl.int64)
            for _ in range(32):
                mid = (lo + hi + 1) // 2
                count = tl.cast(0, tl.int64)
                for v0 in range(0, vocab, BLOCK):
                    x = tl.load(src + v0 + offs, mask=v0 + offs < vocab, other=float("-inf"))
                    x = tl.where(x >= floor, x, float("-inf"))
                    hit = (v0 + offs < vocab) & (_order_key(x).to(tl.int64) >= mid)
                    count += tl.sum(hit.to(tl.int64), 0)
                lo = tl.where(count >= k, mid, lo)
                hi = tl.where(count >= k, hi, mid - 1)
            key_floor = lo
    if HAS_TOP_P:
        p = tl.load(top_p_ptr + row).to(tl.float32)
        if p < 1.0:
            total = tl.cast(0.0, tl.float32)
            for v0 in range(0, vocab, BLOCK):
                x = tl.load(src + v0 + offs, mask=v0 + offs < vocab, other=float("-inf"))
                keep = (x >= floor) & (_order_key(x).to(tl.int64) >= key_floor)
                total += tl.sum(tl.where(keep, tl.exp(x - m), 0.0), 0)
            budget = p * total
            lo = key_floor  # smallest t with mass(key > t) <= budget lies in [lo, hi]
            hi = tl.cast(_INT32_MAX, tl.int64)
            for _ in range(32):
                mid = (lo + hi) // 2
                mass = tl.cast(0.0, tl.float32)
                for v0 in range(0, vocab, BLOCK):
                    x = tl.load(src + v0 + offs, mask=v0 + offs < vocab, other=float("-inf"))
                    key = _order_key(x).to(tl.int64)
                    above = (x >= floor) & (key >= key_floor) & (key > mid)
                    mass += tl.sum(tl.where(above, tl.exp(x - m), 0.0), 0)
                hi = tl.where(mass <= budget, mid, hi)
                lo = tl.where(mass <= budget, lo, mid + 1)
            key_floor = lo
    dst = out_ptr + row * stride_o
    for v0 in range(0, vocab, BLOCK):
        mask = v0 + offs < vocab
        x = tl.load(src + v0 + offs, mask=mask, other=float("-inf"))
        keep = (x >= floor) & (_order_key(x).to(tl.int64) >= key_floor)
        tl.store(dst + v0 + offs, tl.where(keep, x, float("-inf")), mask=mask)


def apply_top_k_top_p_min_p_triton(logits: torch.Tensor, top_k: torch.Tensor | None,
                                   top_p: torch.Tensor | None,
                                   min_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) the logits each row's filters drop. ``logits [N, V]`` float32;
    ``top_k [N]`` int (<= 0 or >= V: off), ``top_p [N]`` float (1: off), ``min_p [N]`` float
    (0: off). Same semantics as :func:`kernels.sampling.apply_top_k_top_p_min_p_ref` (ties at a
    threshold aside); returns a new tensor, no host synchronization."""
    if top_k is None and top_p is None and min_p is None:
        return logits
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    out = torch.empty_like(logits)
    if rows == 0:
        return out
    _filter_kernel[(rows,)](
        logits, out, top_k if top_k is not None else logits, top_p if top_p is not None else logits,
        min_p if min_p is not None else logits, logits.stride(0), out.stride(0), vocab,
        HAS_TOP_K=top_k is not None, HAS_TOP_P=top_p is not None, HAS_MIN_P=min_p is not None,
        BLOCK=min(triton.next_power_of_2(vocab), 4096), num_warps=8,
    )
    return out
