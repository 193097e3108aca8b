"""Speculative decoding's device bookkeeping: the Triton kernels write exactly the reference's
buffers (a verify step's rows; the acceptance and the draft head's next rows), padding requests
and buffer tails included, for k = 1..4, blocks of 4 and 16 tokens, with and without a live
mask; and the reference's acceptance is the run of drafts equal to the target's tokens."""
from __future__ import annotations

import pytest
import torch

from kernels.spec_decode import accept_and_draft_rows_ref, commit_states_ref, verify_chain_ref, verify_rows_ref
from kernels.triton_spec_decode import accept_and_draft_rows_triton, verify_rows_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(k: int, n: int, block_size: int, seed: int, width: int = 6) -> list[torch.Tensor]:
    """(inputs, targets, base, live, table): ``width`` table entries a request."""
    gen = torch.Generator().manual_seed(seed)
    r = k + 1
    table = torch.randint(1, 500, (n, width), generator=gen, dtype=torch.int32)
    base = torch.randint(0, width * block_size - 3 * k - 2, (n,), generator=gen)
    inputs = torch.randint(0, 5, (n, r), generator=gen)
    targets = torch.randint(0, 5, (n, r), generator=gen)
    targets[0, :k] = inputs[0, 1:]  # request 0 accepts every draft
    if n > 1:
        targets[1, 0] = inputs[1, 1] + 1  # request 1 none
    live = torch.rand(n, generator=gen) < 0.7
    live[0] = True
    return [t.to(DEVICE) for t in (inputs, targets, base, live, table)]


def run(verify_rows, accept_and_draft_rows, case, live, block_size: int, rows: int, size: int,
        dest_width: int = 9) -> list[torch.Tensor]:
    """Both ops on buffers pre-filled with junk (tables ``dest_width`` wide, wider than a
    request's, as the graphs' are); every entry they own comes back."""
    inputs, targets, base, _, table = case
    r = inputs.shape[1]
    chain = max(1, r - 2)

    def junk(shape, dtype):
        return torch.full(shape, 99, dtype=dtype, device=DEVICE)
    verify = [junk((rows,), torch.int64), junk((rows,), torch.int64), junk((rows,), torch.int32),
              junk((rows,), torch.int64), junk((rows, dest_width), torch.int32)]
    draft = [junk((size * r,), torch.int64), junk((size * r,), torch.int64), junk((size * r,), torch.int32),
             junk((size * r,), torch.int64), junk((size,), torch.int64),
             # the graphs' chain buffers are wider than a batch: strided slices
             junk((chain, size + 3), torch.int64)[:, :size], junk((chain, size + 3), torch.int32)[:, :size],
             junk((chain, size + 3), torch.int64)[:, :size], junk((size, dest_width), torch.int32)]
    verify_rows(inputs, base, live, table, block_size, *verify)
    accepted, token = accept_and_draft_rows(inputs, targets, base, live, table, block_size, *draft)
    out = [t.cpu() for t in (*verify, *draft, accepted, token)]
    if r == 2:  # k == 1: no chained pass, its buffers untouched
        out = out[:10] + out[13:]
    return out


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("masked", [True, False])
def test_kernels_write_the_references_buffers(k, block_size, masked):
    for n, size, seed in ((1, 1, 0), (3, 4, 1), (5, 8, 2)):
        case = make_case(k, n, block_size, seed)
        live = case[3] if masked else None
        rows = max(2 * size * (k + 1), 2)  # decode graphs pad rows beyond the step's too
        want = run(verify_rows_ref, accept_and_draft_rows_ref, case, live, block_size, rows, size)
        got = run(verify_rows_triton, accept_and_draft_rows_triton, case, live, block_size, rows, size)
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), (n, i, a, b)


