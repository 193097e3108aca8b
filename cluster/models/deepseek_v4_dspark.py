"""DeepSeek-V4's DSpark drafter (``speculative_method=dspark``): the speculation DeepSeek-V4-Flash-0731
and V4.1-Flash ship in place of an MTP layer, as DeepSeek's reference inference code defines it.

Structure (checkpoint names under ``mtp.<s>.``, ``s`` = 0 .. num_stages - 1): each stage is a V4
block (hyper-connected attention then hyper-connected MoE, learned routing, its experts in their
own format and run by the ``draft`` role's kernel) whose attention is ``DSparkAttention``; stage 0
also holds ``main_proj``/``main_norm``, the last stage ``norm``, ``hc_head_*``, the Markov head
(``markov_head.markov_w1`` [V, r], ``markov_head.markov_w2`` [V, r]) and the confidence head
(``confidence_head.proj`` [1, hidden + r]). The target's embedding and LM head are shared.

- Context. The target's forward captures, after each of ``dspark_target_layer_ids``, the plain
  mean of its hyper-connection streams (no norm); their concatenation in layer order gives
  ``main_x = main_norm(main_proj(captured))`` per position, and each stage turns that row into its
  context entry ``rope(kv_norm(wkv_s(main_x)))`` at the row's position. Those entries are the
  drafter's whole state: they live as ``num_stages`` more layers of the ``swa`` KV group, written
  by the target's forward for every row it computes, so they are paged, prefix-cached, preempted
  and transferred with the target's window, and a verify step's rejected rows (at positions at
  or past the next block's first) are never read before the target rewrites them: no rollback.
- A block. For a request whose newest token ``a`` sits at position ``P``: rows ``[a, noise x
  (B - 1)]`` at positions ``P .. P + B - 1`` run through the stages together; every row attends
  the stage's context entries at ``P - window .. P - 1`` and all ``B`` rows of the block (no mask
  inside the block), with the per-head sink. The last stage's hyper head gives ``g``, and
  ``U = head(norm(g))`` the base logits. Row ``i`` drafts the token at ``P + 1 + i``:
  ``z_i = U_i + markov_w2 @ markov_w1[y_{i-1}]`` (``y_{-1} = a``), ``y_i = argmax z_i``; its
  confidence ``c_i = proj([g_i, markov_w1[y_{i-1}]])``, ``sigmoid(c_i)`` the chance that draft i
  is accepted once those before it are. The block always runs at its trained width ``B``; an
  early stop (``dspark_confidence_threshold``) only shortens what is verified.

Like this project's V4 target, stored entries are kept in the model dtype (DeepSeek's code rounds
their non-RoPE features through FP8).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from cluster.models.context import ForwardContext
from cluster.models.deepseek_v4_attention import DeepseekV4Attention
from cluster.models.deepseek_v4_config import SLIDING, DeepseekV4Args, DSparkArgs
from cluster.models.deepseek_v4_kv import LayerKV
from cluster.models.deepseek_v4_layers import V4RMSNorm, V4Rope, hc_head
from cluster.models.layers import Embedding, Linear
from cluster.models.ops import REFERENCE_OPS, Ops

if TYPE_CHECKING:
    from cluster.models.deepseek_v4 import DeepseekV4Block


class DSparkAttention(DeepseekV4Attention):
    """A stage's attention: the V4 attention's projections (low-rank queries with per-head
    RMSNorm, the shared K = V entry, grouped output projection, sinks) over the stage's context
    entries and the block's own rows."""

    def __init__(self, args: DeepseekV4Args, kv: LayerKV, dtype: torch.dtype, ops: Ops = REFERENCE_OPS) -> None:
        super().__init__(args, SLIDING, kv, dtype, ops)

    def entries(self, main_x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor | None = None,
                slots: torch.Tensor | None = None) -> torch.Tensor:
        """``main_x [T, hidden]`` -> the context entries ``[T, head_dim]`` at the rows' positions
        (also written to ``cache [num_blocks, block_size, head_dim]`` at ``slots [T]`` if given)."""
        return self.norm_rope(self.wkv(main_x).unsqueeze(1), cos, sin, self.kv_norm.weight, self.kv_norm.eps,
                              cache=cache, slots=slots)[:, 0]

    def block(self, h: torch.Tensor, context: torch.Tensor, valid: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> torch.Tensor:
        """``h [N * B, hidden]`` (N blocks of B rows), ``context [N, W, head_dim]`` with ``valid
        [N, W]`` -> ``[N * B, hidden]``."""
        t = h.shape[0]
        n, width = context.shape[0], t // context.shape[0]
        q = self.wq_b(self.q_norm(self.wq_a(h))).view(t, self.num_heads, self.head_dim)
        q = self.norm_rope(q, cos, sin, eps=self.args.rms_norm_eps)
        own = self.entries(h, cos, sin).view(n, width, -1)
        keys = torch.cat([context.to(own.dtype), own], 1)  # [N, W + B, D]
        mask = torch.cat([valid, torch.ones((n, width), dtype=torch.bool, device=valid.device)], 1)
        keys = keys.float()  # scores and the weighted sum in float32 (a few hundred keys per block)
        logits = torch.einsum("nbhd,nkd->nhbk", q.view(n, width, self.num_heads, -1).float(), keys)
        logits = (logits * self.head_dim ** -0.5).masked_fill(~mask[:, None, None, :], float("-inf"))
        sink = self.attn_sink.float()[None, :, None, None].expand(n, -1, width, 1)
        probs = torch.cat([logits, sink], -1).softmax(-1)[..., :-1]
        out = torch.einsum("nhbk,nkd->nbhd", probs, keys).to(h.dtype).reshape(t, self.num_heads, self.head_dim)
        out = self.norm_rope(out, cos, sin, inverse=True)  # K = V carried RoPE into the output
        return self.wo_b(self._grouped_wo_a(out))


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.markov_w1 = Embedding(vocab_size, rank, dtype)
        self.markov_w2 = Linear(rank, vocab_size, False, dtype)


class ConfidenceHead(nn.Module):
    def __init__(self, width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.proj = Linear(width, 1, False, dtype)


def _block_class() -> type[DeepseekV4Block]:
    from cluster.models.deepseek_v4 import DeepseekV4Block
    return DeepseekV4Block


class DSparkStage(nn.Module):
    """One draft stage: a V4 block with ``DSparkAttention``; stage 0 fuses the captured target
    features, the last stage holds the heads."""

    def __init__(self, args: DeepseekV4Args, index: int, kv: LayerKV, dtype: torch.dtype, ops: Ops = REFERENCE_OPS,
                 native_experts: bool | None = None) -> None:
        super().__init__()
        d = args.dspark
        assert d is not None
        self.args, self.index = args, index
        block = _block_class()(args, SLIDING, False, kv, dtype, ops, draft=True, native_experts=native_experts)
        block.attn = DSparkAttention(args, kv, dtype, ops)
        # the block's parameters, under the checkpoint's names (mtp.<s>.attn.*, mtp.<s>.ffn.*, ...)
        self.attn, self.ffn, self.attn_norm, self.ffn_norm = block.attn, block.ffn, block.attn_norm, block.ffn_norm
        self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale = block.hc_attn_fn, block.hc_attn_base, block.hc_attn_scale
        self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale = block.hc_ffn_fn, block.hc_ffn_base, block.hc_ffn_scale
        self.hc_pre, self.hc_post = block.hc_pre, block.hc_post
        h = args.hidden_size
        if index == 0:
            self.main_proj = Linear(len(d.target_layer_ids) * h, h, False, dtype)
            self.main_norm = V4RMSNorm(h, args.rms_norm_eps, ops)
        if index == d.num_stages - 1:
            from cluster.models.deepseek_v4 import _hc_params
            self.norm = V4RMSNorm(h, args.rms_norm_eps, ops)
            self.hc_head_fn, self.hc_head_base, self.hc_head_scale = _hc_params(args, args.hc_mult)
            self.markov_head = MarkovHead(args.vocab_size, d.markov_rank, dtype)
            self.confidence_head = ConfidenceHead(h + d.markov_rank, dtype)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, context: torch.Tensor, valid: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [N * B, hc_mult, hidden]`` -> the same."""
        a = self.args
        h, post, comb = self.hc_pre(x, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale,
                                    a.hc_sinkhorn_iters, a.hc_eps, a.rms_norm_eps)
        x = self.hc_post(self.attn.block(self.attn_norm(h), context, valid, cos, sin), x, post, comb)
        h, post, comb = self.hc_pre(x, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale,
                                    a.hc_sinkhorn_iters, a.hc_eps, a.rms_norm_eps)
        return self.hc_post(self.ffn(self.ffn_norm(h), input_ids), x, post, comb)


class DSparkDrafter:
    """The stages (the target's ``mtp`` ModuleList, which owns their parameters), their context
    writes and block drafting. ``layers``: where stage s's entries live, ``(group, layer)``."""

    def __init__(self, args: DeepseekV4Args, stages: nn.ModuleList, layers: list[tuple[int, int]]) -> None:
        assert args.dspark is not None
        self.args: DeepseekV4Args = args
        self.spec: DSparkArgs = args.dspark
        self.stages = stages
        self.layers = layers
        #: The Markov head's rank -> vocab projection in float32, as DeepSeek's reference holds it
        #: (made on first use, after loading: 4 x vocab x rank bytes).
        self._markov_w2: torch.Tensor | None = None

    def write_context(self, captured: torch.Tensor, ctx: ForwardContext, rope: V4Rope) -> None:
        """The target's captured features ``[T, len(targets) * hidden]`` at ``ctx.positions`` ->
        every stage's context entries, written at the rows' slots."""
        first = cast(DSparkStage, self.stages[0])
        main_x = first.main_norm(first.main_proj(captured))
        cos, sin = rope.cos_sin("main", ctx.positions)
        for stage, (group, layer) in zip(cast(list[DSparkStage], self.stages), self.layers):
            slots = ctx.slot_mappings[group]
            assert slots is not None  # padding rows (slot -1) write the null block
            stage.attn.entries(main_x, cos, sin, cache=ctx.kv_caches[group][:, layer], slots=slots)

    def context(self, kv_caches: list[torch.Tensor], tables: torch.Tensor, positions: torch.Tensor
                ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Each stage's entries at ``positions - window .. positions - 1`` (``tables``: the blocks'
        table of the ``swa`` group per request) -> ``[N, W, head_dim]`` per stage and ``valid [N, W]``."""
        window = self.args.sliding_window
        pos = positions[:, None] - window + torch.arange(window, device=positions.device)[None]  # [N, W]
        valid = pos >= 0
        pos = pos.clamp(min=0)
        out = []
        for group, layer in self.layers:
            cache = kv_caches[group][:, layer]
            bs = cache.shape[1]
            blocks = tables.long().gather(1, pos // bs)
            out.append(cache[blocks, pos % bs])
        return out, valid

    def draft_block(self, embed: Embedding, head_logits, rope: V4Rope, kv_caches: list[torch.Tensor],
                    tables: torch.Tensor, anchors: torch.Tensor, positions: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Blocks for ``N`` requests whose newest tokens ``anchors [N]`` sit at ``positions [N]`` ->
        (drafts ``[N, B]`` (greedy over the Markov-corrected logits), their logits ``[N, B, V]``
        (float32), confidence logits ``[N, B]``)."""
        a, spec = self.args, self.spec
        n, width = anchors.shape[0], spec.block_size
        tokens = torch.full((n, width), spec.noise_token_id, dtype=torch.long, device=anchors.device)
        tokens[:, 0] = anchors
        rows = (positions[:, None] + torch.arange(width, device=positions.device)[None]).reshape(-1)
        cos, sin = rope.cos_sin("main", rows)
        contexts, valid = self.context(kv_caches, tables, positions)
        ids = tokens.reshape(-1)
        x = embed(ids).unsqueeze(1).expand(-1, a.hc_mult, -1).contiguous()
        for stage, context in zip(self.stages, contexts):
            x = stage(x, ids, context, valid, cos, sin)
        last = cast(DSparkStage, self.stages[-1])
        g = hc_head(x, last.hc_head_fn, last.hc_head_base, last.hc_head_scale, a.hc_eps, a.rms_norm_eps)
        base = head_logits(last.norm(g)).view(n, width, -1)  # [N, B, V] float32
        g = g.view(n, width, -1)
        w1 = last.markov_head.markov_w1
        w2 = self._markov_w2
        if w2 is None or w2.device != base.device:
            w2 = self._markov_w2 = last.markov_head.markov_w2.weight.float()
        proj = last.confidence_head.proj.weight.float()
        prev = anchors
        drafts, logits, confidence = [], [], []
        for i in range(width):
            e = w1(prev)  # [N, r]: the Markov state, the token before row i's draft
            z = base[:, i] + nn.functional.linear(e.float(), w2)
            confidence.append((torch.cat([g[:, i].float(), e.float()], -1) @ proj.t())[:, 0])
            prev = z.argmax(-1)
            drafts.append(prev)
            logits.append(z)
        return torch.stack(drafts, 1), torch.stack(logits, 1), torch.stack(confidence, 1)
