"""DeepSeek-V4 compressors' one-token step in Triton. :func:`compress_decode_triton` computes what
:func:`kernels.deepseek_v4_ref.compress_decode_ref` does (the pools after one more token per row,
and each row's entry so far) in one kernel, where the reference launches about 30 small torch
kernels (the CSA series' concatenations, two pool merges, the stacks and selects of the restart);
the compressors' glue was 204 of the 599 kernels of a batch-1 V4 decode step in graphs
(bench/results/v4-decode-profile-h200-2026-12-03-hc.json). :func:`compress_store_triton` then
normalises, rotates and stores the entries the step completed (the reference: a norm, the RoPE
tables, a concatenation, a rotation and an indexed write, about 15 kernels), one kernel a cache.

One program per row and slice of channels; a channel's result depends on that channel's inputs
only (float32 throughout), so a row's result does not depend on its batch. The merge of two pools
is written as the reference's ``logaddexp`` and weighted means are (max plus the log of the
shifted sum: float32 rounding apart, the same)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.deepseek_v4_ref import EMPTY_LSE


@triton.jit
def _merge(lse_a, mean_a, lse_b, mean_b):
    m = tl.maximum(lse_a, lse_b)
    lse = m + tl.log(tl.exp(lse_a - m) + tl.exp(lse_b - m))
    return lse, mean_a * tl.exp(lse_a - lse) + mean_b * tl.exp(lse_b - lse)


@triton.jit
def _series(main_ptr, index_ptr, row, stride_m, stride_i, cs, ok, D, off_main, off_index, HAS_INDEX: tl.constexpr):
    """Channels ``cs`` of one series: the main compressor's from ``off_main``, then (CSA with an
    indexer) the indexer compressor's from ``off_index``."""
    if HAS_INDEX:
        main = cs < D
        x = tl.load(main_ptr + row * stride_m + off_main + cs, mask=ok & main, other=0.0).to(tl.float32)
        y = tl.load(index_ptr + row * stride_i + off_index + (cs - D), mask=ok & (cs >= D), other=0.0)
        return tl.where(main, x, y.to(tl.float32))
    else:
        return tl.load(main_ptr + row * stride_m + off_main + cs, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _advance(carry, state, mean_ptr, row, p, ratio, cs, ok, g_ptr, v_ptr, ig_ptr, iv_ptr, ape_ptr, iape_ptr,
             stride_g, stride_v, stride_ig, stride_iv, stride_ape, stride_iape, C, D, DI, empty_lse,
             OVERLAP: tl.constexpr, HAS_INDEX: tl.constexpr, HAS_APE: tl.constexpr):
    """Row ``row``'s channels ``cs``: its pools ``carry`` (``[lse | mean]`` per series, float32 or
    the state cache's dtype) after the token at position ``p`` -> ``state``, its entry so far ->
    ``mean_ptr``. ``HAS_APE``: the gates are the raw projections, the slot's bias ``ape[p % ratio]``
    (and the indexer compressor's) still to add."""
    fresh = p == 0
    done = (p % ratio) == ratio - 1
    slot = p % ratio
    # series B: the window in progress (HCA: the whole projection; CSA: the second halves)
    off_b = D if OVERLAP else 0
    g_b = _series(g_ptr, ig_ptr, row, stride_g, stride_ig, cs, ok, D, off_b, DI, HAS_INDEX)
    if HAS_APE:
        g_b += _series(ape_ptr, iape_ptr, slot, stride_ape, stride_iape, cs, ok, D, off_b, DI, HAS_INDEX)
    v_b = _series(v_ptr, iv_ptr, row, stride_v, stride_iv, cs, ok, D, off_b, DI, HAS_INDEX)
    c_lse = tl.where(fresh, empty_lse, tl.load(carry + cs, mask=ok, other=0.0).to(tl.float32))
    c_mean = tl.where(fresh, 0.0, tl.load(carry + C + cs, mask=ok, other=0.0).to(tl.float32))
    lse_b, mean_b = _merge(c_lse, c_mean, g_b, v_b)
    tl.store(mean_ptr + cs, mean_b, mask=ok)
    dt = state.dtype.element_ty
    if OVERLAP:
        # series A: the first halves, pooled into the next entry's overlap part
        g_a = _series(g_ptr, ig_ptr, row, stride_g, stride_ig, cs, ok, D, 0, 0, HAS_INDEX)
        if HAS_APE:
            g_a += _series(ape_ptr, iape_ptr, slot, stride_ape, stride_iape, cs, ok, D, 0, 0, HAS_INDEX)
        v_a = _series(v_ptr, iv_ptr, row, stride_v, stride_iv, cs, ok, D, 0, 0, HAS_INDEX)
        a_lse = tl.where(fresh, empty_lse, tl.load(carry + 2 * C + cs, mask=ok, other=0.0).to(tl.float32))
        a_mean = tl.where(fresh, 0.0, tl.load(carry + 3 * C + cs, mask=ok, other=0.0).to(tl.float32))
        lse_a, mean_a = _merge(a_lse, a_mean, g_a, v_a)
        # in progress: [entry so far, overlap so far]; completed: [overlap -> next entry, empty]
        tl.store(state + cs, tl.where(done, lse_a, lse_b).to(dt), mask=ok)
        tl.store(state + C + cs, tl.where(done, mean_a, mean_b).to(dt), mask=ok)
        tl.store(state + 2 * C + cs, tl.where(done, empty_lse, lse_a).to(dt), mask=ok)
        tl.store(state + 3 * C + cs, tl.where(done, 0.0, mean_a).to(dt), mask=ok)
    else:
        tl.store(state + cs, tl.where(done, empty_lse, lse_b).to(dt), mask=ok)
        tl.store(state + C + cs, tl.where(done, 0.0, mean_b).to(dt), mask=ok)


@triton.jit
def _compress_decode_kernel(carry_ptr, pos_ptr, g_ptr, v_ptr, ig_ptr, iv_ptr, state_ptr, mean_ptr,
                            C, D, DI, ratio, stride_c, stride_s, stride_g, stride_v, stride_ig, stride_iv,
                            stride_mean, empty_lse, OVERLAP: tl.constexpr, HAS_INDEX: tl.constexpr,
                            BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    p = tl.load(pos_ptr + row)
    _advance(carry_ptr + row * stride_c, state_ptr + row * stride_s, mean_ptr + row * stride_mean, row, p, ratio,
             cs, cs < C, g_ptr, v_ptr, ig_ptr, iv_ptr, g_ptr, g_ptr, stride_g, stride_v, stride_ig, stride_iv, 0, 0,
             C, D, DI, empty_lse, OVERLAP, HAS_INDEX, False)


@triton.jit
def _compress_decode_paged_kernel(states_ptr, table_ptr, pos_ptr, g_ptr, v_ptr, ig_ptr, iv_ptr, ape_ptr, iape_ptr,
                                  mean_ptr, index_ptr, done_ptr, C, D, DI, ratio, block_size, stride_block,
                                  stride_t, stride_g, stride_v, stride_ig, stride_iv, stride_ape, stride_iape,
                                  stride_mean, empty_lse, OVERLAP: tl.constexpr, HAS_INDEX: tl.constexpr,
                                  BLOCK_C: tl.constexpr):
    """A decode step's rows over the paged state group: each row's carry is its block of the
    position before (``table[row, (p - 1) // block_size]``), its new pools go to the block of its
    position, in place (a program reads its channels of the carry before it writes them; the
    blocks differ between rows but padding rows', which share the null block)."""
    row = tl.program_id(0).to(tl.int64)
    cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    p = tl.load(pos_ptr + row).to(tl.int64)
    before = tl.load(table_ptr + row * stride_t + tl.maximum(p - 1, 0) // block_size).to(tl.int64)
    after = tl.load(table_ptr + row * stride_t + p // block_size).to(tl.int64)
    _advance(states_ptr + before * stride_block, states_ptr + after * stride_block, mean_ptr + row * stride_mean,
             row, p, ratio, cs, cs < C, g_ptr, v_ptr, ig_ptr, iv_ptr, ape_ptr, iape_ptr, stride_g, stride_v,
             stride_ig, stride_iv, stride_ape, stride_iape, C, D, DI, empty_lse, OVERLAP, HAS_INDEX, True)
    if tl.program_id(1) == 0:
        tl.store(index_ptr + row, p // ratio)
        tl.store(done_ptr + row, (p % ratio) == ratio - 1)


def compress_decode_triton(carry: torch.Tensor, positions: torch.Tensor, ratio: int, gate: torch.Tensor,
                           value: torch.Tensor, index_gate: torch.Tensor | None = None,
                           index_value: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same signature and results as :func:`kernels.deepseek_v4_ref.compress_decode_ref`."""
    rows = carry.shape[0]
    overlap = carry.dim() == 4
    c = carry.shape[-1]
    has_index = overlap and index_gate is not None and index_value is not None
    d = gate.shape[1] // 2 if overlap else gate.shape[1]
    di = index_gate.shape[1] // 2 if has_index else 0  # type: ignore[union-attr]
    assert d + di == c, (d, di, c)
    carry = carry.float().reshape(rows, -1)
    if carry.stride(-1) != 1:
        carry = carry.contiguous()
    gate, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (gate, value))
    ig, iv = (index_gate, index_value) if has_index else (gate, value)
    assert ig is not None and iv is not None
    ig, iv = (t if t.stride(-1) == 1 else t.contiguous() for t in (ig, iv))
    positions = positions.contiguous()
    state = torch.empty(rows, carry.shape[1], dtype=torch.float32, device=carry.device)
    mean = torch.empty(rows, c, dtype=torch.float32, device=carry.device)
    if rows:
        block = min(256, triton.next_power_of_2(c))
        _compress_decode_kernel[(rows, triton.cdiv(c, block))](
            carry, positions, gate, value, ig, iv, state, mean, c, d, di, ratio, carry.stride(0), state.stride(0),
            gate.stride(0), value.stride(0), ig.stride(0), iv.stride(0), mean.stride(0), EMPTY_LSE,
            OVERLAP=overlap, HAS_INDEX=has_index, BLOCK_C=block, num_warps=2)
    return state.view(rows, *((2, 2) if overlap else (2,)), c), mean



def compress_decode_paged_triton(states: torch.Tensor, table: torch.Tensor, block_size: int,
                                 positions: torch.Tensor, ratio: int, gate: torch.Tensor, value: torch.Tensor,
                                 ape: torch.Tensor, index_gate: torch.Tensor | None = None,
                                 index_value: torch.Tensor | None = None, index_ape: torch.Tensor | None = None
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same signature and results as :func:`kernels.deepseek_v4_ref.compress_decode_paged_ref`, in
    one kernel (the reference: about 15 torch kernels of gathers, the carried pools' copy, the
    gates' slot bias, the write back)."""
    rows = positions.shape[0]
    overlap = states.dim() == 4
    c = states.shape[-1]
    has_index = overlap and index_gate is not None and index_value is not None and index_ape is not None
    d = gate.shape[1] // 2 if overlap else gate.shape[1]
    di = index_gate.shape[1] // 2 if has_index else 0  # type: ignore[union-attr]
    assert d + di == c, (d, di, c)
    assert states[0].is_contiguous(), "a block's state must be contiguous"
    gate, value, ape = (t if t.stride(-1) == 1 else t.contiguous() for t in (gate, value, ape))
    ig, iv, iape = (index_gate, index_value, index_ape) if has_index else (gate, value, ape)
    assert ig is not None and iv is not None and iape is not None
    ig, iv, iape = (t if t.stride(-1) == 1 else t.contiguous() for t in (ig, iv, iape))
    table = table if table.stride(-1) == 1 else table.contiguous()
    positions = positions.contiguous()
    mean = torch.empty(rows, c, dtype=torch.float32, device=states.device)
    index = torch.empty(rows, dtype=torch.int64, device=states.device)
    done = torch.empty(rows, dtype=torch.bool, device=states.device)
    if rows:
        block = min(256, triton.next_power_of_2(c))
        _compress_decode_paged_kernel[(rows, triton.cdiv(c, block))](
            states, table, positions, gate, value, ig, iv, ape, iape, mean, index, done, c, d, di, ratio, block_size,
            states.stride(0), table.stride(0), gate.stride(0), value.stride(0), ig.stride(0), iv.stride(0),
            ape.stride(0), iape.stride(0), mean.stride(0), EMPTY_LSE,
            OVERLAP=overlap, HAS_INDEX=has_index, BLOCK_C=block, num_warps=2)
    return mean, index, done

@triton.jit
def _compress_store_kernel(pooled_ptr, index_ptr, done_ptr, w_ptr, inv_freq_ptr, cache_ptr, table_ptr, stride_p,
                           N, ROT_HALF, eps, ratio, scaling, stride_cb, stride_cs, per_block, stride_t, max_col,
                           BLOCK: tl.constexpr, BLOCK_R: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    done = tl.load(done_ptr + row) != 0
    idx = tl.load(index_ptr + row).to(tl.int64)
    col = tl.minimum(idx // per_block, max_col)
    blk = tl.load(table_ptr + row * stride_t + col).to(tl.int64)
    dst = cache_ptr + blk * stride_cb + (idx % per_block) * stride_cs
    dt = cache_ptr.dtype.element_ty
    src = pooled_ptr + row * stride_p
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    x = tl.load(src + offs, mask=ok, other=0.0).to(dt).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
    y = ((x * inv).to(dt).to(tl.float32) * tl.load(w_ptr + offs, mask=ok, other=0.0)).to(dt)
    nope = N - 2 * ROT_HALF
    tl.store(dst + offs, y, mask=ok & (offs < nope) & done)
    # the rotated tail, in interleaved pairs (e, e + 1)
    i = tl.arange(0, BLOCK_R)
    ri = i < ROT_HALF
    e = nope + 2 * i
    xe = tl.load(src + e, mask=ri, other=0.0).to(dt).to(tl.float32)
    xo = tl.load(src + e + 1, mask=ri, other=0.0).to(dt).to(tl.float32)
    ye = ((xe * inv).to(dt).to(tl.float32) * tl.load(w_ptr + e, mask=ri, other=0.0)).to(dt).to(tl.float32)
    yo = ((xo * inv).to(dt).to(tl.float32) * tl.load(w_ptr + e + 1, mask=ri, other=0.0)).to(dt).to(tl.float32)
    f = (idx * ratio).to(tl.float32) * tl.load(inv_freq_ptr + i, mask=ri, other=0.0)
    c = tl.cos(f) * scaling
    s = tl.sin(f) * scaling
    tl.store(dst + e, (ye * c - yo * s).to(dt), mask=ri & done)
    tl.store(dst + e + 1, (yo * c + ye * s).to(dt), mask=ri & done)


def compress_store_triton(pooled: torch.Tensor, index: torch.Tensor, done: torch.Tensor, weight: torch.Tensor,
                          eps: float, inv_freq: torch.Tensor, ratio: int, scaling: float, cache: torch.Tensor,
                          table: torch.Tensor) -> None:
    """Same signature and effect as :func:`kernels.deepseek_v4_ref.compress_store_ref`, except that
    rows not done write nothing (the reference writes them into the null block)."""
    rows, n = pooled.shape
    assert pooled.stride(-1) == 1 and cache.stride(-1) == 1 and cache.shape[-1] == n, (pooled.stride(), cache.shape)
    rot_half = inv_freq.shape[0]
    if rows:
        _compress_store_kernel[(rows,)](
            pooled, index.contiguous(), done.contiguous(), weight.contiguous(), inv_freq.float().contiguous(), cache,
            table, pooled.stride(0), n, rot_half, eps, ratio, float(scaling), cache.stride(0), cache.stride(1),
            cache.shape[1], table.stride(0), table.shape[1] - 1, BLOCK=triton.next_power_of_2(n),
            BLOCK_R=max(2, triton.next_power_of_2(rot_half)), num_warps=4)
