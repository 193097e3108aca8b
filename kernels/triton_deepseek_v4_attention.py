"""DeepSeek-V4 sparse attention in Triton: each query attends its sliding window of token entries
plus compressed entries (the indexer's top-k picks, or every visible one), single shared K = V head,
attention sinks. Same semantics as :func:`kernels.deepseek_v4_ref.sparse_attention_ref`.

One program per (token, block of ``BLOCK_H`` heads, split): MQA puts the heads in the rows of
``tl.dot``, so every K = V tile ``[BLOCK_N, D]`` loaded from the paged caches serves both products
(``q @ k.T`` and ``p @ v``) for all the program's heads. A query's entries form one virtual list:
its window positions ``(p - window, p]`` (from ``min_position`` on) first (paged token cache), then its compressed entries
(entry ``topk[t, j]``, ``-1`` skipped, or entry ``j``, from the paged compressed cache). Decode
batches split that list across programs (split-KV) and a second kernel merges the partial results
(base-2 log-sum-exp) and adds the sink; with one split the first kernel finishes alone. Prefill and
mixed batches run the same kernel: the grid is flat over tokens, so it does not depend on the
batch's sequence lengths. Paged offsets are int64. A tile's query block and its staged K = V
tiles must fit the device's shared memory: the autotuner never tries those that do not (on sm_120,
99 KB: at most ``64 x 512`` queries and two stages of ``16 x 512`` entries in bf16).
"""
from __future__ import annotations

import math
from typing import cast

import torch
import triton
import triton.language as tl

from kernels.triton_deepseek_v4_common import (BATCH_ARGS, LOG2E, batch_tensors, log_steps, next_power_of_2,
                                               token_bucket,
                                               token_position, token_sequence)
from kernels.triton_support import (INTERPRET, autotune_configs, check_last_dim_contiguous, exact_dot, num_sms,
                                   shared_memory_per_block, staged_tile_bytes)

