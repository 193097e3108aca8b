"""Prometheus metrics of the OpenAI front end, in an own CollectorRegistry (never the process-global
one, so several apps in one process do not collide), with vLLM-style ``cluster:`` names.

Every metric carries the label ``model_name`` (the served name, as vLLM's do). Measured here, per
sample (a request with ``n=2`` counts twice):
- histograms ``cluster:time_to_first_token_seconds`` (arrival to the first output carrying a
  token), ``cluster:inter_token_latency_seconds`` (each gap between two outputs carrying tokens:
  one per engine step, as vLLM v1 counts it), ``cluster:e2e_request_latency_seconds``;
- the TTFT breakdown from ``StepOutput.timings``: ``cluster:ttft_prefill_queue_seconds``,
  ``cluster:ttft_prefill_compute_seconds``, ``cluster:ttft_kv_transfer_seconds``,
  ``cluster:ttft_first_decode_seconds``, and ``cluster:request_queue_time_seconds`` (arrival to
  the first step that computes the prompt, on whichever worker prefills it; a request's first
  sample);
- counters ``cluster:request_finished_total{finished_reason}`` (stop, length, abort, error),
  ``cluster:prompt_tokens_total``, ``cluster:generation_tokens_total`` and
  ``cluster:http_requests_total{route,status}``.

Rendered at scrape time from ``EngineClient.replica_stats()``, labelled ``role`` and ``replica``:
gauges ``cluster:num_requests_running``, ``cluster:num_requests_waiting``,
``cluster:kv_cache_usage_perc`` (a fraction in [0, 1], as vLLM's), ``cluster:prefix_cache_hit_rate``,
``cluster:kv_cache_free_blocks``, ``cluster:cuda_graphs_captured`` (1 or 0); counters ``cluster:kv_transfer_bytes_total`` and
``cluster:kv_transfer_failures_total``; and ``cluster:kv_transfer_seconds`` as a summary without
quantiles, i.e. the pair ``cluster:kv_transfer_seconds_sum`` (seconds spent moving KV) and
``cluster:kv_transfer_seconds_count`` (transfers), so ``rate(_sum) / rate(_count)`` is the mean
transfer time. Numeric entries of ``ReplicaStats.extra`` whose key is a valid metric name become
gauges ``cluster:<key>`` (e.g. ``spec_accept_len``), or counters where the key ends in ``_total``
(``cluster:num_preemptions_total``, ``cluster:forked_samples_total``, ``cluster:prefill_requests_total``,
``cluster:remote_prefill_failures_total``, ``cluster:local_prefills_total``: prompts the ingress
sent to a decode replica to prefill itself), so roles can add them without touching this file.
"""
from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily

from cluster.common.messages import ReplicaStats, StepOutput

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)
#: StepOutput.timings key -> (histogram name, help): the TTFT breakdown, and the queue time.
TTFT_PARTS = {
    "prefill_queue": ("cluster:ttft_prefill_queue_seconds", "TTFT breakdown: prefill_queue."),
    "prefill_compute": ("cluster:ttft_prefill_compute_seconds", "TTFT breakdown: prefill_compute."),
    "transfer": ("cluster:ttft_kv_transfer_seconds", "TTFT breakdown: transfer."),
    "first_decode": ("cluster:ttft_first_decode_seconds", "TTFT breakdown: first_decode."),
    "queue": ("cluster:request_queue_time_seconds", "Arrival to the first step computing the prompt."),
}
#: ReplicaStats field -> (metric name, help) rendered as a gauge.
_REPLICA_GAUGES = {
    "num_requests_running": ("cluster:num_requests_running", "Requests in the replica's running batch."),
    "num_requests_waiting": ("cluster:num_requests_waiting", "Requests waiting in the replica's queue."),
    "kv_cache_usage_perc": ("cluster:kv_cache_usage_perc", "Fraction of KV blocks in use (0 to 1)."),
    "prefix_cache_hit_rate": ("cluster:prefix_cache_hit_rate", "Prefix cache hit rate (0 to 1)."),
    "num_free_blocks": ("cluster:kv_cache_free_blocks", "Free KV blocks."),
    "cuda_graphs_captured": ("cluster:cuda_graphs_captured", "1 when decode steps replay captured CUDA graphs, "
                             "0 when they run eagerly (see /v1/backends, component cuda_graphs, for why)."),
}
_METRIC_KEY = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_LABELS = ["model_name", "role", "replica"]


