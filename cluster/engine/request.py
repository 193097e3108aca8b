"""Request: one sample's state inside an engine.

States (``RequestStatus``):
  WAITING -> RUNNING -> FINISHED_*          (colocated; prefill role finishes after the first token)
  RUNNING -> PREEMPTED -> RUNNING           (blocks ran out: freed, recomputed later from scratch)
  WAITING_FOR_REMOTE_KV -> RUNNING          (decode role: blocks reserved, KV arrives from prefill)
Any state may end in FINISHED_ABORTED (cancel, deadline) or FINISHED_ERROR.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cluster.common.errors import ErrorKind
from cluster.common.outputs import FinishReason, PositionLogprobs
from cluster.common.sampling_params import SamplingParams
from cluster.common.block_hash import hash_token_blocks

if TYPE_CHECKING:
    from cluster.engine.spec_decode import SpecDecodeStats


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def finished(self) -> bool:
        return self.value.startswith("finished")

    @property
    def finish_reason(self) -> FinishReason | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


@dataclass(eq=False)  # identity: requests live in lists that are searched every step
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    #: Which of the parent's n samples this is (seeds differ per sample).
    sample_index: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[PositionLogprobs] = field(default_factory=list)
    num_computed_tokens: int = 0
    #: Prompt tokens found in the prefix cache when the request was first scheduled.
    num_cached_tokens: int = -1
    block_hashes: list[int] = field(default_factory=list)
    stop_reason: str | int | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None
    #: Set by roles: e.g. the prefill role keeps blocks after finishing until the transfer is done.
    hold_blocks_on_finish: bool = False
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    #: Tokens sampled by a step still running on the device, not yet appended (pipelined
    #: decode, see LLMEngine): their positions are computed, their values not yet known here.
    num_pending: int = 0
    #: Draft tokens proposed to follow the request's tokens, verified by the next step
    #: (speculative decoding; see cluster.engine.spec_decode). Never part of its tokens.
    spec_token_ids: list[int] = field(default_factory=list)
    #: A sampled request's drafts drawn from the draft head's distribution: the target's draw
    #: noise at each verified position ``[len(spec_token_ids) + 1, V]`` (``Sampler.position_noise``),
    #: which the drafts were drawn with and the verify step draws with. None otherwise.
    spec_noise: Any = None
    #: A seeded request's draw noise by output position, drawn ahead for pipelined verify steps
    #: (``Sampler.seeded_noise``; positions behind the request are dropped as it advances).
    seeded_noise: dict[int, Any] = field(default_factory=dict)
    #: This request's speculation (verify steps, draft tokens, accepted ones in all and per draft
    #: position), counted by the engine's ``SpecDecodeStats.record``; None until its first verify
    #: step. Reported in its RequestOutput.metrics.
    spec_stats: SpecDecodeStats | None = None
    #: Prefill role with a draft head: the target's hidden state at the prompt's last position
    #: (float32 bytes), handed to the decode worker with the first token.
    draft_hidden: bytes | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    def draft_room(self, k: int, max_model_len: int) -> int:
        """How many drafts its next verify step may propose: ``k``, at most what ``max_tokens``
        and ``max_model_len`` leave room for (the step's bonus token included)."""
        room = min(k, max_model_len - self.num_tokens - 1)
        if self.max_tokens is not None:
            room = min(room, self.max_tokens - self.num_output_tokens - 1)
        return room

    @property
    def deadline(self) -> float | None:
        d = self.sampling_params.deadline_s
        return None if d is None else self.arrival_time + d

    def update_block_hashes(self, block_size: int) -> None:
        self.block_hashes = hash_token_blocks(self.all_token_ids, block_size, self.block_hashes)

    def append_output(self, token_id: int, logprobs: PositionLogprobs | None, block_size: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
        if self.num_tokens % block_size == 0:
            self.update_block_hashes(block_size)
