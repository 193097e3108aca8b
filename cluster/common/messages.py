"""Typed messages that cross process boundaries between the ingress, prefill and decode roles.
Plain dataclasses of plain values (picklable, no torch), so every role can import them."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from cluster.common.outputs import PositionLogprobs
from cluster.common.sampling_params import SamplingParams


@dataclass
class GenerateRequest:
    """One sample to generate: validated, tokenized, with its deadline. The ingress splits a
    request with ``n > 1`` into n of these (``sample_index`` 0..n-1, params.n == 1)."""

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
    """Decode -> prefill: compute this sample's prompt and write its KV into my reserved blocks."""

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


@dataclass
class StepOutput:
    """What a decode worker streams back for one sample after each step: the new tokens (and
    their logprobs), the cumulative text and the finish state."""

    request_id: str
    new_token_ids: list[int]
    text: str
    new_logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    #: Error class name for finish_reason "error" (maps to an HTTP status at the edge).
    error_type: str | None = None
    #: Per-request timing breakdown (seconds), set on the first output: prefill_queue,
    #: prefill_compute, transfer, first_decode, ttft.
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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
