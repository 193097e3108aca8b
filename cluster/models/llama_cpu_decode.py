"""The Llama family's decode step on a CPU with quantized weights, in as few torch ops as the
layer-by-layer path's numbers allow.

On a small model every op of a decode step costs about as much as its arithmetic: SmolLM2-135M's
30 layers made about 88 torch ops each through the generic path (norms as six ops, the rotation
as eighteen, the slot mapping split and the block list rebuilt in every layer, a cast before and
after every projection), so most of a batch-1 step on a 2-core machine was op dispatch, not the
4-bit kernels. This path computes the same numbers, bit for bit (tests/models/test_llama_cpu_decode.py
compares them), with about a third of the ops:

- what every layer shares is computed once per step: the rotation's cos/sin in the layout the
  rotation takes, the new tokens' blocks and offsets, the blocks to gather, the padding mask;
- a norm is the model's own native norm (``kernels.cpu_native.rms_norm``: one call, where the
  native kernels run), else ``F.rms_norm`` (one fused op, equal to the reference's), its residual
  add folded into the promotion of the previous projection's bfloat16 output;
- q's and k's rotation is two multiplies and an add over ``[T, heads, 2, D / 2]`` with the
  halves swapped by one ``flip`` (``x1 c + x2 (-s)`` is ``x1 c - x2 s`` exactly);
- every layer's K and V cache views are made once per cache;
- with the native kernels (``kernels.cpu_native``: the model's ops then hold its ``qkv_prepare``
  and ``paged_attention``), one native call per layer rotates q and k, writes k and v to the cache
  and attends, the same numbers as the layers' two calls; without them, the torch ops below.

It serves decode-only steps (one new token per sequence, the reference attention, no q/k norms);
everything else (prefill chunks, verify steps, Qwen3's q/k norms, a GPU) takes the layers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from cluster.models.context import ForwardContext
from kernels import cpu_native
from kernels.attention import block_list, paged_attention_ref, split_slots
from kernels.cpu_quant import Q4Weight, q4_matmul
from kernels.norm import rms_norm_ref
from kernels.qkv_prepare import qkv_prepare_ref
from kernels.rotary import rope_cos_sin


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Q4Weight
    qkv_bias: torch.Tensor | None
    o: Q4Weight
    o_bias: torch.Tensor | None
    gate_up: Q4Weight
    gate_up_bias: torch.Tensor | None
    down: Q4Weight
    down_bias: torch.Tensor | None


def unsupported_reason(model: Any) -> str | None:
    """Why ``model`` (a LlamaForCausalLM) cannot take this path, or None."""
    if model.args.qk_norm:
        return "q/k norms (Qwen3)"
    ops = model.ops
    native = (cpu_native.paged_attention, cpu_native.qkv_prepare, cpu_native.rms_norm)
    refs = (paged_attention_ref, qkv_prepare_ref, rms_norm_ref)
    mine = (ops.attention, ops.qkv_prepare, ops.rms_norm)
    if any(op not in (ref, nat) for op, ref, nat in zip(mine, refs, native)):
        return "attention, q/k preparation or norms run kernels other than the CPU references or native ones"
    if (ops.attention is cpu_native.paged_attention) != (ops.qkv_prepare is cpu_native.qkv_prepare):
        return "one of attention and q/k preparation is native, the other not"
    for layer in model.layers:
        linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        if any(lin.quantized is None for lin in linears):
            return "a projection is not quantized"
    if model.embed_tokens.weight.device.type != "cpu":
        return "not on a CPU"
    return None


class LlamaCpuDecode:
    """Decode steps of one quantized LlamaForCausalLM on a CPU (see the module's docstring)."""

    def __init__(self, model: Any) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the lean CPU decode path does not apply: {reason}")
        a = model.args
        self.model = model
        self.hidden = a.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.qk_size = (a.num_heads + a.num_kv_heads) * a.head_dim
        self.q_out = a.num_heads * a.head_dim
        self.intermediate = a.intermediate_size
        self.eps = a.rms_norm_eps
        self.scale = a.head_dim ** -0.5
        self.layers = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(_Layer(
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                attn.qkv_proj.quantized, attn.qkv_proj.bias, attn.o_proj.quantized, attn.o_proj.bias,
                mlp.gate_up_proj.quantized, mlp.gate_up_proj.bias, mlp.down_proj.quantized, mlp.down_proj.bias))
        #: The model's norms are the native ones (``kernels.cpu_native.rms_norm``, given by
        #: ``cluster.models.cpu_quant`` with the native kernels): this path takes them too.
        self.native_norm = model.ops.rms_norm is cpu_native.rms_norm
        #: Likewise the rotation, KV write and attention (``cpu_native.qkv_prepare`` and
        #: ``paged_attention``): then one native call per layer does all three.
        self.native_attention = model.ops.attention is cpu_native.paged_attention
        self._views: tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] | None = None
        self._pointers: tuple[torch.Tensor, list[tuple[int, int]] | None] | None = None
        #: Decode steps this path computed (the rest went through the layers).
        self.num_steps = 0

    def applies(self, ctx: ForwardContext, num_rows: int) -> bool:
        """A decode-only step: one new token per sequence, no prompt rows, no verify rows."""
        return (not ctx.prefill and ctx.verify_slot is None and len(ctx.seq_lens_cpu) == num_rows
                and ctx.query_start_loc_cpu[-1] == num_rows and ctx.slot_mappings[0] is not None)

    def _cache_views(self, storage: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        if self._views is None or self._views[0] is not storage:
            per_layer = [(storage[:, i], storage[:, i, 0], storage[:, i, 1]) for i in range(len(self.layers))]
            self._views = (storage, per_layer)
        return self._views[1]

    def _cache_pointers(self, storage: torch.Tensor) -> list[tuple[int, int]] | None:
        """Every layer's (K, V) addresses for the native step, or None where the native kernels do
        not read this cache (checked once per cache, not per step)."""
        if self._pointers is None or self._pointers[0] is not storage:
            views = self._cache_views(storage)
            readable = cpu_native.cache_layout(views[0][1], views[0][2]) is not None
            self._pointers = (storage, [(k.data_ptr(), v.data_ptr()) for _, k, v in views] if readable else None)
        return self._pointers[1]

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``input_ids [B]`` (one per sequence) -> final hidden states ``[B, H]``, the KV of the
        new tokens written, exactly as the layers would."""
        self.num_steps += 1
        model = self.model
        b = input_ids.shape[0]
        hq, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        views = self._cache_views(ctx.kv_caches[0])
        cache_dtype = ctx.kv_caches[0].dtype
        block_size = ctx.block_sizes[0]

        # shared by every layer: rotation tables, slots, the gather list, the padding mask
        cos, sin = rope_cos_sin(model.inv_freq, ctx.positions)  # [B, D / 2]
        slot_mapping = ctx.slot_mappings[0]
        assert slot_mapping is not None
        native = None
        pointers = self._cache_pointers(ctx.kv_caches[0]) if self.native_attention else None
        if pointers is not None:
            native = cpu_native.DecodeAttention(hq, hk, d, cos, sin, slot_mapping, ctx.block_tables[0], ctx.seq_lens,
                                                self.scale, views[0][1], views[0][2])
        else:
            cos4 = cos[:, None, None, :]  # [B, 1, 1, D / 2], both halves
            sin4 = torch.stack((-sin, sin), dim=1)[:, None]  # [B, 1, 2, D / 2]: x2 (-s) | x1 s
            keep, slot_blocks, slot_offsets = split_slots(slot_mapping, block_size)
            max_len = max(ctx.seq_lens_cpu)
            num_blocks = (max_len + block_size - 1) // block_size
            gather = block_list(ctx.block_tables[0], num_blocks)  # every sequence's blocks, one list
            if b == 1:
                mask = None
            else:
                k_pos = torch.arange(num_blocks * block_size)
                mask = (k_pos[None, :] < ctx.seq_lens.long()[:, None])[:, None, None, :]  # [B, 1, 1, S]

        x: torch.Tensor = F.embedding(input_ids, model.embed_tokens.weight)  # [B, H] float32
        residual: torch.Tensor | None = None
        for i, (layer, (layer_cache, k_cache, v_cache)) in enumerate(zip(self.layers, views)):
            h, residual = self._norm(x, layer.input_norm, residual)
            qkv = _linear(h, layer.qkv, layer.qkv_bias)  # [B, (Hq + 2 Hkv) D] float32
            if native is not None and pointers is not None:
                out = native.layer(qkv, *pointers[i])  # rotation, KV write and attention: [B, Hq D]
            else:
                qk = qkv[:, :self.qk_size].view(b, hq + hk, 2, d // 2)
                torch.add(qk * cos4, qk.flip(2) * sin4, out=qk)  # rotated in place: q | k | v stays one row
                q = qkv[:, :self.q_out].view(b, hq, d)
                kv = qkv[:, self.q_out:].view(b, 2, hk, d)  # the cache's [2, Hkv, D] per entry
                if keep is not None:
                    kv = kv[keep]
                layer_cache[slot_blocks, :, slot_offsets] = kv if cache_dtype == kv.dtype else kv.to(cache_dtype)
                keys = k_cache.index_select(0, gather).view(b, num_blocks * block_size, hk, d)
                values = v_cache.index_select(0, gather).view(b, num_blocks * block_size, hk, d)
                if mask is None:
                    keys, values = keys[:, :max_len], values[:, :max_len]
                if cache_dtype != q.dtype:
                    keys, values = keys.to(q.dtype), values.to(q.dtype)
                out = F.scaled_dot_product_attention(
                    q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=self.scale,
                    enable_gqa=hq != hk)  # [B, Hq, 1, D]
            attn = q4_matmul(out.reshape(b, self.q_out), layer.o)  # bfloat16
            if layer.o_bias is not None:
                attn = attn.float() + layer.o_bias
            h, residual = self._norm(attn, layer.post_norm, residual)
            gate_up = _linear(h, layer.gate_up, layer.gate_up_bias)
            act = F.silu(gate_up[:, :self.intermediate]) * gate_up[:, self.intermediate:]
            x = q4_matmul(act, layer.down)
            if layer.down_bias is not None:
                x = x.float() + layer.down_bias
        assert residual is not None
        return self._norm(x, model.norm.weight, residual)[0]

    def _norm(self, x: torch.Tensor, weight: torch.Tensor,
              residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual) * weight, x + residual)``, as the layers' norm computes it: the
        native norm where the model's ops take it, else ``F.rms_norm`` (one fused op, equal to the
        reference's) with the residual add folded into the promotion of a bfloat16 projection
        output (converting bfloat16 to float32 is exact, so ``bf16 + f32`` is the reference's
        ``f32(bf16) + f32``)."""
        if self.native_norm:
            h, summed = cpu_native.rms_norm(x, weight, self.eps, residual)
            return h, x if summed is None else summed
        h = x if residual is None else x + residual
        return F.rms_norm(h, (self.hidden,), weight, self.eps), h


def _linear(x: torch.Tensor, weight: Q4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    y = q4_matmul(x, weight).float()
    return y if bias is None else y + bias
