"""DecodeWorker: the decode role without Ray. For each request it reserves KV blocks for the
prompt, asks a prefill worker (through ``prefill_fn``) to compute into them, and once the KV has
landed it decodes the rest in its batch, streaming StepOutputs. A request's ``n`` samples make one
prefill call, which draws every sample's first token from the prompt's logits: samples 1..n-1 then
fork sample 0's KV here (full blocks shared, the last partial block copied), computing nothing.

A request's states here (``cluster.common.lifecycle.DecodeState``, one record per request, legal
moves only, a gauge per state): WAITING_FOR_BLOCKS (first come, first served, as a local request
waits in the scheduler's queue; bounded by ``max_waiting`` and the deadline) -> REMOTE_PREFILL
(blocks reserved, the prefill worker computes and writes) -> RECEIVING (its last write landing)
-> DECODING -> DONE.
RECEIVING ends within ``kv_transfer_timeout_s``: on a failure or timeout the sample is prefilled
here instead (LOCAL_PREFILL; or FAILED, if fallback is off). Short prompts, or all prompts when there is no
prefill worker, are prefilled here from the start (LOCAL_PREFILL). Abandoned reservations stay out of use
for a grace period, so a late write cannot land in reused blocks."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from cluster.common.errors import OverloadedError, RequestTimeoutError
from cluster.common.lifecycle import DECODE_TRANSITIONS, DecodeState, Lifecycles
from cluster.common.messages import (GenerateRequest, PrefillRequest, PrefillResult, ReplicaStats, StepDeltas,
                                     StepOutput)
from cluster.common.outputs import RequestOutput
from cluster.common.reporting import queue_time, replica_stats
from cluster.config import ClusterConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.output_processor import RequestGroup
from cluster.engine.port import EnginePort
from cluster.kv_transfer import KVStorage, KVTransferBackend

logger = logging.getLogger(__name__)

PrefillFn = Callable[[PrefillRequest], Awaitable[PrefillResult]]

#: How often a request waiting for KV blocks to reserve tries again.
RESERVE_POLL_S = 0.01


class DecodeWorker:
    def __init__(self, config: ClusterConfig, engine_id: str, prefill_fn: PrefillFn | None,
                 node_id: str = "", transfer_options: dict[str, Any] | None = None) -> None:
        self.config = config
        self.engine_id = engine_id
        self.prefill_fn = prefill_fn
        storage = KVStorage(config.transfer.backend, engine_id, node_id, **(transfer_options or {}))
        # a prompt prefilled here (local prefill) is chunked to keep the decoding requests'
        # steps within local_prefill_itl_share of the ITL target, unless the user set a target
        step_target = config.scheduler.prefill_step_target_s or (
            config.transfer.local_prefill_itl_share * config.target_itl_s)
        scheduler = dataclasses.replace(config.scheduler, role="decode", prefill_step_target_s=step_target)
        engine = LLMEngine(config.model, config.cache, scheduler, kv_allocator=storage.allocate)
        self.backend: KVTransferBackend = storage.build(engine.runner.kv_caches, engine.kv_specs)
        self.engine = EnginePort(engine)
        self.max_model_len = self.engine.info.max_model_len
        #: Remote prefills that failed (then prefilled here, or failed the request).
        self.remote_prefill_failures = 0
        #: Requests the ingress sent here to be prefilled on this replica (short prompts, no
        #: prefill role, or a saturated prefill pool: cluster.router.ingress.prefill_locally).
        self.local_prefills = 0
        #: Requests waiting for KV blocks to reserve, first come first served: the head tries
        #: again every RESERVE_POLL_S; the others wait for their event (set at their turn).
        self._reserve_queue: list[asyncio.Event] = []
        #: Every request's state here (cluster.common.lifecycle), a gauge per state in /metrics.
        self.lifecycle: Lifecycles[DecodeState] = Lifecycles(DECODE_TRANSITIONS, DecodeState.DONE)

    @property
    def reserve_waiting(self) -> int:
        """Requests waiting for KV blocks to reserve."""
        return len(self._reserve_queue)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[StepOutput]:
        rid = req.request_id
        group = await self.engine.make_group(rid, req.prompt_token_ids, req.sampling_params,
                                             arrival_time=_monotonic(req.arrival_time), sample_index=req.sample_index)
        first = group.samples[0].request_id
        deadline = group.samples[0].deadline
        local = req.local_prefill or self.prefill_fn is None
        self.local_prefills += int(local)
        self.lifecycle.start(rid, DecodeState.LOCAL_PREFILL if local else DecodeState.WAITING_FOR_BLOCKS, deadline)
        queue = self.engine.open_stream(rid)
        timings: dict[str, float] = {}
        prefill_task: asyncio.Task[None] | None = None
        try:
            if local:
                await self.engine.add(group)
            else:
                tables = await self._reserve(group)
                self.lifecycle.move(rid, DecodeState.REMOTE_PREFILL, self._transfer_deadline(deadline))
                prefill = PrefillRequest(req, self.backend.endpoint(), tables, f"{self.engine_id}/{first}")
                prefill_task = asyncio.create_task(self._remote_prefill(prefill, rid, first, deadline, timings))
            async for out in self._read(StepDeltas(rid, req.sample_index), group, queue, timings):
                if out.new_token_ids and self.lifecycle.state(rid) is DecodeState.LOCAL_PREFILL:
                    self.lifecycle.move(rid, DecodeState.DECODING, deadline)
                if out.error_kind is not None and self.lifecycle.state(rid) is not DecodeState.FAILED:
                    self.lifecycle.move(rid, DecodeState.FAILED)
                yield out
        except Exception:  # a failure (not the caller leaving: that ends the record below)
            if self.lifecycle.state(rid) not in (None, DecodeState.FAILED):
                self.lifecycle.move(rid, DecodeState.FAILED)
            raise
        finally:
            if prefill_task is not None and not prefill_task.done():
                prefill_task.cancel()
            self.lifecycle.end(rid)
            self.engine.close_stream(rid)
            self.engine.abort(rid)  # no-op once finished

    def _transfer_deadline(self, deadline: float | None) -> float:
        """Until when a remote prefill (or its transfer) may take: the transfer timeout, or the
        request's deadline if that comes first."""
        limit = time.monotonic() + self.config.transfer.timeout_s
        return limit if deadline is None else min(limit, deadline)

    async def _reserve(self, group: RequestGroup) -> list[list[int]]:
        """Reserve KV blocks for sample 0's prompt and return its block tables. With no room now
        (the blocks are in use, or held for an abandoned transfer's grace period) the request
        waits its turn, as a local one waits in the scheduler's queue: until blocks come back,
        its deadline passes (RequestTimeoutError, whether or not it is at the head of the queue)
        or the client goes. OverloadedError only when ``max_waiting`` requests already wait."""
        if len(self._reserve_queue) >= self.config.scheduler.max_waiting:
            raise OverloadedError(f"decode worker has no free KV blocks or sequence slots and "
                                  f"{len(self._reserve_queue)} requests wait for them")
        deadline = group.samples[0].deadline
        turn = asyncio.Event()  # set while this request is at the head of the queue
        if not self._reserve_queue:
            turn.set()
        self._reserve_queue.append(turn)
        try:
            while True:
                if turn.is_set():
                    tables = await self.engine.reserve_remote(group)
                    if tables is not None:
                        return tables
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise RequestTimeoutError("deadline exceeded waiting for KV blocks on the decode worker")
                if turn.is_set():
                    await asyncio.sleep(RESERVE_POLL_S if remaining is None else min(RESERVE_POLL_S, remaining))
                else:
                    try:
                        await asyncio.wait_for(turn.wait(), remaining)
                    except asyncio.TimeoutError:
                        pass
        finally:
            head = self._reserve_queue[0] is turn
            self._reserve_queue.remove(turn)
            if head and self._reserve_queue:
                self._reserve_queue[0].set()

    async def _remote_prefill(self, prefill: PrefillRequest, group_id: str, rid: str, deadline: float | None,
                              timings: dict[str, float]) -> None:
        """Sample ``rid``'s prompt computed by a prefill worker into the reserved blocks."""
        timeout = self.config.transfer.timeout_s
        start = time.monotonic()
        try:
            assert self.prefill_fn is not None
            result = await asyncio.wait_for(self.prefill_fn(prefill), timeout)
            returned = time.monotonic()
            self.lifecycle.advance(group_id, DecodeState.REMOTE_PREFILL, DecodeState.RECEIVING,
                                   self._transfer_deadline(deadline))
            await asyncio.to_thread(self.backend.wait_received, prefill.transfer_key, timeout, result.sender_node)
            timings.update(result.timings)
            timings["transfer_wait"] = time.monotonic() - returned
            timings["kv_ready"] = time.monotonic() - start
            if await self.engine.finish_remote(rid, result.first_token, result.logprobs, result.others,
                                               draft_hidden=result.draft_hidden):
                self.lifecycle.advance(group_id, DecodeState.RECEIVING, DecodeState.DECODING, deadline)
            timings["num_cached_tokens"] = float(result.num_cached_tokens)
        except asyncio.CancelledError:
            self.backend.forget(prefill.transfer_key)
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of the remote path ends the same way
            self.remote_prefill_failures += 1
            self.backend.forget(prefill.transfer_key)
            fallback = self.config.transfer.fallback_to_local_prefill
            logger.warning("remote prefill of %s failed (%s); %s", rid, exc,
                           "prefilling locally" if fallback else "failing the request")
            for expected in (DecodeState.REMOTE_PREFILL, DecodeState.RECEIVING):
                self.lifecycle.advance(group_id, expected, DecodeState.LOCAL_PREFILL if fallback else DecodeState.FAILED,
                                       deadline)
            await self.engine.fail_remote(rid, f"remote prefill failed: {exc}", fallback)

    async def _read(self, deltas: StepDeltas, group: RequestGroup, queue: asyncio.Queue[Any],
                    timings: dict[str, float]) -> AsyncIterator[StepOutput]:
        """Every sample's StepOutputs until all have finished; a sample's first carries the
        timings (sample 0's: the prefill's and its queue time; the others': their TTFT)."""
        start = time.monotonic()
        started: set[int] = set()
        while deltas.finished_samples < len(group.samples):
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            out: RequestOutput = item
            for step in deltas.take(out):
                if step.sample_index not in started:
                    started.add(step.sample_index)
                    if step.sample_index != deltas.first_sample:
                        step.timings = {"ttft": time.monotonic() - start}
                    else:
                        step.timings = self._first_timings(timings, time.monotonic() - start)
                        queued = timings["prefill_queue"] if "prefill_queue" in timings else queue_time(group)
                        if queued is not None:
                            step.timings["queue"] = queued
                        if "num_cached_tokens" in timings:
                            step.num_cached_tokens = int(timings["num_cached_tokens"])
                yield step

    @staticmethod
    def _first_timings(timings: dict[str, float], ttft: float) -> dict[str, float]:
        result = {k: timings[k] for k in ("prefill_queue", "prefill_compute", "transfer") if k in timings}
        if "kv_ready" in timings:
            result["transfer"] = result.get("transfer", 0.0) + timings.get("transfer_wait", 0.0)
            result["first_decode"] = max(0.0, ttft - timings["kv_ready"])
        result["ttft"] = ttft
        return result

    async def stats(self, replica_id: str) -> ReplicaStats:
        stats = await self.engine.stats()
        stats.gauges["num_requests_waiting"] += self.reserve_waiting  # those waiting for blocks to reserve
        return replica_stats("decode", replica_id, stats.gauges, self.backend.stats,
                             {"remote_prefill_failures_total": float(self.remote_prefill_failures),
                              "local_prefills_total": float(self.local_prefills), **stats.counters,
                              **self.lifecycle.gauges("decode_requests")})

    def shutdown(self) -> None:
        self.engine.shutdown()
        self.backend.close()


def _monotonic(wall_time: float) -> float:
    """A wall-clock arrival time (from another process) on this process's monotonic clock."""
    return time.monotonic() - max(0.0, time.time() - wall_time)
