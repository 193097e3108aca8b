"""Triton paged attention and KV-cache writes against the pure-torch references: GQA ratios,
shuffled block tables, strided per-layer cache views, varlen batches mixing cached prefixes,
prefill chunks and decode rows, sliding windows, split-KV decode, padding slots."""
from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from kernels.attention import PagedAttentionMetadata, paged_attention_ref, write_kv_cache
from kernels.triton_attention import paged_attention_triton, write_kv_cache_triton
from kernels.triton_attention_decode import paged_decode_attention
from kernels.triton_attention_prefill import _wide_offset
from tests.kernels.paged import make_kv_storage, make_paged_batch, poisoned_like

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def _tol(dtype: torch.dtype) -> float:
    if dtype == torch.float32:
        return 5e-3 if ON_GPU else 1e-4  # tf32 dots on GPU
    return 3e-2


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any(), "kernel left unwritten (NaN) outputs"
    err = (out.float() - ref.float()).norm() / ref.float().norm()
    assert err < _tol(dtype), f"relative error {err:.2e}"


def _run(batch, scale: float, window: int | None, dtype: torch.dtype) -> None:
    ref = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, window)
    out = paged_attention_triton(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, window,
                                 out=poisoned_like(batch.q))
    _check(out, ref, dtype)


MIXED = [(37, 37), (50, 13), (9, 1), (70, 5), (33, 1), (16, 16)]  # (seq_len, q_len)


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_mixed_batch(num_q_heads: int, num_kv_heads: int, dtype: torch.dtype) -> None:
    batch = make_paged_batch(MIXED, num_q_heads, num_kv_heads, head_dim=32, block_size=8,
                             dtype=dtype, device=DEVICE)
    _run(batch, 32 ** -0.5, None, dtype)


@pytest.mark.parametrize("window", [1, 7, 20])
def test_prefill_sliding_window(window: int) -> None:
    batch = make_paged_batch(MIXED, 4, 2, head_dim=32, block_size=8, device=DEVICE, seed=1)
    _run(batch, 0.2, window, torch.float32)


def test_prefill_odd_head_dim_and_block_size() -> None:
    batch = make_paged_batch([(45, 20), (6, 3)], 6, 2, head_dim=24, block_size=5, device=DEVICE,
                             seed=2)
    _run(batch, 24 ** -0.5, None, torch.float32)


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (8, 2), (16, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode(num_q_heads: int, num_kv_heads: int, dtype: torch.dtype) -> None:
    seqs = [(70, 1), (1, 1), (33, 1), (128, 1)]
    batch = make_paged_batch(seqs, num_q_heads, num_kv_heads, head_dim=32, block_size=16,
                             dtype=dtype, device=DEVICE, seed=3)
    assert batch.meta.decode_only
    _run(batch, 32 ** -0.5, None, dtype)


@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("window", [None, 10])
def test_decode_splits(num_splits: int, window: int | None) -> None:
    seqs = [(90, 1), (2, 1), (47, 1)]
    batch = make_paged_batch(seqs, 4, 2, head_dim=16, block_size=4, device=DEVICE, seed=4)
    meta = batch.meta
    ref = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, meta, 0.3, window)
    out = paged_decode_attention(batch.q, batch.k_cache, batch.v_cache, meta.block_tables,
                                 meta.seq_lens, meta.max_seq_len, 0.3, window,
                                 num_splits=num_splits, out=poisoned_like(batch.q))
    _check(out, ref, torch.float32)


def test_decode_merge_tickets_reset_for_the_next_launch() -> None:
    """The last split of each (sequence, KV head) merges in the same launch and puts its ticket
    counter back to zero: repeated launches (graph replays) give the same, right output."""
    from kernels.triton_attention_decode import _TICKETS
    batch = make_paged_batch([(61, 1), (9, 1), (130, 1)], 6, 3, head_dim=16, block_size=8, device=DEVICE,
                             seed=9)
    meta = batch.meta
    ref = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, meta, 0.2)
    outs = [paged_decode_attention(batch.q, batch.k_cache, batch.v_cache, meta.block_tables, meta.seq_lens,
                                   meta.max_seq_len, 0.2, num_splits=5, out=poisoned_like(batch.q))
            for _ in range(3)]
    for out in outs:
        _check(out, ref, torch.float32)
    assert int(_TICKETS[batch.q.device].count_nonzero()) == 0


