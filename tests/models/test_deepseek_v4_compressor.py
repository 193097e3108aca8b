"""The batched decode step of the DeepSeek-V4 compressors against the chunk path on one-token
chunks: the same checkpoints written and the same completed entries, for HCA and CSA states,
sequences at the start, inside and at the end of a window and of a block, in one batch."""
from __future__ import annotations

import pytest
import torch

from cluster.models.context import ForwardContext
from cluster.models.deepseek_v4_compressor import ChunkCompressor, decode_step
from kernels.deepseek_v4_ref import EMPTY_LSE


def _context(positions: list[int], storage: torch.Tensor, block_size: int) -> ForwardContext:
    batch = len(positions)
    width = max(positions) // block_size + 1
    # distinct blocks per sequence (block 0 is the null block)
    tables = torch.arange(1, 1 + batch * width).view(batch, width).int()
    return ForwardContext(
        positions=torch.tensor(positions), query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.tensor([p + 1 for p in positions], dtype=torch.int32),
        query_start_loc_cpu=list(range(batch + 1)), seq_lens_cpu=[p + 1 for p in positions],
        kv_caches=[storage], block_tables=[tables], slot_mappings=[None], block_sizes=[block_size])


def _projections(kind: str, series_b: tuple[torch.Tensor, torch.Tensor],
                 series_a: tuple[torch.Tensor, torch.Tensor] | None, d: int) -> tuple:
    """The compressor projections the series come from: HCA's are the series; CSA's are ``[A | B]``
    halves, with ``csa_index`` the last channels from the indexer compressor's own halves."""
    if series_a is None:
        return (*series_b, None, None)
    if kind == "csa":
        return torch.cat([series_a[0], series_b[0]], -1), torch.cat([series_a[1], series_b[1]], -1), None, None
    return (torch.cat([series_a[0][:, :d], series_b[0][:, :d]], -1), torch.cat([series_a[1][:, :d], series_b[1][:, :d]], -1),
            torch.cat([series_a[0][:, d:], series_b[0][:, d:]], -1), torch.cat([series_a[1][:, d:], series_b[1][:, d:]], -1))


@pytest.mark.parametrize("advance", ["torch", "triton"])
@pytest.mark.parametrize("kind", ["hca", "csa", "csa_index"])
def test_decode_step_equals_one_token_chunks(kind: str, advance: str) -> None:
    """With the reference one-token merge and with the Triton kernel (interpreted here)."""
    from kernels.deepseek_v4_ref import compress_decode_ref
    from kernels.triton_deepseek_v4_compressor import compress_decode_triton

    csa = kind != "hca"
    ratio, block_size, channels = 4, 4, 6
    positions = [0, 1, 3, 4, 6, 7, 11, 13, 14, 15]  # window start / inside / end; block boundaries
    gen = torch.Generator().manual_seed(0)
    batch = len(positions)
    state_shape = (2, 2, channels) if csa else (2, channels)
    width = max(positions) // block_size + 1
    storage = torch.randn(1 + batch * width, 1, *state_shape, generator=gen)
    storage[..., 0, :] = storage[..., 0, :].abs() * -1.0  # plausible log-sum-exps
    if csa:
        storage[3, 0, 1, 0] = EMPTY_LSE  # an empty overlap part in a carried state
    series_b = (torch.randn(batch, channels, generator=gen), torch.randn(batch, channels, generator=gen))
    series_a = (torch.randn(batch, channels, generator=gen), torch.randn(batch, channels, generator=gen)) if csa else None

    chunked = storage.clone()
    ctx = _context(positions, chunked, block_size)
    entries = {seq: pooled for seq, _, pooled in ChunkCompressor(ratio, 0, 0).run(series_b, series_a, ctx)}

    batched = storage.clone()
    step = decode_step(_projections(kind, series_b, series_a, 4), _context(positions, batched, block_size), ratio, 0, 0,
                       advance=compress_decode_ref if advance == "torch" else compress_decode_triton)

    torch.testing.assert_close(batched, chunked, rtol=1e-5, atol=1e-6)
    assert step.done.tolist() == [p % ratio == ratio - 1 for p in positions]
    assert step.index.tolist() == [p // ratio for p in positions]
    assert set(entries) == {i for i, p in enumerate(positions) if p % ratio == ratio - 1}
    for seq, pooled in entries.items():
        torch.testing.assert_close(step.pooled[seq], pooled[0], rtol=1e-5, atol=1e-6)
