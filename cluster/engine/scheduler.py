"""Scheduler: continuous batching under a per-step token budget.

There is no prefill or decode phase: each step, every request's ``num_computed_tokens`` catches up
with its token count as far as the budget allows (a long prompt is prefilled in chunks). Running
requests are served first, in arrival order; then waiting requests are admitted while the budget,
``max_num_seqs`` and the KV pool allow. When a running request cannot get a block, the most
recently admitted running request is preempted (its blocks freed; it is recomputed later).
A request's prompt chunk is also capped per step by ``long_prefill_token_threshold`` and by the
``ChunkSizer``'s cap (learned from measured step times when ``prefill_step_target_s`` is on; the
step loop teaches it), so decoding requests keep their steps short while a long prompt is
prefilled beside them. With ``sized_chunks_per_step`` the sizer's cap bounds the prompt tokens of
the whole step instead (every prompt chunk together, in arrival order), as the step time it learns
from does.

The same scheduler serves every role: ``prefill`` requests stop after their first token and keep
their blocks for the transfer; ``decode`` requests enter WAITING_FOR_REMOTE_KV with blocks reserved
and join the batch once their KV has arrived.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cluster.common.errors import ErrorKind, InvalidRequestError, OverloadedError
from cluster.config import SchedulerConfig
from cluster.engine.kv_cache_manager import KVCacheManager
from cluster.engine.request import Request, RequestStatus
from cluster.engine.sampler import SamplingRow


@dataclass
class ScheduledRequest:
    """One request's share of a step. ``request`` is the engine's side; the runner reads only the
    fields after it, which the engine fills right before the step runs (``StepLoop._inputs``)."""

    request: Request
    #: Tokens computed before this step (the start of this step's chunk).
    num_computed_tokens: int
    num_new_tokens: int
    request_id: str = ""
    #: This step's input tokens known on the host: ``num_new_tokens`` of them, or fewer when the
    #: last is being sampled by the step in flight (pipelined decode: taken on the device).
    token_ids: Sequence[int] = ()
    #: The rows to sample from this chunk's last position, when it reaches the end of the
    #: request: (request id, what to sample with) for the request, then for each sample that
    #: takes its first token from the same logits (a request's other samples).
    sampling: Sequence[tuple[str, SamplingRow]] = ()
    #: Draft tokens verified by this step (speculative decoding): the chunk's last ``k`` input
    #: tokens; ``sampling`` then has ``k + 1`` rows for the request, one per position from the
    #: last known token on.
    draft_token_ids: Sequence[int] = ()
    #: The chunk computes prompt rows (several tokens, or a prompt's last token): kernels whose
    #: numerics depend on the rows' count take one path for them (see ForwardContext.prefill).
    prefill: bool = False

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the request's tokens, so a next token is sampled."""
        return self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens

    @property
    def samples_with_pending(self) -> bool:
        """``samples``, counting tokens the step in flight is sampling (pipelined decode)."""
        return self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens + self.request.num_pending


