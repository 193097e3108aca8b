"""PrefillServer: the prefill role as a Ray Serve deployment (one engine per replica). Decode
replicas call ``prefill``; the replica reports its queue to routers and its statistics to the
ClusterState deployment."""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray
from ray import serve

from cluster.common.messages import PrefillRequest, PrefillResult, ReplicaStats
from cluster.common.reporting import report_forever, routing_stats
from cluster.config import ClusterConfig
from cluster.engine.stalls import freeze_heap
from cluster.prefill.worker import PrefillWorker

logger = logging.getLogger(__name__)


@serve.deployment(name="PrefillServer", max_ongoing_requests=512)
class PrefillServer:
    async def __init__(self, config: ClusterConfig, state: Any = None) -> None:
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        node_id = ray.get_runtime_context().get_node_id()
        self.worker = PrefillWorker(config, engine_id=f"prefill-{self.replica_id}", node_id=node_id)
        freeze_heap()  # the process lives for its engine: what start-up built stays out of full collections
        self.state = state
        self._reporter = asyncio.get_running_loop().create_task(
            report_forever(state, self.stats, self.worker.engine.backends))

    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        return await self.worker.prefill(request)

    async def stats(self) -> ReplicaStats:
        return await self.worker.stats(self.replica_id)

    async def record_routing_stats(self) -> dict[str, Any]:
        return routing_stats(await self.stats())

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Load for the planner (cluster.router.planner), when the deployment autoscales."""
        s = await self.stats()
        return {"num_requests_waiting": float(s.num_requests_waiting),
                "kv_cache_usage_perc": float(s.kv_cache_usage_perc)}

    def inject_transfer_failures(self, count: int) -> None:
        """Test hook: fail the next ``count`` KV writes of this replica."""
        self.worker.backend.inject_failures = count

    async def check_health(self) -> None:
        if self.worker.engine.dead is not None:
            raise RuntimeError(f"engine loop stopped: {self.worker.engine.dead}")

    def __del__(self) -> None:
        worker = getattr(self, "worker", None)
        if worker is not None:
            worker.shutdown()
