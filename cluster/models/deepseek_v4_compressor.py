"""DeepSeek-V4 compressors: pooling each window of ``R`` tokens into one compressed entry, chunk by
chunk, with the window in progress carried between chunks in the ``state`` KV group.

Each token projects a value ``kv`` and a gate (plus a learned per-slot bias ``ape``); an entry is
the per-channel softmax-over-gates weighted mean of its window's values, RMS-normalised and rotated
(compress RoPE) at position ``entry * R``. HCA pools plain windows. CSA windows overlap: its
projections are twice as wide, and entry ``w`` pools the first halves (series A) of window
``w - 1``'s tokens together with the second halves (series B) of window ``w``'s tokens. The CSA
layer's lightning indexer pools the same windows at its own width, so its channels ride along.

A chunk starts at any position: the pools are carried as ``(lse, mean)`` pairs (see
``kernels.deepseek_v4_ref``) read from the checkpoint before the chunk's first token, and the
checkpoint after every token block the chunk completes (and after its last token) is written back.

A decode step (one new token per sequence) takes :func:`decode_step` instead: the whole batch at
once, with device tensors only (no loop over sequences, no host synchronisation): each carried
pool merges its one token, the checkpoint after it is written, and every sequence reports the
entry its window would complete with a ``done`` flag (the caller stores only those).

A verify step (speculative decoding: a request's next positions, each its own one-token row) must
leave the state of a request that never saw the rejected drafts: a verified position pools from
its predecessor's state (not the state groups'), and its state goes to a row of
``ForwardContext.verify_states`` instead of the state group; the engine copies the last accepted
position's into its checkpoint block afterwards (``ModelRunner.commit_verified``). Entries the
rejected positions complete are stored (they are not visible before their window's last position,
which writes them again).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from cluster.common.kv_spec import checkpoint_positions
from cluster.models.context import ForwardContext
from cluster.models.deepseek_v4_layers import V4RMSNorm
from cluster.models.layers import Linear
from cluster.models.ops import REFERENCE_OPS, Ops
from kernels.deepseek_v4_ref import (EMPTY_LSE, compress_decode_ref, empty_pools, merge_pools_ref,
                                     softmax_pool_prefix_ref, state_blocks)


class CompressorWeights(nn.Module):
    """One compressor's parameters: ``wkv``, ``wgate`` (``hidden -> width``), the per-slot gate bias
    ``ape [R, width]`` and the entry norm (over ``dim`` channels)."""

    def __init__(self, hidden: int, width: int, dim: int, ratio: int, eps: float, dtype: torch.dtype,
                 ops: Ops = REFERENCE_OPS) -> None:
        super().__init__()
        self.ratio = ratio
        self.wkv = Linear(hidden, width, False, dtype)
        self.wgate = Linear(hidden, width, False, dtype)
        self.ape = nn.Parameter(torch.empty(ratio, width, dtype=torch.float32), requires_grad=False)
        self.norm = V4RMSNorm(dim, eps, ops)

    def finish(self, kv: torch.Tensor, gate: torch.Tensor, positions: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``wkv(h)``, ``wgate(h)`` -> values and biased gates ``[T, width]`` (float32)."""
        return kv.float(), gate.float() + self.ape[positions % self.ratio]


