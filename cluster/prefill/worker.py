"""PrefillWorker: the prefill role without Ray. It prefills prompts (chunked and batched by the
shared scheduler), writes each step's KV blocks into the decode worker's reserved blocks as soon
as the step is done, and returns the first token once the last write has landed.

The writes run off the engine thread (``cluster.prefill.sender``): after each step the engine
thread pins the blocks the step wrote and queues their write; a sender thread per decode worker
moves them, so a slow peer delays only its own requests and never the prefill of the others.

A request's states here (``cluster.common.lifecycle.PrefillState``, legal moves only, a gauge per
state): QUEUED (waiting in the scheduler) -> PREFILLING (chunks computed, each chunk's write
queued) -> SENDING (prompt computed, first token known, writes in flight) -> SENT (last write
landed) -> RELEASED (blocks freed). A failed write ends the request with KVTransferError;
cancellation (the decode side gave up) or the request's deadline aborts it; every path frees its
blocks, and a write in flight keeps the blocks it reads until it is done."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time

from cluster.common.errors import ClusterError, ErrorKind, KVTransferError, RequestTimeoutError
from cluster.common.lifecycle import PREFILL_TRANSITIONS, Lifecycles, PrefillState
from cluster.common.messages import PrefillRequest, PrefillResult, ReplicaStats
from cluster.common.reporting import replica_stats
from cluster.config import ClusterConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.port import EnginePort, StepReport
from cluster.kv_transfer import KVStorage, KVTransferBackend
from cluster.kv_transfer.plan import plan_block_copies
from cluster.prefill.sender import KVSender, PrefillJob, SendTask

logger = logging.getLogger(__name__)


class PrefillWorker:
    def __init__(self, config: ClusterConfig, engine_id: str, node_id: str = "") -> None:
        self.config = config
        self.engine_id = engine_id
        storage = KVStorage(config.transfer.backend, engine_id, node_id)
        scheduler = dataclasses.replace(config.scheduler, role="prefill")
        engine = LLMEngine(config.model, config.cache, scheduler, kv_allocator=storage.allocate)
        self.backend: KVTransferBackend = storage.build(engine.runner.kv_caches, engine.kv_specs)
        self._jobs: dict[str, PrefillJob] = {}
        #: Prompts prefilled and handed over (one per request, whatever its ``n``).
        self.prefills_completed = 0
        self._jobs_lock = threading.Lock()
        #: Every request's state here (cluster.common.lifecycle), a gauge per state in /metrics.
        self.lifecycle: Lifecycles[PrefillState] = Lifecycles(PREFILL_TRANSITIONS, PrefillState.RELEASED)
        self.engine = EnginePort(engine, post_step=self._write_step)
        self.sender = KVSender(self.backend, self.engine.unpin, self._write_failed, self._write_landed)
        self.transfer_timeout_s = config.transfer.timeout_s

    # --- the request --------------------------------------------------------------------------

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        """Prefill once whatever ``n`` is: sample 0 computes the prompt (its KV goes to the decode
        worker) and the step that samples its first token draws the other samples' too."""
        sample = req.request
        group = await self.engine.make_group(req.transfer_key, sample.prompt_token_ids, sample.sampling_params,
                                             sample_index=sample.sample_index)
        request = group.samples[0]
        rid = request.request_id  # the transfer key, "#0" appended when n > 1
        request.hold_blocks_on_finish = True
        job = PrefillJob(req, rid, queued_upto=req.skip_tokens)
        self.lifecycle.start(rid, PrefillState.QUEUED, request.deadline)
        with self._jobs_lock:
            self._jobs[rid] = job
        try:
            final = None
            async for out in self.engine.generate(group):
                final = out if final is None else final.add(out)
            if job.error is not None:
                self._failed(rid)
                raise job.error
            assert final is not None and final.finished
            completion = final.outputs[0]
            if completion.finish_reason in ("error", "abort") or not completion.token_ids:
                self._failed(rid)
                if final.error_kind is ErrorKind.DEADLINE:
                    raise RequestTimeoutError("the request's deadline passed during prefill")
                raise ClusterError(f"prefill failed: {final.error or completion.finish_reason}")
            await self._landed(rid, job, request.deadline)
            timings = {
                "prefill_queue": (request.first_scheduled_time or request.arrival_time) - request.arrival_time,
                "prefill_compute": (request.first_token_time or time.monotonic())
                - (request.first_scheduled_time or request.arrival_time),
                "transfer": job.transfer_s,
            }
            others = []
            for other in final.outputs[1:]:
                if not other.token_ids:
                    raise ClusterError(f"prefill drew no first token for sample {other.index}: "
                                       f"{final.error or other.finish_reason}")
                others.append((other.token_ids[0], other.logprobs[0] if other.logprobs else None))
            first_logprobs = completion.logprobs[0] if completion.logprobs else None
            self.prefills_completed += 1
            return PrefillResult(completion.token_ids[0], first_logprobs, final.num_cached_tokens,
                                 job.bytes_sent, timings, sender_node=self.backend.node_id, others=others,
                                 draft_hidden=request.draft_hidden)
        finally:
            job.cancelled = True  # the engine thread stops writing for it from now on
            with self._jobs_lock:
                self._jobs.pop(rid, None)
            self.lifecycle.end(rid)
            self.engine.release(rid)

    async def _landed(self, rid: str, job: PrefillJob, deadline: float | None) -> None:
        """Wait for the request's last write (queued by the step that computed the prompt's end)."""
        wait_s = self.transfer_timeout_s
        if deadline is not None:
            wait_s = min(wait_s, max(0.0, deadline - time.monotonic()))
        try:
            await asyncio.wait_for(asyncio.wrap_future(job.landed), wait_s)
        except asyncio.TimeoutError:
            self._failed(rid)
            if deadline is not None and time.monotonic() >= deadline:
                raise RequestTimeoutError("the request's deadline passed while its KV was being written") from None
            raise KVTransferError(f"the KV writes of {rid} did not land within {wait_s:.1f}s") from None
        except KVTransferError:
            self._failed(rid)
            raise

    def _failed(self, rid: str) -> None:
        for expected in (PrefillState.QUEUED, PrefillState.PREFILLING, PrefillState.SENDING):
            self.lifecycle.advance(rid, expected, PrefillState.FAILED)

    # --- runs in the engine thread after every step -----------------------------------------------

    def _write_step(self, report: StepReport) -> None:
        """Queue the step's writes: per request, the blocks its tokens ``[queued_upto, end)``
        wrote, pinned until the sender has written them."""
        for work in report.work:
            rid, end = work.request_id, work.end
            with self._jobs_lock:
                job = self._jobs.get(rid)
            if job is None or job.cancelled or job.error is not None:
                continue
            num_prompt = report.num_prompt_tokens(rid)
            if num_prompt is None or end <= job.queued_upto:
                continue
            pinned = report.pin(rid)
            if pinned is None:
                continue
            last = end >= num_prompt
            self.lifecycle.advance(rid, PrefillState.QUEUED, PrefillState.PREFILLING)
            try:
                copies = plan_block_copies(report.kv_specs, pinned, job.prefill.dest_block_tables,
                                           job.queued_upto, end)
            except Exception as exc:  # noqa: BLE001 - a malformed request fails alone, not the engine loop
                self.engine.unpin(pinned)
                error = KVTransferError(f"KV write for {job.prefill.transfer_key} failed: {exc!r}")
                logger.warning("%s", error)
                job.fail(error)
                report.abort(job.prefill.transfer_key, str(error), ErrorKind.KV_TRANSFER)
                continue
            job.queued_upto = end
            if last:
                self.lifecycle.advance(rid, PrefillState.PREFILLING, PrefillState.SENDING)
            self.sender.submit(SendTask(job, copies, last, pinned, report.ready))

    # --- runs in a sender thread --------------------------------------------------------------------

    def _write_failed(self, job: PrefillJob, error: KVTransferError) -> None:
        self.engine.abort(job.prefill.transfer_key)  # stop computing it; prefill() raises ``error``

    def _write_landed(self, job: PrefillJob) -> None:
        self.lifecycle.advance(job.request_id, PrefillState.SENDING, PrefillState.SENT)

    # --- introspection ------------------------------------------------------------------------------

    async def stats(self, replica_id: str) -> ReplicaStats:
        stats = await self.engine.stats()
        return replica_stats("prefill", replica_id, stats.gauges, self.backend.stats,
                             {"prefill_requests_total": float(self.prefills_completed), **stats.counters,
                              **self.lifecycle.gauges("prefill_requests"),
                              "kv_writes_in_flight": float(self.sender.queued())})

    def shutdown(self) -> None:
        self.engine.shutdown()
        self.sender.close()
        self.backend.close()
