"""Paged attention in Triton: the public entry points with the reference's semantics
(``kernels.attention``), and the KV-cache write.

``paged_attention_triton`` takes the decode kernel for decode-only batches (one query token per
sequence) and the prefill/extend kernel for everything else, including batches that mix decode
rows with prefill chunks.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention import PagedAttentionMetadata
from kernels.triton_attention_decode import paged_decode_attention
from kernels.triton_attention_prefill import paged_prefill_attention
from kernels.triton_support import check_last_dim_contiguous


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: PagedAttentionMetadata, scale: float,
                           sliding_window: int | None = None, *,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal GQA attention of ``q [T, Hq, D]`` over each sequence's paged KV; returns
    ``[T, Hq, D]`` (into ``out`` if given). Same semantics as
    :func:`kernels.attention.paged_attention_ref`."""
    if meta.decode_only:
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                      meta.max_seq_len, scale, sliding_window, out=out)
    return paged_prefill_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
                                   meta.block_tables, meta.max_query_len, scale, sliding_window,
                                   out=out)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    page = slot // PAGE_SIZE
    in_page = slot % PAGE_SIZE
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (slot >= 0) & (heads < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = k_cache_ptr + page * stride_kcb + in_page * stride_kct
    v_dst = v_cache_ptr + page * stride_vcb + in_page * stride_vct
    tl.store(k_dst + heads[:, None] * stride_kch + offs_d[None, :],
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst + heads[:, None] * stride_vch + offs_d[None, :],
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          k: torch.Tensor, v: torch.Tensor) -> None:
    """Scatter new keys/values ``[T, Hkv, D]`` into their slots (``slot_mapping [T]`` int64,
    slot = block * block_size + offset); slots < 0 are skipped. Same semantics as
    :func:`kernels.attention.write_kv_cache`, with no host synchronization."""
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(name, t)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    block_h = max(1, min(triton.next_power_of_2(num_kv_heads), 4096 // block_d))
    _write_kv_kernel[(num_tokens, triton.cdiv(num_kv_heads, block_h))](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=k_cache.shape[1],
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4,
    )
