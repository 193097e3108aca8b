"""DeepSeek-V4 Triton kernels (sparse attention over window + compressed entries + sinks, the
lightning indexer's scores and top-k) against the pure-torch references on random inputs: varlen
batches mixing prefill chunks, decode rows and an empty sequence, shuffled block tables whose
entries behind the window point nowhere, strided per-layer cache views, split-KV decode, outputs
and scratch poisoned, NaN-checked. Tiny shapes under the interpreter on CPU; real V4-Flash shapes
on a GPU (marked ``gpu``)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kernels.deepseek_v4_ref import indexer_topk_ref, sparse_attention_ref
from kernels import triton_deepseek_v4_indexer as indexer
from kernels.triton_deepseek_v4_attention import sparse_attention_triton
from kernels.triton_deepseek_v4_indexer import indexer_topk_triton
from tests.kernels.poison import poisoned_allocations

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
FREED = 10**6  # block-table entry of a block the window left behind: reading it faults

MIXED = [(37, 37), (50, 13), (0, 0), (9, 1), (70, 1), (33, 1), (16, 16)]  # (seq_len, q_len)
DECODE = [(70, 1), (1, 1), (33, 1), (128, 1), (9, 1)]
SHORT = [(21, 21), (30, 6), (0, 0), (9, 1), (41, 1)]  # the indexer's select is slow to interpret


@dataclass
class V4Batch:
    q: torch.Tensor  # [T, H, D]
    window_cache: torch.Tensor  # [num_blocks, block_size, D], a strided per-layer view
    window_tables: torch.Tensor  # [B, max_blocks]
    comp_cache: torch.Tensor  # [num_blocks, entries_per_block, D]
    comp_tables: torch.Tensor
    index_q: torch.Tensor  # [T, Hi, Di]
    index_weights: torch.Tensor  # [T, Hi] float32
    index_cache: torch.Tensor  # [num_blocks, entries_per_block, Di]
    index_tables: torch.Tensor
    query_start_loc: list[int]
    seq_lens: list[int]

    def positions(self) -> torch.Tensor:
        return torch.cat([torch.arange(s - (self.query_start_loc[i + 1] - self.query_start_loc[i]), s)
                          for i, s in enumerate(self.seq_lens)])


def _paged(num_entries: list[int], per_block: int, width: int, dtype: torch.dtype, gen: torch.Generator,
           first_needed: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A two-layer storage (layer 1 returned as a view) and shuffled tables; entries before
    ``first_needed[i]``'s block point at block FREED."""
    blocks = [-(-n // per_block) for n in num_entries]
    total = sum(blocks) + 3
    storage = torch.randn(total, 2, per_block, width, generator=gen).to(dtype)
    order = torch.randperm(total, generator=gen)
    tables = torch.zeros(len(blocks), max(blocks + [1]) + 1, dtype=torch.int32)
    tables[:, -1] = FREED
    used = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = order[used:used + n].to(torch.int32)
        used += n
        if first_needed is not None:
            tables[i, :first_needed[i] // per_block] = FREED
    return storage.to(DEVICE)[:, 1], tables.to(DEVICE)


def make_v4_batch(seqs: list[tuple[int, int]], heads: int = 4, dim: int = 32, window: int = 5, ratio: int = 2,
                  block_size: int = 4, entries_per_block: int = 3, index_heads: int = 3, index_dim: int = 16,
                  dtype: torch.dtype = torch.float32, seed: int = 0) -> V4Batch:
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [s for s, _ in seqs]
    qsl = [0]
    for _, q_len in seqs:
        qsl.append(qsl[-1] + q_len)
    first = [max(0, s - q - window + 1) for s, q in seqs]
    window_cache, window_tables = _paged(seq_lens, block_size, dim, dtype, gen, first)
    comp_cache, comp_tables = _paged([s // ratio for s in seq_lens], entries_per_block, dim, dtype, gen)
    index_cache, index_tables = _paged([s // ratio for s in seq_lens], entries_per_block, index_dim, dtype, gen)
    t = qsl[-1]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(DEVICE)

    return V4Batch(rand(t, heads, dim).to(dtype), window_cache, window_tables, comp_cache, comp_tables,
                   rand(t, index_heads, index_dim).to(dtype), rand(t, index_heads), index_cache, index_tables,
                   qsl, seq_lens)


def random_picks(batch: V4Batch, ratio: int, topk: int, seed: int = 1) -> torch.Tensor:
    """Distinct visible entries per query in any order (fewer where fewer are visible), then
    ``-1`` padding, as both indexers write them."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for p in batch.positions().tolist():
        visible = (p + 1) // ratio
        picks = torch.randperm(visible, generator=gen)[:topk]
        rows.append(torch.cat([picks, torch.full((topk - len(picks),), -1)]))
    return torch.stack(rows).to(DEVICE) if rows else torch.empty(0, topk, dtype=torch.int64, device=DEVICE)


def _check(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any(), "kernel left unwritten (NaN) outputs"
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < tol, f"relative error {err:.2e}"


def _tol(dtype: torch.dtype) -> float:
    return 3e-2 if dtype == torch.bfloat16 else (5e-3 if ON_GPU else 1e-4)


def _attention(batch: V4Batch, mode: str, window: int, ratio: int, sinks: torch.Tensor, topk: int = 4,
               num_splits: int | None = None, min_position: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    comp = mode != "sliding"
    picks = random_picks(batch, ratio, topk) if mode == "topk" else None
    args = (batch.q, batch.window_cache, batch.window_tables, batch.comp_cache if comp else None,
            batch.comp_tables if comp else None, picks, sinks, batch.query_start_loc, batch.seq_lens, window,
            ratio, batch.q.shape[-1] ** -0.5)
    ref = sparse_attention_ref(*args, min_position=min_position)
    with poisoned_allocations():
        out = sparse_attention_triton(*args, num_splits=num_splits, min_position=min_position)
    return out, ref


@pytest.mark.parametrize("mode", ["sliding", "topk", "all_visible"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_attention_mixed_batch(mode: str, dtype: torch.dtype) -> None:
    batch = make_v4_batch(MIXED, dtype=dtype)
    sinks = torch.randn(4, device=DEVICE)
    out, ref = _attention(batch, mode, window=5, ratio=2, sinks=sinks)
    _check(out, ref, _tol(dtype))


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("mode", ["topk", "all_visible"])
def test_sparse_attention_decode_splits(num_splits: int, mode: str) -> None:
    batch = make_v4_batch(DECODE, heads=6, window=7, ratio=4, entries_per_block=2, seed=2)
    sinks = 2 * torch.randn(6, device=DEVICE)
    out, ref = _attention(batch, mode, window=7, ratio=4, sinks=sinks, topk=6, num_splits=num_splits)
    _check(out, ref, _tol(torch.float32))


@pytest.mark.parametrize("num_splits", [1, 4])
def test_sparse_attention_tiles_of_skipped_picks(num_splits: int) -> None:
    """The indexer pads a short context's picks with ``-1`` at the end: whole tiles (and whole
    splits) of skipped picks fold nothing, and a row with no pick at all keeps its window only."""
    batch = make_v4_batch(DECODE, heads=4, window=3, ratio=4, entries_per_block=2, seed=5)
    topk = 64  # more than any row's visible entries (at most 128 // 4 = 32)
    rows = []
    for p in batch.positions().tolist():
        visible = (p + 1) // 4
        picks = torch.randperm(visible, generator=torch.Generator().manual_seed(p))[:topk]
        rows.append(torch.cat([picks, torch.full((topk - len(picks),), -1)]))
    picks = torch.stack(rows).to(DEVICE)
    assert (picks[:, 32:] == -1).all() and (picks[1] == -1).all()
    sinks = torch.randn(4, device=DEVICE)
    args = (batch.q, batch.window_cache, batch.window_tables, batch.comp_cache, batch.comp_tables, picks, sinks,
            batch.query_start_loc, batch.seq_lens, 3, 4, batch.q.shape[-1] ** -0.5)
    ref = sparse_attention_ref(*args)
    with poisoned_allocations():
        out = sparse_attention_triton(*args, num_splits=num_splits)
    _check(out, ref, _tol(torch.float32))


def test_sparse_attention_window_one_and_dominant_sinks() -> None:
    """Window 1 (a query sees only itself), more picks than visible entries, sinks that take most
    of the probability."""
    batch = make_v4_batch([(12, 12), (30, 1)], heads=2, window=1, ratio=3, seed=3)
    out, ref = _attention(batch, "topk", window=1, ratio=3, sinks=torch.tensor([4.0, -1.0], device=DEVICE),
                          topk=16)
    _check(out, ref, _tol(torch.float32))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_sparse_attention_from_a_first_position(num_splits: int) -> None:
    """``min_position=1`` (an MTP layer: its entry 0 has no target state before it): entry 0 is
    never attended, and a query at position 0 sees nothing but its sink (output zero)."""
    batch = make_v4_batch([(1, 1), (4, 4), (9, 1), (30, 1)], heads=4, window=6, ratio=2, seed=5)
    sinks = torch.randn(4, device=DEVICE)
    out, ref = _attention(batch, "sliding", window=6, ratio=2, sinks=sinks, num_splits=num_splits, min_position=1)
    _check(out, ref, _tol(torch.float32))
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(ref[0], torch.zeros_like(ref[0]))
    shifted = sparse_attention_ref(batch.q, batch.window_cache, batch.window_tables, None, None, None, sinks,
                                   batch.query_start_loc, batch.seq_lens, 6, 2, batch.q.shape[-1] ** -0.5)
    assert not torch.allclose(shifted[1:5], ref[1:5])  # entry 0 was attended without it


def test_sparse_attention_v4_width() -> None:
    """The V4 head width (512) and more heads than one head block."""
    batch = make_v4_batch([(20, 3), (11, 1)], heads=20, dim=512, window=8, ratio=4, seed=4)
    out, ref = _attention(batch, "topk", window=8, ratio=4, sinks=torch.randn(20, device=DEVICE), topk=3)
    _check(out, ref, _tol(torch.float32))


def test_sparse_attention_prunes_tiles_over_the_shared_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The autotuner never tries a tile over the device's shared memory: on sm_120 (99 KB) the
    listed tiles only, not the two-stage prefill tiles (64 heads x 32 entries, 32 x 64) that the
    H200 runs; on sm_90 every one. float32 queries double the estimate: none fits sm_120, and the
    first listed tile is left (a float32 model is a correctness path there, never a tuned one)."""
    from kernels import triton_deepseek_v4_attention as attention
    from tests.kernels.aot import SM120_SHARED_LIMIT

    tiles = attention._CONFIGS
    assert tiles == attention._PORTABLE_TILES + attention.PREFILL_TILES
    q16, q32 = (torch.empty(1, 64, 512, dtype=d, device="meta") for d in (torch.bfloat16, torch.float32))
    for limit, dtype_q, kept in ((SM120_SHARED_LIMIT, q16, attention._PORTABLE_TILES), (227 * 1024, q16, tiles)):
        monkeypatch.setattr(attention, "shared_memory_per_block", lambda limit=limit: limit)
        assert attention._prune(tiles, {"num_heads": 64, "q_ptr": dtype_q}, BLOCK_D=512) == kept
    monkeypatch.setattr(attention, "shared_memory_per_block", lambda: SM120_SHARED_LIMIT)
    assert attention._prune(tiles, {"num_heads": 64, "q_ptr": q32}, BLOCK_D=512) == tiles[:1]
    assert attention.shared_memory_estimate(tiles[0], 512, 4) > SM120_SHARED_LIMIT


def _check_topk(out: torch.Tensor, ref: torch.Tensor, batch: V4Batch, ratio: int, topk: int) -> None:
    """Each row: the right number of distinct visible picks and the same scores as the reference's
    picks (ties may pick other entries)."""
    assert out.shape == ref.shape == (len(batch.q), topk) and out.dtype == torch.int64
    positions = batch.positions().tolist()
    for t, p in enumerate(positions):
        seq = max(i for i in range(len(batch.seq_lens)) if batch.query_start_loc[i] <= t)
        visible = (p + 1) // ratio
        picks = out[t][out[t] >= 0]
        assert ((out[t] >= 0) | (out[t] == -1)).all(), f"row {t}: unwritten slots {out[t].tolist()}"
        assert len(picks) == min(topk, visible) == int((ref[t] >= 0).sum()), (t, out[t], ref[t])
        # the -1 padding last in both (a sparse attention may stop at a query's min(topk, visible))
        assert (out[t][:len(picks)] >= 0).all() and (ref[t][:len(picks)] >= 0).all(), (t, out[t], ref[t])
        assert len(set(picks.tolist())) == len(picks) and (picks < visible).all()
        if not len(picks):
            continue
        keys = batch.index_cache[batch.index_tables[seq].long()[torch.arange(visible, device=DEVICE) // 3],
                                 torch.arange(visible, device=DEVICE) % 3].double()
        scores = torch.relu(torch.einsum("hd,ed->he", batch.index_q[t].double(), keys))
        scores = (scores * batch.index_weights[t].double()[:, None]).sum(0)
        ours = scores[picks].sort().values
        theirs = scores[ref[t][ref[t] >= 0]].sort().values
        tol = 5e-3 if ON_GPU else 1e-3  # GPU: tf32 / bf16 dots; picks may differ between near-equal scores
        torch.testing.assert_close(ours, theirs, rtol=tol, atol=tol * scores.abs().max().item())


@pytest.mark.parametrize("topk,dtype", [(1, torch.float32), (5, torch.float32), (40, torch.float32),
                                        (5, torch.bfloat16)])
def test_indexer_topk_mixed_batch(topk: int, dtype: torch.dtype) -> None:
    batch = make_v4_batch(SHORT, dtype=dtype, seed=5)
    args = (batch.index_q, batch.index_weights, batch.index_cache, batch.index_tables, batch.query_start_loc,
            batch.seq_lens, 2, topk, 0.25)
    ref = indexer_topk_ref(*args)
    with poisoned_allocations():
        out = indexer_topk_triton(*args)
    _check_topk(out, ref, batch, 2, topk)


def test_indexer_topk_in_tiles_and_token_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows longer than one selection tile (selected tile by tile) and a scratch smaller than the
    batch (scored in token chunks)."""
    monkeypatch.setattr(indexer, "_TOPK_TILE", 8)
    monkeypatch.setattr(indexer, "_SCRATCH_ELEMENTS", 7 * 20)
    batch = make_v4_batch([(25, 2), (0, 0), (41, 1)], seed=8)
    args = (batch.index_q, batch.index_weights, batch.index_cache, batch.index_tables, batch.query_start_loc,
            batch.seq_lens, 2, 6, 0.5)
    with poisoned_allocations():
        out = indexer_topk_triton(*args)
    _check_topk(out, indexer_topk_ref(*args), batch, 2, 6)


@pytest.mark.parametrize("tile", [8, 4096])
def test_indexer_topk_ties_pick_lower_entries(tile: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Scores equal everywhere (zero keys): the lowest visible entries are picked."""
    monkeypatch.setattr(indexer, "_TOPK_TILE", tile)
    batch = make_v4_batch([(30, 1), (7, 7)], seed=6)
    batch.index_cache.zero_()
    out = indexer_topk_triton(batch.index_q, batch.index_weights, batch.index_cache, batch.index_tables,
                              batch.query_start_loc, batch.seq_lens, 2, 10, 1.0)
    for t, p in enumerate([29] + list(range(7))):
        visible = min(10, (p + 1) // 2)
        assert out[t].tolist() == list(range(visible)) + [-1] * (10 - visible)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("decode", [True, False])
def test_gpu_v4_flash_shapes(decode: bool) -> None:
    """V4-Flash: 64 heads x 512, window 128, CSA ratio 4 with top-512, indexer 64 x 128, bf16."""
    seqs = [(8192, 1)] * 8 + [(3000, 1)] * 8 if decode else [(4096, 4096), (6000, 700), (513, 1)]
    batch = make_v4_batch(seqs, heads=64, dim=512, window=128, ratio=4, block_size=64, entries_per_block=16,
                          index_heads=64, index_dim=128, dtype=torch.bfloat16, seed=7)
    args = (batch.index_q, batch.index_weights, batch.index_cache, batch.index_tables, batch.query_start_loc,
            batch.seq_lens, 4, 512, 128 ** -0.5)
    picks = indexer_topk_triton(*args)
    ref_picks = indexer_topk_ref(*args)
    assert ((picks >= 0).sum(1) == (ref_picks >= 0).sum(1)).all()
    sinks = torch.randn(64, device=DEVICE)
    for comp, topk in ((False, None), (True, picks), (True, None)):
        attn = (batch.q, batch.window_cache, batch.window_tables, batch.comp_cache if comp else None,
                batch.comp_tables if comp else None, topk, sinks, batch.query_start_loc, batch.seq_lens, 128, 4,
                512 ** -0.5)
        _check(sparse_attention_triton(*attn), sparse_attention_ref(*attn), 3e-2)


# --- hyper-connections (hc_pre: streams collapsed + Sinkhorn mixing; hc_post: streams spread) ---


def _hc_inputs(t: int, n: int, h: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    m = (2 + n) * n
    x = torch.randn(t, n, h, generator=g).to(dtype)
    fn = torch.randn(m, n * h, generator=g) * 0.05
    base, scale = torch.randn(m, generator=g) * 0.5, torch.rand(3, generator=g) + 0.5
    out = torch.randn(t, h, generator=g).to(dtype)
    return tuple(v.to(DEVICE) for v in (x, fn, base, scale, out))


_HC_SHAPES = [(1, 4, 64), (5, 4, 96), (19, 2, 40), (2, 3, 300), (3, 4, 1100)]


@pytest.mark.parametrize("t,n,h,dtype,split_bf16", [
    *[(*shape, dtype, False) for shape in _HC_SHAPES for dtype in (torch.float32, torch.bfloat16)],
    *[(*shape, torch.bfloat16, True) for shape in _HC_SHAPES if shape[0] != 19]])
def test_hyper_connections(t: int, n: int, h: int, dtype: torch.dtype, split_bf16: bool,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    """hc_pre (split mixes, Sinkhorn in registers, collapse) and hc_post against the references:
    float32 to its rounding, bf16 to one ulp of the outputs; N not a power of two, H not a
    multiple of the slice, H over several slices, scratch and outputs poisoned. ``bf16x3``: the
    mixes of bf16 streams as three bf16 products of fn's exact split, to the same tolerances."""
    from kernels import triton_deepseek_v4_hc as hc
    from kernels.deepseek_v4_ref import hc_post_ref, hc_pre_ref
    from kernels.triton_deepseek_v4_hc import hc_post_triton, hc_pre_triton
    monkeypatch.setattr(hc, "SPLIT_BF16", split_bf16)

    x, fn, base, scale, out = _hc_inputs(t, n, h, dtype, seed=t * 7 + n)
    ref = hc_pre_ref(x, fn, base, scale, 20, 1e-6, 1e-6)
    with poisoned_allocations():
        got = hc_pre_triton(x, fn, base, scale, 20, 1e-6, 1e-6)
        spread = hc_post_triton(out, x, ref[1], ref[2])
    ulp = 1e-5 if dtype == torch.float32 else 2 ** -7
    assert got[0].dtype == dtype and got[1].dtype == got[2].dtype == torch.float32
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[2], ref[2], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[2].sum(-2), torch.ones(t, n, device=DEVICE), rtol=0, atol=1e-4)  # columns
    torch.testing.assert_close(got[0].float(), ref[0].float(), rtol=ulp, atol=ulp)
    torch.testing.assert_close(spread.float(), hc_post_ref(out, x, ref[1], ref[2]).float(), rtol=2 * ulp, atol=2 * ulp)


@pytest.mark.parametrize("split_bf16", [False, True], ids=["ieee", "bf16x3"])
def test_hyper_connections_rows_do_not_depend_on_the_batch(split_bf16: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A token's results are the same alone as in a batch (fixed K chunks, fixed sum order), bit
    for bit on a GPU: decode, verify and prefill rows of one token agree (interpreted, within
    rounding)."""
    from kernels import triton_deepseek_v4_hc as hc
    from kernels.triton_deepseek_v4_hc import hc_post_triton, hc_pre_triton
    monkeypatch.setattr(hc, "SPLIT_BF16", split_bf16)

    x, fn, base, scale, out = _hc_inputs(9, 4, 640, torch.bfloat16, seed=3)
    batch = hc_pre_triton(x, fn, base, scale, 20, 1e-6, 1e-6)
    spread = hc_post_triton(out, x, batch[1], batch[2])

    def same(a: torch.Tensor, b: torch.Tensor) -> None:
        if ON_GPU:
            assert torch.equal(a, b)
        else:  # interpreted (NumPy 2.4 underneath here), a row's last bits move with the batch
            ulp = 1e-5 if a.dtype == torch.float32 else 2 ** -7
            torch.testing.assert_close(a.float(), b.float(), rtol=ulp, atol=ulp)
    for row in (0, 4, 8):
        alone = hc_pre_triton(x[row:row + 1], fn, base, scale, 20, 1e-6, 1e-6)
        for a, b in zip(alone, batch):
            same(a[0], b[row])
        same(hc_post_triton(out[row:row + 1], x[row:row + 1], alone[1], alone[2])[0], spread[row])
    empty = hc_pre_triton(x[:0], fn, base, scale, 20, 1e-6, 1e-6)
    assert [tuple(e.shape) for e in empty] == [(0, 640), (0, 4), (0, 4, 4)]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_gpu_hyper_connections_v4_flash_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """V4-Flash: 4 streams of 4096, 20 Sinkhorn iterations, bf16 streams; a decode row, a batch of
    32 and a prefill chunk of 4096 (one test: one process in the GPU gate's budget), the mixes as
    float32 FMA products and as three bf16 tensor-core products of fn's split."""
    from kernels import triton_deepseek_v4_hc as hc
    from kernels.deepseek_v4_ref import hc_post_ref, hc_pre_ref
    from kernels.triton_deepseek_v4_hc import hc_post_triton, hc_pre_triton

    for t, split in ((1, False), (32, False), (4096, False), (1, True), (32, True), (4096, True)):
        monkeypatch.setattr(hc, "SPLIT_BF16", split)
        x, fn, base, scale, out = _hc_inputs(t, 4, 4096, torch.bfloat16, seed=t)
        ref = hc_pre_ref(x, fn, base, scale, 20, 1e-6, 1e-6)
        got = hc_pre_triton(x, fn, base, scale, 20, 1e-6, 1e-6)
        torch.testing.assert_close(got[1], ref[1], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got[2], ref[2], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got[0].float(), ref[0].float(), rtol=2 ** -7, atol=2 ** -6)
        torch.testing.assert_close(hc_post_triton(out, x, ref[1], ref[2]).float(),
                                   hc_post_ref(out, x, ref[1], ref[2]).float(), rtol=2 ** -6, atol=2 ** -5)


# --- norm + RoPE (+ the window's KV write) ---


def _norm_rope_inputs(t: int, h: int, d: int, half: int, dtype: torch.dtype, seed: int, device: str = DEVICE
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A strided ``[t, h, d]`` view (a slice of wider rows, as a fused projection's), cos/sin of
    real angles, and a norm weight."""
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(t, h, d + 16, generator=gen)).to(dtype)[..., 8:8 + d]
    angles = 100 * torch.rand(t, half, generator=gen)
    weight = torch.rand(d, generator=gen) + 0.5
    return x.to(device), angles.cos().to(device), angles.sin().to(device), weight.to(device)


def _assert_rows_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """float32: to rounding. bf16: an ulp of the value plus a few of the row's largest (each
    rounding of the scale, the scaled row and the pair a rotation mixes may land one ulp apart: the
    interpreter truncates where the GPU rounds, and the norm's sum runs in another order)."""
    if ref.dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    else:
        got, ref = got.float(), ref.float()
        row_max = ref.abs().amax(-1, keepdim=True)
        assert ((got - ref).abs() <= ref.abs() * 2 ** -7 + row_max * 2 ** -5).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,h,d,half", [(3, 4, 64, 8), (5, 1, 48, 8), (2, 3, 96, 16), (1, 2, 32, 16)])
def test_norm_rope(t: int, h: int, d: int, half: int, dtype: torch.dtype) -> None:
    """Each of the op's uses against the reference: the queries (unweighted norm), the KV entry
    (weighted norm), the indexer's queries (no norm) and the attention output (inverse rotation);
    rows of non-power-of-two width and a row rotated whole (``2 * half == d``)."""
    from kernels.deepseek_v4_ref import norm_rope_ref
    from kernels.triton_deepseek_v4_rope import norm_rope_triton

    x, cos, sin, weight = _norm_rope_inputs(t, h, d, half, dtype, seed=t * d)
    for kwargs in ({}, {"eps": 1e-6}, {"eps": 1e-6, "weight": weight}, {"inverse": True}):
        with poisoned_allocations():
            got = norm_rope_triton(x, cos, sin, **kwargs)
        ref = norm_rope_ref(x, cos, sin, **kwargs)
        assert got.shape == ref.shape and got.dtype == ref.dtype and got.is_contiguous()
        _assert_rows_close(got, ref)
    # the untouched channels are the normalised row itself, the rotation undoes itself
    ref = norm_rope_ref(x, cos, sin)
    back = norm_rope_triton(norm_rope_triton(x, cos, sin), cos, sin, inverse=True)
    if dtype == torch.float32:
        _assert_rows_close(back, x.contiguous())
    assert torch.equal(norm_rope_triton(x, cos, sin)[..., :d - 2 * half], ref[..., :d - 2 * half])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rope_writes_the_window_cache(dtype: torch.dtype) -> None:
    """With a cache (a strided per-layer view), each row also lands at its slot; a padding row's
    slot -1 writes slot 0 of the null block and nothing else changes."""
    from kernels.deepseek_v4_ref import norm_rope_ref
    from kernels.triton_deepseek_v4_rope import norm_rope_triton

    x, cos, sin, weight = _norm_rope_inputs(5, 1, 48, 8, dtype, seed=3)
    storage = torch.randn(6, 2, 4, 48).to(dtype)
    slots = torch.tensor([9, -1, 22, 4, 13])
    caches = [storage.clone(), storage.clone()]
    ref = norm_rope_ref(x, cos, sin, weight, 1e-6, cache=caches[0][:, 1], slots=slots)
    got = norm_rope_triton(x, cos, sin, weight, 1e-6, cache=caches[1][:, 1], slots=slots)
    _assert_rows_close(got, ref)
    _assert_rows_close(caches[1], caches[0])
    changed = (caches[1] != storage).any(-1)
    assert changed[:, 0].sum() == 0 and changed[:, 1].sum() == 5
    assert changed[0, 1, 0] and changed[2, 1, 1] and changed[5, 1, 2] and changed[1, 1, 0] and changed[3, 1, 1]
    with pytest.raises(ValueError, match="one head"):
        norm_rope_triton(x.expand(5, 2, 48), cos, sin, cache=caches[1][:, 1], slots=slots)
    assert norm_rope_triton(x[:0], cos[:0], sin[:0]).shape == (0, 1, 48)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_gpu_norm_rope_v4_flash_width() -> None:
    """V4-Flash: 64 query heads of 512 (64 rotated), the KV entry with its cache write, the
    indexer's 64 heads of 128; a decode row, a batch of 32 and a prefill chunk of 4096."""
    from kernels.deepseek_v4_ref import norm_rope_ref
    from kernels.triton_deepseek_v4_rope import norm_rope_triton

    for t in (1, 32, 4096):
        for h, d, kwargs in ((64, 512, {"eps": 1e-6}), (64, 512, {"inverse": True}), (64, 128, {}),
                             (1, 512, {"eps": 1e-6, "weight": True})):
            x, cos, sin, weight = _norm_rope_inputs(t, h, d, 32, torch.bfloat16, seed=t + h + d)
            if kwargs.get("weight"):
                kwargs = {"eps": 1e-6, "weight": weight}
            _assert_rows_close(norm_rope_triton(x, cos, sin, **kwargs), norm_rope_ref(x, cos, sin, **kwargs))
        caches = [torch.zeros(t // 16 + 2, 2, 16, 512, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
        # real rows never hold slot 0: it is the null block's, where a padding row (-1) writes; two
        # rows writing one slot race, so a draw that put a real row there made this test flaky
        slots = torch.randperm(16 * (t // 16 + 2) - 1, device="cuda")[:t] + 1
        slots[0] = -1
        x, cos, sin, weight = _norm_rope_inputs(t, 1, 512, 32, torch.bfloat16, seed=t)
        norm_rope_ref(x, cos, sin, weight, 1e-6, cache=caches[0][:, 1], slots=slots)
        norm_rope_triton(x, cos, sin, weight, 1e-6, cache=caches[1][:, 1], slots=slots)
        _assert_rows_close(caches[1], caches[0])


# --- the MoE router ---


def _route_inputs(t: int, e: int, dtype: torch.dtype, seed: int, device: str = DEVICE
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gate logits (some past softplus's threshold and some far below zero), a correction bias,
    a hash table and token ids."""
    gen = torch.Generator().manual_seed(seed)
    logits = 4 * torch.randn(t, e, generator=gen)
    logits[:, :2] = torch.tensor([25.0, -30.0])
    bias = 0.1 * torch.randn(e, generator=gen)
    tid2eid = torch.stack([torch.randperm(e, generator=gen)[:6] for _ in range(50)]).to(torch.int32)
    input_ids = torch.randint(0, 50, (t,), generator=gen)
    return logits.to(dtype).to(device), bias.to(device), tid2eid.to(device), input_ids.to(device)


def _assert_routes_match(got: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor]) -> None:
    """The same experts per token (in any order) with the same weights (bf16: within a few ulps:
    each step rounds where the torch ops do, and the interpreter truncates where they round)."""
    (w_got, ids_got), (w_ref, ids_ref) = got, ref
    assert ids_got.dtype == torch.int64 and w_got.dtype == w_ref.dtype and w_got.shape == w_ref.shape
    ids_got, order_got = ids_got.sort(-1)
    ids_ref, order_ref = ids_ref.sort(-1)
    assert torch.equal(ids_got, ids_ref)
    tol = 1e-6 if w_ref.dtype == torch.float32 else 2 ** -5  # five roundings, each up to an ulp
    w_got, w_ref = w_got.gather(1, order_got).float(), w_ref.gather(1, order_ref).float()
    assert ((w_got - w_ref).abs() <= w_ref.abs() * tol + 1e-7).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("t,e,k", [(5, 16, 6), (3, 256, 6), (2, 48, 1), (1, 8, 8)])
def test_route(t: int, e: int, k: int, scoring: str, dtype: torch.dtype) -> None:
    """Learned routing (top-k of score + bias) and hash routing against the reference; expert
    counts off powers of two, k of 1 and k = E."""
    from kernels.deepseek_v4_ref import route_ref
    from kernels.triton_deepseek_v4_router import route_triton

    logits, bias, tid2eid, input_ids = _route_inputs(t, e, dtype, seed=t * e + k)
    _assert_routes_match(route_triton(logits, k, scoring, 1.5, bias=bias),
                         route_ref(logits, k, scoring, 1.5, bias=bias))
    if k <= 6:
        table = tid2eid[:, :k] % e
        hashed = route_triton(logits, k, scoring, 2.5, tid2eid=table, input_ids=input_ids)
        assert torch.equal(hashed[1], table[input_ids].long())  # the table's order, kept
        _assert_routes_match(hashed, route_ref(logits, k, scoring, 2.5, tid2eid=table, input_ids=input_ids))


def test_route_picks_by_biased_score_and_refuses_bad_calls() -> None:
    """The bias decides the choice but not the weights: an expert with a low score and a large
    bias is chosen, weighted by its score; bad calls are refused by name; no tokens, no launch."""
    from kernels.triton_deepseek_v4_router import route_triton

    logits = torch.tensor([[3.0, 2.0, -4.0, 1.0]])
    bias = torch.tensor([0.0, 0.0, 10.0, 0.0])
    weights, ids = route_triton(logits, 2, "sigmoid", 1.0, bias=bias)
    assert ids.tolist() == [[2, 0]]
    scores = logits.sigmoid()[0, [2, 0]]
    torch.testing.assert_close(weights[0], scores / scores.sum())
    with pytest.raises(ValueError, match="scoring"):
        route_triton(logits, 2, "relu", 1.0, bias=bias)
    with pytest.raises(ValueError, match="bias"):
        route_triton(logits, 2, "sigmoid", 1.0)
    with pytest.raises(ValueError, match="input ids"):
        route_triton(logits, 2, "sigmoid", 1.0, tid2eid=torch.zeros(4, 2, dtype=torch.int64))
    empty = route_triton(logits[:0], 2, "sigmoid", 1.0, bias=bias)
    assert empty[0].shape == empty[1].shape == (0, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_gpu_route_v4_flash_width() -> None:
    """V4-Flash: 256 experts, top 6, sqrtsoftplus, bf16 logits; learned and hash routing at a
    decode row, a batch of 32 and a prefill chunk of 4096."""
    from kernels.deepseek_v4_ref import route_ref
    from kernels.triton_deepseek_v4_router import route_triton

    for t in (1, 32, 4096):
        logits, bias, tid2eid, input_ids = _route_inputs(t, 256, torch.bfloat16, seed=t)
        _assert_routes_match(route_triton(logits, 6, "sqrtsoftplus", 1.5, bias=bias),
                             route_ref(logits, 6, "sqrtsoftplus", 1.5, bias=bias))
        _assert_routes_match(route_triton(logits, 6, "sqrtsoftplus", 1.5, tid2eid=tid2eid, input_ids=input_ids),
                             route_ref(logits, 6, "sqrtsoftplus", 1.5, tid2eid=tid2eid, input_ids=input_ids))


# --- the compressors' one-token step ---


@pytest.mark.parametrize("kind", ["hca", "csa", "csa_index"])
def test_compress_decode(kind: str) -> None:
    """Rows at a window's start (position 0: the carry is ignored), inside, and completing it
    (restart; CSA: the overlap half becomes the entry in progress), an empty carried overlap part;
    C not a multiple of the channel slice; outputs poisoned."""
    from kernels.deepseek_v4_ref import EMPTY_LSE, compress_decode_ref
    from kernels.triton_deepseek_v4_compressor import compress_decode_triton

    g = torch.Generator().manual_seed(len(kind))
    d, di = (300, 0) if kind == "hca" else (300, 40) if kind == "csa_index" else (340, 0)
    c = d + di
    positions = torch.tensor([0, 1, 3, 6, 7, 12, 15, 0, 5])
    shape = (len(positions), 2, c) if kind == "hca" else (len(positions), 2, 2, c)
    carry = torch.randn(*shape, generator=g)
    carry[..., 0, :] = -carry[..., 0, :].abs()  # plausible log-sum-exps
    if kind != "hca":
        carry[2, 1, 0] = EMPTY_LSE
    width = d if kind == "hca" else 2 * d
    proj = [torch.randn(len(positions), width, generator=g) for _ in range(2)]
    index = [torch.randn(len(positions), 2 * di, generator=g) for _ in range(2)] if di else [None, None]
    args = [t.to(DEVICE) if t is not None else None for t in (carry, positions, *proj, *index)]
    want = compress_decode_ref(args[0], args[1], 4, *args[2:])
    with poisoned_allocations():
        got = compress_decode_triton(args[0], args[1], 4, *args[2:])
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["hca", "csa", "csa_index"])
def test_compress_decode_paged(kind: str) -> None:
    """A decode step's compressors over the paged state group, in place: carries read from each
    row's block of the position before (the same block as the write, or the block before, at a
    block's first position), the raw gates' slot bias added, the pools written to the block of the
    position, the other layers' states of the group untouched; entries, indices and done flags as
    the reference's, from bf16 projections (a fused GEMM's column slices: row strides)."""
    from kernels.deepseek_v4_ref import compress_decode_paged_ref
    from kernels.triton_deepseek_v4_compressor import compress_decode_paged_triton

    g = torch.Generator().manual_seed(7 + len(kind))
    d, di = (300, 0) if kind == "hca" else (300, 40) if kind == "csa_index" else (340, 0)
    c, ratio, block_size = d + di, 4, 8
    positions = torch.tensor([0, 1, 3, 6, 7, 8, 12, 15, 16, 0, 5])
    rows = len(positions)
    shape = (2, c) if kind == "hca" else (2, 2, c)
    group = torch.randn(64, 3, *shape, generator=g)  # the state group: 3 layers' states per block
    table = (torch.randperm(63, generator=g)[:rows * 3] + 1).view(rows, 3).int()
    width = d if kind == "hca" else 2 * d
    fused = torch.randn(rows, 2 * width + 4 * di + 16, generator=g).bfloat16()  # the GEMM's output
    value, gate = fused[:, :width], fused[:, width:2 * width]
    ape = torch.randn(ratio, width, generator=g)
    index = ((fused[:, 2 * width + 2 * di:2 * width + 4 * di], fused[:, 2 * width:2 * width + 2 * di],
              torch.randn(ratio, 2 * di, generator=g)) if di else (None, None, None))
    move = [t.to(DEVICE) if t is not None else None for t in (table, positions, gate, value, ape, *index)]
    want_group, got_group = group.to(DEVICE), group.to(DEVICE).clone()
    want = compress_decode_paged_ref(want_group[:, 1], move[0], block_size, move[1], ratio, *move[2:])
    with poisoned_allocations():
        got = compress_decode_paged_triton(got_group[:, 1], move[0], block_size, move[1], ratio, *move[2:])
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.dtype, b.dtype)
        if a.dtype.is_floating_point:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(a, b)
    torch.testing.assert_close(got_group, want_group, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_group[:, 0], group[:, 0].to(DEVICE)) and torch.equal(got_group[:, 2], group[:, 2].to(DEVICE))
    assert not torch.equal(got_group[:, 1], group[:, 1].to(DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compress_store(dtype: torch.dtype) -> None:
    """The completed entries (rows done) land normalised and rotated where the reference puts them,
    from a strided pooled view into a strided per-layer cache view; rows not done leave every
    allocated block untouched (an in-progress entry past the allocated blocks included)."""
    from kernels.deepseek_v4_ref import compress_store_ref
    from kernels.rotary import rope_inv_freq
    from kernels.triton_deepseek_v4_compressor import compress_store_triton

    g = torch.Generator().manual_seed(5)
    n, per_block, layers = 96, 4, 2
    index = torch.tensor([0, 3, 4, 9, 7, 2, 13])
    done = torch.tensor([True, True, False, True, True, False, False])
    pooled = torch.randn(len(index), n + 40, generator=g)[:, 5:5 + n]  # strided, as the CSA split
    weight = torch.rand(n, generator=g) + 0.5
    inv_freq = rope_inv_freq(32, 10000.0)  # a 32-channel rotated tail
    # each row's own blocks; row 6's entry 13 lies past its 3 allocated blocks (column clamped)
    table = (1 + torch.arange(len(index) * 3).view(len(index), 3)).int()
    storage = torch.randn(1 + table.numel(), layers, per_block, n, generator=g).to(dtype)
    args = [t.to(DEVICE) for t in (pooled, index, done, weight)]
    ref_cache, got_cache = storage.clone().to(DEVICE), storage.clone().to(DEVICE)
    compress_store_ref(*args, 1e-6, inv_freq.to(DEVICE), 4, 1.25, ref_cache[:, 1], table.to(DEVICE))
    compress_store_triton(*args, 1e-6, inv_freq.to(DEVICE), 4, 1.25, got_cache[:, 1], table.to(DEVICE))
    # bf16: three roundings, each one ulp apart at most (Triton's interpreter truncates to bf16)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -5
    torch.testing.assert_close(got_cache[1:].float(), ref_cache[1:].float(), rtol=tol, atol=tol)  # all but the null block
    assert torch.equal(got_cache[:, 0], storage[:, 0].to(DEVICE))  # the other layer untouched
    written = got_cache[1:, 1] != storage[1:, 1].to(DEVICE)
    assert written.any(-1).sum().item() == int(done.sum())  # one slot per completed entry


# --- sm_90 / sm_120 builds (ahead of time, no GPU needed; see tests/kernels/portability_check.py) ---


def _portability_cases() -> list[tuple[str, object, tuple[object, ...], dict[str, object]]]:
    """The V4 kernels at V4-Flash shapes with ``meta`` tensors (only dtypes and alignment matter)."""
    from kernels import triton_deepseek_v4_attention as attention

    def t(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device="meta")

    i32, i64, f32 = torch.int32, torch.int64, torch.float32
    q, cache, table, loc = t(128, 64, 512), t(4096, 64, 512), t(128, 300, dtype=i32), t(129, dtype=i32)
    picks, sinks, part = t(128, 512, dtype=i64), t(64, dtype=f32), t(128, 64, 4, 512, dtype=f32)
    cases = []
    for comp, topk, splits in ((False, False, 1), (True, True, 4), (True, False, 1)):
        cases.append((f"v4_attention_{'topk' if topk else 'all' if comp else 'window'}_s{splits}",
                      attention._sparse_attention_kernel,
                      (q, cache, table, cache, table, picks, sinks, loc, loc, q, part, part, 128, 8, 64, 128, 0, 4,
                       512, 0.1, 128, 32768, 512, 32768, 512, 300, 8192, 512, 300, 512, 32768, 512),
                      dict(HEAD_DIM=512, BLOCK_D=512, WIN_PAGE=64, COMP_PAGE=16, HAS_COMP=comp, HAS_TOPK=topk,
                           NUM_SPLITS=splits, UPCAST=False)))
    cases.append(("v4_attention_merge", attention._merge_kernel, (part, part, sinks, q, 64, 32768, 512),
                  dict(HEAD_DIM=512, BLOCK_D=512, NUM_SPLITS=4, BLOCK_S=4, num_warps=4)))
    iq, icache, scores = t(128, 64, 128), t(4096, 16, 128), t(128, 2048, dtype=f32)
    cases.append(("v4_indexer_scores", indexer._indexer_scores_kernel,
                  (iq, t(128, 64, dtype=f32), icache, table, loc, loc, scores, 0, 128, 8, 64, 4, 0.1, 128, 8192,
                   128, 64, 2048, 128, 300, 2048),
                  dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_H=64, PAGE=16, NUM_SPLITS=1, UPCAST=False)))
    for one_tile in (True, False):
        cases.append((f"v4_indexer_topk_{'tile' if one_tile else 'tiles'}", indexer._topk_kernel,
                      (scores, picks, loc, loc, 0, 128, 8, 4, 512, 2048, 512),
                      dict(BLOCK=4096, ONE_TILE=one_tile, num_warps=8)))
    from kernels import triton_deepseek_v4_compressor as compressor
    for overlap, has_index in ((False, False), (True, True)):
        c = 640 if overlap else 512
        state = t(128, 4 * c if overlap else 2 * c, dtype=f32)
        proj, index_proj = t(128, 1024, dtype=f32), t(128, 256, dtype=f32)
        cases.append((f"v4_compress_decode_{'csa' if overlap else 'hca'}", compressor._compress_decode_kernel,
                      (state, t(128, dtype=i64), proj, proj, index_proj, index_proj, state, t(128, c, dtype=f32), c,
                       512, 128 if has_index else 0, 4, state.shape[1], state.shape[1], 1024, 1024, 256, 256, c,
                       -1e30),
                      dict(OVERLAP=overlap, HAS_INDEX=has_index, BLOCK_C=256, num_warps=2)))
    for overlap, has_index in ((False, False), (True, True)):
        c = 640 if overlap else 512
        states, proj, index_proj = t(4096, 3, 4 * c if overlap else 2 * c, dtype=f32), t(128, 4096), t(128, 4096)
        cases.append((f"v4_compress_decode_paged_{'csa' if overlap else 'hca'}", compressor._compress_decode_paged_kernel,
                      (states, table, t(128, dtype=i64), proj, proj, index_proj, index_proj, t(4, 1024, dtype=f32),
                       t(4, 256, dtype=f32), t(128, c, dtype=f32), t(128, dtype=i64), t(128, dtype=torch.bool), c,
                       512, 128 if has_index else 0, 4, 16, states.stride(0), 300, 4096, 4096, 4096, 4096, 1024,
                       256, c, -1e30),
                      dict(OVERLAP=overlap, HAS_INDEX=has_index, BLOCK_C=256, num_warps=2)))
    entries_cache, pooled_rows = t(4096, 16, 512), t(128, 640, dtype=f32)
    cases.append(("v4_compress_store", compressor._compress_store_kernel,
                  (pooled_rows, t(128, dtype=i64), t(128, dtype=torch.bool), t(512, dtype=f32), t(32, dtype=f32),
                   entries_cache, table, 640, 512, 32, 1e-6, 4, 1.0, 16 * 512 * 4, 512, 16, 300, 299),
                  dict(BLOCK=512, BLOCK_R=32, num_warps=4)))
    from kernels import triton_deepseek_v4_hc as hc
    streams, fn, part, sq = t(64, 4, 4096), t(24, 16384, dtype=f32), t(64, 128, 32, dtype=f32), t(64, 128, dtype=f32)
    for block_t, warps in ((16, 4), (64, 8)):
        for split in (False, True):
            cases.append((f"v4_hc_mix_t{block_t}" + ("_bf16x3" if split else ""), hc._hc_mix_kernel,
                          (streams, fn, part, sq, 64, 16384, 16384, 128),
                          dict(M=24, M_PAD=32, CHUNK_K=hc.CHUNK, BLOCK_T=block_t, BLOCK_K=hc.BLOCK_K, SPLIT_W=split,
                               num_warps=warps)))
    post, comb, block_out = t(64, 4, dtype=f32), t(64, 4, 4, dtype=f32), t(64, 4096)
    cases.append(("v4_hc_pre_finish", hc._hc_pre_finish_kernel,
                  (part, sq, streams, t(24, dtype=f32), t(3, dtype=f32), block_out, post, comb, 16384, 4096, 128,
                   16384, 4096, 4096, 1e-6, 1e-6),
                  dict(ITERS=20, N=4, N_PAD=4, M_PAD=32, S_PAD=128, BLOCK_H=512, num_warps=1)))
    cases.append(("v4_hc_post", hc._hc_post_kernel,
                  (block_out, streams, post, comb, streams, 4096, 4096, 16384, 4096, 16384, 4096),
                  dict(N=4, N_PAD=4, BLOCK_H=256, num_warps=4)))
    from kernels import triton_deepseek_v4_rope as rope
    rows, angles, slots = t(128, 64, 512), t(128, 32, dtype=f32), t(128, dtype=i64)
    cases.append(("v4_norm_rope", rope._norm_rope_kernel,
                  (rows, angles, angles, t(512, dtype=f32), rows, cache, slots, 64 * 512, 512, 64 * 512, 512, 32,
                   32, 64 * 64 * 512, 512, 64, 64, 1e-6),
                  dict(D=512, HALF=32, BLOCK_D=512, BLOCK_H=8, NORM=True, WEIGHTED=True, INVERSE=False,
                       WRITE_CACHE=True, num_warps=4)))
    from kernels import triton_deepseek_v4_router as router
    gate_logits = t(128, 256)
    cases.append(("v4_route", router._route_kernel,
                  (gate_logits, t(256, dtype=f32), gate_logits, gate_logits, t(128, 6), t(128, 6, dtype=i64), 256, 256,
                   0, 1.5),
                  dict(TOP_K=6, BLOCK_E=256, BLOCK_K=8, SCORING=0, HASH=False, num_warps=1)))
    return cases


def _print_portability() -> None:
    import json

    from tests.kernels.aot import compile_for
    from tests.kernels.portability_check import ARCHS, _configs

    for name, kernel, args, kwargs in _portability_cases():
        for arch in ARCHS:
            for opts in _configs(kernel, kwargs, arch):
                record: dict[str, object] = {"kernel": name, "arch": f"sm_{arch[0]}{arch[1]}", "config": opts}
                try:
                    record["shared"] = compile_for(kernel, arch, *args, **kwargs, **opts).metadata.shared
                except Exception as e:  # report every failure, keep compiling the rest
                    record["error"] = f"{type(e).__name__}: {str(e)[-400:]}"
                print(json.dumps(record), flush=True)


def test_v4_kernels_compile_for_sm90_and_sm120() -> None:
    """Every V4 kernel builds for sm_90 and sm_120; on sm_120 every config its autotuner would
    try fits 99 KB."""
    import json
    import os
    import subprocess
    import sys

    from tests.kernels.aot import SM120_SHARED_LIMIT

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "tests.kernels.test_deepseek_v4_kernels"], cwd=root, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    failures = [r for r in records if "error" in r]
    assert not failures, json.dumps(failures, indent=1)
    names = {r["kernel"] for r in records}
    assert len(names) == 20  # the hyper-connection mixes twice: float32 FMA and bf16x3 products
    for name in names:
        sm120 = [(r["shared"], r["config"]) for r in records if r["kernel"] == name and r["arch"] == "sm_120"]
        assert sm120 and all(shared <= SM120_SHARED_LIMIT for shared, _ in sm120), (name, sm120)


if __name__ == "__main__":
    _print_portability()
