"""What every serving replica reports, shared by the prefill and decode roles (which never import
each other): its ReplicaStats built from engine metrics and transfer counters, the routing stats
Serve's routers read, and the loop that pushes reports to the ClusterState deployment."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from cluster.common.messages import ReplicaStats

logger = logging.getLogger(__name__)
REPORT_PERIOD_S = 0.5
#: An unchanged report is sent again after this long (ClusterState forgets a replica after 10 s).
HEARTBEAT_S = 2.0
#: A report not answered in this long is abandoned (the next one is sent on schedule).
_REPORT_TIMEOUT_S = 5.0


def arrival_rate_cv2(times: list[float], now: float, span: float, bin_s: float = 1.0, min_bins: int = 5) -> float:
    """How bursty arrivals are: the squared coefficient of variation of the arrival rate, beyond a
    Poisson process's own noise, from counts in ``bin_s`` bins over the last ``span`` seconds:
    (variance - mean) / mean^2 of the counts, at least 0. Poisson arrivals give about 0; on/off
    arrivals at r x the mean rate for 1/r of the time give r - 1, at any rate, and the same for a
    random share of them (a replica's share of a cluster's arrivals). 0 with fewer than
    ``min_bins`` bins or no arrivals."""
    bins = int(span // bin_s)
    if bins < min_bins:
        return 0.0
    counts = [0] * bins
    for t in times:
        k = int((now - t) // bin_s)
        if 0 <= k < bins:
            counts[k] += 1
    mean = sum(counts) / bins
    if mean <= 0:
        return 0.0
    var = sum((c - mean) ** 2 for c in counts) / bins
    return max(0.0, (var - mean) / mean**2)


def replica_stats(role: str, replica_id: str, metrics: dict[str, float], transfer: Any,
                  extra: dict[str, Any] | None = None) -> ReplicaStats:
    """``metrics``: LLMEngine.metrics() (gauges beyond ReplicaStats' own fields, such as
    ``draft_head_graphs_captured``, go to ``extra``); ``transfer``: a backend's TransferStats."""
    own = {f.name for f in dataclasses.fields(ReplicaStats)}
    extra = {**{k: v for k, v in metrics.items() if k not in own}, **(extra or {})}
    return ReplicaStats(
        role=role, replica_id=replica_id,
        num_requests_running=int(metrics["num_requests_running"]),
        num_requests_waiting=int(metrics["num_requests_waiting"]),
        kv_cache_usage_perc=metrics["kv_cache_usage_perc"],
        num_free_blocks=int(metrics["num_free_blocks"]),
        prefix_cache_hit_rate=metrics["prefix_cache_hit_rate"],
        cuda_graphs_captured=metrics["cuda_graphs_captured"],
        kv_transfer_bytes_total=transfer.bytes_total, kv_transfer_seconds_total=transfer.seconds_total,
        kv_transfer_count=transfer.count, kv_transfer_failures_total=transfer.failures_total,
        extra=extra)


def queue_time(group: Any) -> float | None:
    """Seconds from an engine request group's arrival to the first step that computed its first
    sample's prompt on this engine (None before that)."""
    first = group.samples[0]
    return None if first.first_scheduled_time is None else max(0.0, first.first_scheduled_time - first.arrival_time)


def routing_stats(stats: ReplicaStats) -> dict[str, Any]:
    """What the request routers (cluster.router.routers) rank replicas by."""
    return {"waiting": stats.num_requests_waiting, "running": stats.num_requests_running,
            "free_blocks": stats.num_free_blocks}


async def report_forever(state: Any, stats: Callable[[], Awaitable[ReplicaStats]],
                         backends: Callable[[], list[dict[str, Any]]], period_s: float = REPORT_PERIOD_S,
                         heartbeat_s: float = HEARTBEAT_S) -> None:
    """Push this replica's stats and kernel table to ClusterState every ``period_s`` while they
    change, and at least every ``heartbeat_s`` (an idle replica costs next to no CPU; ClusterState
    drops replicas silent for longer), for ever."""
    failing = False
    last: tuple[ReplicaStats | None, float] = (None, -math.inf)
    while state is not None:
        try:
            last = await asyncio.wait_for(_report_once(state, stats, backends, last, heartbeat_s),
                                          timeout=_REPORT_TIMEOUT_S)
            failing = False
        except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - metrics must never take the replica down
            task = asyncio.current_task()
            if isinstance(exc, asyncio.CancelledError) and task is not None and task.cancelling():
                raise  # this loop itself is being stopped
            if not failing:  # once per streak, so a dead engine or state replica shows in the log
                logger.warning("stats report failed: %r", exc)
            failing = True
        await asyncio.sleep(period_s)


async def _report_once(state: Any, stats: Callable[[], Awaitable[ReplicaStats]],
                       backends: Callable[[], list[dict[str, Any]]], last: tuple[ReplicaStats | None, float],
                       heartbeat_s: float) -> tuple[ReplicaStats | None, float]:
    """Sends the stats unless they equal the last ones sent (timestamps aside) and a heartbeat is
    not yet due; returns what was last sent and when."""
    current, now = await stats(), time.monotonic()
    previous, sent_at = last
    if now - sent_at < heartbeat_s and _unchanged(current, previous):
        return last
    await state.report.remote(current, backends())
    return current, now


def _unchanged(current: ReplicaStats, previous: ReplicaStats | None) -> bool:
    if previous is None:
        return False
    if isinstance(current, ReplicaStats) and isinstance(previous, ReplicaStats):
        current = dataclasses.replace(current, timestamp=previous.timestamp)
    return bool(current == previous)
