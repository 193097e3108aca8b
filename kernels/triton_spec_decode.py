"""Speculative decoding's device bookkeeping in Triton (semantics of :mod:`kernels.spec_decode`):
one program per verify row (``verify_rows_triton``) and one per request
(``accept_and_draft_rows_triton``), each writing every buffer entry it owns, padding included,
so that a pipelined verify step's rows and the draft head's next proposal cost one launch each
instead of dozens of small torch ops. Table offsets are int64."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_W = 128  # table entries copied per loop iteration


@triton.jit
def _verify_rows_kernel(inputs_ptr, base_ptr, live_ptr, table_ptr, ids_ptr, pos_ptr, lens_ptr, slots_ptr, tables_ptr,
                        n, r, width, dest_width, table_stride, dest_stride, block_size,
                        HAS_LIVE: tl.constexpr, BLOCK_W: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    i = t // r
    valid = t < n * r
    live = valid
    if HAS_LIVE:
        live = live & (tl.load(live_ptr + i, mask=valid, other=0) != 0)
    token = tl.load(inputs_ptr + t, mask=valid, other=0)
    pos = tl.where(live, tl.load(base_ptr + i, mask=valid, other=0) + t % r, 0)
    block = tl.load(table_ptr + i * table_stride + tl.minimum(pos // block_size, width - 1), mask=live, other=0)
    tl.store(ids_ptr + t, token)
    tl.store(pos_ptr + t, pos)
    tl.store(lens_ptr + t, (pos + 1).to(tl.int32))
    tl.store(slots_ptr + t, tl.where(live, block.to(tl.int64) * block_size + pos % block_size, -1))
    for w in range(0, dest_width, BLOCK_W):
        offs = w + tl.arange(0, BLOCK_W)
        row = tl.load(table_ptr + i * table_stride + offs, mask=live & (offs < width), other=0)
        tl.store(tables_ptr + t * dest_stride + offs, row, mask=offs < dest_width)


def verify_rows_triton(inputs: torch.Tensor, base: torch.Tensor, live: torch.Tensor | None, table: torch.Tensor,
                       block_size: int, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
                       slots: torch.Tensor, block_tables: torch.Tensor) -> None:
    n, r = inputs.shape
    rows = input_ids.shape[0]
    inputs, table = inputs.contiguous(), table.contiguous()
    _verify_rows_kernel[(rows,)](
        inputs, base, live if live is not None else base, table, input_ids, positions, seq_lens, slots, block_tables,
        n, r, table.shape[1], block_tables.shape[1], table.stride(0), block_tables.stride(0), block_size,
        HAS_LIVE=live is not None, BLOCK_W=BLOCK_W, num_warps=1)


@triton.jit
def _accept_draft_kernel(inputs_ptr, targets_ptr, base_ptr, live_ptr, table_ptr, accepted_ptr, token_ptr,
                         first_ids_ptr, first_pos_ptr, first_lens_ptr, first_slots_ptr, last_rows_ptr,
                         chain_pos_ptr, chain_lens_ptr, chain_slots_ptr, tables_ptr,
                         n, r, width, dest_width, table_stride, chain_stride, dest_stride, block_size,
                         HAS_LIVE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    valid = i < n
    live = valid
    if HAS_LIVE:
        live = live & (tl.load(live_ptr + i, mask=valid, other=0) != 0)
    j = tl.arange(0, BLOCK_R)
    k = r - 1
    target = tl.load(targets_ptr + i * r + j, mask=valid & (j < r), other=0)
    draft = tl.load(inputs_ptr + i * r + j + 1, mask=valid & (j < k), other=0)  # d_{j+1}, compared with t_j
    accepted = tl.min(tl.where((draft == target) & (j < k), k, j), axis=0)  # the first miss (k: none)
    accepted = tl.where(valid, accepted, 0)
    token = tl.sum(tl.where(j == accepted, target, 0), axis=0)
    tl.store(accepted_ptr + i, accepted.to(tl.int64), mask=valid)
    tl.store(token_ptr + i, token, mask=valid)
    base = tl.load(base_ptr + i, mask=valid, other=0)
    # first pass: positions base + 1 + j for j <= accepted (drafts, then the target's token)
    alive = live & (j <= accepted)
    ids = tl.where(j == accepted, token, tl.where(j < k, draft, token))
    pos = tl.where(alive, base + 1 + j, 0)
    block = tl.load(table_ptr + i * table_stride + tl.minimum(pos // block_size, width - 1), mask=alive, other=0)
    rows = i * r + j
    in_row = j < r
    tl.store(first_ids_ptr + rows, ids, mask=in_row)
    tl.store(first_pos_ptr + rows, pos, mask=in_row)
    tl.store(first_lens_ptr + rows, (pos + 1).to(tl.int32), mask=in_row)
    tl.store(first_slots_ptr + rows, tl.where(alive, block.to(tl.int64) * block_size + pos % block_size, -1),
             mask=in_row)
    tl.store(last_rows_ptr + i, i * r + accepted)
    # chained pass c at base + accepted + 2 + c, c < k - 1
    in_chain = j < k - 1
    cpos = tl.where(live, base + accepted + 2 + j, 0)
    cblock = tl.load(table_ptr + i * table_stride + tl.minimum(cpos // block_size, width - 1), mask=live & in_chain,
                     other=0)
    tl.store(chain_pos_ptr + j * chain_stride + i, cpos, mask=in_chain)
    tl.store(chain_lens_ptr + j * chain_stride + i, (cpos + 1).to(tl.int32), mask=in_chain)
    tl.store(chain_slots_ptr + j * chain_stride + i,
             tl.where(live, cblock.to(tl.int64) * block_size + cpos % block_size, -1), mask=in_chain)
    for w in range(0, dest_width, BLOCK_W):
        offs = w + tl.arange(0, BLOCK_W)
        row = tl.load(table_ptr + i * table_stride + offs, mask=live & (offs < width), other=0)
        tl.store(tables_ptr + i * dest_stride + offs, row, mask=offs < dest_width)


def accept_and_draft_rows_triton(inputs: torch.Tensor, targets: torch.Tensor, base: torch.Tensor,
                                 live: torch.Tensor | None, table: torch.Tensor, block_size: int,
                                 first_ids: torch.Tensor, first_positions: torch.Tensor, first_seq_lens: torch.Tensor,
                                 first_slots: torch.Tensor, last_rows: torch.Tensor, chain_positions: torch.Tensor,
                                 chain_seq_lens: torch.Tensor, chain_slots: torch.Tensor, draft_tables: torch.Tensor
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    n, r = inputs.shape
    inputs, targets, table = inputs.contiguous(), targets.contiguous(), table.contiguous()
    accepted = torch.empty(n, dtype=torch.int64, device=inputs.device)
    token = torch.empty(n, dtype=inputs.dtype, device=inputs.device)
    assert chain_positions.stride() == chain_seq_lens.stride() == chain_slots.stride() and chain_slots.stride(1) == 1
    _accept_draft_kernel[(last_rows.shape[0],)](
        inputs, targets, base, live if live is not None else base, table, accepted, token,
        first_ids, first_positions, first_seq_lens, first_slots, last_rows, chain_positions, chain_seq_lens,
        chain_slots, draft_tables, n, r, table.shape[1], draft_tables.shape[1], table.stride(0),
        chain_slots.stride(0), draft_tables.stride(0), block_size,
        HAS_LIVE=live is not None, BLOCK_R=triton.next_power_of_2(r), BLOCK_W=BLOCK_W, num_warps=1)
    return accepted, token