@dataclass
class PooledChunk:
    """One sequence's chunk, pooled: the entries its completed windows produce and the running
    pools at each of its slots (for checkpoints)."""

    first_window: int
    entries: torch.Tensor  # [num_complete, C] pooled means, entry index first_window + i
    lse_b: torch.Tensor  # [W, R, C] series B (the entry in progress)
    mean_b: torch.Tensor
    lse_a: torch.Tensor | None  # [W, R, C] series A (overlap part), CSA only
    mean_a: torch.Tensor | None

    def states_at(self, positions: list[int], ratio: int) -> torch.Tensor:
        """The checkpoints after ``positions``: ``[P, 2, C]`` (HCA) or ``[P, 2, 2, C]`` (CSA), in one
        gather (a prefill chunk checkpoints every block)."""
        device = self.lse_b.device
        pos = torch.tensor(positions, device=device)
        i, j = pos // ratio - self.first_window, pos % ratio
        completed = (j == ratio - 1)[:, None, None]  # the window's entry is done: nothing in progress
        b = torch.stack([self.lse_b[i, j], self.mean_b[i, j]], dim=1)  # [P, 2, C]
        empty = torch.stack([torch.full_like(b[:, 0], EMPTY_LSE), torch.zeros_like(b[:, 1])], dim=1)
        if self.lse_a is None:
            return torch.where(completed, empty, b)
        assert self.mean_a is not None
        a = torch.stack([self.lse_a[i, j], self.mean_a[i, j]], dim=1)  # [P, 2, C]
        # In progress: [entry so far, overlap part so far]; completed: [overlap part -> next entry, empty].
        return torch.where(completed[..., None], torch.stack([a, empty], dim=1), torch.stack([b, a], dim=1))


