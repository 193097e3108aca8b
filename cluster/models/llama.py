"""Llama family: LlamaForCausalLM, Qwen2ForCausalLM (q/k/v bias), Qwen3ForCausalLM (per-head
q/k RMSNorm), SmolLM2 (Llama). GQA, RoPE (default and llama3 scaling), RMSNorm, SwiGLU, tied or
untied embeddings. One full-attention KV group holding every layer's K and V."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cluster.common.errors import UnsupportedArchitectureError
from cluster.common.kv_spec import KVGroupSpec
from cluster.models.context import ForwardContext
from cluster.models.layers import Embedding, GatedMLP, Linear, RMSNorm
from kernels.cpu_quant import Q8Weight, linear_q8
from kernels.rotary import rope_cos_sin, rope_inv_freq
from cluster.models.loader import ParamTarget
from cluster.models.ops import REFERENCE_OPS, Ops


@dataclass(frozen=True)
class LlamaArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> LlamaArgs:
        arch = (config.get("architectures") or ["LlamaForCausalLM"])[0]
        if config.get("use_sliding_window"):
            raise UnsupportedArchitectureError(f"{arch} with use_sliding_window=true is not supported")
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
            theta = float(rope.pop("rope_theta", config.get("rope_theta", 10000.0)))
            kind = rope.get("rope_type", rope.get("type", "default"))
            if kind not in ("default", "llama3"):
                raise UnsupportedArchitectureError(f"rope type {kind!r} is not supported (default, llama3 are)")
            is_qwen2 = arch == "Qwen2ForCausalLM"
            return cls(
                architecture=arch,
                vocab_size=int(config["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                num_layers=int(config["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=rope if kind != "default" else None,
                max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                qkv_bias=is_qwen2 or bool(config.get("attention_bias", False)),
                o_bias=(not is_qwen2) and bool(config.get("attention_bias", False)),
                mlp_bias=bool(config.get("mlp_bias", False)),
                qk_norm=arch == "Qwen3ForCausalLM",
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise UnsupportedArchitectureError(f"{arch}: config.json lacks or mis-types {exc}") from exc


class LlamaAttention(nn.Module):
    def __init__(self, args: LlamaArgs, layer_idx: int, dtype: torch.dtype, ops: Ops) -> None:
        super().__init__()
        self.ops = ops
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.scale = args.head_dim ** -0.5
        self.qkv_proj = Linear(args.hidden_size, self.q_size + 2 * self.kv_size, args.qkv_bias, dtype, ops)
        self.o_proj = Linear(self.q_size, args.hidden_size, args.o_bias, dtype, ops)
        if args.qk_norm:
            self.q_norm: RMSNorm | None = RMSNorm(args.head_dim, args.rms_norm_eps, dtype, ops)
            self.k_norm: RMSNorm | None = RMSNorm(args.head_dim, args.rms_norm_eps, dtype, ops)
        else:
            self.q_norm = self.k_norm = None
        self.eps = args.rms_norm_eps

    def forward(self, x: torch.Tensor, ctx: ForwardContext, rope: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        """``rope``: the step's ``cos, sin [T, D // 2]``, computed once for all layers."""
        t = x.shape[0]
        layer_cache = ctx.kv_caches[0][:, self.layer_idx]  # [num_blocks, 2, bs, Hkv, D]
        k_cache, v_cache = layer_cache[:, 0], layer_cache[:, 1]
        meta = ctx.attention_metadata(0)
        norms = (self.q_norm.weight, self.k_norm.weight) if self.q_norm is not None and self.k_norm is not None \
            else (None, None)
        # q/k norms, rotary and the KV write in one op: [T, Hq, D] queries out, k/v into the cache
        dense = prompt_rows(ctx, t)
        q = self.ops.qkv_prepare(self.qkv_proj(x, dense=dense), self.num_heads, self.num_kv_heads, self.head_dim,
                                 *rope, k_cache, v_cache, meta.slot_mapping, *norms, self.eps)
        out = self.ops.attention(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(t, self.q_size), dense=dense)


