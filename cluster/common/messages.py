"""Typed messages that cross process boundaries between the ingress, prefill and decode roles.
Plain dataclasses of plain values (picklable, no torch), so every role can import them."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from cluster.common.errors import ErrorKind
from cluster.common.outputs import PositionLogprobs, RequestOutput
from cluster.common.sampling_params import SamplingParams


@dataclass
class GenerateRequest:
    """One prompt to generate for: validated, tokenized, with its deadline, and its
    ``sampling_params.n`` samples (numbered ``sample_index`` .. ``sample_index + n - 1``: the seed
    of each is varied by its number). One routed call per prompt, whatever ``n`` is: the worker
    that decodes it prefills the prompt once and its samples share that KV."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    sample_index: int = 0
    arrival_time: float = field(default_factory=time.time)
    #: Hashes of the prompt's full blocks (prefix-cache affinity for routing).
    block_hashes: list[int] = field(default_factory=list)
    #: Prefill on the decode worker itself (conditional disaggregation).
    local_prefill: bool = False


@dataclass
class PrefillRequest:
    """Decode -> prefill: compute this request's prompt, write its KV into my reserved blocks, and
    draw the first token of each of its ``n`` samples."""

    request: GenerateRequest
    #: The decode worker's TransferEndpoint (a kv_transfer type; opaque here).
    dest: Any
    #: Per KV group, the decode worker's block table reserved for the prompt.
    dest_block_tables: list[list[int]]
    #: Names this transfer (unique across the cluster): the key of the completion notification.
    transfer_key: str
    #: Leading prompt tokens whose KV the decode worker already holds (its own prefix cache).
    skip_tokens: int = 0


@dataclass
class PrefillResult:
    first_token: int
    logprobs: PositionLogprobs | None
    num_cached_tokens: int
    bytes_sent: int
    #: prefill_queue, prefill_compute, transfer (seconds spent writing KV).
    timings: dict[str, float] = field(default_factory=dict)
    #: The prefill worker's node (the decode worker's ``wait_received`` needs the path it used).
    sender_node: str = ""
    #: The first tokens (and logprobs) of the request's samples 1..n-1, drawn from the same
    #: prompt logits as ``first_token``, each with its own seed: the decode worker forks them.
    others: list[tuple[int, PositionLogprobs | None]] = field(default_factory=list)
    #: The drafter's hand-over (its KV for the prompt travels with the blocks): draft_head / mtp,
    #: the target's hidden state at the prompt's last position (float32 bytes) the decode
    #: worker's drafter starts from; dspark, the layout descriptor and checksum of the drafter's
    #: entries that the decode worker checks before drafting (JSON bytes).
    draft_hidden: bytes | None = None


@dataclass
class StepOutput:
    """What a decode worker streams back for one sample after each step: the new tokens (and
    their logprobs), the new text and the finish state; its size does not grow with the output.
    A request's samples share one stream; ``sample_index`` says whose output this is."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    #: Why a sample ended in "error" or "abort" (the HTTP edge answers with its exception).
    error_kind: ErrorKind | None = None
    #: Per-request timing breakdown (seconds), set on the first output: prefill_queue,
    #: prefill_compute, transfer, first_decode, ttft.
    timings: dict[str, float] = field(default_factory=dict)
    sample_index: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class StepDeltas:
    """Turns one request's engine deltas (RequestOutputs holding what each step added) into
    StepOutputs, one per sample with something new, numbered from ``first_sample``; counts the
    samples that finished."""

    def __init__(self, request_id: str, first_sample: int = 0) -> None:
        self.request_id = request_id
        self.first_sample = first_sample
        self._done: set[int] = set()

    @property
    def finished_samples(self) -> int:
        return len(self._done)

    def take(self, out: RequestOutput) -> list[StepOutput]:
        steps = []
        for completion in out.outputs:
            i = completion.index
            if i in self._done:
                continue
            failed = completion.finish_reason in ("error", "abort")
            steps.append(StepOutput(
                request_id=self.request_id, new_token_ids=completion.token_ids, new_text=completion.text,
                new_logprobs=completion.logprobs, finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason, num_cached_tokens=out.num_cached_tokens,
                error=out.error if failed else None,
                error_kind=(out.error_kind or (ErrorKind.ABORTED if completion.finish_reason == "abort"
                                               else ErrorKind.INTERNAL)) if failed else None,
                sample_index=self.first_sample + i))
            if completion.finished:
                self._done.add(i)
        return steps


@dataclass
class ReplicaStats:
    """A replica's gauges and counters, pushed for /metrics, routing and autoscaling."""

    role: str
    replica_id: str
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage_perc: float = 0.0
    num_free_blocks: int = 0
    prefix_cache_hit_rate: float = 0.0
    #: 1 when the replica's decode steps replay captured CUDA graphs, 0 when they run eagerly.
    cuda_graphs_captured: float = 0.0
    kv_transfer_bytes_total: int = 0
    kv_transfer_seconds_total: float = 0.0
    kv_transfer_count: int = 0
    kv_transfer_failures_total: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    timestamp: float = field(default_factory=time.time)
