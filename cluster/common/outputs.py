"""Outputs returned to users: RequestOutput holding one CompletionOutput per sample (n of them).

An engine emits deltas: each RequestOutput of a step holds, per sample that changed, only what is
new (token ids, text, logprobs) and the finish state, so the cost of a step does not grow with the
output. ``RequestOutput.add`` accumulates them into the whole output (the offline ``LLM`` returns
that)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from cluster.common.errors import ErrorKind

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
    #: Set when a sample ended in "error" or "abort": what went wrong, and its kind.
    error: str | None = None
    error_kind: ErrorKind | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    def add(self, delta: RequestOutput) -> RequestOutput:
        """Accumulate a later delta of the same request into this output (in place); returns it."""
        by_index = {c.index: c for c in self.outputs}
        for new in delta.outputs:
            have = by_index.get(new.index)
            if have is None:
                have = by_index[new.index] = CompletionOutput(new.index, "", [])
                self.outputs.append(have)
            have.text += new.text
            have.token_ids.extend(new.token_ids)
            if new.logprobs is not None:
                if have.logprobs is None:
                    have.logprobs = []
                have.logprobs.extend(new.logprobs)
            have.finish_reason, have.stop_reason = new.finish_reason, new.stop_reason
        self.outputs.sort(key=lambda c: c.index)
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        self.finished = delta.finished
        if delta.error is not None and self.error is None:
            self.error, self.error_kind = delta.error, delta.error_kind
        self.metrics.update(delta.metrics)
        return self
