"""OpenAI wire models (pydantic v2): the bodies of /v1/completions and /v1/chat/completions, their
responses and stream chunks, /v1/models, usage, logprobs and the error body.

Requests are validated strictly (``"temperature": "hot"`` or ``"n": 1.5`` is an error, not a
coercion) and unknown fields are ignored, as OpenAI clients send fields this server has no use
for (``user``, ``metadata``...). Fields it understands but does not implement (``echo``,
``logit_bias``, ``tools``...) are refused with a 400 rather than silently ignored. Each request
turns itself into ``SamplingParams``; a bad value raises InvalidRequestError naming the field.
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, field_validator, model_serializer

from cluster.common.errors import InvalidRequestError
from cluster.common.sampling_params import SamplingParams

#: Most samples one HTTP request may fan out to (prompts x n).
MAX_SAMPLES_PER_REQUEST = 256
#: SamplingParams field -> the request field a client wrote.
_PARAM_NAMES = {"deadline_s": "timeout"}


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool | None = False


class SamplingFields(_Request):
    """What both endpoints share: the model, streaming, and sampling and stopping settings."""

    model: str
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # Extensions (vLLM's names).
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    #: Name logprob tokens "token_id:<id>" instead of their text (vLLM's extension).
    return_tokens_as_token_ids: bool = False
    #: Seconds from arrival after which the request is aborted (504); our extension.
    timeout: float | None = None
    #: Each choice carries ``timings``: where its time went (``cluster.api.metrics.SampleTimer``);
    #: our extension, as llama.cpp's server reports ``timings`` and SGLang's ``meta_info``.
    return_timings: bool = False

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true",
                                      param="stream_options")
        if self.logit_bias:
            raise InvalidRequestError("logit_bias is not supported", param="logit_bias")
        if isinstance(self.n, int) and self.n > MAX_SAMPLES_PER_REQUEST:
            raise InvalidRequestError(f"n must be <= {MAX_SAMPLES_PER_REQUEST}, got {self.n}", param="n")

    def _sampling_params(self, *, max_tokens: int | None, logprobs: int | None,
                         default_timeout_s: float | None) -> SamplingParams:
        deadline = self.timeout
        if default_timeout_s is not None and (deadline is None or deadline > default_timeout_s):
            deadline = default_timeout_s
        fields: dict[str, Any] = dict(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            skip_special_tokens=self.skip_special_tokens, deadline_s=deadline)
        # None means "the default": leave it to SamplingParams.
        kwargs = {k: v for k, v in fields.items() if v is not None or k == "max_tokens"}
        try:
            return SamplingParams(**kwargs)
        except InvalidRequestError as exc:
            param = _PARAM_NAMES.get(exc.param or "", exc.param)
            message = exc.message.replace("deadline_s", "timeout") if param == "timeout" else exc.message
            raise InvalidRequestError(message, param=param) from exc


def _check_prompt(value: Any) -> Any:
    def is_ids(v: Any) -> bool:
        return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)

    ok = (isinstance(value, str)
          or (isinstance(value, list) and len(value) > 0
              and (all(isinstance(p, str) for p in value) or is_ids(value)
                   or all(is_ids(p) for p in value))))
    if not ok:
        raise ValueError("prompt must be a string, a non-empty list of strings, a list of token ids, "
                         "or a list of lists of token ids")
    return value


class CompletionRequest(SamplingFields):
    prompt: Any
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _valid_prompt(cls, value: Any) -> Any:
        return _check_prompt(value)

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts as a list: strings, or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(t, int) for t in p):
            return [p]
        return list(p)

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise InvalidRequestError("echo is not supported", param="echo")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of other than n is not supported", param="best_of")

    def to_sampling_params(self, default_timeout_s: float | None = None) -> SamplingParams:
        self.check_supported()
        return self._sampling_params(max_tokens=self.max_tokens, logprobs=self.logprobs,
                                     default_timeout_s=default_timeout_s)


class ContentPart(_Request):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Request):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def to_template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: text content as one string."""
        content = self.content
        if isinstance(content, list):
            for part in content:
                if part.type != "text" or part.text is None:
                    raise InvalidRequestError(f"content part of type {part.type!r} is not supported "
                                              "(text only)", param="messages")
            content = "\n".join(part.text or "" for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise InvalidRequestError("tools are not supported", param="tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise InvalidRequestError("response_format other than text is not supported",
                                      param="response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")

    def to_sampling_params(self, default_timeout_s: float | None = None) -> SamplingParams:
        self.check_supported()
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        try:
            return self._sampling_params(max_tokens=max_tokens, logprobs=logprobs,
                                         default_timeout_s=default_timeout_s)
        except InvalidRequestError as exc:
            renamed = {"logprobs": "top_logprobs"}
            if self.max_completion_tokens is not None:
                renamed["max_tokens"] = "max_completion_tokens"
            if exc.param in renamed:
                param = renamed[exc.param]
                raise InvalidRequestError(exc.message.replace(exc.param, param, 1), param=param) from exc
            raise


# --- responses ---------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class _TimedChoice(BaseModel):
    """A choice that carries ``timings`` (seconds, by part) when the request asked for them
    (``return_timings``); the field is left out of the body otherwise."""

    timings: dict[str, float] | None = None

    @model_serializer(mode="wrap")
    def _drop_unasked_timings(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        body: dict[str, Any] = handler(self)
        timings = body.pop("timings", None)
        if timings is not None:
            body["timings"] = timings  # last, after the fields every client reads
        return body


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_TimedChoice):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(_TimedChoice):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(_TimedChoice):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pd-cluster"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
