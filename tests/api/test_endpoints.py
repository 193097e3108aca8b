"""/v1/models, /health, /metrics (names, labels, values), /v1/backends, and the server-wide
request timeout."""
from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.api.server import build_openai_app
from cluster.common.errors import EngineDeadError
from tests.api.conftest import SERVED_NAME, ServerThread
from tests.api.fakes import FakeEngineClient, Script

try:
    import httpx
except ImportError:  # openai >= 3 ships its HTTP client as httpx2
    import httpx2 as httpx  # type: ignore[no-redef]


def scrape(http) -> dict[str, list]:
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def value(samples, name: str, **labels) -> float:
    matches = [s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matches) == 1, (name, labels, samples.get(name))
    return matches[0]


def test_models(fake, client):
    [model] = client.models.list().data
    assert model.id == SERVED_NAME and model.object == "model" and model.owned_by == "pd-cluster"
    assert model.model_extra["root"] == fake.model_name and model.model_extra["max_model_len"] == fake.max_model_len


def test_health(fake, http):
    assert http.get("/health").status_code == 200
    fake.health_error = EngineDeadError("decode replica d0 is dead")
    r = http.get("/health")
    assert r.status_code == 503 and r.json()["error"]["message"] == "decode replica d0 is dead"
    fake.health_error = RuntimeError("secret")
    r = http.get("/health")
    assert r.status_code == 503 and "secret" not in r.text


def test_backends(fake, http):
    r = http.get("/v1/backends")
    assert r.status_code == 200 and r.json() == fake.backend_list


def test_metrics_names_and_labels(fake, client, http):
    before = scrape(http)
    fake.script = lambda request: Script(timings={"prefill_queue": 0.01, "prefill_compute": 0.02,
                                                  "transfer": 0.003, "first_decode": 0.004})
    client.completions.create(model=SERVED_NAME, prompt="hello", max_tokens=4, n=2)
    after = scrape(http)

    def grew(name: str, by: float, **labels) -> None:
        old = value(before, name, **labels) if name in before and any(
            all(s.labels.get(k) == v for k, v in labels.items()) for s in before[name]) else 0.0
        assert value(after, name, **labels) - old == pytest.approx(by), name

    for name in ("time_to_first_token_seconds", "ttft_prefill_queue_seconds", "ttft_prefill_compute_seconds",
                 "ttft_kv_transfer_seconds", "ttft_first_decode_seconds", "e2e_request_latency_seconds"):
        grew(f"cluster:{name}_count", 2)
    grew("cluster:inter_token_latency_seconds_count", 6)  # 3 gaps per 4-token sample
    grew("cluster:ttft_prefill_compute_seconds_sum", 0.04)
    grew("cluster:generation_tokens_total", 8)
    grew("cluster:request_finished_total", 2, finished_reason="length")
    grew("cluster:http_requests_total", 1, route="/v1/completions", status="200")
    assert "cluster:prompt_tokens_total" in after
    assert any(s.labels.get("le") == "+Inf" for s in after["cluster:time_to_first_token_seconds_bucket"])


def test_metrics_replica_gauges(fake, http):
    samples = scrape(http)
    assert value(samples, "cluster:num_requests_running", role="decode", replica="d0") == 3
    assert value(samples, "cluster:num_requests_waiting", role="prefill", replica="p0") == 2
    assert value(samples, "cluster:kv_cache_usage_perc", role="decode", replica="d0") == 0.75
    assert value(samples, "cluster:prefix_cache_hit_rate", role="prefill", replica="p0") == 0.5
    assert value(samples, "cluster:kv_transfer_bytes_total", role="prefill", replica="p0") == 4096
    assert value(samples, "cluster:kv_transfer_failures_total", role="prefill", replica="p0") == 1
    assert value(samples, "cluster:kv_transfer_seconds_sum", role="prefill", replica="p0") == 0.5
    assert value(samples, "cluster:kv_transfer_seconds_count", role="prefill", replica="p0") == 4
    assert value(samples, "cluster:spec_accept_len", role="decode", replica="d0") == 2.5
    assert not any("bad" in name or name == "cluster:label" for name in samples)
    # an extra counted up is exposed as a counter, not a gauge
    assert value(samples, "cluster:remote_prefill_failures_total", role="decode", replica="d0") == 3
    text = http.get("/metrics").text
    assert "# TYPE cluster:remote_prefill_failures_total counter" in text and "# TYPE cluster:spec_accept_len gauge" in text


