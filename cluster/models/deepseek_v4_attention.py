"""DeepSeek-V4 attention: shared-KV MQA (one ``head_dim``-wide entry per token is both key and
value) over a sliding window, plus, per layer type, compressed entries: CSA (ratio ``csa_ratio``,
overlapping windows, the lightning indexer picks the top-k entries per query) or HCA (ratio
``hca_ratio``, every visible entry). Low-rank queries with per-head RMSNorm, partial interleaved
RoPE on each head's trailing slice, per-head attention sinks, de-rotation of the output's rope
slice, grouped low-rank output projection.

KV state per layer (see ``deepseek_v4_kv``): its window entries, its compressed entries (and
indexer keys), its compressor checkpoints.

Kernels: the attention over window + compressed entries + sinks is ``Ops.v4_sparse_attention`` and
the indexer's scoring and top-k ``Ops.v4_indexer`` (references in ``kernels.deepseek_v4_ref``,
Triton kernels on GPUs); norms and rotations go through ``Ops.rms_norm`` / ``Ops.rotary``."""
from __future__ import annotations

import torch
from torch import nn

from cluster.models.context import ForwardContext
from cluster.models.deepseek_v4_compressor import ChunkCompressor, CompressorWeights, DecodeEntries, decode_step
from cluster.models.deepseek_v4_config import CSA, SLIDING, DeepseekV4Args
from cluster.models.deepseek_v4_kv import LayerKV
from cluster.models.deepseek_v4_layers import V4RMSNorm, V4Rope
from cluster.models.layers import FusedRows, Linear
from cluster.models.ops import REFERENCE_OPS, Ops


class Indexer(nn.Module):
    """The lightning indexer of a CSA layer: its queries (from the attention's low-rank query),
    per-head weights, and its own compressor at ``index_head_dim``."""

    def __init__(self, args: DeepseekV4Args, dtype: torch.dtype, ops: Ops = REFERENCE_OPS) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.topk = args.index_n_heads, args.index_head_dim, args.index_topk
        self.select_kernel, self.norm_rope = ops.v4_indexer, ops.v4_norm_rope
        self.wq_b = Linear(args.q_lora_rank, self.num_heads * self.head_dim, False, dtype)
        self.weights_proj = Linear(args.hidden_size, self.num_heads, False, dtype)
        self.compressor = CompressorWeights(args.hidden_size, 2 * self.head_dim, self.head_dim, args.csa_ratio,
                                            args.rms_norm_eps, dtype, ops)

    def select(self, q_raw: torch.Tensor, weights_raw: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               ctx: ForwardContext, index: tuple[int, int]) -> torch.Tensor:
        """Top-k compressed entries per query ``[T, topk]`` (-1: none), from this layer's
        ``wq_b(q_residual)`` and ``weights_proj(h)`` (computed with the attention's projections)."""
        q = q_raw.view(-1, self.num_heads, self.head_dim)
        q = self.norm_rope(q, cos, sin)  # [T, Hi, Di]
        weights = weights_raw.float() * self.num_heads ** -0.5  # [T, Hi]
        group, layer = index
        return self.select_kernel(q, weights, ctx.kv_caches[group][:, layer], ctx.block_tables[group],
                                  ctx.query_start_loc_cpu, ctx.seq_lens_cpu, self.compressor.ratio, self.topk,
                                  self.head_dim ** -0.5, query_start_loc=ctx.query_start_loc,
                                  seq_lens=ctx.seq_lens)


