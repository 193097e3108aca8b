"""DeepSeek-V4's lightning indexer in Triton: scores of each query against its sequence's compressed
indexer keys, then the top-k entries per query. Same semantics as
:func:`kernels.deepseek_v4_ref.indexer_topk_ref`.

1. Scores: one program per (token, split of its visible entries) holds the token's ``Hi x Di``
   queries and streams key tiles ``[BLOCK_E, Di]`` from the paged cache:
   ``score[e] = scale * sum_h w[h] * relu(q[h] . k[e])`` (the heads are the rows of ``tl.dot``).
   Only visible entries (``e < (p + 1) // R``) are written, to a float32 scratch ``[T, E]``.
2. Top-k: one program per token selects without sorting (a radix select): scores map to
   order-preserving uint32 keys, a 32-step bitwise search finds the key of the k-th largest score
   (each step counts the keys at or above a candidate), then one pass writes the entries above it
   and, in index order, as many ties as are still needed, compacted with prefix sums. Rows with
   fewer than ``k`` visible entries end in ``-1``. Order within a row is entry order.
No host synchronization; long batches are scored in token chunks so that the scratch stays under
``_SCRATCH_ELEMENTS``. Paged offsets are int64.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.triton_deepseek_v4_common import (BATCH_ARGS, batch_tensors, log_steps, next_power_of_2,
                                               token_bucket, token_position, token_sequence)
from kernels.triton_support import INTERPRET, exact_dot, autotune_configs, check_last_dim_contiguous, num_sms

_CONFIGS = [
    triton.Config({"BLOCK_E": 32}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_E": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_E": 64}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_E": 128}, num_warps=8, num_stages=2),
]
_SCRATCH_ELEMENTS = 1 << 28  # 1 GiB of float32 scores at most
#: Rows up to this many entries are selected in registers; longer ones in tiles of it.
_TOPK_TILE = 4096
_MIN_SPLIT_ENTRIES = 256


@triton.autotune(configs=autotune_configs(_CONFIGS, triton.Config({"BLOCK_E": 16}, num_warps=4,
                                                                  num_stages=1)),
                 key=["HEAD_DIM", "BLOCK_H", "PAGE", "NUM_SPLITS", "token_bucket"], cache_results=True)
@triton.jit(do_not_specialize=BATCH_ARGS)
def _indexer_scores_kernel(
    q_ptr, w_ptr, k_ptr, tables_ptr, query_start_loc_ptr, seq_lens_ptr, scores_ptr,
    t_base, num_seqs, log_b, num_heads, ratio, scale, token_bucket,
    stride_qt, stride_qh, stride_wt, stride_kb, stride_ke, stride_tab, stride_st,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, PAGE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, UPCAST: tl.constexpr, BLOCK_E: tl.constexpr,
):
    row = tl.program_id(0) // NUM_SPLITS  # scratch row
    split = tl.program_id(0) % NUM_SPLITS
    t = t_base + row
    seq = token_sequence(query_start_loc_ptr, t, num_seqs, log_b)
    visible = (token_position(query_start_loc_ptr, seq_lens_ptr, t, seq) + 1) // ratio
    part = tl.cdiv(tl.cdiv(visible, NUM_SPLITS), BLOCK_E) * BLOCK_E
    start = split * part
    end = tl.minimum(start + part, visible)

    t64 = t.to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + t64 * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    w = tl.load(w_ptr + t64 * stride_wt + heads, mask=h_mask, other=0.0).to(tl.float32)  # [BLOCK_H]
    table = tables_ptr + seq.to(tl.int64) * stride_tab
    out = scores_ptr + row.to(tl.int64) * stride_st
    for e0 in range(start, end, BLOCK_E):
        offs_e = e0 + tl.arange(0, BLOCK_E)
        e_mask = offs_e < end
        page = tl.load(table + offs_e // PAGE, mask=e_mask, other=0).to(tl.int64)
        rows = k_ptr + page * stride_kb + (offs_e % PAGE).to(tl.int64) * stride_ke
        k = tl.load(rows[:, None] + offs_d[None, :], mask=e_mask[:, None] & d_mask[None, :], other=0.0)
        s = exact_dot(q, tl.trans(k.to(q.dtype)))  # [BLOCK_H, BLOCK_E] float32
        score = tl.sum(tl.maximum(s, 0.0) * w[:, None], 0) * scale
        tl.store(out + offs_e, score, mask=e_mask)


@triton.jit
def _order_keys(x):
    """float32 -> uint32 keys in the same order (+0 and -0 equal)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = tl.where(x == 0.0, 0, bits)
    flip = tl.where((bits >> 31) == 1, 0xFFFFFFFF, 0x80000000).to(tl.uint32)
    return bits ^ flip


