"""The step loop (part of LLMEngine, see engine.py): ``step()`` is schedule, run the model,
process the outputs. The engine fills each scheduled request's runner inputs (``_inputs``: input
token ids, sampling rows) right before the runner reads them, so the runner sees the
SchedulerOutput only. Sampled tokens go through one path (``_take_token``: append, stop checks,
detokenization, a delta for the request's group); ``_collect`` returns the step's deltas. It
uses pipelining's ``_pipeline_ready``/``_launch``/``_complete_in_flight``, speculative
pipelining's ``_launch_verify_from_device``/``_launch_verify_from_host``, intake's
``_expire_deadlines``/``_forks``/``_settle_held``/``_finish_group_if_done`` and remote KV's
``_release_quarantine``."""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from cluster.common.kv_spec import checkpoint_positions
from cluster.common.outputs import PositionLogprobs, RequestOutput
from cluster.config import CacheConfig, ModelConfig, SchedulerConfig
from cluster.engine.kv_cache_manager import KVCacheManager
from cluster.engine.model_runner import ModelRunner, RunnerOutput
from cluster.engine.output_processor import OutputProcessor, RequestGroup
from cluster.engine.pipeline import InFlightStep
from cluster.engine.spec_pipeline import InFlightVerify
from cluster.engine.request import Request, RequestStatus
from cluster.engine.sampler import SamplingRow
from cluster.engine.scheduler import ChunkSizer, ScheduledRequest, Scheduler, SchedulerOutput
from cluster.engine.draft_runner import DraftJob
from cluster.engine.spec_decode import Proposer, SpecDecodeStats, accepted_length
from cluster.engine.stalls import StallWatch, Stalls
from kernels.compile_watch import Compilation

logger = logging.getLogger(__name__)
#: At most one slow-step warning per this many seconds (each says how many went unsaid).
SLOW_STEP_LOG_PERIOD_S = 10.0
#: How many of the compilations inside served steps the engine keeps (diagnostics, tests).
MAX_STEP_COMPILATIONS_KEPT = 64


