"""Intake: how requests enter and leave an engine (part of LLMEngine, see engine.py).

It uses the step loop's ``_take_token`` (a forked sample's first token) and ``_mark_changed``,
and remote KV's ``_quarantine_blocks``. A request is validated and tokenized (``make_group``; InvalidRequestError for bad input), split
into its ``n`` samples and queued (``add_group``). Samples 1..n-1 are held until sample 0 has
computed the prompt, then fork its KV with first tokens drawn from the same logits
(``_settle_held``): one prefill for n samples. A request leaves finished (its last delta), aborted
(``abort_request``, any state) or past its deadline (``_expire_deadlines``)."""
from __future__ import annotations

import time
from collections.abc import Sequence

from cluster.common.errors import ClusterError, ErrorKind, InvalidRequestError, kind_of
from cluster.common.outputs import PositionLogprobs, RequestOutput
from cluster.common.sampling_params import SamplingParams
from cluster.config import SchedulerConfig
from cluster.engine.model_runner import ModelRunner
from cluster.engine.output_processor import OutputProcessor, RequestGroup
from cluster.engine.request import Request, RequestStatus
from cluster.engine.scheduler import Scheduler, SchedulerOutput
from cluster.engine.spec_decode import Proposer
from cluster.models.tokenizer import Tokenizer


