"""Drafting with DeepSeek-V4's MTP layer (``speculative_method=mtp``): the ``Drafter`` the
engine's DraftHeadRunner drives, as it drives the Llama draft head.

The target, built with ``mtp=True``, returns its pre-head hyper-connection streams
``[T, hc_mult * hidden]`` from its forward (its ``compute_logits`` finishes them), and those are the
hidden rows the runner keeps and hands to the MTP layer one position later (the layer's row at
``q`` reads ``x_q`` and the streams at ``q - 1``; see ``DeepseekV4MTPLayer``). The layer's output
streams, of the same width, stand in for the target's when it is chained: one layer drafts all
``k`` tokens, its window KV one position further each pass, as DeepSeek's reference and vLLM do.
Its MoE runs the ``draft`` role's kernel (``draft_moe_backend``), in the MTP experts' own format.
"""
from __future__ import annotations

import torch

from cluster.common.errors import UnsupportedSettingError
from cluster.models.context import ForwardContext
from cluster.models.deepseek_v4 import DeepseekV4ForCausalLM, DeepseekV4MTPLayer
from cluster.models.draft_head import perturbed_argmax
from cluster.models.ops import Ops


class MTPDrafter:
    def __init__(self, target: DeepseekV4ForCausalLM, index: int = 0) -> None:
        if not target.drafts_with_mtp:
            raise UnsupportedSettingError("the model was not built to draft with its MTP layers (mtp=True)",
                                          param="speculative_method")
        if target.args.dspark is not None:
            raise UnsupportedSettingError(
                "this checkpoint ships a DSpark drafter under mtp.* (dspark_* config keys), not an MTP layer: use "
                "speculative_method='dspark'", param="speculative_method")
        if len(target.mtp) <= index:
            raise UnsupportedSettingError(
                "speculative_method='mtp' needs the checkpoint's MTP layer (mtp.0.*); this checkpoint has none",
                param="speculative_method")
        self.target = target
        self.module: DeepseekV4MTPLayer = target.mtp[index]  # type: ignore[assignment]
        a = target.args
        self.hc_mult, self.hidden_size = a.hc_mult, a.hidden_size
        self.width = a.hc_mult * a.hidden_size
        self.dtype = target.dtype
        self.vocab_size = a.vocab_size
        self.ops: Ops = target.ops

    def draft(self, input_ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``input_ids [T]``, ``hidden [T, hc_mult * hidden]`` (streams one position earlier) ->
        the layer's output streams, flattened the same way."""
        streams = hidden.view(hidden.shape[0], self.hc_mult, self.hidden_size).to(self.dtype)
        out = self.module.draft(self.target.embed(input_ids), streams, input_ids, ctx, self.target.rope)
        return out.flatten(1)

    def draft_logits(self, g: torch.Tensor) -> torch.Tensor:
        return self.target.head_logits(self.module.collapse(g.view(g.shape[0], self.hc_mult, self.hidden_size)))

    def draft_tokens(self, g: torch.Tensor, scale: torch.Tensor | None = None,
                     gumbel: torch.Tensor | None = None) -> torch.Tensor:
        return perturbed_argmax(self.draft_logits(g), scale, gumbel)

    def draft_vocab_ids(self) -> torch.Tensor | None:
        return None
