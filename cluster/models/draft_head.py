"""Draft head (``speculative_method=draft_head``): a one-layer NextN/EAGLE-style model that drafts
the tokens after a request's last one from the target model's last hidden state.

At position ``p`` its input is the token ``x_p`` and the target's final hidden state at ``p - 1``
(zeros at position 0): ``fc(cat(enorm(embed(x_p)), hnorm(h_{p-1})))``, then one decoder layer of
the target's own shape and a final norm give ``g_p``, whose logits (the target's LM head, shared,
as is the embedding) predict ``x_{p+1}``. Chained: ``g_p`` stands in for ``h_p`` at ``p + 1``.

Its KV at position ``p`` depends on ``x_0 .. x_p`` only (the target's hidden at ``p - 1`` does),
exactly as the target's own KV does, so it lives as one more layer of the target's full-attention
KV group: the same blocks, block tables, prefix-cache keys, preemption and transfer.

Two forwards over the same parameters: ``forward`` on the paged KV (serving, through the model's
ops), ``forward_dense`` over whole sequences with causal attention and plain torch (training, and
the reference the tests hold ``forward`` to). ``dense_hidden`` is the target's dense forward.
"""
from __future__ import annotations

import json
import os
from typing import Any, Protocol

import torch
from torch import nn

from cluster.common.errors import ModelLoadError, UnsupportedSettingError
from cluster.models.context import ForwardContext
from cluster.models.layers import Linear, RMSNorm
from cluster.models.llama import LlamaArgs, LlamaDecoderLayer, LlamaForCausalLM
from cluster.models.ops import REFERENCE_OPS, Ops
from kernels.cpu_quant import Q8Weight, linear_q8
from kernels.norm import rms_norm_ref
from kernels.rotary import apply_rotary_ref, rope_cos_sin, rope_inv_freq

#: The committed heads (trained by bench/train_draft_head.py), by ``model`` setting.
DRAFT_HEAD_DIR = os.path.join(os.path.dirname(__file__), "draft_heads")
DEFAULT_DRAFT_HEADS = {"smollm2": "smollm2-135m-instruct.safetensors"}
FORMAT = "pd-cluster-draft-head/1"
VOCAB_FORMAT = "pd-cluster-draft-vocab/1"