def pool_chunk(series_b: tuple[torch.Tensor, torch.Tensor], series_a: tuple[torch.Tensor, torch.Tensor] | None,
               start: int, ratio: int, carry: torch.Tensor) -> PooledChunk:
    """Pool tokens ``[start, start + n)`` of one sequence. ``series_*`` are (gate, value) ``[n, C]``;
    ``carry`` is the checkpoint after ``start - 1`` (``[2, C]`` or ``[2, 2, C]``)."""
    gate_b, value_b = series_b
    n, width = gate_b.shape
    first, last = start // ratio, (start + n - 1) // ratio
    num_windows = last - first + 1
    slots = torch.arange(n, device=gate_b.device) + (start - first * ratio)

    def windows(gate: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.full((num_windows * ratio, width), float("-inf"), device=gate.device)
        v = torch.zeros((num_windows * ratio, width), device=gate.device)
        g[slots], v[slots] = gate, value
        return g.view(num_windows, ratio, width), v.view(num_windows, ratio, width)

    carry_b = carry if series_a is None else carry[0]
    lse_b, mean_b = softmax_pool_prefix_ref(*windows(gate_b, value_b), carry_b[0], carry_b[1])
    lse_a = mean_a = None
    if series_a is not None:
        lse_a, mean_a = softmax_pool_prefix_ref(*windows(*series_a), carry[1][0], carry[1][1])
        if num_windows > 1:  # window w's entry also pools window w - 1's series A
            lse_b[1:], mean_b[1:] = merge_pools_ref(lse_a[:-1, -1:], mean_a[:-1, -1:], lse_b[1:], mean_b[1:])
    num_complete = (start + n) // ratio - first
    return PooledChunk(first, mean_b[:num_complete, -1], lse_b, mean_b, lse_a, mean_a)


class ChunkCompressor:
    """Runs one compressed layer's pooling for a batch: reads each sequence's carried state, pools
    its chunk, writes checkpoints, and returns the new entries to store."""

    def __init__(self, ratio: int, state_group: int, state_layer: int) -> None:
        self.ratio = ratio
        self.state_group = state_group
        self.state_layer = state_layer

    def run(self, series_b: tuple[torch.Tensor, torch.Tensor],
            series_a: tuple[torch.Tensor, torch.Tensor] | None, ctx: ForwardContext
            ) -> list[tuple[int, int, torch.Tensor]]:
        """Per sequence with new entries: (sequence, first entry index, pooled means ``[m, C]``)."""
        states = ctx.kv_caches[self.state_group][:, self.state_layer]  # [num_blocks, *state]
        table = ctx.block_tables[self.state_group].tolist()  # one device sync per layer, not per sequence
        block_size = ctx.block_sizes[self.state_group]
        verify = ctx.verify_prev_cpu if ctx.verify_states is not None else None
        scratch = ctx.verify_states[self.state_group] if ctx.verify_states is not None else None
        verified: dict[int, torch.Tensor] = {}  # a verify step's states, by row: a row's carry is its predecessor's
        out = []
        q = ctx.query_start_loc_cpu
        for i, seq_len in enumerate(ctx.seq_lens_cpu):
            rows = slice(q[i], q[i + 1])
            n = q[i + 1] - q[i]
            if n == 0:
                continue
            start = seq_len - n
            if verify is not None and verify[q[i]] >= 0:
                carry = verified[verify[q[i]]]
            elif start > 0:
                carry = states[table[i][(start - 1) // block_size]].float()
            else:
                carry = empty_pools(tuple(states.shape[1:]), states.device)
            chunk = pool_chunk((series_b[0][rows], series_b[1][rows]),
                               None if series_a is None else (series_a[0][rows], series_a[1][rows]),
                               start, self.ratio, carry)
            slot = ctx.verify_slot_cpu[q[i]] if ctx.verify_slot_cpu is not None else -1
            if scratch is not None and slot >= 0:
                # a verified position (one token): its state waits for the acceptance (commit_verified)
                verified[q[i]] = chunk.states_at([start], self.ratio)[0]
                scratch[slot, self.state_layer] = verified[q[i]].to(scratch.dtype)
            else:
                positions = checkpoint_positions(start, seq_len, block_size)
                blocks = torch.tensor([table[i][p // block_size] for p in positions], device=states.device)
                states[blocks] = chunk.states_at(positions, self.ratio).to(states.dtype)
            if chunk.entries.shape[0]:
                out.append((i, chunk.first_window, chunk.entries))
        return out


@dataclass
class DecodeEntries:
    """One decode step's pooled entries, one row per sequence: ``pooled [B, C]`` is the entry of
    window ``index [B]``, complete where ``done [B]`` (elsewhere a partial pool, not to store)."""

    pooled: torch.Tensor
    index: torch.Tensor
    done: torch.Tensor


def decode_step(projections: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None],
                ctx: ForwardContext, ratio: int, state_group: int, state_layer: int,
                advance: Callable[..., tuple[torch.Tensor, torch.Tensor]] = compress_decode_ref) -> DecodeEntries:
    """Pool one token per sequence (``projections``: the compressor's gate and value ``[B, W]`` and,
    for CSA, its indexer compressor's or None; row i sequence i): the same pools as
    :class:`ChunkCompressor` on chunks of one token. ``advance`` is the one-token merge
    (``Ops.v4_compress_decode``)."""
    states = ctx.kv_caches[state_group][:, state_layer]  # [num_blocks, *state]
    pos = ctx.positions.long()
    before, after = state_blocks(ctx.block_tables[state_group], pos, ctx.block_sizes[state_group])
    carry = states[before]  # [B, *state]; a first token's (position 0) is ignored: an empty pool
    done = pos % ratio == ratio - 1  # the token completes its window's entry
    state, mean_b = advance(carry, pos, ratio, *projections)
    if ctx.verify_states is not None and ctx.verify_prev is not None and ctx.verify_slot is not None:
        # A verify step: a verified position's carry is its predecessor's state (a scan over the
        # request's positions, as deep as the step's longest), and its state waits in a row of its
        # own for the acceptance (ModelRunner.commit_verified); the null block takes its write.
        chained = (ctx.verify_prev >= 0).view(-1, *([1] * (carry.dim() - 1)))
        predecessor = ctx.verify_prev.clamp(min=0)
        for _ in range(ctx.verify_depth - 1):
            state, mean_b = advance(torch.where(chained, state[predecessor], carry), pos, ratio, *projections)
        scratch = ctx.verify_states[state_group]
        assert scratch is not None
        verified = ctx.verify_slot >= 0
        scratch[torch.where(verified, ctx.verify_slot, scratch.shape[0] - 1), state_layer] = state.to(scratch.dtype)
        after = torch.where(verified, 0, after)
    states[after] = state.to(states.dtype)
    return DecodeEntries(mean_b, pos // ratio, done)
