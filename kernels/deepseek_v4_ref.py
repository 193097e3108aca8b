"""DeepSeek-V4 attention ops, pure-torch references (the targets of the Triton kernels).

- Compressor pooling: a compressed entry is a per-channel softmax-weighted mean of its window's
  token projections (weights from the gates). ``softmax_pool_prefix_ref`` computes, for every
  window slot, the running pool of the slots so far as a ``(lse, mean)`` pair per channel (the
  log-sum-exp of the gates seen and the weighted mean of the values), starting window 0 from a
  carried pair; ``merge_pools_ref`` combines two pairs. An empty pool is ``(EMPTY_LSE, 0)``.
- ``indexer_topk_ref``: the lightning indexer's scores ``sum_h w[t, h] * relu(q[t, h] . k[e]) * scale``
  over a sequence's compressed keys and the top-k entries each query may see (entry ``e`` covers
  tokens ``[e * R, (e + 1) * R)`` and is visible to positions ``>= (e + 1) * R - 1``: the token
  that completes a window already sees its entry, in prefill as in decode, as DeepSeek's reference
  inference code has it). Equal scores rank by entry index, lowest first: the ReLU makes exact
  ties common (every head's dot product negative gives 0), and a top-k that breaks them by the
  shape of its input picks other entries in a one-pass prefill than in decode (transformers'
  full and cached forwards part that way on small configs).
- ``sparse_attention_ref``: single-KV-head attention (the entry is both K and V) of each query over
  its sliding window of token entries plus compressed entries (every visible one, or the indexer's
  picks), with a per-head attention sink in the softmax's denominator.
- ``compress_decode_ref``: a compressor's pools after one more token per row (a decode or verify
  step): the carried window(s) merge the token's gate and value, and a window the token completes
  restarts (CSA: its overlap half becomes the next entry's start).
- ``compress_store_ref``: a decode step's completed entries (or CSA's indexer keys): RMS-normalised
  with the compressor's norm weight, the tail rotated by the compress RoPE at the entry's first
  position, written to the paged cache where the token completed its window.
- ``norm_rope_ref``: a head-major row's RMS norm (weighted, unweighted or none) and the rotation of
  its trailing RoPE channels (interleaved pairs; ``inverse`` rotates back), optionally written to a
  paged token cache: the queries, the window's KV entry and the attention output of every layer.
- ``route_ref``: the MoE router after its gate projection: scores (``sqrtsoftplus``, ``sigmoid`` or
  ``softmax`` of the logits), the top-k experts by score plus the correction bias (or, in hash
  layers, the token id's frozen experts), their scores renormalised and scaled.
- ``hc_pre_ref`` / ``hc_post_ref``: the manifold-constrained hyper-connections around every block:
  the N residual streams collapsed into the block's input by "pre" weights, and the block output
  spread back with "post" weights plus the Sinkhorn-projected (doubly stochastic) "comb" mixing of
  the streams, all computed from the RMS-normalised streams.

Paged layouts, per layer: token entries ``[num_blocks, block_size, D]`` (position ``p`` in block
``table[p // block_size]``), compressed entries ``[num_blocks, entries_per_block, D]``. A batch is a
flat run of query tokens: sequence ``i`` owns rows ``query_start_loc[i]:query_start_loc[i + 1]``, its
last ``q_len`` positions out of ``seq_lens[i]``. The ops take the batch as host lists
(``query_start_loc_cpu``, ``seq_lens_cpu``); their kernels (``kernels.triton_deepseek_v4_*``) also
take device copies as the keyword arguments ``query_start_loc`` / ``seq_lens``, which the
references accept and ignore, so that every implementation has one signature.
"""
from __future__ import annotations

import torch

from kernels.norm import rms_norm_ref
from kernels.rotary import apply_rotary_ref, rope_cos_sin

#: The log-sum-exp of an empty pool: finite, so merging two empty pools stays well defined.
EMPTY_LSE = -1e30