def test_decode_split_count_fixed_while_context_grows() -> None:
    """A launch shape captured at a short context (CUDA graphs) stays right at a longer one."""
    batch = make_paged_batch([(200, 1), (150, 1)], 4, 1, head_dim=16, block_size=16, device=DEVICE,
                             seed=5)
    meta = batch.meta
    ref = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, meta, 0.25)
    out = paged_decode_attention(batch.q, batch.k_cache, batch.v_cache, meta.block_tables,
                                 meta.seq_lens, max_seq_len=20, scale=0.25, num_splits=2)
    _check(out, ref, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache(dtype: torch.dtype) -> None:
    torch.manual_seed(6)
    block_size, hkv, d = 4, 3, 24
    storage, k_cache, v_cache = make_kv_storage(9, block_size, hkv, d, dtype, DEVICE)
    ref_storage = storage.clone()
    ref_k, ref_v = ref_storage[:, 1, 0], ref_storage[:, 1, 1]
    slots = torch.tensor([33, 2, -1, 17, 35, -1, 0], dtype=torch.int64, device=DEVICE)
    kv = torch.randn(len(slots), 2, hkv, d, device=DEVICE).to(dtype)
    k, v = kv[:, 0], kv[:, 1]  # strided views, as a fused projection's output would be
    write_kv_cache(ref_k, ref_v, slots, k, v)
    write_kv_cache_triton(k_cache, v_cache, slots, k, v)
    torch.testing.assert_close(storage, ref_storage, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (the cache must exceed 2**31 elements)")
def test_slot_math_is_int64() -> None:
    """Element offsets past 2**31 must not wrap, in the write and in both attention kernels."""
    block_size, hkv, d = 16, 1, 16
    big_block = (2**31) // (block_size * hkv * d) + 3  # the element offset exceeds int32
    num_blocks = big_block + 1
    k_cache = torch.zeros(num_blocks, block_size, hkv, d, dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(1, hkv, d, device=DEVICE).to(torch.bfloat16)
    slots = torch.tensor([big_block * block_size + 5], dtype=torch.int64, device=DEVICE)
    write_kv_cache_triton(k_cache, v_cache, slots, k, -k)
    assert torch.equal(k_cache[big_block, 5], k[0]) and torch.equal(v_cache[big_block, 5], -k[0])
    k_cache[big_block].normal_()
    v_cache[big_block].normal_()
    for q_len in (1, 6):
        meta = PagedAttentionMetadata(
            query_start_loc=torch.tensor([0, q_len], dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor([12], dtype=torch.int32, device=DEVICE),
            block_tables=torch.tensor([[big_block]], dtype=torch.int32, device=DEVICE),
            slot_mapping=slots, query_start_loc_cpu=[0, q_len], seq_lens_cpu=[12],
            max_query_len=q_len, max_seq_len=12)
        q = torch.randn(q_len, 2, d, device=DEVICE).to(torch.bfloat16)
        ref = paged_attention_ref(q, k_cache, v_cache, meta, 0.25)
        _check(paged_attention_triton(q, k_cache, v_cache, meta, 0.25), ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("decode", [True, False])
def test_gpu_real_shapes(decode: bool) -> None:
    seqs = [(4096, 1)] * 8 if decode else [(2048, 2048), (3000, 700), (513, 1)]
    batch = make_paged_batch(seqs, 32, 8, head_dim=128, block_size=16, dtype=torch.bfloat16,
                             device="cuda", seed=7)
    _run(batch, 1 / math.sqrt(128), None, torch.bfloat16)
    _run(batch, 1 / math.sqrt(128), 1024, torch.bfloat16)


@triton.jit
def _wide_offset_kernel(index_ptr, out_ptr, stride, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, _wide_offset(tl.load(index_ptr + offs), stride))


@pytest.mark.parametrize("stride", [1, 48, 2**31 - 1, 2**31 + 5])
def test_wide_offset_is_exact_past_int32(stride: int) -> None:
    """Paged row offsets: non-negative int32 page ids times int32 (or int64) strides, exact as
    int64 far past 2**31."""
    index = torch.tensor([0, 1, 7, 2**20 + 3, 2**31 - 1, 12345, 2**30, 99], dtype=torch.int32,
                         device=DEVICE)
    out = torch.full((8,), -1, dtype=torch.int64, device=DEVICE)
    _wide_offset_kernel[(1,)](index, out, stride, BLOCK=8)
    assert out.tolist() == [i * stride for i in index.tolist()]
