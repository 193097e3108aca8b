"""Pipelined speculative decoding (part of LLMEngine, see engine.py; ``async_scheduling`` with the
draft head, its proposal and the verify steps in CUDA graphs).

Where a verify step's next one starts depends on how many drafts it accepted. A host that reads
that before it launches the next step leaves the GPU idle while it schedules, builds inputs and
processes tokens, which for a small model costs as much as the step. So the device decides: one
launch (``ModelRunner.launch_verify``, cluster/engine/verify_step.py; greedy batches as one CUDA
graph) runs the verify step, samples every verified position, counts the accepted drafts and runs
the head's next proposal from the verify rows' hidden states, leaving the next step's input tokens
and first positions on the device. ``step()`` launches step
N+1 from them, then reads step N's tokens (one asynchronous copy) and takes them through the
usual per-token path (stop checks, detokenization, ``max_tokens``).

The host knows each request's KV up to the step in flight's first position
(``num_computed_tokens``); it allocates blocks for the furthest the steps in flight can write
(``3k + 2`` tokens past that: a step accepting all ``k`` drafts, then the next step's verify rows
and its head's chained passes) and frees the rest once it reads how far they went. The head's
state on the host is left at the newest token (``DraftHeadRunner.resume``), so a synchronous step
can take over at any point.

Sampled requests' drafts stay coupled to their draws (``speculative_draft_sampling="coupled"``):
each launch draws the next step's noise for every verify row from the engine's generator, the
head's next drafts for the sampled requests are drawn with it, and the next launch hands it to
those rows' draws (``SamplingRow.noise``); an epoch's first launch uses the noise its host
proposal was drawn with.

A seeded request draws with noise that is a function of the output position, and the host does
not know a pipelined step's positions: they are ``O + a + 1 + j`` where ``O`` is where the step in
flight starts (known) and ``a`` its accepted drafts (on the device). So each launch hands the
device the request's noise at the ``3k + 2`` positions from ``O`` on (``Sampler.seeded_noise``,
kept per request, a position drawn once), and the device picks its rows' noise, and (coupled)
the next drafts' noise ``a'`` accepted drafts further (``SeededWindow``): the same draws as the
synchronous steps, so seeded output is the non-speculative seeded output, token for token.

A step is launched this way while every running request verifies ``k`` drafts (an epoch starts
after a synchronous proposal), samples without host data (greedy or random, seeded or not: no
penalties, logprobs or pending ``min_tokens``), has room for two more steps within
``max_model_len``, gets its blocks, and nothing waits (and the seeded requests' noise windows fit
in ``MAX_SEEDED_WINDOW_BYTES``). Anything else (a new request, a finished one, an abort) first
completes the step in flight; the engine then runs synchronously until the next epoch starts.
Tokens are those of the synchronous verify steps: the same draws, the same acceptance rule. A
request that stops at step N has step N+1 computed for nothing (its blocks are freed; stream order
keeps that step's writes before any later one's).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cluster.config import ModelConfig, SchedulerConfig
from cluster.engine.batch import pad_tables
from cluster.engine.cuda_graphs import stage
from cluster.engine.kv_cache_manager import KVCacheManager
from cluster.engine.model_runner import ModelRunner, SeededWindow, VerifyLaunch
from cluster.engine.output_processor import RequestGroup
from cluster.engine.request import Request, RequestStatus
from cluster.engine.scheduler import Scheduler, SchedulerOutput
from cluster.engine.spec_decode import SpecDecodeStats
from cluster.engine.verify_step import flight_reach

logger = logging.getLogger(__name__)

#: The most a pipelined verify step's seeded noise windows may take (``flight_reach(k)`` positions
#: of the vocabulary per seeded request, float32); past it the batch's verify steps run
#: synchronously.
MAX_SEEDED_WINDOW_BYTES = 256 << 20


@dataclass
class InFlightVerify:
    """A launched pipelined verify step whose tokens are not yet read."""

    requests: list[Request]
    launch: VerifyLaunch


class SpecPipelining:
    # state shared with the other parts of LLMEngine (set in LLMEngine.__init__)
    model_config: ModelConfig
    scheduler_config: SchedulerConfig
    scheduler: Scheduler
    kv: KVCacheManager
    runner: ModelRunner
    spec_stats: SpecDecodeStats | None
    _sample_group: dict[str, RequestGroup]
    _verify_in_flight: InFlightVerify | None
    #: Whether verify steps may run pipelined (see engine.py), and the steps that did.
    _spec_pipelined: bool
    spec_pipeline_status: str
    num_pipelined_steps: int
    num_pipelined_verify_steps: int

    def _verify_ready(self, requests: Sequence[Request], reach: int) -> bool:
        """Whether ``requests``, every running request, can verify ``k`` drafts pipelined, with
        blocks covering ``reach`` tokens past their ``num_computed_tokens`` (allocated here)."""
        sch = self.scheduler
        k = self.model_config.num_speculative_tokens
        if (sch.waiting or len(requests) != len(sch.running) or any(a is not b for a, b in zip(requests, sch.running))
                or not self.runner.can_launch_verify(len(requests), k)):
            return False
        limit = self.scheduler_config.max_model_len - flight_reach(k)
        window_bytes = len(requests) * flight_reach(k) * self.runner.sampler.vocab_size * 4
        if any(_seeded(r) for r in requests) and window_bytes > MAX_SEEDED_WINDOW_BYTES:
            return False
        for r in requests:
            p = r.sampling_params
            if (r.status is not RequestStatus.RUNNING or r.num_computed_tokens > limit or r.num_pending
                    or p.logprobs is not None or p.has_penalties or r.num_output_tokens < p.min_tokens):
                return False
            group = self._sample_group.get(r.request_id)
            if group is not None and group.held:
                return False
        # blocks taken here and then not used are freed when the step's outcome is read
        return all(self.kv.allocate(r.request_id, r.num_computed_tokens + reach) for r in requests)

    def _launch_verify_from_host(self, sched: SchedulerOutput) -> bool:
        """Start an epoch: launch this step's verify step pipelined, its drafts just proposed on
        the host, if the whole batch qualifies."""
        k = self.model_config.num_speculative_tokens
        if not self._spec_pipelined or sched.failed or sched.preempted:
            return False
        for s in sched.scheduled:
            r = s.request
            if len(r.spec_token_ids) != k or s.num_new_tokens != k + 1 or s.num_computed_tokens != r.num_tokens - 1:
                return False
        requests = [s.request for s in sched.scheduled]
        if not self._verify_ready(requests, 2 * k + 1):  # this step: verify to base + k, drafts to base + 2k
            return False
        inputs = np.array([[r.all_token_ids[-1], *r.spec_token_ids] for r in requests], dtype=np.int64)
        base = np.array([r.num_computed_tokens for r in requests], dtype=np.int64)
        dev = self.runner.device
        noise = None
        if any(r.spec_noise is not None for r in requests):  # coupled drafts proposed on the host
            noise = [r.spec_noise for r in requests]
        if not self._launch_verify(requests, stage(inputs, dev), stage(base, dev), noise):
            return False
        self._begin(sched)
        return True

    def _launch_verify_from_device(self) -> bool:
        """Continue an epoch: launch the next verify step from the one in flight's results on
        the device, then read that one. False (nothing launched) where the batch no longer
        qualifies: the caller completes the step in flight and steps synchronously."""
        step = self._verify_in_flight
        k = self.model_config.num_speculative_tokens
        if step is None or not self._verify_ready(step.requests, flight_reach(k)):
            return False
        if not self._launch_verify(step.requests, step.launch.outputs.next_inputs, step.launch.outputs.next_base,
                                   step.launch.next_noise, step.launch.outputs.accepted + 1):
            return False
        # the host does not know the step's positions: record where the step in flight starts
        self.last_step = [(r.request_id, r.num_computed_tokens, k + 1) for r in step.requests]
        return True

    def _launch_verify(self, requests: list[Request], inputs: torch.Tensor, base: torch.Tensor,
                       noise: Sequence[torch.Tensor | None] | torch.Tensor | None = None,
                       offset: torch.Tensor | None = None) -> bool:
        """Launch a verify step, then read the one in flight. False where the launch failed: the
        step in flight is read, and verify steps run synchronously from then on (where a failure
        in the draft head costs a step its acceptance, never a request), said in the log,
        ``/v1/backends`` and the gauge ``spec_decode_pipelined``. ``noise``: per request, the
        draw noise of its verify rows that its drafts were drawn with (coupled drafts); the
        sampled requests' next drafts are drawn likewise with noise drawn at this launch.
        ``offset [n]`` (on the device; None: 0): how far past the requests' output the step's first
        position lies (the step in flight's accepted drafts + 1), for seeded requests' noise."""
        previous = self._verify_in_flight
        k = self.model_config.num_speculative_tokens
        tables = [self.kv.block_tables(r.request_id) for r in requests]
        table = [pad_tables([t[g] for t in tables]) for g in range(len(tables[0]))]  # per KV group
        sampling = [self._sampling_row(r) for r in requests for _ in range(k + 1)]  # unseeded: any position
        scales = None
        if self.model_config.speculative_draft_sampling == "coupled" and any(not q.sampling_params.greedy
                                                                              for q in requests):
            scales = [0.0 if q.sampling_params.greedy else 1.0 / q.sampling_params.temperature for q in requests]
        try:
            launch = self.runner.launch_verify(table, sampling, inputs, base, scales,
                                               self._seeded_window(requests, offset), noise)
        except Exception as exc:  # noqa: BLE001 - the synchronous steps take over, and fail what must fail
            logger.exception("a pipelined verify step failed: verify steps run synchronously from now on")
            self._spec_pipelined = False
            self.spec_pipeline_status = f"a pipelined verify step failed: {type(exc).__name__}: {exc}"
            self._verify_in_flight = None
            if previous is not None:
                self._complete_verify(previous)
            return False
        self.num_pipelined_steps += 1
        self.num_pipelined_verify_steps += 1
        self._verify_in_flight = InFlightVerify(requests, launch)
        if previous is not None:
            self._complete_verify(previous)
        return True

    def _seeded_window(self, requests: list[Request], offset: torch.Tensor | None) -> SeededWindow | None:
        """The seeded requests' draw noise at the ``flight_reach(k)`` output positions from the one the host
        knows (``SeededWindow``); None where no request is seeded."""
        seeded = [_seeded(r) for r in requests]
        if not any(seeded):
            return None
        sampler = self.runner.sampler
        length = flight_reach(self.model_config.num_speculative_tokens)
        zeros = torch.zeros(sampler.vocab_size, dtype=torch.float32, device=sampler.device)
        rows: list[torch.Tensor] = []
        for r, s in zip(requests, seeded):
            start = r.num_output_tokens
            rows.extend(sampler.seeded_noise(self._sampling_row(r), range(start, start + length), r.seeded_noise)
                        if s else [zeros] * length)
        if offset is None:
            offset = torch.zeros(len(requests), dtype=torch.int64, device=sampler.device)
        return SeededWindow(torch.stack(rows).view(len(requests), length, -1), offset, seeded)

    def _complete_verify(self, step: InFlightVerify) -> None:
        """Read a pipelined verify step's tokens (waiting for it) and take them as a synchronous
        verify step would; then each request's KV and head state stand at its newest token, with
        the blocks a successor in flight writes kept."""
        launch = step.launch
        if launch.done is not None:
            launch.done.synchronize()
        values = launch.host.tolist()
        k = self.model_config.num_speculative_tokens
        n, r = len(step.requests), k + 1
        successor = self._verify_in_flight
        ahead = {id(x) for x in successor.requests} if successor is not None else set()
        assert self.spec_stats is not None and self.runner.drafter is not None
        for i, request in enumerate(step.requests):
            if request.status is not RequestStatus.RUNNING:
                continue  # finished, aborted or preempted meanwhile: this step's tokens are dropped
            accepted = values[n * r + i]
            room = request.draft_room(k, self.scheduler_config.max_model_len)
            if room > 0:  # drafts past max_tokens are none: a synchronous step would not propose them
                self.spec_stats.record(min(k, room), min(accepted, room), request)
            for token in values[i * r:i * r + accepted + 1]:
                self._take_token(request, token, None)
                if request.status is not RequestStatus.RUNNING:
                    break
            if request.status is RequestStatus.RUNNING:
                computed = request.num_computed_tokens + accepted + 1
                keep = computed + (2 * k + 1 if id(request) in ahead else 0)
                self.scheduler.advance_verified(request, computed, keep)
                self.runner.drafter.resume(request.request_id, computed, launch.outputs.last_hidden[i:i + 1])


def _seeded(r: Request) -> bool:
    """Whether ``r`` draws with seeded noise (``SeededWindow``)."""
    return r.sampling_params.seed is not None and not r.sampling_params.greedy
