"""EnginePort: the one way the roles (prefill, decode), the local server and tools drive an engine.

Each operation is a method with typed arguments and results; every call runs in the engine
thread between steps (AsyncEngine), so the engine stays single-threaded, and nothing outside
``cluster/engine`` reaches into its scheduler or KV manager. A post-step hook receives a
``StepReport``: what the step computed, and the few reads and the abort a hook may need.

    intake      make_group (validate, tokenize; raises InvalidRequestError), add, generate, abort
    remote KV   reserve_remote, finish_remote, fail_remote (decode role); release, unpin (prefill role)
    reporting   stats (gauges and counters), backends, info (fixed at start-up)
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cluster.common.errors import ErrorKind
from cluster.common.kv_spec import KVGroupSpec
from cluster.common.outputs import PositionLogprobs, RequestOutput
from cluster.common.sampling_params import SamplingParams
from cluster.engine.async_engine import AsyncEngine
from cluster.engine.engine import LLMEngine
from cluster.engine.output_processor import RequestGroup
from cluster.models.tokenizer import Tokenizer


@dataclass(frozen=True)
class EngineInfo:
    """What callers may know of an engine; fixed once it has started."""

    vocab_size: int
    max_model_len: int
    block_size: int
    kv_specs: tuple[KVGroupSpec, ...]
    tokenizer: Tokenizer | None


@dataclass
class EngineStats:
    #: Gauges: LLMEngine.metrics() (running, waiting, KV usage, free blocks, hit rate, graphs).
    gauges: dict[str, float] = field(default_factory=dict)
    #: Totals since start-up, each key ending in ``_total``: LLMEngine.counters().
    counters: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ScheduledWork:
    """One request's share of a step: tokens ``start`` .. ``end`` computed."""

    request_id: str
    start: int
    end: int


class StepReport:
    """What the last step computed, handed to a post-step hook in the engine thread. The blocks
    ``pin`` names stay valid, in any thread, until ``EnginePort.unpin`` (read them once ``ready``
    has completed)."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self.work = [ScheduledWork(rid, start, start + n) for rid, start, n in engine.last_step]
        self.kv_specs = engine.kv_specs
        self._ready: torch.cuda.Event | None = None

    @property
    def ready(self) -> torch.cuda.Event | None:
        """An event on the engine's stream after this step (None on a CPU): the step's KV writes
        are complete once it has (``synchronize()`` it in the thread that reads them)."""
        if self._ready is None and self._engine.device.type == "cuda":
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(self._engine.device))
        return self._ready

    def pin(self, request_id: str) -> list[list[int]] | None:
        """The request's block tables, per KV group, with every block kept allocated (not reused,
        whatever happens to the request) until ``EnginePort.unpin`` of these tables; None once its
        blocks are gone."""
        kv = self._engine.kv
        return kv.pin(request_id) if request_id in kv.tables else None

    def num_prompt_tokens(self, request_id: str) -> int | None:
        request = self._engine.scheduler.requests.get(request_id)
        return None if request is None else request.num_prompt_tokens

    def abort(self, group_id: str, message: str, kind: ErrorKind) -> None:
        self._engine.abort_request(group_id, error=message, kind=kind)


class EnginePort:
    def __init__(self, engine: LLMEngine, post_step: Callable[[StepReport], None] | None = None) -> None:
        self.engine = engine  # for tests and introspection only: callers use the methods below
        hook = None if post_step is None else (lambda e: post_step(StepReport(e)))
        self._loop = AsyncEngine(engine, post_step=hook)
        self.info = EngineInfo(engine.vocab_size, engine.scheduler_config.max_model_len, engine.cache_config.block_size,
                               tuple(engine.kv_specs), engine.tokenizer)

    @property
    def dead(self) -> BaseException | None:
        """Why the engine loop stopped, if it did."""
        return self._loop.dead

    # --- intake ---------------------------------------------------------------------------------

    async def make_group(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                         arrival_time: float | None = None, sample_index: int = 0) -> RequestGroup:
        """Validate and tokenize a request without adding it (raises InvalidRequestError)."""
        return await self._loop.run(
            lambda e: e.make_group(request_id, prompt, params, arrival_time=arrival_time, sample_index=sample_index))

    async def add(self, group: RequestGroup) -> None:
        await self._loop.run(lambda e: e.add_group(group))

    def generate(self, group: RequestGroup) -> AsyncIterator[RequestOutput]:
        """Add a request and stream its deltas; leaving early aborts it."""
        return self._loop.generate(group)

    def open_stream(self, request_id: str) -> asyncio.Queue[Any]:
        """Receive a request's deltas (and an exception if the loop dies) on a queue, from now on."""
        return self._loop.open_stream(request_id)

    def close_stream(self, request_id: str) -> None:
        self._loop.close_stream(request_id)

    def abort(self, request_id: str) -> None:
        """End a request in any state (fire and forget; nothing happens if it has finished)."""
        self._loop.submit(lambda e: e.abort_request(request_id))

    # --- remote KV ---------------------------------------------------------------------------------

    async def reserve_remote(self, group: RequestGroup) -> list[list[int]] | None:
        """Decode role: reserve KV blocks for sample 0's prompt, which another worker computes;
        its block tables, or None when there is no room now (nothing reserved). One engine
        command, so no step can end the request between the reservation and the read."""
        first = group.samples[0].request_id

        def attempt(e: LLMEngine) -> list[list[int]] | None:
            return [list(t) for t in e.kv.block_tables(first)] if e.reserve_remote(group) else None
        return await self._loop.run(attempt)

    async def finish_remote(self, request_id: str, first_token: int, logprobs: PositionLogprobs | None,
                            others: Sequence[tuple[int, PositionLogprobs | None]] = (),
                            draft_hidden: bytes | None = None) -> bool:
        """Decode role: the prompt's KV has landed; sample 0 takes ``first_token`` and the other
        samples fork it with theirs (``draft_hidden``: the draft head's start). False if the
        request is gone."""
        return await self._loop.run(lambda e: e.finish_remote_prefill(request_id, first_token, logprobs, others,
                                                                      draft_hidden))

    async def fail_remote(self, request_id: str, reason: str, fallback: bool) -> None:
        """Decode role: the remote prefill failed: prefill here (``fallback``) or fail the request."""
        await self._loop.run(lambda e: e.fail_remote_prefill(request_id, reason, fallback))

    def release(self, request_id: str) -> None:
        """Prefill role: free a finished request's held blocks (its KV has been sent, or writes
        still in flight hold pins on the blocks they read)."""
        self._loop.submit(lambda e: e.scheduler.release(request_id))

    def unpin(self, tables: list[list[int]]) -> None:
        """Drop the references ``StepReport.pin`` took (fire and forget, from any thread)."""
        self._loop.submit(lambda e: e.kv.free_blocks(tables))

    # --- reporting ------------------------------------------------------------------------------------

    async def stats(self) -> EngineStats:
        return await self._loop.run(lambda e: EngineStats(e.metrics(), e.counters()))

    def backends(self) -> list[dict[str, str]]:
        """The kernel chosen for each component and the decode graphs' state (fixed at start-up)."""
        return self.engine.backends()

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn`` on the engine between steps: for tests and tools, never for the roles."""
        return await self._loop.run(fn)

    def shutdown(self) -> None:
        self._loop.shutdown()