#: Tiles that fit every supported GPU (sm_120 included).
_PORTABLE_TILES = [
    triton.Config({"BLOCK_H": 16, "BLOCK_N": 32}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_H": 16, "BLOCK_N": 64}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_H": 16, "BLOCK_N": 32}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_H": 32, "BLOCK_N": 32}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_H": 64, "BLOCK_N": 16}, num_warps=8, num_stages=2),
]
#: Prefill tiles (all 64 heads of a token, 32-64 entries a step): 26% / 22% faster than the tiles
#: above on an 8k V4-Flash prompt's CSA / sliding layer on the H200 when swept alone
#: (bench/results/v4-prefill-profile-h200-2026-12-06.json), over sm_120's 99 KB (pruned there).
PREFILL_TILES = [
    triton.Config({"BLOCK_H": 64, "BLOCK_N": 32}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_H": 32, "BLOCK_N": 64}, num_warps=8, num_stages=2),
]
_CONFIGS = _PORTABLE_TILES + PREFILL_TILES
#: Shared memory a tile uses beyond its query and K = V tiles (compiled for sm_90 / sm_120: 1-4 KB).
_SHARED_SLACK = 4096
#: Each split takes at least this many entries (decode); at most this many splits.
_MIN_SPLIT_ENTRIES = 64
_MAX_SPLITS = 16


def shared_memory_estimate(config: triton.Config, block_d: int, element_bytes: int) -> int:
    """Shared memory of a config: the query tile, the staged K = V tiles and some slack (the
    compiled sm_90 / sm_120 kernels of the listed configs use 49-100 KB, within 4 KB of this)."""
    h, n = config.kwargs["BLOCK_H"], config.kwargs["BLOCK_N"]
    return element_bytes * block_d * h + staged_tile_bytes(config, element_bytes * block_d * n) + _SHARED_SLACK


def _prune(configs: list[triton.Config], named_args: dict, **kwargs: object) -> list[triton.Config]:
    """Head blocks no wider than needed: for few heads, the smallest ``BLOCK_H`` only. Configs
    over the device's shared memory per block (99 KB on sm_120) are never tried."""
    heads = int(named_args.get("num_heads", 64))
    q = named_args.get("q_ptr")
    element_bytes = q.element_size() if isinstance(q, torch.Tensor) else 2
    block_d = int(cast(int, kwargs.get("BLOCK_D", 512)))
    limit = shared_memory_per_block()
    kept = [c for c in configs if c.kwargs["BLOCK_H"] <= max(16, next_power_of_2(heads))
            and shared_memory_estimate(c, block_d, element_bytes) <= limit]
    return kept or configs[:1]


@triton.jit
def _fold_tile(acc, l_i, m_i, q, kv_ptrs, n_mask, offs_d, d_mask, qk_scale, UPCAST: tl.constexpr):
    """Fold one K = V tile (rows ``kv_ptrs [BLOCK_N]``, masked by ``n_mask``) into the running
    softmax state of the program's heads."""
    kv = tl.load(kv_ptrs[:, None] + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    kv = kv.to(q.dtype)  # [BLOCK_N, BLOCK_D]; the reference computes in q's dtype too
    qk = exact_dot(q, tl.trans(kv)) * qk_scale  # [BLOCK_H, BLOCK_N], log2 domain
    qk = tl.where(n_mask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + exact_dot(p.to(kv.dtype), kv)
    return acc, l_i, m_new


@triton.autotune(
    configs=autotune_configs(_CONFIGS, triton.Config({"BLOCK_H": 16, "BLOCK_N": 16}, num_warps=4,
                                                     num_stages=1)),
    key=["num_heads", "HEAD_DIM", "WIN_PAGE", "COMP_PAGE", "HAS_COMP", "HAS_TOPK", "NUM_SPLITS", "token_bucket"],
    prune_configs_by={"early_config_prune": _prune}, cache_results=True,
)
@triton.jit(do_not_specialize=[a for a in BATCH_ARGS if a != "t_base"])
def _sparse_attention_kernel(
    q_ptr, win_ptr, win_tables_ptr, comp_ptr, comp_tables_ptr, topk_ptr, sinks_ptr,
    query_start_loc_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    num_seqs, log_b, num_heads, window, min_pos, ratio, num_picks, qk_scale, token_bucket,
    stride_qt, stride_qh, stride_wb, stride_wt, stride_wtab, stride_cb, stride_ce, stride_ctab,
    stride_kt, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, WIN_PAGE: tl.constexpr, COMP_PAGE: tl.constexpr,
    HAS_COMP: tl.constexpr, HAS_TOPK: tl.constexpr, NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Programs of one token are adjacent, so its entries are read from L2 by all but the first.
    pid = tl.program_id(0)
    per_token = tl.cdiv(num_heads, BLOCK_H) * NUM_SPLITS
    t = pid // per_token
    head_block = (pid % per_token) // NUM_SPLITS
    split = pid % NUM_SPLITS
    seq = token_sequence(query_start_loc_ptr, t, num_seqs, log_b)
    pos = token_position(query_start_loc_ptr, seq_lens_ptr, t, seq)
    seq64, t64 = seq.to(tl.int64), t.to(tl.int64)

    n_win = tl.maximum(tl.minimum(window, pos + 1 - min_pos), 0)
    win_lo = pos + 1 - n_win  # first window position (>= min_pos)
    n_comp = 0
    if HAS_COMP:
        n_comp = (pos + 1) // ratio  # the query's visible compressed entries
        if HAS_TOPK:
            # Picks are distinct and their -1 padding comes last (as the indexer writes them),
            # so a query's valid picks are within its first min(k, visible) slots: the rest
            # (three quarters of them for a CSA query at 512 tokens of context, 512 picks of 128
            # entries) are neither loaded nor folded, and their splits are not launched work.
            n_comp = tl.minimum(num_picks, n_comp)
    total = n_win + n_comp
    part = tl.cdiv(tl.cdiv(total, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * part
    end = tl.minimum(start + part, total)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + t64 * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)

    win_table = win_tables_ptr + seq64 * stride_wtab
    win_end = tl.minimum(end, n_win)
    for n0 in range(start, win_end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs < win_end
        token = win_lo + offs
        page = tl.load(win_table + token // WIN_PAGE, mask=n_mask, other=0).to(tl.int64)
        rows = win_ptr + page * stride_wb + (token % WIN_PAGE).to(tl.int64) * stride_wt
        acc, l_i, m_i = _fold_tile(acc, l_i, m_i, q, rows, n_mask, offs_d, d_mask, qk_scale, UPCAST)
    if HAS_COMP:
        comp_table = comp_tables_ptr + seq64 * stride_ctab
        for n0 in range(tl.maximum(start, n_win), end, BLOCK_N):
            offs = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs < end
            entry = offs - n_win
            if HAS_TOPK:
                entry = tl.load(topk_ptr + t64 * stride_kt + entry, mask=n_mask, other=-1)
                n_mask &= entry >= 0
            page = tl.load(comp_table + entry // COMP_PAGE, mask=n_mask, other=0).to(tl.int64)
            rows = comp_ptr + page * stride_cb + (entry % COMP_PAGE).to(tl.int64) * stride_ce
            acc, l_i, m_i = _fold_tile(acc, l_i, m_i, q, rows, n_mask, offs_d, d_mask, qk_scale,
                                       UPCAST)

    if NUM_SPLITS == 1:
        sink = tl.load(sinks_ptr + heads, mask=h_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        m_fin = tl.maximum(m_i, sink)
        keep = tl.exp2(m_i - m_fin)
        out = acc * (keep / (l_i * keep + tl.exp2(sink - m_fin)))[:, None]
        tl.store(out_ptr + t64 * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        row = (t64 * num_heads + heads) * NUM_SPLITS + split  # [BLOCK_H]
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc / l_safe[:, None],
                 mask=h_mask[:, None] & d_mask[None, :])
        tl.store(part_lse_ptr + row, tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe)),
                 mask=h_mask)


@triton.jit
def _merge_kernel(part_out_ptr, part_lse_ptr, sinks_ptr, out_ptr, num_heads, stride_ot, stride_oh,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                  BLOCK_S: tl.constexpr):
    """Combine one (token, head)'s split partials and its sink into the output."""
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    row = (t * num_heads + head) * NUM_SPLITS + offs_s  # [BLOCK_S]
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
    m = tl.maximum(tl.max(lse, 0), sink)
    w = tl.exp2(lse - m)  # empty splits: lse = -inf, weight 0
    parts = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=s_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    out = tl.sum(parts * w[:, None], 0) / (tl.sum(w, 0) + tl.exp2(sink - m))
    tl.store(out_ptr + t * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=d_mask)


def sparse_attention_num_splits(num_tokens: int, num_heads: int, max_entries: int,
                                device: torch.device) -> int:
    """Splits per (token, head block): enough programs for two waves over the GPU, each split
    at least ``_MIN_SPLIT_ENTRIES`` entries long. One for prefill-sized batches."""
    programs = num_tokens * math.ceil(num_heads / 16)
    wanted = math.ceil(2 * num_sms(device) / max(programs, 1))
    return max(1, min(wanted, math.ceil(max_entries / _MIN_SPLIT_ENTRIES), _MAX_SPLITS))


def _max_entries(seq_lens_cpu: list[int], window: int, ratio: int, picks: int | None,
                 has_comp: bool) -> int:
    longest = max(seq_lens_cpu, default=0)
    comp = 0 if not has_comp else picks if picks is not None else longest // max(ratio, 1)
    return min(window, longest) + comp


def sparse_attention_triton(q: torch.Tensor, window_cache: torch.Tensor, window_tables: torch.Tensor,
                            compressed_cache: torch.Tensor | None, compressed_tables: torch.Tensor | None,
                            topk_indices: torch.Tensor | None, sinks: torch.Tensor,
                            query_start_loc_cpu: list[int], seq_lens_cpu: list[int], window: int,
                            compress_ratio: int, scale: float, *,
                            query_start_loc: torch.Tensor | None = None,
                            seq_lens: torch.Tensor | None = None, min_position: int = 0,
                            num_splits: int | None = None) -> torch.Tensor:
    """``q [T, H, D]`` over paged ``window_cache [num_blocks, block_size, D]`` (and
    ``compressed_cache [num_blocks, entries_per_block, D]``) -> ``[T, H, D]`` in ``q``'s dtype.
    Same semantics as :func:`kernels.deepseek_v4_ref.sparse_attention_ref` (picks in
    ``topk_indices [T, k]`` are distinct; ``-1`` skipped) for picks whose ``-1`` padding is last,
    as :func:`kernels.triton_deepseek_v4_indexer.indexer_topk_triton` writes them: a query reads
    only its first ``min(k, (position + 1) // ratio)`` picks (it sees no more entries than that). ``query_start_loc``/``seq_lens``: device
    copies of the lists (saves a host-to-device copy). ``num_splits`` defaults to
    :func:`sparse_attention_num_splits`."""
    for name, t in (("q", q), ("window_cache", window_cache), ("compressed_cache", compressed_cache)):
        if t is not None:
            check_last_dim_contiguous(name, t)
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    num_seqs = len(seq_lens_cpu)
    if num_tokens == 0 or num_seqs == 0:
        return out
    # Absent tensors are replaced by present ones the kernel never reads.
    has_comp = compressed_cache is not None and compressed_tables is not None
    comp = compressed_cache if compressed_cache is not None and has_comp else window_cache
    comp_tables = compressed_tables if compressed_tables is not None and has_comp else window_tables
    has_topk = has_comp and topk_indices is not None
    topk = topk_indices.contiguous() if topk_indices is not None and has_topk else window_tables
    qsl, lens = batch_tensors(q.device, query_start_loc_cpu, seq_lens_cpu, query_start_loc, seq_lens)
    if num_splits is None:
        entries = _max_entries(seq_lens_cpu, window, compress_ratio, topk.shape[1] if has_topk else None, has_comp)
        num_splits = sparse_attention_num_splits(num_tokens, num_heads, entries, q.device)
    part_shape = (num_tokens, num_heads, num_splits)
    part_out = torch.empty((*part_shape, head_dim) if num_splits > 1 else (1,), dtype=torch.float32,
                           device=q.device)
    part_lse = torch.empty(part_shape if num_splits > 1 else (1,), dtype=torch.float32, device=q.device)

    def grid(meta: dict[str, int]) -> tuple[int]:
        return (num_tokens * triton.cdiv(num_heads, meta["BLOCK_H"]) * num_splits,)

    _sparse_attention_kernel[grid](
        q, window_cache, window_tables, comp, comp_tables, topk, sinks, qsl, lens, out, part_out,
        part_lse, num_seqs, log_steps(num_seqs), num_heads, window, min_position, max(compress_ratio, 1),
        topk.shape[1] if has_topk else 0, scale * LOG2E, token_bucket(num_tokens),
        q.stride(0), q.stride(1), window_cache.stride(0), window_cache.stride(1),
        window_tables.stride(0), comp.stride(0), comp.stride(1), comp_tables.stride(0),
        topk.stride(0), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim), WIN_PAGE=window_cache.shape[1],
        COMP_PAGE=comp.shape[1], HAS_COMP=has_comp, HAS_TOPK=has_topk, NUM_SPLITS=num_splits,
        UPCAST=INTERPRET,
    )
    if num_splits > 1:
        _merge_kernel[(num_tokens, num_heads)](
            part_out, part_lse, sinks, out, num_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim), NUM_SPLITS=num_splits,
            BLOCK_S=next_power_of_2(num_splits), num_warps=4,
        )
    return out