class LlamaDraftHead(nn.Module):
    inv_freq: torch.Tensor

    def __init__(self, args: LlamaArgs, kv_layer: int, dtype: torch.dtype, ops: Ops = REFERENCE_OPS) -> None:
        super().__init__()
        h = args.hidden_size
        self.args = args
        self.kv_layer = kv_layer
        self.enorm = RMSNorm(h, args.rms_norm_eps, dtype, ops)
        self.hnorm = RMSNorm(h, args.rms_norm_eps, dtype, ops)
        self.fc = Linear(2 * h, h, False, dtype, ops)
        self.layer = LlamaDecoderLayer(args, kv_layer, dtype, ops)
        self.norm = RMSNorm(h, args.rms_norm_eps, dtype, ops)
        self.register_buffer("inv_freq", rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling),
                             persistent=False)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``embeds, hidden [T, H]`` (the tokens' embeddings, the target's hidden one position
        earlier) at ``ctx.positions`` -> ``g [T, H]``, writing the draft layer's KV."""
        x = self.fc(torch.cat((self.enorm(embeds)[0], self.hnorm(hidden)[0]), dim=-1))
        rope = rope_cos_sin(self.inv_freq, ctx.positions)
        x, residual = self.layer(x, None, ctx, rope)
        return self.norm(x, residual)[0]

    def forward_dense(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``embeds, hidden [B, L, H]`` of sequences starting at position 0 -> ``g [B, L, H]``;
        differentiable (training)."""
        eps = self.args.rms_norm_eps
        x = nn.functional.linear(torch.cat((rms_norm_ref(embeds, self.enorm.weight, eps)[0],
                                            rms_norm_ref(hidden, self.hnorm.weight, eps)[0]), dim=-1),
                                 self.fc.weight)
        cos, sin = rope_cos_sin(self.inv_freq, torch.arange(x.shape[1], device=x.device))
        x = dense_decoder_layer(self.layer, self.args, x, cos, sin)
        return rms_norm_ref(x, self.norm.weight, eps)[0]

    def init_from_target(self, target: LlamaForCausalLM) -> None:
        """Training start: the decoder layer copied from the target's last with its two output
        projections zeroed (the layer starts as the identity and learns its updates), ``fc``
        taking the hidden state half through, so the head starts from ``g_t = h_{t-1}``."""
        with torch.no_grad():
            self.layer.load_state_dict(target.layers[-1].state_dict())
            self.layer.self_attn.o_proj.weight.zero_()
            self.layer.mlp.down_proj.weight.zero_()
            self.norm.weight.copy_(target.norm.weight)
            self.enorm.weight.fill_(1.0)
            self.hnorm.weight.fill_(1.0)
            h = self.args.hidden_size
            self.fc.weight.zero_()
            self.fc.weight[:, h:].copy_(torch.eye(h, dtype=self.fc.weight.dtype))
            self.fc.weight[:, :h].normal_(0.0, 0.02)


class Drafter(Protocol):
    """A draft model over a target, as the engine's DraftHeadRunner drives it: at each row it
    reads a token and the target's hidden state one position earlier (a row of ``width`` values of
    ``dtype``), writes its KV (in the target's KV groups) and returns its own hidden state of the
    same width, which stands in for the target's when it is chained; ``draft_logits`` turns that
    into the next token's logits, ``draft_tokens`` into the drafted token. ``module`` holds its
    parameters; ``ops`` its kernels."""

    width: int
    dtype: torch.dtype
    vocab_size: int
    ops: Ops
    module: nn.Module

    def draft(self, input_ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor: ...

    def draft_logits(self, g: torch.Tensor) -> torch.Tensor: ...

    def draft_tokens(self, g: torch.Tensor, scale: torch.Tensor | None = None,
                     gumbel: torch.Tensor | None = None) -> torch.Tensor:
        """Each row's drafted token over the tokens it may draft: the argmax of its logits, or
        with ``scale [N]`` (1 / temperature) and ``gumbel [N, V']`` (Gumbel noise over those
        tokens, ``draft_vocab_ids`` of the whole vocabulary's) a draw from its tempered
        distribution (``perturbed_argmax``)."""
        ...

    def draft_vocab_ids(self) -> torch.Tensor | None:
        """The token ids a draft may take, in the order of ``gumbel``'s columns (None: all)."""
        ...


class HeadDrafter:
    """A LlamaDraftHead over its target: the target's embedding and LM head, shared. With
    ``vocab_ids`` (a draft vocabulary: ``load_draft_vocab``) drafts are the argmax over those
    rows of the LM head only (a copy of them: int8 where the target's logits run on the CPU int8
    kernel, else the model's dtype)."""

    def __init__(self, head: "LlamaDraftHead", target: LlamaForCausalLM,
                 vocab_ids: torch.Tensor | None = None) -> None:
        self.module = head
        self.target = target
        self.width = int(head.args.hidden_size)
        self.dtype = head.fc.weight.dtype
        self.vocab_size = int(target.vocab_size)
        self.ops: Ops = getattr(target, "ops", REFERENCE_OPS)
        self.vocab_ids: torch.Tensor | None = None
        self._q8: Q8Weight | None = None
        self._rows: torch.Tensor | None = None
        if vocab_ids is not None:
            self._restrict(vocab_ids)

    def _restrict(self, vocab_ids: torch.Tensor) -> None:
        target = self.target
        q8 = getattr(target, "quantized_logits", None)
        lm_head = target.lm_head
        if q8 is not None:
            ids = vocab_ids.to(q8.codes.device)
            self._q8 = Q8Weight(q8.codes.index_select(0, ids).contiguous(), q8.scales.index_select(0, ids).contiguous(),
                                None if q8.dense is None else q8.dense.index_select(0, ids).contiguous())
        elif lm_head is not None and lm_head.quantized is not None:
            return  # a 4-bit LM head: no row subset of it here; the whole vocabulary it is
        else:
            weight = target.embed_tokens.weight if lm_head is None else lm_head.weight
            self._rows = weight.index_select(0, vocab_ids.to(weight.device)).contiguous()
        self.vocab_ids = vocab_ids.to(target.embed_tokens.weight.device)

    def draft(self, input_ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.module(self.target.embed_tokens(input_ids).to(hidden.dtype), hidden, ctx)

    def draft_logits(self, g: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(g)

    def draft_tokens(self, g: torch.Tensor, scale: torch.Tensor | None = None,
                     gumbel: torch.Tensor | None = None) -> torch.Tensor:
        """The drafted token of each row of ``g [N, H]`` over the draft vocabulary (the whole one
        without a ``vocab_ids``): see ``Drafter.draft_tokens``."""
        if self.vocab_ids is None:
            return perturbed_argmax(self.draft_logits(g), scale, gumbel)
        if self._q8 is not None:
            logits = linear_q8(g, self._q8)
        else:
            assert self._rows is not None
            logits = nn.functional.linear(g.to(self._rows.dtype), self._rows)
        return self.vocab_ids.index_select(0, perturbed_argmax(logits, scale, gumbel))

    def draft_vocab_ids(self) -> torch.Tensor | None:
        return self.vocab_ids


def perturbed_argmax(logits: torch.Tensor, scale: torch.Tensor | None, gumbel: torch.Tensor | None) -> torch.Tensor:
    """``argmax(logits * scale + gumbel)`` per row (the Gumbel-max draw from ``softmax(logits *
    scale)``), or the plain argmax without noise. A greedy row has scale 1 and gumbel 0."""
    if gumbel is None:
        return logits.argmax(dim=-1)
    assert scale is not None
    return (logits.float() * scale[:, None] + gumbel).argmax(dim=-1)


def dense_decoder_layer(layer: LlamaDecoderLayer, args: LlamaArgs, x: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor) -> torch.Tensor:
    """One Llama decoder layer over ``x [B, L, H]`` with causal attention (plain torch)."""
    b, n, _ = x.shape
    attn = layer.self_attn
    eps = args.rms_norm_eps
    h = rms_norm_ref(x, layer.input_layernorm.weight, eps)[0]
    qkv = nn.functional.linear(h, attn.qkv_proj.weight, attn.qkv_proj.bias)
    q, k, v = qkv.split((attn.q_size, attn.kv_size, attn.kv_size), dim=-1)
    q = q.reshape(b, n, attn.num_heads, attn.head_dim)
    k = k.reshape(b, n, attn.num_kv_heads, attn.head_dim)
    v = v.reshape(b, n, attn.num_kv_heads, attn.head_dim)
    if attn.q_norm is not None and attn.k_norm is not None:
        q = rms_norm_ref(q, attn.q_norm.weight, eps)[0]
        k = rms_norm_ref(k, attn.k_norm.weight, eps)[0]
    q, k = apply_rotary_ref(q, cos, sin), apply_rotary_ref(k, cos, sin)
    out = nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=attn.scale,
        enable_gqa=attn.num_heads != attn.num_kv_heads)
    x = x + nn.functional.linear(out.transpose(1, 2).reshape(b, n, attn.q_size), attn.o_proj.weight,
                                 attn.o_proj.bias)
    h = rms_norm_ref(x, layer.post_attention_layernorm.weight, eps)[0]
    gate, up = nn.functional.linear(h, layer.mlp.gate_up_proj.weight, layer.mlp.gate_up_proj.bias).chunk(2, dim=-1)
    return x + nn.functional.linear(nn.functional.silu(gate) * up, layer.mlp.down_proj.weight,
                                    layer.mlp.down_proj.bias)


def dense_hidden(model: LlamaForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """The target's final hidden states ``[B, L, H]`` for ``input_ids [B, L]`` (sequences from
    position 0; right padding changes no earlier position). Float weights only."""
    x = model.embed_tokens(input_ids)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    cos, sin = rope_cos_sin(model.inv_freq, positions)  # type: ignore[arg-type]
    for layer in model.layers:
        x = dense_decoder_layer(layer, model.args, x, cos, sin)  # type: ignore[arg-type]
    return rms_norm_ref(x, model.norm.weight, model.args.rms_norm_eps)[0]


def head_metadata(args: LlamaArgs, target: str, **extra: Any) -> dict[str, str]:
    """What a saved head records of the model it drafts for (checked when it loads)."""
    meta = {"format": FORMAT, "target": target, "hidden_size": str(args.hidden_size),
            "vocab_size": str(args.vocab_size), "num_heads": str(args.num_heads),
            "num_kv_heads": str(args.num_kv_heads), "intermediate_size": str(args.intermediate_size)}
    meta.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in extra.items()})
    return meta


def default_draft_head_path(model: str) -> str | None:
    name = DEFAULT_DRAFT_HEADS.get(model)
    return None if name is None else os.path.join(DRAFT_HEAD_DIR, name)


def draft_vocab_path(head_path: str) -> str:
    """Where the vocabulary of the head at ``head_path`` lives (``<head>.vocab.safetensors``)."""
    return head_path.removesuffix(".safetensors") + ".vocab.safetensors"


def load_draft_vocab(path: str, vocab_size: int) -> torch.Tensor:
    """A draft vocabulary written by bench/draft_vocab.py: its ``token_ids`` (int64, distinct, each
    below ``vocab_size``, which it must have been counted for)."""
    from safetensors import safe_open

    if not os.path.isfile(path):
        raise ModelLoadError(f"draft vocabulary {path!r} does not exist", param="speculative_draft_vocab")
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            ids = f.get_tensor("token_ids") if "token_ids" in set(f.keys()) else None
    except Exception as exc:  # noqa: BLE001 - a corrupt file is a load error
        raise ModelLoadError(f"draft vocabulary {path!r} cannot be read: {exc}", param="speculative_draft_vocab") from exc
    if meta.get("format") != VOCAB_FORMAT or ids is None:
        raise ModelLoadError(f"{path!r} is not a draft vocabulary (format {meta.get('format')!r}, want "
                             f"{VOCAB_FORMAT!r}, with token_ids)", param="speculative_draft_vocab")
    if meta.get("vocab_size") != str(vocab_size):
        raise ModelLoadError(f"draft vocabulary {path!r} was counted for vocab_size={meta.get('vocab_size')}, the "
                             f"model has {vocab_size}", param="speculative_draft_vocab")
    ids = ids.to(torch.int64).flatten()
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size or ids.unique().numel() != ids.numel():
        raise ModelLoadError(f"draft vocabulary {path!r}: token_ids must be distinct ids in [0, {vocab_size})",
                             param="speculative_draft_vocab")
    return ids


def load_draft_head(path: str, target: Any, kv_layer: int, dtype: torch.dtype, device: torch.device,
                    ops: Ops = REFERENCE_OPS) -> LlamaDraftHead:
    """Build a head for ``target`` (a Llama-family model) and load its weights from ``path`` (a
    safetensors file written by bench/train_draft_head.py), checking its names, shapes and the
    target shape it was trained for."""
    from safetensors import safe_open

    if not isinstance(target, LlamaForCausalLM):
        raise UnsupportedSettingError(
            f"speculative_method='draft_head' drafts for Llama-family models; this model is "
            f"{type(target).__name__}", param="speculative_method")
    if not os.path.isfile(path):
        raise ModelLoadError(f"draft head weights {path!r} do not exist", param="draft_model")
    args = target.args
    head = LlamaDraftHead(args, kv_layer, dtype, ops)
    expected = {name: tuple(p.shape) for name, p in head.state_dict().items()}
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            names = set(f.keys())
            tensors = {name: f.get_tensor(name) for name in names}
    except Exception as exc:  # noqa: BLE001 - a corrupt file is a load error
        raise ModelLoadError(f"draft head weights {path!r} cannot be read: {exc}", param="draft_model") from exc
    if meta.get("format") != FORMAT:
        raise ModelLoadError(f"{path!r} is not a draft head file (format {meta.get('format')!r}, want {FORMAT!r})",
                             param="draft_model")
    for key in ("hidden_size", "vocab_size", "num_heads", "num_kv_heads", "intermediate_size"):
        if meta.get(key) != str(getattr(args, key)):
            raise ModelLoadError(f"draft head {path!r} was trained for {key}={meta.get(key)}, the model has "
                                 f"{getattr(args, key)}", param="draft_model")
    if names != set(expected):
        raise ModelLoadError(f"draft head {path!r}: tensors {sorted(names ^ set(expected))} do not match the "
                             f"head's parameters", param="draft_model")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ModelLoadError(f"draft head {path!r}: {name} has shape {tuple(tensors[name].shape)}, want {shape}",
                                 param="draft_model")
    head.load_state_dict({k: v.to(dtype) for k, v in tensors.items()})
    head.metadata = meta  # type: ignore[assignment]
    return head.to(device)