class ReplicaStatsCollector:
    """Renders the replicas' latest stats (set just before each scrape) as metric families."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: list[ReplicaStats] = []

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        for field_name, (name, doc) in _REPLICA_GAUGES.items():
            gauge = GaugeMetricFamily(name, doc, labels=_LABELS)
            for s in stats:
                gauge.add_metric([self.model_name, s.role, s.replica_id], float(getattr(s, field_name)))
            yield gauge
        transferred = CounterMetricFamily("cluster:kv_transfer_bytes", "KV bytes moved between prefill "
                                          "and decode.", labels=_LABELS)
        failures = CounterMetricFamily("cluster:kv_transfer_failures", "Failed KV transfers.", labels=_LABELS)
        seconds = SummaryMetricFamily("cluster:kv_transfer_seconds", "Time spent moving KV blocks "
                                      "(_sum: seconds, _count: transfers).", labels=_LABELS)
        for s in stats:
            labels = [self.model_name, s.role, s.replica_id]
            transferred.add_metric(labels, float(s.kv_transfer_bytes_total))
            failures.add_metric(labels, float(s.kv_transfer_failures_total))
            seconds.add_metric(labels, count_value=s.kv_transfer_count, sum_value=s.kv_transfer_seconds_total)
        yield from (transferred, failures, seconds)
        yield from self._extra_gauges(stats)

    def _extra_gauges(self, stats: list[ReplicaStats]) -> Iterator[Metric]:
        """Numeric extras as gauges, or as counters where the key ends in ``_total`` (a count that
        only grows, such as ``remote_prefill_failures_total``)."""
        reserved = {name.split(":", 1)[1] for name, _ in _REPLICA_GAUGES.values()} | set(_REPLICA_GAUGES)
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for s in stats:
            for key, value in s.extra.items():
                if (not _METRIC_KEY.match(key) or key in reserved or isinstance(value, bool)
                        or not isinstance(value, (int, float))):
                    continue
                family = families.get(key)
                if family is None:
                    if key.endswith("_total"):
                        family = CounterMetricFamily(f"cluster:{key.removesuffix('_total')}",
                                                     f"Replica counter {key}.", labels=_LABELS)
                    else:
                        family = GaugeMetricFamily(f"cluster:{key}", f"Replica gauge {key}.", labels=_LABELS)
                    families[key] = family
                family.add_metric([self.model_name, s.role, s.replica_id], float(value))
        yield from families.values()


class SampleTimer:
    """Observes one sample's outputs as they arrive: TTFT, its breakdown, ITL, e2e, tokens; and
    keeps them for the sample's ``timings`` (a request's ``return_timings``)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self._start = time.monotonic()
        self._first_token: float | None = None
        self._last_token: float | None = None
        self._end: float | None = None
        self._parts: dict[str, float] = {}
        self._done = False

    def on_output(self, out: StepOutput) -> None:
        now = time.monotonic()
        m = self._metrics
        if out.new_token_ids:
            if self._last_token is None:
                self._first_token = now
                m.ttft.observe(now - self._start)
                for key, histogram in m.ttft_parts.items():
                    if key in out.timings:
                        histogram.observe(max(0.0, out.timings[key]))
                self._parts = dict(out.timings)  # clamped where read (timings)
            else:
                m.itl.observe(now - self._last_token)
            self._last_token = now
            m.generation_tokens.inc(len(out.new_token_ids))
        if out.finished:
            reason = out.finish_reason or "error"
            self.finish("error" if out.error and reason not in ("abort", "error") else reason)

    def finish(self, reason: str) -> None:
        if self._done:
            return
        self._done = True
        self._end = time.monotonic()
        self._metrics.e2e.observe(self._end - self._start)
        self._metrics.finished.labels(model_name=self._metrics.model_name, finished_reason=reason).inc()

    def timings(self, received: float) -> dict[str, float]:
        """Where the sample's time went, in seconds, for a request received at ``received``
        (``time.monotonic()``): ``prepare`` (tokenising, templating, checks: received until its
        samples were sent), ``ttft`` and ``e2e`` (received until the first token, the last output,
        here at the front end); and as the workers reported them with the first token:
        ``queue`` (until the first engine step computing the prompt: from the front end's
        hand-off where the decode worker prefills it, from the prefill worker's intake where a
        prefill worker does, then equal to ``prefill_queue``), ``prefill_queue``,
        ``prefill_compute``, ``transfer`` and ``first_decode`` (a prompt a prefill worker
        computed), ``worker_ttft`` (the decode worker's own, from when it took the sample).
        Samples after a prompt's first carry only ``worker_ttft`` of those."""
        out = {"prepare": self._start - received}
        if self._first_token is not None:
            out["ttft"] = self._first_token - received
        if self._end is not None:
            out["e2e"] = self._end - received
        for key, value in self._parts.items():
            out["worker_ttft" if key == "ttft" else key] = value
        return {key: round(max(0.0, value), 6) for key, value in out.items()}


class ServerMetrics:
    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, model = self.registry, ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, model, buckets=buckets, registry=r).labels(model_name=model_name)
        self.ttft = histogram("cluster:time_to_first_token_seconds", "Time to the first token.", TTFT_BUCKETS)
        self.itl = histogram("cluster:inter_token_latency_seconds", "Time between two outputs carrying tokens.",
                             ITL_BUCKETS)
        self.e2e = histogram("cluster:e2e_request_latency_seconds", "Arrival to the last output.", E2E_BUCKETS)
        self.ttft_parts = {key: histogram(name, doc, TTFT_BUCKETS) for key, (name, doc) in TTFT_PARTS.items()}
        self.finished = Counter("cluster:request_finished", "Samples finished, by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self.prompt_tokens = Counter("cluster:prompt_tokens", "Prompt tokens of accepted requests.", model,
                                     registry=r).labels(model_name=model_name)
        self.generation_tokens = Counter("cluster:generation_tokens", "Generated tokens.", model,
                                         registry=r).labels(model_name=model_name)
        self._http = Counter("cluster:http_requests", "HTTP requests by route and status.",
                             ["model_name", "route", "status"], registry=r)
        self.replicas = ReplicaStatsCollector(model_name)
        r.register(self.replicas)

    def http_request(self, route: str, status: int) -> None:
        self._http.labels(model_name=self.model_name, route=route, status=str(status)).inc()

    def sample_timer(self) -> SampleTimer:
        return SampleTimer(self)

    def render(self, stats: list[ReplicaStats]) -> bytes:
        """Prometheus text with the replica gauges set from ``stats`` (no await in between, so
        concurrent scrapes cannot interleave)."""
        self.replicas.stats = stats
        return generate_latest(self.registry)