@triton.jit(do_not_specialize=BATCH_ARGS)
def _topk_kernel(scores_ptr, out_ptr, query_start_loc_ptr, seq_lens_ptr, t_base, num_seqs, log_b, ratio,
                 topk, stride_st, stride_ot, BLOCK: tl.constexpr, ONE_TILE: tl.constexpr):
    """``ONE_TILE``: every row fits one ``BLOCK`` (its keys stay in registers for all 32 steps)."""
    row = tl.program_id(0)
    t = t_base + row
    seq = token_sequence(query_start_loc_ptr, t, num_seqs, log_b)
    visible = (token_position(query_start_loc_ptr, seq_lens_ptr, t, seq) + 1) // ratio
    need = tl.minimum(topk, visible)
    scores = scores_ptr + row.to(tl.int64) * stride_st
    out = out_ptr + t.to(tl.int64) * stride_ot
    offs = tl.arange(0, BLOCK)

    # The largest key with at least `need` keys at or above it (the need-th largest), bit by bit.
    threshold = tl.zeros([], tl.uint32)
    bit = tl.full([], 0x80000000, tl.uint32)
    if ONE_TILE:
        mask = offs < visible
        keys = _order_keys(tl.load(scores + offs, mask=mask, other=0.0))
        for _ in range(32):
            candidate = threshold | bit
            count = tl.sum((mask & (keys >= candidate)).to(tl.int32), 0)
            threshold = tl.where(count >= need, candidate, threshold)
            bit = bit >> 1
        above = tl.sum((mask & (keys > threshold)).to(tl.int32), 0)
        tie = mask & (keys == threshold)
        picked = (mask & (keys > threshold)) | (tie & (tl.cumsum(tie.to(tl.int32), 0) <= need - above))
        tl.store(out + tl.cumsum(picked.to(tl.int32), 0) - 1, offs.to(tl.int64), mask=picked)
    else:
        for _ in range(32):
            candidate = threshold | bit
            count = tl.zeros([], tl.int32)
            for e0 in range(0, visible, BLOCK):
                mask = e0 + offs < visible
                keys = _order_keys(tl.load(scores + e0 + offs, mask=mask, other=0.0))
                count += tl.sum((mask & (keys >= candidate)).to(tl.int32), 0)
            threshold = tl.where(count >= need, candidate, threshold)
            bit = bit >> 1
        above = tl.zeros([], tl.int32)
        for e0 in range(0, visible, BLOCK):
            mask = e0 + offs < visible
            keys = _order_keys(tl.load(scores + e0 + offs, mask=mask, other=0.0))
            above += tl.sum((mask & (keys > threshold)).to(tl.int32), 0)
        written = tl.zeros([], tl.int32)
        ties = tl.zeros([], tl.int32)
        for e0 in range(0, visible, BLOCK):
            mask = e0 + offs < visible
            keys = _order_keys(tl.load(scores + e0 + offs, mask=mask, other=0.0))
            tie = mask & (keys == threshold)
            tie_rank = ties + tl.cumsum(tie.to(tl.int32), 0)  # 1-based among the row's ties
            picked = (mask & (keys > threshold)) | (tie & (tie_rank <= need - above))
            slot = written + tl.cumsum(picked.to(tl.int32), 0) - 1
            tl.store(out + slot, (e0 + offs).to(tl.int64), mask=picked)
            written += tl.sum(picked.to(tl.int32), 0)
            ties += tl.sum(tie.to(tl.int32), 0)
    for k0 in range(0, topk, BLOCK):  # slots [need, topk) hold no entry
        slots = k0 + offs
        tl.store(out + slots, tl.full([BLOCK], -1, tl.int64), mask=(slots >= need) & (slots < topk))


def _num_splits(num_tokens: int, max_entries: int, device: torch.device) -> int:
    wanted = math.ceil(2 * num_sms(device) / max(num_tokens, 1))
    return max(1, min(wanted, math.ceil(max_entries / _MIN_SPLIT_ENTRIES), 64))


def indexer_topk_triton(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                        index_tables: torch.Tensor, query_start_loc_cpu: list[int],
                        seq_lens_cpu: list[int], compress_ratio: int, topk: int, scale: float, *,
                        query_start_loc: torch.Tensor | None = None,
                        seq_lens: torch.Tensor | None = None) -> torch.Tensor:
    """``q [T, Hi, Di]``, ``weights [T, Hi]`` over the paged ``index_cache [num_blocks,
    entries_per_block, Di]`` -> ``[T, topk]`` int64 entry indices, ``-1`` where a query sees fewer
    than ``topk`` entries. Same semantics as :func:`kernels.deepseek_v4_ref.indexer_topk_ref`
    (among equal scores, the lower entries are picked). ``query_start_loc``/``seq_lens``: device
    copies of the lists (saves a host-to-device copy)."""
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("index_cache", index_cache)
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty((num_tokens, topk), dtype=torch.int64, device=q.device)
    num_seqs = len(seq_lens_cpu)
    if num_tokens == 0 or num_seqs == 0 or topk == 0:
        return out
    qsl, lens = batch_tensors(q.device, query_start_loc_cpu, seq_lens_cpu, query_start_loc, seq_lens)
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()
    max_entries = max(max(seq_lens_cpu) // compress_ratio, 1)
    chunk = max(1, min(num_tokens, _SCRATCH_ELEMENTS // max_entries))
    scores = torch.empty((chunk, max_entries), dtype=torch.float32, device=q.device)
    splits = _num_splits(chunk, max_entries, q.device)
    log_b = log_steps(num_seqs)
    topk_block = min(_TOPK_TILE, next_power_of_2(max(max_entries, topk, 16)))
    for t_base in range(0, num_tokens, chunk):
        rows = min(chunk, num_tokens - t_base)
        _indexer_scores_kernel[(rows * splits,)](
            q, weights, index_cache, index_tables, qsl, lens, scores,
            t_base, num_seqs, log_b, num_heads, compress_ratio, scale, token_bucket(rows),
            q.stride(0), q.stride(1), weights.stride(0), index_cache.stride(0),
            index_cache.stride(1), index_tables.stride(0), scores.stride(0),
            HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim),
            BLOCK_H=max(16, next_power_of_2(num_heads)), PAGE=index_cache.shape[1],
            NUM_SPLITS=splits, UPCAST=INTERPRET,
        )
        _topk_kernel[(rows,)](
            scores, out, qsl, lens, t_base, num_seqs, log_b, compress_ratio, topk, scores.stride(0),
            out.stride(0), BLOCK=topk_block, ONE_TILE=max_entries <= topk_block,
            num_warps=4 if topk_block <= 1024 else 8,
        )
    return out
