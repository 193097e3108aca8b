"""Remote KV (part of LLMEngine, see engine.py): requests whose prompt another worker prefills.

Decode role: ``reserve_remote`` reserves blocks for sample 0's prompt (the request waits in the
scheduler's receiving set, WAITING_FOR_REMOTE_KV); ``finish_remote_prefill`` admits it once the
KV has landed, with the first tokens the prefill worker drew; ``fail_remote_prefill`` prefills
it here instead (``fallback``) or fails it. Blocks a remote writer may still be writing into
(an abandoned or failed transfer) are quarantined for ``remote_kv_grace_s`` before reuse.
Prefill role: requests hold their blocks after their first token (``hold_blocks_on_finish``)
until the role releases them (``Scheduler.release``). It uses intake's ``_register`` and
``_finish_group_if_done`` and the step loop's ``_take_token``/``_mark_changed``."""
from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from cluster.common.errors import ErrorKind, InvalidRequestError
from cluster.common.outputs import PositionLogprobs, RequestOutput
from cluster.config import SchedulerConfig
from cluster.engine.kv_cache_manager import KVCacheManager
from cluster.engine.model_runner import ModelRunner
from cluster.engine.output_processor import RequestGroup
from cluster.engine.request import RequestStatus
from cluster.engine.scheduler import Scheduler


class RemoteKV:
    # state shared with the other parts of LLMEngine (set in LLMEngine.__init__)
    scheduler: Scheduler
    scheduler_config: SchedulerConfig
    kv: KVCacheManager
    groups: dict[str, RequestGroup]
    _sample_group: dict[str, RequestGroup]
    _pending: list[RequestOutput]
    _changed: dict[str, RequestGroup]
    _first_tokens: dict[str, tuple[int, PositionLogprobs | None]]
    _quarantine: list[tuple[float, list[list[int]]]]
    runner: ModelRunner

    def reserve_remote(self, group: RequestGroup) -> bool:
        """Reserve KV blocks for sample 0 of a request whose prompt another worker prefills; the
        other samples wait for that KV as in ``add_group`` (without prefix caching they then
        compute the prompt here). False: no room now (nothing reserved)."""
        if group.request_id in self.groups:
            raise InvalidRequestError(f"request id {group.request_id!r} is already in use", param="request_id")
        if not self.scheduler.reserve_for_remote_kv(group.samples[0]):
            return False
        self._register(group, hold=True)
        return True

    def finish_remote_prefill(self, request_id: str, first_token: int, logprobs: PositionLogprobs | None,
                              others: Sequence[tuple[int, PositionLogprobs | None]] = (),
                              draft_hidden: bytes | None = None) -> bool:
        """The prompt's KV is in the reserved blocks and the prefill worker sampled ``first_token``
        (and ``others``: the first tokens of samples 1..n-1, drawn from the same logits): the
        request joins the running batch and its other samples fork its KV. False if the request
        is gone (aborted, expired)."""
        request = self.scheduler.remote_kv_arrived(request_id)
        if request is None:
            return False
        group = self._sample_group[request_id]
        drafter = self.runner.drafter
        if drafter is not None:  # the drafter starts where the prompt ends, from the prefill's hand-over
            drafter.receive(request_id, self.kv.block_tables(request_id), request.num_computed_tokens, draft_hidden)
        for sample, drawn in zip(group.samples[1:], others):
            self._first_tokens[sample.request_id] = drawn
        self._take_token(request, first_token, logprobs)
        group = self._changed.pop(self._sample_group[request_id].request_id, None)
        if group is not None:  # deliver the first token now, not after the next step
            self._pending.append(group.delta())
            self._finish_group_if_done(group, emit=False)
        return True

    def fail_remote_prefill(self, request_id: str, reason: str, fallback: bool) -> None:
        """The remote prefill or its transfer failed: prefill here instead (``fallback``) or fail."""
        request = self.scheduler.receiving.get(request_id)
        if request is None:
            return
        if not fallback:
            self._quarantine_blocks(request_id)
            self.scheduler.finish(request, RequestStatus.FINISHED_ERROR, error=reason, kind=ErrorKind.KV_TRANSFER)
            self._mark_changed(request)
            self._finish_group_if_done(self._sample_group[request_id], emit=True)
            return
        requeued = self.scheduler.requeue_remote(request_id)  # not None: it was receiving
        if requeued is not None:
            self._quarantine_tables(requeued[1])

    def _quarantine_blocks(self, request_id: str) -> None:
        """A remote prefill may still be writing into these blocks: keep them unused for a while."""
        self._quarantine_tables(self.kv.detach(request_id))

    def _quarantine_tables(self, tables: list[list[int]]) -> None:
        self._quarantine.append((time.monotonic() + self.scheduler_config.remote_kv_grace_s, tables))

    def _release_quarantine(self) -> None:
        now = time.monotonic()
        while self._quarantine and self._quarantine[0][0] <= now:
            self.kv.free_blocks(self._quarantine.pop(0)[1])
