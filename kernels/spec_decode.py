"""Speculative decoding's bookkeeping on the device (pure-torch references): the rows of a verify
step and of the draft head's next proposal, computed from values on the device alone, so a
pipelined step needs no host value and, in a CUDA graph, two launches instead of about eighty.

A request ``i`` of a verify step has ``r = k + 1`` input tokens ``inputs[i]`` (its last known
token, then ``k`` drafts) at positions ``base[i] ..``; ``table [n, W]`` holds its KV blocks of
``block_size`` tokens. Requests whose ``live`` entry is false (padding up to a graph's size)
read the null block (position 0, table of zeros) and write nowhere (slot -1); ``live=None``:
every request is live. Output buffers
may be longer than the requests need: their tails get the same padding values.
"""
from __future__ import annotations

import torch


def _every(live: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
    """``live``, or every request live (None)."""
    return torch.ones(n, dtype=torch.bool, device=device) if live is None else live


def _slots(table: torch.Tensor, positions: torch.Tensor, block_size: int, live: torch.Tensor) -> torch.Tensor:
    """The KV slot of ``positions [n, m]`` in each request's ``table [n, W]`` row; -1 where not live."""
    blocks = table.gather(1, (positions // block_size).clamp(max=table.shape[1] - 1)).long()
    return torch.where(live, blocks * block_size + positions % block_size, -1)


def _fill(buffer: torch.Tensor, values: torch.Tensor, pad: int) -> None:
    """``buffer`` starts with ``values`` (flattened) and is ``pad`` after them."""
    n = values.numel()
    buffer[:n].copy_(values.reshape(-1))
    buffer[n:].fill_(pad)


def _copy_tables(dest: torch.Tensor, table: torch.Tensor, live: torch.Tensor) -> None:
    """``dest [N, Wd]``: row ``i < n`` is ``table[i]`` where live (zeros past its width), else zeros."""
    dest.zero_()
    dest[:table.shape[0], :table.shape[1]].copy_(torch.where(live[:, None], table, 0))


def verify_rows_ref(inputs: torch.Tensor, base: torch.Tensor, live: torch.Tensor | None, table: torch.Tensor,
                    block_size: int, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
                    slots: torch.Tensor, block_tables: torch.Tensor) -> None:
    """A verify step's decode rows: row ``i * r + j`` is request ``i``'s input ``j``, one query at
    ``base[i] + j`` over its blocks (``block_tables`` gets the request's table row). Fills the
    first ``R >= n * r`` entries of ``input_ids, positions [R]`` int64, ``seq_lens [R]`` int32,
    ``slots [R]`` int64 and ``block_tables [R, Wd]`` int32."""
    n, r = inputs.shape
    live = _every(live, n, inputs.device)
    alive = live[:, None].expand(n, r)
    pos = torch.where(alive, base[:, None] + torch.arange(r, device=base.device), 0)  # [n, r]
    _fill(input_ids, inputs, 0)
    _fill(positions, pos, 0)
    _fill(seq_lens, pos + 1, 1)
    verify_group_rows_ref(base, live, r, table, block_size, slots, block_tables)


def accept_and_draft_rows_ref(inputs: torch.Tensor, targets: torch.Tensor, base: torch.Tensor, live: torch.Tensor | None,
                              table: torch.Tensor, block_size: int, first_ids: torch.Tensor,
                              first_positions: torch.Tensor, first_seq_lens: torch.Tensor, first_slots: torch.Tensor,
                              last_rows: torch.Tensor, chain_positions: torch.Tensor, chain_seq_lens: torch.Tensor,
                              chain_slots: torch.Tensor, draft_tables: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept request ``i``'s drafts while ``inputs[i, j + 1] == targets[i, j]`` (``targets
    [n, r]``: the target's token at each verified position) and lay out the draft head's next
    proposal: its first pass over the positions ``base + 1 .. base + accepted + 1`` (the
    accepted drafts, then the target's token after them), ``r`` rows a request with the rows past
    those writing nowhere, ``last_rows`` the newest of them; chained pass ``c`` (of ``k - 1``) at
    ``base + accepted + 2 + c``; ``draft_tables`` the requests' tables. Fills the first
    ``S >= n`` requests' entries of ``first_* [S * r]``, ``last_rows [S]``, ``chain_* [k - 1, S]``
    (``[1, S]`` unused when ``k == 1``) and ``draft_tables [S, Wd]``. Returns ``(accepted [n],
    token [n])``."""
    n, r = inputs.shape
    k = r - 1
    dev = inputs.device
    live = _every(live, n, dev)
    accepted = (inputs[:, 1:] == targets[:, :-1]).long().cumprod(dim=1).sum(dim=1)  # [n]
    token = targets.gather(1, accepted[:, None])[:, 0]
    j = torch.arange(r, device=dev)[None, :]
    alive = (j <= accepted[:, None]) & live[:, None]  # [n, r]
    ids = torch.where(j == accepted[:, None], token[:, None], torch.cat((inputs[:, 1:], token[:, None]), dim=1))
    pos = torch.where(alive, base[:, None] + 1 + j, 0)
    _fill(first_ids, ids, 0)
    _fill(first_positions, pos, 0)
    _fill(first_seq_lens, pos + 1, 1)
    _fill(first_slots, _slots(table, pos, block_size, alive), -1)
    s = last_rows.shape[0]
    last_rows.copy_(torch.arange(s, device=dev) * r)
    last_rows[:n] += accepted
    if k > 1:
        chain = torch.where(live[:, None], (base + accepted + 1)[:, None] + j[:, 1:k], 0)  # [n, k - 1]
        slots = _slots(table, chain, block_size, live[:, None].expand(n, k - 1))
        for buffer, values, pad in ((chain_positions, chain, 0), (chain_seq_lens, chain + 1, 1), (chain_slots, slots, -1)):
            buffer[:, :n].copy_(values.T)
            buffer[:, n:].fill_(pad)
    _copy_tables(draft_tables, table, live)
    return accepted, token


def verify_group_rows_ref(base: torch.Tensor, live: torch.Tensor | None, r: int, table: torch.Tensor,
                          block_size: int, slots: torch.Tensor | None, block_tables: torch.Tensor) -> None:
    """A verify step's rows in one KV group (``verify_rows_ref`` lays out the first group with the
    rows' tokens and positions; a model with several calls this for each other group): row ``i * r + j`` gets request ``i``'s ``table [n, W]`` row of that group and,
    for a per-token group (``slots`` given), the slot of position ``base[i] + j``. Fills the first
    ``R >= n * r`` entries of ``slots [R]`` (where given) and ``block_tables [R, Wd]``."""
    n = base.shape[0]
    alive = _every(live, n, base.device)[:, None].expand(n, r)
    if slots is not None:
        pos = torch.where(alive, base[:, None] + torch.arange(r, device=base.device), 0)
        _fill(slots, _slots(table, pos, block_size, alive), -1)
    _copy_tables(block_tables, table.repeat_interleave(r, dim=0), alive.reshape(-1))


def verify_chain_ref(n: int, r: int, live: torch.Tensor | None, verify_slot: torch.Tensor,
                     verify_prev: torch.Tensor) -> None:
    """A verify step's rows for a model with ``state`` KV groups (see ``ForwardContext``): row
    ``t = i * r + j`` of a live request is verified position ``t`` (its state goes to scratch row
    ``t``) and, for ``j > 0``, pools from row ``t - 1``'s state; padding rows are neither (-1).
    Fills the first ``R >= n * r`` entries of ``verify_slot, verify_prev [R]`` int64."""
    dev = verify_slot.device
    alive = _every(live, n, dev)[:, None].expand(n, r)
    t = torch.arange(n * r, device=dev).view(n, r)
    _fill(verify_slot, torch.where(alive, t, -1), -1)
    _fill(verify_prev, torch.where(alive & (t % r > 0), t - 1, -1), -1)


def commit_states_ref(cache: torch.Tensor, scratch: torch.Tensor, table: torch.Tensor, base: torch.Tensor,
                      accepted: torch.Tensor, live: torch.Tensor | None, r: int, block_size: int) -> None:
    """After a verify step of ``n`` requests of ``r`` rows laid out by ``verify_chain_ref``, on the
    device: request ``i``'s state after verified position ``base[i] + j`` (``scratch`` row ``i * r
    + j``) goes to the block of ``table [n, W]`` (a ``state`` group's) that holds that position's
    checkpoint, where ``j`` is kept: the newest accepted position (``j == accepted[i]``) and each
    accepted one that ends a block (as a prefill chunk checkpoints: ``checkpoint_positions``). The
    rows not kept, and padding requests', go to the null block (block 0), which takes any write.
    ``cache [num_blocks, ...]`` and ``scratch [> n * r, ...]``: the group's blocks and the verified
    positions' states, alike past the first dimension."""
    n = base.shape[0]
    dev = base.device
    j = torch.arange(r, device=dev)[None, :]
    pos = base[:, None] + j  # [n, r]
    newest = accepted[:, None]
    keep = (j <= newest) & ((j == newest) | (pos % block_size == block_size - 1))
    keep &= _every(live, n, dev)[:, None]
    blocks = table.gather(1, (pos // block_size).clamp(max=table.shape[1] - 1)).long()
    cache.index_copy_(0, torch.where(keep, blocks, 0).reshape(-1), scratch[:n * r])
