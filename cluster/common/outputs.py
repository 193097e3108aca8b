"""Outputs returned to users: RequestOutput holding one CompletionOutput per sample (n of them)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass
class Logprob:
    """Log-probability of one token, with its rank in the distribution (1 = most likely)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: One generated position: token id -> its Logprob (the sampled token plus the top-N).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[PositionLogprobs] | None = None
    #: The stop string or stop token id that ended the sample, if one did.
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = False
    #: Set when finish_reason is "error": what went wrong.
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
