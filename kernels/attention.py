"""Paged attention, pure-torch reference.

KV cache layout, per layer: ``k_cache``/``v_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``
(possibly strided views into one storage tensor that holds every layer's blocks). A token at
position ``p`` of a sequence lives in block ``block_table[p // block_size]`` at offset
``p % block_size``; its flat slot is ``block_id * block_size + offset``.

A batch is a flat run of query tokens: sequence ``i`` owns query rows
``query_start_loc[i]:query_start_loc[i+1]``, which are its *last* ``q_len`` positions out of
``seq_lens[i]`` (the cached prefix plus the new tokens), so causal masking is offset by
``seq_len - q_len``.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class PagedAttentionMetadata:
    """Per-batch metadata, on the model's device. The ``*_cpu`` lists mirror the tensors for host-side
    loops (the CPU reference), so they never force a device sync."""

    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32, tokens in context after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64, where each new token's KV is written
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


def write_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   k: torch.Tensor, v: torch.Tensor) -> None:
    """Scatter new keys/values ``[T, Hkv, D]`` into their slots. Slots < 0 are skipped (padding)."""
    keep, blocks, offsets = split_slots(slot_mapping, k_cache.shape[1])
    if keep is not None:
        k, v = k[keep], v[keep]
    k_cache[blocks, offsets] = k.to(k_cache.dtype)
    v_cache[blocks, offsets] = v.to(v_cache.dtype)


#: The last slot mapping split into (rows kept, blocks, offsets), with what it was computed from:
#: every layer of a step writes the same slots, so a step splits them once, not once per layer
#: (on a CPU, where this path serves every step, the split cost more than the write).
_last_split: tuple[Any, int, int, tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]] | None = None


def split_slots(slot_mapping: torch.Tensor, block_size: int
                ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``slot_mapping [T]`` -> (the rows to keep, or None when every slot is >= 0; the kept
    slots' blocks; their offsets), computed once for all the layers of a step that ask."""
    global _last_split
    version = None if slot_mapping.is_inference() else slot_mapping._version  # inference tensors have none
    last = _last_split
    if version is not None and last is not None and last[0]() is slot_mapping and last[1] == version \
            and last[2] == block_size:
        return last[3]
    if slot_mapping.device.type == "cpu":
        # on the host, numpy's arithmetic costs a fraction of torch's per-op dispatch, which on a
        # small model's CPU decode step is a measurable share of the step
        host = slot_mapping.numpy()
        valid_np = host >= 0
        keep = None if valid_np.all() else torch.from_numpy(valid_np)
        kept = host if keep is None else host[valid_np]
        split = (keep, torch.from_numpy(kept // block_size), torch.from_numpy(kept % block_size))
    else:
        valid = slot_mapping >= 0
        keep = None if bool(valid.all()) else valid
        slots = slot_mapping if keep is None else slot_mapping[keep]
        split = (keep, torch.div(slots, block_size, rounding_mode="floor"), slots % block_size)
    if version is not None:
        _last_split = (weakref.ref(slot_mapping), version, block_size, split)
    return split


def block_list(block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """The first ``num_blocks`` blocks of every row of ``block_tables [B, max_blocks]``, as one
    flat int64 list ``[B * num_blocks]`` (a CPU table's through numpy: one op, not three)."""
    if block_tables.device.type == "cpu":
        return torch.from_numpy(block_tables.numpy()[:, :num_blocks].reshape(-1).astype("int64"))
    return block_tables[:, :num_blocks].reshape(-1).long()


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: PagedAttentionMetadata, scale: float,
                        sliding_window: int | None = None) -> torch.Tensor:
    """Causal GQA attention of ``q [T, Hq, D]`` over each sequence's paged KV; returns ``[T, Hq, D]``."""
    if meta.decode_only:
        return _decode_batched(q, k_cache, v_cache, meta, scale, sliding_window)
    out = torch.empty_like(q)
    attend_sequences(q, k_cache, v_cache, meta, scale, sliding_window, range(meta.num_seqs), out)
    return out


def attend_sequences(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: PagedAttentionMetadata, scale: float, sliding_window: int | None,
                     seqs: Iterable[int], out: torch.Tensor) -> None:
    """:func:`paged_attention_ref`'s per-sequence path for the sequences ``seqs`` only: their query
    rows of ``out`` are written, the others left as they are (a caller that runs some rows
    elsewhere, as the CPU-native decode kernel does a mixed step's one-token rows)."""
    block_size = k_cache.shape[1]
    for i in seqs:
        start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        seq_len = meta.seq_lens_cpu[i]
        q_len = end - start
        if q_len == 0:
            continue
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = meta.block_tables[i, :num_blocks].long()
        k = k_cache[blocks].flatten(0, 1)[:seq_len]  # [S, Hkv, D]
        v = v_cache[blocks].flatten(0, 1)[:seq_len]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [q_len, S]
        if sliding_window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
        out[start:end] = _sdpa(q[start:end].unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                               mask[None, None], scale)[0]


def _decode_batched(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: PagedAttentionMetadata, scale: float,
                    sliding_window: int | None) -> torch.Tensor:
    """One query token per sequence: gather every sequence's blocks at once and mask the padding.

    The gather is one ``index_select`` over the blocks' flat list (a block's entries are
    contiguous, whatever the layer stride of the storage): advanced indexing with the ``[B, nb]``
    table took about twice as long on a CPU, where this path serves every decode step. One
    sequence with no window needs no mask: its keys are cut to its length."""
    block_size = k_cache.shape[1]
    num_blocks = (meta.max_seq_len + block_size - 1) // block_size
    batch = q.shape[0]
    blocks = block_list(meta.block_tables, num_blocks)  # [B * nb]
    k = k_cache.index_select(0, blocks).view(batch, num_blocks * block_size, *k_cache.shape[2:])
    v = v_cache.index_select(0, blocks).view(batch, num_blocks * block_size, *v_cache.shape[2:])
    if batch == 1 and sliding_window is None:
        seq_len = meta.seq_lens_cpu[0]
        return _sdpa(q.unsqueeze(1), k[:, :seq_len], v[:, :seq_len], None, scale)[:, 0]
    k_pos = torch.arange(k.shape[1], device=q.device)
    seq_lens = meta.seq_lens.to(q.device).long()
    mask = k_pos[None, :] < seq_lens[:, None]  # [B, S]
    if sliding_window is not None:
        mask &= k_pos[None, :] >= (seq_lens[:, None] - sliding_window)
    out = _sdpa(q.unsqueeze(1), k, v, mask[:, None, None, :], scale)  # [B, 1, Hq, D]
    return out[:, 0]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          scale: float) -> torch.Tensor:
    """``q [B, Lq, Hq, D]``, ``k/v [B, Lk, Hkv, D]``, boolean ``mask`` broadcastable to
    ``[B, Hq, Lq, Lk]`` (None: every key) -> ``[B, Lq, Hq, D]``."""
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    # GQA without materialising repeated K/V heads
    out = F.scaled_dot_product_attention(qt, kt.to(qt.dtype), vt.to(qt.dtype), attn_mask=mask, scale=scale,
                                         enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)
