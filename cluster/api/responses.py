"""Assembling OpenAI responses from sample outputs: ChoiceState accumulates one choice (one sample)
and the two formats turn choice states into the completions or chat shape, whole or as stream
chunks. What the formats share (delta text, usage) lives in ChoiceState and ``usage_of``."""
from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel

from cluster.api.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from cluster.api.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    PromptTokensDetails,
    UsageInfo,
)
from cluster.common.outputs import PositionLogprobs


@dataclass
class ChoiceState:
    """One choice (one sample of one prompt) as its outputs arrive."""

    index: int
    prompt_index: int
    #: The text as it arrived, a piece per output (joined once, at the end or per stream chunk).
    parts: list[str] = field(default_factory=list)
    #: Pieces of ``parts`` already streamed.
    sent: int = 0
    num_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    positions: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    #: Whether a stream chunk has been sent for this choice (chat: the first carries the role).
    started: bool = False
    #: Where the choice's time went (``SampleTimer.timings``), once it finished, if the request
    #: asked (``return_timings``); its last stream chunk or its whole response carries them.
    timings: dict[str, float] | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def take_delta(self) -> str:
        """The text not streamed yet (the engine holds back what a stop string might remove, so
        the text only grows)."""
        delta = "".join(self.parts[self.sent:])
        self.sent = len(self.parts)
        return delta


def usage_of(choices: list[ChoiceState], prompt_lens: list[int]) -> UsageInfo:
    """Prompt tokens count once per prompt (not per sample), as OpenAI counts them."""
    cached = [0] * len(prompt_lens)
    for c in choices:
        cached[c.prompt_index] = max(cached[c.prompt_index], c.num_cached_tokens)
    prompt_tokens = sum(prompt_lens)
    completion_tokens = sum(c.num_tokens for c in choices)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(cached)))


class CompletionFormat:
    def __init__(self, request_id: str, created: int, model: str, texts: TokenTexts,
                 num_logprobs: int | None) -> None:
        self.request_id, self.created, self.model = request_id, created, model
        self._texts = texts
        self._num_logprobs = num_logprobs
        self._offsets: dict[int, int] = {}

    def _logprobs(self, choice: ChoiceState, token_ids: list[int],
                  positions: list[PositionLogprobs] | None) -> CompletionLogprobs | None:
        if self._num_logprobs is None:
            return None
        logprobs, self._offsets[choice.index] = completion_logprobs(
            self._texts, token_ids, positions, self._num_logprobs, self._offsets.get(choice.index, 0))
        return logprobs

    def chunk(self, choice: ChoiceState, delta: str, token_ids: list[int],
              positions: list[PositionLogprobs] | None) -> BaseModel:
        return CompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=[
            CompletionChoice(index=choice.index, text=delta,
                             logprobs=self._logprobs(choice, token_ids, positions),
                             finish_reason=choice.finish_reason, stop_reason=choice.stop_reason,
                             timings=choice.timings if choice.finish_reason else None)])

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        return CompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=[],
                               usage=usage)

    def response(self, choices: list[ChoiceState], usage: UsageInfo) -> BaseModel:
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model, usage=usage,
                                  choices=[CompletionChoice(
                                      index=c.index, text=c.text,
                                      logprobs=self._logprobs(c, c.token_ids, c.positions),
                                      finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                      timings=c.timings)
                                      for c in choices])


class ChatFormat:
    def __init__(self, request_id: str, created: int, model: str, texts: TokenTexts,
                 num_top_logprobs: int | None) -> None:
        self.request_id, self.created, self.model = request_id, created, model
        self._texts = texts
        self._num_top = num_top_logprobs

    def _logprobs(self, token_ids: list[int], positions: list[PositionLogprobs] | None) -> ChatLogprobs | None:
        if self._num_top is None:
            return None
        return ChatLogprobs(content=chat_logprobs(self._texts, token_ids, positions, self._num_top))

    def chunk(self, choice: ChoiceState, delta: str, token_ids: list[int],
              positions: list[PositionLogprobs] | None) -> BaseModel:
        message = DeltaMessage(role=None if choice.started else "assistant",
                               content=delta if delta or not choice.started else None)
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=[
            ChatStreamChoice(index=choice.index, delta=message, logprobs=self._logprobs(token_ids, positions),
                             finish_reason=choice.finish_reason, stop_reason=choice.stop_reason,
                             timings=choice.timings if choice.finish_reason else None)])

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=[],
                                   usage=usage)

    def response(self, choices: list[ChoiceState], usage: UsageInfo) -> BaseModel:
        return ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model, usage=usage,
                                      choices=[ChatChoice(
                                          index=c.index, message=AssistantMessage(content=c.text),
                                          logprobs=self._logprobs(c.token_ids, c.positions),
                                          finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                          timings=c.timings)
                                          for c in choices])