def test_acceptance_is_the_run_of_matching_drafts():
    inputs = torch.tensor([[7, 1, 2, 3], [7, 1, 2, 3], [7, 1, 2, 3], [7, 1, 2, 3]])
    targets = torch.tensor([[1, 2, 3, 9], [1, 2, 5, 9], [4, 2, 3, 9], [1, 5, 3, 9]])
    table = torch.arange(1, 9, dtype=torch.int32).repeat(4, 1)
    base = torch.tensor([0, 10, 20, 30])
    live = torch.tensor([True, True, True, False])
    bufs = [torch.zeros(16, dtype=torch.int64), torch.zeros(16, dtype=torch.int64), torch.zeros(16, dtype=torch.int32),
            torch.zeros(16, dtype=torch.int64), torch.zeros(4, dtype=torch.int64), torch.zeros((2, 4), dtype=torch.int64),
            torch.zeros((2, 4), dtype=torch.int32), torch.zeros((2, 4), dtype=torch.int64),
            torch.zeros((4, 8), dtype=torch.int32)]
    accepted, token = accept_and_draft_rows_ref(inputs, targets, base, live, table, 4, *bufs)
    assert accepted.tolist() == [3, 2, 0, 1] and token.tolist() == [9, 5, 4, 5]
    first_ids, first_positions, _, first_slots, last_rows = bufs[:5]
    assert first_ids[4:8].tolist() == [1, 2, 5, 5]  # accepted drafts, then the target's token
    assert first_positions[4:8].tolist() == [11, 12, 13, 0] and first_slots[7] == -1
    assert first_slots[4] == table[1, 11 // 4] * 4 + 11 % 4
    assert last_rows.tolist() == [3, 6, 8, 13]
    chain_positions, chain_slots = bufs[5], bufs[7]
    assert chain_positions[:, 0].tolist() == [5, 6] and chain_positions[:, 3].tolist() == [0, 0]
    assert chain_slots[:, 3].tolist() == [-1, -1]  # not live: writes nowhere


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernels_on_the_gpu_at_serving_sizes():
    """Compiled for the GPU, at a verify graph's sizes (64 requests, k = 3 and 4, 16-token blocks,
    tables of 512 entries): the reference's buffers, entry for entry."""
    for k in (3, 4):
        case = make_case(k, 64, 16, seed=k, width=300)
        for live in (case[3], None):
            want = run(verify_rows_ref, accept_and_draft_rows_ref, case, live, 16, 512, 64, dest_width=512)
            got = run(verify_rows_triton, accept_and_draft_rows_triton, case, live, 16, 512, 64, dest_width=512)
            assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("block_size", [2, 4])
def test_state_commit_on_the_device_keeps_what_the_host_commit_keeps(k, block_size):
    """``commit_states_ref`` (pipelined verify steps) writes the states ``ModelRunner.commit_verified``
    writes after a synchronous step (the positions ``checkpoint_positions`` names over the
    accepted ones), every other row going to the null block; ``verify_chain_ref`` numbers the rows
    as the host's verify batch does (``build_host_batch``: running ordinal, the row before)."""
    from cluster.common.kv_spec import checkpoint_positions
    gen = torch.Generator().manual_seed(k * 10 + block_size)
    n, r, width, blocks = 5, k + 1, 8, 64
    table = torch.randperm(blocks - 1, generator=gen)[:n * width].view(n, width).int() + 1  # distinct, not null
    base = torch.randint(0, width * block_size - r, (n,), generator=gen)
    accepted = torch.randint(0, k + 1, (n,), generator=gen)
    live = torch.tensor([True, True, False, True, True])
    scratch = torch.randn((n * r + 1, 2, 3), generator=gen)
    cache = torch.randn((blocks, 2, 3), generator=gen)
    want = cache.clone()
    for i in range(n):
        if not live[i]:
            continue
        start = int(base[i])
        for q in checkpoint_positions(start, start + int(accepted[i]) + 1, block_size):
            want[int(table[i, q // block_size])] = scratch[i * r + q - start]
    got = cache.clone()
    commit_states_ref(got, scratch, table, base, accepted, live, r, block_size)
    torch.testing.assert_close(got[1:], want[1:], rtol=0, atol=0)
    slot, prev = torch.zeros(n * r + 3, dtype=torch.long), torch.zeros(n * r + 3, dtype=torch.long)
    verify_chain_ref(n, r, live, slot, prev)
    t = torch.arange(n * r)
    alive = live.repeat_interleave(r)
    assert slot.tolist() == torch.where(alive, t, -1).tolist() + [-1] * 3
    assert prev.tolist() == torch.where(alive & (t % r > 0), t - 1, -1).tolist() + [-1] * 3