class DeepseekV4Attention(nn.Module):
    def __init__(self, args: DeepseekV4Args, layer_type: str, kv: LayerKV, dtype: torch.dtype,
                 ops: Ops = REFERENCE_OPS) -> None:
        super().__init__()
        self.args, self.layer_type, self.kv = args, layer_type, kv
        self.attention_kernel, self.norm_rope = ops.v4_sparse_attention, ops.v4_norm_rope
        self.compress_kernel, self.store_kernel = ops.v4_compress_decode, ops.v4_compress_store
        self.paged_compress_kernel = ops.v4_compress_decode_paged
        #: The first position whose window entry may be attended (an MTP layer: 1; see deepseek_v4_mtp).
        self.min_position = 0
        self.num_heads, self.head_dim = args.num_heads, args.head_dim
        self.rope_kind = "main" if layer_type == SLIDING else "compress"
        self.ratio = args.ratio(layer_type)
        self.wq_a = Linear(args.hidden_size, args.q_lora_rank, False, dtype)
        self.q_norm = V4RMSNorm(args.q_lora_rank, args.rms_norm_eps, ops)
        self.wq_b = Linear(args.q_lora_rank, args.num_heads * args.head_dim, False, dtype)
        self.wkv = Linear(args.hidden_size, args.head_dim, False, dtype)
        self.kv_norm = V4RMSNorm(args.head_dim, args.rms_norm_eps, ops)
        group_in = args.num_heads * args.head_dim // args.o_groups
        # Grouped output projection: ``wo_a`` holds o_groups blocks [o_lora_rank, group_in], one per head group.
        self.wo_a = Linear(group_in, args.o_groups * args.o_lora_rank, False, dtype)
        self.wo_b = Linear(args.o_groups * args.o_lora_rank, args.hidden_size, False, dtype)
        self.attn_sink = nn.Parameter(torch.empty(args.num_heads, dtype=torch.float32), requires_grad=False)
        self.compressor: CompressorWeights | None = None
        self.indexer: Indexer | None = None
        if layer_type != SLIDING:
            overlap = 2 if layer_type == CSA else 1
            self.compressor = CompressorWeights(args.hidden_size, overlap * args.head_dim, args.head_dim,
                                                self.ratio, args.rms_norm_eps, dtype, ops)
        if layer_type == CSA:
            self.indexer = Indexer(args, dtype, ops)
        # The projections of the same input as one GEMM each (decode at batch 1 is bound by
        # their launches and split-K reductions): of ``h`` the query's low rank, the KV entry,
        # the compressors' values and gates and the indexer's head weights; of the low-rank query
        # the attention's and the indexer's queries.
        from_h: list[tuple[nn.Module, str]] = [(self.wq_a, "weight"), (self.wkv, "weight")]
        from_q: list[tuple[nn.Module, str]] = [(self.wq_b, "weight")]
        if self.compressor is not None:
            from_h += [(self.compressor.wkv, "weight"), (self.compressor.wgate, "weight")]
        if self.indexer is not None:
            idx = self.indexer
            from_h += [(idx.compressor.wkv, "weight"), (idx.compressor.wgate, "weight"), (idx.weights_proj, "weight")]
            from_q.append((idx.wq_b, "weight"))
        self.h_proj, self.q_proj = FusedRows(from_h), FusedRows(from_q)

    def forward(self, h: torch.Tensor, ctx: ForwardContext, rope: V4Rope) -> torch.Tensor:
        """``h [T, hidden]`` -> ``[T, hidden]``; writes this chunk's KV state."""
        t = h.shape[0]
        cos, sin = rope.cos_sin(self.rope_kind, ctx.positions)
        q_low, kv_raw, *rest = self.h_proj(h)
        q_residual = self.q_norm(q_low)
        q_raw, *index_q = self.q_proj(q_residual)
        q = self.norm_rope(q_raw.view(t, self.num_heads, self.head_dim), cos, sin, eps=self.args.rms_norm_eps)
        window_group, window_layer = self.kv.window
        window_cache = ctx.kv_caches[window_group][:, window_layer]  # [num_blocks, block_size, D]
        slots = ctx.slot_mappings[window_group]
        assert slots is not None
        # the window's KV entry, written at its slot (a decode graph's padding rows, slot -1, write the null block)
        self.norm_rope(kv_raw.unsqueeze(1), cos, sin, self.kv_norm.weight, self.kv_norm.eps, cache=window_cache,
                       slots=slots)
        compressed_cache = compressed_tables = topk = None
        if self.compressor is not None:
            self._compress(h, rest[:4], ctx, rope)
            group, layer = self.kv.compressed  # type: ignore[misc]
            compressed_cache, compressed_tables = ctx.kv_caches[group][:, layer], ctx.block_tables[group]
        if self.indexer is not None:
            assert self.kv.index is not None
            topk = self.indexer.select(index_q[0], rest[4], cos, sin, ctx, self.kv.index)
        out = self.attention_kernel(q, window_cache, ctx.block_tables[window_group], compressed_cache,
                                    compressed_tables, topk, self.attn_sink, ctx.query_start_loc_cpu,
                                    ctx.seq_lens_cpu, self.args.sliding_window, max(self.ratio, 1),
                                    self.head_dim ** -0.5, query_start_loc=ctx.query_start_loc,
                                    seq_lens=ctx.seq_lens, min_position=self.min_position)  # [T, H, D]
        # K = V carried RoPE into the output; undo it at the query position
        out = self.norm_rope(out, cos, sin, inverse=True)
        return self.wo_b(self._grouped_wo_a(out))

    def _grouped_wo_a(self, out: torch.Tensor) -> torch.Tensor:
        """``[T, H, D]`` -> ``[T, o_groups * o_lora_rank]``: each head group projected by its own block."""
        groups = self.args.o_groups
        x = out.reshape(out.shape[0], groups, -1).transpose(0, 1)  # [G, T, group_in]
        w = self.wo_a.weight.view(groups, -1, x.shape[-1])  # [G, o_lora_rank, group_in]
        return torch.bmm(x, w.transpose(1, 2)).transpose(0, 1).flatten(1)

    def _compress(self, h: torch.Tensor, raw: list[torch.Tensor], ctx: ForwardContext, rope: V4Rope) -> None:
        """Pool this chunk's windows; store the entries (and indexer keys) the chunk completes.
        ``raw``: the compressor's value and gate projections of ``h`` (then the indexer's)."""
        assert self.compressor is not None and self.kv.state is not None and self.kv.compressed is not None
        d = self.head_dim
        decode = h.shape[0] == len(ctx.seq_lens_cpu)  # one token per sequence, batched
        if decode and ctx.verify_states is None:
            # a decode step: the pools advance in place in the paged state group, one kernel
            step = self._decode_paged(raw, ctx)
            self._store_done(ctx, self.kv.compressed, step, step.pooled[:, :d], self.compressor.norm, rope)
            if self.indexer is not None and self.kv.index is not None:
                self._store_done(ctx, self.kv.index, step, step.pooled[:, d:], self.indexer.compressor.norm, rope)
            return
        kv, gate = self.compressor.finish(raw[0], raw[1], ctx.positions)
        ikv = igate = None
        if self.indexer is not None:
            ikv, igate = self.indexer.compressor.finish(raw[2], raw[3], ctx.positions)
        if decode:  # a verify step: one token per row, each position pooled from its predecessor's state
            step = decode_step((gate, kv, igate, ikv), ctx, self.ratio, *self.kv.state, advance=self.compress_kernel)
            self._store_done(ctx, self.kv.compressed, step, step.pooled[:, :d], self.compressor.norm, rope)
            if self.indexer is not None and self.kv.index is not None:
                self._store_done(ctx, self.kv.index, step, step.pooled[:, d:], self.indexer.compressor.norm, rope)
            return
        if igate is None or ikv is None:
            series_b, series_a = (gate, kv), None
        else:
            di = self.indexer.head_dim  # type: ignore[union-attr]
            series_a = (torch.cat([gate[:, :d], igate[:, :di]], -1), torch.cat([kv[:, :d], ikv[:, :di]], -1))
            series_b = (torch.cat([gate[:, d:], igate[:, di:]], -1), torch.cat([kv[:, d:], ikv[:, di:]], -1))
        runner = ChunkCompressor(self.ratio, *self.kv.state)
        for seq, first, pooled in runner.run(series_b, series_a, ctx):
            index = torch.arange(pooled.shape[0], device=h.device) + first
            entries, keys = self._finish_entries(pooled, index, rope, h.dtype)
            self._store(ctx, self.kv.compressed, seq, first, entries)
            if keys is not None and self.kv.index is not None:
                self._store(ctx, self.kv.index, seq, first, keys)

    def _decode_paged(self, raw: list[torch.Tensor], ctx: ForwardContext) -> DecodeEntries:
        """A decode step's compressors (``Ops.v4_compress_decode_paged``): the carried pools read
        from and written back to the paged state group, the gates' slot bias added, in one kernel
        (a verify step keeps each position's state apart: :func:`decode_step`)."""
        assert self.compressor is not None and self.kv.state is not None
        group, layer = self.kv.state
        index = (raw[3], raw[2], self.indexer.compressor.ape) if self.indexer is not None else (None, None, None)
        mean, entry, done = self.paged_compress_kernel(
            ctx.kv_caches[group][:, layer], ctx.block_tables[group], ctx.block_sizes[group], ctx.positions,
            self.ratio, raw[1], raw[0], self.compressor.ape, *index)  # raw: values, gates (then the indexer's)
        return DecodeEntries(mean, entry, done)

    def _finish_entries(self, pooled: torch.Tensor, index: torch.Tensor, rope: V4Rope, dtype: torch.dtype
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Pooled means ``[m, C]`` of entries ``index [m]`` -> the attention entries and (CSA) the
        indexer keys to store: normalised and rotated at the entries' first positions."""
        assert self.compressor is not None
        d = self.head_dim
        cos, sin = rope.cos_sin("compress", index * self.ratio)
        norm = self.compressor.norm
        entries = self.norm_rope(pooled[:, None, :d].to(dtype), cos, sin, norm.weight, norm.eps)[:, 0]
        if self.indexer is None:
            return entries, None
        norm = self.indexer.compressor.norm
        return entries, self.norm_rope(pooled[:, None, d:].to(dtype), cos, sin, norm.weight, norm.eps)[:, 0]

    def _store_done(self, ctx: ForwardContext, where: tuple[int, int], step: DecodeEntries, pooled: torch.Tensor,
                    norm: V4RMSNorm, rope: V4Rope) -> None:
        """Normalise, rotate and store row i's entry (``pooled [B, n]``) at its window's index where
        ``step.done[i]`` (``Ops.v4_compress_store``; no host synchronisation to pick the rows)."""
        group, layer = where
        self.store_kernel(pooled, step.index, step.done, norm.weight, norm.eps, rope.compress_inv_freq, self.ratio,
                          rope.scaling["compress"], ctx.kv_caches[group][:, layer], ctx.block_tables[group])

    @staticmethod
    def _store(ctx: ForwardContext, where: tuple[int, int], seq: int, first: int, entries: torch.Tensor) -> None:
        group, layer = where
        cache = ctx.kv_caches[group][:, layer]  # [num_blocks, entries_per_block, width]
        per_block = cache.shape[1]
        index = torch.arange(first, first + entries.shape[0], device=entries.device)
        blocks = ctx.block_tables[group][seq].long()[index // per_block]
        cache[blocks, index % per_block] = entries.to(cache.dtype)
