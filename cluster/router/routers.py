"""Ray Serve request routers that apply the policies in policy.py. Serve runs a router in every
process that holds a handle to the deployment: the ingress routes decode requests, and each
decode replica routes its prefill requests. Replicas report the statistics these routers read
through ``record_routing_stats``."""
from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from cluster.router.policy import PrefixAffinity, rank_decode, rank_prefill


def _by_id(replicas: list[RunningReplica]) -> dict[str, RunningReplica]:
    return {r.replica_id.unique_id: r for r in replicas}


class DecodeRouter(RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        replicas = _by_id(candidate_replicas)
        stats = {rid: dict(r.routing_stats or {}) for rid, r in replicas.items()}
        return [[replicas[rid] for rid in rank] for rank in rank_decode(stats, list(replicas))]


class PrefillRouter(RequestRouter):
    def initialize_state(self, imbalance: int = 4, **kwargs: Any) -> None:
        self.imbalance = imbalance
        self.affinity = PrefixAffinity()

    def _hashes(self, pending_request: PendingRequest | None) -> list[int]:
        if pending_request is None or not pending_request.args:
            return []
        request = getattr(pending_request.args[0], "request", None)
        return list(getattr(request, "block_hashes", []) or [])

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        replicas = _by_id(candidate_replicas)
        queue = {rid: int((r.routing_stats or {}).get("waiting", 0)) + int((r.routing_stats or {}).get("running", 0))
                 for rid, r in replicas.items()}
        ranks = rank_prefill(queue, list(replicas), self._affinity(), self._hashes(pending_request), self._imbalance())
        return [[replicas[rid] for rid in rank] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._affinity().record(self._hashes(pending_request), replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._affinity().forget(replica_id.unique_id)

    def _affinity(self) -> PrefixAffinity:
        if not hasattr(self, "affinity"):
            self.initialize_state()
        return self.affinity

    def _imbalance(self) -> int:
        return getattr(self, "imbalance", 4)