class Intake:
    # state shared with the other parts of LLMEngine (set in LLMEngine.__init__)
    tokenizer: Tokenizer | None
    vocab_size: int
    scheduler: Scheduler
    scheduler_config: SchedulerConfig
    runner: ModelRunner
    output_processor: OutputProcessor
    groups: dict[str, RequestGroup]
    _sample_group: dict[str, RequestGroup]
    _pending: list[RequestOutput]
    _first_tokens: dict[str, tuple[int, PositionLogprobs | None]]
    num_forked_samples: int
    proposer: Proposer | None

    # --- validation and queueing ------------------------------------------------------------------

    def tokenize(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        """Validate a prompt and return (text, token ids)."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty", param="prompt")
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer; give token ids", param="prompt")
            ids = self.tokenizer.encode(prompt)
            text: str | None = prompt
        else:
            ids = list(prompt)
            text = None
            if not ids:
                raise InvalidRequestError("prompt is empty", param="prompt")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise InvalidRequestError("prompt token ids must be integers", param="prompt")
        bad = [t for t in ids if t < 0 or t >= self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token id(s) {bad[:5]} outside the vocabulary [0, {self.vocab_size})", param="prompt")
        if not ids:
            raise InvalidRequestError("prompt tokenizes to nothing", param="prompt")
        return text, ids

    def make_group(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                   arrival_time: float | None = None, sample_index: int = 0) -> RequestGroup:
        """Validate and build a request without adding it (raises InvalidRequestError)."""
        if request_id in self.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling_params must be a SamplingParams", param="sampling_params")
        text, ids = self.tokenize(prompt)
        eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else ()
        now = arrival_time if arrival_time is not None else time.monotonic()
        samples = [Request(request_id if params.n == 1 else f"{request_id}#{i}", ids, params, eos,
                           sample_index=sample_index + i, arrival_time=now) for i in range(params.n)]
        self.scheduler.check_fits(samples[0])
        group = RequestGroup(request_id, text, ids, samples)
        group.texts = [self.output_processor.make_text(s) for s in samples]
        return group

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                    arrival_time: float | None = None) -> RequestGroup:
        group = self.make_group(request_id, prompt, params, arrival_time)
        self.add_group(group)
        return group

    def add_group(self, group: RequestGroup) -> None:
        """Queue a request. Its samples 1..n-1 wait for sample 0 to compute the prompt
        (``RequestGroup.held``); the step that samples sample 0's first token draws theirs from the
        same logits (each with its own seed), and they fork its KV: full blocks shared, the last
        partial block copied. One prefill for n samples, nothing computed again."""
        self.scheduler.add_request(group.samples[0])
        self._register(group, hold=True)

    def _register(self, group: RequestGroup, hold: bool) -> None:
        for s in group.samples:
            self._sample_group[s.request_id] = group
        group.held = group.samples[1:] if hold else []
        self.groups[group.request_id] = group

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    # --- n > 1: one prefill, n samples ------------------------------------------------------------

    def _settle_held(self, group: RequestGroup) -> None:
        """Sample 0 changed: once it has its first token (the prompt is computed) the held samples
        fork its KV with the first tokens drawn for them (``_first_tokens``); if it ended without
        one, they end as it did. A sample that cannot fork now (no sequence slot or block free, or
        no token drawn for it) joins the queue and computes what the prefix cache lacks."""
        first = group.samples[0]
        if first.num_output_tokens == 0 and not first.status.finished:
            return
        held, group.held = group.held, []
        for s in held:
            drawn = self._first_tokens.pop(s.request_id, None)
            if s.status.finished:
                continue
            if first.num_output_tokens == 0:
                self.scheduler.finish(s, first.status, error=first.error, kind=first.error_kind)
                continue
            if drawn is not None and self._fork(first, s, *drawn):
                continue
            try:
                self.scheduler.add_request(s)
            except ClusterError as exc:  # the waiting queue is full: this sample fails, visibly
                self.scheduler.finish(s, RequestStatus.FINISHED_ERROR, error=exc.message, kind=kind_of(exc))

    def _fork(self, first: Request, sample: Request, token: int, logprobs: PositionLogprobs | None) -> bool:
        """``sample`` takes ``first``'s prompt KV and its own first token. A prefill role forks no
        blocks: the sample ends at its first token, and the decode worker forks there."""
        if not self.scheduler_config.prefill_only:
            copies = self.scheduler.fork(first, sample)
            if copies is None:
                return False
            self.runner.copy_blocks(copies)
            if self.runner.drafter is not None:
                self.runner.drafter.fork(first.request_id, sample.request_id, first.num_prompt_tokens)
            self.num_forked_samples += 1
        self._take_token(sample, token, logprobs)
        return True

    def _forks(self, sched: SchedulerOutput) -> dict[str, list[Request]]:
        """Held samples whose first token this step draws: those of each sample 0 that samples
        its first token now."""
        forks: dict[str, list[Request]] = {}
        for s in sched.scheduled:
            r = s.request
            if r.num_output_tokens == 0 and s.samples:
                group = self._sample_group.get(r.request_id)
                if group is not None and group.held and r is group.samples[0]:
                    forks[r.request_id] = [c for c in group.held if not c.status.finished]
        return forks

    # --- leaving ------------------------------------------------------------------------------------

    def abort_request(self, request_id: str, *, error: str | None = None,
                      status: RequestStatus = RequestStatus.FINISHED_ABORTED, kind: ErrorKind | None = None) -> None:
        group = self.groups.get(request_id)
        if group is None:
            return
        for s in group.samples:
            if s.request_id in self.scheduler.receiving:
                self._quarantine_blocks(s.request_id)
            self.scheduler.finish(s, status, error=error, kind=kind)
        self._finish_group_if_done(group, emit=True)

    def _expire_deadlines(self) -> None:
        now = time.monotonic()
        for group in list(self.groups.values()):
            deadline = group.samples[0].deadline
            if deadline is not None and now > deadline:
                self.abort_request(group.request_id, error="deadline exceeded", kind=ErrorKind.DEADLINE)

    def _finish_group_if_done(self, group: RequestGroup, emit: bool) -> None:
        if not group.finished or group.request_id not in self.groups:
            return
        del self.groups[group.request_id]
        for s in group.samples:
            self._sample_group.pop(s.request_id, None)
            if self.proposer is not None:
                self.proposer.forget(s.request_id)
            if self.runner.drafter is not None:
                self.runner.drafter.forget(s.request_id)
        if emit:
            self._pending.append(group.delta())
