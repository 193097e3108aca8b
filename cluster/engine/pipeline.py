"""Pipelined decode (part of LLMEngine, see engine.py; ``async_scheduling`` with CUDA graphs).

While every running request decodes one token with device-side sampling (no penalties, no
logprobs) and nothing waits for admission, ``step()`` schedules and launches step N+1 (its input
tokens taken on the device from step N's samples) before it reads step N's tokens and runs their
stop checks, detokenization and outputs; the GPU never waits for the host. A request that stops at
step N has step N+1 computed for nothing (its blocks are freed; stream order keeps later writes
after it). Any other step first completes the one in flight, then runs synchronously. Tokens are
identical either way."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from cluster.engine.cuda_graphs import fetch
from cluster.engine.kv_cache_manager import KVCacheManager
from cluster.engine.model_runner import ModelRunner
from cluster.engine.output_processor import RequestGroup
from cluster.engine.request import RequestStatus
from cluster.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from cluster.engine.spec_pipeline import InFlightVerify

logger = logging.getLogger(__name__)


@dataclass
class InFlightStep:
    """A launched pipelined step whose sampled tokens are not yet read."""

    scheduled: list[ScheduledRequest]
    tokens: torch.Tensor  # [B] int64 on the device
    host: torch.Tensor  # [B] int64 pinned, filled by an asynchronous copy
    done: torch.cuda.Event | None  # None on CPU (nothing runs asynchronously)
    rows: dict[str, int]  # request id -> row in tokens


class Pipelining:
    # state shared with the other parts of LLMEngine (set in LLMEngine.__init__)
    scheduler: Scheduler
    kv: KVCacheManager
    runner: ModelRunner
    _sample_group: dict[str, RequestGroup]
    _in_flight: InFlightStep | None
    _verify_in_flight: InFlightVerify | None
    num_pipelined_steps: int

    def _pipeline_ready(self) -> bool:
        """The next step can be launched before the one in flight is read: every running request
        decodes exactly one token (counting the one in flight), samples on the device, fits the
        graphs, and the pool has a block for each (so nothing is preempted); nothing waits."""
        sch = self.scheduler
        graphs = self.runner.graphs
        if sch.waiting or not sch.running or (graphs is not None and len(sch.running) > graphs.max_batch):
            return False
        if min(self.kv.num_free_blocks()) < len(sch.running):
            return False
        for r in sch.running:
            if r.num_tokens + r.num_pending - r.num_computed_tokens != 1:
                return False
            if r.num_output_tokens + r.num_pending == 0:  # a first token: its held samples fork
                group = self._sample_group.get(r.request_id)
                if group is not None and group.held:
                    return False
            p = r.sampling_params
            if p.logprobs is not None or p.has_penalties:
                return False
        return True

    def _launch(self, sched: SchedulerOutput) -> None:
        """Launch a pipelined step, then read the previous one (the GPU runs this one meanwhile)."""
        previous = self._in_flight
        self._begin(sched)
        try:
            tokens = self.runner.launch(sched, previous.rows if previous else {},
                                        previous.tokens if previous else None)
            host, done = fetch(tokens)
        except Exception as exc:  # noqa: BLE001 - as in step(): fail the batch, keep the loop
            logger.exception("model step failed")
            self._complete_in_flight()
            self._fail([s.request for s in sched.scheduled if s.request.status is RequestStatus.RUNNING], exc)
            return
        self.num_pipelined_steps += 1
        for s in sched.scheduled:
            self.scheduler.mark_computed(s)
            s.request.num_pending += 1
        self._in_flight = InFlightStep(sched.scheduled, tokens, host, done,
                                       {s.request.request_id: i for i, s in enumerate(sched.scheduled)})
        if previous is not None:
            self._complete(previous)

    def _complete_in_flight(self) -> None:
        """Read the step in flight, a decode step or a verify step (spec_pipeline.py), if any."""
        if self._in_flight is not None:
            step, self._in_flight = self._in_flight, None
            self._complete(step)
        if self._verify_in_flight is not None:
            verify, self._verify_in_flight = self._verify_in_flight, None
            self._complete_verify(verify)

    def _complete(self, step: InFlightStep) -> None:
        """Read a pipelined step's tokens (waiting for it) and process them as a step would."""
        if step.done is not None:
            step.done.synchronize()
        for s, token in zip(step.scheduled, step.host.tolist()):
            request = s.request
            request.num_pending = max(0, request.num_pending - 1)
            if request.status is not RequestStatus.RUNNING:
                continue  # finished, aborted or preempted meanwhile: this token is dropped
            self._take_token(request, token, None)
        if self._in_flight is not None:  # the running step's blocks include the new full ones
            for s in self._in_flight.scheduled:
                request = s.request
                if request.status is RequestStatus.RUNNING:
                    self.kv.cache_full_blocks(request.request_id, request.block_hashes, request.num_computed_tokens)
