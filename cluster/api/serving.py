"""OpenAIServing: turns a validated completions or chat request into sample requests for the
EngineClient and their merged outputs into an OpenAI response.

A request becomes prompts (tokenized, length-checked), each prompt one GenerateRequest with its
``n`` samples (one routed call and one prefill per prompt; the same ``seed``: the engine varies
the draw per sample), run concurrently by SampleStreams. Choice ``i`` of the response is sample
``i % n`` of prompt ``i // n``. Non-streaming responses aggregate; streaming ones wait for the
first output before answering 200, so admission failures and a deadline that passes before any
token keep their status codes (429/503/504...); a failure after that is an SSE error event
followed by ``data: [DONE]``.
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from cluster.api import errors as api_errors
from cluster.api.client import EngineClient
from cluster.api.logprobs import TokenTexts
from cluster.api.metrics import ServerMetrics
from cluster.api.responses import ChatFormat, ChoiceState, CompletionFormat, usage_of
from cluster.api.sample_streams import SampleStreams
from cluster.api.schemas import MAX_SAMPLES_PER_REQUEST, ChatCompletionRequest, CompletionRequest
from cluster.common.block_hash import hash_token_blocks
from cluster.common.errors import ClusterError, InvalidRequestError, ModelNotFoundError
from cluster.common.messages import GenerateRequest, StepOutput
from cluster.common.sampling_params import SamplingParams

#: Threads that tokenise and apply chat templates (per front-end process).
TOKENIZE_THREADS = 2

logger = logging.getLogger(__name__)

ResponseFormat = CompletionFormat | ChatFormat


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None = None


class _SSEResponse(StreamingResponse):
    """A stream that closes its sample streams however it ends, even if it never starts (a client
    gone before the headers were sent)."""

    def __init__(self, body: AsyncIterator[str], streams: SampleStreams) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._streams = streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._streams.aclose()


def _sse(payload: str) -> str:
    return f"data: {payload}\n\n"


class OpenAIServing:
    def __init__(self, client: EngineClient, metrics: ServerMetrics, *, model_name: str,
                 block_size: int = 16, request_timeout_s: float | None = None,
                 aliases: tuple[str, ...] = ()) -> None:
        self.client = client
        self.metrics = metrics
        self.model_name = model_name
        self.accepted_names = {model_name, *aliases}
        self.block_size = block_size
        self.request_timeout_s = request_timeout_s
        self.texts = TokenTexts(client.tokenizer)
        self.texts_as_ids = TokenTexts(client.tokenizer, as_ids=True)
        # Tokenising and templating run here, off the event loop, a few at a time: a large
        # prompt must not freeze every other request and /health.
        self._tokenize_pool = ThreadPoolExecutor(max_workers=TOKENIZE_THREADS, thread_name_prefix="tokenize")
        self._max_token_bytes: int | None = None

    def check_model(self, model: str) -> None:
        if model not in self.accepted_names:
            raise ModelNotFoundError(f"The model `{model}` does not exist; this server serves "
                                     f"`{self.model_name}`.", param="model", code="model_not_found")

    # --- endpoints ------------------------------------------------------------------------------

    async def completions(self, request: CompletionRequest, request_id: str) -> Response:
        received = time.monotonic()
        self.check_model(request.model)
        params = request.to_sampling_params(self.request_timeout_s)
        prompts = await self._completion_prompts(request)
        texts = self.texts_as_ids if request.return_tokens_as_token_ids else self.texts
        fmt = CompletionFormat(request_id, int(time.time()), self.model_name, texts, request.logprobs)
        return await self._serve(request_id, prompts, params, "prompt", fmt, request.stream,
                                 request.include_usage, received if request.return_timings else None)

    async def chat(self, request: ChatCompletionRequest, request_id: str) -> Response:
        received = time.monotonic()
        self.check_model(request.model)
        params = request.to_sampling_params(self.request_timeout_s)
        messages = [m.to_template_dict() for m in request.messages]
        tokenizer = self.client.tokenizer
        # The template writes the special tokens itself (BOS included), as transformers assumes.
        text = await self._off_loop(tokenizer.apply_chat_template, messages,
                                    add_generation_prompt=request.add_generation_prompt)
        prompt = Prompt(await self._encode(text, "messages", add_special_tokens=False), text)
        num_top = (request.top_logprobs or 0) if request.logprobs else None
        texts = self.texts_as_ids if request.return_tokens_as_token_ids else self.texts
        fmt = ChatFormat(request_id, int(time.time()), self.model_name, texts, num_top)
        return await self._serve(request_id, [prompt], params, "messages", fmt, request.stream,
                                 request.include_usage, received if request.return_timings else None)

    # --- preparing samples --------------------------------------------------------------------------

    async def _off_loop(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool,
                                                                functools.partial(fn, *args, **kwargs))

    async def _encode(self, text: str, param: str, **kwargs: Any) -> list[int]:
        """Token ids of ``text``, in the tokenising threads. A text too long for the context by its
        length alone (more bytes than ``max_model_len`` of the longest token could hold) is
        refused before it is tokenised."""
        limit = self.client.max_model_len
        if len(text) > limit:  # cheap first: a char is at least one byte
            if self._max_token_bytes is None:
                self._max_token_bytes = await self._off_loop(_max_token_bytes, self.client.tokenizer)
            size = len(text.encode("utf-8", "surrogatepass"))
            if size > limit * self._max_token_bytes:
                raise InvalidRequestError(
                    f"This model's maximum context length is {limit} tokens. However, your prompt has "
                    f"{size} bytes, at least {size // self._max_token_bytes} tokens. Please reduce the "
                    "length of the prompt.", param=param, code="context_length_exceeded")
        return list(await self._off_loop(self.client.tokenizer.encode, text, **kwargs))

    async def _completion_prompts(self, request: CompletionRequest) -> list[Prompt]:
        prompts: list[Prompt] = []
        # The model's vocabulary is authoritative (it may be padded beyond the tokenizer's).
        vocab = int(getattr(self.client, "vocab_size", 0) or self.client.tokenizer.vocab_size)
        for p in request.prompts():
            if isinstance(p, str):
                prompts.append(Prompt(await self._encode(p, "prompt"), p))
                continue
            bad = next((t for t in p if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequestError(f"token id {bad} is out of vocabulary (size {vocab})", param="prompt")
            prompts.append(Prompt(list(p)))
        return prompts

    def _sample_params(self, prompt: Prompt, params: SamplingParams, param: str) -> SamplingParams:
        """Per-prompt params: max_tokens resolved against the context length."""
        limit, length = self.client.max_model_len, len(prompt.token_ids)
        if length == 0:
            raise InvalidRequestError("the prompt is empty", param=param)
        if length >= limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{length} tokens. Please reduce the length of the prompt.", param=param,
                code="context_length_exceeded")
        room = limit - length
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{length + params.max_tokens} tokens ({length} in the prompt, {params.max_tokens} for "
                f"the completion). Please reduce the length of the prompt or max_tokens.",
                param="max_tokens", code="context_length_exceeded")
        return params.replace(max_tokens=room if params.max_tokens is None else params.max_tokens)

    def _fan_out(self, request_id: str, prompts: list[Prompt], params: SamplingParams,
                 param: str) -> tuple[list[GenerateRequest], list[ChoiceState]]:
        if len(prompts) * params.n > MAX_SAMPLES_PER_REQUEST:
            raise InvalidRequestError(f"prompts x n must be <= {MAX_SAMPLES_PER_REQUEST}, got "
                                      f"{len(prompts)} x {params.n}", param=param)
        arrival = time.time()
        requests, choices = [], []
        for p_index, prompt in enumerate(prompts):
            sample_params = self._sample_params(prompt, params, param)
            requests.append(GenerateRequest(
                request_id=f"{request_id}-{p_index}", prompt_token_ids=prompt.token_ids,
                sampling_params=sample_params, prompt=prompt.text, arrival_time=arrival,
                block_hashes=hash_token_blocks(prompt.token_ids, self.block_size)))
            choices.extend(ChoiceState(index=p_index * params.n + sample, prompt_index=p_index)
                           for sample in range(params.n))
        return requests, choices

    # --- running them -------------------------------------------------------------------------------

    async def _serve(self, request_id: str, prompts: list[Prompt], params: SamplingParams, param: str,
                     fmt: ResponseFormat, stream: bool, include_usage: bool, timed_from: float | None) -> Response:
        """``timed_from``: when the request was received, if it asked for its choices' timings."""
        requests, choices = self._fan_out(request_id, prompts, params, param)
        prompt_lens = [len(p.token_ids) for p in prompts]
        self.metrics.prompt_tokens.inc(sum(prompt_lens))
        streams = SampleStreams(self.client, requests, self.metrics, deadline_s=params.deadline_s)
        if not stream:
            async with streams:
                async for index, out in streams:
                    _apply(choices[index], out, keep_logprobs=params.logprobs is not None)
                    if out.finished and timed_from is not None:
                        choices[index].timings = streams.timings(index, timed_from)
            body = fmt.response(choices, usage_of(choices, prompt_lens))
            return Response(body.model_dump_json(), media_type="application/json")
        streams.start()
        try:
            first = await streams.next()
            api_errors.raise_for_output(first[1])
        except BaseException:
            await streams.aclose()
            raise
        events = self._events(streams, first, choices, fmt, prompt_lens, include_usage, timed_from)
        return _SSEResponse(events, streams)

    async def _events(self, streams: SampleStreams, first: tuple[int, StepOutput],
                      choices: list[ChoiceState], fmt: ResponseFormat, prompt_lens: list[int],
                      include_usage: bool, timed_from: float | None) -> AsyncIterator[str]:
        try:
            index, out = first
            while True:
                choice = choices[index]
                new_text = _apply(choice, out, keep_logprobs=False)
                if out.finished and timed_from is not None:
                    choice.timings = streams.timings(index, timed_from)
                if new_text or out.new_token_ids or out.finished:
                    chunk = fmt.chunk(choice, choice.take_delta(), out.new_token_ids, out.new_logprobs)
                    choice.started = True
                    yield _sse(chunk.model_dump_json())
                if streams.done:
                    break
                index, out = await streams.next()
            if include_usage:
                yield _sse(fmt.usage_chunk(usage_of(choices, prompt_lens)).model_dump_json())
        except ClusterError as exc:
            logger.info("request %s failed mid-stream: %s", fmt.request_id, exc.message)
            yield _sse(json.dumps(exc.to_openai()))
        except Exception:
            logger.exception("request %s failed mid-stream", fmt.request_id)
            yield _sse(json.dumps(api_errors.internal_error().to_openai()))
        finally:
            await streams.aclose()
        yield _sse("[DONE]")


def _apply(choice: ChoiceState, out: StepOutput, *, keep_logprobs: bool) -> bool:
    """Account for one output of ``choice``'s sample; raises the ClusterError an error output
    stands for. Returns whether the text grew."""
    api_errors.raise_for_output(out)
    grew = bool(out.new_text)
    if grew:
        choice.parts.append(out.new_text)
    choice.num_tokens += len(out.new_token_ids)
    choice.num_cached_tokens = max(choice.num_cached_tokens, out.num_cached_tokens)
    if keep_logprobs:
        choice.token_ids.extend(out.new_token_ids)
        choice.positions.extend(out.new_logprobs or [{} for _ in out.new_token_ids])
    if out.finished:
        choice.finish_reason, choice.stop_reason = out.finish_reason, out.stop_reason
    return grew


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _max_token_bytes(tokenizer: Any) -> int:
    """UTF-8 bytes of the vocabulary's longest token (special tokens included)."""
    longest = 1
    for token_id in range(tokenizer.vocab_size):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        longest = max(longest, len(text.encode("utf-8", "surrogatepass")))
    return longest