def test_metrics_survive_a_failing_replica_stats(fake, http, monkeypatch):
    async def broken():
        raise RuntimeError("ray is down")
    monkeypatch.setattr(fake, "replica_stats", broken)
    samples = scrape(http)
    assert "cluster:time_to_first_token_seconds_count" in samples
    assert "cluster:num_requests_running" not in samples


def test_errors_are_counted_by_status(fake, http):
    before = scrape(http)
    http.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    after = scrape(http)
    labels = dict(model_name=SERVED_NAME, route="/v1/completions", status="404")
    old = value(before, "cluster:http_requests_total", **labels) if any(
        s.labels == labels for s in before.get("cluster:http_requests_total", [])) else 0
    assert value(after, "cluster:http_requests_total", **labels) == old + 1


def test_every_metric_names_the_model(fake, client, http):
    """Every sample carries ``model_name`` (the served name), as vLLM's metrics do, and the
    replicas' counters (preemptions, prefills) come through as counters."""
    client.completions.create(model=SERVED_NAME, prompt="hello", max_tokens=2)
    fake.stats[0].extra["num_preemptions_total"] = 2
    try:
        samples = scrape(http)
    finally:
        del fake.stats[0].extra["num_preemptions_total"]
    assert samples and all(s.labels.get("model_name") == SERVED_NAME for group in samples.values() for s in group)
    assert value(samples, "cluster:num_preemptions_total", role="prefill") == 2
    assert "cluster:request_queue_time_seconds_count" in samples


@pytest.mark.parametrize("timeout,expected", [(None, 5.0), (2.0, 2.0), (10.0, 5.0)])
def test_server_request_timeout_caps_the_deadline(tokenizer, timeout, expected):
    fake = FakeEngineClient(tokenizer)
    app = build_openai_app(fake, max_body_bytes=1 << 16, request_timeout_s=5.0, block_size=4)
    with ServerThread(app) as server, httpx.Client(base_url=server.base_url) as http:
        body = {"model": fake.model_name, "prompt": "hello world", "max_tokens": 2, "timeout": timeout}
        assert http.post("/v1/completions", json=body).status_code == 200
    [request] = fake.requests
    assert request.sampling_params.deadline_s == expected
    assert len(request.block_hashes) == len(request.prompt_token_ids) // 4


def test_openapi_documents_the_request_and_response_bodies(http):
    """/openapi.json names the request body of completions and chats (read by hand, so FastAPI
    alone would not) and the responses, every ``$ref`` resolving within the document."""
    doc = http.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]

    def resolve(node):
        return schemas[node["$ref"].rsplit("/", 1)[1]]

    completions = doc["paths"]["/v1/completions"]["post"]
    body = resolve(completions["requestBody"]["content"]["application/json"]["schema"])
    assert {"model", "prompt", "max_tokens", "n", "stream", "logprobs"} <= set(body["properties"])
    assert "prompt" in body.get("required", []) or "prompt" in body["properties"]
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert "messages" in resolve(chat["requestBody"]["content"]["application/json"]["schema"])["properties"]
    assert "choices" in resolve(chat["responses"]["200"]["content"]["application/json"]["schema"])["properties"]
    assert "error" in resolve(completions["responses"]["4XX"]["content"]["application/json"]["schema"])["properties"]
    assert "data" in resolve(doc["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]["schema"])["properties"]
    assert "/v1/models/{model_id}" in doc["paths"]

    def refs(node):
        if isinstance(node, dict):
            if "$ref" in node:
                yield node["$ref"]
            for v in node.values():
                yield from refs(v)
        elif isinstance(node, list):
            for v in node:
                yield from refs(v)
    missing = [r for r in refs(doc) if r.rsplit("/", 1)[1] not in schemas]
    assert not missing, missing
