"""Paged prefill/extend attention in Triton (flash-style online softmax).

Grid ``(query tiles, num_q_heads, num_seqs)``: each program takes ``BLOCK_M`` query rows of one
sequence and one head. A sequence's queries are its last ``q_len`` positions of ``seq_len``, so
row ``m`` sits at position ``seq_len - q_len + m`` and sees keys up to that position (and, with a
sliding window ``W``, only the last ``W`` of them). Keys come from the paged cache, which already
holds the new tokens (``write_kv_cache`` runs first). Key tiles wholly below the tile's first
query position need no mask; only the diagonal tiles (and every tile under a window) are masked.
GQA: query head ``h`` reads KV head ``h // (Hq // Hkv)``. Paged offsets are int64.

On Hopper the MMAs are not what limits this loop but the work around them, issued by the same
warps: the unmasked tiles fold the softmax scale into the exp2's FMA and rescale the
accumulator inside the PV dot; a tile's row offsets cost one 32x32->64 multiply per row (page
ids are non-negative int32), with the in-page part hoisted out of the loop when pages tile
``BLOCK_N``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_support import INTERPRET, exact_dot, autotune_configs, check_last_dim_contiguous

_LOG2E = 1.4426950408889634

# 128x128 tiles with 8 warps (two warpgroups, one 64-row wgmma each) amortize the per-tile
# softmax and address work best; three stages let the pipeliner fetch a tile's block-table
# entries one stage ahead of its K/V copies (two stages leave that latency in the loop).
# 64-row tiles with 4 warps fit two programs per SM, which then overlap each other's softmax
# and MMA (at twice the L2 traffic). The last config is the small-shared-memory fallback.
_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=2),
]


@triton.jit
def _load_tile(ptrs, n_mask, d_mask, MASK_N: tl.constexpr, EVEN_D: tl.constexpr):
    """Load a ``[BLOCK_N, BLOCK_D]`` KV tile, masking only what can be out of range."""
    if MASK_N:
        return tl.load(ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    if EVEN_D:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=d_mask[None, :], other=0.0)


@triton.jit
def _wide_offset(index, stride):
    """``index * stride`` as int64 for a non-negative ``index``: for int32 operands one 32x32->64
    unsigned multiply (a sign-extended int64 product costs five instructions per row on sm_90)."""
    stride = stride + tl.zeros((), tl.int32)  # an int32 tensor, even for a constexpr stride of 1
    WIDE: tl.constexpr = stride.dtype == tl.int64 or index.dtype == tl.int64
    if WIDE:
        offset = index.to(tl.int64) * stride
    else:
        offset = (index.to(tl.uint32, bitcast=True).to(tl.uint64)
                  * stride.to(tl.uint32, bitcast=True).to(tl.uint64)).to(tl.int64, bitcast=True)
    return offset


@triton.jit
def _attend(acc, l_i, m_i, q, q_pos, k_base, v_base, table, lo, hi, qk_scale, window,
            stride_kb, stride_kt, stride_vb, stride_vt, offs_d, d_mask,
            PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
            HAS_WINDOW: tl.constexpr, EVEN_D: tl.constexpr, UPCAST: tl.constexpr):
    """Fold keys ``[lo, hi)`` into the running softmax state ``(acc, l_i, m_i)`` (log2 domain).
    ``lo`` is a multiple of ``BLOCK_N``. Unmasked tiles (every key visible to every row) scale
    the scores inside the exp2's FMA and need no guard for rows with nothing visible."""
    # Offsets within a page repeat from tile to tile when pages tile BLOCK_N: hoisted.
    ALIGNED: tl.constexpr = BLOCK_N % PAGE_SIZE == 0
    k_in_page = _wide_offset(tl.arange(0, BLOCK_N) % PAGE_SIZE, stride_kt)
    v_in_page = _wide_offset(tl.arange(0, BLOCK_N) % PAGE_SIZE, stride_vt)
    for n0 in range(lo, hi, BLOCK_N):
        n0 = tl.multiple_of(n0, BLOCK_N)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if MASKED:
            page = tl.load(table + offs_n // PAGE_SIZE, mask=offs_n < hi, other=0)
        else:
            page = tl.load(table + offs_n // PAGE_SIZE)
        if not ALIGNED:
            k_in_page = _wide_offset(offs_n % PAGE_SIZE, stride_kt)
            v_in_page = _wide_offset(offs_n % PAGE_SIZE, stride_vt)
        k_rows = _wide_offset(page, stride_kb) + k_in_page
        k = _load_tile(k_base + k_rows[:, None] + offs_d[None, :], offs_n < hi, d_mask, MASKED,
                       EVEN_D)  # [BLOCK_N, BLOCK_D]
        if UPCAST:
            k = k.to(tl.float32)
        qk = exact_dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N], unscaled
        if MASKED:
            visible = (offs_n[None, :] <= q_pos[:, None]) & (offs_n < hi)[None, :]
            if HAS_WINDOW:
                visible &= offs_n[None, :] > q_pos[:, None] - window
            qk = tl.where(visible, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
            p = tl.exp2(qk - m_safe[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_safe = m_new
            p = tl.exp2(qk * qk_scale - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = _wide_offset(page, stride_vb) + v_in_page
        v = _load_tile(v_base + v_rows[:, None] + offs_d[None, :], offs_n < hi, d_mask, MASKED,
                       EVEN_D)
        if UPCAST:
            v = v.to(tl.float32)
        acc = exact_dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(
    configs=autotune_configs(_CONFIGS, triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4,
                                                     num_stages=1)),
    key=["HEAD_DIM", "PAGE_SIZE", "GQA", "HAS_WINDOW", "q_len_bucket"], cache_results=True,
)
@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt, stride_ot, stride_oh, qk_scale, window, q_len_bucket,
    GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    # Largest query tiles first: under causal masking they carry the most work.
    m_start = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    if m_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len + m_start  # position of the tile's first query row

    offs_m = m_start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < q_len
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    rows = (q_begin + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = first_pos + tl.arange(0, BLOCK_M)  # rows past q_len are computed, never stored

    kv_head = (head // GQA).to(tl.int64)
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    hi = tl.minimum(seq_len, first_pos + BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if HAS_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, q_pos, k_base, v_base, table, lo, hi, qk_scale,
                                window, stride_kb, stride_kt, stride_vb, stride_vt, offs_d, d_mask,
                                PAGE_SIZE, BLOCK_N, True, True, EVEN_D, UPCAST)
    else:
        full_end = (first_pos + 1) // BLOCK_N * BLOCK_N  # keys every row of the tile sees
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, q_pos, k_base, v_base, table, 0, full_end,
                                qk_scale, window, stride_kb, stride_kt, stride_vb, stride_vt,
                                offs_d, d_mask, PAGE_SIZE, BLOCK_N, False, False, EVEN_D, UPCAST)
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, q_pos, k_base, v_base, table, full_end, hi,
                                qk_scale, window, stride_kb, stride_kt, stride_vb, stride_vt,
                                offs_d, d_mask, PAGE_SIZE, BLOCK_N, True, False, EVEN_D, UPCAST)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            block_tables: torch.Tensor, max_query_len: int, scale: float,
                            sliding_window: int | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal varlen attention of ``q [T, Hq, D]`` over paged ``k/v_cache [num_blocks,
    block_size, Hkv, D]``; returns ``[T, Hq, D]`` in ``q``'s dtype (into ``out`` if given)."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(name, t)
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if out is None:
        out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out

    def grid(meta: dict[str, int]) -> tuple[int, int, int]:
        return (triton.cdiv(max_query_len, meta["BLOCK_M"]), num_q_heads, num_seqs)

    _prefill_kernel[grid](
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        scale * _LOG2E, sliding_window or 0, min(triton.next_power_of_2(max_query_len), 4096),
        GQA=num_q_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), PAGE_SIZE=page_size,
        HAS_WINDOW=sliding_window is not None, UPCAST=INTERPRET,
    )
    return out
