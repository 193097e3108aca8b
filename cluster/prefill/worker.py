"""PrefillWorker: the prefill role without Ray. It prefills prompts (chunked and batched by the
shared scheduler), writes each step's KV blocks into the decode worker's reserved blocks as soon
as the step is done, and returns the first token.

A request's states here (``cluster.common.lifecycle.PrefillState``, legal moves only, a gauge per
state): QUEUED (waiting in the scheduler) -> PREFILLING (chunks computed, each followed by a
write) -> SENT (last write done, first token known) -> RELEASED (blocks freed).
A failed write ends the request with KVTransferError; cancellation (the decode side gave up) or
the request's deadline aborts it; every path frees its blocks."""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass

from cluster.common.errors import ClusterError, ErrorKind, KVTransferError, RequestTimeoutError
from cluster.common.lifecycle import PREFILL_TRANSITIONS, Lifecycles, PrefillState
from cluster.common.messages import PrefillRequest, PrefillResult, ReplicaStats
from cluster.common.reporting import replica_stats
from cluster.config import ClusterConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.port import EnginePort, StepReport
from cluster.kv_transfer import KVStorage, KVTransferBackend
from cluster.kv_transfer.plan import plan_block_copies

logger = logging.getLogger(__name__)


@dataclass
class PrefillJob:
    prefill: PrefillRequest
    #: Tokens whose blocks have been written to the decode worker.
    written_upto: int
    bytes_sent: int = 0
    transfer_s: float = 0.0
    cancelled: bool = False
    error: Exception | None = None


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
        job = PrefillJob(req, written_upto=req.skip_tokens)
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
                                 job.bytes_sent, timings, sender_node=self.backend.node_id, others=others)
        finally:
            job.cancelled = True  # the engine thread stops writing for it from now on
            with self._jobs_lock:
                self._jobs.pop(rid, None)
            self.lifecycle.end(rid)
            self.engine.release(rid)

    def _failed(self, rid: str) -> None:
        for expected in (PrefillState.QUEUED, PrefillState.PREFILLING):
            self.lifecycle.advance(rid, expected, PrefillState.FAILED)

    # --- runs in the engine thread after every step -----------------------------------------------

    def _write_step(self, report: StepReport) -> None:
        for work in report.work:
            rid, end = work.request_id, work.end
            with self._jobs_lock:
                job = self._jobs.get(rid)
            if job is None or job.cancelled or job.error is not None:
                continue
            tables, num_prompt = report.block_tables(rid), report.num_prompt_tokens(rid)
            if tables is None or num_prompt is None or end <= job.written_upto:
                continue
            last = end >= num_prompt
            self.lifecycle.advance(rid, PrefillState.QUEUED, PrefillState.PREFILLING)
            start = time.perf_counter()
            try:
                copies = plan_block_copies(report.kv_specs, tables,
                                           job.prefill.dest_block_tables, job.written_upto, end)
                job.bytes_sent += self.backend.send(job.prefill.dest, job.prefill.transfer_key, copies, last)
            except Exception as exc:  # noqa: BLE001 - one request's bad write fails it, not the engine loop
                error = exc if isinstance(exc, KVTransferError) else KVTransferError(
                    f"KV write for {rid} failed: {exc!r}")
                logger.warning("KV write for %s failed: %s", rid, error)
                job.error = error
                report.abort(job.prefill.transfer_key, str(error), ErrorKind.KV_TRANSFER)
                continue
            job.transfer_s += time.perf_counter() - start
            job.written_upto = end
            if last:
                self.lifecycle.advance(rid, PrefillState.PREFILLING, PrefillState.SENT)

    # --- introspection ------------------------------------------------------------------------------

    async def stats(self, replica_id: str) -> ReplicaStats:
        stats = await self.engine.stats()
        return replica_stats("prefill", replica_id, stats.gauges, self.backend.stats,
                             {"prefill_requests_total": float(self.prefills_completed), **stats.counters,
                              **self.lifecycle.gauges("prefill_requests")})

    def shutdown(self) -> None:
        self.engine.shutdown()
        self.backend.close()
