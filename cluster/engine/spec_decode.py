"""Speculative decoding: draft proposers and the verification rule (part of LLMEngine's step).

Each step, a decoding request may carry ``k`` draft tokens (``Request.spec_token_ids``, from a
proposer). The scheduler schedules them after the request's last token, the runner computes all
``1 + k`` positions in one pass and draws the target's token at each (``t_0 .. t_k``, with the
request's own sampling: greedy argmax, or its seeded or unseeded draw, penalties and min_tokens
applied as if the drafts before that position were already output), and the engine accepts
drafts while ``d_{j+1} == t_j``, then takes ``t_m`` at the first mismatch (or the bonus
``t_k``): ``m + 1`` tokens per step, each through the usual per-token path (stop checks,
``max_tokens``, logprobs), stopping at the first that ends the request.

Why the output is exact: position ``j``'s target token is drawn exactly as a non-speculative
step would draw it given the same prefix (the same logits, the same seeded noise: the seed
depends on the output position, never on speculation), and the tokens kept are those draws up
to the first where the prefix differs from the draft. So greedy and seeded outputs equal the
non-speculative ones token for token. For an unseeded request the kept token at each position
is a draw from the target distribution; with a one-hot draft (a proposer without a
distribution) this is rejection sampling (Leviathan et al.): the draft is accepted with
probability ``p(d)``, and a rejection yields a draw from ``p`` without ``d``, renormalised.

KV: the verify step writes KV for all ``1 + k`` positions; the request's ``num_computed_tokens``
then advances past the accepted tokens only, and the blocks past what those need are freed
(``KVCacheManager.truncate``), so no block table and no prefix-cache entry holds a rejected token.
"""
from __future__ import annotations

import logging
from typing import Protocol

import numpy as np

from cluster.config import ModelConfig
from cluster.engine.request import Request

logger = logging.getLogger(__name__)


class Proposer(Protocol):
    """Proposes up to ``k`` draft tokens to follow a request's tokens."""

    name: str

    def propose(self, request: Request, k: int) -> list[int]: ...

    def forget(self, request_id: str) -> None: ...


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the context's last ``n`` tokens (``n``
    from ``max_n`` down to ``min_n``) and propose the ``k`` tokens that followed it. The context
    is kept per request in a growing array, so a step costs one vectorised scan of it."""

    name = "ngram"

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._context: dict[str, tuple[np.ndarray, int]] = {}

    def propose(self, request: Request, k: int) -> list[int]:
        tokens = self._tokens(request)
        return ngram_lookup(tokens, k, self.min_n, self.max_n)

    def forget(self, request_id: str) -> None:
        self._context.pop(request_id, None)

    def _tokens(self, request: Request) -> np.ndarray:
        ids = request.all_token_ids
        buf, n = self._context.get(request.request_id, (None, 0))
        if buf is None or n > len(ids) or (n and buf[n - 1] != ids[n - 1]):  # new, or recomputed
            buf, n = np.empty(max(64, 2 * len(ids)), dtype=np.int64), 0
        if len(ids) > len(buf):
            grown = np.empty(2 * len(ids), dtype=np.int64)
            grown[:n] = buf[:n]
            buf = grown
        if len(ids) > n:
            buf[n:len(ids)] = ids[n:]
            n = len(ids)
        self._context[request.request_id] = (buf, n)
        return buf[:n]


def ngram_lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """The ``k`` tokens after the latest earlier match of ``tokens``' last n-gram (longest n first)."""
    length = len(tokens)
    if k <= 0 or length < 2:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)  # starts 0 .. length-1-n
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class DraftHeadProposer:
    """A draft layer (the draft head, or DeepSeek-V4's MTP layer) drafts on the device once the
    step's slots are allocated (cluster.engine.draft_runner): before scheduling, a request that
    will draft gets ``k`` placeholder drafts (the scheduler sizes its step by them), replaced by
    the layer's tokens after scheduling, before the step's inputs are built."""

    device_side = True

    def __init__(self, name: str = "draft_head") -> None:
        self.name = name

    def propose(self, request: Request, k: int) -> list[int]:
        return [0] * k

    def forget(self, request_id: str) -> None:
        pass


def make_proposer(config: ModelConfig) -> Proposer | None:
    if config.speculative_method == "none":
        return None
    if config.speculative_method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.speculative_method in ("draft_head", "mtp", "dspark"):
        return DraftHeadProposer(config.speculative_method)
    raise AssertionError(f"speculative_method={config.speculative_method!r} passed validation")


def accepted_length(drafts: list[int], targets: list[int]) -> int:
    """How many drafts the target's tokens accept: the length of the run ``drafts[j] == targets[j]``."""
    m = 0
    while m < len(drafts) and drafts[m] == targets[m]:
        m += 1
    return m


class SpecDecodeStats:
    """Totals since start-up: verify steps ("drafts"), draft tokens proposed, accepted, and
    accepted per draft position (vLLM's spec_decode_num_* counters)."""

    def __init__(self, k: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k

    def record(self, num_draft_tokens: int, num_accepted: int, request: Request | None = None) -> None:
        """One verify step of ``num_draft_tokens`` drafts of which the first ``num_accepted`` were
        right; counted for ``request`` too (its ``spec_stats``: its RequestOutput.metrics)."""
        self._count(num_draft_tokens, num_accepted)
        if request is not None:
            if request.spec_stats is None:
                request.spec_stats = SpecDecodeStats(len(self.accepted_per_pos))
            request.spec_stats._count(num_draft_tokens, num_accepted)

    def _count(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify step (accepted drafts plus the target's own token)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @staticmethod
    def request_metrics(samples: list[Request]) -> dict[str, float]:
        """A request's speculation, summed over its samples, as RequestOutput.metrics keys (empty
        where none of them was verified): verify steps, draft tokens, accepted ones (in all and
        per draft position that accepted any) and the mean accepted length (tokens per verify step)."""
        stats = [s.spec_stats for s in samples if s.spec_stats is not None and s.spec_stats.num_drafts]
        if not stats:
            return {}
        steps = sum(s.num_drafts for s in stats)
        accepted = sum(s.num_accepted_tokens for s in stats)
        out = {"spec_num_drafts": float(steps), "spec_num_draft_tokens": float(sum(s.num_draft_tokens for s in stats)),
               "spec_num_accepted_tokens": float(accepted), "spec_mean_accepted_length": 1.0 + accepted / steps}
        for j in range(max(len(s.accepted_per_pos) for s in stats)):
            n = sum(s.accepted_per_pos[j] for s in stats if j < len(s.accepted_per_pos))
            if n:
                out[f"spec_num_accepted_tokens_pos{j}"] = float(n)
        return out

    def counters(self) -> dict[str, float]:
        out = {"spec_decode_num_drafts_total": float(self.num_drafts),
               "spec_decode_num_draft_tokens_total": float(self.num_draft_tokens),
               "spec_decode_num_accepted_tokens_total": float(self.num_accepted_tokens)}
        for j, n in enumerate(self.accepted_per_pos):
            out[f"spec_decode_num_accepted_tokens_pos{j}_total"] = float(n)
        return out