@dataclass
class SchedulerOutput:
    """The whole contract between scheduler and model runner for one step: the runner reads
    nothing else (no live request)."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    #: Per scheduled request, its block table in every KV group, covering this step's tokens.
    block_tables: dict[str, list[list[int]]] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    #: Requests the scheduler ended this step (one that can never get its blocks): the engine
    #: reports them.
    failed: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class ChunkSizer:
    """Prompt chunks sized so that a step carrying them beside decoding requests takes about
    ``target_s`` (Sarathi-Serve's TBT-sized token budget, learned from this engine's own steps
    rather than profiled ahead).

    A step of ``p`` prompt tokens that took ``t`` seconds suggests ``p * target_s / t`` tokens.
    With a step's time ``a + b p`` (a fixed cost, then a cost per token) that suggestion lies
    below the tokens that fill the target exactly, ``(target_s - a) / b``, whenever the step was
    within the target, and iterating it converges there; over the target it shrinks the chunks
    at once. Only steps whose chunk the cap bounded (or that overran the target) teach it: a
    short prompt's step says nothing about a long one's. Growth is at most 2x a step."""

    #: Chunks never go below this many tokens (a long prompt always progresses).
    MIN_TOKENS = 16

    def __init__(self, target_s: float, budget: int, initial: int = 256) -> None:
        self.target_s = target_s
        self.budget = budget
        self.floor = min(self.MIN_TOKENS, budget)
        self.cap = max(self.floor, min(initial, budget))

    def observe(self, prompt_tokens: int, bounded: bool, seconds: float) -> int:
        """A step with ``prompt_tokens`` prompt tokens (``bounded``: some chunk was cut to the
        cap) beside decoding requests took ``seconds``; returns the cap for the next steps."""
        if prompt_tokens <= 0 or seconds <= 0 or not (bounded or seconds > self.target_s):
            return self.cap
        suggested = int(prompt_tokens * self.target_s / seconds)
        self.cap = max(self.floor, min(suggested, 2 * self.cap, self.budget))
        return self.cap


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, block_size: int) -> None:
        self.config = config
        self.kv = kv
        self.block_size = block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        #: Decode role: requests whose blocks are reserved and whose KV is on its way.
        self.receiving: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        self.prefix_queried_tokens = 0
        self.num_preemptions = 0
        self.prefix_hit_tokens = 0
        #: Where a request's KV is complete only up to some position although more is computed
        #: (a draft head's layer lags the target's by up to k + 1 positions): request id -> the
        #: tokens whose every layer is written; blocks past it are not cached yet.
        self.cache_limit: Callable[[str], int | None] | None = None
        #: Prompt chunks sized to keep steps near ``prefill_step_target_s`` (None: off).
        self.chunk_sizer = (ChunkSizer(config.prefill_step_target_s, config.max_num_batched_tokens)
                            if config.prefill_step_target_s > 0 else None)

    def chunk_cap(self) -> int | None:
        """The most prompt tokens one request schedules this step (None: the budget decides)."""
        per_step = self.config.sized_chunks_per_step
        measured = self.chunk_sizer.cap if self.chunk_sizer is not None and not per_step else None
        caps = [c for c in (self.config.long_prefill_token_threshold, measured) if c]
        return min(caps) if caps else None

    def step_prompt_cap(self) -> int | None:
        """The most prompt tokens a whole step schedules, over all its prompt chunks
        (``sized_chunks_per_step``; None: no such bound)."""
        if self.chunk_sizer is None or not self.config.sized_chunks_per_step:
            return None
        return self.chunk_sizer.cap

    # --- admission ------------------------------------------------------------------------------

    def check_fits(self, request: Request) -> None:
        """Refuse, with a typed error, a request this engine can never serve."""
        n = request.num_prompt_tokens
        if n >= self.config.max_model_len:
            raise InvalidRequestError(
                f"prompt is {n} tokens, which leaves no room to generate within max_model_len="
                f"{self.config.max_model_len}", param="prompt")
        if not self.kv.can_fit(n + 1, self.config.max_num_batched_tokens):
            raise InvalidRequestError(
                f"prompt of {n} tokens does not fit in the KV cache even when it is empty", param="prompt")

    def add_request(self, request: Request) -> None:
        self.check_fits(request)
        if len(self.waiting) >= self.config.max_waiting:
            raise OverloadedError(f"the waiting queue is full ({self.config.max_waiting} requests)")
        request.update_block_hashes(self.block_size)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def reserve_for_remote_kv(self, request: Request) -> bool:
        """Decode role: reserve blocks for the prompt now; the prefill worker fills them. Returns
        False (nothing reserved) when the pool or the sequence limit cannot take it yet."""
        self.check_fits(request)
        if len(self.running) + len(self.receiving) >= self.config.max_num_seqs:
            return False
        request.update_block_hashes(self.block_size)
        if not self.kv.allocate_tail(request.request_id, request.num_prompt_tokens):
            return False
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        request.num_cached_tokens = 0
        self.requests[request.request_id] = request
        self.receiving[request.request_id] = request
        return True

    def remote_kv_arrived(self, request_id: str) -> Request | None:
        """Decode role: the prompt's KV is in place; the request joins the running batch."""
        request = self.receiving.pop(request_id, None)
        if request is None:
            return None
        request.num_computed_tokens = request.num_prompt_tokens
        self.kv.cache_full_blocks(request_id, request.block_hashes, request.num_computed_tokens)
        request.status = RequestStatus.RUNNING
        request.first_scheduled_time = request.first_scheduled_time or time.monotonic()
        self.running.append(request)
        return request

    def requeue_remote(self, request_id: str) -> tuple[Request, list[list[int]]] | None:
        """Decode role: the remote prefill failed and the prompt is prefilled here instead: the
        request leaves the receiving set for the front of the queue, computing from scratch.
        Returns it and its reserved blocks, detached (a late write may still land in them: the
        caller keeps them unused for a while); None if it is not receiving."""
        request = self.receiving.pop(request_id, None)
        if request is None:
            return None
        tables = self.kv.detach(request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_cached_tokens = -1
        self.waiting.appendleft(request)
        return request, tables

    def fork(self, parent: Request, child: Request) -> list[list[tuple[int, int]]] | None:
        """Another sample of ``parent``'s request joins the batch with the KV of its computed
        prompt (see ``KVCacheManager.fork``; the caller copies the returned blocks). None, with
        nothing changed, when no sequence slot or block is free: the sample then waits and
        computes what the prefix cache does not give it."""
        if len(self.running) + len(self.receiving) >= self.config.max_num_seqs:
            return None
        copies = self.kv.fork(parent.request_id, child.request_id, parent.num_computed_tokens)
        if copies is None:
            return None
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.status = RequestStatus.RUNNING
        child.first_scheduled_time = parent.first_scheduled_time or time.monotonic()
        child.update_block_hashes(self.block_size)
        self.requests[child.request_id] = child
        self.running.append(child)
        return copies

    # --- one step ---------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        cap = self.chunk_cap()
        prompt_left = self.step_prompt_cap()  # None: no per-step bound on prompt tokens
        preempted_now = False
        for request in list(self.running):
            if request not in self.running:  # preempted earlier in this loop
                continue
            c = request.num_computed_tokens
            base = request.num_tokens + request.num_pending - c
            n = min(base + len(request.spec_token_ids), budget)
            chunk = base > 1 and not request.spec_token_ids  # a prompt (or recompute) chunk
            if chunk and cap is not None:
                n = min(n, cap)
            if chunk and prompt_left is not None:
                n = min(n, prompt_left)
            if n <= 0:
                continue
            if request.spec_token_ids:
                del request.spec_token_ids[max(0, n - base):]  # the budget takes what fits
            self.kv.free_skipped(request.request_id, c)
            while not self.kv.allocate(request.request_id, c + n):
                if request.spec_token_ids:  # drop the drafts before preempting anyone
                    n -= len(request.spec_token_ids)
                    request.spec_token_ids.clear()
                    continue
                victim = self.running[-1]
                self._preempt(victim, out)
                preempted_now = True
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue
            out.scheduled.append(ScheduledRequest(request, c, n, request.request_id))
            budget -= n
            if chunk and prompt_left is not None:
                prompt_left -= n
            if budget == 0:
                break
        if not preempted_now and prompt_left != 0:
            self._admit_waiting(out, budget if prompt_left is None else min(budget, prompt_left), cap)
        out.block_tables = {s.request_id: self.kv.block_tables(s.request_id) for s in out.scheduled}
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int, cap: int | None) -> None:
        now = time.monotonic()
        while self.waiting and budget > 0 and len(self.running) + len(self.receiving) < self.config.max_num_seqs:
            request = self.waiting[0]
            prefix = self.kv.find_cached_prefix(request.block_hashes, request.num_tokens)
            c = prefix.num_tokens
            n = min(request.num_tokens - c, budget, cap or budget)
            if not self.kv.allocate(request.request_id, c + n, prefix):
                if not self.kv.can_fit(request.num_tokens, self.config.max_num_batched_tokens):
                    # Not even an empty pool holds it (a preempted request grown past the pool):
                    # fail it instead of waiting forever. Blocks held outside the scheduler
                    # (quarantined after a failed remote prefill, held while a prefill sends)
                    # come back, so a request that fits an empty pool waits for them.
                    self.waiting.popleft()
                    self.finish(request, RequestStatus.FINISHED_ERROR,
                                error="the KV cache is too small for this request")
                    out.failed.append(request)
                    continue
                break
            self.waiting.popleft()
            self.kv.free_skipped(request.request_id, c)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = c
                self.prefix_queried_tokens += request.num_prompt_tokens
                self.prefix_hit_tokens += c
            request.num_computed_tokens = c
            request.status = RequestStatus.RUNNING
            request.first_scheduled_time = request.first_scheduled_time or now
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, c, n, request.request_id))
            budget -= n

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        request.num_pending = 0  # a token in flight is dropped: the recompute samples it again
        request.spec_token_ids.clear()
        self.kv.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)
        out.preempted.append(request.request_id)

    # --- after the step --------------------------------------------------------------------------

    def mark_computed(self, scheduled: ScheduledRequest) -> None:
        request = scheduled.request
        request.num_computed_tokens = scheduled.num_computed_tokens + scheduled.num_new_tokens
        self._cache_full_blocks(request)

    def mark_verified(self, scheduled: ScheduledRequest, num_accepted: int) -> None:
        """A verify step accepted ``num_accepted`` of its drafts: the KV of the positions up to the
        last accepted draft is kept, the blocks only rejected drafts wrote are freed."""
        request = scheduled.request
        k = len(scheduled.draft_token_ids)
        computed = scheduled.num_computed_tokens + scheduled.num_new_tokens - k + num_accepted
        if request.status is RequestStatus.RUNNING:
            self.advance_verified(request, computed, computed)
        else:
            request.num_computed_tokens = computed

    def advance_verified(self, request: Request, num_computed: int, keep: int) -> None:
        """A verify step's outcome: the KV of ``num_computed`` tokens is kept, and the blocks
        past those covering ``keep >= num_computed`` tokens (a pipelined step in flight writes
        up to there) are freed."""
        request.num_computed_tokens = num_computed
        self.kv.truncate(request.request_id, keep)
        self._cache_full_blocks(request)

    def _cache_full_blocks(self, request: Request) -> None:
        upto = request.num_computed_tokens
        limit = self.cache_limit(request.request_id) if self.cache_limit is not None else None
        if limit is not None:
            upto = min(upto, limit)
        self.kv.cache_full_blocks(request.request_id, request.block_hashes, upto)

    def finish(self, request: Request, status: RequestStatus, *, error: str | None = None,
               kind: ErrorKind | None = None) -> None:
        """End a request in any state; frees its blocks unless the role holds them. An error or
        abort records its ``kind`` (by default INTERNAL for an error, ABORTED for an abort)."""
        assert status.finished
        if request.status.finished:
            return
        request.status = status
        request.error = error
        if status is RequestStatus.FINISHED_ERROR:
            request.error_kind = kind or ErrorKind.INTERNAL
        elif status is RequestStatus.FINISHED_ABORTED:
            request.error_kind = kind or ErrorKind.ABORTED
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.receiving.pop(request.request_id, None)
        if not request.hold_blocks_on_finish:
            self.release(request.request_id)

    def release(self, request_id: str) -> None:
        """Free a finished request's blocks and forget it."""
        self.kv.free(request_id)
        self.requests.pop(request_id, None)

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_queried_tokens
        return self.prefix_hit_tokens / q if q else 0.0

    @property
    def num_unfinished(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.receiving)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)
