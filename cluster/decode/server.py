"""DecodeServer: the decode role as a Ray Serve deployment. The ingress streams ``generate``;
the replica calls the PrefillServer deployment for remote prefills (its router picks the prefill
replica), reports free KV blocks and load to routers, and statistics to ClusterState."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from cluster.common.messages import GenerateRequest, PrefillRequest, PrefillResult, ReplicaStats, StepOutput
from cluster.config import ClusterConfig
from cluster.decode.worker import DecodeWorker

logger = logging.getLogger(__name__)
REPORT_PERIOD_S = 0.5


@serve.deployment(name="DecodeServer", max_ongoing_requests=1024)
class DecodeServer:
    async def __init__(self, config: ClusterConfig, prefill: Any = None, state: Any = None) -> None:
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.prefill = prefill if config.prefill_replicas > 0 else None
        ctx = ray.get_runtime_context()
        self.worker = DecodeWorker(
            config, engine_id=f"decode-{self.replica_id}",
            prefill_fn=self._call_prefill if self.prefill is not None else None,
            node_id=ctx.get_node_id(), transfer_options=_transfer_options(config))
        self.state = state
        self._reporter = asyncio.get_running_loop().create_task(self._report_forever())

    async def _call_prefill(self, request: PrefillRequest) -> PrefillResult:
        assert self.prefill is not None
        response = self.prefill.prefill.remote(request)
        try:
            return await response
        except asyncio.CancelledError:
            response.cancel()
            raise

    async def generate(self, request: GenerateRequest) -> AsyncIterator[StepOutput]:
        async for out in self.worker.generate(request):
            yield out

    async def info(self) -> dict[str, Any]:
        engine = self.worker.engine.engine
        return {"max_model_len": self.worker.max_model_len, "vocab_size": engine.vocab_size}

    async def stats(self) -> ReplicaStats:
        return await self.worker.stats(self.replica_id)

    async def record_routing_stats(self) -> dict[str, Any]:
        s = await self.stats()
        return {"waiting": s.num_requests_waiting, "running": s.num_requests_running,
                "free_blocks": s.num_free_blocks}

    async def check_health(self) -> None:
        if self.worker.engine.dead is not None:
            raise RuntimeError(f"engine loop stopped: {self.worker.engine.dead}")

    async def _report_forever(self) -> None:
        while self.state is not None:
            try:
                await self.state.report.remote(await self.stats(), self.worker.engine.engine.backends())
            except Exception:  # noqa: BLE001 - metrics must never take the replica down
                logger.debug("stats report failed", exc_info=True)
            await asyncio.sleep(REPORT_PERIOD_S)

    def __del__(self) -> None:
        worker = getattr(self, "worker", None)
        if worker is not None:
            worker.shutdown()


def _transfer_options(config: ClusterConfig) -> dict[str, Any]:
    if config.transfer.backend == "nccl":
        return {"host": ray.util.get_node_ip_address(), "timeout_s": config.transfer.timeout_s}
    return {}
