"""Paged decode attention in Triton: one query token per sequence, split-KV.

Grid ``(num_seqs, num_kv_heads, num_splits)``: each program takes every query head of one KV head
(GQA: the KV tile is read once for the whole group, the group padded to 16 rows for ``tl.dot``)
over one contiguous slice of the sequence's context, and writes a partial output plus its
log-sum-exp (base 2). The program that finishes last for its (sequence, KV head) merges the
splits in the same launch: each program takes a ticket from a per-(sequence, KV head) counter
after its partial is written (a block barrier, then an acquire-release atomic at GPU scope), and
the one holding the last ticket reads every partial (bypassing L1), writes the output and resets
the counter to zero, so the counters are ready for the next launch (a CUDA graph replays the
kernel with the same counters). One launch per layer instead of a split kernel and a merge kernel.
With one split the kernel writes the final output directly.

The counters are one int32 per (sequence, KV head), kept per device (:func:`_tickets`): launches
that share them must not run concurrently, which holds for kernels issued in order on one stream.

Each program derives its slice from the sequence's *current* length on the device, so a launch
with a fixed ``num_splits`` (e.g. captured in a CUDA graph) stays correct as contexts grow.
Paged offsets are computed in int64.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.triton_support import INTERPRET, exact_dot, check_last_dim_contiguous, num_sms

_LOG2E = 1.4426950408889634

#: The launch configuration on a GPU. Not autotuned: the engine first runs this kernel while
#: warming its CUDA graphs up on one-token contexts, where every configuration times the same.
#: Chosen from SWEEP_CONFIGS by bench/decode_attention_gpu.py on an H200 (Qwen3-8B heads, batch
#: 1..64, contexts 530..4096): within 4% of the best everywhere; its staged tiles fit sm_120.
GPU_CONFIG = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
SWEEP_CONFIGS = [{"BLOCK_N": 32, "num_warps": 4, "num_stages": 3}, {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
                 GPU_CONFIG, {"BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
                 {"BLOCK_N": 128, "num_warps": 8, "num_stages": 2}]
_INTERPRETED_CONFIG = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1}


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr, tickets_ptr,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt, stride_ob, stride_oh, qk_scale, window,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GQA: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr, UPCAST: tl.constexpr, BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    part = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * part
    end = tl.minimum(start + part, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    heads = kv_head * GQA + offs_h
    h_mask = offs_h < GQA
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    seq64 = seq.to(tl.int64)
    q = tl.load(q_ptr + seq64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq64 * stride_bt
    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + kv_head.to(tl.int64) * stride_vh
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        page = tl.load(table + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_page = (offs_n % PAGE_SIZE).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_off = page * stride_kb + in_page * stride_kt  # [BLOCK_N] int64
        k = tl.load(k_base + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        qk = exact_dot(q, tl.trans(k)) * qk_scale  # [BLOCK_H, BLOCK_N], log2 domain
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = page * stride_vb + in_page * stride_vt
        v = tl.load(v_base + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + exact_dot(p.to(v.dtype), v)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # empty slice (short sequence): weight 0 in the merge
    out = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + seq64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])
    else:
        row = (seq64 * NUM_Q_HEADS + heads) * NUM_SPLITS + split  # [BLOCK_H]
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out,
                 mask=h_mask[:, None] & d_mask[None, :])
        tl.store(part_lse_ptr + row, tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe)),
                 mask=h_mask)
        # Every thread's partial is written before the ticket is taken (release, GPU scope).
        tl.debug_barrier()
        ticket_ptr = tickets_ptr + seq64 * NUM_KV_HEADS + kv_head
        ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
        if ticket == NUM_SPLITS - 1:  # the last program of this (sequence, KV head) merges
            base = (seq64 * NUM_Q_HEADS + heads) * NUM_SPLITS  # [BLOCK_H]
            io_mask = h_mask[:, None] & d_mask[None, :]
            m_all = tl.full([BLOCK_H], float("-inf"), tl.float32)
            l_all = tl.zeros([BLOCK_H], tl.float32)
            merged = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
            for s in range(NUM_SPLITS):
                lse = tl.load(part_lse_ptr + base + s, mask=h_mask, other=float("-inf"), cache_modifier=".cg")
                piece = tl.load(part_out_ptr + (base + s)[:, None] * HEAD_DIM + offs_d[None, :], mask=io_mask,
                                other=0.0, cache_modifier=".cg")
                m_new = tl.maximum(m_all, lse)
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all empty so far: weights 0
                alpha = tl.exp2(m_all - m_ref)
                w = tl.exp2(lse - m_ref)
                l_all = l_all * alpha + w
                merged = merged * alpha[:, None] + piece * w[:, None]
                m_all = m_new
            out = merged / tl.where(l_all == 0.0, 1.0, l_all)[:, None]
            tl.store(out_ptr + seq64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=io_mask)
            tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")  # ready for the next launch


_TICKETS: dict[torch.device, torch.Tensor] = {}
#: Counters replaced by larger ones stay allocated: CUDA graphs captured with them keep using them.
_RETIRED: list[torch.Tensor] = []


def _tickets(device: torch.device, needed: int) -> torch.Tensor:
    """The device's zeroed ticket counters, at least ``needed`` of them. Kernels leave them at zero;
    a larger set is allocated only when a launch needs more (split launches have fewer programs
    than about two per SM, so the first 4,096 serve every engine batch)."""
    t = _TICKETS.get(device)
    if t is None or t.numel() < needed:
        if t is not None:
            _RETIRED.append(t)
        t = torch.zeros(max(4096, triton.next_power_of_2(needed)), dtype=torch.int32, device=device)
        _TICKETS[device] = t
    return t


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Splits per (sequence, KV head): about two programs per multiprocessor, but no slice
    shorter than 256 tokens. (Measured on an H200, bench/decode_attention_gpu.py: more splits
    than that cost more in partials and merging than they win in parallelism; batch 32 at 530
    tokens of context ran 24.6 us with 2 splits against 27.7 us with 5.)"""
    programs = num_seqs * num_kv_heads
    wanted = math.ceil(2 * num_sms(device) / max(programs, 1))
    return max(1, min(wanted, math.ceil(max_seq_len / 256), 64))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                           scale: float, sliding_window: int | None = None,
                           num_splits: int | None = None, out: torch.Tensor | None = None,
                           config: dict | None = None) -> torch.Tensor:
    """``q [B, Hq, D]`` (one token per sequence, at position ``seq_lens[b] - 1``) over paged
    ``k/v_cache [num_blocks, block_size, Hkv, D]``; returns ``[B, Hq, D]`` in ``q``'s dtype.
    ``num_splits`` defaults to :func:`decode_num_splits`; keep it fixed under CUDA graphs.
    ``out`` (optional, ``[B, Hq, D]``, last dim contiguous) receives the result. ``config``
    (``BLOCK_N``, ``num_warps``, ``num_stages``) replaces :data:`GPU_CONFIG` (benchmarks sweep it)."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(name, t)
    num_seqs, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    gqa = num_q_heads // num_kv_heads
    if num_splits is None:
        num_splits = decode_num_splits(num_seqs, num_kv_heads, max_seq_len, q.device)
    if out is None:
        out = torch.empty((num_seqs, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    part_out = torch.empty((num_seqs, num_q_heads, num_splits, head_dim) if num_splits > 1 else (1,),
                           dtype=torch.float32, device=q.device)
    part_lse = torch.empty((num_seqs, num_q_heads, num_splits) if num_splits > 1 else (1,),
                           dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(head_dim)
    tickets = _tickets(q.device, num_seqs * num_kv_heads) if num_splits > 1 else part_lse
    launch = dict(config or (_INTERPRETED_CONFIG if INTERPRET else GPU_CONFIG))
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse, tickets,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        scale * _LOG2E, sliding_window or 0,
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, GQA=gqa, BLOCK_H=max(16, triton.next_power_of_2(gqa)),
        HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE_SIZE=page_size, NUM_SPLITS=num_splits,
        HAS_WINDOW=sliding_window is not None, UPCAST=INTERPRET, **launch,
    )
    return out