class StepLoop:
    # state shared with the other parts of LLMEngine (set in LLMEngine.__init__)
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler: Scheduler
    scheduler_config: SchedulerConfig
    runner: ModelRunner
    output_processor: OutputProcessor
    groups: dict[str, RequestGroup]
    _sample_group: dict[str, RequestGroup]
    _pending: list[RequestOutput]
    _changed: dict[str, RequestGroup]
    _quarantine: list[tuple[float, list[list[int]]]]
    _first_tokens: dict[str, tuple[int, PositionLogprobs | None]]
    _in_flight: InFlightStep | None
    _verify_in_flight: InFlightVerify | None
    kv: KVCacheManager
    _pipelined: bool
    last_step: list[tuple[str, int, int]]
    num_sync_steps: int
    #: Steps slower than ``slow_step_s`` seconds (0: not counted), the slowest step's seconds, and
    #: the rate limit of the slow-step warning.
    slow_step_s: float
    num_slow_steps: int
    slowest_step_s: float
    _slow_steps_said: int
    _slow_step_logged_at: float
    #: What held served steps besides their work (stalls.py): Triton compilations inside them (a
    #: shape the start-up warm-up missed; counted, and warned of at most once a period) and the
    #: seconds of garbage collection.
    stall_watch: StallWatch
    num_step_compiles: int
    step_compilations: list[Compilation]
    step_compile_s: float
    step_gc_s: float
    _compiles_logged_at: float
    proposer: Proposer | None
    spec_stats: SpecDecodeStats | None

    def has_work(self) -> bool:
        """Anything to step for: unfinished requests, outputs not yet returned, quarantined blocks,
        a pipelined step in flight."""
        return (bool(self.groups) or bool(self._pending) or bool(self._quarantine)
                or self._in_flight is not None or self._verify_in_flight is not None)

    def step(self) -> list[RequestOutput]:
        """One engine step (``_step``), timed: a step slower than ``slow_step_s`` is counted and
        said (``_note_slow_step``)."""
        began = time.perf_counter()
        mark = self.stall_watch.mark()
        out = self._step()
        seconds = time.perf_counter() - began
        stalls = self.stall_watch.since(mark)
        self.step_gc_s += stalls.gc_seconds
        if stalls.compilations:
            self._note_step_compiles(stalls)
        if seconds > self.slowest_step_s:
            self.slowest_step_s = seconds
        if 0 < self.slow_step_s < seconds:
            self._note_slow_step(seconds, stalls)
        return out

    def _note_step_compiles(self, stalls: Stalls) -> None:
        """Count Triton compilations inside a served step and warn (at most once a
        ``SLOW_STEP_LOG_PERIOD_S``): every request in the step waited for them."""
        self.num_step_compiles += len(stalls.compilations)
        self.step_compile_s += stalls.compile_seconds
        self.step_compilations.extend(stalls.compilations[:MAX_STEP_COMPILATIONS_KEPT - len(self.step_compilations)])
        now = time.monotonic()
        if now - self._compiles_logged_at < SLOW_STEP_LOG_PERIOD_S:
            return
        self._compiles_logged_at = now
        logger.warning("a served step compiled Triton kernels: %s, for %s; %d compilations inside steps since "
                       "start-up (the start-up warm-up did not reach this shape)", stalls.describe(),
                       self._step_shape(), self.num_step_compiles)

    def _step_shape(self) -> str:
        chunks = [n for _, _, n in self.last_step]
        prompts = [n for n in chunks if n > 1]
        context = max((start + n for _, start, n in self.last_step), default=0)
        return (f"{sum(chunks)} tokens of {len(chunks)} requests ({len(prompts)} prompt chunks, the longest "
                f"{max(prompts, default=0)} tokens; contexts up to {context} tokens)")

    def _note_slow_step(self, seconds: float, stalls: Stalls | None = None) -> None:
        """Count a slow step and warn with its shape and what stalled it (compilations, garbage
        collection), at most one warning per ``SLOW_STEP_LOG_PERIOD_S`` (saying how many slow steps
        went unsaid since the last)."""
        self.num_slow_steps += 1
        now = time.monotonic()
        if now - self._slow_step_logged_at < SLOW_STEP_LOG_PERIOD_S:
            return
        unsaid = self.num_slow_steps - 1 - self._slow_steps_said
        self._slow_steps_said = self.num_slow_steps
        self._slow_step_logged_at = now
        held = stalls.describe() if stalls is not None else ""
        logger.warning("slow step: %.3f s (slow_step_s=%.3g) for %s%s; %d slow steps since start-up%s", seconds,
                       self.slow_step_s, self._step_shape(), f"; in it: {held}" if held else "",
                       self.num_slow_steps, f", {unsaid} not logged since the last warning" if unsaid else "")

    def _step(self) -> list[RequestOutput]:
        self._release_quarantine()
        self._expire_deadlines()
        if self._launch_verify_from_device():  # pipelined speculative decoding goes on
            return self._collect()
        if self._pipelined and self._pipeline_ready():
            sched = self.scheduler.schedule()  # nothing waits here, so none fails admission
            self._inputs(sched, {})  # no forks: _pipeline_ready refuses a step that draws first tokens
            if self.runner.can_launch(sched):
                self._launch(sched)
                return self._collect()
            self._complete_in_flight()  # not expected (the checks above hold), but always safe
            sched.scheduled = [s for s in sched.scheduled if s.request.status is RequestStatus.RUNNING]
        else:
            self._complete_in_flight()
            if self.proposer is not None:
                self._propose()
            sched = self.scheduler.schedule()
            if getattr(self.proposer, "device_side", False):
                self._draft_on_device(sched)
                if self._launch_verify_from_host(sched):
                    return self._collect()
        self._begin(sched)
        for request in sched.failed:
            self._mark_changed(request)
        if not sched.is_empty:
            self.num_sync_steps += 1
            forks = self._forks(sched)
            self._inputs(sched, forks)
            sizer = self.scheduler.chunk_sizer
            started = time.perf_counter() if sizer is not None else 0.0
            try:
                result = self.runner.execute(sched)
            except Exception as exc:  # noqa: BLE001 - a failed batch fails its requests, not the loop
                logger.exception("model step failed")
                self._fail([s.request for s in sched.scheduled], exc)
            else:
                if sizer is not None:
                    self._size_chunks(sizer, sched, time.perf_counter() - started,
                                      self.scheduler.config.sized_chunks_per_step)
                for children in forks.values():
                    for c in children:
                        self._first_tokens[c.request_id] = (result.sampled[c.request_id],
                                                            result.logprobs.get(c.request_id))
                self._process(sched.scheduled, result)
        return self._collect()

    @staticmethod
    def _size_chunks(sizer: ChunkSizer, sched: SchedulerOutput, seconds: float, per_step: bool = False) -> None:
        """Teach the chunk sizer from a step that carried prompt chunks beside decoding requests
        (such a step samples their tokens, so its time is the device's, not just the launch)."""
        prompt = [s for s in sched.scheduled if s.num_new_tokens > 1 and not s.draft_token_ids]
        if not prompt or len(prompt) == len(sched.scheduled):
            return
        total = sum(s.num_new_tokens for s in prompt)
        if per_step:  # the cap bounded the step's prompt tokens together
            bounded = total >= sizer.cap
        else:
            bounded = any(s.num_new_tokens == sizer.cap and not s.samples for s in prompt)
        sizer.observe(total, bounded, seconds)

    def _inputs(self, sched: SchedulerOutput, forks: dict[str, list[Request]]) -> None:
        """Fill what the runner reads of each scheduled request, from its state now: the input
        tokens known on the host (drafts last) and, for a chunk that reaches the request's end
        (counting a token in flight), its sampling rows: one, or one per verified position, and
        those of the samples in ``forks`` that draw their first token from the same logits."""
        for s in sched.scheduled:
            r = s.request
            c = s.num_computed_tokens
            s.prefill = s.num_new_tokens > 1 and not r.spec_token_ids or r.num_output_tokens == 0
            drafts = r.spec_token_ids
            if drafts and c + s.num_new_tokens == r.num_tokens + len(drafts):
                s.token_ids = r.all_token_ids[c:] + drafts
                s.draft_token_ids = list(drafts)
                s.sampling = [(r.request_id, self._sampling_row(r, drafts[:j])) for j in range(len(drafts) + 1)]
                if r.spec_noise is not None:  # the noise the drafts were drawn with (_draft_on_device)
                    for j, (_, row) in enumerate(s.sampling):
                        row.noise = r.spec_noise[j]
                continue
            s.token_ids = r.all_token_ids[c:c + s.num_new_tokens]
            s.draft_token_ids = ()
            if s.samples_with_pending:
                rows = [(r.request_id, self._sampling_row(r))]
                for child in forks.get(r.request_id, ()):
                    rows.append((child.request_id, self._sampling_row(child)))
                s.sampling = rows
            else:
                s.sampling = ()

    @staticmethod
    def _sampling_row(r: Request, ahead: Sequence[int] = ()) -> SamplingRow:
        """How to sample ``r``'s next token, or (``ahead``: drafts taken as already output) the
        token after them: the seeded noise, min_tokens and penalties of that output position."""
        p = r.sampling_params
        position = r.num_output_tokens + r.num_pending + len(ahead)
        banned: tuple[int, ...] = ()
        if position < p.min_tokens:  # stop and eos ids may not end it yet
            banned = tuple(p.stop_token_ids) + (() if p.ignore_eos else r.eos_token_ids)
        output = r.output_token_ids
        pending = r.num_pending + len(ahead)
        if ahead and p.has_penalties:  # the drafts count as output for the penalties
            output, pending = output + list(ahead), r.num_pending
        return SamplingRow(p, r.prompt_token_ids, output, banned, r.sample_index, pending)

    def _begin(self, sched: SchedulerOutput) -> None:
        """Record the step in ``last_step``."""
        self.last_step = [(s.request_id, s.num_computed_tokens, s.num_new_tokens) for s in sched.scheduled]

    def _fail(self, requests: list[Request], exc: Exception) -> None:
        for r in requests:
            self.scheduler.finish(r, RequestStatus.FINISHED_ERROR, error=f"model step failed: {exc}")
            self._mark_changed(r)

    def _collect(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        changed, self._changed = self._changed, {}
        for group in changed.values():
            if group.request_id in self.groups:
                outputs.append(group.delta())
                self._finish_group_if_done(group, emit=False)
        return outputs

    def take_pending(self) -> list[RequestOutput]:
        """Outputs produced outside a step (aborts, remotely prefilled first tokens)."""
        pending, self._pending = self._pending, []
        return pending

    def _mark_changed(self, request: Request) -> None:
        group = self._sample_group.get(request.request_id)
        if group is not None:
            self._changed[group.request_id] = group
            if group.held and request is group.samples[0]:
                self._settle_held(group)

    def _process(self, scheduled: list[ScheduledRequest], result: RunnerOutput) -> None:
        # (verified position, request, position): the states to keep, as a prefill chunk keeps them
        commits: list[tuple[int, str, int]] = []
        for s in scheduled:
            request = s.request
            if request.status is not RequestStatus.RUNNING:
                continue
            if s.draft_token_ids:
                taken = self._take_verified(s, result)
                if request.status is RequestStatus.RUNNING:
                    first, start = result.verify_slots[s.request_id], s.num_computed_tokens
                    commits += [(first + q - start, s.request_id, q)
                                for q in checkpoint_positions(start, start + taken, self.cache_config.block_size)]
                continue
            self.scheduler.mark_computed(s)
            token = result.sampled.get(request.request_id)
            if token is not None and self.scheduler_config.prefill_only and self.runner.drafter is not None:
                request.draft_hidden = self.runner.drafter.handover(  # for the decode worker
                    request.request_id, self.kv.block_tables(request.request_id), request.num_computed_tokens)
            if token is not None:
                self._take_token(request, token, result.logprobs.get(request.request_id))
        if commits and self.runner.verify_states is not None:
            self.runner.commit_verified([c[0] for c in commits], [self.kv.block_tables(c[1]) for c in commits],
                                        [c[2] for c in commits])

    def _take_verified(self, s: ScheduledRequest, result: RunnerOutput) -> int:
        """A verify step: the target's tokens ``t_0 .. t_k`` at the chunk's last ``k + 1``
        positions. Take ``t_0`` and then each ``t_j`` whose prefix the drafts got right
        (``d_j == t_{j-1}``), stopping at the first token that ends the request. Returns how many
        were taken (the KV of as many positions is kept)."""
        request = s.request
        drafts = list(s.draft_token_ids)
        targets = result.verified[request.request_id]
        logprobs = result.verified_logprobs.get(request.request_id) or [None] * len(targets)
        m = accepted_length(drafts, targets)
        assert self.spec_stats is not None
        self.spec_stats.record(len(drafts), m, request)
        taken = 0
        for token, lp in zip(targets[:m + 1], logprobs[:m + 1]):
            self._take_token(request, token, lp)
            taken += 1
            if request.status is not RequestStatus.RUNNING:
                break
        self.scheduler.mark_verified(s, taken - 1)
        return taken

    def _propose(self) -> None:
        """Draft tokens for every running request that decodes next (all its tokens but the last
        computed), at most what ``max_tokens`` and ``max_model_len`` leave room for."""
        proposer = self.proposer
        assert proposer is not None
        k = self.model_config.num_speculative_tokens
        max_len = self.scheduler_config.max_model_len
        for r in self.scheduler.running:
            r.spec_token_ids = []
            r.spec_noise = None
            if r.num_pending or r.num_output_tokens == 0 or r.num_computed_tokens != r.num_tokens - 1:
                continue
            room = r.draft_room(k, max_len)
            if room > 0:
                r.spec_token_ids = proposer.propose(r, room)

    def _draft_on_device(self, sched: SchedulerOutput) -> None:
        """Replace the placeholder drafts of the scheduled verify steps with the draft head's."""
        jobs = []
        coupled = self.model_config.speculative_draft_sampling == "coupled"
        for s in sched.scheduled:
            r = s.request
            if r.spec_token_ids and s.num_computed_tokens == r.num_tokens - 1 \
                    and s.num_new_tokens == 1 + len(r.spec_token_ids):
                k = len(r.spec_token_ids)
                p = r.sampling_params
                if coupled and not p.greedy:  # drafts drawn with the noise the verify step draws with
                    rows = [self._sampling_row(r, r.spec_token_ids[:j]) for j in range(k + 1)]
                    r.spec_noise = self.runner.sampler.position_noise(rows)
                jobs.append(DraftJob(r.request_id, r.num_tokens - 1, r.all_token_ids[-1], k,
                                     scale=1.0 / p.temperature if r.spec_noise is not None else 1.0,
                                     noise=r.spec_noise))
            else:
                r.spec_token_ids = []
                r.spec_noise = None
        if jobs:
            try:
                drafts = self.runner.propose(jobs, sched.block_tables)
            except Exception:  # noqa: BLE001 - a failed draft costs this step its acceptance, nothing else
                logger.exception("draft head failed: this step verifies placeholder drafts")
                for job in jobs:  # their draft state may be half-updated: start it afresh
                    self.runner.drafter.forget(job.request_id)  # type: ignore[union-attr]
                return  # the placeholders stay: any drafts verify exactly, these are just rejected
            for s in sched.scheduled:
                if s.request.request_id in drafts:
                    new = drafts[s.request.request_id]
                    s.num_new_tokens -= len(s.request.spec_token_ids) - len(new)  # a block stopped early
                    s.request.spec_token_ids = new

    def _take_token(self, request: Request, token: int, logprobs: PositionLogprobs | None) -> None:
        """Append a sampled token to ``request``, then its stop checks and output bookkeeping."""
        request.append_output(token, logprobs, self.cache_config.block_size)
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        group = self._sample_group[request.request_id]
        status = self.output_processor.on_token(request, group.texts[group.samples.index(request)])
        if status is None and self.scheduler_config.prefill_only:
            status = RequestStatus.FINISHED_LENGTH  # the decode worker generates the rest
        if group.held and request is group.samples[0]:
            self._settle_held(group)  # its other samples fork the prompt's KV before it can be freed
        if status is not None:
            self.scheduler.finish(request, status)
        self._mark_changed(request)
