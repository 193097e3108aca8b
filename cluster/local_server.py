"""The OpenAI HTTP API over one in-process colocated engine, without Ray: a single-process
server for development, and the baseline that measures what Ray and disaggregation add.

    python -m cluster.local_server --model smollm2 --port 8001

A composition root like cluster.application: the HTTP layer (cluster.api) knows no engine, and
the engine is driven through its EnginePort only.
"""
from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from typing import Any

from cluster.api.server import build_openai_app
from cluster.common.errors import OverloadedError
from cluster.common.messages import GenerateRequest, ReplicaStats, StepDeltas, StepOutput
from cluster.common.reporting import queue_time
from cluster.common.reporting import replica_stats as build_replica_stats
from cluster.config import ClusterConfig, parse_cluster_args
from cluster.engine.engine import LLMEngine
from cluster.engine.port import EnginePort
from cluster.engine.stalls import freeze_heap
from cluster.kv_transfer.base import TransferStats
from cluster.models.registry import served_name


class LocalEngineClient:
    """EngineClient over an engine in this process (prefill and decode in one engine)."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.engine = EnginePort(LLMEngine(config.model, config.cache, config.scheduler))
        info = self.engine.info
        if info.tokenizer is None:
            raise RuntimeError("the HTTP API needs a model with a tokenizer")
        self.tokenizer = info.tokenizer
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.model_name = config.served_model_name or served_name(config.model.model)
        self._inflight = 0

    async def generate(self, request: GenerateRequest) -> AsyncIterator[StepOutput]:
        if self._inflight >= self.config.max_inflight_requests:
            raise OverloadedError(f"{self._inflight} requests in flight; try again later")
        self._inflight += 1
        rid = request.request_id
        try:
            group = await self.engine.make_group(rid, request.prompt_token_ids, request.sampling_params,
                                                 sample_index=request.sample_index)
            deltas = StepDeltas(rid, request.sample_index)
            timed = False
            async for out in self.engine.generate(group):
                for step in deltas.take(out):
                    if not timed and step.new_token_ids and step.sample_index == request.sample_index:
                        timed = True
                        queued = queue_time(group)
                        step.timings = {} if queued is None else {"queue": queued}
                    yield step
        finally:
            self._inflight -= 1

    async def health(self) -> None:
        if self.engine.dead is not None:
            raise RuntimeError(f"engine loop stopped: {self.engine.dead}")

    async def replica_stats(self) -> list[ReplicaStats]:
        stats = await self.engine.stats()
        # one engine, no KV transfer: its transfer counters are zero
        return [build_replica_stats("colocated", "local", stats.gauges, TransferStats(), stats.counters)]

    async def backends(self) -> list[dict[str, Any]]:
        return [dict(b, role="colocated", replica="local") for b in self.engine.backends()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("settings", nargs="*", help="key=value settings of cluster/config.py")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    args = parser.parse_args(argv)
    settings = dict(s.split("=", 1) for s in args.settings)
    settings.setdefault("model", args.model)
    config = parse_cluster_args(settings)
    client = LocalEngineClient(config)
    app = build_openai_app(client, max_body_bytes=config.max_body_bytes, served_model_name=client.model_name,
                           request_timeout_s=config.request_timeout_s, block_size=config.cache.block_size,
                           model_aliases=() if config.served_model_name else (config.model.model,),
                           api_keys=config.api_key, cors_allow_origins=config.cors_allow_origins)
    freeze_heap()
    import uvicorn
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
