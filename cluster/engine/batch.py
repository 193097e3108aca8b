"""HostBatch: one step's model inputs built on the host (numpy), from the scheduled requests and
their block tables: token ids, positions, per-sequence query starts and lengths, and per KV group
the padded block table and, for per-token groups, the slot of every new token. The model runner
turns it into device tensors (eager) or copies it into a captured graph's static buffers."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cluster.common.kv_spec import KVGroupSpec
from cluster.engine.scheduler import ScheduledRequest


@dataclass
class HostBatch:
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [B + 1] int32
    seq_lens: np.ndarray  # [B] int32
    block_tables: list[np.ndarray]  # per group [B, max_blocks] int32
    slot_mappings: list[np.ndarray | None]  # per group [T] int64 (per-token groups only)
    #: (row of the sequence's last token, the scheduled request) for rows to sample.
    sample_rows: list[tuple[int, ScheduledRequest]]
    #: A verify step: per row, its ordinal among the verified positions (-1: it is not one), and
    #: the row of the same request's previous one (-1: none); None in other steps (see
    #: ForwardContext).
    verify_slot: np.ndarray | None = None  # [T] int64
    verify_prev: np.ndarray | None = None  # [T] int64
    #: The most verified positions of one request in the step.
    verify_depth: int = 1
    #: Some chunk computes prompt rows (ScheduledRequest.prefill).
    prefill: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def decode_only(self) -> bool:
        return len(self.input_ids) == self.num_seqs


def build_host_batch(scheduled: list[ScheduledRequest], block_tables: dict[str, list[list[int]]],
                     specs: list[KVGroupSpec]) -> HostBatch:
    """The step's inputs. A verify step's positions (a request with draft tokens: its last known
    token, then the drafts) become one attention sequence each, of one query token over the
    request's blocks up to that position: each is computed exactly as a decode step of that
    position would be, so speculation changes no logit (and a batch of decodes and verifies is
    decode-only: it can replay a decode graph)."""
    counts = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=len(scheduled))
    starts = np.fromiter((s.num_computed_tokens for s in scheduled), dtype=np.int64, count=len(scheduled))
    ends = np.cumsum(counts)
    total = int(ends[-1]) if len(ends) else 0
    ids = np.empty(total, dtype=np.int64)
    for s, begin in zip(scheduled, (ends - counts).tolist()):
        known, n = s.token_ids, s.num_new_tokens
        ids[begin:begin + len(known)] = known
        ids[begin + len(known):begin + n] = 0  # sampled by the step in flight: filled on the device
    owner = np.arange(len(scheduled))  # the scheduled request of each attention sequence
    verify_slot = verify_prev = None
    if any(s.draft_token_ids for s in scheduled):  # a verify step: each verified position its own sequence
        split = np.array([bool(s.draft_token_ids) for s in scheduled])
        per_seq = np.where(split, counts, 1)
        owner = np.repeat(owner, per_seq)
        offset = np.arange(len(owner)) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)
        q_counts = np.where(split[owner], 1, counts[owner])
        seq_starts = starts[owner] + np.where(split[owner], offset, 0)
    else:
        q_counts, seq_starts = counts, starts
    query_start = np.zeros(len(owner) + 1, dtype=np.int32)
    np.cumsum(q_counts, out=query_start[1:])
    seq_index = np.repeat(np.arange(len(owner)), q_counts)
    positions = seq_starts[seq_index] + (np.arange(total) - query_start[:-1][seq_index])
    depth = 1
    if len(owner) != len(scheduled):  # a request's verified positions are consecutive one-token rows
        verified = split[owner[seq_index]]
        verify_slot = np.where(verified, np.cumsum(verified) - 1, -1)
        verify_prev = np.where(verified & (offset[seq_index] > 0), np.arange(total) - 1, -1)
        depth = int(counts[split].max())
    tables, slots = [], []
    for g, spec in enumerate(specs):
        rows = [block_tables[scheduled[i].request_id][g] for i in owner.tolist()]
        table = pad_tables(rows)
        tables.append(table)
        if spec.kind in ("full", "sliding_window"):
            blocks = table[seq_index, positions // spec.block_size].astype(np.int64)
            slots.append(blocks * spec.block_size + positions % spec.block_size)
        else:
            slots.append(None)
    sample_rows = [(int(ends[i]) - 1, s) for i, s in enumerate(scheduled) if s.sampling]
    return HostBatch(ids, positions, query_start, (seq_starts + q_counts).astype(np.int32), tables, slots,
                     sample_rows, verify_slot, verify_prev, depth, any(s.prefill for s in scheduled))


def pad_tables(rows: Sequence[Sequence[int]], out: np.ndarray | None = None) -> np.ndarray:
    """Ragged block tables as one array, each row padded with block 0 (the null block): written into
    the first rows of ``out`` (zeros past each table) where given, else a new int32 array as wide
    as the widest table (at least 1)."""
    if out is None:
        out = np.zeros((len(rows), max(1, max((len(r) for r in rows), default=1))), dtype=np.int32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def take_pending_tokens(input_ids: torch.Tensor, rows: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """``input_ids`` with entry ``i`` replaced by ``previous[rows[i]]`` where ``rows[i] >= 0``: the
    tokens a pipelined step takes from the samples of the step still in flight, on the device."""
    picked = previous.index_select(0, rows.clamp(min=0, max=previous.numel() - 1))
    return torch.where(rows >= 0, picked, input_ids)
