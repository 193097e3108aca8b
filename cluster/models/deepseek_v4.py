"""DeepSeek-V4 (``DeepseekV4ForCausalLM``): the founding model family.

Structure (module and parameter names follow the released checkpoints, so loading is mostly a
name-for-name copy): ``embed``; ``layers[i]`` each with ``attn`` (sliding, CSA or HCA; see
``deepseek_v4_attention``), ``ffn`` (MoE; see ``deepseek_v4_moe``), ``attn_norm``/``ffn_norm`` and the
hyper-connection parameters ``hc_attn_*``/``hc_ffn_*``; ``hc_head_*``, ``norm`` and ``head``. The
residual is ``hc_mult`` streams ``[T, hc_mult, hidden]`` from the embedding to the final hyper head.
``mtp[k]`` holds the MTP (next-n) layers for speculative decoding (``speculative_method=mtp``); they
take no part in this model's forward, which then returns the pre-head streams they read. KV state: see ``deepseek_v4_kv``. Kernels: every op the model calls comes
from the ``Ops`` resolved at start-up (:func:`kernel_components` lists them); routed experts are
kept in their checkpoint format on CUDA and dequantized on CPU (``deepseek_v4_experts``).

The computation follows transformers' ``models/deepseek_v4`` (the tests' reference) where it and
DeepSeek's inference code differ: that code rounds the stored KV's non-RoPE features through FP8
and the indexer's queries and keys through FP4 (after a Hadamard rotation, which alone leaves the
scores unchanged); transformers, and this model, keep them in the model dtype. Compressed entries
follow the reference's rule in prefill, chunked prefill and decode alike: a query at position t
sees entry e (and the indexer may pick it) iff t >= (e + 1) * R - 1. The indexer ranks equal
scores by entry index, lowest first (its ReLU makes exact ties common; a top-k that breaks them by
the shape of its input picks differently in prefill and in decode, which is how transformers'
full and cached forwards part on small configs): tests/models/test_deepseek_v4_semantics.py."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from cluster.common.kv_spec import KVGroupSpec
from cluster.models.context import ForwardContext
from cluster.models.deepseek_v4_attention import DeepseekV4Attention
from cluster.models.deepseek_v4_config import CSA, SLIDING, DeepseekV4Args
from cluster.models.deepseek_v4_dspark import DSparkDrafter, DSparkStage
from cluster.models.deepseek_v4_kv import LayerKV, deepseek_v4_kv_specs, layer_kv_layout
from cluster.models.deepseek_v4_layers import V4RMSNorm, V4Rope, hc_head
from cluster.models.deepseek_v4_moe import DeepseekV4MoE
from cluster.models.ops import REFERENCE_OPS, Ops, base_components
from cluster.models.deepseek_v4_quant import QuantScheme, expert_kernel_format
from cluster.models.deepseek_v4_weights import load_deepseek_v4_weights
from cluster.models.layers import Embedding, FusedRows, Linear


def _hc_params(args: DeepseekV4Args, mixes: int) -> tuple[nn.Parameter, nn.Parameter, nn.Parameter]:
    """(fn, base, scale) of one hyper-connection (``mixes = (2 + N) * N``) or hyper head (``N``)."""
    def param(*shape: int) -> nn.Parameter:
        return nn.Parameter(torch.empty(*shape, dtype=torch.float32), requires_grad=False)

    return param(mixes, args.hc_mult * args.hidden_size), param(mixes), param(3 if mixes > args.hc_mult else 1)


class DeepseekV4Block(nn.Module):
    """One decoder layer: hyper-connected attention, then hyper-connected MoE."""

    def __init__(self, args: DeepseekV4Args, layer_type: str, hash_routed: bool, kv: LayerKV,
                 dtype: torch.dtype, ops: Ops = REFERENCE_OPS, draft: bool = False,
                 native_experts: bool | None = None) -> None:
        super().__init__()
        self.args = args
        self.attn = DeepseekV4Attention(args, layer_type, kv, dtype, ops)
        self.ffn = DeepseekV4MoE(args, hash_routed, dtype, ops, draft, native_experts)
        self.attn_norm = V4RMSNorm(args.hidden_size, args.rms_norm_eps, ops)
        self.ffn_norm = V4RMSNorm(args.hidden_size, args.rms_norm_eps, ops)
        mixes = (2 + args.hc_mult) * args.hc_mult
        self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale = _hc_params(args, mixes)
        self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale = _hc_params(args, mixes)
        self.hc_pre, self.hc_post = ops.v4_hc_pre, ops.v4_hc_post

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, ctx: ForwardContext, rope: V4Rope) -> torch.Tensor:
        """``x [T, hc_mult, hidden]`` -> the same."""
        a = self.args
        h, post, comb = self.hc_pre(x, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale,
                                    a.hc_sinkhorn_iters, a.hc_eps, a.rms_norm_eps)
        x = self.hc_post(self.attn(self.attn_norm(h), ctx, rope), x, post, comb)
        h, post, comb = self.hc_pre(x, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale,
                                    a.hc_sinkhorn_iters, a.hc_eps, a.rms_norm_eps)
        return self.hc_post(self.ffn(self.ffn_norm(h), input_ids), x, post, comb)


class DeepseekV4MTPLayer(DeepseekV4Block):
    """An MTP (next-n) layer: a decoder block on the sliding-window path (learned routing, its own
    window KV: ``kv``, the layers after the model's in the ``swa`` group), the projections that
    join the target's pre-head hyper-connection streams with a token's embedding, and its own
    hyper head and norm; the target's embedding and LM head are shared.

    A row at position ``q`` reads the token ``x_q`` and the target's streams at ``q - 1``
    (``draft``), as DeepSeek's reference reads ``x_{p+1}`` with the streams at ``p``, one position
    later: attention depends on position differences only, and so the layer's KV at ``q`` depends
    on ``x_0 .. x_q``, as the target's does (same blocks, same prefix-cache keys). Its entry 0 has
    no streams before it, so attention starts at position 1 (``min_position``), where the
    reference's first row sits. Run only to draft (cluster/models/deepseek_v4_mtp.py)."""

    def __init__(self, args: DeepseekV4Args, layer_type: str, kv: LayerKV, dtype: torch.dtype,
                 ops: Ops = REFERENCE_OPS, native_experts: bool | None = None) -> None:
        super().__init__(args, layer_type, False, kv, dtype, ops, draft=True, native_experts=native_experts)
        self.attn.min_position = 1
        self.e_proj = Linear(args.hidden_size, args.hidden_size, False, dtype)
        self.h_proj = Linear(args.hidden_size, args.hidden_size, False, dtype)
        self.enorm = V4RMSNorm(args.hidden_size, args.rms_norm_eps, ops)
        self.hnorm = V4RMSNorm(args.hidden_size, args.rms_norm_eps, ops)
        self.norm = V4RMSNorm(args.hidden_size, args.rms_norm_eps, ops)
        self.hc_head_fn, self.hc_head_base, self.hc_head_scale = _hc_params(args, args.hc_mult)

    def draft(self, embeds: torch.Tensor, streams: torch.Tensor, input_ids: torch.Tensor, ctx: ForwardContext,
              rope: V4Rope) -> torch.Tensor:
        """``embeds [T, hidden]`` (the rows' tokens), ``streams [T, hc_mult, hidden]`` (the
        target's, or this layer's when chained, one position earlier) -> this layer's output
        streams ``[T, hc_mult, hidden]``, writing its window KV."""
        t, n, h = streams.shape
        joined = self.h_proj(self.hnorm(streams).reshape(t * n, h)).view(t, n, h)
        return super().forward(joined + self.e_proj(self.enorm(embeds)).unsqueeze(1), input_ids, ctx, rope)

    def collapse(self, streams: torch.Tensor) -> torch.Tensor:
        """Output streams ``[T, hc_mult, hidden]`` -> the hidden state ``[T, hidden]`` the LM head reads."""
        a = self.args
        return self.norm(hc_head(streams, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, a.hc_eps,
                                 a.rms_norm_eps))


class DeepseekV4ForCausalLM(nn.Module):
    """``native_experts``: keep routed experts in their checkpoint format (None: on CUDA only)."""

    def __init__(self, args: DeepseekV4Args, dtype: torch.dtype, ops: Ops = REFERENCE_OPS,
                 native_experts: bool | None = None, mtp: bool = False, dspark: bool = False) -> None:
        super().__init__()
        self.args = args
        self.dtype = dtype
        self.ops = ops
        #: The engine drafts with the MTP layer(s): ``forward`` returns the pre-head streams they
        #: read, and the ``swa`` KV group holds their layers too.
        self.drafts_with_mtp = mtp
        #: The engine drafts with the DSpark stages: ``forward`` captures the target layers'
        #: features and writes the stages' context entries (more layers of the ``swa`` group).
        self.drafts_with_dspark = dspark
        if dspark and args.dspark is None:
            from cluster.common.errors import UnsupportedSettingError
            raise UnsupportedSettingError("speculative_method='dspark' needs a DSpark checkpoint (dspark_* config "
                                          "keys: DeepSeek-V4-Flash-0731, V4.1-Flash); this one has none",
                                          param="speculative_method")        # Block size 1 places layers in groups; the real block size only changes block shapes.
        self.kv_layout = layer_kv_layout(args, deepseek_v4_kv_specs(args, 1, "float32"))
        self.embed = Embedding(args.vocab_size, args.hidden_size, dtype)
        self.layers = nn.ModuleList(
            DeepseekV4Block(args, kind, args.hash_layers[i], self.kv_layout[i], dtype, ops,
                            native_experts=native_experts)
            for i, kind in enumerate(args.layer_types))
        self.norm = V4RMSNorm(args.hidden_size, args.rms_norm_eps, ops)
        self.hc_head_fn, self.hc_head_base, self.hc_head_scale = _hc_params(args, args.hc_mult)
        self.head = None if args.tie_word_embeddings else Linear(args.hidden_size, args.vocab_size, False, dtype)
        self.mtp = nn.ModuleList(DeepseekV4MTPLayer(args, kind, LayerKV((0, args.num_layers + i)), dtype, ops,
                                                    native_experts)
                                 for i, kind in enumerate(args.mtp_layer_types))
        self.dspark: DSparkDrafter | None = None
        if args.dspark is not None:  # its stages are the checkpoint's mtp.<s>
            stages = args.dspark.num_stages
            self.mtp = nn.ModuleList(DSparkStage(args, s, LayerKV((0, args.num_layers + s)), dtype, ops, native_experts)
                                     for s in range(stages))
            self.dspark = DSparkDrafter(args, self.mtp, [(0, args.num_layers + s) for s in range(stages)])
            self._dspark_targets = frozenset(args.dspark.target_layer_ids)
        self.rope = V4Rope(args)

    def kernel_choices(self) -> list[dict[str, Any]]:
        return list(self.ops.table) + [self.fused_projections_row()]

    def fused_projections_row(self) -> dict[str, Any]:
        """The kernel-table row of the projections that share an input (``FusedRows``: per layer
        the attention's of ``h`` and of the low-rank query, the gate's with the shared expert's):
        one GEMM each, or (a member quantized, biased or of another dtype) their own GEMMs."""
        groups = [v for m in self.modules() for v in vars(m).values() if isinstance(v, FusedRows) and len(v.members) > 1]
        fused = sum(g.active for g in groups)
        impl = "fused" if fused == len(groups) else "partly fused" if fused else "separate"
        reason = (f"{fused} of {len(groups)} groups of projections that read one input run as one GEMM each"
                  + ("" if fused == len(groups) else
                     " (the rest: a member quantized, biased or of another dtype, device or width)"))
        device = self.ops.table[0]["device"] if self.ops.table else next(self.parameters()).device.type
        return {"component": "fused_projections", "op": "linear", "format": str(self.dtype).replace("torch.", ""),
                "role": "main", "impl": impl, "device": device, "reason": reason}

    @property
    def cuda_graph_blocker(self) -> str | None:
        """Why decode steps cannot be captured, or None: they can when the sparse attention, the
        indexer and the routed experts run the Triton kernels (batched, no host synchronisation;
        the references loop over sequences and experts on the host). The rest of a decode step is
        batched torch."""
        impl = {row["component"]: row["impl"] for row in self.ops.table}
        if not impl:
            return "no kernel table (ops resolved by hand)"
        other = [f"{c} runs {impl[c]}" for c in _GRAPH_COMPONENTS if impl.get(c, "triton") != "triton"]
        return "; ".join(other) + " (graphs need the Triton kernels)" if other else None

    @property
    def supports_cuda_graphs(self) -> bool:
        return self.cuda_graph_blocker is None

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return self.args.max_position_embeddings

    def kv_cache_specs(self, block_size: int, dtype: str) -> list[KVGroupSpec]:
        specs = deepseek_v4_kv_specs(self.args, block_size, dtype)
        if self.drafts_with_mtp:  # the MTP layers' windows: the layers after the model's in ``swa``
            specs[0] = dataclasses.replace(specs[0], num_layers=specs[0].num_layers + len(self.mtp))
        if self.drafts_with_dspark:
            # The DSpark stages' context entries: the layers after the model's in ``swa``. A block
            # at P reads P - window .. P - 1, one position more than the target's window keeps.
            assert self.dspark is not None
            specs[0] = dataclasses.replace(specs[0], num_layers=specs[0].num_layers + len(self.mtp),
                                           sliding_window=self.args.sliding_window + 1)
        return specs

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``input_ids [T]`` -> final hidden states ``[T, hidden]``, or (drafting with the MTP
        layer) the pre-head streams ``[T, hc_mult * hidden]`` it reads (``compute_logits``
        finishes them)."""
        a = self.args
        x = self.embed(input_ids).unsqueeze(1).expand(-1, a.hc_mult, -1).contiguous()  # [T, hc, H]
        captured = []
        with self.rope.shared():
            for i, layer in enumerate(self.layers):
                x = layer(x, input_ids, ctx, self.rope)
                if self.drafts_with_dspark and self.dspark is not None and i in self._dspark_targets:
                    captured.append(x.mean(1))  # the DSpark capture: the streams' plain mean
            if captured:
                assert self.dspark is not None
                self.dspark.write_context(torch.cat(captured, -1), ctx, self.rope)
        if self.drafts_with_mtp:
            return x.flatten(1)
        return self.final_hidden(x)

    def final_hidden(self, streams: torch.Tensor) -> torch.Tensor:
        """The last layer's streams ``[T, hc_mult, hidden]`` -> the hidden state the LM head reads."""
        a = self.args
        return self.norm(hc_head(streams, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, a.hc_eps,
                                 a.rms_norm_eps))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.drafts_with_mtp:
            hidden = self.final_hidden(hidden.view(hidden.shape[0], self.args.hc_mult, -1))
        return self.head_logits(hidden)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over final hidden states ``[T, hidden]`` (the MTP layers share it)."""
        weight = self.embed.weight if self.head is None else self.head.weight
        return nn.functional.linear(hidden, weight).float()

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]], total: int | None = None,
                     desc: str = "Loading weights") -> None:
        load_deepseek_v4_weights(self, weights, total=total, desc=desc)


#: Components whose kernels decide whether a decode step can be captured in a CUDA graph.
_GRAPH_COMPONENTS = ("v4_sparse_attention", "v4_indexer", "moe")

#: The shared ops V4 calls (it has no use for the paged attention of the Llama family); the
#: speculative ones run in its verify steps (the rows of a verify step; acceptance and the next
#: drafts on the device when verify steps are pipelined). Left unresolved, they kept the torch
#: references on a GPU too, out of the kernel table (and out of reach of anything that wraps the
#: resolved kernel).
_SHARED_OPS = ("rms_norm", "silu_and_mul", "sampling", "spec_verify_rows", "spec_accept_draft_rows")


def kernel_components(config: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """Kernels V4 needs: the shared ones it calls, its sparse attention (and, with CSA layers, the
    lightning indexer), the routed experts' MoE in the main model's expert format, and (with an MTP
    layer) the draft's MoE in the MTP experts' format."""
    QuantScheme.from_config(config)  # an unknown format fails here, by name
    args = DeepseekV4Args.from_hf(config)
    components = [c for c in base_components() if c[1] in _SHARED_OPS]
    components.append(("v4_sparse_attention", "v4_sparse_attention", "bf16", "main"))
    components += [("v4_hc_pre", "v4_hc_pre", "bf16", "main"), ("v4_hc_post", "v4_hc_post", "bf16", "main"),
                   ("v4_norm_rope", "v4_norm_rope", "bf16", "main"), ("v4_route", "v4_route", "bf16", "main")]
    if any(t != SLIDING for t in args.layer_types):
        components += [("v4_compress_decode", "v4_compress_decode", "bf16", "main"),
                       ("v4_compress_decode_paged", "v4_compress_decode_paged", "bf16", "main"),
                       ("v4_compress_store", "v4_compress_store", "bf16", "main")]
    if CSA in args.layer_types:
        components.append(("v4_indexer", "v4_indexer", "bf16", "main"))
    components.append(("moe", "moe", expert_kernel_format(config, "main"), "main"))
    if args.mtp_layer_types or args.dspark is not None:  # MTP layers or DSpark stages: both under mtp.*
        components.append(("mtp.moe", "moe", expert_kernel_format(config, "draft"), "draft"))
    return components


def build_deepseek_v4(config: dict[str, Any], dtype: torch.dtype, ops: Ops = REFERENCE_OPS,
                      mtp: bool = False, dspark: bool = False) -> DeepseekV4ForCausalLM:
    QuantScheme.from_config(config)  # an unknown quantization format fails before any allocation
    return DeepseekV4ForCausalLM(DeepseekV4Args.from_hf(config), dtype, ops, mtp=mtp, dspark=dspark)
