"""Sampling ops (pure-torch references): logit filters and sampling from a distribution with
caller-supplied noise, so that a request's draws depend only on its own seed."""
from __future__ import annotations

import torch


def apply_top_k_top_p_min_p_ref(logits: torch.Tensor, top_k: torch.Tensor | None,
                                top_p: torch.Tensor | None, min_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) the logits each row's filters drop. ``logits [N, V]`` float32;
    ``top_k [N]`` int (<= 0 or >= V: off), ``top_p [N]`` float (1: off), ``min_p [N]`` float (0: off)."""
    if top_k is None and top_p is None and min_p is None:
        return logits
    if min_p is not None:
        probs = logits.softmax(-1)
        threshold = probs.max(-1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        k = torch.where((top_k <= 0) | (top_k >= vocab), vocab, top_k).to(logits.device)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        drop |= ranks >= k[:, None]
    if top_p is not None:
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above each token
        p = top_p[:, None].to(logits.device)
        drop |= (before > p) & (p < 1.0)  # float32 sums can pass 1: top_p == 1 keeps everything
        drop[:, 0] = False  # always keep the most likely token
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def sample_with_noise_ref(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Draw one token per row of ``probs [N, V]`` given ``noise [N, V]`` ~ Exp(1): the argmax of
    ``probs / noise`` is distributed as ``probs`` (the exponential race)."""
    return (probs / noise).argmax(-1)
