"""FakeEngineClient: an in-process EngineClient that answers each sample with scripted StepOutputs
(a fixed reply, rotated per sample_index, one token per step), records every sample as a
GenerateRequest of one sample (a request of ``n`` is split into ``n``: ids ``<id>#<i>``, as the
engine names them, streamed concurrently and merged), and records which sample iterators were
closed and which were cancelled. Tests set ``script`` to a
function of the request returning a Script to inject failures, delays, cache hits and timings."""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from cluster.common.errors import ErrorKind
from cluster.common.messages import GenerateRequest, ReplicaStats, StepOutput
from cluster.common.outputs import Logprob, PositionLogprobs
from cluster.models.tokenizer import Tokenizer

REPLY = " the quick brown fox jumps over the lazy dog, hello world"


@dataclass
class Script:
    #: Raised by the first ``__anext__`` (admission failure).
    admission_error: BaseException | None = None
    #: Seconds to wait before each output.
    delay: float = 0.0
    #: Before the output carrying token number ``after`` (1-based), end the sample: with
    #: finish_reason "abort" (kind DEADLINE), or "error" with ``error_kind``, or by raising.
    deadline_after: int | None = None
    error_after: int | None = None
    error_kind: ErrorKind | None = None
    raise_after: int | None = None
    #: Wait forever before this token (an engine that never answers).
    hang_after: int | None = None
    #: Finish with "stop" after this many tokens (as if EOS was sampled).
    eos_after: int | None = None
    tokens_per_step: int = 1
    num_cached_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)


class FakeEngineClient:
    def __init__(self, tokenizer: Tokenizer, *, model_name: str = "fake-model", max_model_len: int = 128) -> None:
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.reply_ids = tokenizer.encode(REPLY, add_special_tokens=False)
        self.script: Callable[[GenerateRequest], Script] = lambda request: Script()
        self.requests: list[GenerateRequest] = []
        self.closed: set[str] = set()
        self.cancelled: set[str] = set()
        self.health_error: BaseException | None = None
        self.stats: list[ReplicaStats] = [
            ReplicaStats(role="prefill", replica_id="p0", num_requests_running=1, num_requests_waiting=2,
                         kv_cache_usage_perc=0.25, prefix_cache_hit_rate=0.5, kv_transfer_bytes_total=4096,
                         kv_transfer_seconds_total=0.5, kv_transfer_count=4, kv_transfer_failures_total=1),
            ReplicaStats(role="decode", replica_id="d0", num_requests_running=3, kv_cache_usage_perc=0.75,
                         extra={"spec_accept_len": 2.5, "bad name": 1, "label": "x", "remote_prefill_failures_total": 3}),
        ]
        self.backend_list: list[dict[str, Any]] = [{"replica": "d0", "op": "attention", "impl": "torch"}]

    def reset(self) -> None:
        self.script = lambda request: Script()
        self.requests.clear()
        self.closed.clear()
        self.cancelled.clear()
        self.health_error = None

    def reply_for(self, request: GenerateRequest) -> list[int]:
        shift = request.sample_index % len(self.reply_ids)
        ids = self.reply_ids[shift:] + self.reply_ids[:shift]
        return (ids * (1 + (request.sampling_params.max_tokens or 0) // len(ids)))

    async def generate(self, request: GenerateRequest) -> AsyncIterator[StepOutput]:
        n = request.sampling_params.n
        samples = [request] if n == 1 else [
            dataclasses.replace(request, request_id=f"{request.request_id}#{i}", sample_index=request.sample_index + i,
                                sampling_params=request.sampling_params.replace(n=1)) for i in range(n)]
        queue: asyncio.Queue[StepOutput | BaseException | None] = asyncio.Queue()

        async def pump(sample: GenerateRequest) -> None:
            try:
                async for out in self._sample(sample):
                    out.sample_index = sample.sample_index
                    queue.put_nowait(out)
                queue.put_nowait(None)
            except Exception as exc:  # noqa: BLE001 - raised by the merged stream
                queue.put_nowait(exc)

        tasks = [asyncio.create_task(pump(s)) for s in samples]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _sample(self, request: GenerateRequest) -> AsyncIterator[StepOutput]:
        self.requests.append(request)
        script = self.script(request)
        try:
            if script.admission_error is not None:
                raise script.admission_error
            async for out in self._outputs(request, script):
                yield out
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled.add(request.request_id)
            raise
        finally:
            self.closed.add(request.request_id)

    async def _outputs(self, request: GenerateRequest, script: Script) -> AsyncIterator[StepOutput]:
        params = request.sampling_params
        reply, ids = self.reply_for(request), []
        max_tokens = params.max_tokens or len(reply)
        shown = 0  # characters of the text sent so far (each output carries only the new ones)
        while True:
            await asyncio.sleep(script.delay)
            n = len(ids) + 1
            if script.hang_after == n:
                await asyncio.Event().wait()
            if script.raise_after == n:
                raise RuntimeError("boom: secret internal detail")
            if script.deadline_after == n:
                yield StepOutput(request.request_id, [], self.tokenizer.decode(ids)[shown:], finish_reason="abort",
                                 error="deadline exceeded", error_kind=ErrorKind.DEADLINE)
                return
            if script.error_after == n:
                yield StepOutput(request.request_id, [], self.tokenizer.decode(ids)[shown:], finish_reason="error",
                                 error="KV transfer failed: peer gone", error_kind=script.error_kind)
                return
            new = reply[len(ids):len(ids) + min(script.tokens_per_step, max_tokens - len(ids))]
            ids += new
            out = StepOutput(request.request_id, new, self.tokenizer.decode(ids),
                             num_cached_tokens=script.num_cached_tokens,
                             new_logprobs=self._logprobs(new, params.logprobs),
                             timings=dict(script.timings) if n == 1 else {})
            out.finish_reason, out.stop_reason = self._finish(out, ids, max_tokens, script, params.stop)
            hold = max((len(s) for s in params.stop), default=1) - 1
            if not out.finished and hold:  # as the engine does: never show the start of a stop string
                out.new_text = out.new_text[:-hold]
            out.new_text, shown = out.new_text[shown:], max(shown, len(out.new_text))
            yield out
            if out.finished:
                return

    @staticmethod
    def _finish(out: StepOutput, ids: list[int], max_tokens: int, script: Script,
                stop: tuple[str, ...]) -> tuple[str | None, str | None]:
        for s in stop:  # out.new_text holds the whole text here
            at = out.new_text.find(s)
            if at >= 0:
                out.new_text = out.new_text[:at]
                return "stop", s
        if script.eos_after is not None and len(ids) >= script.eos_after:
            return "stop", None
        if len(ids) >= max_tokens:
            return "length", None
        return None, None

    def _logprobs(self, tokens: list[int], num: int | None) -> list[PositionLogprobs] | None:
        if num is None:
            return None
        out = []
        for t in tokens:
            entry: PositionLogprobs = {t: Logprob(-0.25, rank=1)}
            for rank in range(2, num + 1):
                entry[(t + rank) % self.tokenizer.vocab_size] = Logprob(-1.0 * rank, rank=rank)
            out.append(entry)
        return out

    async def health(self) -> None:
        if self.health_error is not None:
            raise self.health_error

    async def replica_stats(self) -> list[ReplicaStats]:
        return list(self.stats)

    async def backends(self) -> list[dict[str, Any]]:
        return list(self.backend_list)