def empty_pools(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Float32 ``(lse, mean)`` pairs of empty pools: ``shape [..., 2, C]``, ``[..., 0, :]`` the lse."""
    state = torch.zeros(shape, device=device)
    state[..., 0, :] = EMPTY_LSE
    return state


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim without a weight, the scale computed in float32, in ``x``'s dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def softmax_pool_prefix_ref(gate: torch.Tensor, value: torch.Tensor, carry_lse: torch.Tensor,
                            carry_mean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``gate``, ``value [W, R, C]`` (absent slots have gate ``-inf``) and a carried pool
    ``[C]`` folded into window 0 -> running pools ``(lse, mean) [W, R, C]`` in float32."""
    gate, value = gate.float(), value.float()
    carry = torch.full_like(gate[:, :1], float("-inf"))
    carry[0, 0] = carry_lse.float()
    ref = torch.maximum(gate.amax(dim=1, keepdim=True), carry)  # [W, 1, C], finite per window
    weight = torch.exp(gate - ref)
    total = torch.cumsum(weight, dim=1)
    weighted = torch.cumsum(weight * value, dim=1)
    carried = torch.exp(carry - ref)  # zero but for window 0
    total = total + carried
    weighted = weighted + carried * torch.where(carry.isfinite(), carry_mean.float(), 0.0)
    present = total > 0
    lse = torch.where(present, ref + torch.log(torch.where(present, total, 1.0)), EMPTY_LSE)
    mean = torch.where(present, weighted / torch.where(present, total, 1.0), 0.0)
    return lse, mean


def merge_pools_ref(lse_a: torch.Tensor, mean_a: torch.Tensor, lse_b: torch.Tensor, mean_b: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool of the union of two disjoint pools (broadcasting)."""
    lse = torch.logaddexp(lse_a, lse_b)
    return lse, mean_a * torch.exp(lse_a - lse) + mean_b * torch.exp(lse_b - lse)


def gather_entries(cache: torch.Tensor, table: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Entries ``[start, end)`` of one sequence from a paged cache ``[num_blocks, per_block, D]``."""
    per_block = cache.shape[1]
    idx = torch.arange(start, end, device=cache.device)
    blocks = table.long()[idx // per_block]
    return cache[blocks, idx % per_block]


def indexer_topk_ref(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                     index_tables: torch.Tensor, query_start_loc_cpu: list[int], seq_lens_cpu: list[int],
                     compress_ratio: int, topk: int, scale: float, *,
                     query_start_loc: torch.Tensor | None = None,
                     seq_lens: torch.Tensor | None = None) -> torch.Tensor:
    """``q [T, Hi, Di]``, ``weights [T, Hi]`` -> ``[T, topk]`` int64 entry indices, ``-1`` where a query
    sees fewer than ``topk`` entries (order within a row is unspecified; ties go to the lowest
    entry index)."""
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int64, device=q.device)
    for i in range(len(seq_lens_cpu)):
        start, end = query_start_loc_cpu[i], query_start_loc_cpu[i + 1]
        seq_len = seq_lens_cpu[i]
        num_entries = seq_len // compress_ratio
        if end == start or num_entries == 0:
            continue
        keys = gather_entries(index_cache, index_tables[i], 0, num_entries).float()  # [E, Di]
        scores = torch.relu(torch.einsum("thd,ed->the", q[start:end].float(), keys)) * scale
        scores = (scores * weights[start:end].float().unsqueeze(-1)).sum(dim=1)  # [q_len, E]
        positions = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        visible = (positions + 1) // compress_ratio  # entries each query may see
        future = torch.arange(num_entries, device=q.device)[None, :] >= visible[:, None]
        k = min(topk, num_entries)
        # a stable descending sort ranks equal scores by entry index (torch.topk leaves ties open)
        picked = scores.masked_fill(future, float("-inf")).sort(dim=-1, descending=True, stable=True).indices[:, :k]
        out[start:end, :k] = torch.where(picked >= visible[:, None], -1, picked)
    return out


def sparse_attention_ref(q: torch.Tensor, window_cache: torch.Tensor, window_tables: torch.Tensor,
                         compressed_cache: torch.Tensor | None, compressed_tables: torch.Tensor | None,
                         topk_indices: torch.Tensor | None, sinks: torch.Tensor,
                         query_start_loc_cpu: list[int], seq_lens_cpu: list[int], window: int,
                         compress_ratio: int, scale: float, *,
                         query_start_loc: torch.Tensor | None = None,
                         seq_lens: torch.Tensor | None = None, min_position: int = 0) -> torch.Tensor:
    """``q [T, H, D]`` -> ``[T, H, D]``. Each query at position ``p`` attends the token entries at
    ``(p - window, p]`` from ``min_position`` on (an MTP layer's entry 0 has no target state
    before it) and, with a compressed cache, the compressed entries ``topk_indices[t]``
    (``-1`` skipped) or, when ``topk_indices`` is None, every entry ``e < (p + 1) // compress_ratio``."""
    out = torch.empty_like(q)
    for i in range(len(seq_lens_cpu)):
        start, end = query_start_loc_cpu[i], query_start_loc_cpu[i + 1]
        if end == start:
            continue
        seq_len, q_len = seq_lens_cpu[i], end - start
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        first = min(seq_len, max(min_position, seq_len - q_len - window + 1))
        keys = gather_entries(window_cache, window_tables[i], first, seq_len)  # [S, D]
        k_pos = torch.arange(first, seq_len, device=q.device)
        mask = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)  # k_pos >= first
        if compressed_cache is not None:
            assert compressed_tables is not None
            num_entries = seq_len // compress_ratio
            entries = gather_entries(compressed_cache, compressed_tables[i], 0, num_entries)
            e_idx = torch.arange(num_entries, device=q.device)
            if topk_indices is None:
                e_mask = e_idx[None, :] < ((q_pos + 1) // compress_ratio)[:, None]
            else:  # picks of -1 land in a spare column that is dropped
                picks = topk_indices[start:end]
                e_mask = torch.zeros((q_len, num_entries + 1), dtype=torch.bool, device=q.device)
                e_mask.scatter_(1, torch.where(picks >= 0, picks, num_entries), True)
                e_mask = e_mask[:, :num_entries]
            keys = torch.cat([keys, entries])
            mask = torch.cat([mask, e_mask], dim=1)
        out[start:end] = _attend_with_sinks(q[start:end], keys, mask, sinks, scale)
    return out


def _attend_with_sinks(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """``q [L, H, D]``, ``kv [S, D]`` (K = V), ``mask [L, S]`` -> ``[L, H, D]``; the sink is one more
    logit per head that takes probability mass but contributes no value."""
    kv = kv.to(q.dtype)
    logits = torch.einsum("lhd,sd->hls", q, kv).float() * scale  # softmax in float32
    logits = logits.masked_fill(~mask[None], float("-inf"))
    sink = sinks.float()[:, None, None].expand(-1, logits.shape[1], 1)
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    probs = combined.softmax(dim=-1)[..., :-1].to(kv.dtype)
    return torch.einsum("hls,sd->lhd", probs, kv)


def hc_pre_ref(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, eps: float,
               norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [T, N, H]`` (N streams) -> the block input ``[T, H]`` (streams collapsed by the "pre"
    weights) and, for ``hc_post_ref``, the "post" weights ``[T, N]`` and the doubly-stochastic
    (Sinkhorn projected, ``iters`` normalisations) "comb" mixing ``[T, N, N]`` (float32), all
    computed from the unweighted-RMS-normalised streams. ``fn [(2 + N) * N, N * H]``, ``base
    [(2 + N) * N]`` and ``scale [3]`` are float32."""
    n = x.shape[1]
    flat = unweighted_rms_norm(x.flatten(1).float(), norm_eps)
    mixes = torch.nn.functional.linear(flat, fn.float())  # [T, (2 + N) * N]
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    pre_s, post_s, comb_s = scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    collapsed = (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)
    return collapsed, post, comb


def hc_post_ref(out: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams ``[T, N, H]``: stream k = post[k] * block output + sum_j comb[j, k] * stream j
    (``out [T, H]``, ``x [T, N, H]``, ``post [T, N]``, ``comb [T, N, N]``), in ``x``'s dtype."""
    dtype = x.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), x)


def compress_decode_ref(carry: torch.Tensor, positions: torch.Tensor, ratio: int, gate: torch.Tensor,
                        value: torch.Tensor, index_gate: torch.Tensor | None = None,
                        index_value: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row. ``carry``: each row's pools before the token, float32 ``[B, 2, C]`` (HCA:
    ``[lse | mean]`` of the window in progress) or ``[B, 2, 2, C]`` (CSA: the entry in progress, then
    the overlap pool of the next entry); ignored where ``positions == 0`` (an empty pool). ``gate``
    / ``value [B, W]`` (float32): the compressor's projections, ``W = C`` for HCA, ``2 * d`` for CSA
    (``[A | B]`` halves); CSA's indexer compressor ``index_gate`` / ``index_value [B, 2 * di]`` rides
    along as the last ``di`` channels (``C = d + di``). Returns the pools after the token (same
    shape as ``carry``; a window the token completes, ``positions % ratio == ratio - 1``, restarts)
    and each row's entry pooled so far ``[B, C]`` (the complete entry where the window completes)."""
    fresh = (positions == 0).view(-1, *([1] * (carry.dim() - 1)))
    carry = torch.where(fresh, empty_pools(tuple(carry.shape), carry.device), carry.float())
    done = positions % ratio == ratio - 1
    gate, value = gate.float(), value.float()
    if carry.dim() == 3:
        series_b, series_a = (gate, value), None
    else:
        d = gate.shape[1] // 2
        if index_gate is None or index_value is None:
            series_a, series_b = (gate[:, :d], value[:, :d]), (gate[:, d:], value[:, d:])
        else:
            di = index_gate.shape[1] // 2
            ig, iv = index_gate.float(), index_value.float()
            series_a = (torch.cat([gate[:, :d], ig[:, :di]], -1), torch.cat([value[:, :d], iv[:, :di]], -1))
            series_b = (torch.cat([gate[:, d:], ig[:, di:]], -1), torch.cat([value[:, d:], iv[:, di:]], -1))
    carry_b = carry if series_a is None else carry[:, 0]  # [B, 2, C]
    lse_b, mean_b = merge_pools_ref(carry_b[:, 0], carry_b[:, 1], *series_b)
    empty = torch.stack([torch.full_like(lse_b, EMPTY_LSE), torch.zeros_like(mean_b)], dim=1)  # [B, 2, C]
    b = torch.stack([lse_b, mean_b], dim=1)
    if series_a is None:
        return torch.where(done[:, None, None], empty, b), mean_b
    lse_a, mean_a = merge_pools_ref(carry[:, 1, 0], carry[:, 1, 1], *series_a)
    a = torch.stack([lse_a, mean_a], dim=1)
    # In progress: [entry so far, overlap part so far]; completed: [overlap part -> next entry, empty].
    return torch.where(done[:, None, None, None], torch.stack([a, empty], dim=1), torch.stack([b, a], dim=1)), mean_b


def state_blocks(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's paged compressor state per row (one token at ``positions`` each, ``table
    [B, max_blocks]``): the block holding the pools before the token (the previous position's; a
    first token's, position 0, is read but ignored) and the block its pools after go to."""
    table, pos = table.long(), positions.long()
    before = table.gather(1, ((pos - 1).clamp(min=0) // block_size)[:, None])[:, 0]
    after = table.gather(1, (pos // block_size)[:, None])[:, 0]
    return before, after


def compress_decode_paged_ref(states: torch.Tensor, table: torch.Tensor, block_size: int, positions: torch.Tensor,
                              ratio: int, gate: torch.Tensor, value: torch.Tensor, ape: torch.Tensor,
                              index_gate: torch.Tensor | None = None, index_value: torch.Tensor | None = None,
                              index_ape: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step's one token per row over the paged state group: row i's carried pools are
    ``states[table[i, (p - 1) // block_size]]`` (``states [num_blocks, *state]``: ``[2, C]`` HCA,
    ``[2, 2, C]`` CSA), its pools after the token (:func:`compress_decode_ref`) are written to
    ``states[table[i, p // block_size]]`` in place. ``gate`` / ``value`` (and the indexer
    compressor's) are the raw projections: each gate gets its slot's bias ``ape[p % ratio]`` here.
    Returns each row's entry so far ``[B, C]`` (float32), the entry's index ``p // ratio`` and
    whether the token completes it."""
    pos = positions.long()
    before, after = state_blocks(table, pos, block_size)
    slot = pos % ratio
    index_gate = None if index_gate is None or index_ape is None else index_gate.float() + index_ape[slot]
    state, mean = compress_decode_ref(states[before], pos, ratio, gate.float() + ape[slot], value, index_gate,
                                      index_value)
    states[after] = state.to(states.dtype)
    return mean, pos // ratio, slot == ratio - 1


def compress_store_ref(pooled: torch.Tensor, index: torch.Tensor, done: torch.Tensor, weight: torch.Tensor,
                       eps: float, inv_freq: torch.Tensor, ratio: int, scaling: float, cache: torch.Tensor,
                       table: torch.Tensor) -> None:
    """Store the entries a decode step completed. ``pooled [B, n]`` (float32, a strided view
    allowed): row i's pool of window ``index[i]``, complete where ``done[i]``; ``weight [n]`` the
    entry norm's (float32); ``inv_freq [rot / 2]``, ``scaling``: the compress RoPE, applied to the
    last ``rot`` channels (interleaved pairs) at position ``index * ratio``; ``cache [num_blocks,
    per_block, n]`` (a per-layer view, the model's dtype) with ``table [B, max_blocks]``. Rounds as
    the model's norm and rotary ops do: the pool and the normalised row to the cache's dtype, the
    weighted row again, the rotation computed in float32. Rows not done write the null block 0
    (an entry in progress may lie past the blocks allocated so far: its column is clamped)."""
    cos, sin = rope_cos_sin(inv_freq, index * ratio, scaling)
    x = norm_rope_ref(pooled.to(cache.dtype)[:, None], cos, sin, weight, eps)[:, 0]
    per_block = cache.shape[1]
    column = (index // per_block).clamp(max=table.shape[1] - 1)
    blocks = table.long().gather(1, column[:, None])[:, 0]
    cache[torch.where(done, blocks, 0), index % per_block] = x


def norm_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None = None,
                  eps: float | None = None, inverse: bool = False, cache: torch.Tensor | None = None,
                  slots: torch.Tensor | None = None) -> torch.Tensor:
    """``x [T, H, D]`` (heads laid out ``[nope | rope]``; a strided view allowed) -> a new
    ``[T, H, D]`` in ``x``'s dtype: RMS-normalised over D when ``eps`` is given (with the float32
    ``weight [D]`` as the model's ``V4RMSNorm`` rounds it, or without one as
    :func:`unweighted_rms_norm`), then the last ``2 * cos.shape[-1]`` channels rotated by ``cos,
    sin [T, rot / 2]`` (float32; by ``-sin`` if ``inverse``) in interleaved pairs, in float32. With
    ``cache [num_blocks, block_size, D]`` (H must be 1) the rows are also written at ``slots [T]``
    (negative slots, a graph's padding rows, write slot 0 of the null block)."""
    if eps is not None:
        x = unweighted_rms_norm(x, eps) if weight is None else rms_norm_ref(x, weight, eps)[0].to(x.dtype)
    rot = 2 * cos.shape[-1]
    out = torch.cat([x[..., :-rot], apply_rotary_ref(x[..., -rot:], cos, -sin if inverse else sin, True)], dim=-1)
    if cache is not None:
        if slots is None or out.shape[1] != 1:
            raise ValueError("a cache write needs slots and one head per row")
        block_size = cache.shape[1]
        where = slots.long().clamp(min=0)
        cache[where // block_size, where % block_size] = out[:, 0].to(cache.dtype)
    return out


#: The routers' score functions (``route_ref``'s ``scoring``).
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


def route_ref(logits: torch.Tensor, top_k: int, scoring: str, scaling: float, bias: torch.Tensor | None = None,
              tid2eid: torch.Tensor | None = None, input_ids: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` (the gate projection, the model's dtype) -> (weights ``[T, k]`` in that
    dtype, expert ids ``[T, k]`` int64). Experts: the top ``k`` of ``scores + bias`` (``bias [E]``
    float32; in no set order), or with ``tid2eid [vocab, k]`` the rows of ``input_ids [T]``. Weights:
    the chosen experts' scores over their sum, times ``scaling``. Computed as the model's torch ops
    round: each step's result in the logits' dtype."""
    if scoring == "sqrtsoftplus":
        scores = torch.nn.functional.softplus(logits).sqrt()
    elif scoring == "sigmoid":
        scores = logits.sigmoid()
    elif scoring == "softmax":
        scores = logits.softmax(dim=-1)
    else:
        raise ValueError(f"unknown scoring function {scoring!r} ({', '.join(SCORING_FUNCS)})")
    if tid2eid is not None:
        if input_ids is None:
            raise ValueError("hash routing needs the input ids")
        ids = tid2eid[input_ids].long()
    else:
        if bias is None:
            raise ValueError("a learned router needs its correction bias")
        ids = torch.topk(scores + bias, top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids

