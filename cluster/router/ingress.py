"""Ingress: the HTTP entry (the OpenAI app from cluster.api) as a Ray Serve deployment. It is the
EngineClient behind that app: it bounds requests in flight, decides per prompt whether the
decode replica prefills it itself (prompts under ``local_prefill_threshold`` tokens, no prefill
replicas, or every prefill replica's queue at ``local_prefill_queue_threshold`` in its cluster
view: ``prefill_locally``), attaches the prompt's block hashes for prefix-cache affinity, and streams the
decode replica (chosen by DecodeRouter: most free KV blocks, least load). A decode replica that
is full answers before any output and the request is retried on another."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError

from cluster.api.server import build_openai_app
from cluster.common.block_hash import hash_token_blocks
from cluster.common.errors import EngineDeadError, OverloadedError, ReplicaDiedError
from cluster.common.messages import GenerateRequest, ReplicaStats, StepOutput
from cluster.common.serve_routing import own_routing_id
from cluster.config import ClusterConfig
from cluster.models.registry import load_tokenizer, served_name
from cluster.models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
#: Leading prompt blocks hashed for prefix affinity.
AFFINITY_BLOCKS = 64
DECODE_RETRIES = 3
#: The cluster view (ClusterState's replica reports) is refreshed this often, each try bounded.
SNAPSHOT_PERIOD_S, SNAPSHOT_TIMEOUT_S = 1.0, 5.0
#: /health answers 503 once no decode replica has reported for this long (ClusterState drops a
#: replica 10 s after its last report).
DECODE_SILENT_S = 15.0


def prefill_locally(prompt_tokens: int, config: ClusterConfig, snapshot: list[ReplicaStats]) -> bool:
    """Whether the decode replica prefills this prompt itself (conditional disaggregation): no
    prefill replicas, a prompt under ``local_prefill_threshold`` tokens, or a saturated prefill
    pool, as Dynamo's router decides: every prefill replica in the cluster view (ClusterState's
    reports, refreshed every ``SNAPSHOT_PERIOD_S``) has ``local_prefill_queue_threshold`` or more
    requests waiting. With no prefill report in the view the pool counts as not saturated."""
    transfer = config.transfer
    if config.prefill_replicas == 0 or prompt_tokens < transfer.local_prefill_threshold:
        return True
    limit = transfer.local_prefill_queue_threshold
    if limit <= 0:
        return False
    waiting = [s.num_requests_waiting for s in snapshot if s.role == "prefill"]
    return bool(waiting) and min(waiting) >= limit


@serve.deployment(name="Ingress", max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0})
@serve.ingress()
class Ingress:
    async def __init__(self, config: ClusterConfig, decode: Any, state: Any = None) -> None:
        self.config = config
        self.decode = decode
        self.state = state
        tokenizer, _ = load_tokenizer(config.model.model)
        if tokenizer is None:
            raise RuntimeError(f"model {config.model.model!r} has no tokenizer; the HTTP API needs one")
        self.tokenizer: Tokenizer = tokenizer
        info = await decode.info.remote()
        self.max_model_len = int(info["max_model_len"])
        self.vocab_size = int(info["vocab_size"])
        self.model_name = config.served_model_name or served_name(config.model.model)
        self._inflight = 0
        self._snapshot: list[ReplicaStats] = []
        self._started = time.monotonic()
        self._refresher = (asyncio.get_running_loop().create_task(self._refresh_forever())
                           if state is not None else None)

    def __serve_build_asgi_app__(self) -> Any:
        return build_openai_app(self, max_body_bytes=self.config.max_body_bytes,
                                served_model_name=self.model_name,
                                request_timeout_s=self.config.request_timeout_s,
                                block_size=self.config.cache.block_size,
                                model_aliases=() if self.config.served_model_name else (self.config.model.model,),
                                api_keys=self.config.api_key, cors_allow_origins=self.config.cors_allow_origins)

    # --- EngineClient ----------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[StepOutput]:
        if self._inflight >= self.config.max_inflight_requests:
            raise OverloadedError(f"{self._inflight} requests in flight; try again later")
        self._inflight += 1
        try:
            own_routing_id()  # one HTTP request makes a decode call per prompt: each is routed on its own
            self._route(request)
            for attempt in range(DECODE_RETRIES):
                started = False
                response = self.decode.options(stream=True).generate.remote(request)
                try:
                    async for out in response:
                        started = True
                        yield out
                    return
                except OverloadedError:
                    if started or attempt == DECODE_RETRIES - 1:
                        raise
                    await asyncio.sleep(0.05 * (attempt + 1))
                except (RayActorError, ActorUnavailableError) as exc:
                    # The decode replica died. Before any output the request starts again on
                    # another replica (Serve routes around the dead one); after, the client gets
                    # a retryable error naming what failed.
                    logger.warning("decode replica died serving %s: %r", request.request_id, exc)
                    if started or attempt == DECODE_RETRIES - 1:
                        raise ReplicaDiedError(
                            f"the decode replica serving this request died ({type(exc).__name__}); the "
                            "service goes on with the other replicas: retry the request",
                            code="decode_replica_died") from None
                    await asyncio.sleep(0.5 * (attempt + 1))
                finally:
                    response.cancel()
        finally:
            self._inflight -= 1

    def _route(self, request: GenerateRequest) -> None:
        request.local_prefill = prefill_locally(len(request.prompt_token_ids), self.config, self._snapshot)
        if not request.block_hashes:
            bs = self.config.cache.block_size
            request.block_hashes = hash_token_blocks(request.prompt_token_ids[: AFFINITY_BLOCKS * bs], bs)

    async def check_health(self) -> None:
        """Serve's health check of this replica: its own state only. It never waits on another
        deployment, so a busy decode replica cannot get the HTTP front end restarted."""
        if self._refresher is not None and self._refresher.done() and not self._refresher.cancelled():
            raise RuntimeError(f"the ingress's cluster view stopped: {self._refresher.exception()!r}")

    async def health(self) -> None:
        """GET /health, from the cluster view this replica keeps (refreshed in the background and
        by /metrics): unavailable while no decode replica has reported for ``DECODE_SILENT_S``."""
        if self.state is None:
            return
        decode = [s for s in self._snapshot if s.role == "decode"]
        if not decode and time.monotonic() - self._started > DECODE_SILENT_S:
            raise EngineDeadError(f"no decode replica has reported in the last {DECODE_SILENT_S:.0f} s")

    async def replica_stats(self) -> list[ReplicaStats]:
        """For /metrics: ClusterState's latest reports (the last view if it does not answer in time)."""
        if self.state is not None:
            await self._refresh()
        return list(self._snapshot)

    async def _refresh(self) -> None:
        """Take ClusterState's latest replica reports as this replica's cluster view (kept as it
        was if ClusterState does not answer within ``SNAPSHOT_TIMEOUT_S``)."""
        try:
            self._snapshot = list(await asyncio.wait_for(self.state.snapshot.remote(), SNAPSHOT_TIMEOUT_S))
        except (Exception, asyncio.TimeoutError) as exc:  # noqa: BLE001 - keep the last view
            logger.debug("cluster snapshot failed: %r", exc)

    async def _refresh_forever(self) -> None:
        """Keep the cluster view fresh for /health, every ``SNAPSHOT_PERIOD_S``."""
        while True:
            await self._refresh()
            await asyncio.sleep(SNAPSHOT_PERIOD_S)

    async def backends(self) -> list[dict[str, Any]]:
        if self.state is None:
            return []
        return list(await self.state.backends.remote())

