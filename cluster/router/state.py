"""ClusterState: one small deployment that collects every prefill and decode replica's latest
statistics and kernel choices, for /metrics, /v1/backends and the planner. Reports older than
``stale_after_s`` (a replica that died) are dropped."""
from __future__ import annotations

import time
from typing import Any

from ray import serve

from cluster.common.messages import ReplicaStats


@serve.deployment(name="ClusterState", num_replicas=1, max_ongoing_requests=1000,
                  ray_actor_options={"num_cpus": 0}, logging_config={"enable_access_log": False})
class ClusterState:
    def __init__(self, stale_after_s: float = 10.0) -> None:
        self.stale_after_s = stale_after_s
        self._stats: dict[str, ReplicaStats] = {}
        self._backends: dict[str, list[dict[str, Any]]] = {}

    def report(self, stats: ReplicaStats, backends: list[dict[str, Any]] | None = None) -> None:
        self._stats[stats.replica_id] = stats
        if backends is not None:
            self._backends[stats.replica_id] = backends

    def snapshot(self) -> list[ReplicaStats]:
        now = time.time()
        for rid in [r for r, s in self._stats.items() if now - s.timestamp > self.stale_after_s]:
            del self._stats[rid]
            self._backends.pop(rid, None)
        return list(self._stats.values())

    def backends(self) -> list[dict[str, Any]]:
        self.snapshot()
        return [dict(entry, replica=rid, role=self._stats[rid].role)
                for rid, entries in self._backends.items() if rid in self._stats for entry in entries]
