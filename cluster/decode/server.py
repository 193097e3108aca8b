"""DecodeServer: the decode role as a Ray Serve deployment. The ingress streams ``generate``;
the replica calls the PrefillServer deployment for remote prefills (its router picks the prefill
replica), reports free KV blocks and load to routers, and statistics to ClusterState."""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from cluster.common.messages import GenerateRequest, PrefillRequest, PrefillResult, ReplicaStats, StepOutput
from cluster.common.reporting import arrival_rate_cv2, report_forever, routing_stats
from cluster.common.serve_routing import own_routing_id
from cluster.config import ClusterConfig
from cluster.decode.worker import DecodeWorker
from cluster.engine.stalls import freeze_heap

logger = logging.getLogger(__name__)
#: Seconds of per-request latencies behind the p90s reported to the planner.
LATENCY_WINDOW_S = 30.0


@serve.deployment(name="DecodeServer", max_ongoing_requests=1024)
class DecodeServer:
    async def __init__(self, config: ClusterConfig, prefill: Any = None, state: Any = None,
                       local_prefill_factory: Any = None) -> None:
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.prefill = prefill if config.prefill_replicas > 0 else None
        self.local_prefill: Any = None
        prefill_fn = self._call_prefill if self.prefill is not None else None
        if local_prefill_factory is not None:
            # kv_transfer=local: a prefill engine in this process (built by the application, since
            # decode never imports prefill); KV moves by local copies.
            self.local_prefill = local_prefill_factory(config, engine_id=f"prefill-of-{self.replica_id}")
            prefill_fn = self.local_prefill.prefill
        self.worker = DecodeWorker(
            config, engine_id=f"decode-{self.replica_id}", prefill_fn=prefill_fn,
            node_id=ray.get_runtime_context().get_node_id(), transfer_options=_transfer_options(config))
        freeze_heap()  # the process lives for its engine: what start-up built stays out of full collections
        self.state = state
        self.ttft, self.itl, self.prefill_queue = LatencyWindow(), LatencyWindow(), LatencyWindow()
        self.demand = DemandWindow()
        self._reporter = asyncio.get_running_loop().create_task(
            report_forever(state, self.stats, self.worker.engine.backends))

    async def _call_prefill(self, request: PrefillRequest) -> PrefillResult:
        assert self.prefill is not None
        own_routing_id()  # each prefill call is routed on its own, whatever request it is made under
        response = self.prefill.prefill.remote(request)
        try:
            return await response
        except asyncio.CancelledError:
            response.cancel()
            raise

    async def generate(self, request: GenerateRequest) -> AsyncIterator[StepOutput]:
        last_token: dict[int, float] = {}  # per sample
        self.demand.arrive(len(request.prompt_token_ids))
        generated = 0
        async for out in self.worker.generate(request):
            if out.new_token_ids:
                last_token[out.sample_index] = self._observe_latency(request, out, last_token.get(out.sample_index))
                generated += len(out.new_token_ids)
            yield out
        self.demand.complete(generated)

    def _observe_latency(self, request: GenerateRequest, out: StepOutput, last_token: float | None) -> float:
        """TTFT from the ingress's arrival time, the gap since the previous output (ITL, one per
        step as /metrics counts it) and prefill queue time, for the planner."""
        now = time.time()
        if last_token is None:
            self.ttft.add(max(0.0, now - request.arrival_time))
            if "prefill_queue" in out.timings:
                self.prefill_queue.add(out.timings["prefill_queue"])
        else:
            self.itl.add(now - last_token)
        return now

    async def info(self) -> dict[str, Any]:
        return {"max_model_len": self.worker.max_model_len, "vocab_size": self.worker.engine.info.vocab_size}

    async def stats(self) -> ReplicaStats:
        s = await self.worker.stats(self.replica_id)
        s.extra.update(ttft_p90_seconds=self.ttft.p90(), itl_p90_seconds=self.itl.p90(),
                       prefill_queue_p90_seconds=self.prefill_queue.p90(), **self.demand.summary())
        return s

    async def record_routing_stats(self) -> dict[str, Any]:
        return routing_stats(await self.stats())

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Load and recent latencies for the planner (cluster.router.planner), when autoscaling."""
        s = await self.stats()
        return {"num_requests_waiting": float(s.num_requests_waiting),
                "kv_cache_usage_perc": float(s.kv_cache_usage_perc),
                **{key: float(s.extra[key])
                   for key in ("ttft_p90_seconds", "itl_p90_seconds", "prefill_queue_p90_seconds",
                               *DemandWindow.KEYS)}}

    async def check_health(self) -> None:
        if self.worker.engine.dead is not None:
            raise RuntimeError(f"engine loop stopped: {self.worker.engine.dead}")

    def __del__(self) -> None:
        for worker in (getattr(self, "worker", None), getattr(self, "local_prefill", None)):
            if worker is not None:
                worker.shutdown()


def _transfer_options(config: ClusterConfig) -> dict[str, Any]:
    if config.transfer.backend == "nccl":
        return {"host": ray.util.get_node_ip_address(), "timeout_s": config.transfer.timeout_s}
    if config.transfer.backend == "auto":
        return {"remote_peers": OtherNodes()}
    return {}


class OtherNodes:
    """Whether the Ray cluster has an alive node besides this one (``auto`` starts NIXL only then),
    asked of Ray at most every ``period_s``."""

    def __init__(self, period_s: float = 10.0) -> None:
        self.period_s = period_s
        self._checked = -math.inf
        self._answer = False

    def __call__(self) -> bool:
        now = time.monotonic()
        if now - self._checked >= self.period_s:
            here = ray.get_runtime_context().get_node_id()
            self._answer = any(n["Alive"] and n["NodeID"] != here for n in ray.nodes())
            self._checked = now
        return self._answer


class LatencyWindow:
    """Recent samples of one value (a latency in seconds; DemandWindow's token counts): those of
    the last ``window_s`` (at most ``max_samples``), summarized as a p90 for the planner and /metrics."""

    def __init__(self, window_s: float = LATENCY_WINDOW_S, max_samples: int = 2048) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def add(self, seconds: float, now: float | None = None) -> None:
        self._samples.append((time.monotonic() if now is None else now, seconds))

    def recent(self, now: float | None = None) -> deque[tuple[float, float]]:
        """The window's ``(time, value)`` samples, oldest first (older ones dropped)."""
        now = time.monotonic() if now is None else now
        while self._samples and now - self._samples[0][0] > self.window_s:
            self._samples.popleft()
        return self._samples

    def p90(self, now: float | None = None) -> float:
        """The 90th percentile (nearest rank) of the window's samples; 0.0 when there are none."""
        values = sorted(v for _, v in self.recent(now))
        return values[math.ceil(0.9 * len(values)) - 1] if values else 0.0


class DemandWindow:
    """What arrived at this replica over the last ``window_s``: the arrival rate, the mean prompt
    tokens of those requests, and the mean output tokens (every sample's) of the requests that
    completed in the window (an output's length is known only at its end), and how bursty the
    arrivals are (``arrival_rate_cv2``: the rate's squared coefficient of variation over 1 s bins,
    beyond Poisson noise). The planner sums the rates over the decode replicas (every request is
    decoded by exactly one) for its predictive sizing (DistServe's and Dynamo's inputs)."""

    KEYS = ("arrival_rps", "prompt_tokens_mean", "output_tokens_mean", "arrival_rate_cv2")

    def __init__(self, window_s: float = LATENCY_WINDOW_S, max_samples: int = 8192, now: float | None = None) -> None:
        self.window_s = window_s
        self.started = time.monotonic() if now is None else now
        self.arrivals = LatencyWindow(window_s, max_samples)  # prompt tokens per arrival
        self.completions = LatencyWindow(window_s, max_samples)  # output tokens per completion

    def arrive(self, prompt_tokens: int, now: float | None = None) -> None:
        self.arrivals.add(prompt_tokens, now)

    def complete(self, output_tokens: int, now: float | None = None) -> None:
        self.completions.add(output_tokens, now)

    def summary(self, now: float | None = None) -> dict[str, float]:
        now = time.monotonic() if now is None else now
        arrivals, done = self.arrivals.recent(now), self.completions.recent(now)
        # over the window, or the replica's life if shorter, or the span kept if the deque is full
        span = min(self.window_s, now - self.started)
        if arrivals and len(arrivals) == arrivals.maxlen:
            span = min(span, now - arrivals[0][0])
        return {"arrival_rps": len(arrivals) / span if span > 0 else 0.0,
                "prompt_tokens_mean": sum(n for _, n in arrivals) / len(arrivals) if arrivals else 0.0,
                "output_tokens_mean": sum(n for _, n in done) / len(done) if done else 0.0,
                "arrival_rate_cv2": arrival_rate_cv2([t for t, _ in arrivals], now, span)}