def prompt_rows(ctx: ForwardContext, num_rows: int) -> bool | None:
    """True where the step computes prompt rows (``ForwardContext.prefill``, or several queries of
    one sequence): quantized CPU projections then take one kernel whatever the chunk's size, so
    a prompt's KV and first token do not depend on how it was chunked or how much of it a prefix
    hit supplied; None (decode steps): the kernel the rows suit (``kernels.cpu_quant.linear_q4``)."""
    return True if ctx.prefill or len(ctx.seq_lens_cpu) != num_rows else None


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs, layer_idx: int, dtype: torch.dtype, ops: Ops) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, ops)
        self.self_attn = LlamaAttention(args, layer_idx, dtype, ops)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, ops)
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, args.mlp_bias, dtype, ops)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext,
                rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        if residual is None:
            residual = x
        h = self.self_attn(h, ctx, rope)
        h, residual = self.post_attention_layernorm(h, residual)
        assert residual is not None
        return self.mlp(h, dense=prompt_rows(ctx, h.shape[0])), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, args: LlamaArgs, dtype: torch.dtype, ops: Ops = REFERENCE_OPS) -> None:
        super().__init__()
        self.args = args
        self.dtype = dtype
        self.ops = ops
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size, dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(args, i, dtype, ops) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, ops)
        self.lm_head = None if args.tie_word_embeddings else Linear(args.hidden_size, args.vocab_size, False, dtype)
        self.register_buffer("inv_freq", rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling),
                             persistent=False)
        #: CPU only (cluster.models.cpu_quant): the tied logits projection as int8 rows, and the
        #: kernel table rows of the quantized weights.
        self.quantized_logits: Q8Weight | None = None
        self.quantized_kernels: list[dict[str, Any]] = []
        #: CPU only: decode-only steps in fewer ops (cluster.models.llama_cpu_decode), or None.
        self.cpu_decode: Any = None

    def quantize_logits(self, weight: Q8Weight) -> None:
        self.quantized_logits = weight

    @property
    def cuda_graph_blocker(self) -> str | None:
        """Why decode steps cannot be captured, or None: they can when attention runs the Triton
        kernels (no host syncs, no step-dependent shapes)."""
        name = self.ops.attention.__name__
        if name == "paged_attention_triton":
            return None
        return f"attention runs {name}, not the Triton kernel (attention_backend)"

    @property
    def supports_cuda_graphs(self) -> bool:
        return self.cuda_graph_blocker is None

    def kernel_choices(self) -> list[dict[str, Any]]:
        return list(self.ops.table) + list(self.quantized_kernels)

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return self.args.max_position_embeddings

    def kv_cache_specs(self, block_size: int, dtype: str) -> list[KVGroupSpec]:
        a = self.args
        return [KVGroupSpec(name="attn", kind="full", num_layers=a.num_layers,
                            block_shape=(2, block_size, a.num_kv_heads, a.head_dim), dtype=dtype,
                            block_size=block_size)]

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``input_ids [T]`` -> final hidden states ``[T, H]``."""
        if self.cpu_decode is not None and self.cpu_decode.applies(ctx, input_ids.shape[0]):
            return self.cpu_decode.forward(input_ids, ctx)
        x = self.embed_tokens(input_ids)
        rope = rope_cos_sin(self.inv_freq, ctx.positions)  # once per step, shared by every layer
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(x, residual, ctx, rope)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.quantized_logits is not None:
            return linear_q8(hidden, self.quantized_logits).float()
        if self.lm_head is not None and self.lm_head.quantized is not None:
            return self.lm_head(hidden).float()
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return nn.functional.linear(hidden, weight).float()

    def checkpoint_targets(self) -> dict[str, ParamTarget]:
        """HF checkpoint tensor name -> parameter (slice) it loads into."""
        a = self.args
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        targets: dict[str, ParamTarget] = {
            "model.embed_tokens.weight": ParamTarget("embed_tokens.weight"),
            "model.norm.weight": ParamTarget("norm.weight"),
        }
        if self.lm_head is not None:
            targets["lm_head.weight"] = ParamTarget("lm_head.weight")
        for i in range(a.num_layers):
            hf, me = f"model.layers.{i}.", f"layers.{i}."
            for suffix in ("weight",) + (("bias",) if a.qkv_bias else ()):
                for name, off, size in (("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)):
                    targets[f"{hf}self_attn.{name}.{suffix}"] = ParamTarget(
                        f"{me}self_attn.qkv_proj.{suffix}", off, size)
            for suffix in ("weight",) + (("bias",) if a.o_bias else ()):
                targets[f"{hf}self_attn.o_proj.{suffix}"] = ParamTarget(f"{me}self_attn.o_proj.{suffix}")
            for suffix in ("weight",) + (("bias",) if a.mlp_bias else ()):
                inter = a.intermediate_size
                targets[f"{hf}mlp.gate_proj.{suffix}"] = ParamTarget(f"{me}mlp.gate_up_proj.{suffix}", 0, inter)
                targets[f"{hf}mlp.up_proj.{suffix}"] = ParamTarget(f"{me}mlp.gate_up_proj.{suffix}", inter, inter)
                targets[f"{hf}mlp.down_proj.{suffix}"] = ParamTarget(f"{me}mlp.down_proj.{suffix}")
            for norm in ("input_layernorm", "post_attention_layernorm"):
                targets[f"{hf}{norm}.weight"] = ParamTarget(f"{me}{norm}.weight")
            if a.qk_norm:
                targets[f"{hf}self_attn.q_norm.weight"] = ParamTarget(f"{me}self_attn.q_norm.weight")
                targets[f"{hf}self_attn.k_norm.weight"] = ParamTarget(f"{me}self_attn.k_norm.weight")
        return targets

    #: Checkpoint tensors that carry nothing the model needs.
    ignored_tensors = ("rotary_emb.inv_freq", "lm_head.weight")
